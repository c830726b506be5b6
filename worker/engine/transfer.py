"""Copies between host and device that do not make the host wait for the device's queue of work."""

from __future__ import annotations

import torch


def upload(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor; on CUDA through pinned memory, so the copy does not wait for the stream."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


def place_pending(ids: torch.Tensor, tokens: torch.Tensor, fixes: list[tuple[int, int]]) -> None:
    """ids[row] = tokens[i] for each (row, i): tokens sampled last step and not read back, placed on the device."""
    if fixes:
        index = upload(list(zip(*fixes)), torch.long, ids.device)
        ids[index[0]] = tokens[index[1]]


class Staging:
    """Guards pinned host buffers that every step rewrites and copies to the device without blocking.

    While a step may still be queued on the device (steps overlap, or a graph waits behind the last one),
    its copy may not have read the buffer yet: `wait` before rewriting, `record` after queueing the copies.
    Nothing to do on CPU, where a copy is done when it returns."""

    def __init__(self, device: torch.device) -> None:
        self.event = torch.cuda.Event() if device.type == "cuda" else None

    def wait(self) -> None:
        if self.event is not None:
            self.event.synchronize()   # returns at once when nothing was recorded yet

    def record(self) -> None:
        if self.event is not None:
            self.event.record()


class StagedBuffer:
    """`fields` device vectors of up to `capacity` values, each step rewritten for its first n, with a pinned
    host twin they are copied from.

    Both are laid out per row count: the values for n rows are `fields` x n contiguous elements at the start
    of the buffer (`device(n)` and `host(n)` are [fields, n] views of them), not n columns of a [fields,
    capacity] matrix. So whatever n a step takes, its copy is one contiguous pinned block to one contiguous
    device block, which CUDA queues without waiting; a strided slice of a pinned tensor would be staged
    through pageable memory first, every step. The caller guards rewrites with a `Staging`."""

    def __init__(self, fields: int, capacity: int, dtype: torch.dtype, device: torch.device) -> None:
        self.fields, self.capacity = fields, capacity
        self.device_flat = torch.zeros(fields * capacity, dtype=dtype, device=device)
        self.host_flat = torch.zeros(fields * capacity, dtype=dtype, pin_memory=device.type == "cuda")

    def device(self, n: int) -> torch.Tensor:
        return self.device_flat[:self.fields * n].view(self.fields, n)

    def host(self, n: int) -> torch.Tensor:
        return self.host_flat[:self.fields * n].view(self.fields, n)

    def put(self, values, n: int) -> torch.Tensor:
        """Write [fields, n] values (nested lists or an array) to the host block and queue its copy; the
        device view."""
        host = self.host(n)
        host.copy_(torch.as_tensor(values, dtype=host.dtype))
        device = self.device(n)
        device.copy_(host, non_blocking=True)
        return device


class Readback:
    """A step's sampled token ids on their way to the host: the copy is queued now, waited for in `tolist`."""

    def __init__(self, tokens: torch.Tensor) -> None:
        self.tokens = tokens   # kept on the device: the next step reads its inputs from it
        self.event = None
        self.host = tokens
        if tokens.device.type == "cuda":
            self.host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
            self.host.copy_(tokens, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()

    def tolist(self) -> list[int]:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
