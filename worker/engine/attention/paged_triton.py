"""Paged attention in Triton: the step's K/V written into the pool, decode rows split over the context, chunks tiled.

Three kernels read and write the pool in place, through each sequence's block table and the pool's own
strides (any block size; a tile of keys may span several blocks):

- `store_kv`: one program per token writes its K and V rows of every KV head into their slots.
- `decode`: one query per row. A program takes (row, KV head, split): the KV head's query heads are the rows
  of its tile (grouped-query attention reads each key once), and the row's context is cut into `splits`
  ranges so that few rows still fill the GPU. With more than one split each program leaves its unnormalised
  output, maximum and sum, and `combine` merges them (the usual split-KV reduction).
- `chunks`: prefill chunks (and decode rows, as one-query chunks) of an eager step. A program takes one tile
  of a chunk's queries for one KV head: BLOCK_M rows, each a (query, head of the group) pair, against the
  sequence's keys up to the tile's last position, causal on the chunk's own keys.

Softmax runs in base 2 (scores scaled by log2(e)), accumulation in float32. Everything here also runs on CPU
tensors under TRITON_INTERPRET=1 (set before anything imports Triton, as tests/conftest.py does), which is how
the tests check it without a GPU.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
MAX_SPLITS = 32


@dataclass(frozen=True)
class Tuning:
    """Tile sizes and launch settings; the defaults are the ones measured best (docs/BENCHMARKS.md, "GPU")."""

    decode_block_n: int = 64
    decode_warps: int = 4
    decode_stages: int = 2
    chunk_block_m: int = 64
    chunk_block_n: int = 64
    chunk_warps: int = 4
    chunk_stages: int = 2
    programs_per_sm: int = 1    # decode: context splits only while (rows x KV heads) programs leave multiprocessors idle


TUNING = Tuning()


def _pow2(n: int, least: int = 1) -> int:
    return max(least, 1 << (max(n, 1) - 1).bit_length())


@triton.jit
def _store_kv(k_ptr, v_ptr, k_cache, v_cache, slots_ptr,
              stride_kt, stride_kh, stride_vt, stride_vh, stride_ch, stride_cb, stride_ct,
              KV_HEADS: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
              BLOCK_SIZE: tl.constexpr):
    t = tl.program_id(0)
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    m = (h[:, None] < KV_HEADS) & (d[None, :] < D)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    dst = h[:, None] * stride_ch + (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_ct + d[None, :]
    key = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=m)
    value = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=m)
    tl.store(k_cache + dst, key, mask=m)
    tl.store(v_cache + dst, value, mask=m)


@triton.jit
def _decode(q_ptr, k_cache, v_cache, tables_ptr, lens_ptr, out_ptr, part_acc, part_ml,
            stride_qr, stride_qh, stride_ch, stride_cb, stride_ct, stride_tr, stride_or, stride_oh, qk_scale,
            HEADS: tl.constexpr, GROUP: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
            BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.program_id(2)
    context = tl.load(lens_ptr + r)
    per_split = ((context + SPLITS - 1) // SPLITS + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = s * per_split
    end = tl.minimum(context, start + per_split)

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    head = h * GROUP + g
    gd = (g[:, None] < GROUP) & (d[None, :] < D)
    q = tl.load(q_ptr + r * stride_qr + head[:, None] * stride_qh + d[None, :], mask=gd, other=0.0)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    table = tables_ptr + r.to(tl.int64) * stride_tr
    k_head = k_cache + h.to(tl.int64) * stride_ch
    v_head = v_cache + h.to(tl.int64) * stride_ch
    for first in range(start, end, BLOCK_N):
        keys = first + tl.arange(0, BLOCK_N)
        live = keys < end
        block = tl.load(table + keys // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
        where = block * stride_cb + (keys % BLOCK_SIZE) * stride_ct
        kd = live[:, None] & (d[None, :] < D)
        k = tl.load(k_head + where[:, None] + d[None, :], mask=kd, other=0.0)
        scores = tl.dot(q, tl.trans(k)) * qk_scale
        scores = tl.where(live[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        p = tl.exp2(scores - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + where[:, None] + d[None, :], mask=kd, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    if SPLITS == 1:
        out = acc / l_i[:, None]
        tl.store(out_ptr + r * stride_or + head[:, None] * stride_oh + d[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=gd)
    else:
        # [rows, heads, splits, D] and [rows, heads, splits, 2] (maximum, sum); an empty split leaves -inf, 0.
        row = (r.to(tl.int64) * HEADS + head) * SPLITS + s
        tl.store(part_acc + row[:, None] * D_PAD + d[None, :], acc, mask=g[:, None] < GROUP)
        tl.store(part_ml + row * 2, m_i, mask=g < GROUP)
        tl.store(part_ml + row * 2 + 1, l_i, mask=g < GROUP)


@triton.jit
def _combine(part_acc, part_ml, out_ptr, stride_or, stride_oh,
             HEADS: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, SPLITS: tl.constexpr,
             S_PAD: tl.constexpr):
    r = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D_PAD)
    row = (r.to(tl.int64) * HEADS + h) * SPLITS + s
    live = s < SPLITS
    m = tl.load(part_ml + row * 2, mask=live, other=float("-inf"))
    l = tl.load(part_ml + row * 2 + 1, mask=live, other=0.0)
    top = tl.max(m, 0)
    w = tl.where(m > float("-inf"), tl.exp2(m - top), 0.0)
    acc = tl.load(part_acc + row[:, None] * D_PAD + d[None, :], mask=live[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + r * stride_or + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < D)


@triton.jit(do_not_specialize=["stride_tr"])   # the step's table width varies: one compiled variant for all
def _chunks(q_ptr, k_cache, v_cache, tables_ptr, out_ptr, tile_seq_ptr, tile_first_ptr,
            seq_row_ptr, seq_len_ptr, seq_ctx_ptr,
            stride_qr, stride_qh, stride_ch, stride_cb, stride_ct, stride_tr, stride_or, stride_oh, qk_scale,
            GROUP: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    t = tl.program_id(0)
    h = tl.program_id(1)
    seq = tl.load(tile_seq_ptr + t)
    first_query = tl.load(tile_first_ptr + t)       # the tile's first query, counted within its chunk
    row0 = tl.load(seq_row_ptr + seq)               # the chunk's first row in the packed step
    length = tl.load(seq_len_ptr + seq)
    context = tl.load(seq_ctx_ptr + seq)            # keys in the pool once this chunk is written
    QUERIES: tl.constexpr = BLOCK_M // GROUP

    i = tl.arange(0, BLOCK_M)
    d = tl.arange(0, D_PAD)
    query = first_query + i // GROUP
    head = h * GROUP + i % GROUP
    valid = (i < QUERIES * GROUP) & (query < length)
    position = context - length + query             # each row's own position: it sees keys up to it
    qd = valid[:, None] & (d[None, :] < D)
    rows = (row0 + query).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_qr + head[:, None] * stride_qh + d[None, :], mask=qd, other=0.0)

    end = context - length + tl.minimum(first_query + QUERIES, length)   # past the tile's last position
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    table = tables_ptr + seq.to(tl.int64) * stride_tr
    k_head = k_cache + h.to(tl.int64) * stride_ch
    v_head = v_cache + h.to(tl.int64) * stride_ch
    for first in range(0, end, BLOCK_N):
        keys = first + tl.arange(0, BLOCK_N)
        live = keys < end
        block = tl.load(table + keys // BLOCK_SIZE, mask=live, other=0).to(tl.int64)
        where = block * stride_cb + (keys % BLOCK_SIZE) * stride_ct
        kd = live[:, None] & (d[None, :] < D)
        k = tl.load(k_head + where[:, None] + d[None, :], mask=kd, other=0.0)
        scores = tl.dot(q, tl.trans(k)) * qk_scale
        seen = live[None, :] & (keys[None, :] <= position[:, None])
        scores = tl.where(seen, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_safe = tl.where(m_new > float("-inf"), m_new, 0.0)   # a row that sees nothing yet (padding rows)
        p = tl.exp2(scores - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_head + where[:, None] + d[None, :], mask=kd, other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_or + head[:, None] * stride_oh + d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=qd)


# ---- launchers ------------------------------------------------------------------------------------------------

def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slots: torch.Tensor) -> None:
    """k, v [tokens, kv_heads, d] into the layer's pool [kv_heads, blocks, block_size, d] at `slots`
    (block * block_size + offset, one per token)."""
    tokens, kv_heads, d = k.shape
    if tokens == 0:
        return
    _check_pool(k_cache, v_cache)
    _store_kv[(tokens,)](k, v, k_cache, v_cache, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
                         k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), KV_HEADS=kv_heads,
                         H_PAD=_pow2(kv_heads), D=d, D_PAD=_pow2(d, 16), BLOCK_SIZE=k_cache.shape[2])


def _check_pool(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    if k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
        raise ValueError("the K and V pools must share one layout with contiguous head dimensions")


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def splits_for(rows: int, kv_heads: int, device: torch.device, tuning: Tuning = TUNING) -> int:
    """Context splits for a decode launch: only while one program per (row, KV head) leaves multiprocessors idle
    (a split's partial results and their merge cost more than they save once the GPU is full)."""
    if device.type != "cuda":
        return 1 if rows * kv_heads >= 8 else 2   # the interpreter: exercise both forms, cheaply
    want = _multiprocessors(device) * tuning.programs_per_sm // max(1, rows * kv_heads)
    return max(1, min(MAX_SPLITS, want))


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, tables: torch.Tensor,
           lens: torch.Tensor, scale: float, splits: int, out: torch.Tensor | None = None,
           tuning: Tuning = TUNING) -> torch.Tensor:
    """q [rows, heads, d] -> [rows, heads, d]: each row attends over its first lens[row] keys, found through
    tables[row] (int32 block ids). Shapes and `splits` fixed, it is one or two launches, capturable in a graph."""
    rows, heads, d = q.shape
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    _check_pool(k_cache, v_cache)
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q) if out is None else out
    if rows == 0:
        return out
    d_pad = _pow2(d, 16)
    if splits > 1:
        part_acc = torch.empty(rows, heads, splits, d_pad, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(rows, heads, splits, 2, dtype=torch.float32, device=q.device)
    else:
        part_acc = part_ml = out   # unused
    _decode[(rows, kv_heads, splits)](
        q, k_cache, v_cache, tables, lens, out, part_acc, part_ml,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), tables.stride(0),
        out.stride(0), out.stride(1), scale * LOG2E,
        HEADS=heads, GROUP=group, G_PAD=_pow2(group, 16), D=d, D_PAD=d_pad, BLOCK_SIZE=k_cache.shape[2],
        BLOCK_N=tuning.decode_block_n, SPLITS=splits, num_warps=tuning.decode_warps, num_stages=tuning.decode_stages)
    if splits > 1:
        _combine[(rows, heads)](part_acc, part_ml, out, out.stride(0), out.stride(1), HEADS=heads, D=d,
                                D_PAD=d_pad, SPLITS=splits, S_PAD=_pow2(splits))
    return out


