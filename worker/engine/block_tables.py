"""Decode rows' block tables kept on the device from step to step: a sequence keeps its row, and a step writes
only the block ids that are new."""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import torch


class RowOrder:
    """Places a step's decoding sequences in rows 0..n-1 so that each keeps the row it had the step before.

    A row freed by a sequence that left (finished, preempted) goes to a newcomer; when the batch shrinks, a
    sequence in a row past the new count moves into a freed one. Either way only that row's table is written
    again (SlotTables), not every row behind it, as a list order would shift them."""

    def __init__(self) -> None:
        self._rows: dict[Hashable, int] = {}

    def arrange(self, seqs: Sequence) -> list:
        """The sequences in their rows' order."""
        n = len(seqs)
        rows: list = [None] * n
        movers = []
        for seq in seqs:
            row = self._rows.get(seq)
            if row is not None and row < n and rows[row] is None:
                rows[row] = seq
            else:
                movers.append(seq)
        free = (i for i, seq in enumerate(rows) if seq is None)
        for seq, row in zip(movers, free):
            rows[row] = seq
        self._rows = {seq: i for i, seq in enumerate(rows)}
        return rows

    def row(self, seq: Hashable) -> int | None:
        """The row the sequence had in the last step, None if it did not decode then."""
        return self._rows.get(seq)


class SlotTables:
    """Block ids of up to `rows` decode rows, a [rows, width] tensor on the device that persists across steps.

    `write` is given each row's owner, table and count of ids in use. A row whose owner is the one it had
    (the same sequence, not preempted since) gets only the ids past those it already holds: one id when a
    decode crosses into a new block, nothing on the other block_size - 1 steps. A row with a new owner, or
    an owner of None (unknown), is written whole. Columns past a row's count keep stale ids of the pool,
    which readers never use (FlexAttention) or mask (gather)."""

    def __init__(self, rows: int, width: int, fill: int, dtype: torch.dtype, device: torch.device) -> None:
        self.tables = torch.full((rows, width), fill, dtype=dtype, device=device)
        self.width = width
        self._owners: list[Hashable | None] = [None] * rows
        self._counts = [0] * rows
        self._host = self._device = None
        self.entries_written = 0   # block ids written since the start (measurements and tests read it)

    def write(self, owners: Sequence[Hashable | None], tables: Sequence[Sequence[int]],
              counts: Sequence[int]) -> int:
        """Row i := tables[i][:counts[i]], writing only what changed; the number of ids written. The copy is
        queued without waiting: call it between the owner's `Staging.wait` and `record`."""
        w = self.width
        index: list[int] = []
        values: list[int] = []
        for row, (owner, table, count) in enumerate(zip(owners, tables, counts)):
            held = self._counts[row] if owner is not None and owner == self._owners[row] else 0
            if count > held:
                index.extend(range(row * w + held, row * w + count))
                values.extend(table[held:count])
            self._owners[row], self._counts[row] = owner, max(count, held)
        k = len(index)
        if k:
            host, device = self._staging(k)
            host[:2 * k].copy_(torch.tensor(index + values, dtype=torch.long))
            staged = device[:2 * k]
            staged.copy_(host[:2 * k], non_blocking=True)
            self.tables.view(-1).index_copy_(0, staged[:k], staged[k:].to(self.tables.dtype))
            self.entries_written += k
        return k

    def _staging(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Pinned host and device buffers for k (index, id) pairs, grown by doubling when a step needs more."""
        if self._host is None or self._host.numel() < 2 * k:
            size = 2 * max(k, 256)
            size = 1 << (size - 1).bit_length()
            device = self.tables.device
            self._host = torch.empty(size, dtype=torch.long, pin_memory=device.type == "cuda")
            self._device = torch.empty(size, dtype=torch.long, device=device)
        return self._host, self._device
