"""CPU matmuls through oneDNN with weights packed once, instead of MKL re-reading row-major weights.

At the batch sizes a serving step has (16-64 rows), prepacked oneDNN linears run faster than `F.linear` on the
same float32 weights (the 49152-wide lm_head most of all; docs/BENCHMARKS.md).
The swap is reversible, and modules are replaced, not model code.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

log = logging.getLogger(__name__)

# The row count the packing is tuned for; any other count still works.
PACK_ROWS_HINT = 16
# Inputs of more rows than this are padded to a multiple of it. oneDNN keeps state for every input shape it
# has run (about 0.5 MB per shape and weight, here), and a serving step's row count takes any value up to
# the token budget: unpadded, a worker's memory grew by hundreds of MB as new counts kept turning up.
# Smaller inputs (decode steps of a few requests) run as they are: padding them to 16 rows cost throughput.
ROW_BUCKET = 16


class PackedLinear(nn.Module):
    def __init__(self, dense: nn.Linear) -> None:
        super().__init__()
        # Kept for unpack_linears, outside the module tree: modules() should list what actually runs.
        self.__dict__["dense"] = dense
        self.in_features, self.out_features = dense.in_features, dense.out_features
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(dense.weight.detach(), PACK_ROWS_HINT)
        self.bias = None if dense.bias is None else dense.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return bucket_rows(x, self.out_features, self._run)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def bucket_rows(x: torch.Tensor, out_features: int, run) -> torch.Tensor:
    """run(x), with inputs of more than ROW_BUCKET rows padded to a multiple of it."""
    rows = x.numel() // x.shape[-1]
    pad = -rows % ROW_BUCKET
    if pad == 0 or rows < ROW_BUCKET:
        return run(x)
    flat = x.reshape(rows, x.shape[-1])
    out = run(torch.cat([flat, flat.new_zeros(pad, flat.shape[1])]))[:rows]
    return out.reshape(*x.shape[:-1], out_features)


def supported(model: nn.Module) -> bool:
    param = next(model.parameters())
    return (param.device.type == "cpu" and param.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def pack_linears(model: nn.Module) -> int:
    """Swap every nn.Linear for a PackedLinear; returns how many were swapped (0 when unsupported)."""
    if not supported(model):
        return 0
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    try:
        packed = [(parent, name, PackedLinear(child)) for parent, name, child in targets]
    except RuntimeError as exc:   # a oneDNN build without these ops: stay on dense matmuls
        log.warning("oneDNN packing unavailable, using dense matmuls: %s", exc)
        return 0
    for parent, name, module in packed:
        setattr(parent, name, module)
    return len(packed)


def unpack_linears(model: nn.Module) -> None:
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, PackedLinear):
                setattr(parent, name, child.dense)
