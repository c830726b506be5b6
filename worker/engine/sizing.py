"""Per-device defaults: slots, tokens per step, overlapped steps, and the KV-pool size (fixed on a CPU, a share
of the free memory on a GPU, less what a step needs beside it)."""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from .device import buckets

# Slots when EngineConfig.max_num_seqs is None. A GPU step costs about the same for 16 or 256 sequences
# (launch-bound), so it takes many more; a CPU step grows with every sequence.
DEFAULT_SLOTS = {"cpu": 16, "cuda": 256}
# Tokens per step when EngineConfig.max_num_batched_tokens is None. On a CPU a step's cost grows with every
# token, so prefill chunks stay small beside the decodes; a GPU's 256 decode rows would leave 512 tokens only
# 256 for prompts, so it takes vLLM's default for online serving (not measured here).
DEFAULT_BUDGET = {"cpu": 512, "cuda": 8192}
CPU_KV_CACHE_GIB = 1.0
# Overlapped steps when EngineConfig.overlap_steps is None: off everywhere. On a GPU they measured slower
# (docs/BENCHMARKS.md, "GPU"); a CPU has nothing to overlap them with, and each token would come a step later.
DEFAULT_OVERLAP = {"cpu": False, "cuda": False}
# Bytes per [rows, vocab] entry the sampler may hold at once: float32 copies of the scores (processed, scaled,
# weights, running sums) and, for top-k/top-p on a GPU, a full sort: sorted values and int64 indices, its int64
# index input and the radix sort's double buffers.
SAMPLER_COPY_BYTES = 4 * 4
SAMPLER_SORT_BYTES = 4 + 8 + 8 + 12


@dataclass
class Reserve:
    """GPU memory kept out of the KV pool for what a step holds beside it."""

    graph_logits: int = 0   # every captured decode graph keeps its [bucket, vocab] logits
    sampler: int = 0        # the sampled rows' float32 scores and a full sort of them
    activations: int = 0    # hidden-state-sized buffers per batched token
    per_block: int = 0      # bytes per pool block of buffers that grow with the pool (FlexAttention block lists)

    @property
    def bytes(self) -> int:
        return self.graph_logits + self.sampler + self.activations


@dataclass
class Sizing:
    max_num_seqs: int
    num_blocks: int
    max_num_batched_tokens: int
    kv_source: str                 # "num_blocks", "kv_cache_memory_gib" or "gpu_memory_utilization"
    free_bytes: int | None = None  # free device memory seen after the model was loaded (GPU only)
    reserve: Reserve | None = None

    def describe(self, config) -> str:
        if self.kv_source == "gpu_memory_utilization":
            r = self.reserve or Reserve()
            return (f"{config.gpu_memory_utilization:g} of the memory left to this process "
                    f"({self.free_bytes / 2**30:.1f} GiB free after the model; {r.bytes / 2**30:.2f} GiB kept for a "
                    f"step: {r.graph_logits / 2**30:.2f} graph logits, {r.sampler / 2**30:.2f} sampler, "
                    f"{r.activations / 2**30:.2f} activations)")
        if self.kv_source == "kv_cache_memory_gib":
            return f"{config.kv_cache_memory_gib or CPU_KV_CACHE_GIB:g} GiB"
        return "num_blocks"


def default_slots(device_type: str) -> int:
    return DEFAULT_SLOTS.get(device_type, DEFAULT_SLOTS["cpu"])


def default_budget(device_type: str) -> int:
    return DEFAULT_BUDGET.get(device_type, DEFAULT_BUDGET["cpu"])


def compile_for(config, device_type: str) -> bool:
    """EngineConfig.compile_layers as set, else $COMPILE_LAYERS (0 or 1), else on for CUDA. Off on CPU: there the
    compiled layers run the same C kernels and measured no faster than the model's own code at 16 rows and 2-5%
    slower at 48, dynamo's guards and the compiled code's wrapper costing a layer what the fused ops save
    (docs/BENCHMARKS.md)."""
    if config.compile_layers is not None:
        return config.compile_layers
    return _switch("COMPILE_LAYERS", device_type == "cuda")


def fused_for(config) -> bool:
    """EngineConfig.fused_layers as set, else $FUSED_LAYERS (0 or 1), else on."""
    if config.fused_layers is not None:
        return config.fused_layers
    return _switch("FUSED_LAYERS", True)


def _switch(name: str, default: bool) -> bool:
    """An on/off environment setting: 1 or 0, unset or empty for `default`; anything else a ValueError."""
    env = (os.environ.get(name) or "").strip()
    if env not in ("", "0", "1"):
        raise ValueError(f"{name} must be 1 or 0; got {env!r}.")
    return env == "1" if env else default


def overlap_for(config, device_type: str) -> bool:
    """EngineConfig.overlap_steps as set, else the device's default."""
    if config.overlap_steps is not None:
        return config.overlap_steps
    return DEFAULT_OVERLAP.get(device_type, DEFAULT_OVERLAP["cpu"])


