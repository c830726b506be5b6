"""Paged attention in place through compiled FlexAttention: block masks built from block tables.

Keys and values are a layer's pool viewed as one long sequence [1, kv_heads, blocks * block_size, d]
(batch 1, broadcast over query rows); a BlockMask lists, per tile of queries, the pool blocks they read,
so no context is gathered. The query heads that share a KV head become query positions, so grouped-query
attention needs no repeat and no power-of-two group. Two forms:

- decode rows: each row is a batch entry with its own block list (FlexAttention's decoding kernel),
  from int32 buffers that `PagedTables` keeps on the device, so the same BlockMask serves every step
  and every CUDA-graph replay once the buffers are refilled. The decoding kernel needs a static batch:
  the rows are padded to one of a few row counts (`kernel_rows`), each compiled with static shapes, so
  every decode step, whatever its bucket, runs that kernel (a symbolic row count would fall back to
  the main kernel, which tiles 128 queries for each row's one);
- prefill chunks: all chunks of a step are one query sequence; each tile of 128 queries lists the union
  of its rows' blocks, and `mask_mod` keeps a key when its block belongs to the row's sequence (through a
  physical-to-logical block map) at a position not past the row's.

The decode form's `mask_mod` only describes a row's last block: the compiled kernel applies it there
and nowhere else, but FlexAttention's eager fallback applies `mask_mod` alone over every key of the
pool. `attend` therefore refuses to run eagerly: a recompile past dynamo's limit raises instead.
"""

from __future__ import annotations

import functools
import typing
from types import SimpleNamespace

import torch
from torch.nn.attention import flex_attention as _flex_module

from ..block_tables import SlotTables
from ..transfer import StagedBuffer, Staging, upload

Q_TILE = 128          # queries per BlockMask row tile in the prefill form
GPU_MIN_BLOCK = 16    # Triton's matrix tiles are at least 16 wide: a KV block is one tile or more
# Decode row counts compiled: powers of four up to the slot count, so at most 4x padding of attention rows (a
# padding row reads one key) and few compiles. Each is a cache entry of the decode form's compiled function;
# 16 covers slot counts up to 4**15, above dynamo's default limit of 8.
KERNEL_ROWS_BASE = 4
DECODE_COMPILE_LIMIT = 16
_compiled = None
_decode_compiled = None


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


def kernel_rows(max_rows: int) -> list[int]:
    """The row counts the decode form is compiled for: 1, 4, 16, 64, ... below max_rows, then max_rows."""
    sizes, n = [], 1
    while n < max_rows:
        sizes.append(n)
        n *= KERNEL_ROWS_BASE
    return sizes + [max_rows]


def _flex():
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_flex_module.flex_attention, fullgraph=True)
    return _compiled


def _decode_call(query, key, value, block_mask, scale, kernel_options):
    """The decode form's entry point: a function of its own, so that its compiled variants (one per static row
    count) are cached and counted apart from the prefill form's."""
    return _flex_module.flex_attention(query, key, value, block_mask=block_mask, scale=scale,
                                       kernel_options=kernel_options)


