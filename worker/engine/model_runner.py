"""Runs one packed forward pass: builds the step's tensors, calls the model, returns sampling logits."""

from __future__ import annotations

import inspect
import logging
import os
import time

import torch

from . import attention, native, sizing
from .attention import flex
from .attention import Span
from .block_tables import RowOrder
from .weights.packed import pack_linears, unpack_linears
from .compiled import CompiledLayers
from .fused import FusedLayers
from .config import KV_CACHE_DTYPES, EngineConfig
from .device import DecodeGraphs
from .scheduler import Batch
from .transfer import place_pending, upload

log = logging.getLogger(__name__)

# Attention backends whose eager steps run the compiled layers: the Triton kernels (CUDA), the C kernel (CPU)
COMPILED_BACKENDS = ("triton", "kernel")


def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def kv_shape(model) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a decoder-only transformers model."""
    c = _text_config(model)
    heads = c.num_attention_heads
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // heads
    return c.num_hidden_layers, getattr(c, "num_key_value_heads", None) or heads, head_dim


def query_group(model) -> int:
    """Query heads per KV head."""
    c = _text_config(model)
    return c.num_attention_heads // kv_shape(model)[1]


def context_length(model) -> int:
    c = _text_config(model)
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        if getattr(c, name, None):
            return int(getattr(c, name))
    raise ValueError("The model config names no context length; set EngineConfig.max_model_len.")


def kv_cache_dtype(config: EngineConfig, dtype: torch.dtype, backend: str, eager: bool) -> torch.dtype:
    """The KV pool's dtype: the model's ("auto"), or float16 (EngineConfig.kv_cache_dtype, else $KV_CACHE_DTYPE).
    A float32 model's float16 pool is read and written by the C kernel only (eager steps, the "kernel" backend)."""
    name = config.kv_cache_dtype or os.environ.get("KV_CACHE_DTYPE") or "auto"
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"Unknown KV cache dtype {name!r}; choose one of {', '.join(KV_CACHE_DTYPES)}.")
    if name == "auto" or dtype == torch.float16:
        return dtype
    if dtype != torch.float32 or backend != "kernel" or not eager:
        raise ValueError(f"A float16 KV pool takes a float32 model on the CPU's 'kernel' attention backend with eager "
                         f"steps, not a {str(dtype).removeprefix('torch.')} model on {backend!r}"
                         f"{'' if eager else ' with static decode buffers'}; set KV_CACHE_DTYPE=auto.")
    return torch.float16


