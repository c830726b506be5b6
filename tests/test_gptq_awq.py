"""GPTQ and AWQ 4-bit checkpoints: their packing read against the publishers' own packers and de-quantisers, loaded
models against float models holding the published de-quantised weights, the engine on them, and settings refused."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from worker.engine import EngineConfig, LLMEngine, RequestFinished, SamplingParams, attention
from worker.engine.fused import FusedLayers
from worker.engine.weights.quantised import Int4Linear, Int8Embedding, bfloat16_refusal
from worker.engine.weights.gptq_awq import awq_int4, gptq_int4
from worker.model_loader import ModelLoadError, load_model

# ---- the publishers' code, transcribed (4-bit paths; the only edits are the noted ones) ------------------------


def autogptq_pack(W, scales, zeros, group_size, bits=4):
    """AutoGPTQ auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py, QuantLinear.pack (2/4/8-bit branch): W [out, in],
    scales and zeros [out, groups]. Edit: returns (qweight, qzeros, scales, g_idx) instead of setting buffers."""
    infeatures = W.shape[1]
    scales = scales.t().contiguous()
    zeros = zeros.t().contiguous()
    scale_zeros = zeros * scales
    self_scales = scales.clone().half()

    intweight = []
    for idx in range(infeatures):
        g_idx = idx // group_size
        intweight.append(
            torch.round(
                (W[:, idx] + scale_zeros[g_idx]) / self_scales[g_idx]
            ).to(torch.int)[:, None]
        )
    intweight = torch.cat(intweight, dim=1)
    intweight = intweight.t().contiguous()
    intweight = intweight.numpy().astype(np.uint32)

    i = 0
    row = 0
    qweight = np.zeros(
        (intweight.shape[0] // 32 * bits, intweight.shape[1]), dtype=np.uint32
    )
    while row < qweight.shape[0]:
        for j in range(i, i + (32 // bits)):
            qweight[row] |= intweight[j] << (bits * (j - i))
        i += 32 // bits
        row += 1

    qweight = qweight.astype(np.int32)

    zeros -= 1
    zeros = zeros.numpy().astype(np.uint32)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // 32 * bits), dtype=np.uint32)
    i = 0
    col = 0
    while col < qzeros.shape[1]:
        for j in range(i, i + (32 // bits)):
            qzeros[:, col] |= zeros[:, j] << (bits * (j - i))
        i += 32 // bits
        col += 1

    qzeros = qzeros.astype(np.int32)
    g_idx = torch.tensor([i // group_size for i in range(infeatures)], dtype=torch.int32)
    return torch.from_numpy(qweight), torch.from_numpy(qzeros), self_scales, g_idx


def autogptq_dequantize(qweight, qzeros, scales, group_size, bits=4):
    """AutoGPTQ qlinear_cuda_old.py, QuantLinear.forward without the CUDA extension (2/4/8-bit branch), up to the
    matmul: the weight [in, out]."""
    wf = torch.tensor(list(range(0, 32, bits)), dtype=torch.int32).unsqueeze(0)
    zeros = torch.bitwise_right_shift(torch.unsqueeze(qzeros, 2).expand(-1, -1, 32 // bits), wf.unsqueeze(0)).to(
        torch.int16 if bits == 8 else torch.int8)
    torch.bitwise_and(zeros, (2 ** bits) - 1, out=zeros)

    zeros = zeros + 1
    zeros = zeros.reshape(-1, 1, zeros.shape[1] * zeros.shape[2])

    scales = scales.reshape(-1, 1, scales.shape[-1])

    weight = torch.bitwise_right_shift(torch.unsqueeze(qweight, 1).expand(-1, 32 // bits, -1), wf.unsqueeze(-1)).to(
        torch.int16 if bits == 8 else torch.int8)
    torch.bitwise_and(weight, (2 ** bits) - 1, out=weight)
    weight = weight.reshape(-1, group_size, weight.shape[2])
    weight = (scales * (weight - zeros))
    return weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])


def gptqmodel_pack(W, scales, zeros, g_idx, bits=4):
    """GPTQModel gptqmodel/nn_modules/qlinear/__init__.py, PackableQuantLinear.pack_original (2/4/8-bit branch, int32
    words): gptq_v2, zeros stored as they are. Edit: returns (qweight, qzeros, scales, g_idx)."""
    pack_dtype_bits, pack_factor, maxq = 32, 32 // bits, 2 ** bits - 1
    scales = scales.T.contiguous()
    zeros = zeros.T.contiguous()
    scale_zeros = zeros * scales
    self_scales = scales.to(dtype=torch.float16)

    int_weight = torch.round((W + scale_zeros[g_idx].T) / scales[g_idx].T)
    int_weight.clamp_(0, maxq)
    int_weight = int_weight.to(torch.int32).T.contiguous()
    int_weight = int_weight.numpy().astype(np.uint32)

    qweight = np.zeros((int_weight.shape[0] // pack_dtype_bits * bits, int_weight.shape[1]), dtype=np.uint32)
    for row in range(qweight.shape[0]):
        for j in range(pack_factor):
            qweight[row] |= int_weight[row * pack_factor + j] << (bits * j)

    zeros = zeros.numpy().astype(np.uint32)
    qzeros = np.zeros((zeros.shape[0], zeros.shape[1] // pack_dtype_bits * bits), dtype=np.uint32)
    for col in range(qzeros.shape[1]):
        for j in range(pack_factor):
            qzeros[:, col] |= zeros[:, col * pack_factor + j] << (bits * j)
    return (torch.from_numpy(qweight.astype(np.int32)), torch.from_numpy(qzeros.astype(np.int32)), self_scales,
            g_idx.to(torch.int32))


def gptqmodel_v2_to_v1(qzeros):
    """GPTQModel gptqmodel/utils/model.py, convert_gptq_v2_to_v1_format_module, bits == 4 (on a copy)."""
    qzeros = qzeros.clone()
    qzeros -= 0b00010001000100010001000100010001
    return qzeros


def gptqmodel_v1_to_v2(qzeros):
    """GPTQModel gptqmodel/utils/model.py, convert_gptq_v1_to_v2_format_module, bits == 4, int32 (on a copy)."""
    qzeros = qzeros.clone()
    qzeros += 0b00010001000100010001000100010001
    return qzeros


def gptqmodel_dequantize(qweight, qzeros, scales, g_idx, bits=4):
    """GPTQModel gptqmodel/nn_modules/qlinear/__init__.py, dequantize_weight (2/4/8-bit branch, num_itr=1), its
    buffers spelled out: the weight [in, out]."""
    pack_factor, maxq, dequant_dtype = 32 // bits, 2 ** bits - 1, torch.int8
    wf = torch.tensor(list(range(0, 32, bits)), dtype=torch.int32)
    wf_unsqueeze_zero, wf_unsqueeze_neg_one = wf.unsqueeze(0), wf.unsqueeze(-1)
    zeros = torch.bitwise_right_shift(
        torch.unsqueeze(qzeros, 2).expand(-1, -1, pack_factor),
        wf_unsqueeze_zero,
    ).to(dequant_dtype)
    zeros = torch.bitwise_and(zeros, maxq).reshape(scales.shape)

    weight = torch.bitwise_and(
        torch.bitwise_right_shift(
            torch.unsqueeze(qweight, 1).expand(-1, pack_factor, -1),
            wf_unsqueeze_neg_one,
        ).to(dequant_dtype),
        maxq
    )
    weight = weight.reshape(weight.shape[0] * weight.shape[1], weight.shape[2])
    return scales[g_idx.long()] * (weight - zeros[g_idx.long()])


def autoawq_pack(W, scales, zeros, group_size, w_bit=4):
    """AutoAWQ awq/modules/linear/gemm.py, WQLinear_GEMM.from_linear: W [out, in], scales and zeros [groups, out].
    Edit: returns (qweight, qzeros, scales) instead of a module."""
    in_features = W.shape[1]
    scale_zeros = zeros * scales

    awq_scales = scales.clone().half()

    pack_num = 32 // w_bit

    intweight = []
    for idx in range(in_features):
        intweight.append(
            torch.round(
                (W[:, idx] + scale_zeros[idx // group_size])
                / awq_scales[idx // group_size]
            ).to(torch.int)[:, None]
        )
    intweight = torch.cat(intweight, dim=1)
    intweight = intweight.t().contiguous()
    intweight = intweight.to(dtype=torch.int32)
    qweight = torch.zeros(
        (intweight.shape[0], intweight.shape[1] // 32 * w_bit),
        dtype=torch.int32,
    )

    for col in range(intweight.shape[1] // pack_num):
        order_map = [0, 2, 4, 6, 1, 3, 5, 7]
        for i in range(pack_num):
            qweight_col = intweight[:, col * pack_num + order_map[i]]
            qweight[:, col] |= qweight_col << (i * w_bit)

    zeros = zeros.to(dtype=torch.int32)
    qzeros = torch.zeros(
        (zeros.shape[0], zeros.shape[1] // 32 * w_bit),
        dtype=torch.int32,
    )

    for col in range(zeros.shape[1] // pack_num):
        order_map = [0, 2, 4, 6, 1, 3, 5, 7]
        for i in range(pack_num):
            qzero_col = zeros[:, col * pack_num + order_map[i]]
            qzeros[:, col] |= qzero_col << (i * w_bit)
    return qweight, qzeros, awq_scales


AWQ_REVERSE_ORDER = [0, 4, 1, 5, 2, 6, 3, 7]


def awq_dequantize_gemm(qweight, qzeros, scales, bits, group_size):
    """AutoAWQ awq/utils/packing_utils.py, dequantize_gemm with unpack_awq and reverse_awq_order inlined: [in, out]."""
    shifts = torch.arange(0, 32, bits, device=qzeros.device)
    iweights = torch.bitwise_right_shift(qweight[:, :, None], shifts[None, None, :]).to(torch.int8)
    iweights = iweights.view(iweights.shape[0], -1)
    izeros = torch.bitwise_right_shift(qzeros[:, :, None], shifts[None, None, :]).to(torch.int8)
    izeros = izeros.view(izeros.shape[0], -1)

    reverse_order_tensor = torch.arange(izeros.shape[-1], dtype=torch.int32, device=izeros.device)
    reverse_order_tensor = reverse_order_tensor.view(-1, 32 // bits)
    reverse_order_tensor = reverse_order_tensor[:, AWQ_REVERSE_ORDER]
    reverse_order_tensor = reverse_order_tensor.view(-1)
    izeros = izeros[:, reverse_order_tensor]
    iweights = iweights[:, reverse_order_tensor]

    iweight = torch.bitwise_and(iweights, (2**bits) - 1)
    izeros = torch.bitwise_and(izeros, (2**bits) - 1)

    scales = scales.repeat_interleave(group_size, dim=0)
    izeros = izeros.repeat_interleave(group_size, dim=0)
    return (iweight - izeros) * scales


# ---- the packed formats, word by word ------------------------------------------------------------------------

def random_words(*shape, seed):
    return torch.randint(-2**31, 2**31 - 1, shape, dtype=torch.int32, generator=torch.Generator().manual_seed(seed))


def fp16_scales(*shape, seed):
    return (torch.rand(*shape, generator=torch.Generator().manual_seed(seed)) * 0.05 + 1e-3).half()


@pytest.mark.parametrize("group", [32, 128])
def test_any_packed_words_read_exactly_as_the_publishers_dequantize_them(group):
    """Random words: every nibble value, negative words, v1 zeros that borrowed. The publishers' de-quantisation
    is run on float32 scales (it takes any dtype), where (q - z) s is exact, as is ours (q - 8) s + (8 - z) s."""
    k, n = 256, 48
    qweight, qzeros, scales = random_words(k // 8, n, seed=1), random_words(k // group, n // 8, seed=2), \
        fp16_scales(k // group, n, seed=3)
    g_idx = torch.arange(k, dtype=torch.int32) // group
    ours = gptq_int4(qweight, qzeros, scales, g_idx, v1=True)
    assert ours.group == group and ours.order is None and int(ours.codes.max()) <= 15
    assert torch.equal(ours.dequantize().t(),
                       gptqmodel_dequantize(qweight, gptqmodel_v1_to_v2(qzeros), scales.float(), g_idx))
    v2 = gptq_int4(qweight, qzeros, scales, g_idx, v1=False).dequantize().t()
    assert torch.equal(v2, gptqmodel_dequantize(qweight, qzeros, scales.float(), g_idx))
    # AutoGPTQ reads each v1 zero as nibble + 1; the same wherever no nibble of the word is 15 (no borrow).
    plain = qzeros & 0x77777777   # every nibble 0..7
    assert torch.equal(gptq_int4(qweight, plain, scales, g_idx, v1=True).dequantize().t(),
                       autogptq_dequantize(qweight, plain, scales.float(), group))
    awq_weight, awq_zeros = random_words(k, n // 8, seed=4), random_words(k // group, n // 8, seed=5)
    assert torch.equal(awq_int4(awq_weight, awq_zeros, scales).dequantize().t(),
                       awq_dequantize_gemm(awq_weight, awq_zeros, scales.float(), 4, group))


def test_activation_order_reads_as_a_permutation_of_the_inputs():
    k, n, group = 256, 32, 64
    qweight, qzeros, scales = random_words(k // 8, n, seed=6), random_words(k // group, n // 8, seed=7), \
        fp16_scales(k // group, n, seed=8)
    perm = torch.randperm(k, generator=torch.Generator().manual_seed(9))
    g_idx = (torch.argsort(perm) // group).to(torch.int32)   # GPTQ: g_idx[perm[i]] = i // group
    ours = gptq_int4(qweight, qzeros, scales, g_idx, v1=False)
    assert ours.order is not None
    assert torch.equal(ours.dequantize().t(), gptqmodel_dequantize(qweight, qzeros, scales.float(), g_idx))
    x = torch.randn(3, k, generator=torch.Generator().manual_seed(10))
    module = Int4Linear(ours)
    expected = x.bfloat16().float() @ module.dequantized().t()
    # Sums of 256 products, accumulated in float32 and handed back in bfloat16: within 1% of the largest output.
    assert (module(x) - expected).abs().max() <= 0.01 * expected.abs().max()


# ---- checkpoints of tiny models -------------------------------------------------------------------------------

CASES = {
    # name: (tiny architecture, quantization_config, shards)
    "gptq-v1-sym": ("llama", dict(quant_method="gptq", bits=4, group_size=32, desc_act=False, sym=True,
                                  checkpoint_format="gptq"), 1),
    "gptq-v1-asym": ("llama", dict(quant_method="gptq", bits=4, group_size=64, desc_act=False, sym=False,
                                   checkpoint_format="gptq"), 1),
    "gptq-v2-desc-act": ("qwen2", dict(quant_method="gptq", bits=4, group_size=32, desc_act=True, sym=False,
                                       checkpoint_format="gptq_v2"), 1),
    "gptq-v2-all-inputs": ("llama", dict(quant_method="gptq", bits=4, group_size=-1, desc_act=False, sym=True,
                                         checkpoint_format="gptq_v2"), 1),
    "awq": ("llama", dict(quant_method="awq", bits=4, group_size=32, zero_point=True, version="gemm"), 2),
}


def quantizer_params(W: torch.Tensor, group: int, sym: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-group scale and integer zero as GPTQ's quantizer finds them (the range widened to take in 0), [out,
    groups], the scales float16 values so the packers' .half() keeps them."""
    g = W.view(W.shape[0], -1, group)
    low, high = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
    if sym:
        high = torch.maximum(-low, high)
        low = -high
    scales = ((high - low) / 15).clamp_min(1e-4).half().float()
    zeros = torch.full_like(scales, 8.0) if sym else torch.round(-low / scales)
    return scales, zeros


