"""Worker settings from the environment, with defaults that run on one CPU machine."""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field


def _parse(name: str, value: str, kind: type) -> int | float:
    try:
        return kind(value)
    except ValueError:
        raise ValueError(f"{name} must be {'an integer' if kind is int else 'a number'}; got {value!r}. "
                         f"Fix it in the environment (or .env), or unset it for the default.") from None


def _int(name: str, default: int) -> int:
    return _parse(name, os.environ.get(name) or str(default), int)


def _float(name: str, default: float) -> float:
    return _parse(name, os.environ.get(name) or str(default), float)


def _optional(name: str, kind: type) -> int | float | None:
    """Unset or empty: None, for a default that depends on the device."""
    value = os.environ.get(name)
    return _parse(name, value, kind) if value else None


def _switch(name: str, off: bool | None = None) -> bool | None:
    """"1"/"true"/"yes"/"on": True; "0"/"false"/"no"/"off": `off`; unset or empty: None (the device's default)."""
    value = (os.environ.get(name) or "").strip().lower()
    if not value:
        return None
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return off
    raise ValueError(f"{name} must be 1 or 0 (true/false); got {value!r}.")


def _choice(name: str, choices: tuple[str, ...]) -> str | None:
    """One of `choices`, or None when unset or empty (the default)."""
    value = os.environ.get(name) or None
    if value is not None and value not in choices:
        raise ValueError(f"{name} must be one of {', '.join(choices)}; got {value!r}. Fix it in the environment "
                         f"(or .env), or unset it for the default.")
    return value


def kv_cache_dtype_setting() -> str | None:
    from worker.engine.config import KV_CACHE_DTYPES

    return _choice("KV_CACHE_DTYPE", KV_CACHE_DTYPES)


def weights_setting() -> str:
    """WEIGHTS as the worker reads it: unset is auto, the device's measured best (model_loader.auto_weights)."""
    return os.environ.get("WEIGHTS") or "auto"


@dataclass
class WorkerSettings:
    redis_url: str = field(default_factory=lambda: os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    database_url: str | None = field(default_factory=lambda: os.environ.get("DATABASE_URL"))
    model: str | None = field(default_factory=lambda: os.environ.get("MODEL") or None)
    device: str | None = field(default_factory=lambda: os.environ.get("DEVICE") or None)
    dtype: str | None = field(default_factory=lambda: os.environ.get("DTYPE") or None)
    # Weight precision on CPU: float32, int4, int8, bfloat16 or w8a8 (worker/engine/weights/quantised.py). Unset: auto,
    # the device's measured best (model_loader.auto_weights).
    weights: str = field(default_factory=lambda: weights_setting())
    # Unset: 16 slots, 512 tokens per step and a 1 GiB KV pool on CPU; 256 slots, 8192 tokens per step and
    # GPU_MEMORY_UTILIZATION of the GPU on CUDA.
    max_num_seqs: int | None = field(default_factory=lambda: _optional("MAX_NUM_SEQS", int))
    max_num_batched_tokens: int | None = field(default_factory=lambda: _optional("MAX_NUM_BATCHED_TOKENS", int))
    kv_cache_gib: float | None = field(default_factory=lambda: _optional("KV_CACHE_GIB", float))
    # "float16": a float32 model's KV pool in half the bytes (the CPU's C attention kernel). Unset: "auto", the
    # model's dtype.
    kv_cache_dtype: str | None = field(default_factory=kv_cache_dtype_setting)
    # Unset: decode steps replayed as CUDA graphs on CUDA, eager on CPU; "1" forces eager everywhere.
    enforce_eager: bool | None = field(default_factory=lambda: _switch("ENFORCE_EAGER"))
    # Unset: the C kernel on CPU (float32, when a compiler is present), else gathering the context.
    attention_backend: str | None = field(default_factory=lambda: os.environ.get("ATTENTION_BACKEND") or None)
    # Decode steps through static buffers (CUDA graphs): "flex" reads the KV pool in place, "gather" copies
    # each context out. Unset: "flex", else "gather" when flex does not compile or capture.
    decode_attention: str | None = field(default_factory=lambda: os.environ.get("DECODE_ATTENTION") or None)
    # "1": each step's tokens are read back while the next step runs (EngineConfig.overlap_steps); "0": not.
    # Unset: the device's default (off).
    overlap_steps: bool | None = field(default_factory=lambda: _switch("OVERLAP_STEPS", off=False))
    gpu_memory_utilization: float = field(default_factory=lambda: _float("GPU_MEMORY_UTILIZATION", 0.9))
    # While bulk requests wait, their share of each step's token budget (EngineConfig.bulk_token_share).
    bulk_token_share: float = field(default_factory=lambda: _float("BULK_TOKEN_SHARE", 0.1))
    # After SIGTERM, answers under way have this long to finish before they go back to the queue.
    shutdown_grace_s: float = field(default_factory=lambda: _float("SHUTDOWN_GRACE_S", 15))
    # How long a finished answer waits for the database (its final write) and for Redis (its final event)
    # before the request is handed back to the queue to be answered again.
    sql_retry_s: float = field(default_factory=lambda: _float("SQL_RETRY_S", 60))
    redis_retry_s: float = field(default_factory=lambda: _float("REDIS_RETRY_S", 60))
    # An accepted request found in no queue and held by no worker this long after it was accepted was lost in
    # a fault (worker/reaper.py): it is queued again from its copy, or its customer is told to send it again.
    lost_after_s: float = field(default_factory=lambda: _float("LOST_AFTER_S", 20))
    # Text deltas are sent at most this often, every request's together in one message (worker/publisher.py).
    stream_window_s: float = field(default_factory=lambda: float(os.environ.get("STREAM_WINDOW_MS", "50")) / 1000)
    # Benchmarks only: tokens per second per request from a stand-in engine with no model (worker/synthetic.py).
    synthetic_token_rate: float = field(default_factory=lambda: float(os.environ.get("SYNTHETIC_TOKEN_RATE") or 0))
    name: str = field(default_factory=lambda: os.environ.get("WORKER_NAME", f"worker@{socket.gethostname()}"))


def expected_slots(settings: WorkerSettings) -> int:
    """The slots the engine will have, known before the model loads (the task thread pool is sized from it)."""
    if settings.max_num_seqs:
        return settings.max_num_seqs
    from worker.engine.config import EngineConfig
    from worker.engine.sizing import slots_and_budget
    from worker.model_loader import pick_device

    config = EngineConfig(max_num_batched_tokens=settings.max_num_batched_tokens)
    return slots_and_budget(config, pick_device(settings.device).type)[0]
