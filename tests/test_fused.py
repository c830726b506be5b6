"""Decoder layers with their elementwise work in C on CPU steps (worker/engine/fused.py, layer_ops.c): each kernel
against transformers' expression, the engine's answers against `generate` on the same arithmetic, and the models
and settings that keep the layers' own code."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers.models.llama import modeling_llama

from tests.test_compiled_cpu import PROMPTS, serve
from tests.tiny_model import make_tiny_model_dir
from worker.engine import EngineConfig, LLMEngine, SamplingParams, attention, native
from worker.engine.fused import FusedLayers, unfit_reason
from worker.engine.sizing import fused_for
from worker.model_loader import load_model

pytestmark = pytest.mark.skipif(native.load() is None or native.load_layer_ops() is None,
                                reason="needs a C compiler for the attention and layer kernels")

def close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.allclose(a, b, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("rows", [1, 5, 200])   # 200 rows x 576 splits over the threads
def test_rms_norm_and_the_residual_add_compute_llamas_rmsnorm(rows):
    lib = native.load_layer_ops()
    g = torch.Generator().manual_seed(rows)
    wide = torch.randn(rows, 700, generator=g) * 3
    x, y = wide[:, :576], torch.randn(rows, 576, generator=g)   # x's rows are strided, as a column slice's are
    norm = modeling_llama.LlamaRMSNorm(576, eps=1e-5)
    norm.weight.data = torch.randn(576, generator=g)
    out, total, summed = torch.empty(rows, 576), torch.empty(rows, 576), torch.empty(rows, 576)
    lib.rms_norm_f32(x.data_ptr(), rows, 576, x.stride(0), norm.weight.data_ptr(), 1e-5, out.data_ptr(), 2)
    with torch.no_grad():
        assert close(out, norm(x))
        lib.add_rms_norm_f32(x.data_ptr(), x.stride(0), y.data_ptr(), 576, rows, 576, norm.weight.data_ptr(), 1e-5,
                             total.data_ptr(), summed.data_ptr(), 2)
        assert torch.equal(total, x + y) and close(summed, norm(x + y))


@pytest.mark.parametrize("tokens", [1, 9, 300])
@pytest.mark.parametrize("head_norms", [False, True])   # True: Qwen3's RMSNorm of each head first
def test_rotary_rotates_queries_and_keys_as_transformers_does(tokens, head_norms):
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    lib = native.load_layer_ops()
    g = torch.Generator().manual_seed(tokens)
    heads, kv_heads, d = 9, 3, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * d, generator=g)   # q and k are column slices of one result
    q, k = qkv[:, :heads * d], qkv[:, heads * d:(heads + kv_heads) * d]
    angles = torch.rand(tokens, d // 2, generator=g) * 100
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    q_norm, k_norm = Qwen3RMSNorm(d, eps=1e-6), Qwen3RMSNorm(d, eps=1e-6)
    q_norm.weight.data, k_norm.weight.data = torch.randn(d, generator=g), torch.randn(d, generator=g)
    weights = (q_norm.weight.data_ptr(), k_norm.weight.data_ptr()) if head_norms else (None, None)
    q_out, k_out = torch.empty(tokens, heads, d), torch.empty(tokens, kv_heads, d)
    assert lib.rotary_f32(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), tokens, heads, kv_heads, d,
                          cos.data_ptr(), sin.data_ptr(), *weights, 1e-6, q_out.data_ptr(), k_out.data_ptr(), 2)
    q_heads, k_heads = q.reshape(tokens, heads, d), k.reshape(tokens, kv_heads, d)
    with torch.no_grad():
        if head_norms:
            q_heads, k_heads = q_norm(q_heads), k_norm(k_heads)
        want_q, want_k = modeling_llama.apply_rotary_pos_emb(q_heads.transpose(0, 1)[None],
                                                             k_heads.transpose(0, 1)[None], cos[None], sin[None])
    assert close(q_out, want_q[0].transpose(0, 1)) and close(k_out, want_k[0].transpose(0, 1))


def test_silu_and_multiply_over_the_whole_float_range():
    lib = native.load_layer_ops()
    g = torch.Generator().manual_seed(0)
    rows, cols = 40, 1536   # 40 x 1536 splits over the threads
    gate_up = torch.randn(rows, 2 * cols, generator=g) * 4
    gate_up[0, :8] = torch.tensor([0.0, -0.0, 88.0, -88.0, 100.0, -100.0, 1e-30, -1e-30])
    gate, up = gate_up[:, :cols], gate_up[:, cols:]
    out = torch.empty(rows, cols)
    lib.silu_mul_f32(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), rows, cols, out.data_ptr(), 2)
    want = torch.nn.functional.silu(gate) * up
    assert torch.isfinite(out).all() and torch.allclose(out, want, rtol=1e-5, atol=1e-6)


def engine_for(model, tok, **options) -> LLMEngine:
    return LLMEngine(model, tok, EngineConfig(max_num_seqs=4, max_num_batched_tokens=24, block_size=4, num_blocks=64,
                                              attention_backend="kernel", **options))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])
def test_the_engines_fused_layers_answer_as_generate_on_the_same_arithmetic(arch, tiny_model_dirs, tokenizer,
                                                                            tmp_path, monkeypatch):
    from worker.engine import fused

    calls = []
    real = fused.fused_layer
    monkeypatch.setattr(fused, "fused_layer", lambda *args: calls.append(1) or real(*args))
    path = tiny_model_dirs.get(arch) or make_tiny_model_dir(tmp_path / arch, tokenizer, arch)
    model, tok = load_model(str(path))
    engine = engine_for(model, tok)
    assert engine.runner.fused is not None and "layers fused" in engine.runner.describe_steps()
    got = serve(engine, cap=8)
    layers = model.config.num_hidden_layers
    assert calls and len(calls) % layers == 0
    ref = load_model(str(path))[0]
    attention.register()
    ref.set_attn_implementation(attention.KERNEL_REFERENCE)
    FusedLayers(ref, reference=True)
    calls.clear()
    for rid, ids, cap in [*((str(i), list(range(5, 5 + n)), 8) for i, n in enumerate(PROMPTS)), ("alone", [9], 4)]:
        out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=cap, do_sample=False)
        assert got[rid] == out[0, len(ids):].tolist(), f"{arch} request {rid}"
    assert calls, "the reference ran the model's own layers, not the fused ones"


def test_outside_a_step_and_once_released_the_layers_are_the_models_own(tiny_model_dir):
    from worker.engine.weights.packed import pack_linears

    model, tok = load_model(str(tiny_model_dir))
    ids = torch.tensor([list(range(5, 25))])
    want = model(ids).logits
    packed = load_model(str(tiny_model_dir))[0]
    pack_linears(packed)   # what the engine does to the linears while it holds the model (oneDNN's own last bits)
    want_held = packed(ids).logits
    engine = engine_for(model, tok)
    serve(engine, cap=8)
    # A forward pass of its own (generate, a reference) while the engine holds the model: the model's code.
    model.set_attn_implementation("sdpa")
    assert torch.equal(model(ids).logits, want_held)
    engine.release_model()
    assert all("forward" not in layer.__dict__ for layer in model.model.layers)
    assert torch.equal(model(ids).logits, want)   # the linears unpacked too


def test_models_the_fused_layers_do_not_fit_keep_their_own_code(tiny_model_dirs, tokenizer, tmp_path, caplog):
    gelu = make_tiny_model_dir(tmp_path / "gelu", tokenizer, "llama", hidden_act="gelu_pytorch_tanh")
    for path, why in ((tiny_model_dirs["gpt2"], "no list of decoder layers"), (gelu, "not SiLU")):
        model, tok = load_model(str(path))
        assert why in unfit_reason(model)
        with caplog.at_level(logging.INFO, logger="worker.engine.model_runner"):
            engine = engine_for(model, tok)
        assert engine.runner.fused is None and why in caplog.text
        assert serve(engine, cap=8)   # answers all the same


def test_fused_layers_follow_the_setting(tiny_model_dir, monkeypatch):
    model, tok = load_model(str(tiny_model_dir))
    assert engine_for(model, tok, fused_layers=False).runner.fused is None
    monkeypatch.setenv("FUSED_LAYERS", "0")
    assert not fused_for(EngineConfig())
    assert fused_for(EngineConfig(fused_layers=True))
    monkeypatch.setenv("FUSED_LAYERS", "yes")
    with pytest.raises(ValueError, match="FUSED_LAYERS must be 1 or 0"):
        fused_for(EngineConfig())
    monkeypatch.delenv("FUSED_LAYERS")
    assert fused_for(EngineConfig())


def test_w8a8_siblings_run_their_shared_matmul_once_for_the_same_columns(tiny_model_dir):
    from worker.engine.fused import together
    from worker.engine.weights.quantised import quantize_model

    model, _ = load_model(str(tiny_model_dir))
    quantize_model(model, "w8a8")
    attn = model.model.layers[0].self_attn
    matmul = attn.q_proj.matmul
    runs = []
    real = matmul._run
    matmul._run = lambda x: runs.append(1) or real(x)
    h = torch.randn(5, attn.q_proj.in_features)
    with torch.inference_mode():
        want = (attn.q_proj(h), attn.k_proj(h), attn.v_proj(h))
        runs.clear()
        got = together(attn.q_proj, attn.k_proj, attn.v_proj)(h)
        assert len(runs) == 1 and all(torch.equal(a, b) for a, b in zip(got, want))
        # Not all of the matmul's members, or not in its order: each module on its own.
        runs.clear()
        assert torch.equal(together(attn.k_proj, attn.q_proj, attn.v_proj)(h)[1], want[0]) and len(runs) == 1
        plain = torch.nn.Linear(attn.q_proj.in_features, 3)
        assert torch.equal(together(plain)(h)[0], plain(h))


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3", "mistral"])   # qwen2: biases; qwen3: head norms
def test_a_whole_w8a8_layer_in_one_call_computes_the_kernels_one_by_one_to_the_bit(arch, tiny_model_dirs, tokenizer,
                                                                                   tmp_path, monkeypatch):
    from worker.engine import fused
    from worker.engine.weights.quantised import VNNI_ROWS, WHOLE_TILE_KERNELS, Int8Matmul, quantize_model

    if native.load_layer_step() is None or not native.int8_tile_kernels():
        pytest.skip("needs the whole-layer kernel and a w8a8 tile kernel (AMX, AVX512-VNNI or AVX2)")
    path = tiny_model_dirs.get(arch) or make_tiny_model_dir(tmp_path / arch, tokenizer, arch)
    one_by_one = []
    real = fused.fused_layer
    monkeypatch.setattr(fused, "fused_layer", lambda *args: one_by_one.append(args[3].shape[1]) or real(*args))

    def answers(one_call: bool) -> tuple[dict, list[int]]:
        model, tok = load_model(str(path))
        g = torch.Generator().manual_seed(0)
        for linear in model.modules():   # Qwen2's q/k/v biases, which start at zero
            if isinstance(linear, torch.nn.Linear) and linear.bias is not None:
                linear.bias.data = torch.randn(linear.bias.shape, generator=g)
        quantize_model(model, "w8a8")
        engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4, max_num_batched_tokens=96, block_size=4,
                                                    num_blocks=96, attention_backend="kernel"))
        engine.runner.fused.release()
        engine.runner.fused = FusedLayers(model, one_call=one_call)
        assert all(w is not None for w in engine.runner.fused.whole) == one_call
        assert ("one call a layer" in engine.runner.describe_steps()) == one_call
        one_by_one.clear()
        prompts = {"long": list(range(5, 85)), **{str(i): list(range(7, 7 + n)) for i, n in enumerate(PROMPTS)}}
        for rid, ids in prompts.items():   # the 80-token prompt's first step is past VNNI's rows
            engine.add_request(rid, prompt_token_ids=ids, params=SamplingParams(
                temperature=0, max_new_tokens=8, logprobs=3, prompt_logprobs=2))
        got = {rid: [] for rid in prompts}
        while engine.has_unfinished():
            for event in engine.step():
                got[event.request_id].append((event.token_ids, getattr(event, "finish_reason", None),
                                              getattr(event, "logprobs", None), getattr(event, "prompt_logprobs", None)))
        return got, list(one_by_one)

    whole, rows_left = answers(True)
    kernels, rows_all = answers(False)
    assert whole == kernels   # tokens, and every log-probability to the bit
    assert rows_all and all(rows > VNNI_ROWS for rows in rows_left)
    kernel = next(m.kernel for m in load_model(str(path), weights="w8a8")[0].modules() if isinstance(m, Int8Matmul))
    if kernel == "vnni":
        assert rows_left, "a step past VNNI's rows took the whole-layer call"
    else:   # AMX and AVX2 take every row count in one call a layer
        assert kernel in WHOLE_TILE_KERNELS and not rows_left


@pytest.mark.parametrize("layers", ["own", "fused", "w8a8-one-call"])
def test_a_float16_pool_answers_as_generate_over_its_cache_rounded_to_float16(layers, tiny_model_dir):
    """kv_cache_dtype="float16": the engine's pool holds each K/V row in half the bytes; `generate` on
    KERNEL_REFERENCE_F16 reads transformers' cache rounded the same way, so every token matches, through the
    model's own layers, the C-fused ones and the w8a8 whole-layer call. On this tiny model only the w8a8 case's
    tokens part from a float32 pool's reference (its products are exact); test_attention checks the kernel's
    float16 pool to the bit."""
    from worker.engine.weights.quantised import quantize_model

    if layers == "w8a8-one-call" and (native.load_layer_step() is None or not native.int8_tile_kernels()):
        pytest.skip("needs the whole-layer kernel and a w8a8 tile kernel (AMX or AVX512-VNNI)")

    def loaded():
        model, tok = load_model(str(tiny_model_dir))
        if layers == "w8a8-one-call":
            quantize_model(model, "w8a8")
        return model, tok

    model, tok = loaded()
    engine = engine_for(model, tok, kv_cache_dtype="float16", fused_layers=layers != "own")
    assert engine.runner.kv.dtype == torch.float16
    path = native.attention_path()
    assert engine.runner.describe_steps().startswith(f"attention kernel ({path} path) over a float16 KV pool;")
    fused = engine.runner.fused
    assert (fused is not None) == (layers != "own")
    if fused is not None:
        assert any(w is not None for w in fused.whole) == (layers == "w8a8-one-call")
    got = serve(engine, cap=8)
    ref = loaded()[0]
    attention.register()
    ref.set_attn_implementation(attention.KERNEL_REFERENCE_F16)
    if layers != "own":
        FusedLayers(ref, reference=True)
    for rid, ids, cap in [*((str(i), list(range(5, 5 + n)), 8) for i, n in enumerate(PROMPTS)), ("alone", [9], 4)]:
        out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=cap, do_sample=False)
        assert got[rid] == out[0, len(ids):].tolist(), f"{layers} request {rid}"


def test_a_float16_pool_holds_twice_the_blocks_and_is_refused_where_its_kernel_does_not_run(tiny_model_dir,
                                                                                             monkeypatch):
    monkeypatch.delenv("KV_CACHE_DTYPE", raising=False)
    model, tok = load_model(str(tiny_model_dir))

    def runner(**options):
        return LLMEngine(model, tok, EngineConfig(max_num_seqs=4, max_num_batched_tokens=24, block_size=4,
                                                  kv_cache_memory_gib=0.001, **options)).runner

    full = runner(attention_backend="kernel")
    monkeypatch.setenv("KV_CACHE_DTYPE", "float16")
    half = runner(attention_backend="kernel")
    assert (full.kv.dtype, half.kv.dtype) == (torch.float32, torch.float16)
    assert half.num_blocks in (2 * full.num_blocks, 2 * full.num_blocks + 1)
    with pytest.raises(ValueError, match="float16 KV pool takes a float32 model on the CPU's 'kernel'.*"
                                         "KV_CACHE_DTYPE=auto"):
        runner(attention_backend="gather")
    monkeypatch.setenv("KV_CACHE_DTYPE", "fp8")
    with pytest.raises(ValueError, match="Unknown KV cache dtype 'fp8'; choose one of auto, float16"):
        runner(attention_backend="kernel")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, float16"):
        EngineConfig(kv_cache_dtype="half").validate()