def fake_quantize(W, scales, zeros, group_of):
    """Each weight on its grid: scale * (clamp(round(w / scale) + zero) - zero), input k in group group_of[k]."""
    s, z = scales[:, group_of], zeros[:, group_of]
    return s * (torch.clamp(torch.round(W / s) + z, 0, 15) - z)


def quantize_linear(name: str, W: torch.Tensor, settings: dict, seed: int) -> tuple[dict, torch.Tensor]:
    """One linear's checkpoint tensors by the case's publisher, and that publisher's de-quantised weight [out, in]."""
    out_features, in_features = W.shape
    group = in_features if settings["group_size"] == -1 else settings["group_size"]
    sym = settings.get("sym", False)
    W = W.clone()
    if not sym:
        W[0, :group] = W[0, :group].abs()   # a group whose zero is 0: in v1 its nibble borrows from the next one
    order = torch.arange(in_features)
    if settings.get("desc_act"):
        order = torch.randperm(in_features, generator=torch.Generator().manual_seed(seed))
    g_idx = torch.argsort(order) // group     # input k is quantised at position argsort(order)[k]
    scales, zeros = quantizer_params(W[:, order], group, sym)
    Wq = fake_quantize(W, scales, zeros, g_idx)
    if settings["quant_method"] == "awq":
        qweight, qzeros, half_scales = autoawq_pack(Wq, scales.t().contiguous(), zeros.t().contiguous(), group)
        reference = awq_dequantize_gemm(qweight, qzeros, half_scales.float(), 4, group)
        return {"qweight": qweight, "qzeros": qzeros, "scales": half_scales}, reference.t()
    if settings["checkpoint_format"] == "gptq" and sym:
        qweight, qzeros, half_scales, g_idx32 = autogptq_pack(Wq, scales, zeros.clone(), group)
        reference = autogptq_dequantize(qweight, qzeros, half_scales.float(), group)
    else:
        qweight, qzeros, half_scales, g_idx32 = gptqmodel_pack(Wq, scales, zeros, g_idx)
        reference = gptqmodel_dequantize(qweight, qzeros, half_scales.float(), g_idx32)
        if settings["checkpoint_format"] == "gptq":
            v2_zeros, qzeros = qzeros, gptqmodel_v2_to_v1(qzeros)
            assert torch.equal(gptqmodel_v1_to_v2(qzeros), v2_zeros)
    assert (reference.t() - Wq).abs().max() <= scales.max() * 2**-10, name   # the packers kept the grid
    return {"qweight": qweight, "qzeros": qzeros, "scales": half_scales, "g_idx": g_idx32}, reference.t()


