"""Paged attention plugged into transformers' attention-function interface.

The model's own code computes Q/K/V and RoPE; this function writes the new K/V into the paged
pool in place and attends over each sequence's blocks. Decode rows are batched into one call;
each prefill chunk gets its own causal call.

The pool is laid out [kv_heads, blocks, block_size, head_dim] per layer, so gathering a batch's
blocks yields [kv_heads, seqs, tokens, head_dim] with no transpose: (kv_heads, seqs) are the
batch dimensions of one SDPA call, and the query heads that share a KV head are its query rows
(grouped-query attention without repeating K/V).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

ATTN_NAME = "engine_paged"


@dataclass
class PrefillChunk:
    start: int             # first row of this chunk in the packed tokens
    length: int            # tokens in the chunk
    context: int           # tokens of the sequence in the cache after this step (chunk included)
    blocks: torch.Tensor   # the sequence's block ids covering `context`


@dataclass
class StepContext:
    """What every layer's attention call needs to know about this step's packing."""

    kv: torch.Tensor                            # [2, layers, kv_heads, blocks, block_size, head_dim]
    slots: torch.Tensor                         # [tokens] flat cache slot of each packed token
    num_decodes: int = 0
    decode_blocks: torch.Tensor | None = None   # [decodes, max_blocks]
    decode_mask: torch.Tensor | None = None     # [1, decodes, 1, max_blocks * block_size]
    prefills: list[PrefillChunk] = field(default_factory=list)


_local = threading.local()


def set_context(ctx: StepContext | None) -> None:
    _local.ctx = ctx


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None,
                    dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    ctx: StepContext = _local.ctx
    k_cache, v_cache = ctx.kv[0, module.layer_idx], ctx.kv[1, module.layer_idx]
    kv_heads, _, _, head_dim = k_cache.shape
    # The packed tokens are one "batch of one": [1, heads, T, d] -> [heads, T, d].
    q, k, v = query[0], key[0], value[0]
    k_cache.view(kv_heads, -1, head_dim).index_copy_(1, ctx.slots, k)
    v_cache.view(kv_heads, -1, head_dim).index_copy_(1, ctx.slots, v)

    out = torch.empty_like(q)
    nd = ctx.num_decodes
    if nd:
        out[:, :nd] = _decode_attention(q[:, :nd], k_cache, v_cache, ctx, scaling)
    for chunk in ctx.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        out[:, rows] = _prefill_attention(q[:, rows], k[:, rows], v[:, rows], k_cache, v_cache, chunk, scaling)
    return out.transpose(0, 1).unsqueeze(0), None   # [1, T, heads, d], as transformers expects


def _gather(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    """Block ids [..., n] -> [kv_heads, ..., n * block_size, head_dim]."""
    g = cache[:, blocks]
    return g.flatten(-3, -2)


def _decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, ctx: StepContext,
                      scaling: float | None) -> torch.Tensor:
    heads, nd, d = q.shape
    kv_heads = k_cache.shape[0]
    qg = q.reshape(kv_heads, heads // kv_heads, nd, d).transpose(1, 2)      # [kvh, nd, group, d]
    keys, values = _gather(k_cache, ctx.decode_blocks), _gather(v_cache, ctx.decode_blocks)
    o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=ctx.decode_mask, scale=scaling)
    return o.transpose(1, 2).reshape(heads, nd, d)


def _prefill_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                       v_cache: torch.Tensor, chunk: PrefillChunk, scaling: float | None) -> torch.Tensor:
    heads, kv_heads = q.shape[0], k.shape[0]
    if chunk.context == chunk.length:
        # Nothing cached before this chunk: plain causal attention over the fresh K/V.
        keys, values, mask, causal = k, v, None, True
    else:
        keys = _gather(k_cache, chunk.blocks)[:, :chunk.context]
        values = _gather(v_cache, chunk.blocks)[:, :chunk.context]
        first = chunk.context - chunk.length
        rows = torch.arange(first, chunk.context, device=q.device)
        mask = torch.arange(chunk.context, device=q.device)[None, :] <= rows[:, None]
        causal = False
    o = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, is_causal=causal,
                                       scale=scaling, enable_gqa=heads != kv_heads)
    return o[0]


def register() -> None:
    """Make the function selectable as attn_implementation=ATTN_NAME (no mask is built for it)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
