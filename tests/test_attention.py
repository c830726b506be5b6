"""The attention backends against each other and plain causal attention, on random pools and tables."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F

from worker.engine import attention, cpu_kernel, flex
from worker.engine.attention import Span
from worker.engine.device import buckets

needs_kernel = pytest.mark.skipif(cpu_kernel.load() is None, reason="no C compiler for the paged-attention kernel")


class Layer(torch.nn.Module):
    layer_idx = 1


def random_step(heads: int, kv_heads: int, head_dim: int, block_size: int, seed: int):
    """A step of decodes and prefill chunks (some with a cached prefix) over shuffled blocks."""
    gen = random.Random(seed)
    num_blocks = 512
    free = list(range(num_blocks))
    gen.shuffle(free)
    # (tokens already cached, new rows): decodes first, then chunks with and without a prefix.
    shapes = [(gen.randint(1, 60), 1) for _ in range(5)] + [(0, 23), (17, 9), (32, 1), (5, 40)]
    spans, slots, row = [], [], 0
    history = []   # every sequence's full K/V, to check against dense attention
    for cached, n in shapes:
        context = cached + n
        table = [free.pop() for _ in range(-(-context // block_size))]
        spans.append(Span(row, n, context, table))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(cached, context)]
        row += n
        history.append((torch.randn(kv_heads, context, head_dim), torch.randn(kv_heads, context, head_dim)))
    kv = torch.zeros(2, 2, kv_heads, num_blocks, block_size, head_dim)
    for span, (k, v) in zip(spans, history):   # the cached prefix is already in the pool
        for p in range(span.context - span.length):
            b, o = span.table[p // block_size], p % block_size
            kv[0, 1, :, b, o], kv[1, 1, :, b, o] = k[:, p], v[:, p]
    new_k = torch.cat([k[:, s.context - s.length:] for s, (k, _) in zip(spans, history)], dim=1)
    new_v = torch.cat([v[:, s.context - s.length:] for s, (_, v) in zip(spans, history)], dim=1)
    q = torch.randn(row, heads, head_dim).transpose(0, 1)     # [heads, T, d] as a strided view, like the models'
    return kv, spans, slots, q, new_k, new_v, history


def dense_reference(q, spans, history, heads, kv_heads):
    out = torch.empty(q.shape[1], heads, q.shape[2])
    for s, (k, v) in zip(spans, history):
        qs = q[:, s.start:s.start + s.length]
        first = s.context - s.length
        mask = torch.arange(s.context)[None, :] <= torch.arange(first, s.context)[:, None]
        o = F.scaled_dot_product_attention(qs[None], k[None], v[None], attn_mask=mask,
                                           enable_gqa=heads != kv_heads)[0]
        out[s.start:s.start + s.length] = o.transpose(0, 1)
    return out


@pytest.mark.parametrize("backend", [pytest.param("kernel", marks=needs_kernel), "gather", "flex"])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size", [(4, 2, 16, 4), (9, 3, 64, 16), (6, 6, 8, 1)])
def test_backend_writes_the_pool_and_matches_dense_attention(backend, heads, kv_heads, head_dim, block_size):
    kv, spans, slots, q, k, v, history = random_step(heads, kv_heads, head_dim, block_size, seed=heads)
    if backend == "flex":
        flex.start_engine()   # as each engine does: this test's shapes are new constants
    width = max(len(s.table) for s in spans)
    paged = flex.PagedTables(8, width, kv.shape[3], block_size, heads // kv_heads, scratch_block=0, device=kv.device)
    ctx = attention.build_context(backend, kv, slots, spans, num_decodes=5, block_size=block_size, paged=paged)
    attention.set_context(ctx)
    try:
        out, _ = attention.paged_attention(Layer(), q[None], k[None], v[None], None)
    finally:
        attention.set_context(None)
    torch.testing.assert_close(out[0], dense_reference(q, spans, history, heads, kv_heads), atol=1e-5, rtol=1e-4)
    # Every new row landed in its slot of layer 1, and nothing was written to layer 0.
    flat_k = kv[0, 1].reshape(kv_heads, -1, head_dim)
    torch.testing.assert_close(flat_k[:, slots], k)
    assert not kv[:, 0].any()


def test_backend_choice_follows_the_config_then_the_device():
    cpu = torch.device("cpu")
    assert attention.choose_backend("gather", cpu, torch.float32) == "gather"
    assert attention.choose_backend(None, cpu, torch.bfloat16) == "gather"
    expected = "kernel" if cpu_kernel.load() is not None else "gather"
    assert attention.choose_backend(None, cpu, torch.float32) == expected
    with pytest.raises(ValueError, match="float32 on CPU only"):
        attention.choose_backend("kernel", cpu, torch.bfloat16)
    with pytest.raises(ValueError, match="Unknown attention backend"):
        attention.choose_backend("flash", cpu, torch.float32)


def test_without_a_compiler_the_gather_backend_runs(monkeypatch, tmp_path):
    monkeypatch.setenv("MODEL_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_kernel, "_compiler", lambda: None)
    cpu_kernel.load.cache_clear()
    try:
        assert cpu_kernel.load() is None
        assert attention.choose_backend(None, torch.device("cpu"), torch.float32) == "gather"
    finally:
        cpu_kernel.load.cache_clear()


def test_decode_buckets_grow_by_eight_past_sixteen_and_end_at_the_slot_count():
    assert buckets(1) == [1]
    assert buckets(4) == [1, 2, 4]
    assert buckets(16) == [1, 2, 4, 8, 16]
    assert buckets(48) == [1, 2, 4, 8, 16, 24, 32, 40, 48]
    assert buckets(50) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 50]
    assert buckets(6) == [1, 2, 4, 6]


def test_flex_decode_reads_the_pool_in_place_through_tables_rewritten_between_calls():
    """The static-buffer decode path: one BlockMask over int32 buffers, refilled for each step as a graph
    replay would see them, with stale ids left in the columns a row does not use."""
    heads, kv_heads, head_dim, block_size, rows = 9, 3, 64, 16, 5
    kv, *_ = random_step(heads, kv_heads, head_dim, block_size, seed=0)
    flex.start_engine()
    pool_blocks = kv.shape[3]
    width = 8   # a row holds far fewer blocks than the pool (512)
    tables = torch.randint(0, pool_blocks, (rows, width), dtype=torch.int32)   # stale ids everywhere
    last = torch.randint(0, pool_blocks, (rows, 1), dtype=torch.int32)
    full_num = torch.zeros(rows, dtype=torch.int32)
    limit = torch.ones(rows, dtype=torch.int32)
    mask = flex.paged_block_mask(tables, full_num, last, limit, block_size, pool_blocks, heads // kv_heads)
    for seed in (1, 2):
        step_kv, spans, slots, q, k, v, history = random_step(heads, kv_heads, head_dim, block_size, seed=seed)
        kv.copy_(step_kv)
        decodes = spans[:rows]
        for i, s in enumerate(decodes):   # the decode rows' new K/V are in the pool already
            for p in range(s.context - 1, s.context):
                b, o = s.table[p // block_size], p % block_size
                kv[0, 1, :, b, o], kv[1, 1, :, b, o] = history[i][0][:, p], history[i][1][:, p]
            full = (s.context - 1) // block_size
            tables[i, :full] = torch.tensor(s.table[:full], dtype=torch.int32)
            full_num[i], last[i, 0] = full, s.table[full]
            limit[i] = s.table[full] * block_size + s.context - full * block_size
        out = flex.decode(q[:, :rows], kv[0, 1], kv[1, 1], mask, None)
        want = dense_reference(q, decodes, history[:rows], heads, kv_heads)[:rows].transpose(0, 1)
        torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-4)


def test_flex_decode_buffers_grow_with_the_longest_context_not_with_the_pool():
    """A GPU pool holds hundreds of thousands of blocks; 256 decode rows' tables must not be that wide."""
    rows, width, pool_blocks = 256, 512, 200_000
    paged = flex.PagedTables(rows, width, pool_blocks, 16, 3, scratch_block=pool_blocks - 1,
                             device=torch.device("cpu"))
    assert paged.logical is None   # the prefill map is made only when the flex backend prefills
    assert paged.nbytes < 2 * rows * width * 4 + 64 * rows
    mask = paged.mask(rows)
    assert mask.kv_indices.shape[-1] == pool_blocks   # the CPU kernel's view spans the pool ...
    assert mask.kv_indices.stride(-1) == 0            # ... without allocating it


