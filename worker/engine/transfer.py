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
