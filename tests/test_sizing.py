"""Slots and KV-pool sizing per device, as pure arithmetic: the GPU rules are checked without a GPU."""

from __future__ import annotations

import re

import pytest

from worker.engine import EngineConfig, attention
from worker.engine.device import buckets
from worker.engine.sizing import CPU_KV_CACHE_GIB, overlap_for, size_engine, size_model
from worker.settings import WorkerSettings, expected_slots

GIB = 2**30
BLOCK = 2 * 2**20   # bytes per KV block


def test_cpu_defaults_stay_16_slots_and_one_gib():
    sizing = size_engine(EngineConfig(), "cpu", BLOCK)
    assert sizing.max_num_seqs == 16 and sizing.max_num_batched_tokens == 512
    assert sizing.num_blocks == int(CPU_KV_CACHE_GIB * GIB) // BLOCK == 512
    assert sizing.kv_source == "kv_cache_memory_gib"


def test_gpu_defaults_take_256_slots_and_a_share_of_the_memory_left():
    free, model, reserve = 60 * GIB, 2 * GIB, GIB
    sizing = size_engine(EngineConfig(), "cuda", BLOCK, free_bytes=free, model_bytes=model, reserve_bytes=reserve)
    # 256 decode rows leave most of a step's 8192 tokens to prompts.
    assert sizing.max_num_seqs == 256 and sizing.max_num_batched_tokens == 8192
    # 0.9 of the 62 GiB this process could use, less the model already in it and the activation reserve.
    assert sizing.num_blocks == int(0.9 * 62 * GIB - 3 * GIB) // BLOCK
    assert sizing.kv_source == "gpu_memory_utilization"
    lower = size_engine(EngineConfig(gpu_memory_utilization=0.5), "cuda", BLOCK, free_bytes=free, model_bytes=model,
                        reserve_bytes=reserve)
    assert lower.num_blocks == int(0.5 * 62 * GIB - 3 * GIB) // BLOCK < sizing.num_blocks


def test_explicit_settings_win_on_every_device():
    for device, free in (("cpu", None), ("cuda", 60 * GIB)):
        assert size_engine(EngineConfig(max_num_seqs=8, num_blocks=100), device, BLOCK, free).num_blocks == 100
        fixed = size_engine(EngineConfig(max_num_seqs=8, kv_cache_memory_gib=0.5), device, BLOCK, free)
        assert (fixed.max_num_seqs, fixed.num_blocks, fixed.kv_source) == (8, 256, "kv_cache_memory_gib")


def test_the_token_budget_default_never_falls_below_the_slots_asked_for():
    for device in ("cpu", "cuda"):
        sizing = size_engine(EngineConfig(max_num_seqs=10_000, num_blocks=100), device, BLOCK)
        assert (sizing.max_num_seqs, sizing.max_num_batched_tokens) == (10_000, 10_000)
    asked = size_engine(EngineConfig(max_num_batched_tokens=300), "cuda", BLOCK, free_bytes=GIB)
    assert asked.max_num_batched_tokens == 300


def test_gpu_slots_default_never_exceeds_the_token_budget():
    sizing = size_engine(EngineConfig(max_num_batched_tokens=128), "cuda", BLOCK, free_bytes=10 * GIB)
    assert sizing.max_num_seqs == 128
    with pytest.raises(ValueError, match="at least max_num_seqs"):
        EngineConfig(max_num_seqs=256, max_num_batched_tokens=128).validate()


