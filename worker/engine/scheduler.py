"""Iteration-level scheduling: which sequences run in the next forward pass, and how many tokens each.

Requests are served by service class (sequence.SERVICE_CLASSES), then by arrival. A waiting interactive request
that finds every slot or the KV pool taken preempts the newest request of a lower class, so it starts in this
step (the preempted one resumes later with the same tokens, its full blocks kept in the prefix cache while the
pool can hold them). Bulk requests are not starved: while they wait and bulk work has less than
EngineConfig.bulk_token_share of the step's token budget, the first of them is admitted ahead of standard ones.
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field

from .block_manager import BlockManager
from .config import EngineConfig
from .sequence import Sequence, Status


@dataclass
class Batch:
    """One step's work. Decodes come first so their rows are contiguous in the packed tokens."""

    decodes: list[Sequence] = field(default_factory=list)
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)   # (sequence, tokens this step)

    @property
    def num_seqs(self) -> int:
        return len(self.decodes) + len(self.prefills)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(n for _, n in self.prefills)

    def __bool__(self) -> bool:
        return bool(self.decodes or self.prefills)


def _waiting_order(seq: Sequence) -> tuple:
    """Class first; within a class preempted sequences first, then arrival (not submission: requests handed over
    by several threads, or redelivered after a fault, are served first come, first served)."""
    return seq.rank, seq.num_preemptions == 0, seq.arrival_time


def _running_order(seq: Sequence) -> tuple:
    """Class, then arrival: the last running sequence is the newest of the least urgent class, preempted first."""
    return seq.rank, seq.arrival_time


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: list[Sequence] = []   # in _waiting_order
        self.running: list[Sequence] = []   # in _running_order
        self.num_preemptions = 0
        self.num_class_preemptions = 0      # of them, made to start a waiting interactive request

    def add(self, seq: Sequence) -> None:
        bisect.insort(self.waiting, seq, key=_waiting_order)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: Sequence) -> None:
        """Take a sequence out of the queues and give its blocks back."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.blocks.release(seq)

    def schedule(self) -> tuple[Batch, list[Sequence]]:
        """Plan the next step; also return sequences that can never fit and must be failed."""
        batch, budget, preempted, impossible = Batch(), self.config.max_num_batched_tokens, False, []
        self._make_room_for_interactive(budget)

        for seq in list(self.running):
            if seq.status is not Status.RUNNING or budget == 0:
                continue
            want = 1 if seq.num_uncomputed == 1 else min(seq.num_uncomputed, budget)
            while not self.blocks.ensure_capacity(seq, seq.num_computed_tokens + want):
                victim = self.running[-1]
                if victim is seq and len(self.running) == 1:
                    impossible.append(seq)   # alone and still out of blocks: the pool is too small for it
                    break
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is not Status.RUNNING or seq in impossible:
                continue
            if want == 1 and seq.num_uncomputed == 1:
                batch.decodes.append(seq)
            else:
                batch.prefills.append((seq, want))
            budget -= want

        # A step that had to preempt admits nobody: the pool is already short.
        if not preempted:
            self._admit(batch, budget)
        return batch, impossible

    def _admit(self, batch: Batch, budget: int) -> None:
        """Admit waiting sequences in order while slots, tokens and blocks last (a bulk one may go first, below)."""
        order = list(self.waiting)
        share = self.config.bulk_token_share * self.config.max_num_batched_tokens
        bulk = next((s for s in order if s.service_class == "bulk"), None)
        bulk_tokens = (sum(1 for s in batch.decodes if s.service_class == "bulk")
                       + sum(n for s, n in batch.prefills if s.service_class == "bulk"))
        capped = None
        if bulk is not None and share and bulk_tokens < share:   # ahead of standard, after interactive
            order.remove(bulk)
            order.insert(next((i for i, s in enumerate(order) if s.rank > 0), len(order)), bulk)
            capped = bulk
        for seq in order:
            if budget <= 0 or len(self.running) >= self.config.max_num_seqs:
                break
            if seq.waits_for_leader and self.blocks.enable_prefix_caching:
                continue   # a later choice: the first one's prompt blocks will be its cache hits
            if not seq.block_table:
                # A request scoring its prompt (or a continued answer's tokens) computes every row: no cache hits.
                seq.num_computed_tokens = 0 if seq.scored_from is not None else self.blocks.allocate_cached_prefix(seq)
                seq.num_cached_tokens = max(seq.num_cached_tokens, seq.num_computed_tokens)
            want = min(seq.num_uncomputed, budget)
            if seq is capped:   # its floor, leaving the rest of the step to the classes above it
                want = min(want, max(1, int(share - bulk_tokens)))
            if not self.blocks.ensure_capacity(seq, seq.num_computed_tokens + want):
                self.blocks.release(seq)   # it waits; keep no blocks while waiting
                seq.num_computed_tokens = 0
                break
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            if seq.admitted_time is None:
                seq.admitted_time = time.time()
            bisect.insort(self.running, seq, key=_running_order)
            batch.prefills.append((seq, want))
            budget -= want

    def _make_room_for_interactive(self, budget: int) -> None:
        """When the first waiting request is interactive and every slot, or the blocks its first chunk needs, are
        taken, preempt the newest running requests of lower classes (the least urgent first) until it fits."""
        head = next((s for s in self.waiting
                     if not (s.waits_for_leader and self.blocks.enable_prefix_caching)), None)
        if head is None or head.rank != 0:
            return
        need = self.blocks.blocks_needed(min(head.num_tokens, budget))
        while self.running and self.running[-1].rank > head.rank:
            if len(self.running) < self.config.max_num_seqs and self.blocks.num_free >= need:
                return
            self._preempt(self.running[-1])
            self.num_class_preemptions += 1

    def _preempt(self, seq: Sequence) -> None:
        """Drop a sequence's cache and requeue it first; it is recomputed later with the same tokens."""
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.add(seq)
