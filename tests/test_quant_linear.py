"""Low-precision linears: each against its de-quantised float weights, row-count invariance, the GGUF Q4_1 reading."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from worker.engine.quant_linear import (GROUP, BF16_ROWS, KERNEL_DTYPE, BF16Linear, Int4Linear, Int4Weights,
                                        Int8Embedding, Int8Linear, int4_from_float, kernel_group,
                                        quantize_model)
from worker.gguf_blocks import q4_1_to_int4
from worker.model_loader import ModelLoadError, load_model

KINDS = ("int4", "int8", "bfloat16")


def make(kind: str, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.nn.Module:
    if kind == "int4":
        return Int4Linear(int4_from_float(weight), bias)
    return Int8Linear(weight, bias) if kind == "int8" else BF16Linear(weight, bias, BF16_ROWS)


@pytest.mark.parametrize("kind", KINDS)
def test_module_matches_its_dequantized_weights(kind):
    torch.manual_seed(0)
    weight, bias = torch.randn(96, 128) * 0.1, torch.randn(96)
    module = make(kind, weight, bias)
    dequantized = module.dequantized()
    # The quantisation's own error is within its step: half a scale, rounded to what the kernel holds.
    step = {"int4": (weight.view(96, -1, GROUP).amax(-1) - weight.view(96, -1, GROUP).amin(-1)).max() / 15,
            "int8": weight.abs().amax() / 127, "bfloat16": weight.abs().amax() / 128}[kind]
    assert (dequantized - weight).abs().max() <= step * 0.51
    for shape in ((1, 128), (3, 5, 128), (40, 128)):
        x = torch.randn(*shape)
        # The kernels take bfloat16 activations and return bfloat16 results, accumulated in float32.
        expected = x.to(KERNEL_DTYPE).float() @ dequantized.t() + bias
        out = module(x)
        assert out.shape == (*shape[:-1], 96) and out.dtype == torch.float32
        torch.testing.assert_close(out, expected, rtol=1e-2, atol=2e-2)


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


def test_quantize_model_swaps_every_linear_and_the_tied_embedding(tiny):
    model, tok = tiny
    embedding = model.get_input_embeddings().weight.detach().clone()
    ids = torch.tensor([tok.encode("Where is my parcel?")])
    with torch.no_grad():
        before = model(ids).logits
        report = quantize_model(model, "int4")
        after = model(ids).logits
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
    with pytest.raises(ModelLoadError, match=r"WEIGHTS='int3'.*float32, int4, int8, bfloat16"):
        load_model(str(tiny_model_dir), weights="int3")
    with pytest.raises(ModelLoadError, match=r"WEIGHTS=int4 runs on the CPU only"):
        load_model(str(tiny_model_dir), device="cuda", weights="int4")


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
