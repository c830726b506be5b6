"""Paged attention plugged into transformers' attention-function interface.

The model's own code computes Q/K/V and RoPE; this function writes the new K/V into the paged
pool in place and attends over each sequence's blocks, through one of two backends:

- "kernel": a C kernel (paged_attention.c, CPU, float32) that writes the step's K/V and attends
  every row of the step, decodes and prefill chunks alike, reading the pool in place through the
  block table: one call per layer.
- "gather": PyTorch only, any device and dtype. Each layer gathers the batch's blocks into SDPA's
  layout; decode rows share one SDPA call, each prefill chunk gets its own. Where FlexAttention's
  decoding kernel runs (on CUDA; see ModelRunner) the cached context is read in place instead: decode
  rows through flex.decode, chunks with a cached prefix through flex.prefill, so a step's memory grows
  with its tokens, not with its decode rows times the longest context; chunks with nothing cached
  keep plain causal SDPA over their own K/V.

- "flex": compiled FlexAttention reading the pool in place (flex.py), any device: decode rows in one
  call, all prefill chunks in another. Decode steps through the static buffers of device.DecodeGraphs
  use its decode form by default whatever the backend ("flex" decode attention), or gather.

The pool is laid out [kv_heads, blocks, block_size, head_dim] per layer, so gathering a batch's
blocks yields [kv_heads, seqs, tokens, head_dim] with no transpose: (kv_heads, seqs) are the
batch dimensions of one SDPA call, and the query heads that share a KV head are its query rows
(grouped-query attention without repeating K/V).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import threading
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .. import native
from . import flex, ops
from ..transfer import upload

ATTN_NAME = "engine_paged"
KERNEL_REFERENCE = "engine_kernel"   # the kernel's arithmetic on a plain model's own cache (kernel_reference)
KERNEL_REFERENCE_F16 = "engine_kernel_f16"   # the same over the cache rounded to float16, as a float16 pool holds it
BACKENDS = ("kernel", "gather", "flex", "triton")
DECODE_MODES = ("triton", "flex", "gather")   # decode attention in the static-buffer (CUDA-graph) path
log = logging.getLogger(__name__)


@dataclass
class Span:
    """One sequence's rows in the packed step: a decode (length 1) or a prefill chunk."""

    start: int             # first row in the packed tokens
    length: int            # rows
    context: int           # tokens of the sequence in the cache after this step (these rows included)
    table: list[int]       # the sequence's block ids (at least those covering `context`)
    owner: object = None   # the same from step to step while `table` only grows (block_tables.SlotTables)


@dataclass
class PrefillChunk:
    start: int             # first row of this chunk in the packed tokens
    length: int            # tokens in the chunk
    context: int           # tokens of the sequence in the cache after this step (chunk included)
    blocks: torch.Tensor | None   # the sequence's block ids covering `context`; None when nothing was cached


@dataclass
class StepContext:
    """What every layer's attention call needs to know about this step's packing."""

    kv: torch.Tensor                            # [2, layers, kv_heads, blocks, block_size, head_dim]
    slots: torch.Tensor                         # [tokens] flat cache slot of each packed token
    backend: str = "gather"
    num_decodes: int = 0
    # gather backend
    decode_blocks: torch.Tensor | None = None   # [decodes, max_blocks]
    decode_mask: torch.Tensor | None = None     # [1, decodes, 1, max_blocks * block_size]
    decode_block_mask: object | None = None      # FlexAttention BlockMask: decodes read the pool in place
    prefill_block_mask: object | None = None     # every prefill chunk (flex), those with a cached prefix (gather)
    prefill_rows: torch.Tensor | None = None     # gather in place: the rows prefill_block_mask covers
    prefills: list[PrefillChunk] = field(default_factory=list)
    # kernel backend: per-row sequence index and position (int32), block tables [seqs, width] (int32), the longest
    # context
    kernel_tensors: tuple[torch.Tensor, ...] = ()
    kernel_max_context: int = 0
    # triton backend: decode rows of a static-buffer step (block tables, context lengths, context splits), or an
    # eager step's sequences and query tiles
    decode_tables: torch.Tensor | None = None
    decode_lens: torch.Tensor | None = None
    decode_splits: int = 1
    chunk_plan: object | None = None             # paged_triton.ChunkPlan


