"""A GGUF file's own Q4_1 blocks as int4 codes, scales and zeros, under the model's parameter names."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from worker.engine.weights.quantised import Int4Weights

log = logging.getLogger(__name__)

Q4_1_BLOCK_BYTES = 20   # float16 d, float16 m, 16 bytes of nibbles: w = d * q + m over 32 weights


def q4_1_to_int4(rows: np.ndarray | torch.Tensor) -> Int4Weights:
    """[N, K / 32 * 20] bytes of Q4_1 blocks -> codes and float32 scale and zero, exactly as de-quantised:
    (q - 8) * d + (m + 8 d) = d * q + m. A block's byte j holds weight j (low nibble) and weight j + 16 (high)."""
    rows = np.ascontiguousarray(rows.numpy() if isinstance(rows, torch.Tensor) else rows, dtype=np.uint8)
    n = rows.shape[0]
    blocks = rows.reshape(n, -1, Q4_1_BLOCK_BYTES)
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 4:]
    codes = np.concatenate([nibbles & 0x0F, nibbles >> 4], axis=-1).reshape(n, -1)
    return Int4Weights(torch.from_numpy(codes.astype(np.int32)), torch.from_numpy(d),
                       torch.from_numpy(m + np.float32(8) * d))


class Q4_1Blocks(Mapping):
    """Block rows by parameter name, decoded to Int4Weights as each is looked up (one layer's codes at a time)."""

    def __init__(self, rows: dict[str, torch.Tensor]) -> None:
        self.rows = rows

    def __getitem__(self, name: str) -> Int4Weights:
        return q4_1_to_int4(self.rows[name])

    def __iter__(self):
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)


def read_q4_1(gguf: str | Path, model) -> dict[str, torch.Tensor]:
    """Every Q4_1 matrix of the file as its raw block rows (uint8 [N, K / 32 * 20]), by the model's parameter
    name, rows in the model's order: llama.cpp's converter permutes the rows of q and k, transformers' tensor
    processor undoes it, and the same row order is applied to the blocks. Tensors whose processing is not a
    plain row order are left out (quantised from float instead)."""
    from gguf import MODEL_ARCH_NAMES, GGMLQuantizationType, GGUFReader, get_tensor_name_map
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor

    reader = GGUFReader(str(gguf))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=model.config.to_dict())
    arch_id = next((key for key, value in MODEL_ARCH_NAMES.items() if value == arch), None)
    if arch_id is None:
        return {}
    name_map = get_tensor_name_map(arch_id, model.config.num_hidden_layers)
    names = {}
    for module_name, module in model.named_modules():
        # A linear already swapped for a packed one (an engine ran on this model) keeps its dense original.
        if isinstance(module, torch.nn.Linear) or isinstance(getattr(module, "dense", None), torch.nn.Linear):
            gguf_name = name_map.get_name(module_name) or name_map.get_name(module_name.partition(".")[2])
            if gguf_name:
                names[gguf_name + ".weight"] = module_name + ".weight"
    found: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = names.get(tensor.name)
        if tensor.tensor_type != GGMLQuantizationType.Q4_1 or name is None or len(tensor.data.shape) != 2:
            continue
        order = _row_order(processor, tensor.name, tensor.data.shape[0])
        if order is None:
            log.info("%s: rows are not a plain reordering; quantised from float instead", tensor.name)
            continue
        found[name] = torch.from_numpy(np.ascontiguousarray(tensor.data[order]))
    return found


def _row_order(processor, name: str, rows: int) -> np.ndarray | None:
    index = np.arange(rows, dtype=np.float64).reshape(rows, 1)
    try:
        result = np.asarray(processor.process(weights=index, name=name).weights)
    except Exception:   # a processor that needs more than the rows
        return None
    if result.shape != index.shape:
        return None
    order = result[:, 0].astype(np.int64)
    return order if np.array_equal(np.sort(order), np.arange(rows)) else None