def _decode_kernel():
    """Compiled with static shapes: dynamo never turns the row count symbolic (its automatic dynamic shapes
    would after the first change, and the Triton decoding kernel needs a static batch)."""
    global _decode_compiled
    if _decode_compiled is None:
        _decode_compiled = torch.compile(_decode_call, fullgraph=True, dynamic=False)
    return _decode_compiled


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
    rows x width, not with the pool, so a large GPU pool does not multiply them. The decode rows' full-block
    ids persist from step to step (SlotTables): a step writes the ids a row did not hold yet. Their counts,
    last block and end change every step and go up in one contiguous copy (StagedBuffer)."""

    def __init__(self, rows: int, width: int, pool_blocks: int, block_size: int, group: int, scratch_block: int,
                 device: torch.device) -> None:
        self.block_size, self.group, self.scratch_block = block_size, group, scratch_block
        self.width, self.pool_blocks = width, pool_blocks
        self.sizes = kernel_rows(rows)
        self.slots = SlotTables(rows, width, scratch_block, torch.int32, device)
        self.tables = self.slots.tables
        # A row's one partial block, in column 0. The kernels disagree on the list's layout: the CPU kernel
        # wants it to span the pool (so it gets a stride-0 view of one column) and reads each list through
        # its own strides; the GPU kernels read the full-block list through the partial list's strides, so
        # there the two share one shape and layout.
        last_width = 1 if device.type == "cpu" else width
        self.last = torch.full((rows, last_width), scratch_block, dtype=torch.int32, device=device)
        self.counts = StagedBuffer(3, rows, torch.int32, device)   # full blocks, last block, limit
        self.staging = Staging(device)
        self.logical: torch.Tensor | None = None   # prefill chunks' block maps, made on first use
        self._masks: dict[int, object] = {}

    def reset(self, rows: int) -> None:
        """Make all `rows` rows padding (one key of the scratch block), e.g. before a graph is captured with
        them: the row counts' layouts share one buffer, so one count's fill leaves another's rows meaningless."""
        bs, scratch = self.block_size, self.scratch_block
        self.staging.wait()
        counts = self.counts.put([[0] * rows, [scratch] * rows, [scratch * bs + 1] * rows], rows)
        self.last[:rows, 0].copy_(counts[1])
        self.staging.record()

    @property
    def nbytes(self) -> int:
        buffers = (self.tables, self.last, self.counts.device_flat, self.counts.host_flat, self.logical)
        return sum(t.numel() * t.element_size() for t in buffers if t is not None)

    def rows_for(self, n: int) -> int:
        """The compiled row count that n decode rows are padded to."""
        return next(size for size in self.sizes if size >= n)

    def mask(self, rows: int):
        """The BlockMask of a compiled row count (see rows_for)."""
        if rows not in self._masks:
            counts = self.counts.device(rows)
            self._masks[rows] = paged_block_mask(self.tables[:rows], counts[0], self.last[:rows], counts[2],
                                                 self.block_size, self.pool_blocks, self.group)
        return self._masks[rows]

    def fill(self, tables: list[list[int]], contexts: list[int], rows: int,
             owners: list | None = None) -> None:
        """Write the rows' tables (padded to `rows` with one key of the scratch block); copies are non-blocking.

        owners: what identifies each row's table from one step to the next (see SlotTables); None: unknown,
        every id is written."""
        bs, scratch, pad = self.block_size, self.scratch_block, rows - len(tables)
        full = [(c - 1) // bs for c in contexts]
        last = [t[f] for t, f in zip(tables, full)]
        limit = [blk * bs + c - f * bs for blk, c, f in zip(last, contexts, full)]
        self.staging.wait()
        counts = self.counts.put([full + [0] * pad, last + [scratch] * pad, limit + [scratch * bs + 1] * pad], rows)
        self.last[:rows, 0].copy_(counts[1])
        # Only the full blocks' ids: columns past a row's count are never read.
        self.slots.write(owners or [None] * len(tables), tables, full)
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


def warm_prefill(paged: PagedTables, k_cache: torch.Tensor, v_cache: torch.Tensor, heads: int) -> None:
    """Compile the prefill form before a request needs it (a compile takes seconds; serving would otherwise stall
    on it at the first chunks with a cached prefix): chunks of 8, 300, 20 and 1 rows over a prefix cached in the
    scratch block. The first compiles static shapes; the second makes the varying ones symbolic, with two query
    tiles or more; the third and fourth get the variants dynamo specialises apart, a single query tile and a
    single row. Nothing is written to the pool."""
    bs, scratch = paged.block_size, paged.scratch_block
    for length in (8, 300, 20, 1):
        context = length + 1
        span = SimpleNamespace(start=0, length=length, context=context, table=[scratch] * -(-context // bs))
        q = torch.zeros(heads, length, k_cache.shape[-1], dtype=k_cache.dtype, device=k_cache.device)
        prefill(q, k_cache, v_cache, paged.prefill_mask([span]), None)


def _pool(cache: torch.Tensor) -> torch.Tensor:
    kv_heads, blocks, block_size, d = cache.shape
    return cache.view(1, kv_heads, blocks * block_size, d)


def attend(queries: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_mask,
           scaling: float | None) -> torch.Tensor:
    """The prefill form's compiled call. Its query length varies between calls (symbolic); heads and head
    size are kept static, and so are the pool's size, the block size and the query group, by `start_engine`."""
    keys, values = _pool(k_cache), _pool(v_cache)
    for t in (queries, keys, values):
        torch._dynamo.mark_static(t, 1)
        torch._dynamo.mark_static(t, 3)
    options = gpu_kernel_options(block_mask.BLOCK_SIZE[1]) if queries.device.type == "cuda" else None
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        return _flex()(queries, keys, values, block_mask=block_mask, scale=scaling, kernel_options=options)


def attend_decode(rows: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_mask,
                  scaling: float | None) -> torch.Tensor:
    """The decode form's compiled call, static in every shape: one compiled variant per row count. On CUDA
    the decoding kernel is demanded, so a shape it cannot take raises instead of running the main kernel."""
    options = None
    if rows.device.type == "cuda":
        options = dict(gpu_kernel_options(block_mask.BLOCK_SIZE[1]))
        if "TRITON_DECODE" in typing.get_args(getattr(_flex_module, "_Backend", None)):
            options["BACKEND"] = "TRITON_DECODE"
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True, recompile_limit=DECODE_COMPILE_LIMIT):
        return _decode_kernel()(rows, _pool(k_cache), _pool(v_cache), block_mask, scaling, options)


@functools.cache
def gpu_kernel_options(block_size: int) -> dict:
    """Triton kernel options. The main FlexAttention kernel's KV tile (64 keys or more by default) must divide
    the KV block size, and unlike the decoding kernel it does not shrink the tile for a smaller block (torch
    2.11 and 2.13 raise "Q and KV block size must be divisible by BLOCK_M and BLOCK_N"). Prefill chunks run
    there (decode rows run the decoding kernel, which shrinks its tile itself). The tile is the largest
    power of two up to 64 that divides the block size."""
    tile = 64
    while block_size % tile:
        tile //= 2
    return {"BLOCK_N": tile}


def decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_mask,
           scaling: float | None) -> torch.Tensor:
    """q [heads, rows, d] -> [heads, rows, d]; one batch entry per row, padded with zero queries to the mask's
    row count (a compiled one, `kernel_rows`)."""
    heads, n, d = q.shape
    kv_heads = k_cache.shape[0]
    rows = q.reshape(kv_heads, heads // kv_heads, n, d).permute(2, 0, 1, 3)    # [n, kvh, group, d]
    size = block_mask.kv_num_blocks.shape[0]
    if size > n:
        rows = torch.cat([rows, rows.new_zeros(size - n, *rows.shape[1:])])
    out = attend_decode(rows.contiguous(), k_cache, v_cache, block_mask, scaling)[:n]
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