_local = threading.local()


def set_context(ctx: StepContext | None) -> None:
    _local.ctx = ctx


def current_context() -> StepContext | None:
    """The step this thread is running, None outside the engine's steps."""
    return getattr(_local, "ctx", None)


def triton_available() -> bool:
    """Triton imports (it comes with torch's CUDA builds; the CPU build runs without it)."""
    try:
        from . import paged_triton  # noqa: F401
    except ImportError:
        return False
    return True


def choose_backend(requested: str | None, device: torch.device, dtype: torch.dtype, block_size: int = 16) -> str:
    """The backend to run: the one asked for (EngineConfig or ATTENTION_BACKEND), else the device's best as
    measured (docs/BENCHMARKS.md): the C kernel on a CPU in float32; on CUDA the Triton kernels
    (paged_triton.py), else "flex" where its kernel takes the block size, else "gather"."""
    requested = requested or os.environ.get("ATTENTION_BACKEND") or None
    if requested is not None and requested not in BACKENDS:
        raise ValueError(f"Unknown attention backend {requested!r}; choose one of {', '.join(BACKENDS)}.")
    kernel_fits = device.type == "cpu" and dtype == torch.float32
    if requested == "kernel" and not kernel_fits:
        raise ValueError(f"The 'kernel' attention backend runs float32 on CPU only, not {dtype} on {device.type}; "
                         "use 'gather'.")
    if requested in (None, "kernel") and kernel_fits:
        if native.load() is not None:
            return "kernel"
        log.warning("attention backend 'kernel' unavailable: using 'gather'")
    if requested == "triton" and not triton_available():
        raise ValueError("The 'triton' attention backend needs the triton package; use 'flex' or 'gather'.")
    if requested is None and device.type == "cuda" and triton_available():
        return "triton"
    if requested is None and device.type == "cuda" and flex.fits(device, block_size):
        return "flex"
    return requested if requested in ("flex", "triton") else "gather"


def choose_decode_attention(requested: str | None) -> str | None:
    """The decode attention asked for (EngineConfig or DECODE_ATTENTION), None for the default order."""
    requested = requested or os.environ.get("DECODE_ATTENTION") or None
    if requested is not None and requested not in DECODE_MODES:
        raise ValueError(f"Unknown decode attention {requested!r}; choose one of {', '.join(DECODE_MODES)}.")
    return requested


def padded_tables(tables: list[list[int]], width: int, pad: int = 0) -> list[list[int]]:
    """Each table's first `width` block ids, padded with block `pad` (masked out by the context lengths)."""
    return [t[:width] + [pad] * (width - len(t[:width])) for t in tables]