def write_checkpoint(source: Path, target: Path, arch_settings: dict, shards: int) -> dict[str, torch.Tensor]:
    """A quantised copy of a tiny model directory: its linears (not the lm_head) packed, the rest float16 as
    quantisers save it. Returns the reference de-quantised weight of each linear and every stored tensor, in
    float32, by parameter name."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32)
    tensors, reference = {}, {}
    linears = {name: m for name, m in model.named_modules() if type(m) is torch.nn.Linear and name != "lm_head"}
    for seed, (name, linear) in enumerate(sorted(linears.items())):
        packed, weight = quantize_linear(name, linear.weight.detach(), arch_settings, seed)
        tensors.update({f"{name}.{key}": value for key, value in packed.items()})
        reference[f"{name}.weight"] = weight
        if linear.bias is not None:
            tensors[f"{name}.bias"] = linear.bias.detach().half()
            reference[f"{name}.bias"] = tensors[f"{name}.bias"].float()
    for key, value in model.state_dict().items():
        owner = key.rpartition(".")[0]
        if owner not in linears and not (key == "lm_head.weight" and model.config.tie_word_embeddings):
            tensors[key] = value.half()
            reference[key] = tensors[key].float()
    target.mkdir()
    keys = sorted(tensors)
    parts = [keys[i::shards] for i in range(shards)]
    names = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)] if shards > 1 \
        else ["model.safetensors"]
    for part, file in zip(parts, names):
        save_file({key: tensors[key].contiguous() for key in part}, str(target / file), metadata={"format": "pt"})
    if shards > 1:
        (target / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {key: file for part, file in zip(parts, names) for key in part}}))
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = arch_settings
    (target / "config.json").write_text(json.dumps(config))
    for extra in source.iterdir():
        if extra.name not in ("config.json", "model.safetensors"):
            shutil.copy(extra, target / extra.name)
    return reference


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, tiny_model_dirs):
    root = tmp_path_factory.mktemp("quantised")
    return {case: (root / case, write_checkpoint(tiny_model_dirs[arch], root / case, settings, shards))
            for case, (arch, settings, shards) in CASES.items()}


def float_model(source: Path, reference: dict[str, torch.Tensor]):
    """The tiny model holding the checkpoint's reference weights, dense float32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    missing, unexpected = model.load_state_dict(reference, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}
    return model


