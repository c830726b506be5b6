"""Paged attention as registered operators, so a compiled forward pass calls it without a graph break.

`supportbot::paged_decode` writes a decode step's K/V into the pool and attends every row in place through the
Triton kernels; `supportbot::paged_chunks` does the same for an eager step's chunks. Each declares that it
writes the pool, so the compiler orders it after earlier writes and updates the pool in place (no copy of the
pool is made; tests/test_compiled.py reads the generated code).
"""

from __future__ import annotations

import torch


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