def build_context(backend: str, kv: torch.Tensor, slots: list[int], spans: list[Span], num_decodes: int,
                  block_size: int, paged: flex.PagedTables | None = None, group: int = 1,
                  least: int = 1) -> StepContext:
    """`paged`: device buffers for block tables (ModelRunner keeps them), for the flex backend, and for the
    gather backend where it reads cached context in place (without them it copies contexts out). least: the
    triton backend's plan padded to at least this many sequences (paged_triton.plan), the kernel backend's block
    tables to at least this many columns."""
    device = kv.device
    ctx = StepContext(kv=kv, slots=upload(slots, torch.long, device), backend=backend, num_decodes=num_decodes)
    if backend == "triton":
        from . import paged_triton

        ctx.chunk_plan = paged_triton.plan([s.start for s in spans], [s.length for s in spans],
                                           [s.context for s in spans],
                                           [s.table[:-(-s.context // block_size)] for s in spans], group, device,
                                           least=least)
        return ctx
    if backend in ("flex", "gather") and paged is not None:
        _in_place(ctx, spans, num_decodes, paged)
        return ctx
    if backend == "kernel":
        row_seq, row_pos = [], []
        for i, s in enumerate(spans):
            row_seq += [i] * s.length
            row_pos += range(s.context - s.length, s.context)
        width = max(least, *(-(-s.context // block_size) for s in spans))
        tables = torch.tensor(padded_tables([s.table for s in spans], width), dtype=torch.int32)
        row_seq_t = torch.tensor(row_seq, dtype=torch.int32)
        row_pos_t = torch.tensor(row_pos, dtype=torch.int32)
        ctx.kernel_tensors = (row_seq_t, row_pos_t, tables)
        ctx.kernel_max_context = max(s.context for s in spans)
        return ctx
    decodes = spans[:num_decodes]
    if decodes:
        width = max(-(-s.context // block_size) for s in decodes)
        ctx.decode_blocks = upload(padded_tables([s.table for s in decodes], width), torch.long, device)
        lengths = upload([s.context for s in decodes], torch.long, device)
        mask = torch.arange(width * block_size, device=device)[None, :] < lengths[:, None]
        ctx.decode_mask = mask[None, :, None, :]
    for s in spans[num_decodes:]:
        blocks = upload(s.table[:-(-s.context // block_size)], torch.long, device)
        ctx.prefills.append(PrefillChunk(s.start, s.length, s.context, blocks))
    return ctx


def _in_place(ctx: StepContext, spans: list[Span], num_decodes: int, paged: flex.PagedTables) -> None:
    """Decode rows and prefill chunks that read the pool in place through FlexAttention (with gather, the
    chunks with nothing cached stay with SDPA, over their own K/V)."""
    decodes = spans[:num_decodes]
    if decodes:
        rows = paged.rows_for(num_decodes)
        paged.fill([s.table for s in decodes], [s.context for s in decodes], rows, [s.owner for s in decodes])
        ctx.decode_block_mask = paged.mask(rows)
    chunks = spans[num_decodes:]
    if ctx.backend == "gather":
        ctx.prefills = [PrefillChunk(s.start, s.length, s.context, None) for s in chunks if s.context == s.length]
        chunks = [s for s in chunks if s.context > s.length]
        if chunks:
            ctx.prefill_rows = upload([r for s in chunks for r in range(s.start, s.start + s.length)], torch.long,
                                      ctx.kv.device)
    if chunks:   # packed one after the other, as one query sequence
        starts = [0]
        for s in chunks[:-1]:
            starts.append(starts[-1] + s.length)
        ctx.prefill_block_mask = paged.prefill_mask([Span(a, s.length, s.context, s.table)
                                                     for a, s in zip(starts, chunks)])


def paged_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, scaling: float | None = None,
                    dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
    # The packed tokens are one "batch of one": [1, heads, T, d] -> [heads, T, d].
    q, k, v = query[0], key[0], value[0]
    if "engine_tables" in kwargs:   # a compiled step: its buffers come as arguments (compiled.py)
        return _decode_op(q, k, v, module.layer_idx, scaling, kwargs).unsqueeze(0), None
    if "engine_plan" in kwargs:
        return _chunks_op(q, k, v, module.layer_idx, scaling, kwargs).unsqueeze(0), None
    if "engine_rows" in kwargs:
        return _kernel_op(q, k, v, module.layer_idx, scaling, kwargs).unsqueeze(0), None
    ctx: StepContext = _local.ctx
    if ctx.backend == "kernel":
        out = _kernel_attention(q, k, v, ctx, module.layer_idx, scaling)
    elif ctx.backend == "triton" or ctx.decode_tables is not None:
        out = _triton_attention(q, k, v, ctx, module.layer_idx, scaling)
    elif ctx.backend == "flex":
        out = _flex_attention(q, k, v, ctx, module.layer_idx, scaling)
    else:
        out = _gather_attention(q, k, v, ctx, module.layer_idx, scaling)
    return out.unsqueeze(0), None   # [1, T, heads, d], as transformers expects


def _kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext, layer: int,
                      scaling: float | None) -> torch.Tensor:
    row_seq, row_pos, tables = ctx.kernel_tensors
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    return ops.kernel_step(q, k, v, ctx.kv[0, layer], ctx.kv[1, layer], ctx.slots, row_seq, row_pos, tables,
                           ctx.kernel_max_context, scale)


def _triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext, layer: int,
                      scaling: float | None) -> torch.Tensor:
    """[heads, T, d] in, [T, heads, d] out: the step's K/V written, then decode rows (static buffers) or every
    span of an eager step attended in place."""
    from . import paged_triton

    k_cache, v_cache = ctx.kv[0, layer], ctx.kv[1, layer]
    q, k, v = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)
    paged_triton.store_kv(k, v, k_cache, v_cache, ctx.slots)
    scale = paged_triton.default_scale(q.shape[-1], scaling)
    if ctx.decode_tables is not None:
        return paged_triton.decode(q, k_cache, v_cache, ctx.decode_tables, ctx.decode_lens, scale, ctx.decode_splits)
    return paged_triton.chunks(q, k_cache, v_cache, ctx.chunk_plan, scale)


def _decode_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scaling: float | None,
               step: dict) -> torch.Tensor:
    """Decode rows through the registered operator (ops.py), which a compiled forward calls without a break."""
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    return torch.ops.supportbot.paged_decode(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             step["engine_kv"], layer, step["engine_slots"], step["engine_tables"],
                                             step["engine_lens"], scale)


def _chunks_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scaling: float | None,
               step: dict) -> torch.Tensor:
    """An eager step's spans through the registered operator (ops.py)."""
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    plan = step["engine_plan"]
    return torch.ops.supportbot.paged_chunks(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                             step["engine_kv"], layer, step["engine_slots"], *plan, scale)


def _kernel_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: int, scaling: float | None,
               step: dict) -> torch.Tensor:
    """A CPU step through the C kernel's registered operator (ops.py)."""
    scale = q.shape[-1] ** -0.5 if scaling is None else scaling
    return torch.ops.supportbot.paged_kernel(q, k, v, step["engine_kv"], layer, step["engine_slots"],
                                             *step["engine_rows"], scale)


def _write(k: torch.Tensor, v: torch.Tensor, ctx: StepContext, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Write the step's K/V into the layer's pool in place; the layer's (k_cache, v_cache)."""
    k_cache, v_cache = ctx.kv[0, layer], ctx.kv[1, layer]
    kv_heads, _, _, head_dim = k_cache.shape
    k_cache.view(kv_heads, -1, head_dim).index_copy_(1, ctx.slots, k)
    v_cache.view(kv_heads, -1, head_dim).index_copy_(1, ctx.slots, v)
    return k_cache, v_cache


def _flex_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext, layer: int,
                    scaling: float | None) -> torch.Tensor:
    k_cache, v_cache = _write(k, v, ctx, layer)
    nd = ctx.num_decodes
    parts = []
    if nd:
        parts.append(flex.decode(q[:, :nd], k_cache, v_cache, ctx.decode_block_mask, scaling))
    if ctx.prefill_block_mask is not None:
        parts.append(flex.prefill(q[:, nd:], k_cache, v_cache, ctx.prefill_block_mask, scaling))
    out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
    return out.transpose(0, 1)


def _gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: StepContext, layer: int,
                      scaling: float | None) -> torch.Tensor:
    k_cache, v_cache = _write(k, v, ctx, layer)
    out = torch.empty_like(q)
    nd = ctx.num_decodes
    if nd and ctx.decode_block_mask is not None:
        out[:, :nd] = flex.decode(q[:, :nd], k_cache, v_cache, ctx.decode_block_mask, scaling)
    elif nd:
        out[:, :nd] = _decode_attention(q[:, :nd], k_cache, v_cache, ctx, scaling)
    for chunk in ctx.prefills:
        rows = slice(chunk.start, chunk.start + chunk.length)
        out[:, rows] = _prefill_attention(q[:, rows], k[:, rows], v[:, rows], k_cache, v_cache, chunk, scaling)
    if ctx.prefill_block_mask is not None:   # chunks with a cached prefix, read in place
        rows = ctx.prefill_rows
        out[:, rows] = flex.prefill(q.index_select(1, rows), k_cache, v_cache, ctx.prefill_block_mask, scaling)
    return out.transpose(0, 1)


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
    with _sdpa_backends(q.device):
        o = F.scaled_dot_product_attention(q[None], keys[None], values[None], attn_mask=mask, is_causal=causal,
                                           scale=scaling, enable_gqa=heads != kv_heads)
    return o[0]


# SDPA backends for prefill chunks on CUDA, in order: cuDNN's is left out, since it plans a graph on the host for
# every new query length, and every prompt has its own length. Flash takes grouped-query attention in bf16/fp16; the math backend takes everything else.
_CUDA_SDPA = ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")


def _sdpa_backends(device: torch.device):
    if device.type != "cuda":
        return contextlib.nullcontext()
    from torch.nn.attention import sdpa_kernel

    return sdpa_kernel(_cuda_sdpa_order(), set_priority=True)


@functools.cache
def _cuda_sdpa_order() -> list:
    from torch.nn.attention import SDPBackend

    return [getattr(SDPBackend, name) for name in _CUDA_SDPA]


def kernel_reference(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, scaling: float | None = None,
                     dropout: float = 0.0, half_pool: bool = False, **kwargs) -> tuple[torch.Tensor, None]:
    """The C kernel's attention over transformers' own contiguous cache, for one unpadded causal sequence
    (half_pool: the cache rounded to float16 and read by the float16 pool's kernel, as a float16 pool holds it).

    A row's result in the kernel depends on that row's query and its keys alone, not on the block table,
    the chunking or the rows beside it. So `generate` on a model set to KERNEL_REFERENCE is transformers'
    per-prompt loop computing exactly the engine's arithmetic: what is left to differ is the engine's own
    work (packing, paging, chunked and prefix-cached prefill, scheduling, sampling). The cache
    [1, kv_heads, context, head_dim] is the pool's layout with one block of `context` tokens.
    """
    lib = native.load()
    if lib is None or query.device.type != "cpu" or query.dtype != torch.float32:
        raise RuntimeError("the kernel reference needs the compiled paged-attention kernel and float32 on CPU")
    if query.shape[0] != 1 or attention_mask is not None:
        raise ValueError("the kernel reference attends one unpadded sequence: pass a batch of one, no padding")
    q, k, v = query[0], key[0], value[0]
    heads, tokens, d = q.shape
    kv_heads, context, _ = k.shape
    pool = torch.stack([k, v])[:, :, None].to(torch.float16 if half_pool else torch.float32).contiguous()
    # [2, kv_heads, 1 block, context, head_dim]
    new = slice(context - tokens, context)                 # the queries are the cache's last rows
    k_new, v_new = k[:, new], v[:, new]
    q = q if q.stride(-1) == 1 else q.contiguous()
    slots = torch.arange(context - tokens, context)
    row_seq = torch.zeros(tokens, dtype=torch.int32)
    row_pos = torch.arange(context - tokens, context, dtype=torch.int32)
    table = torch.zeros(1, 1, dtype=torch.int32)
    out = torch.empty(tokens, heads, d)
    kernel = lib.paged_attention_f16kv if half_pool else lib.paged_attention_f32
    rc = kernel(
        q.data_ptr(), q.stride(1), q.stride(0), k_new.data_ptr(), k_new.stride(1), k_new.stride(0),
        v_new.data_ptr(), v_new.stride(1), v_new.stride(0), pool[0].data_ptr(), pool[1].data_ptr(), 1, context,
        heads, kv_heads, d, slots.data_ptr(), tokens, row_seq.data_ptr(), row_pos.data_ptr(), table.data_ptr(), 1,
        context, d ** -0.5 if scaling is None else scaling, out.data_ptr(), torch.get_num_threads())
    if rc != 0:
        raise RuntimeError(f"paged-attention kernel refused {heads} query heads over {kv_heads} KV heads")
    return out.unsqueeze(0), None


def register() -> None:
    """Make the engine's function selectable as attn_implementation=ATTN_NAME, and the kernel's arithmetic on
    a plain model as KERNEL_REFERENCE, over a float16 pool as KERNEL_REFERENCE_F16 (no mask is built for any)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_NAME, paged_attention)
    AttentionInterface.register(KERNEL_REFERENCE, kernel_reference)
    AttentionInterface.register(KERNEL_REFERENCE_F16, functools.partial(kernel_reference, half_pool=True))