def prompt(tokenizer) -> torch.Tensor:
    return torch.tensor([tokenizer.encode("Where is my parcel? It was due on Monday and the tracking says nothing.")])


@pytest.mark.parametrize("case", list(CASES))
def test_checkpoint_loads_onto_the_int4_kernel_as_published(case, checkpoints, tiny_model_dirs):
    path, reference = checkpoints[case]
    arch, settings, _ = CASES[case]
    # WEIGHTS unset in the worker (auto) reads it as the library's None does: the checkpoint's own int4.
    model, tokenizer = load_model(str(path), weights="auto" if case == "awq" else None)
    report = model.weights_report
    layers = {name: m for name, m in model.named_modules() if isinstance(m, Int4Linear)}
    assert len(layers) == 14 and report.from_checkpoint == 14 and report.layers == {"int4": 14}
    assert report.checkpoint == settings["quant_method"].upper() and report.kept_float == ["lm_head"]
    assert "14 from the" in report.describe()
    for name, layer in layers.items():
        expected = reference[f"{name}.weight"]
        # The kernel holds each scale s and zero (8 - z) s in bfloat16 (8 significant bits: each off by up to 2**-8
        # of itself) and hands back bfloat16 (2**-8 of the weight), the rest is exact:
        # |error| <= 2**-8 (|q - 8| s + |8 - z| s + |w|) <= 2**-8 (16 s + |w|), s taken as the kernel holds it.
        s = layer.scales_and_zeros[..., 0].float().t().repeat_interleave(layer.group, 1)
        if layer.order is not None:
            s = s[:, torch.argsort(layer.order)]
        bound = 2**-8 * (16 * s * (1 + 2**-7) + expected.abs()) * 1.01
        assert ((layer.dequantized() - expected).abs() <= bound).all(), name
        if f"{name}.bias" in reference:
            assert torch.equal(layer.bias, reference[f"{name}.bias"])
    assert (layers["model.layers.0.mlp.down_proj"].order is not None) == settings.get("desc_act", False)
    ids = prompt(tokenizer)
    with torch.no_grad():
        expected = float_model(tiny_model_dirs[arch], reference)(ids).logits
        logits = model(ids).logits
    # The kernel rounds every linear's input and its scales to bfloat16: over these five checkpoints and two prompts
    # that moved the logits by at most 1.8% RMS (3.4% of their largest magnitude at one position), where every zero
    # read one step off moves them by about 130% RMS.
    error = logits - expected
    assert error.pow(2).mean().sqrt() <= 0.03 * expected.pow(2).mean().sqrt()
    assert error.abs().max() <= 0.06 * expected.abs().max()