def slots_and_budget(config, device_type: str) -> tuple[int, int]:
    """(max_num_seqs, max_num_batched_tokens): as set, else the device's defaults (slots never above the budget,
    the budget never below the slots set)."""
    budget = config.max_num_batched_tokens or max(default_budget(device_type), config.max_num_seqs or 0)
    return config.max_num_seqs or min(default_slots(device_type), budget), budget


def size_engine(config, device_type: str, bytes_per_block: int, free_bytes: int | None = None,
                model_bytes: int = 0, reserve_bytes: int | Reserve = 0) -> Sizing:
    """Slots and pool blocks from the settings; pure arithmetic, so every device's rule is testable anywhere.

    In order: an explicit `num_blocks`; an explicit `kv_cache_memory_gib`; on a GPU (free_bytes given),
    `gpu_memory_utilization` of the memory this process could use (what is free now plus its own model),
    less the model and the reserve for a step (a Reserve, or plain bytes), as vLLM does; each block then
    also costs the reserve's `per_block`; else 1 GiB.
    """
    reserve = reserve_bytes if isinstance(reserve_bytes, Reserve) else Reserve(activations=reserve_bytes)
    reserve_bytes = reserve.bytes
    slots, tokens = slots_and_budget(config, device_type)
    if tokens < slots:
        raise ValueError("EngineConfig.max_num_batched_tokens must be at least max_num_seqs, "
                         "or some running sequences could never decode")
    if config.num_blocks:
        return Sizing(slots, config.num_blocks, tokens, "num_blocks", free_bytes, reserve)
    if config.kv_cache_memory_gib or free_bytes is None:
        gib = config.kv_cache_memory_gib or CPU_KV_CACHE_GIB
        return Sizing(slots, max(1, int(gib * 2**30) // bytes_per_block), tokens, "kv_cache_memory_gib", free_bytes,
                      reserve)
    budget = int(config.gpu_memory_utilization * (free_bytes + model_bytes)) - model_bytes - reserve_bytes
    blocks = budget // (bytes_per_block + reserve.per_block)
    if blocks < 1:
        raise ValueError(
            f"No GPU memory left for the KV cache: {free_bytes / 2**30:.2f} GiB free after the model, "
            f"gpu_memory_utilization={config.gpu_memory_utilization:g} leaves {budget / 2**30:.2f} GiB once "
            f"{reserve_bytes / 2**30:.2f} GiB is kept for activations. Raise GPU_MEMORY_UTILIZATION, lower "
            "MAX_NUM_SEQS, free the GPU of other processes, or set KV_CACHE_GIB.")
    return Sizing(slots, blocks, tokens, "gpu_memory_utilization", free_bytes, reserve)


def free_device_bytes(device: torch.device) -> int | None:
    """Free memory on a CUDA device now; None elsewhere (a CPU pool has a fixed default size)."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


def model_bytes(model) -> int:
    return sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))


def step_reserve(config, device_type: str, slots: int, tokens: int, vocab_size: int, hidden_size: int,
                 dtype_bytes: int, group: int) -> Reserve:
    """What a step holds beside the KV pool, on a bound that errs high:

    - graph_logits: each captured decode graph keeps its output, [bucket, vocab] in the model's dtype, for
      every bucket (device.buckets), when decode graphs are on (CUDA unless enforce_eager);
    - sampler: per sampled row and vocabulary entry, float32 copies of the scores and a full sort for top-k
      and top-p (a GPU's default, and the fallback of a search among fewer candidates);
    - activations: a handful of hidden-state-sized buffers per batched token;
    - per_block: FlexAttention's block lists of prefill chunks (one int32 per 128 queries and pool block)
      and its block map of the chunks (one int32 per slot and pool block), which grow with the pool."""
    graphs = device_type == "cuda" and not config.enforce_eager
    return Reserve(
        graph_logits=sum(buckets(slots)) * vocab_size * dtype_bytes if graphs else 0,
        sampler=slots * vocab_size * (SAMPLER_COPY_BYTES + SAMPLER_SORT_BYTES),
        activations=16 * tokens * hidden_size * dtype_bytes,
        per_block=4 * (slots + -(-tokens * group // 128)))


def size_model(model, config, device_type: str, bytes_per_block: int, free_bytes: int | None) -> Sizing:
    """size_engine for a loaded model: its size and a step's reserve from its config, with `free_bytes` of
    device memory free (None off a GPU)."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    dtype_bytes = next(model.parameters()).element_size()
    slots, tokens = slots_and_budget(config, device_type)
    group = text.num_attention_heads // (getattr(text, "num_key_value_heads", None) or text.num_attention_heads)
    reserve = step_reserve(config, device_type, slots, tokens, text.vocab_size, text.hidden_size, dtype_bytes, group)
    return size_engine(config, device_type, bytes_per_block, free_bytes, model_bytes(model), reserve)


def size_for(model, config, device: torch.device, bytes_per_block: int) -> Sizing:
    """size_model with the free memory the device reports."""
    return size_model(model, config, device.type, bytes_per_block, free_device_bytes(device))
