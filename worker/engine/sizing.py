"""Slots and KV-pool size per device: fixed on a CPU, a share of the free memory on a GPU."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Slots when EngineConfig.max_num_seqs is None. A GPU step costs about the same for 16 or 256 sequences
# (launch-bound), so it takes many more; a CPU step grows with every sequence.
DEFAULT_SLOTS = {"cpu": 16, "cuda": 256}
# Tokens per step when EngineConfig.max_num_batched_tokens is None. On a CPU a step's cost grows with every
# token, so prefill chunks stay small beside the decodes; a GPU's 256 decode rows would leave 512 tokens only
# 256 for prompts, so it takes vLLM's default for online serving (not measured here).
DEFAULT_BUDGET = {"cpu": 512, "cuda": 8192}
CPU_KV_CACHE_GIB = 1.0


@dataclass
class Sizing:
    max_num_seqs: int
    num_blocks: int
    max_num_batched_tokens: int
    kv_source: str                 # "num_blocks", "kv_cache_memory_gib" or "gpu_memory_utilization"
    free_bytes: int | None = None  # free device memory seen after the model was loaded (GPU only)

    def describe(self, config) -> str:
        if self.kv_source == "gpu_memory_utilization":
            return (f"{config.gpu_memory_utilization:g} of the memory left to this process "
                    f"({self.free_bytes / 2**30:.1f} GiB free after the model)")
        if self.kv_source == "kv_cache_memory_gib":
            return f"{config.kv_cache_memory_gib or CPU_KV_CACHE_GIB:g} GiB"
        return "num_blocks"


def default_slots(device_type: str) -> int:
    return DEFAULT_SLOTS.get(device_type, DEFAULT_SLOTS["cpu"])


def default_budget(device_type: str) -> int:
    return DEFAULT_BUDGET.get(device_type, DEFAULT_BUDGET["cpu"])


def slots_and_budget(config, device_type: str) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens): as set, else the device's defaults (slots never above the budget,
    the budget never below the slots set)."""
    budget = config.max_num_batched_tokens or max(default_budget(device_type), config.max_num_seqs or 0)
    return config.max_num_seqs or min(default_slots(device_type), budget), budget


def size_engine(config, device_type: str, bytes_per_block: int, free_bytes: int | None = None,
                model_bytes: int = 0, reserve_bytes: int = 0) -> Sizing:
    """Slots and pool blocks from the settings; pure arithmetic, so every device's rule is testable anywhere.

    In order: an explicit `num_blocks`; an explicit `kv_cache_memory_gib`; on a GPU (free_bytes given),
    `gpu_memory_utilization` of the memory this process could use (what is free now plus its own model),
    less the model and `reserve_bytes` for a step's activations, as vLLM does; else 1 GiB.
    """
    slots, tokens = slots_and_budget(config, device_type)
    if tokens < slots:
        raise ValueError("EngineConfig.max_num_batched_tokens must be at least max_num_seqs, "
                         "or some running sequences could never decode")
    if config.num_blocks:
        return Sizing(slots, config.num_blocks, tokens, "num_blocks", free_bytes)
    if config.kv_cache_memory_gib or free_bytes is None:
        gib = config.kv_cache_memory_gib or CPU_KV_CACHE_GIB
        return Sizing(slots, max(1, int(gib * 2**30) // bytes_per_block), tokens, "kv_cache_memory_gib", free_bytes)
    budget = int(config.gpu_memory_utilization * (free_bytes + model_bytes)) - model_bytes - reserve_bytes
    blocks = budget // bytes_per_block
    if blocks < 1:
        raise ValueError(
            f"No GPU memory left for the KV cache: {free_bytes / 2**30:.2f} GiB free after the model, "
            f"gpu_memory_utilization={config.gpu_memory_utilization:g} leaves {budget / 2**30:.2f} GiB once "
            f"{reserve_bytes / 2**30:.2f} GiB is kept for activations. Raise GPU_MEMORY_UTILIZATION, lower "
            "MAX_NUM_SEQS, free the GPU of other processes, or set KV_CACHE_GIB.")
    return Sizing(slots, blocks, tokens, "gpu_memory_utilization", free_bytes)


def free_device_bytes(device: torch.device) -> int | None:
    """Free memory on a CUDA device now; None elsewhere (a CPU pool has a fixed default size)."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


def model_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def activation_reserve(slots: int, tokens: int, vocab_size: int, hidden_size: int, dtype_bytes: int) -> int:
    """A rough bound on one step's transient memory beside the pool: float32 logits of every sampled row and
    a few copies in the sampler, plus a handful of hidden-state-sized buffers per batched token."""
    return 4 * slots * vocab_size * 4 + 16 * tokens * hidden_size * dtype_bytes


def size_for(model, config, device: torch.device, bytes_per_block: int) -> Sizing:
    """size_engine with what the loaded model and its device report."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    dtype_bytes = next(model.parameters()).element_size()
    slots, tokens = slots_and_budget(config, device.type)
    reserve = activation_reserve(slots, tokens, text.vocab_size, text.hidden_size, dtype_bytes)
    return size_engine(config, device.type, bytes_per_block, free_device_bytes(device), model_bytes(model), reserve)
