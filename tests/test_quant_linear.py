"""Low-precision linears: each against its de-quantised float weights, row-count invariance, the GGUF Q4_1 reading."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.engine import native
from worker.engine.weights.quantised import (GROUP, BF16_ROWS, KERNEL_DTYPE, BF16Linear, Int4Linear, Int4Weights,
                                        Int8Embedding, Int8Linear, Int8Matmul, QuantReport, W8A8Linear, int4_from_float,
                                        int8_per_channel, kernel_group, quantize_model, quantize_rows)
from worker.engine.weights.gguf_blocks import q4_1_to_int4
from worker.model_loader import ModelLoadError, load_model
from tests.markers import BF16, needs_bf16_matmul

KINDS = ("int4", "int8", BF16, "w8a8")


def linear(weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.nn.Linear:
    module = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
    with torch.no_grad():
        module.weight.copy_(weight)
        if bias is not None:
            module.bias.copy_(bias)
    return module


def make(kind: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.nn.Module:
    if kind == "int4":
        return Int4Linear(int4_from_float(weight), bias)
    if kind == "w8a8":
        return W8A8Linear.group([linear(weight, bias)])[0]
    return Int8Linear(weight, bias) if kind == "int8" else BF16Linear(weight, bias, BF16_ROWS)


@pytest.mark.parametrize("kind", KINDS)
def test_module_matches_its_dequantized_weights(kind):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 128) * 0.1, torch.randn(96)
    module = make(kind, weight, bias)
    dequantized = module.dequantized()
    # The quantisation's own error is within its step: half a scale, rounded to what the kernel holds.
    step = {"int4": (weight.view(96, -1, GROUP).amax(-1) - weight.view(96, -1, GROUP).amin(-1)).max() / 15,
            "int8": weight.abs().amax() / 127, "bfloat16": weight.abs().amax() / 128,
            "w8a8": weight.abs().amax() / 127}[kind]
    assert (dequantized - weight).abs().max() <= step * 0.51
    for shape in ((1, 128), (3, 5, 128), (40, 128)):
        x = torch.randn(*shape)
        if kind == "w8a8":   # activations are quantised per row to int8, and the products summed exactly
            codes, scales = quantize_rows(x.reshape(-1, 128))
            expected = ((codes.float() * scales) @ dequantized.t()).reshape(*shape[:-1], 96) + bias
        else:   # the kernels take bfloat16 activations and return bfloat16 results, accumulated in float32
            expected = x.to(KERNEL_DTYPE).float() @ dequantized.t() + bias
        out = module(x)
        assert out.shape == (*shape[:-1], 96) and out.dtype == torch.float32
        torch.testing.assert_close(out, expected, **({"rtol": 1e-5, "atol": 1e-5} if kind == "w8a8"
                                                     else {"rtol": 1e-2, "atol": 2e-2}))


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("width", [576, 1536])
def test_a_row_gives_the_same_result_whatever_the_row_count(kind, width):
    torch.manual_seed(1)
    # The default model's widths: oneDNN's bf16 matmul takes another blocking past 32 rows (Xeon) and another
    # kernel for a single row of 1536 inputs (AMD Zen).
    module = make(kind, torch.randn(576, width) * 0.1)
    x = torch.randn(300, width)
    full = module(x)
    for rows in (2, 7, 16, 17, 33, 48, 64, 129):
        assert torch.equal(module(x[:rows]), full[:rows]), f"{kind}: {rows} rows differ from the same rows in 300"
    alone = torch.cat([module(x[i:i + 1]) for i in range(40)])
    assert torch.equal(alone, full[:40]), f"{kind}: rows alone differ from the same rows in 300"


@pytest.mark.parametrize("group", [32, 64, 128, 256, 512, 1024])
def test_int4_groups_wider_than_32_and_inputs_taken_in_another_order(group):
    """Checkpoints group 128 inputs or all of them: the kernel takes 32 to 256 and a wider group's scale and zero
    repeat over its parts. An input order (GPTQ's activation order) permutes the input before the kernel."""
    torch.manual_seed(2)
    n, k = 48, 1024
    codes = torch.randint(0, 16, (n, k), dtype=torch.int32)
    scales, zeros = torch.rand(n, k // group) * 0.05 + 0.001, torch.randn(n, k // group) * 0.1
    weights = Int4Weights(codes, scales, zeros, group)
    module = Int4Linear(weights)
    assert module.group == min(group, 256) and module.scales_and_zeros.shape == (k // module.group, n, 2)
    # The kernel holds bfloat16 scales and zeros and hands back bfloat16: one more rounding, at most 2**-8 relative.
    torch.testing.assert_close(module.dequantized(), weights.rounded().dequantize(), rtol=2**-8, atol=1e-6)
    order = torch.randperm(k)
    permuted = Int4Weights(codes, scales, zeros, group, order)
    assert torch.equal(permuted.dequantize()[:, order], weights.dequantize())
    x = torch.randn(5, k)
    assert torch.equal(Int4Linear(permuted)(x), module(x[:, order]))
    assert torch.equal(Int4Linear(permuted).dequantized()[:, order], module.dequantized())


def test_int4_group_that_is_not_a_multiple_of_32_is_refused():
    assert [kernel_group(g) for g in (32, 96, 128, 384, 4096)] == [32, 32, 128, 128, 256]
    with pytest.raises(ValueError, match="group size 48 is not a multiple of 32"):
        Int4Linear(Int4Weights(torch.zeros(16, 96, dtype=torch.int32), torch.ones(16, 2), torch.zeros(16, 2), 48))


def synthetic_q4_1(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    blocks = np.zeros((rows, cols // 32, 20), dtype=np.uint8)
    blocks[..., 0:2] = (rng.uniform(0.001, 0.05, (rows, cols // 32, 1)).astype(np.float16)).view(np.uint8)
    blocks[..., 2:4] = (rng.uniform(-0.4, 0.0, (rows, cols // 32, 1)).astype(np.float16)).view(np.uint8)
    blocks[..., 4:] = rng.integers(0, 256, (rows, cols // 32, 16), dtype=np.uint8)
    return blocks.reshape(rows, -1)


def test_q4_1_blocks_become_int4_codes_that_dequantize_exactly():
    from gguf import GGMLQuantizationType, dequantize

    rows = synthetic_q4_1(48, 256)
    expected = torch.from_numpy(dequantize(rows, GGMLQuantizationType.Q4_1))   # what transformers loads
    weights = q4_1_to_int4(rows)
    assert weights.codes.shape == (48, 256) and int(weights.codes.min()) >= 0 and int(weights.codes.max()) <= 15
    assert torch.equal(weights.dequantize(), expected)
    # Through the kernel: the bfloat16 scales and zeros it holds, and nothing else, separate it from the file.
    module = Int4Linear(weights)
    torch.testing.assert_close(module.dequantized(), weights.rounded().dequantize(), rtol=8e-3, atol=0)
    assert (weights.rounded().dequantize() - expected).abs().max() <= expected.abs().max() * 2**-8


def swapped(tiny, weights: str) -> tuple[torch.Tensor, torch.Tensor, object]:
    """The tiny model's logits for one question before and after quantize_model(weights), and its report."""
    model, tok = tiny
    ids = torch.tensor([tok.encode("Where is my parcel?")])
    with torch.no_grad():
        before = model(ids).logits
        report = quantize_model(model, weights)
        return before, model(ids).logits, report


def test_quantize_model_swaps_every_linear_and_the_tied_embedding(tiny):
    model, _ = tiny
    embedding = model.get_input_embeddings().weight.detach().clone()
    before, after, report = swapped(tiny, "int4")
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert report.layers["int4"] == 2 * 7 + 1 and report.embedding.startswith("int8")
    assert isinstance(model.lm_head, Int4Linear) and isinstance(model.get_input_embeddings(), Int8Embedding)
    lookup = model.get_input_embeddings().dequantized()
    assert (lookup - embedding).abs().max() <= embedding.abs().amax() / 127 / 2 * 1.01
    # Close to the float model (the tiny model's wide random weights make 4 bits coarse), not equal to it.
    similarity = torch.nn.functional.cosine_similarity(after.flatten(), before.flatten(), dim=0)
    assert similarity > 0.9, similarity
    assert not torch.equal(after, before)


def test_bad_weights_name_the_setting_and_the_choices(tiny_model_dir):
    with pytest.raises(ModelLoadError, match=r"WEIGHTS='int3'.*float32, int4, int8, bfloat16, w8a8"):
        load_model(str(tiny_model_dir), weights="int3")
    with pytest.raises(ModelLoadError, match=r"WEIGHTS=int4 runs on the CPU only"):
        load_model(str(tiny_model_dir), device="cuda", weights="int4")


def test_auto_weights_is_w8a8_on_a_float32_cpu_with_vnni_or_avx2_tiles_else_float32(tiny_model_dir, monkeypatch):
    from worker import model_loader
    from worker.settings import WorkerSettings

    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    monkeypatch.setattr(native, "has_vnni", lambda: True)
    assert model_loader.pick_weights(cpu, "auto") == model_loader.pick_weights(cpu, " AUTO") == "w8a8"
    assert model_loader.pick_weights(cpu, "auto", dtype=torch.bfloat16) == "float32"   # DTYPE asked for dense
    assert model_loader.pick_weights(cuda, "auto") == "float32"                        # not refused off the CPU
    assert model_loader.pick_weights(cpu, None) == "float32"                           # the library's: as stored
    assert load_model(str(tiny_model_dir), weights="auto")[0].weights_report.weights == "w8a8"
    monkeypatch.setattr(native, "has_vnni", lambda: False)
    monkeypatch.setattr(native, "int8_tile_kernels", lambda: frozenset({"avx2"}))
    assert model_loader.pick_weights(cpu, "auto") == "w8a8"   # the AVX2 tile kernel, where oneDNN has no VNNI
    monkeypatch.setattr(native, "int8_tile_kernels", lambda: frozenset())
    assert model_loader.pick_weights(cpu, "auto") == "float32"
    monkeypatch.delenv("WEIGHTS", raising=False)
    assert WorkerSettings().weights == "auto"
    monkeypatch.setenv("WEIGHTS", "int4")
    assert WorkerSettings().weights == "int4"


@pytest.mark.real_model
def test_default_gguf_blocks_are_exactly_the_float_weights_transformers_loads(real_model):
    """Every Q4_1 matrix of the bundled GGUF, q and k rows reordered as transformers does, read as int4 codes,
    de-quantises to exactly the float32 weights of the converted model; the Q8_0 embedding too."""
    from worker.model_loader import gguf_int4, resolve_source

    model, _ = real_model
    params = {}   # every linear's dense weight, also where an engine swapped it for a packed one
    for module_name, module in model.named_modules():
        dense = module if isinstance(module, torch.nn.Linear) else getattr(module, "dense", None)
        if isinstance(dense, torch.nn.Linear):
            params[module_name + ".weight"] = dense.weight.detach()
    blocks = gguf_int4(resolve_source(None), model)   # read from the file once, then kept beside the model
    assert len(blocks) == 7 * model.config.num_hidden_layers
    for name in blocks:
        assert torch.equal(blocks[name].dequantize(), params[name].detach()), name
    table = model.get_input_embeddings().weight.detach()
    assert torch.equal(Int8Embedding(table).dequantized(), table)


@needs_bf16_matmul
def test_a_bfloat16_head_gives_a_row_the_same_logits_in_any_batch(tiny):
    model, _ = tiny
    report = quantize_model(model, "int4", head="bfloat16")
    assert isinstance(model.lm_head, BF16Linear) and model.lm_head.rows_per_call == BF16_ROWS
    assert report.layers == {"int4": 2 * 7, "bfloat16": 1} and report.head == "bfloat16"
    assert "lm_head bfloat16" in report.describe()
    # A vocabulary-wide head: oneDNN takes another blocking past BF16_ROWS rows, which no call reaches.
    torch.manual_seed(3)
    head = BF16Linear(torch.randn(8192, 192) * 0.1, rows_per_call=BF16_ROWS)
    x = torch.randn(100, 192)
    alone = torch.cat([head(x[i:i + 1]) for i in range(len(x))])
    for rows in (2, 16, 32, 33, 48, 64, 100):
        assert torch.equal(head(x[:rows]), alone[:rows]), f"{rows} rows"


def test_w8a8_activations_are_quantised_per_row_to_the_rows_own_largest_magnitude():
    x = torch.tensor([[0.6, -1.0, 0.25, 0.0], [0.0, 0.0, 0.0, 0.0], [300.0, 1.0, -2.0, 151.0]])
    codes, scales = quantize_rows(x)
    assert codes.dtype == torch.int8 and codes.abs().amax(1).tolist() == [127, 0, 127]
    assert codes[0].tolist() == [76, -127, 32, 0] and codes[2].tolist() == [127, 0, -1, 64]
    assert scales.squeeze(1).tolist() == pytest.approx([1 / 127, 0, 300 / 127])


def test_w8a8_siblings_share_one_matmul_and_equal_each_layer_alone():
    """q/k/v (or gate/up) read one input: one quantisation and one matmul serve them all, with the same result each
    would get alone (per-output-channel scales do not depend on the neighbours), and nothing is kept afterwards."""
    torch.manual_seed(4)
    layers = [linear(torch.randn(n, 64) * 0.1, torch.randn(n) if n == 32 else None) for n in (48, 16, 32)]
    members = W8A8Linear.group(layers)
    alone = [W8A8Linear.group([m])[0] for m in layers]
    matmul = members[0].matmul
    assert all(m.matmul is matmul for m in members) and isinstance(matmul, Int8Matmul)
    assert [name for name, _ in members[1].named_modules()] == [""]   # its buffers belong to member 0 only
    calls = []
    run = matmul._run
    matmul._run = lambda x: calls.append(x) or run(x)
    x = torch.randn(2, 5, 64)
    outs = [m(x) for m in members]
    assert len(calls) == 1 and matmul.held is None
    for out, single, layer in zip(outs, alone, layers):
        assert out.shape == (2, 5, layer.out_features)
        assert torch.equal(out, single(x))
    # Another input, or the same one written in place, is computed afresh.
    y = torch.randn(2, 5, 64)
    assert torch.equal(members[1](y), alone[1](y)) and len(calls) == 2
    y.mul_(2)
    assert torch.equal(members[2](y), alone[2](y)) and len(calls) == 3
    # A member asked twice for one input before the others had theirs computes again rather than guess.
    assert torch.equal(members[0](x), alone[0](x)) and torch.equal(members[0](x), alone[0](x)) and len(calls) == 5


def test_quantize_model_w8a8_groups_attention_and_mlp_inputs(tiny):
    model, _ = tiny
    before, after, report = swapped(tiny, "w8a8")
    assert not any(type(m) is torch.nn.Linear for m in model.modules())
    assert report.layers == {"w8a8": 2 * 7 + 1} and report.embedding.startswith("int8")
    layer = model.model.layers[0]
    attention, mlp = layer.self_attn, layer.mlp
    assert attention.q_proj.matmul is attention.k_proj.matmul is attention.v_proj.matmul
    assert attention.o_proj.matmul is not attention.q_proj.matmul
    assert mlp.gate_proj.matmul is mlp.up_proj.matmul and mlp.down_proj.matmul is not mlp.up_proj.matmul
    assert len({id(m) for m in model.modules() if isinstance(m, Int8Matmul)}) == 2 * 4 + 1
    similarity = torch.nn.functional.cosine_similarity(after.flatten(), before.flatten(), dim=0)
    assert similarity > 0.95, similarity


@pytest.mark.skipif(native.load_int8_rows() is None, reason="no C compiler for the w8a8 row kernels")
def test_w8a8_row_kernels_give_torch_ops_results_bit_for_bit(two_threads):
    """The C quantiser and scaler (int8_rows.c) against the torch ops they replace: rows of every magnitude, a row
    of zeros, exact halves (rounded to even), strided rows, and enough rows to run on several threads."""
    torch.manual_seed(5)
    members = W8A8Linear.group([linear(torch.randn(n, 96) * 0.1, torch.randn(n)) for n in (64, 32)])
    matmul = members[0].matmul
    x = torch.randn(700, 96) * torch.rand(700, 1) * 50
    x[3] = 0
    x[7] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5] * 12)
    strided = torch.randn(700, 200)[:, 50:146]
    for inputs in (x, x[:1], x[3:4], x[:16], strided, x.view(7, 100, 96)):
        fast = matmul._run(inputs)
        matmul.row_kernels = False
        slow = matmul._run(inputs)
        matmul.row_kernels = True
        assert torch.equal(fast, slow)
    codes, _ = quantize_rows(x[7:8])
    assert codes[0, :8].tolist() == [127, 0, 2, 2, 0, -2, -2, 126]


@pytest.mark.parametrize("kernel", ["amx", "vnni", "avx2"])
def test_w8a8_tile_kernels_give_torch_ops_results_bit_for_bit(kernel, two_threads):
    """The AMX, AVX512-VNNI and AVX2 tile kernels (int8_rows.c) against torch._int_mm and the torch ops, for every
    row count a tile meets (a block of 16 rows or of 4, a part block, several blocks, groups of four blocks and
    beyond), with activations and weights at the int8 range's ends (AVX2's 16-bit pair sums reach 2 * 127 * 127)."""
    if kernel not in native.int8_tile_kernels():
        pytest.skip(f"this CPU or compiler has no {kernel} (native.int8_tile_kernels)")
    torch.manual_seed(6)
    extreme = torch.where(torch.arange(128) % 3 == 0, -1.0, 1.0)   # every code +-127, in rows and in channels
    first = torch.randn(64, 128) * 0.1
    first[:16] = extreme * 0.1
    linears = [linear(first, torch.randn(64)), linear(torch.randn(48, 128) * 0.1, torch.randn(48))]   # 7 tiles
    matmul = W8A8Linear.group(linears)[0].matmul
    assert matmul.kernel is not None and matmul.tiles is not None
    matmul.kernel = kernel
    x = torch.randn(300, 128) * torch.rand(300, 1) * 50
    x[3] = 0
    x[1], x[2] = extreme * 3, -extreme * 3   # sums of 128 products of 127 * 127, either sign
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 9, 16, 17, 33, 48, 64, 65, 80, 300):
        fast = matmul._run(x[:rows])
        matmul.row_kernels = False
        slow = matmul._run(x[:rows])
        matmul.row_kernels = True
        assert torch.equal(fast, slow), rows
    assert matmul._run(x[1:3])[:, :16].abs().min() > 0   # the extreme rows did meet the extreme channels
    codes, _ = int8_per_channel(torch.cat([m.weight for m in linears]))
    assert torch.equal(matmul.plain_codes_t(), codes.t())   # the tiles read back as torch._int_mm's layout


def test_the_load_line_says_which_kernel_takes_the_w8a8_matmuls(tiny):
    model, _ = tiny
    report = quantize_model(model, "w8a8")
    assert sum(report.int8_kernels.values()) == len({id(m) for m in model.modules() if isinstance(m, Int8Matmul)})
    assert set(report.int8_kernels) <= {"amx", "vnni", "avx2", "torch._int_mm"}
    assert "int8 matmuls: " in report.describe()
    mixed = QuantReport("w8a8", {"w8a8": 5}, int8_kernels={"amx": 3, "torch._int_mm": 2})
    assert "3 amx, 2 torch._int_mm (the torch._int_mm ones have shapes outside the tiles" in mixed.describe()


def test_w8a8_on_a_cpu_without_vnni_is_warned_about(tiny, monkeypatch, caplog):
    model, _ = tiny
    monkeypatch.setattr(native, "has_vnni", lambda: False)
    monkeypatch.setattr(native, "int8_tile_kernels", lambda: frozenset({"avx2"}))
    with caplog.at_level("WARNING", logger="worker.engine.weights.quantised"):
        quantize_model(model, "w8a8")
    assert not caplog.text   # the AVX2 tile kernel takes the matmuls
    monkeypatch.setattr(native, "int8_tile_kernels", lambda: frozenset())
    with caplog.at_level("WARNING", logger="worker.engine.weights.quantised"):
        quantize_model(model, "w8a8")
    assert "lists no VNNI instructions" in caplog.text and "WEIGHTS=int4 or float32" in caplog.text


def test_bfloat16_weights_on_a_cpu_without_its_instructions_are_refused_naming_the_setting(tiny, monkeypatch):
    """oneDNN's bfloat16 matmul needs AVX-512 or AVX-NE-CONVERT; elsewhere WEIGHTS=bfloat16 is refused before the
    model loads, saying what to set, rather than failing at the first layer in oneDNN's words."""
    from worker import model_loader
    from worker.engine.weights import quantised

    model, _ = tiny
    refusal = quantised.bfloat16_refusal()
    if refusal is None:   # this CPU runs it: a layer is built, and the refusal is shown by pretending otherwise
        assert BF16Linear(torch.randn(64, 96))(torch.randn(2, 96)).shape == (2, 64)
        monkeypatch.setattr(quantised, "bfloat16_refusal", lambda: "WEIGHTS=bfloat16 needs ... use WEIGHTS=auto")
    message = quantised.bfloat16_refusal()
    assert "WEIGHTS=bfloat16" in message and "WEIGHTS=auto" in message
    with pytest.raises(model_loader.ModelLoadError, match="WEIGHTS=bfloat16"):
        model_loader.pick_weights(torch.device("cpu"), "bfloat16")
    with pytest.raises(ValueError, match="WEIGHTS=bfloat16"):
        quantize_model(model, "bfloat16")
    assert model_loader.pick_weights(torch.device("cpu"), "int4") == "int4"