def test_a_full_gpu_is_refused_with_what_to_change():
    with pytest.raises(ValueError, match="GPU_MEMORY_UTILIZATION.*KV_CACHE_GIB"):
        size_engine(EngineConfig(), "cuda", BLOCK, free_bytes=GIB // 2, model_bytes=8 * GIB, reserve_bytes=GIB)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=1.5).validate()


def test_worker_settings_leave_the_device_defaults_to_the_engine(monkeypatch):
    for name in ("MAX_NUM_SEQS", "MAX_NUM_BATCHED_TOKENS", "KV_CACHE_GIB", "GPU_MEMORY_UTILIZATION"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DEVICE", "cpu")
    settings = WorkerSettings()
    assert (settings.max_num_seqs, settings.kv_cache_gib, settings.gpu_memory_utilization) == (None, None, 0.9)
    assert settings.max_num_batched_tokens is None
    assert expected_slots(settings) == 16
    assert expected_slots(WorkerSettings(device="cuda")) == 256
    monkeypatch.setenv("MAX_NUM_BATCHED_TOKENS", "100")
    assert expected_slots(WorkerSettings(device="cuda")) == 100   # never more slots than a step's tokens
    monkeypatch.setenv("MAX_NUM_SEQS", "32")
    monkeypatch.setenv("GPU_MEMORY_UTILIZATION", "0.8")
    settings = WorkerSettings()
    assert expected_slots(settings) == 32 and settings.gpu_memory_utilization == 0.8


def test_worker_settings_pass_the_attention_backend_eager_switch_and_kv_cache_dtype(monkeypatch):
    monkeypatch.delenv("ATTENTION_BACKEND", raising=False)
    monkeypatch.delenv("ENFORCE_EAGER", raising=False)
    assert (WorkerSettings().attention_backend, WorkerSettings().enforce_eager) == (None, None)
    monkeypatch.setenv("ATTENTION_BACKEND", "gather")
    monkeypatch.setenv("ENFORCE_EAGER", "1")
    assert (WorkerSettings().attention_backend, WorkerSettings().enforce_eager) == ("gather", True)
    monkeypatch.setenv("ENFORCE_EAGER", "0")
    assert WorkerSettings().enforce_eager is None   # the device's default, not the CPU's static-buffer mode
    monkeypatch.delenv("OVERLAP_STEPS", raising=False)
    assert WorkerSettings().overlap_steps is None   # the device's default
    monkeypatch.setenv("OVERLAP_STEPS", "1")
    assert WorkerSettings().overlap_steps is True
    monkeypatch.setenv("OVERLAP_STEPS", "0")
    assert WorkerSettings().overlap_steps is False   # off, on CUDA too
    monkeypatch.delenv("DECODE_ATTENTION", raising=False)
    assert WorkerSettings().decode_attention is None
    monkeypatch.setenv("DECODE_ATTENTION", "gather")
    assert WorkerSettings().decode_attention == "gather"
    assert attention.choose_decode_attention(None) == "gather"
    assert attention.choose_decode_attention("flex") == "flex"
    monkeypatch.delenv("KV_CACHE_DTYPE", raising=False)
    assert WorkerSettings().kv_cache_dtype is None   # auto: the model's dtype
    monkeypatch.setenv("KV_CACHE_DTYPE", "float16")
    assert WorkerSettings().kv_cache_dtype == "float16"
    monkeypatch.setenv("DECODE_ATTENTION", "paged")
    with pytest.raises(ValueError, match="Unknown decode attention 'paged'; choose one of triton, flex, gather"):
        attention.choose_decode_attention(None)


@pytest.mark.parametrize("name, value, says", [
    ("GPU_MEMORY_UTILIZATION", "most", "GPU_MEMORY_UTILIZATION must be a number; got 'most'"),
    ("MAX_NUM_SEQS", "lots", "MAX_NUM_SEQS must be an integer; got 'lots'"),
    ("ENFORCE_EAGER", "maybe", "ENFORCE_EAGER must be 1 or 0"),
    ("OVERLAP_STEPS", "sometimes", "OVERLAP_STEPS must be 1 or 0"),
    ("MAX_NUM_BATCHED_TOKENS", "many", "MAX_NUM_BATCHED_TOKENS must be an integer; got 'many'"),
    ("KV_CACHE_DTYPE", "fp8", "KV_CACHE_DTYPE must be one of auto, float16; got 'fp8'. Fix it in the environment"),
])
def test_a_malformed_worker_setting_names_itself_and_its_value(monkeypatch, name, value, says):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=re.escape(says)):
        WorkerSettings()


def test_the_runner_sizes_a_cpu_engine_by_the_cpu_rule(tiny):
    from worker.engine import LLMEngine

    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(kv_cache_memory_gib=None))
    assert engine.config.max_num_seqs == 16 and engine.runner.sizing.kv_source == "kv_cache_memory_gib"
    pool_bytes = engine.runner.kv.numel() * engine.runner.kv.element_size()
    assert GIB - pool_bytes < pool_bytes / engine.runner.num_blocks   # 1 GiB, to the block


