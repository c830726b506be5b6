"""Decode steps through static input buffers at bucketed batch sizes, replayed as CUDA graphs on CUDA.

A decode-only step of n sequences runs in the smallest bucket >= n: its token ids, positions, cache
slots and context lengths are copied into fixed buffers (one contiguous pinned copy whatever the bucket,
transfer.StagedBuffer), its block tables are brought up to date in place (block_tables.SlotTables: a
row's new ids only), the rows past n are padding (they write to a scratch block of the pool and read one
key of it), and the bucket's captured graph replays. Decode attention reads the pool in place through the
Triton kernels ("triton": the rows' contexts split to fill the GPU, splits fixed per bucket) or a compiled
FlexAttention kernel whose block lists are the step's block tables ("flex"); both take any context length. Or
it gathers each row's blocks up to a static width ("gather", MAX_GRAPH_CONTEXT tokens at most). On CPU there are no graphs: with EngineConfig.enforce_eager=False the same buffers and buckets
run eagerly (how the tests exercise this path); by default CPU steps skip it entirely.
"""

from __future__ import annotations

import logging
import time

import torch

from . import attention
from .attention import flex
from .attention import StepContext
from .compiled import CompiledLayers
from .block_tables import SlotTables
from .transfer import StagedBuffer, Staging, place_pending

log = logging.getLogger(__name__)

# With "gather", the static block tables cover this many tokens at most: decode attention gathers the
# whole width in a graph, so a longer context would cost every step. Steps past it run eagerly.
MAX_GRAPH_CONTEXT = 2048


def buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, ... (steps of 8 from 16) up to max_num_seqs, which is always the last."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 8))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """Static buffers for decode steps of up to max_num_seqs sequences, and one graph per bucket."""

    def __init__(self, model, kv: torch.Tensor, scratch_block: int, block_size: int, max_num_seqs: int,
                 max_model_len: int, use_graphs: bool, attention_mode: str = "flex", group: int = 1,
                 compiled: CompiledLayers | None = None) -> None:
        """group: query heads per KV head. compiled: the model's compiled decoder layers (compiled.py, the
        runner's), which decode steps run through with Triton decode attention, each bucket's graph then
        captured from the compiled code."""
        if attention_mode not in attention.DECODE_MODES:
            raise ValueError(f"Unknown decode attention {attention_mode!r}; choose one of "
                             f"{', '.join(attention.DECODE_MODES)}.")
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.attention_mode = attention_mode
        compile = compiled is not None and attention_mode == "triton"
        # Compiled, a step of one row runs in bucket 2: the compiler would specialise a row count of one apart.
        self.sizes = [b for b in buckets(max_num_seqs) if not compile or b > 1 or b == max_num_seqs]
        self.flex = attention_mode == "flex"
        self.triton = attention_mode == "triton"
        self.kv_heads = kv.shape[2]
        # Block-table columns: a row's longest context in place ("flex", "triton"), the gathered width otherwise.
        in_place = self.flex or self.triton
        self.width = -(-(max_model_len if in_place else min(max_model_len, MAX_GRAPH_CONTEXT)) // block_size)
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        device = kv.device
        n = self.sizes[-1]
        # rows: token ids, positions, cache slots, context lengths; one non-blocking copy per step, laid out
        # so that every bucket's rows are one contiguous block.
        self.rows = StagedBuffer(4, n, torch.long, device)
        self.staging = Staging(device)
        self.paged: flex.PagedTables | None = None
        self.tables: SlotTables | None = None
        if self.flex:
            self.paged = flex.PagedTables(n, self.width, kv.shape[3], block_size, group, scratch_block, device)
        else:
            self.tables = SlotTables(n, self.width, scratch_block, torch.int32 if self.triton else torch.long, device)
        self.use_graphs = use_graphs and device.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.steps_per_bucket = dict.fromkeys(self.sizes, 0)
        self.padding_rows = 0
        self.capture_s = 0.0
        self.graph_bytes = 0
        self.compiled = compiled if compile else None
        self.compile_s = 0.0
        self.not_compiled = "" if compiled is None or self.triton else "decode attention is not triton"

    def _pad(self, n: int) -> None:
        """Bucket n's rows all padding: a forward outside `run` (warm-up, capture) then writes and reads only the
        scratch block."""
        self.staging.wait()
        self.rows.put([[0] * n, [0] * n, [self.scratch_slot] * n, [1] * n], n)
        if self.flex:
            self.paged.reset(self.paged.rows_for(n))
        self.staging.record()

    def _forward(self, n: int) -> torch.Tensor:
        """The forward of bucket n, reading that bucket's views of the buffers."""
        input_ids, positions, slots, context = self.rows.device(n)
        ctx = StepContext(kv=self.kv, slots=slots, backend="gather", num_decodes=n)
        if self.compiled is not None:   # the step's buffers go to every layer as arguments
            return self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                              engine_kv=self.kv, engine_slots=slots, engine_tables=self.tables.tables[:n],
                              engine_lens=context).logits[0]
        if self.flex:
            ctx.decode_block_mask = self.paged.mask(self.paged.rows_for(n))
        elif self.triton:
            from .attention import paged_triton

            ctx.decode_tables, ctx.decode_lens = self.tables.tables[:n], context
            ctx.decode_splits = paged_triton.splits_for(n, self.kv_heads, self.kv.device)
        else:
            keys = torch.arange(self.width * self.block_size, device=self.kv.device)
            mask = keys[None, :] < context[:, None]
            ctx.decode_blocks, ctx.decode_mask = self.tables.tables[:n], mask[None, :, None, :]
        attention.set_context(ctx)
        try:
            return self.model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False).logits[0]
        finally:
            attention.set_context(None)

    @torch.inference_mode()
    def capture(self) -> bool:
        """Capture every bucket, largest first so smaller ones reuse its memory pool; log time and memory.

        A forward that cannot be captured (a host sync, a data-dependent shape, a kernel that does not
        compile) is logged and False returned: the caller tries the next decode attention, or runs eagerly."""
        if self.compiled is not None and not self._compile():
            return self.capture()
        if not self.use_graphs:
            return True
        try:
            self._capture_all()
        except Exception as exc:
            if self.compiled is not None:   # the compiled forward does not capture: capture the model's own
                self._uncompile(f"{type(exc).__name__}: {exc}")
                return self.capture()
            log.exception("decode graphs with %s attention could not be captured", self.attention_mode)
            self.graphs.clear()
            self.outputs.clear()
            torch.cuda.synchronize(self.kv.device)
            torch.cuda.empty_cache()
            return False
        return True

    def _compile(self) -> bool:
        """Compile the layers now, on the largest bucket (the row count symbolic); False (logged) when it fails,
        and the model runs uncompiled."""
        start = time.perf_counter()
        try:
            n = self.sizes[-1]
            self._pad(n)
            self._forward(n)
        except Exception as exc:
            self._uncompile(f"{type(exc).__name__}: {exc}")
            return False
        if self.kv.device.type == "cuda":
            torch.cuda.synchronize(self.kv.device)
        self.compile_s = time.perf_counter() - start
        log.info("decode step compiled in %.1f s", self.compile_s)
        return True

    def _uncompile(self, why: str) -> None:
        log.warning("decode steps run the model uncompiled: compiling it failed (%s)", why.splitlines()[0][:300])
        self.compiled, self.not_compiled = None, why
        self.graphs.clear()
        self.outputs.clear()
        if self.kv.device.type == "cuda":
            torch.cuda.synchronize(self.kv.device)
            torch.cuda.empty_cache()

    def _capture_all(self) -> None:
        start, before = time.perf_counter(), torch.cuda.memory_allocated(self.kv.device)
        pool = None
        for n in reversed(self.sizes):
            self._pad(n)
            self._forward(n)   # warm-up outside the graph: lazy initialisation, cuBLAS workspaces
            torch.cuda.synchronize(self.kv.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[n] = self._forward(n)
            pool = graph.pool()
            self.graphs[n] = graph
        torch.cuda.synchronize(self.kv.device)
        self.capture_s = time.perf_counter() - start
        self.graph_bytes = torch.cuda.memory_allocated(self.kv.device) - before
        log.info("captured %d decode graphs (batch %s, %s attention) in %.2f s, %.1f MiB", len(self.graphs),
                 ",".join(map(str, self.sizes)), self.attention_mode, self.capture_s, self.graph_bytes / 2**20)

    def fits(self, num_decodes: int, max_context: int) -> bool:
        return 0 < num_decodes <= self.sizes[-1] and max_context <= self.width * self.block_size

    def bucket(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def run(self, tokens: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            pending: torch.Tensor | None = None, fixes: list[tuple[int, int]] = (),
            owners: list | None = None) -> torch.Tensor:
        """Logits [n, vocab] of a decode step of n sequences, through the static buffers.

        fixes: (row, i) for rows whose token is still on the device, as `pending[i]` (the previous step's
        sampled tokens, not yet read back). owners: what identifies each row's table from step to step
        (SlotTables); None: every id is written."""
        n = len(tokens)
        b = self.bucket(n)
        pad = b - n
        context = [p + 1 for p in positions]
        self.staging.wait()
        rows = self.rows.put([tokens + [0] * pad, positions + [0] * pad, slots + [self.scratch_slot] * pad,
                              context + [1] * pad], b)
        if self.flex:
            self.paged.fill(tables, context, self.paged.rows_for(b), owners)
        else:   # the blocks covering each context; padding rows' columns hold any id, masked past one key
            bs = self.block_size
            self.tables.write(owners or [None] * n, tables, [-(-c // bs) for c in context])
        self.staging.record()
        place_pending(rows[0], pending, fixes)
        self.steps_per_bucket[b] += 1
        self.padding_rows += pad
        graph = self.graphs.get(b)
        if graph is None:
            return self._forward(b)[:n]
        graph.replay()
        return self.outputs[b][:n]
