"""Decode steps through static input buffers at bucketed batch sizes, replayed as CUDA graphs on CUDA.

A decode-only step of n sequences runs in the smallest bucket >= n: its token ids, positions, cache
slots, block tables and context lengths are copied into fixed buffers, the rows past n are padding
(they write to a scratch block of the pool and read one key of it), and the bucket's captured graph
replays. On CPU there are no graphs: with EngineConfig.enforce_eager=False the same buffers and
buckets run eagerly (how the tests exercise this path); by default CPU steps skip it entirely.
"""

from __future__ import annotations

import logging
import time

import torch

from . import attention
from .attention import StepContext

log = logging.getLogger(__name__)

# The static block tables cover this many tokens at most: decode attention gathers the whole width
# in a graph, so a longer context would cost every step. Steps past it run eagerly.
MAX_GRAPH_CONTEXT = 2048


def buckets(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, 16, 24, 32, ... (steps of 8 from 16) up to max_num_seqs, which is always the last."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 8))
    return sizes + [max_num_seqs]


class DecodeGraphs:
    """Static buffers for decode steps of up to max_num_seqs sequences, and one graph per bucket."""

    def __init__(self, model, kv: torch.Tensor, scratch_block: int, block_size: int, max_num_seqs: int,
                 max_model_len: int, use_graphs: bool) -> None:
        self.model = model
        self.kv = kv
        self.block_size = block_size
        self.sizes = buckets(max_num_seqs)
        self.width = -(-min(max_model_len, MAX_GRAPH_CONTEXT) // block_size)   # block-table columns
        self.scratch_slot = scratch_block * block_size
        self.scratch_block = scratch_block
        device = kv.device
        n = self.sizes[-1]
        self.input_ids = torch.zeros(1, n, dtype=torch.long, device=device)
        self.positions = torch.zeros(1, n, dtype=torch.long, device=device)
        self.slots = torch.full((n,), self.scratch_slot, dtype=torch.long, device=device)
        self.tables = torch.full((n, self.width), scratch_block, dtype=torch.long, device=device)
        self.context = torch.ones(n, dtype=torch.long, device=device)
        # Host staging: one non-blocking copy per step into the device buffers.
        pin = device.type == "cuda"
        self.host = torch.zeros(4 * n + n * self.width, dtype=torch.long, pin_memory=pin)
        self.use_graphs = use_graphs and device.type == "cuda"
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.steps_per_bucket = dict.fromkeys(self.sizes, 0)
        self.padding_rows = 0
        self.capture_s = 0.0
        self.graph_bytes = 0

    def _forward(self, n: int) -> torch.Tensor:
        positions = torch.arange(self.width * self.block_size, device=self.kv.device)
        mask = positions[None, :] < self.context[:n, None]
        ctx = StepContext(kv=self.kv, slots=self.slots[:n], backend="gather", num_decodes=n,
                          decode_blocks=self.tables[:n], decode_mask=mask[None, :, None, :])
        attention.set_context(ctx)
        try:
            return self.model(input_ids=self.input_ids[:, :n], position_ids=self.positions[:, :n],
                              use_cache=False).logits[0]
        finally:
            attention.set_context(None)

    @torch.inference_mode()
    def capture(self) -> bool:
        """Capture every bucket, largest first so smaller ones reuse its memory pool; log time and memory.

        A model whose forward cannot be captured (a host sync, a data-dependent shape) runs eagerly: the
        failure is logged and False returned."""
        if not self.use_graphs:
            return True
        try:
            self._capture_all()
        except Exception:
            log.exception("decode graphs could not be captured: decode steps run eagerly")
            self.graphs.clear()
            self.outputs.clear()
            torch.cuda.synchronize(self.kv.device)
            torch.cuda.empty_cache()
            return False
        return True

    def _capture_all(self) -> None:
        start, before = time.perf_counter(), torch.cuda.memory_allocated(self.kv.device)
        pool = None
        for n in reversed(self.sizes):
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
        log.info("captured %d decode graphs (batch %s) in %.2f s, %.1f MiB", len(self.graphs),
                 ",".join(map(str, self.sizes)), self.capture_s, self.graph_bytes / 2**20)

    def fits(self, num_decodes: int, max_context: int) -> bool:
        return 0 < num_decodes <= self.sizes[-1] and max_context <= self.width * self.block_size

    def bucket(self, n: int) -> int:
        return next(b for b in self.sizes if b >= n)

    def run(self, tokens: list[int], positions: list[int], slots: list[int], tables: list[list[int]]) -> torch.Tensor:
        """Logits [n, vocab] of a decode step of n sequences, through the static buffers."""
        n = len(tokens)
        b = self.bucket(n)
        w, pad, scratch = self.width, b - n, self.scratch_block
        rows = torch.tensor([tokens + [0] * pad, positions + [0] * pad, slots + [self.scratch_slot] * pad,
                             [p + 1 for p in positions] + [1] * pad])
        table = torch.tensor([t[:w] + [scratch] * (w - len(t)) for t in tables] + [[scratch] * w] * pad)
        staged = self.host[:4 * b + b * w]
        staged[:4 * b].view(4, b).copy_(rows)
        staged[4 * b:].view(b, w).copy_(table)
        self.input_ids[0, :b].copy_(staged[:b], non_blocking=True)
        self.positions[0, :b].copy_(staged[b:2 * b], non_blocking=True)
        self.slots[:b].copy_(staged[2 * b:3 * b], non_blocking=True)
        self.context[:b].copy_(staged[3 * b:4 * b], non_blocking=True)
        self.tables[:b].copy_(staged[4 * b:].view(b, w), non_blocking=True)
        self.steps_per_bucket[b] += 1
        self.padding_rows += pad
        graph = self.graphs.get(b)
        if graph is None:
            return self._forward(b)[:n]
        graph.replay()
        return self.outputs[b][:n]
