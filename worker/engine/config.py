"""Engine settings: batch limits, KV-cache pool size and prefix caching."""

from __future__ import annotations

from dataclasses import dataclass

KV_CACHE_DTYPES = ("auto", "float16")


@dataclass
class EngineConfig:
    max_num_seqs: int | None = None      # sequences in one batch (slots); None: 16 on CPU, 256 on CUDA (sizing.py)
    max_num_batched_tokens: int | None = None   # tokens in one forward pass, decodes first, then prefill chunks;
                                         # None: 512 on CPU, 8192 on CUDA (sizing.py)
    block_size: int = 16                 # tokens per KV-cache block
    num_blocks: int | None = None        # KV pool size; None sizes it from the memory settings below
    kv_cache_memory_gib: float | None = None   # None: 1 GiB on CPU, gpu_memory_utilization on CUDA
    kv_cache_dtype: str | None = None    # "auto" (the model's dtype) or "float16" (a float32 model's pool in half the
                                         # bytes: the CPU's "kernel" backend); None: $KV_CACHE_DTYPE, else "auto"
    gpu_memory_utilization: float = 0.9  # CUDA: share of the memory left to this process (model included)
    max_model_len: int | None = None     # None: the model's own context length
    enable_prefix_caching: bool = True
    bulk_token_share: float = 0.1        # while bulk requests wait, they are admitted ahead of standard ones until
                                         # bulk work has this share of the step's token budget (scheduler.py)
    pack_cpu_linears: bool = True        # oneDNN prepacked matmuls on CPU (see weights/packed.py)
    enforce_eager: bool | None = None    # None: decode graphs on CUDA, eager on CPU; False on CPU: static buffers
    attention_backend: str | None = None  # "kernel", "gather" or "flex"; None: $ATTENTION_BACKEND, else the device's best
    decode_attention: str | None = None  # static-buffer decode steps: "flex" (in place) or "gather";
                                         # None: $DECODE_ATTENTION, else "flex", falling back to "gather"
    compile_layers: bool | None = None   # decoder layers compiled with torch.compile for steps with Triton
                                         # attention or the CPU's C kernel (compiled.py); None: $COMPILE_LAYERS,
                                         # else on for CUDA (off on CPU, where it measured no faster)
    fused_layers: bool | None = None     # CPU steps through the C attention kernel run each layer's elementwise
                                         # work in C (fused.py); None: $FUSED_LAYERS, else on where the layers fit
    overlap_steps: bool | None = None    # sample on the device and read the tokens back while the next step
                                         # runs (engine.py); None: off (sizing.py)
    sampler_candidates: int | None = None  # top-k/top-p searched among this many best tokens first, the rows
                                           # that need more redone over the whole row (0: never); None: 256 on a
                                           # CPU, never on a device, where it reads a count on the host mid-step
                                           # (sampler.py)

    def validate(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            value = getattr(self, name)
            if name != "block_size" and value is None:
                continue
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive integer; got {value!r}")
        if self.sampler_candidates is not None and (not isinstance(self.sampler_candidates, int)
                                                    or self.sampler_candidates < 0):
            raise ValueError(f"EngineConfig.sampler_candidates must be 0 or more; got {self.sampler_candidates!r}")
        if self.kv_cache_dtype not in (None, *KV_CACHE_DTYPES):
            raise ValueError(f"EngineConfig.kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}; "
                             f"got {self.kv_cache_dtype!r}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"EngineConfig.num_blocks must be positive; got {self.num_blocks}")
        if not 0 <= self.bulk_token_share <= 1:
            raise ValueError(f"EngineConfig.bulk_token_share must be between 0 and 1; got {self.bulk_token_share}")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ValueError(f"EngineConfig.kv_cache_memory_gib must be positive; got {self.kv_cache_memory_gib}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError("EngineConfig.gpu_memory_utilization must be above 0 and at most 1; "
                             f"got {self.gpu_memory_utilization}")
        slots, tokens = self.max_num_seqs, self.max_num_batched_tokens
        if slots is not None and tokens is not None and tokens < slots:
            raise ValueError("EngineConfig.max_num_batched_tokens must be at least max_num_seqs, "
                             "or some running sequences could never decode")
