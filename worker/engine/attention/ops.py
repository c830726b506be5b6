"""Paged attention as registered operators, so a compiled forward pass calls it without a graph break.

`supportbot::paged_decode` writes a decode step's K/V into the pool and attends every row in place through the
Triton kernels; `supportbot::paged_chunks` does the same for an eager step's chunks; `supportbot::paged_kernel`
does it for any CPU step through the C kernel (paged_attention.c). Each declares that it writes the pool, so the
compiler orders it after earlier writes and updates the pool in place (no copy of the pool is made;
tests/test_compiled.py reads the generated code).
"""

from __future__ import annotations

import torch

from .. import native


@torch.library.custom_op("supportbot::paged_decode", mutates_args=("kv",))
def paged_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, layer: int,
                 slots: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q [rows, heads, d], k and v [rows, kv_heads, d] -> [rows, heads, d]; kv is the whole pool
    [2, layers, kv_heads, blocks, block_size, d]. The context splits follow the row count (paged_triton.splits_for)."""
    from . import paged_triton

    k_cache, v_cache = kv[0, layer], kv[1, layer]
    paged_triton.store_kv(k, v, k_cache, v_cache, slots)
    splits = paged_triton.splits_for(q.shape[0], k_cache.shape[0], q.device)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return paged_triton.decode(q, k_cache, v_cache, tables, lens, scale, splits, out=out)


@paged_decode.register_fake
def _(q, k, v, kv, layer, slots, tables, lens, scale):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


@torch.library.custom_op("supportbot::paged_chunks", mutates_args=("kv",))
def paged_chunks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, layer: int,
                 slots: torch.Tensor, tables: torch.Tensor, seq_row: torch.Tensor, seq_len: torch.Tensor,
                 seq_ctx: torch.Tensor, tile_seq: torch.Tensor, tile_first: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """An eager step (prefill chunks, decode rows as one-query chunks) through the tiled kernel: q [tokens, heads,
    d], k and v [tokens, kv_heads, d] -> [tokens, heads, d]; the plan's tensors as paged_triton.ChunkPlan's."""
    from . import paged_triton

    k_cache, v_cache = kv[0, layer], kv[1, layer]
    paged_triton.store_kv(k, v, k_cache, v_cache, slots)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    plan = paged_triton.ChunkPlan(tables, seq_row, seq_len, seq_ctx, tile_seq, tile_first)
    return paged_triton.chunks(q, k_cache, v_cache, plan, scale, out=out)


@paged_chunks.register_fake
def _(q, k, v, kv, layer, slots, tables, seq_row, seq_len, seq_ctx, tile_seq, tile_first, scale):
    return torch.empty(q.shape, dtype=q.dtype, device=q.device)


@torch.library.custom_op("supportbot::paged_kernel", mutates_args=("kv",))
def paged_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv: torch.Tensor, layer: int,
                 slots: torch.Tensor, row_seq: torch.Tensor, row_pos: torch.Tensor, tables: torch.Tensor,
                 scale: float) -> torch.Tensor:
    """A CPU step through the C kernel, float32 (a float32 or float16 pool): q [heads, tokens, d], k and v
    [kv_heads, tokens, d] -> [tokens, heads, d]; per token its sequence (row_seq, int32) and position (row_pos,
    int32), per sequence its block table (tables [seqs, width], int32), as paged.build_context lays them out for the
    kernel."""
    return kernel_step(q, k, v, kv[0, layer], kv[1, layer], slots, row_seq, row_pos, tables,
                       int(row_pos.max()) + 1, scale)


@paged_kernel.register_fake
def _(q, k, v, kv, layer, slots, row_seq, row_pos, tables, scale):
    return q.new_empty(q.shape[1], q.shape[0], q.shape[2])


def kernel_step(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slots: torch.Tensor, row_seq: torch.Tensor, row_pos: torch.Tensor, tables: torch.Tensor,
                max_context: int, scale: float) -> torch.Tensor:
    """One C call for a step's layer: writes k, v [kv_heads, tokens, d] at `slots` and attends every query row
    (q [heads, tokens, d]) over its sequence's blocks; [tokens, heads, d] out. The pool is float32 or float16
    (new rows rounded to nearest); the arithmetic is float32."""
    heads, tokens, d = q.shape
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    kv_heads, num_blocks, block_size, _ = k_cache.shape
    out = torch.empty(tokens, heads, d, dtype=q.dtype)
    lib = native.load()
    kernel = lib.paged_attention_f16kv if k_cache.dtype == torch.float16 else lib.paged_attention_f32
    rc = kernel(
        q.data_ptr(), q.stride(1), q.stride(0), k.data_ptr(), k.stride(1), k.stride(0),
        v.data_ptr(), v.stride(1), v.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), num_blocks, block_size,
        heads, kv_heads, d, slots.data_ptr(), tokens, row_seq.data_ptr(), row_pos.data_ptr(), tables.data_ptr(),
        tables.shape[1], max_context, scale, out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"paged-attention kernel refused {heads} query heads over {kv_heads} KV heads")
    return out