@dataclass
class ChunkPlan:
    """An eager step's sequences for `chunks`, as device tensors: per sequence its first row, rows and context
    (keys once the step is written), per tile its sequence and first query."""

    tables: torch.Tensor      # int32 [seqs, width]
    seq_row: torch.Tensor     # int32 [seqs]
    seq_len: torch.Tensor     # int32 [seqs]
    seq_ctx: torch.Tensor     # int32 [seqs]
    tile_seq: torch.Tensor    # int32 [tiles]
    tile_first: torch.Tensor  # int32 [tiles]

    def parts(self) -> tuple[torch.Tensor, ...]:
        return self.tables, self.seq_row, self.seq_len, self.seq_ctx, self.tile_seq, self.tile_first


# Each part of a plan starts on a 16-byte boundary: Triton compiles a kernel apart for a pointer that is not (a
# compilation of seconds in the middle of serving, for whichever step first packs its parts otherwise).
ALIGN = 4


def plan(rows: list[int], lengths: list[int], contexts: list[int], tables: list[list[int]], group: int,
         device: torch.device, tuning: Tuning = TUNING, least: int = 1) -> ChunkPlan:
    """The plan of an eager step's sequences (first row, rows and context each; tables padded to one width),
    uploaded in one int32 copy. least: at least this many sequences, tiles and table columns (padding sequences
    have no rows): a compiled step then never sees a size of one, which the compiler would specialise."""
    from ..transfer import upload

    width = max(least, max(map(len, tables)))
    tile_seq, tile_first = tiles(lengths, group, tuning)
    pad = max(0, least - len(rows))
    rows, lengths, contexts, tables = rows + [0] * pad, lengths + [0] * pad, contexts + [0] * pad, tables + [[]] * pad
    tile_seq += [len(rows) - 1] * max(0, least - len(tile_seq))
    tile_first += [0] * (len(tile_seq) - len(tile_first))
    parts = [[b for t in tables for b in t + [0] * (width - len(t))], rows, lengths, contexts, tile_seq, tile_first]
    flat, starts = [], []
    for part in parts:
        starts.append(len(flat))
        flat += part
        flat += [0] * (-len(flat) % ALIGN)
    data = upload(flat, torch.int32, device)
    views = [data[a:a + len(part)] for a, part in zip(starts, parts)]
    return ChunkPlan(views[0].view(len(tables), width), *views[1:])