@pytest.mark.parametrize("case", ["gptq-v1-asym", "gptq-v2-desc-act", "awq"])
def test_dequantised_checkpoint_is_exactly_the_published_weights(case, checkpoints, tiny_model_dirs):
    path, reference = checkpoints[case]
    model, tokenizer = load_model(str(path), weights="float32")
    assert not any(isinstance(m, Int4Linear) for m in model.modules())
    assert model.weights_report.dequantized == 14 and "14 de-quantised from the" in model.weights_report.describe()
    params = dict(model.named_parameters())
    for key, value in reference.items():
        assert torch.equal(params[key], value), key
    ids = prompt(tokenizer)
    with torch.no_grad():
        assert torch.equal(model(ids).logits, float_model(tiny_model_dirs[CASES[case][0]], reference)(ids).logits)


def test_weights_int4_also_quantises_the_rest_and_bfloat16_swaps_the_dequantised(checkpoints):
    path, _ = checkpoints["gptq-v1-sym"]
    model, _ = load_model(str(path), weights="int4")
    report = model.weights_report
    assert isinstance(model.lm_head, Int4Linear) and isinstance(model.get_input_embeddings(), Int8Embedding)
    assert report.layers == {"int4": 15} and report.from_checkpoint == 14 and report.requantized == 1
    assert "14 from the GPTQ checkpoint's 4-bit codes, 1 quantised from float" in report.describe()
    if bfloat16_refusal() is None:   # oneDNN's bfloat16 matmul runs on this CPU
        model, _ = load_model(str(path), weights="bfloat16")
        assert model.weights_report.layers == {"bfloat16": 15} and model.weights_report.dequantized == 14
    model, _ = load_model(str(path), weights="w8a8")
    assert model.weights_report.layers == {"w8a8": 15} and model.weights_report.dequantized == 14
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.matmul is attention.v_proj.matmul   # the de-quantised q/k/v share one int8 matmul