def test_on_a_gpu_both_decode_block_lists_share_one_layout():
    """The GPU kernels read the full-block list through the partial list's strides and width."""
    paged = flex.PagedTables(256, 512, 200_000, 16, 3, scratch_block=0, device=torch.device("meta"))
    assert paged.nbytes < 3 * 256 * 512 * 4 + 64 * 256
    for rows in (1, 24, 256):
        mask = paged.mask(rows)
        assert mask.kv_indices.shape == mask.full_kv_indices.shape == (rows, 1, 1, 512)
        assert mask.kv_indices.stride() == mask.full_kv_indices.stride()
        # The main kernel offsets every list as a contiguous [batch, heads, rows, columns] tensor.
        for t in (mask.kv_indices, mask.full_kv_indices, mask.kv_num_blocks, mask.full_kv_num_blocks):
            assert t.is_contiguous()


@pytest.mark.parametrize("block_size", [16, 32, 48, 64, 128, 272])
def test_the_gpu_kernel_tile_divides_every_block_size_flex_takes(block_size):
    """The main Triton kernel raises when its KV tile does not divide the KV block size."""
    assert flex.fits(torch.device("cuda"), block_size)
    tile = flex.gpu_kernel_options(block_size)["BLOCK_N"]
    assert block_size % tile == 0 and 16 <= tile <= 64
