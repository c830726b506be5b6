"""Compiled decoder layers on the CPU (worker/engine/compiled.py): the C attention kernel and w8a8's matmuls are
registered operators, so a step's layer is one compiled graph; the answers are the layers' own code's."""

from __future__ import annotations

import re

import pytest
import torch
from torch._dynamo.utils import counters
from torch._inductor.utils import run_and_get_code

from worker.engine import EngineConfig, LLMEngine, SamplingParams, native
from worker.engine.weights.quantised import quantize_model
from worker.model_loader import load_model

pytestmark = pytest.mark.skipif(native.load() is None or not native.int8_tile_kernels(),
                                reason="needs the C attention kernel and a w8a8 tile kernel (AMX, VNNI or AVX2)")

# One prompt of a single token arrives alone at the end: a step of one token (padded to two when compiled).
PROMPTS = [1, 7, 40, 3, 12]


def w8a8_engine(model_dir, compile_layers: bool, kv_cache_dtype: str = "auto") -> LLMEngine:
    """Compiled, or the model's own layer code (not the C-fused layers, which round differently)."""
    model, tok = load_model(str(model_dir))
    quantize_model(model, "w8a8")
    return LLMEngine(model, tok, EngineConfig(max_num_seqs=4, max_num_batched_tokens=24, block_size=4, num_blocks=64,
                                              attention_backend="kernel", compile_layers=compile_layers,
                                              fused_layers=False, kv_cache_dtype=kv_cache_dtype))


def serve(engine: LLMEngine, cap: int = 6) -> dict[str, list[int]]:
    """Greedy answers (at most `cap` tokens) to prompts arriving a step apart (chunked prefills beside decodes),
    then a prompt of one token alone (at most 4)."""
    results = {}

    def step() -> None:
        for event in engine.step():
            if event.finished:
                results[event.request_id] = event.token_ids

    for i, length in enumerate(PROMPTS):
        engine.add_request(str(i), prompt_token_ids=list(range(5, 5 + length)),
                           params=SamplingParams(temperature=0, max_new_tokens=cap))
        step()
    while engine.has_unfinished():
        step()
    engine.add_request("alone", prompt_token_ids=[9], params=SamplingParams(temperature=0, max_new_tokens=4))
    while engine.has_unfinished():
        step()
    return results


def test_cpu_steps_through_compiled_layers_answer_as_the_model_and_compile_only_at_start(tiny_model_dir):
    torch._dynamo.reset()
    want = serve(w8a8_engine(tiny_model_dir, compile_layers=False))
    engine, codes = run_and_get_code(lambda: w8a8_engine(tiny_model_dir, compile_layers=True))
    runner = engine.runner
    assert runner.compiled_eager and "eager steps compiled" in runner.describe_steps()
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1
    assert serve(engine) == want
    assert counters["stats"]["unique_graphs"] == graphs   # every step ran the code compiled at start
    assert codes
    for code in codes:
        # four w8a8 products a layer (q/k/v stacked, o, gate/up stacked, down) and one attention call
        assert len(re.findall(r"supportbot\.w8a8_matmul\.default\(", code)) == 4, code
        assert len(re.findall(r"supportbot\.paged_kernel\.default\(", code)) == 1, code
    engine.release_model()
    assert "forward" not in engine.runner.model.model.layers[0].__dict__


def test_compiled_steps_over_a_float16_pool_answer_as_the_models_own_code_over_it(tiny_model_dir):
    """The registered attention operator takes the float16 pool as it is: compiled layers give the uncompiled
    engine's answers over a float16 pool, which differ from a float32 pool's on this model."""
    want = serve(w8a8_engine(tiny_model_dir, compile_layers=False, kv_cache_dtype="float16"))
    assert want != serve(w8a8_engine(tiny_model_dir, compile_layers=False))   # the pool's rounding shows
    engine = w8a8_engine(tiny_model_dir, compile_layers=True, kv_cache_dtype="float16")
    assert engine.runner.kv.dtype == torch.float16 and engine.runner.compiled_eager
    assert serve(engine) == want


def test_a_step_of_one_token_runs_as_two_with_the_padding_row_in_the_scratch_block(tiny_model_dir):
    """The padding row of a one-token compiled step writes only the scratch block (the pool past num_blocks)."""
    engine = w8a8_engine(tiny_model_dir, compile_layers=True)
    runner = engine.runner
    runner.kv[:, :, :, runner.num_blocks] = 0   # the scratch block, which compiling at start wrote
    before = runner.kv.clone()
    engine.add_request("a", prompt_token_ids=[9], params=SamplingParams(temperature=0, max_new_tokens=1))
    while engine.has_unfinished():
        engine.step()
    written = (runner.kv != before).flatten(-2).any(-1).flatten(0, 2).any(0)   # per block
    assert written[runner.num_blocks]                    # the padding row's K/V: the scratch block
    assert int(written[:runner.num_blocks].sum()) == 1   # the request's own: its one block
