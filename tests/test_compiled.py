"""Compiled decoder layers (worker/engine/compiled.py): the pool is written in place by the attention operators,
one compilation serves every layer, and the model comes back as it was."""

from __future__ import annotations

import re

import pytest
import torch

pytest.importorskip("triton")
from torch._dynamo.utils import counters  # noqa: E402
from torch._inductor.utils import run_and_get_code  # noqa: E402

from worker.engine import attention  # noqa: E402
from worker.engine.attention import paged_triton  # noqa: E402
from worker.engine.compiled import CompiledLayers  # noqa: E402
from worker.model_loader import load_model  # noqa: E402


@pytest.fixture()
def qwen3(tiny_model_dirs):
    model, _ = load_model(str(tiny_model_dirs["qwen3"]))
    attention.register()
    model.set_attn_implementation(attention.ATTN_NAME)
    return model


def decode_step(model, kv: torch.Tensor, n: int) -> dict:
    """A decode step of n rows, each at position 0 of its own block."""
    tables = torch.arange(n, dtype=torch.int32)[:, None].expand(n, 2).contiguous()
    return dict(input_ids=torch.randint(0, 1000, (1, n)), position_ids=torch.zeros(1, n, dtype=torch.long),
                use_cache=False, engine_kv=kv, engine_slots=torch.arange(n) * kv.shape[4], engine_tables=tables,
                engine_lens=torch.ones(n, dtype=torch.long))


def call_arguments(line: str, call: str) -> list[str]:
    """The top-level arguments of the call in a line of generated code."""
    text = line[line.index(call) + len(call):]
    args, depth, current = [], 0, ""
    for ch in text:
        if ch == ")" and depth == 0:
            break
        depth += (ch == "(") - (ch == ")")
        if ch == "," and depth == 0:
            args.append(current.strip())
            current = ""
        else:
            current += ch
    return args + [current.strip()]


def test_compiled_decode_steps_write_the_pool_in_place_and_match_the_model(qwen3):
    torch._dynamo.reset()
    config = qwen3.config
    kv = torch.zeros(2, config.num_hidden_layers, config.num_key_value_heads, 9, 4, config.head_dim)
    step, other = decode_step(qwen3, kv, 4), decode_step(qwen3, kv, 3)
    with torch.inference_mode():
        eager = qwen3(**step).logits
        written = kv.clone()
        kv.zero_()
        compiled = CompiledLayers(qwen3)
        try:
            got, codes = run_and_get_code(lambda: qwen3(**step).logits)
            assert torch.allclose(got, eager, atol=1e-5) and torch.allclose(kv, written, atol=1e-5)
            # another row count runs the same compiled code: nothing more is compiled
            graphs = counters["stats"]["unique_graphs"]
            assert graphs >= 1   # the counter this reads is live
            qwen3(**other)
            assert counters["stats"]["unique_graphs"] == graphs
        finally:
            compiled.release()
    calls = [line for code in codes for line in code.splitlines() if "supportbot.paged_decode.default(" in line]
    assert calls
    for line in calls:   # the pool goes to the operator as the layer's own input: never a copy
        assert re.fullmatch(r"arg\d+_1", call_arguments(line, "paged_decode.default(")[3]), line
    # four matmuls a layer: q/k/v stacked, o, gate/up stacked, down
    for code in codes:
        assert len(re.findall(r"extern_kernels\.(?:mm|addmm|bmm)\(", code)) == 4, code
    assert "forward" not in qwen3.model.layers[0].__dict__   # released: the layers' own code again


def test_an_eager_steps_plan_never_has_a_size_of_one_to_specialise():
    plan = paged_triton.plan([0], [1], [5], [[7]], 2, torch.device("cpu"), least=2)
    assert all(min(t.shape) >= 2 for t in plan.parts())
    assert plan.seq_len.tolist() == [1, 0] and plan.tile_seq.tolist() == [0, 1]


def test_an_engine_compiles_before_serving_and_never_while_it_serves(tiny_model_dirs):
    """Eager steps of any size (prompts of 1 to 40 tokens, chunked, beside decodes) and decode steps of any row
    count run the code compiled when the engine started."""
    from worker.engine import EngineConfig, LLMEngine, SamplingParams

    torch._dynamo.reset()
    model, tok = load_model(str(tiny_model_dirs["qwen3"]))
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4, max_num_batched_tokens=24, block_size=4,
                                                num_blocks=64, attention_backend="triton", enforce_eager=False,
                                                decode_attention="triton", compile_layers=True,
                                                pack_cpu_linears=False))
    assert engine.runner.compiled_eager and engine.runner.decode_graphs.compiled is not None
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= 1   # the counter this reads is live
    for i, length in enumerate([1, 7, 40, 3, 12]):
        engine.add_request(str(i), prompt_token_ids=list(range(5, 5 + length)),
                           params=SamplingParams(temperature=0, max_new_tokens=6))
        engine.step()
    while engine.has_unfinished():
        engine.step()
    assert counters["stats"]["unique_graphs"] == graphs
    engine.release_model()


def test_a_model_the_compiled_path_cannot_take_runs_its_own_code_and_says_why(tiny_model_dirs, caplog):
    """GPT-2 keeps its blocks in model.transformer.h, not a decoder-layer list: steps run its own code, the log
    names why once, and the answers are generate's."""
    from worker.engine import EngineConfig, LLMEngine, SamplingParams

    model, tok = load_model(str(tiny_model_dirs["gpt2"]))
    ref = load_model(str(tiny_model_dirs["gpt2"]))[0]
    with caplog.at_level("WARNING", logger="worker.engine.model_runner"):
        engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=2, max_num_batched_tokens=16, block_size=4,
                                                    num_blocks=32, attention_backend="triton", enforce_eager=False,
                                                    decode_attention="triton", compile_layers=True))
    assert engine.runner.compiled is None and not engine.runner.compiled_eager
    assert "no list of decoder layers" in engine.runner.not_compiled
    assert [r.getMessage() for r in caplog.records if "uncompiled" in r.getMessage()] == [
        "steps run the model uncompiled: GPT2LMHeadModel has no list of decoder layers (model.model.layers)"]
    ids = list(range(5, 17))
    engine.add_request("a", prompt_token_ids=ids, params=SamplingParams(temperature=0, max_new_tokens=8))
    results = {}
    while engine.has_unfinished():
        for event in engine.step():
            if event.finished:
                results[event.request_id] = event
    want = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                        max_new_tokens=8, do_sample=False)[0, len(ids):].tolist()
    assert results["a"].token_ids == want
