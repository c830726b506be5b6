"""GPTQ and AWQ 4-bit checkpoints read from safetensors as int4 codes, scales and zeros, and the model built on them."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from worker.engine.weights.quantised import INT4_N_MULTIPLE, Int4Linear, Int4Weights, QuantReport, kernel_group

log = logging.getLogger(__name__)

BITS = 4
SHIFTS = torch.arange(0, 32, BITS, dtype=torch.int32)   # 8 codes per int32, the lowest bits first
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)    # AutoAWQ's GEMM packing: nibble i of a word holds column AWQ_ORDER[i]
V1_ZERO_OFFSET = 0x11111111             # GPTQ v1 stores each zero minus one: gptqmodel subtracts this from the word
GPTQ_FORMATS = ("gptq", "gptq_v2")
SUPPORTED = ("4-bit GPTQ (checkpoint_format gptq or gptq_v2, sym or not, desc_act with GPTQ's activation-order "
             "g_idx) and 4-bit AWQ (version gemm), group_size a multiple of 32 or -1")
QUANTIZED_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "bias")


class CheckpointError(ValueError):
    """A quantised checkpoint this loader cannot read; the message says which setting and what is supported."""


@dataclass
class QuantSpec:
    """A checkpoint's quantization_config, as far as reading its tensors goes."""

    method: str             # "gptq" or "awq"
    group: int              # inputs per scale; -1: all of a layer's inputs
    checkpoint_format: str  # "gptq" (zeros stored minus one), "gptq_v2" or "gemm" (AWQ)

    @property
    def label(self) -> str:
        return "AWQ" if self.method == "awq" else "GPTQ"


def quant_spec(config: dict, quantize_config: dict | None = None) -> QuantSpec | None:
    """The spec of a config.json's quantization_config (or an old AutoGPTQ quantize_config.json), None when the
    model is not quantised; CheckpointError for anything but 4-bit GPTQ and AWQ."""
    settings = config.get("quantization_config")
    if settings is None and quantize_config is not None:
        settings = {"quant_method": "gptq", **quantize_config}
    if settings is None:
        return None
    method = str(settings.get("quant_method", "")).lower()
    if method not in ("gptq", "awq"):
        raise CheckpointError(f"quantization_config has quant_method {method!r}; the checkpoints read here are "
                              f"{SUPPORTED}. Use one of those, the unquantised model (WEIGHTS=int4 or int8 "
                              "quantises it on load) or a GGUF file.")
    bits = settings.get("bits", settings.get("w_bit"))
    group = int(settings.get("group_size", settings.get("q_group_size", -1)))
    if bits != BITS:
        raise CheckpointError(f"{method.upper()} with bits={bits}; the checkpoints read here are {SUPPORTED}. Use a "
                              "4-bit checkpoint, or the unquantised model with WEIGHTS=int8 or int4.")
    if group != -1:
        try:
            kernel_group(group)
        except ValueError:
            raise CheckpointError(f"{method.upper()} with group_size={group}; the checkpoints read here are "
                                  f"{SUPPORTED}. Use one quantised with group_size 32, 64, 128 or -1.") from None
    if method == "gptq":
        fmt = str(settings.get("checkpoint_format") or settings.get("format") or "gptq").lower()
        if fmt not in GPTQ_FORMATS:
            raise CheckpointError(f"GPTQ with checkpoint_format={fmt!r} (a kernel-specific layout); the checkpoints "
                                  f"read here are {SUPPORTED}. Use the model's plain GPTQ export.")
        if str(settings.get("pack_dtype", "int32")).removeprefix("torch.") != "int32":
            raise CheckpointError(f"GPTQ with pack_dtype={settings['pack_dtype']!r}; the checkpoints read here pack "
                                  "codes in int32 words (the default).")
        return QuantSpec("gptq", group, fmt)
    version = str(settings.get("version", "gemm")).lower()
    backend = str(settings.get("backend", "autoawq")).lower()
    if version != "gemm" or backend not in ("autoawq", "none"):
        raise CheckpointError(f"AWQ with version={version!r}, backend={backend!r}; the checkpoints read here are "
                              f"{SUPPORTED} (AutoAWQ's GEMM layout). Use the model's GEMM export.")
    if settings.get("zero_point") is False:
        raise CheckpointError("AWQ with zero_point=false; the checkpoints read here are "
                              f"{SUPPORTED}, with zero points (AutoAWQ's default).")
    return QuantSpec("awq", group, "gemm")


def unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> codes [8 R, C]: word r's nibble i is row 8 r + i."""
    rows, cols = packed.shape
    return ((packed.unsqueeze(1) >> SHIFTS.view(1, -1, 1)) & 0xF).reshape(rows * 8, cols)


def unpack_cols(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> codes [R, 8 C]: word c's nibble i is column 8 c + i."""
    rows, cols = packed.shape
    return ((packed.unsqueeze(2) >> SHIFTS.view(1, 1, -1)) & 0xF).reshape(rows, cols * 8)


def _awq_columns(cols: int) -> torch.Tensor:
    """Where each column sits in AWQ's unpacked nibbles: column 8 c + m is nibble AWQ_ORDER.index(m) of word c."""
    inverse = torch.argsort(torch.tensor(AWQ_ORDER))
    return (torch.arange(0, cols, 8).view(-1, 1) + inverse.view(1, -1)).reshape(-1)


def _int4(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int,
          order: torch.Tensor | None = None) -> Int4Weights:
    """codes [K, N], integer zeros and scales [K // group, N] with w = (q - z) s -> our [N, K] convention
    w = (q - 8) s + (8 - z) s; exact in float32 (a 5-bit integer times a float16 scale)."""
    s = scales.float().t().contiguous()
    return Int4Weights(codes.t().contiguous().to(torch.int32), s, ((8 - zeros.float()).t() * s).contiguous(),
                       group, order)


def _group(rows: int, groups: int, name: str) -> int:
    if groups < 1 or rows % groups:
        raise CheckpointError(f"{name}: {rows} inputs do not split into {groups} groups of equal size; the "
                              f"checkpoints read here are {SUPPORTED}, in_features a multiple of group_size.")
    return rows // groups


def gptq_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, g_idx: torch.Tensor | None,
              v1: bool, name: str = "layer") -> Int4Weights:
    """A GPTQ linear: qweight int32 [K / 8, N] packed along K, qzeros int32 [K / G, N / 8] packed along N, scales
    float16 [K / G, N], g_idx [K] (each input's group); w = (q - z) s. checkpoint_format "gptq" (v1) stores z - 1
    per nibble: gptqmodel writes it by subtracting 0x11111111 from the packed word (a zero of 0 borrows from the
    next nibble) and reads it back by adding that (int32 arithmetic wraps), as done here; where no nibble borrowed
    (every symmetric checkpoint) that is AutoGPTQ's (nibble + 1)."""
    codes = unpack_rows(qweight)
    inputs, outputs = codes.shape
    zeros = unpack_cols(qzeros + V1_ZERO_OFFSET if v1 else qzeros)[:, :outputs]
    group = _group(inputs, scales.shape[0], name)
    plain = torch.arange(inputs) // group
    order = None
    if g_idx is not None and not torch.equal(g_idx.long(), plain):
        # desc_act: GPTQ quantised the inputs in another order and each group still holds `group` of them.
        order = torch.argsort(g_idx.long(), stable=True)
        if not torch.equal(g_idx.long()[order], plain):
            raise CheckpointError(f"{name}: g_idx does not give each of the {scales.shape[0]} groups {group} inputs. "
                                  "desc_act=True is read when g_idx is GPTQ's activation order (a permutation of "
                                  "the inputs, group_size to a group); re-quantise this model with desc_act=False.")
        codes = codes[order]
    return _int4(codes, zeros, scales, group, order)