def test_steps_overlap_only_when_set():
    assert overlap_for(EngineConfig(), "cuda") is False
    assert overlap_for(EngineConfig(), "cpu") is False
    for device in ("cpu", "cuda"):
        assert overlap_for(EngineConfig(overlap_steps=True), device) is True
        assert overlap_for(EngineConfig(overlap_steps=False), device) is False


def test_the_runner_resolves_overlap_and_names_it_in_its_start_line(tiny):
    from worker.engine import LLMEngine

    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(num_blocks=64))
    assert engine.config.overlap_steps is False and "steps not overlapped" in engine.runner.describe_steps()
    engine.release_model()
    engine = LLMEngine(model, tok, EngineConfig(num_blocks=64, overlap_steps=True))
    assert "steps overlapped" in engine.runner.describe_steps()


def test_the_gpu_reserve_holds_every_graph_output_the_sampler_sort_and_the_block_lists(tiny):
    """A tiny model sized as on a GPU with a made-up free memory figure: the pool gets what is left once the
    model, the captured graphs' [bucket, vocab] logits, the sampler's float32 copies and full sort
    ([rows, vocab] values and int64 indices, with the sort's working buffers) and the activations are set aside,
    and each block also pays for FlexAttention's per-block lists."""
    model, _ = tiny
    vocab, hidden, dtype_bytes = model.config.vocab_size, model.config.hidden_size, 4   # float32
    model_bytes = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    free = 40 * GIB
    sizing = size_model(model, EngineConfig(), "cuda", BLOCK, free_bytes=free)
    slots, tokens = 256, 8192
    graph_logits = sum(buckets(256)) * vocab * dtype_bytes
    assert sum(buckets(256)) == 1 + 2 + 4 + 8 + sum(range(16, 257, 8))
    sampler = slots * vocab * (4 * 4 + 4 + 8 + 8 + 12)
    activations = 16 * tokens * hidden * dtype_bytes
    per_block = 4 * (slots + tokens * 2 // 128)   # query group 2: 4 heads over 2 KV heads
    reserve = sizing.reserve
    assert (reserve.graph_logits, reserve.sampler, reserve.activations, reserve.per_block) == (
        graph_logits, sampler, activations, per_block)
    want = (int(0.9 * (free + model_bytes)) - model_bytes - graph_logits - sampler - activations) // (BLOCK + per_block)
    assert sizing.num_blocks == want
    assert "kept for a step" in sizing.describe(EngineConfig())
    # With the real model's vocabulary (Qwen3: 151,936) the logits and the sort are most of a small GPU's headroom.
    assert sum(buckets(256)) * 151_936 * 2 > GIB and 256 * 151_936 * 12 > 0.4 * GIB
    # No decode graphs, no graph outputs; a fixed pool needs no reserve arithmetic at all.
    eager = size_model(model, EngineConfig(enforce_eager=True), "cuda", BLOCK, free_bytes=free)
    assert eager.reserve.graph_logits == 0 and eager.num_blocks > sizing.num_blocks
    assert size_model(model, EngineConfig(num_blocks=10), "cuda", BLOCK, free_bytes=free).num_blocks == 10
    with pytest.raises(ValueError, match="GPU_MEMORY_UTILIZATION"):   # a small GPU: the reserve leaves nothing
        size_model(model, EngineConfig(), "cuda", BLOCK, free_bytes=(graph_logits + sampler) // 2)