@pytest.mark.parametrize("case", ["gptq-v2-desc-act", "awq"])
def test_engine_greedy_equals_generate_on_the_loaded_checkpoint(case, checkpoints):
    path, _ = checkpoints[case]
    model, tokenizer = load_model(str(path))
    ref = load_model(str(path))[0]
    # The engine's arithmetic: its attention kernel and its fused layers. With int4 weights SDPA's last bits part from
    # the kernel's on some CPUs, and the fused layers' q and k from the model's own code (by 5e-7 on AVX2-only CPUs),
    # enough to tip the random checkpoint's near-tied tokens.
    attention.register()
    ref.set_attn_implementation(attention.KERNEL_REFERENCE)
    FusedLayers(ref, reference=True)
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=2, max_num_batched_tokens=24, block_size=4,
                                                      num_blocks=48, attention_backend="kernel"))
    prompts = [list(tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                                  return_dict=False))
               for q in ("Where is my parcel?", "Can I return shoes I have worn once?")]
    for i, ids in enumerate(prompts):
        engine.add_request(str(i), prompt_token_ids=ids, params=SamplingParams(temperature=0.0, max_new_tokens=12))
    results = {}
    while engine.has_unfinished():
        for event in engine.step():
            if isinstance(event, RequestFinished):
                results[event.request_id] = event.token_ids
    for i, ids in enumerate(prompts):
        out = ref.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                           max_new_tokens=12, do_sample=False)
        assert results[str(i)] == out[0, len(ids):].tolist(), f"{case}: request {i} differs"


