"""Paged attention in place through compiled FlexAttention: block masks built from block tables.

Keys and values are a layer's pool viewed as one long sequence [1, kv_heads, blocks * block_size, d]
(batch 1, broadcast over query rows); a BlockMask lists, per tile of queries, the pool blocks they read,
so no context is gathered. The query heads that share a KV head become query positions, so grouped-query
attention needs no repeat and no power-of-two group. Two forms:

- decode rows: each row is a batch entry with its own block list (FlexAttention's decoding kernel),
  from int32 buffers that `PagedTables` keeps on the device, so the same BlockMask serves every step
  and every CUDA-graph replay once the buffers are refilled;
- prefill chunks: all chunks of a step are one query sequence; each tile of 128 queries lists the union
  of its rows' blocks, and `mask_mod` keeps a key when its block belongs to the row's sequence (through a
  physical-to-logical block map) at a position not past the row's.

The decode form's `mask_mod` only describes a row's last block: the compiled kernel applies it there
and nowhere else, but FlexAttention's eager fallback applies `mask_mod` alone over every key of the
pool. `attend` therefore refuses to run eagerly: a recompile past dynamo's limit raises instead.
"""

from __future__ import annotations

import functools
from itertools import chain

import numpy as np
import torch

from .transfer import Staging, upload

Q_TILE = 128          # queries per BlockMask row tile in the prefill form
GPU_MIN_BLOCK = 16    # Triton's matrix tiles are at least 16 wide: a KV block is one tile or more
_compiled = None


def fits(device: torch.device, block_size: int) -> bool:
    """Whether the kernel compiles for this KV block size on this device."""
    return device.type == "cpu" or block_size % GPU_MIN_BLOCK == 0


_engine_key: tuple | None = None


def start_engine(*key) -> None:
    """Drop the kernels compiled for an earlier engine in this process unless it had the same `key`
    (pool shape, block size, query group, dtype, device). Its constants would otherwise turn symbolic in
    the new engine's kernels, which the CPU code generator of torch 2.13 does not compile. The worker
    runs one engine per process; benchmarks and tests run several, one after another."""
    global _engine_key
    if not key or key != _engine_key:
        torch._dynamo.reset()
    _engine_key = key or None


def _flex():
    global _compiled
    if _compiled is None:
        from torch.nn.attention.flex_attention import flex_attention

        _compiled = torch.compile(flex_attention, fullgraph=True)
    return _compiled


def _block_mask(kv_num, kv_indices, full_num, full_indices, block_size: int, mask_mod, seq_lengths):
    from torch.nn.attention.flex_attention import BlockMask

    kwargs = dict(BLOCK_SIZE=(Q_TILE, block_size), mask_mod=mask_mod, seq_lengths=seq_lengths)
    try:
        return BlockMask.from_kv_blocks(kv_num, kv_indices, full_num, full_indices, compute_q_blocks=False, **kwargs)
    except TypeError:   # torch without compute_q_blocks: the transposed lists are computed, and unused
        return BlockMask.from_kv_blocks(kv_num, kv_indices, full_num, full_indices, **kwargs)