def awq_int4(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor, name: str = "layer") -> Int4Weights:
    """An AWQ GEMM linear: qweight int32 [K, N / 8] and qzeros int32 [K / G, N / 8], both packed along N in
    AWQ_ORDER, scales float16 [K / G, N]; w = (q - z) s."""
    columns = _awq_columns(qweight.shape[1] * 8)
    codes = unpack_cols(qweight)[:, columns]
    zeros = unpack_cols(qzeros)[:, columns]
    return _int4(codes, zeros, scales, _group(codes.shape[0], scales.shape[0], name))


class Safetensors:
    """The tensors of a model directory's .safetensors files (sharded or not), read one at a time."""

    def __init__(self, path: Path) -> None:
        from safetensors import safe_open

        index = path / "model.safetensors.index.json"
        if index.is_file():
            files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        else:
            files = sorted(p.name for p in path.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"{path} holds no .safetensors files; quantised checkpoints are read from "
                                  "safetensors.")
        self.files = {name: safe_open(str(path / name), framework="pt") for name in files}
        self.where = {key: name for name, handle in self.files.items() for key in handle.keys()}

    def __contains__(self, key: str) -> bool:
        return key in self.where

    def __iter__(self):
        return iter(self.where)

    def get(self, key: str) -> torch.Tensor:
        return self.files[self.where[key]].get_tensor(key)


def read_int4(tensors: Safetensors, prefix: str, spec: QuantSpec) -> Int4Weights:
    """One quantised linear's codes, scales and zeros, by its module name."""
    missing = [s for s in ("qweight", "qzeros", "scales") if f"{prefix}.{s}" not in tensors]
    if missing:
        raise CheckpointError(f"{prefix}: the checkpoint has no {', '.join(missing)}; it is not a {spec.label} "
                              f"checkpoint of the kind read here ({SUPPORTED}).")
    qweight, qzeros, scales = (tensors.get(f"{prefix}.{s}") for s in ("qweight", "qzeros", "scales"))
    if spec.method == "awq":
        return awq_int4(qweight, qzeros, scales, prefix)
    g_idx = tensors.get(f"{prefix}.g_idx") if f"{prefix}.g_idx" in tensors else None
    return gptq_int4(qweight, qzeros, scales, g_idx, spec.checkpoint_format == "gptq", prefix)


def load_quantized(path: Path, spec: QuantSpec, dtype: torch.dtype, attn_implementation: str,
                   int4: bool) -> tuple[nn.Module, QuantReport]:
    """The model of a GPTQ or AWQ directory on the CPU: its quantised linears as Int4Linear layers built from the
    checkpoint's codes (`int4`) or de-quantised to dense `dtype` weights, every other tensor as stored in `dtype`.
    The model is built without weights and filled one tensor at a time, so no float copy of a quantised weight
    outlives its layer."""
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM, GenerationConfig

    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    with init_empty_weights(include_buffers=False):   # parameters on the meta device, buffers (RoPE) computed
        llm = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    if (path / "generation_config.json").is_file():
        llm.generation_config = GenerationConfig.from_pretrained(path)
    tensors = Safetensors(path)
    modules = dict(llm.named_modules())
    quantized = sorted(key.removesuffix(".qweight") for key in tensors if key.endswith(".qweight"))
    if not quantized:
        raise CheckpointError(f"{path}: its config says {spec.label} but no tensor is named *.qweight.")
    report = QuantReport("int4" if int4 else "float32", checkpoint=spec.label)
    with torch.no_grad():
        for prefix in quantized:
            _place(llm, modules, prefix, tensors, spec, dtype, int4, report)
        taken = {f"{p}.{s}" for p in quantized for s in QUANTIZED_SUFFIXES}
        for key in tensors:
            if key not in taken:
                _set_tensor(modules, key, tensors.get(key), dtype)
        head = llm.get_output_embeddings()
        if type(head) is nn.Linear and head.weight.is_meta and getattr(config, "tie_word_embeddings", False):
            llm.tie_weights()
    empty = [name for name, t in (*llm.named_parameters(), *llm.named_buffers()) if t.is_meta]
    if empty:
        raise CheckpointError(f"{path}: the checkpoint has no tensor for {', '.join(empty[:5])}"
                              f"{' ...' if len(empty) > 5 else ''}.")
    if int4:
        report.layers = {"int4": report.from_checkpoint} if report.from_checkpoint else {}
        report.kept_float += [name for name, m in llm.named_modules() if type(m) is nn.Linear
                              and name not in report.kept_float]
    log.info("%s: %s", path, report.describe())
    return llm, report