# ---- settings refused --------------------------------------------------------------------------------------

def rewrite(checkpoints, tmp_path, case: str, **settings) -> Path:
    source, _ = checkpoints[case]
    target = tmp_path / case
    shutil.copytree(source, target)
    config = json.loads((target / "config.json").read_text())
    config["quantization_config"].update(settings)
    (target / "config.json").write_text(json.dumps(config))
    return target


@pytest.mark.parametrize("settings,message", [
    (dict(bits=8), r"GPTQ with bits=8; the checkpoints read here are 4-bit GPTQ .* Use a 4-bit checkpoint, or the "
                   r"unquantised model with WEIGHTS=int8"),
    (dict(group_size=48), r"GPTQ with group_size=48; the checkpoints read here .* group_size a multiple of 32 or "
                          r"-1\. Use one quantised with group_size 32, 64, 128 or -1"),
    (dict(checkpoint_format="marlin"), r"GPTQ with checkpoint_format='marlin' \(a kernel-specific layout\).* Use "
                                       r"the model's plain GPTQ export"),
    (dict(quant_method="bitsandbytes"), r"quantization_config has quant_method 'bitsandbytes'; the checkpoints read "
                                        r"here are 4-bit GPTQ .* \(WEIGHTS=int4 or int8 quantises it on load\)"),
])
def test_unsupported_settings_name_the_setting_and_what_is_read(settings, message, checkpoints, tmp_path):
    path = rewrite(checkpoints, tmp_path, "gptq-v1-sym", **settings)
    with pytest.raises(ModelLoadError, match=rf"MODEL='{re.escape(str(path))}': {message}"):
        load_model(str(path))