def paged_block_mask(tables: torch.Tensor, full_num: torch.Tensor, last: torch.Tensor, limit: torch.Tensor,
                     block_size: int, pool_blocks: int, group: int):
    """BlockMask for decode rows, from int32 buffers of their block tables, over a pool of `pool_blocks`.

    tables [rows, width]: each row's block ids, the first full_num[row] of them full blocks; last [rows, 1] or
    [rows, width]: the row's last block id in column 0; limit [rows]: its first key past the end, as a
    position in the pool."""
    rows = tables.shape[0]
    if last.shape[-1] == 1:   # CPU: a stride-0 view as wide as the pool (see PagedTables)
        last = last.expand(rows, pool_blocks)

    def mask_mod(b, h, q_idx, kv_idx):
        end = limit[b]
        return (kv_idx // block_size != (end - 1) // block_size) | (kv_idx < end)

    ones = torch.ones(rows, 1, 1, dtype=torch.int32, device=tables.device)
    return _block_mask(ones, last[:, None, None], full_num[:, None, None], tables[:, None, None], block_size,
                       mask_mod, (group, pool_blocks * block_size))


class PagedTables:
    """Device buffers for one step's block tables: up to `rows` decode rows (their BlockMasks cached by row
    count, so a CUDA graph replays them after a refill) and the prefill chunks' block maps.

    width: the most blocks one sequence holds (its longest context). The decode buffers grow with
    rows x width, not with the pool, so a large GPU pool does not multiply them."""

    def __init__(self, rows: int, width: int, pool_blocks: int, block_size: int, group: int, scratch_block: int,
                 device: torch.device) -> None:
        self.block_size, self.group, self.scratch_block = block_size, group, scratch_block
        self.width, self.pool_blocks = width, pool_blocks
        self.tables = torch.full((rows, width), scratch_block, dtype=torch.int32, device=device)
        # A row's one partial block, in column 0. The kernels disagree on the list's layout: the CPU kernel
        # wants it to span the pool (so it gets a stride-0 view of one column) and reads each list through
        # its own strides; the GPU kernels read the full-block list through the partial list's strides, so
        # there the two share one shape and layout.
        last_width = 1 if device.type == "cpu" else width
        self.last = torch.full((rows, last_width), scratch_block, dtype=torch.int32, device=device)
        self.counts = torch.zeros(3, rows, dtype=torch.int32, device=device)   # full blocks, last block, limit
        self.counts[1].fill_(scratch_block)
        self.counts[2].fill_(scratch_block * block_size + 1)
        pin = device.type == "cuda"
        self.host_counts = torch.zeros(3, rows, dtype=torch.int32, pin_memory=pin)
        self.host_tables = torch.zeros(rows * width, dtype=torch.int32, pin_memory=pin)
        self.staging = Staging(device)
        self.logical: torch.Tensor | None = None   # prefill chunks' block maps, made on first use
        self._masks: dict[int, object] = {}

    @property
    def nbytes(self) -> int:
        buffers = (self.tables, self.last, self.counts, self.host_counts, self.host_tables, self.logical)
        return sum(t.numel() * t.element_size() for t in buffers if t is not None)

    def mask(self, rows: int):
        if rows not in self._masks:
            self._masks[rows] = paged_block_mask(self.tables[:rows], self.counts[0, :rows], self.last[:rows],
                                                 self.counts[2, :rows], self.block_size, self.pool_blocks,
                                                 self.group)
        return self._masks[rows]

    def fill(self, tables: list[list[int]], contexts: list[int], rows: int) -> None:
        """Write the rows' tables (padded to `rows` with one key of the scratch block); copies are non-blocking."""
        bs, scratch, pad = self.block_size, self.scratch_block, rows - len(tables)
        full = [(c - 1) // bs for c in contexts]
        last = [t[f] for t, f in zip(tables, full)]
        limit = [blk * bs + c - f * bs for blk, c, f in zip(last, contexts, full)]
        self.staging.wait()
        host = self.host_counts[:, :rows]
        host.copy_(torch.tensor([full + [0] * pad, last + [scratch] * pad, limit + [scratch * bs + 1] * pad],
                                dtype=torch.int32))
        self.counts[:, :rows].copy_(host, non_blocking=True)
        self.last[:rows, 0].copy_(self.counts[1, :rows])
        w = max(full)
        if w:   # only the full blocks' ids are uploaded; columns past a row's count are never read
            counts = np.asarray(full + [0] * pad)
            ids = np.fromiter(chain.from_iterable(t[:f] for t, f in zip(tables, full)), dtype=np.int32,
                              count=int(counts.sum()))
            staged = self.host_tables[:rows * w].view(rows, w)
            array = staged.numpy()
            array.fill(scratch)
            array[np.arange(w)[None, :] < counts[:, None]] = ids   # row-major: each row's ids in order
            self.tables[:rows, :w].copy_(staged, non_blocking=True)
        self.staging.record()

    def prefill_mask(self, spans):
        """BlockMask for prefill chunks packed as one query sequence (`group` queries per row); spans are
        attention.Span-like (start relative to the first prefill row, length, context, table)."""
        device, bs, group = self.tables.device, self.block_size, self.group
        queries = sum(s.length for s in spans) * group
        tiles = -(-queries // Q_TILE)
        lists: list[set[int]] = [set() for _ in range(tiles)]
        row_seq, row_pos, seq_ids, blocks, positions = [], [], [], [], []
        for i, s in enumerate(spans):
            first = s.context - s.length
            row_seq += [i] * s.length
            row_pos += range(first, s.context)
            for tile in range(s.start * group // Q_TILE, ((s.start + s.length) * group - 1) // Q_TILE + 1):
                last_row = min(s.start + s.length, -(-(tile + 1) * Q_TILE // group)) - 1
                lists[tile].update(s.table[:(first + last_row - s.start) // bs + 1])
            used = s.table[:-(-s.context // bs)]
            seq_ids += [i] * len(used)
            blocks += used
            positions += range(len(used))
        # FlexAttention wants block lists as wide as the pool: allocated on the device, only the used
        # columns filled from the host.
        width = max(map(len, lists))
        indices = torch.zeros(tiles, self.pool_blocks, dtype=torch.int32, device=device)
        indices[:, :width] = upload([sorted(b) + [0] * (width - len(b)) for b in lists], torch.int32, device)
        counts = upload([len(b) for b in lists], torch.int32, device)
        # Each chunk's physical-to-logical block map: [rows, pool blocks], made on first use (only this
        # backend's prefill needs it). Its shape never varies: torch 2.13's CPU code generator does not
        # compile a mask that reads a buffer of varying shape, nor (same error) one that looks up a block's
        # position and then the row's table with it, which would need [rows, width] only.
        if self.logical is None:
            self.logical = torch.full((self.tables.shape[0], self.pool_blocks), -1, dtype=torch.int32, device=device)
        logical = self.logical
        logical[:len(spans)].fill_(-1)
        index = upload([seq_ids, blocks], torch.long, device)
        logical.index_put_((index[0], index[1]), upload(positions, torch.int32, device))
        row_seq_t = upload(row_seq, torch.int32, device)
        row_pos_t = upload(row_pos, torch.int32, device)

        def mask_mod(b, h, q_idx, kv_idx):
            row = q_idx // group
            block = logical[row_seq_t[row], kv_idx // bs]
            return (block >= 0) & (block * bs + kv_idx % bs <= row_pos_t[row])

        return _block_mask(counts[None, None], indices[None, None], None, None, bs, mask_mod,
                           (queries, self.pool_blocks * bs))


def _pool(cache: torch.Tensor) -> torch.Tensor:
    kv_heads, blocks, block_size, d = cache.shape
    return cache.view(1, kv_heads, blocks * block_size, d)


def attend(queries: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_mask,
           scaling: float | None, static_queries: bool = False) -> torch.Tensor:
    """The compiled call. Row counts may vary between calls (dynamo makes them symbolic after the first
    change); heads and head size are kept static, and so are the pool's size, the block size and the
    query group, by `start_engine`."""
    keys, values = _pool(k_cache), _pool(v_cache)
    for t in (queries, keys, values):
        torch._dynamo.mark_static(t, 1)
        torch._dynamo.mark_static(t, 3)
    if static_queries:
        torch._dynamo.mark_static(queries, 2)
    options = gpu_kernel_options(block_mask.BLOCK_SIZE[1]) if queries.device.type == "cuda" else None
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        return _flex()(queries, keys, values, block_mask=block_mask, scale=scaling, kernel_options=options)


@functools.cache
def gpu_kernel_options(block_size: int) -> dict:
    """Triton kernel options. The main FlexAttention kernel's KV tile (64 keys or more by default) must divide
    the KV block size, and unlike the decoding kernel it does not shrink the tile for a smaller block (torch
    2.11 and 2.13 raise "Q and KV block size must be divisible by BLOCK_M and BLOCK_N"). Prefill chunks run
    there, and so do decode rows once their count varies: the decoding kernel needs a static batch, and
    dynamo makes the row count symbolic after the first change. The tile is the largest power of two up to
    64 that divides the block size."""
    tile = 64
    while block_size % tile:
        tile //= 2
    return {"BLOCK_N": tile}


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_mask,
           scaling: float | None) -> torch.Tensor:
    """q [heads, rows, d] -> [heads, rows, d]; one batch entry per row."""
    heads, n, d = q.shape
    kv_heads = k_cache.shape[0]
    rows = q.reshape(kv_heads, heads // kv_heads, n, d).permute(2, 0, 1, 3).contiguous()    # [n, kvh, group, d]
    out = attend(rows, k_cache, v_cache, block_mask, scaling, static_queries=True)
    return out.permute(1, 2, 0, 3).reshape(heads, n, d)


def prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_mask,
            scaling: float | None) -> torch.Tensor:
    """q [heads, rows, d] -> [heads, rows, d]; the rows' query heads of a KV head are one sequence."""
    heads, n, d = q.shape
    kv_heads = k_cache.shape[0]
    group = heads // kv_heads
    seq = q.reshape(kv_heads, group, n, d).transpose(1, 2).reshape(1, kv_heads, n * group, d).contiguous()
    torch._dynamo.maybe_mark_dynamic(seq, 2)   # every step packs another number of rows
    out = attend(seq, k_cache, v_cache, block_mask, scaling)
    return out.reshape(kv_heads, n, group, d).transpose(1, 2).reshape(heads, n, d)