def warm_up(k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int, scratch_block: int) -> None:
    """Compile the eager step's kernels before serving (each is seconds of compilation the first time): one query
    over one key of the scratch block, written there."""
    kv_heads, _, block_size, d = k_cache.shape
    device = k_cache.device
    k = torch.zeros(1, kv_heads, d, dtype=k_cache.dtype, device=device)
    store_kv(k, k, k_cache, v_cache, torch.tensor([scratch_block * block_size], device=device))
    q = torch.zeros(1, heads, d, dtype=k_cache.dtype, device=device)
    chunks(q, k_cache, v_cache, plan([0], [1], [1], [[scratch_block]], heads // kv_heads, device), 1.0)


def tiles(lengths: list[int], group: int, tuning: Tuning = TUNING) -> tuple[list[int], list[int]]:
    """(sequence, first query) of each tile: BLOCK_M // group queries a tile."""
    per = max(1, tuning.chunk_block_m // group)
    seqs, firsts = [], []
    for i, n in enumerate(lengths):
        for first in range(0, n, per):
            seqs.append(i)
            firsts.append(first)
    return seqs, firsts


def chunks(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: ChunkPlan, scale: float,
           out: torch.Tensor | None = None, tuning: Tuning = TUNING) -> torch.Tensor:
    """q [rows, heads, d] -> [rows, heads, d] for the rows the plan's sequences cover (others untouched)."""
    rows, heads, d = q.shape
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    if tuning.chunk_block_m < group:
        raise ValueError(f"chunk_block_m {tuning.chunk_block_m} is below the query group {group}")
    _check_pool(k_cache, v_cache)
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty_like(q) if out is None else out
    n_tiles = plan.tile_seq.shape[0]
    if n_tiles == 0:
        return out
    _chunks[(n_tiles, kv_heads)](
        q, k_cache, v_cache, plan.tables, out, plan.tile_seq, plan.tile_first, plan.seq_row, plan.seq_len,
        plan.seq_ctx, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        plan.tables.stride(0), out.stride(0), out.stride(1), scale * LOG2E,
        GROUP=group, D=d, D_PAD=_pow2(d, 16), BLOCK_SIZE=k_cache.shape[2], BLOCK_M=tuning.chunk_block_m,
        BLOCK_N=tuning.chunk_block_n, num_warps=tuning.chunk_warps, num_stages=tuning.chunk_stages)
    return out


def default_scale(d: int, scaling: float | None) -> float:
    return 1.0 / math.sqrt(d) if scaling is None else float(scaling)
