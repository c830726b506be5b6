"""The Triton paged-attention kernels against attention in float64 over the same pool (on CPU through Triton's
interpreter, which tests/conftest.py turns on where there is no CUDA device)."""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("triton")
from worker.engine.attention import paged_triton as pt  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (query heads, KV heads, head size, block size): a group of 3 (SmolLM2-135M), no grouping, Qwen3-0.6B's shape
# with 64-token blocks, and a head size that is not a power of two
SHAPES = [(9, 3, 64, 16), (4, 4, 32, 8), (16, 8, 128, 64), (6, 2, 80, 16)]


def reference(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, table: list[int], context: int,
              positions: list[int], scale: float) -> torch.Tensor:
    """q [n, heads, d] at `positions` of a sequence with `context` keys in the pool: softmax attention in float64."""
    kv_heads, _, block_size, d = k_cache.shape
    group = q.shape[1] // kv_heads
    blocks = table[:-(-context // block_size)]
    keys = k_cache[:, blocks].reshape(kv_heads, -1, d)[:, :context].double()
    values = v_cache[:, blocks].reshape(kv_heads, -1, d)[:, :context].double()
    out = torch.empty(q.shape, dtype=torch.float64)
    for i, pos in enumerate(positions):
        for h in range(q.shape[1]):
            weights = torch.softmax((keys[h // group, :pos + 1] @ q[i, h].double().cpu()) * scale, 0)
            out[i, h] = weights @ values[h // group, :pos + 1]
    return out


def pool(kv_heads: int, blocks: int, block_size: int, d: int, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    kv = torch.randn(2, kv_heads, blocks, block_size, d, dtype=dtype, device=DEVICE)
    return kv[0], kv[1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,d,block_size", SHAPES)
def test_decode_rows_split_or_not_match_float64(dtype, heads, kv_heads, d, block_size):
    gen = random.Random(heads * d + block_size)
    k_cache, v_cache = pool(kv_heads, 40, block_size, d, dtype)
    rows = 5
    contexts = [gen.randint(1, 12 * block_size) for _ in range(rows)] + [1]   # a row of one key, as padding rows
    tables = torch.stack([torch.randperm(40)[:16] for _ in range(rows + 1)]).int().to(DEVICE)
    q = torch.randn(rows + 1, heads, d, dtype=dtype, device=DEVICE)
    lens = torch.tensor(contexts, dtype=torch.int64, device=DEVICE)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    for splits in (1, 3):
        out = torch.full_like(q, float("nan"))
        pt.decode(q, k_cache, v_cache, tables, lens, d ** -0.5, splits, out=out)
        for r, context in enumerate(contexts):
            want = reference(q[r:r + 1].cpu(), k_cache.cpu(), v_cache.cpu(), tables[r].tolist(), context,
                             [context - 1], d ** -0.5)
            assert (out[r].cpu().double() - want[0]).abs().max() < tolerance, (splits, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,d,block_size", SHAPES)
def test_chunks_with_and_without_a_cached_prefix_match_float64(dtype, heads, kv_heads, d, block_size):
    k_cache, v_cache = pool(kv_heads, 40, block_size, d, dtype)
    # a decode row (one query over 20 keys), a whole prompt, and a chunk of 30 after 20 cached keys, packed
    # with a gap of unrelated rows that must stay untouched
    lengths, contexts, first_rows = [1, 7, 30], [20, 7, 50], [0, 1, 10]
    tables = torch.stack([torch.randperm(40)[:16] for _ in range(3)]).int()
    q = torch.randn(40, heads, d, dtype=dtype, device=DEVICE)   # rows 8 and 9 belong to no chunk
    tile_seq, tile_first = pt.tiles(lengths, heads // kv_heads)
    as_int = lambda values: torch.tensor(values, dtype=torch.int32, device=DEVICE)  # noqa: E731
    plan = pt.ChunkPlan(tables.to(DEVICE), as_int(first_rows), as_int(lengths), as_int(contexts), as_int(tile_seq),
                        as_int(tile_first))
    out = torch.full_like(q, float("nan"))
    pt.chunks(q, k_cache, v_cache, plan, d ** -0.5, out=out)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-3
    for first, n, context, table in zip(first_rows, lengths, contexts, tables.tolist()):
        rows = slice(first, first + n)
        want = reference(q[rows].cpu(), k_cache.cpu(), v_cache.cpu(), table, context,
                         list(range(context - n, context)), d ** -0.5)
        assert (out[rows].cpu().double() - want).abs().max() < tolerance
    assert out[8:10].isnan().all()   # rows no sequence covers


def test_a_plans_parts_start_on_16_byte_boundaries_whatever_their_lengths():
    plan = pt.plan([0, 1, 8], [1, 7, 3], [20, 7, 50], [[3, 1], [2], [5, 6, 7, 8]], 3, torch.device(DEVICE))
    parts = [plan.tables, plan.seq_row, plan.seq_len, plan.seq_ctx, plan.tile_seq, plan.tile_first]
    assert all(t.data_ptr() % 16 == 0 for t in parts)
    assert plan.tables.tolist() == [[3, 1, 0, 0], [2, 0, 0, 0], [5, 6, 7, 8]]
    assert plan.seq_ctx.tolist() == [20, 7, 50] and plan.tile_seq.tolist() == [0, 1, 2]


def test_warm_up_writes_only_the_scratch_block():
    k_cache, v_cache = pool(2, 6, 16, 32, torch.float32)
    before = k_cache.clone()
    pt.warm_up(k_cache, v_cache, 4, 5)
    assert torch.equal(k_cache[:, :5], before[:, :5])


def test_tiles_cover_each_chunk_in_runs_of_the_tile_queries():
    seqs, firsts = pt.tiles([1, 70, 32], group=2, tuning=pt.Tuning(chunk_block_m=64))
    assert list(zip(seqs, firsts)) == [(0, 0), (1, 0), (1, 32), (1, 64), (2, 0)]


def test_store_kv_writes_each_token_to_its_slot_only():
    k_cache, v_cache = (torch.zeros(3, 10, 16, 64, device=DEVICE) for _ in range(2))
    k, v = torch.randn(5, 3, 64, device=DEVICE), torch.randn(5, 3, 64, device=DEVICE)
    slots = torch.tensor([0, 17, 33, 159, 100], device=DEVICE)
    pt.store_kv(k, v, k_cache, v_cache, slots)
    for i, slot in enumerate(slots.tolist()):
        assert torch.equal(k_cache[:, slot // 16, slot % 16], k[i]) and torch.equal(v_cache[:, slot // 16, slot % 16], v[i])
    assert int((k_cache != 0).any(-1).sum()) == 5 * 3


def test_splits_fill_the_gpu_and_stay_bounded():
    if DEVICE == "cpu":
        assert pt.splits_for(1, 1, torch.device("cpu")) == 2 and pt.splits_for(16, 8, torch.device("cpu")) == 1
        return
    device = torch.device(DEVICE)
    assert pt.splits_for(256, 8, device) == 1
    assert 1 < pt.splits_for(1, 1, device) <= pt.MAX_SPLITS