def _place(llm: nn.Module, modules: dict[str, nn.Module], prefix: str, tensors: Safetensors, spec: QuantSpec,
           dtype: torch.dtype, int4: bool, report: QuantReport) -> None:
    linear = modules.get(prefix)
    if type(linear) is not nn.Linear:
        raise CheckpointError(f"{prefix}: quantised in the checkpoint but not a linear layer of "
                              f"{type(llm).__name__}; the checkpoint and its config.json do not match.")
    weights = read_int4(tensors, prefix, spec)
    if tuple(weights.codes.shape) != tuple(linear.weight.shape):
        raise CheckpointError(f"{prefix}: the checkpoint's codes are {tuple(weights.codes.shape)} (out, in), the "
                              f"model's layer {tuple(linear.weight.shape)}; the checkpoint and config.json differ.")
    if spec.group not in (-1, weights.group):
        log.info("%s: group of %d inputs (group_size %d in the config)", prefix, weights.group, spec.group)
    bias = tensors.get(f"{prefix}.bias") if f"{prefix}.bias" in tensors else None
    fits = weights.codes.shape[0] % INT4_N_MULTIPLE == 0
    if int4 and fits:
        try:
            module: nn.Module = Int4Linear(weights, bias)
        except ValueError as exc:
            raise CheckpointError(f"{prefix}: {exc}") from None
        report.from_checkpoint += 1
    else:
        if int4:
            log.info("%s: %d outputs is not a multiple of %d (torch's int4 packing); de-quantised to dense",
                     prefix, weights.codes.shape[0], INT4_N_MULTIPLE)
            report.kept_float.append(prefix)
        module = _dense(weights, bias, dtype)
        report.dequantized += 1
    parent_name, _, attr = prefix.rpartition(".")
    setattr(modules[parent_name], attr, module)
    modules[prefix] = module


def _dense(weights: Int4Weights, bias: torch.Tensor | None, dtype: torch.dtype) -> nn.Linear:
    out_features, in_features = weights.codes.shape
    linear = nn.Linear(in_features, out_features, bias=bias is not None, device="meta", dtype=dtype)
    linear.weight = nn.Parameter(weights.dequantize().to(dtype), requires_grad=False)
    if bias is not None:
        linear.bias = nn.Parameter(bias.to(dtype, copy=True), requires_grad=False)
    return linear


def _set_tensor(modules: dict[str, nn.Module], key: str, value: torch.Tensor, dtype: torch.dtype) -> None:
    parent_name, _, attr = key.rpartition(".")
    module = modules.get(parent_name)
    value = value.to(dtype, copy=True) if value.is_floating_point() else value.clone()
    if module is not None and attr in module._parameters:
        if tuple(module._parameters[attr].shape) != tuple(value.shape):
            raise CheckpointError(f"{key}: {tuple(value.shape)} in the checkpoint, "
                                  f"{tuple(module._parameters[attr].shape)} in the model built from config.json.")
        module._parameters[attr] = nn.Parameter(value, requires_grad=False)
    elif module is not None and attr in module._buffers:
        module._buffers[attr] = value
    else:
        log.debug("%s: not a tensor of the model; left out", key)