class ModelRunner:
    def __init__(self, model, config: EngineConfig) -> None:
        self.model = model
        self.config = config
        self.device = next(model.parameters()).device
        self.max_len = min(config.max_model_len or context_length(model), context_length(model))
        self.dtype = next(model.parameters()).dtype
        attention.register()
        self.original_attn = model.config._attn_implementation
        model.set_attn_implementation(attention.ATTN_NAME)
        self.packed_linears = pack_linears(model) if config.pack_cpu_linears else 0
        layers, kv_heads, head_dim = kv_shape(model)
        self.attention_backend = attention.choose_backend(config.attention_backend, self.device, self.dtype,
                                                            config.block_size)
        eager = config.enforce_eager if config.enforce_eager is not None else self.device.type != "cuda"
        self.kv_dtype = kv_cache_dtype(config, self.dtype, self.attention_backend, eager)
        bytes_per_block = 2 * layers * config.block_size * kv_heads * head_dim * self.kv_dtype.itemsize
        self.sizing = sizing.size_for(model, config, self.device, bytes_per_block)   # slots and pool per device
        config.max_num_seqs, self.num_blocks = self.sizing.max_num_seqs, self.sizing.num_blocks
        config.max_num_batched_tokens = self.sizing.max_num_batched_tokens
        config.overlap_steps = sizing.overlap_for(config, self.device.type)
        # Allocated once; every step writes into it in place. The block past num_blocks is scratch for
        # the padding rows of bucketed decode steps; the block manager never hands it out.
        self.kv = torch.zeros(2, layers, kv_heads, self.num_blocks + 1, config.block_size, head_dim,
                              dtype=self.kv_dtype, device=self.device)
        log.info("attention backend: %s (%s, %s; KV pool %s)", self.attention_backend, self.device.type, self.dtype,
                 self.kv_dtype)
        if self.attention_backend == "flex" or not eager or self.device.type == "cuda":
            flex.start_engine(tuple(self.kv.shape), query_group(model), self.dtype, str(self.device))
        if self.attention_backend == "flex" and not flex.fits(self.device, config.block_size):
            raise ValueError(f"The 'flex' attention backend needs a block_size that is a multiple of "
                             f"{flex.GPU_MIN_BLOCK} on {self.device.type}, not {config.block_size}; "
                             "change block_size or use 'gather'.")
        self.takes_logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        # Decoder layers compiled for steps with Triton attention (compiled.py): decode graphs are captured from
        # them, and eager steps run them once they have compiled (_compile_eager).
        self.compiled: CompiledLayers | None = None
        self.compiled_eager = False
        self.not_compiled = ""
        if sizing.compile_for(config, self.device.type):
            try:
                self.compiled = CompiledLayers(model)
            except ValueError as exc:
                self.not_compiled = str(exc)
                log.warning("steps run the model uncompiled: %s", exc)
        # CPU steps through the C attention kernel: each layer's elementwise work in C as well (fused.py)
        self.fused: FusedLayers | None = None
        if (self.compiled is None and self.attention_backend == "kernel" and self.device.type == "cpu"
                and sizing.fused_for(config)):
            try:
                self.fused = FusedLayers(model)
            except ValueError as exc:
                log.info("decoder layers run the model's own code: %s", exc)
        # Static buffers and bucketed decode graphs: on by default on CUDA; on CPU only when asked
        # (enforce_eager=False), where they run eagerly.
        self.decode_graphs: DecodeGraphs | None = None
        if not eager:
            self.decode_graphs = self._static_decode(model, config)
        self.paged = self._paged_tables(config)   # eager steps' block tables, when they read the pool in place
        if self.paged is not None and self.device.type == "cuda":
            self._warm_prefill()
        if self.attention_backend == "triton" and self.device.type == "cuda":
            from .attention import paged_triton

            _, kv_heads, _ = kv_shape(model)
            paged_triton.warm_up(self.kv[0, 0], self.kv[1, 0], kv_heads * query_group(model), self.num_blocks)
        if self.compiled is not None and self.attention_backend in COMPILED_BACKENDS:
            self._compile_eager()
        # Decode rows keep their sequences from step to step wherever block tables persist on the device.
        self.row_order = RowOrder() if self.decode_graphs is not None or self.paged is not None else None

    def _static_decode(self, model, config: EngineConfig) -> DecodeGraphs | None:
        """Static decode buffers (graphs on CUDA) with the decode attention asked for, else the first of
        "flex", "gather" whose graphs capture; None (eager decode steps) when neither does."""
        requested = attention.choose_decode_attention(config.decode_attention)
        modes = [requested] if requested else list(attention.DECODE_MODES)
        if not requested and self.attention_backend != "triton":   # Triton decode goes with Triton eager steps
            modes = [m for m in modes if m != "triton"]
        if "flex" in modes and not flex.fits(self.device, config.block_size):
            log.warning("flex decode attention needs a block size that is a multiple of %d on %s, not %d: "
                        "decode graphs gather", flex.GPU_MIN_BLOCK, self.device.type, config.block_size)
            modes = [m for m in modes if m != "flex"] or ["gather"]
        if "triton" in modes and not attention.triton_available():
            modes = [m for m in modes if m != "triton"] or ["flex"]
        for mode in modes:
            graphs = DecodeGraphs(model, self.kv, self.num_blocks, config.block_size, config.max_num_seqs,
                                  self.max_len, use_graphs=True, attention_mode=mode, group=query_group(model),
                                  compiled=self.compiled)
            if graphs.capture():
                return graphs
        return None

    def _paged_tables(self, config: EngineConfig) -> flex.PagedTables | None:
        """Block-table buffers for eager steps that read the pool in place: always with the flex backend; with
        gather wherever FlexAttention's decoding kernel is known to run (decode graphs captured with it, or
        CUDA with no graphs), so that a mixed step copies no context out. Shared with flex decode graphs: the
        same rows, width and compiled row counts."""
        graphs = self.decode_graphs
        if self.attention_backend == "gather":
            if not flex.fits(self.device, config.block_size):
                return None
            if (graphs is not None and not graphs.flex) or (graphs is None and self.device.type != "cuda"):
                return None
        elif self.attention_backend != "flex":
            return None
        if graphs is not None and graphs.flex:
            return graphs.paged
        return flex.PagedTables(config.max_num_seqs, -(-self.max_len // config.block_size), self.num_blocks + 1,
                                config.block_size, query_group(self.model), self.num_blocks, self.device)

    @torch.inference_mode()
    def _compile_eager(self) -> None:
        """Compile the layers for eager steps now (not in the first request's step): two sequences of one and two
        tokens over the scratch block, which is all they write. A failure is logged and eager steps stay with the
        model's own code."""
        bs, scratch = self.config.block_size, self.num_blocks
        spans = [Span(0, 1, 1, [scratch, scratch]), Span(1, 2, 2, [scratch, scratch])]
        start = time.perf_counter()
        try:
            self._forward([0, 0, 0], [0, 0, 1], [scratch * bs, scratch * bs, scratch * bs + 1], [2], spans, 0,
                          compiled=True)
        except Exception as exc:
            self.not_compiled = f"{type(exc).__name__}: {exc}".splitlines()[0][:300]
            log.warning("eager steps run the model uncompiled: compiling it failed (%s)", self.not_compiled)
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.compiled_eager = True
        log.info("eager steps compiled in %.1f s", time.perf_counter() - start)

    @torch.inference_mode()
    def _warm_prefill(self) -> None:
        """Compile FlexAttention's prefill form now (as steps run it, under inference mode), not in the first
        step that prefills over a cached prefix."""
        start = time.perf_counter()
        _, kv_heads, _ = kv_shape(self.model)
        flex.warm_prefill(self.paged, self.kv[0, 0], self.kv[1, 0], kv_heads * query_group(self.model))
        log.info("FlexAttention's prefill form compiled in %.1f s", time.perf_counter() - start)

    def describe_steps(self) -> str:
        """How steps run: the attention backend (and the KV pool's dtype where it is not the model's), overlapped or
        not, and decode graphs (captured, buckets only, or none)."""
        line = f"attention {self.attention_backend}"
        if self.attention_backend == "kernel":
            line += f" ({native.attention_path()} path)"
        if self.kv_dtype != self.dtype:
            line += f" over a {str(self.kv_dtype).removeprefix('torch.')} KV pool"
        if self.attention_backend == "gather" and self.paged is not None:
            line += " (cached context read in place)"
        line += "; steps overlapped" if self.config.overlap_steps else "; steps not overlapped"
        if self.compiled_eager:
            line += "; eager steps compiled"
        if self.fused is not None:
            whole = any(w is not None for w in self.fused.whole)
            line += "; layers fused (C, one call a layer)" if whole else "; layers fused (C)"
        graphs = self.decode_graphs
        if graphs is None:
            return line + "; decode steps eager"
        if graphs.compiled is not None:
            line += f"; decode step compiled in {graphs.compile_s:.1f} s"
        elif graphs.not_compiled:
            line += f"; decode step not compiled ({graphs.not_compiled.splitlines()[0][:120]})"
        if graphs.graphs:
            return line + (f"; {len(graphs.graphs)} decode graphs ({graphs.attention_mode} attention) captured in "
                           f"{graphs.capture_s:.2f} s, {graphs.graph_bytes / 2**20:.1f} MiB")
        return (line + f"; decode steps through {len(graphs.sizes)} static buckets ({graphs.attention_mode} "
                       "attention), no graphs")

    def release_model(self) -> None:
        """Give the model back as it came: dense linears, its own layers' code and its own attention."""
        if self.compiled is not None:
            self.compiled.release()
        if self.fused is not None:
            self.fused.release()
        unpack_linears(self.model)
        self.model.set_attn_implementation(self.original_attn)

    @torch.inference_mode()
    def run(self, batch: Batch, pending: torch.Tensor | None = None) -> torch.Tensor:
        """Forward the packed batch; logits [rows, vocab] for decodes and prefills that finish this step, in
        batch order, and every row of a prefill chunk from the first position it scores (`Sequence.scored_from`).

        pending: the previous step's sampled tokens while they are still on their way to the host; a sequence
        whose last token is one of them (`Sequence.pending`) reads it from there."""
        bs = self.config.block_size
        if self.row_order is not None:   # the order the engine samples in follows the rows
            batch.decodes = self.row_order.arrange(batch.decodes)
        fixes = [(row, seq.pending) for row, seq in enumerate(batch.decodes) if seq.pending is not None]
        graphs = self.decode_graphs
        if (graphs is not None and not batch.prefills
                and graphs.fits(len(batch.decodes), max(seq.num_tokens for seq in batch.decodes))):
            return self._run_static(batch, pending, fixes)
        ids, positions, slots, keep, spans = [], [], [], [], []
        for seq in batch.decodes:
            pos = seq.num_tokens - 1
            table = seq.block_table
            spans.append(Span(len(ids), 1, pos + 1, table, (seq, seq.num_preemptions)))
            ids.append(seq.token_ids[-1])
            positions.append(pos)
            slots.append(table[pos // bs] * bs + pos % bs)
        keep.extend(range(len(batch.decodes)))

        for seq, n in batch.prefills:
            start, first = len(ids), seq.num_computed_tokens
            span = range(first, first + n)
            ids.extend(seq.token_ids[first:first + n])
            positions.extend(span)
            table = seq.block_table
            slots.extend(table[p // bs] * bs + p % bs for p in span)
            context = first + n
            spans.append(Span(start, n, context, table))
            scored = seq.scored_from
            if scored is not None and context > scored:   # each row scores the token after it (the last one samples)
                keep.extend(range(start + max(0, scored - first), start + n))
            elif context == seq.num_tokens:   # the whole sequence is in: its last row gives the next token
                keep.append(start + n - 1)

        return self._forward(ids, positions, slots, keep, spans, len(batch.decodes), pending, fixes,
                             self.compiled_eager)

    def _forward(self, ids: list[int], positions: list[int], slots: list[int], keep: list[int], spans: list[Span],
                 num_decodes: int, pending: torch.Tensor | None = None, fixes: list[tuple[int, int]] = (),
                 compiled: bool = False) -> torch.Tensor:
        """An eager step's forward; compiled: through the compiled layers, the step's buffers as arguments."""
        step = {}
        if compiled and len(ids) == 1:
            # One token runs as two, so that the compiled code never meets a size of one (which it would
            # specialise): the padding row writes and reads the scratch block alone.
            scratch = self.num_blocks
            ids, positions = ids + [0], positions + [0]
            slots, spans = slots + [scratch * self.config.block_size], spans + [Span(1, 1, 1, [scratch])]
        ctx = attention.build_context(self.attention_backend, self.kv, slots, spans, num_decodes,
                                      self.config.block_size, self.paged, query_group(self.model),
                                      least=2 if compiled else 1)
        if compiled:
            step = dict(engine_kv=ctx.kv, engine_slots=ctx.slots)
            if ctx.backend == "kernel":
                step["engine_rows"] = ctx.kernel_tensors
            else:
                step["engine_plan"] = ctx.chunk_plan.parts()
        attention.set_context(ctx)
        try:
            input_ids = upload([ids], torch.long, self.device)
            position_ids = upload([positions], torch.long, self.device)
            keep_t = upload(keep, torch.long, self.device)
            place_pending(input_ids[0], pending, fixes)
            if self.takes_logits_to_keep:
                out = self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                                 logits_to_keep=keep_t, **step)
                return out.logits[0]
            return self.model(input_ids=input_ids, position_ids=position_ids, use_cache=False,
                              **step).logits[0, keep_t]
        finally:
            attention.set_context(None)

    def _run_static(self, batch: Batch, pending: torch.Tensor | None, fixes: list[tuple[int, int]]) -> torch.Tensor:
        bs = self.config.block_size
        seqs = batch.decodes
        positions = [seq.num_tokens - 1 for seq in seqs]
        slots = [seq.block_table[p // bs] * bs + p % bs for seq, p in zip(seqs, positions)]
        return self.decode_graphs.run([seq.token_ids[-1] for seq in seqs], positions, slots,
                                      [seq.block_table for seq in seqs], pending, fixes,
                                      [(seq, seq.num_preemptions) for seq in seqs])
