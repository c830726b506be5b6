"""Iteration-level scheduling: which sequences run in the next forward pass, and how many tokens each."""

from __future__ import annotations

import bisect
import time
from collections import deque
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


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager) -> None:
        self.config = config
        self.blocks = blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []   # kept in arrival order: the newest is preempted first
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        """Queue in order of arrival, not of submission: requests handed over by several threads (or
        redelivered after a fault) are admitted first come, first served. New arrivals are usually the
        newest, so the scan from the back stops at once; preempted sequences stay at the front."""
        index = len(self.waiting)
        while (index and self.waiting[index - 1].num_preemptions == 0
               and self.waiting[index - 1].arrival_time > seq.arrival_time):
            index -= 1
        self.waiting.insert(index, seq)

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
        i = 0
        while (i < len(self.waiting) and not preempted and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[i]
            if seq.waits_for_leader and self.blocks.enable_prefix_caching:
                i += 1   # a later choice: the first one's prompt blocks will be its cache hits
                continue
            if not seq.block_table:
                # A request scoring its prompt computes every prompt row: no cache hits.
                seq.num_computed_tokens = 0 if seq.wants_prompt_logprobs else self.blocks.allocate_cached_prefix(seq)
                seq.num_cached_tokens = max(seq.num_cached_tokens, seq.num_computed_tokens)
            want = min(seq.num_uncomputed, budget)
            if not self.blocks.ensure_capacity(seq, seq.num_computed_tokens + want):
                self.blocks.release(seq)   # it waits; keep no blocks while waiting
                seq.num_computed_tokens = 0
                break
            del self.waiting[i]
            seq.status = Status.RUNNING
            if seq.admitted_time is None:
                seq.admitted_time = time.time()
            bisect.insort(self.running, seq, key=lambda s: s.arrival_time)
            batch.prefills.append((seq, want))
            budget -= want
        return batch, impossible

    def _preempt(self, seq: Sequence) -> None:
        """Drop a sequence's cache and requeue it first; it is recomputed later with the same tokens."""
        self.running.remove(seq)
        self.blocks.release(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