def test_awq_gemv_is_refused(checkpoints, tmp_path):
    path = rewrite(checkpoints, tmp_path, "awq", version="gemv")
    with pytest.raises(ModelLoadError, match=r"AWQ with version='gemv'.*GEMM layout\)\. Use the model's GEMM"):
        load_model(str(path))


def test_desc_act_g_idx_that_is_not_an_activation_order_is_refused(checkpoints, tmp_path):
    from safetensors.torch import load_file

    path = rewrite(checkpoints, tmp_path, "gptq-v2-desc-act")
    tensors = load_file(str(path / "model.safetensors"))
    key = "model.layers.1.self_attn.o_proj.g_idx"
    tensors[key] = torch.zeros_like(tensors[key])     # every input in group 0 of 2
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"model.layers.1.self_attn.o_proj: g_idx does not give each of the 2 "
                                             r"groups 32 inputs\. desc_act=True is read when .* re-quantise this "
                                             r"model with desc_act=False"):
        load_model(str(path))


def test_int4_weights_on_cuda_are_refused_before_loading(checkpoints):
    path, _ = checkpoints["awq"]
    with pytest.raises(ModelLoadError, match=r"WEIGHTS=int4 runs on the CPU only.*unset WEIGHTS: the AWQ checkpoint "
                                             r"is then de-quantised to DTYPE"):
        load_model(str(path), device="cuda", weights="int4")


def test_autogptq_quantize_config_file_is_read_where_config_json_has_none(checkpoints, tmp_path):
    source, reference = checkpoints["gptq-v1-sym"]
    path = tmp_path / "old-autogptq"
    shutil.copytree(source, path)
    config = json.loads((path / "config.json").read_text())
    settings = config.pop("quantization_config")
    (path / "config.json").write_text(json.dumps(config))
    (path / "quantize_config.json").write_text(json.dumps(
        {key: settings[key] for key in ("bits", "group_size", "desc_act", "sym")}))
    model, _ = load_model(str(path), weights="float32")
    assert torch.equal(model.model.layers[1].mlp.up_proj.weight, reference["model.layers.1.mlp.up_proj.weight"])


def test_checkpoint_without_safetensors_is_refused(checkpoints, tmp_path):
    path = rewrite(checkpoints, tmp_path, "gptq-v1-sym")
    (path / "model.safetensors").rename(path / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match=r"holds no \.safetensors files; quantised checkpoints are read from "):
        load_model(str(path))
