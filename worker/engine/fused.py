"""Decoder layers of CPU steps with their elementwise work in C (layer_ops.c) between the model's own linears.

A Llama-style layer runs about 40 torch ops besides its matmuls and attention: RMSNorm alone is six, rotary ten,
each a dispatch of a few microseconds on a tensor of a few kilobytes. Here each layer of a step through the C
attention kernel runs its linears as the model holds them (packed, w8a8, int4...; w8a8 siblings in one call), and
between them four C calls: RMSNorm, rotary (after Qwen3's per-head norms), the residual add with the second RMSNorm,
and SiLU-and-multiply. Where every linear of a layer is w8a8 in a tile kernel (the CPU default), the whole layer is
one C call (layer_step.c) making the same calls in the same order. Called outside such a step (`generate`, other
backends) a layer runs the model's own code. The answers are the model's own up to float32 rounding (the order of
RMSNorm's sum, SiLU's exponential), which tests/test_fused.py bounds.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable
from dataclasses import dataclass

import torch

from . import attention, native
from .attention import current_context, ops
from .compiled import decoder_layers
from .weights.quantised import VNNI_ROWS, WHOLE_TILE_KERNELS, Int8Matmul, W8A8Linear

# Decoder layers whose forward is Llama's: pre-norm RMSNorm, rotary on every head dimension, SiLU-gated MLP (Qwen3's
# also normalises each query and key head before rotary).
LAYER_KINDS = frozenset(("LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"))
MAX_HEAD_DIM = 512   # layer_ops.c's


def unfit_reason(model) -> str | None:
    """Why this model's layers cannot run fused here, or None when they can."""
    layers = decoder_layers(model)
    if layers is None:
        return f"{type(model).__name__} has no list of decoder layers (model.model.layers)"
    kinds = {type(layer).__name__ for layer in layers}
    if not kinds <= LAYER_KINDS:
        return (f"decoder layers of kind {', '.join(sorted(kinds - LAYER_KINDS))} are not fused (only "
                f"{', '.join(sorted(LAYER_KINDS))})")
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    if getattr(config, "hidden_act", None) != "silu":
        return f"the MLP's activation is {getattr(config, 'hidden_act', None)!r}, not SiLU"
    layer = layers[0]
    norms = [layer.input_layernorm, layer.post_attention_layernorm,
             *(getattr(layer.self_attn, name) for name in ("q_norm", "k_norm") if hasattr(layer.self_attn, name))]
    if any(n.weight.dtype != torch.float32 or n.weight.device.type != "cpu" for n in norms):
        return "the layers' norms are not float32 on the CPU"
    if layer.self_attn.head_dim > MAX_HEAD_DIM:
        return f"heads of {layer.self_attn.head_dim} dimensions are past the kernels' {MAX_HEAD_DIM}"
    if native.load_layer_ops() is None:
        return "the layer kernels did not build (no C compiler)"
    return None


class FusedLayers:
    """Swaps each decoder layer's forward for the fused one while held; `release` puts the model back.

    reference: also fuse the layers of `generate` on a model set to attention.KERNEL_REFERENCE (or _F16), so that it
    computes exactly what the engine's fused steps compute (tests compare the two token for token). one_call: False
    calls the kernels one by one from Python even where a whole layer can be one call (the same result; tests and
    benchmarks compare the two)."""

    def __init__(self, model, reference: bool = False, one_call: bool = True) -> None:
        reason = unfit_reason(model)
        if reason is not None:
            raise ValueError(reason)
        self.lib = native.load_layer_ops()
        self.layers = decoder_layers(model)
        self.reference = reference
        # whole layers in one call: the library, each layer's weights (None: not all w8a8 in tile kernels), the
        # most rows they take, and the step's shared arguments, kept while its layers run
        self.step_lib = native.load_layer_step() if one_call else None
        self.whole: list[WholeLayer | None] = [
            whole_layer(layer) if self.step_lib is not None else None for layer in self.layers]
        self.scratch_per_token = max((w.scratch_per_token for w in self.whole if w is not None), default=0)
        self._step: tuple | None = None
        for layer, whole in zip(self.layers, self.whole):
            layer.forward = self._forward_of(layer, whole)

    def _forward_of(self, layer, whole: WholeLayer | None):
        eager = layer.forward
        lib = self.lib
        attn, mlp = layer.self_attn, layer.mlp
        proj = Projections(together(attn.q_proj, attn.k_proj, attn.v_proj), together(attn.o_proj),
                           together(mlp.gate_proj, mlp.up_proj), together(mlp.down_proj))

        def forward(hidden_states, *args, position_embeddings=None, **kwargs):
            if (position_embeddings is None or hidden_states.dtype != torch.float32 or hidden_states.shape[0] != 1
                    or position_embeddings[0].shape[-1] != attn.head_dim):   # partial rotary: not fused
                return eager(hidden_states, *args, position_embeddings=position_embeddings, **kwargs)
            ctx = current_context()
            if ctx is not None and ctx.backend == "kernel":
                if whole is not None and hidden_states.shape[1] <= whole.max_rows:
                    return self._one_call(whole, hidden_states, position_embeddings, ctx)
                return fused_layer(lib, layer, proj, hidden_states, position_embeddings, in_pool(ctx, attn))
            cache = kwargs.get("past_key_values")
            if (self.reference and ctx is None and cache is not None
                    and attn.config._attn_implementation in (attention.KERNEL_REFERENCE,
                                                             attention.KERNEL_REFERENCE_F16)):
                return fused_layer(lib, layer, proj, hidden_states, position_embeddings,
                                   through_cache(cache, attn, kwargs.get("attention_mask")))
            return eager(hidden_states, *args, position_embeddings=position_embeddings, **kwargs)

        return forward

    def _one_call(self, whole: WholeLayer, hidden_states: torch.Tensor,
                  position_embeddings: tuple[torch.Tensor, torch.Tensor], ctx) -> torch.Tensor:
        x = _rows(hidden_states[0])
        tokens, hidden = x.shape
        held = self._step
        if held is None or held[0] is not ctx or held[1] is not position_embeddings[0]:
            held = self._step = (ctx, position_embeddings[0], *self._step_args(ctx, position_embeddings, tokens))
        out = _new(tokens, hidden)
        rc = self.step_lib.layer_step(whole.address, held[2], x.data_ptr(), x.stride(0), out.data_ptr())
        if rc != 0:
            raise RuntimeError(LAYER_STEP_ERRORS.get(rc, f"the whole-layer kernel failed ({rc})"))
        return out.unsqueeze(0)

    def _step_args(self, ctx, position_embeddings: tuple[torch.Tensor, torch.Tensor], tokens: int) -> tuple:
        """The step's shared arguments (an address) and the tensors they point into, which must outlive them."""
        cos, sin = (t[0].contiguous() for t in position_embeddings)
        row_seq, row_pos, tables = ctx.kernel_tensors
        kv = ctx.kv   # [2, layers, kv_heads, blocks, block_size, head_dim]
        scratch = _new(tokens * self.scratch_per_token)
        args = StepArgs(tokens, cos.data_ptr(), sin.data_ptr(), ctx.slots.data_ptr(), row_seq.data_ptr(),
                        row_pos.data_ptr(), tables.data_ptr(), tables.shape[1], ctx.kernel_max_context,
                        kv[0, 0].data_ptr(), kv[1, 0].data_ptr(), kv.stride(1), kv.shape[3], kv.shape[4],
                        scratch.data_ptr(), torch.get_num_threads(), kv.dtype == torch.float16)
        return ctypes.addressof(args), args, scratch, cos, sin

    def release(self) -> None:
        self._step = None
        for layer in self.layers:
            layer.__dict__.pop("forward", None)


Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Project = Callable[[torch.Tensor], tuple[torch.Tensor, ...]]


@dataclass
class Projections:
    """A layer's linears, each group reading one input: q/k/v, o, gate/up, down."""

    qkv: Project
    o: Project
    gate_up: Project
    down: Project


def shared_matmul(linears: tuple[torch.nn.Module, ...]) -> Int8Matmul | None:
    """The Int8Matmul the linears share when they are all of its members, in order (w8a8 siblings); else None."""
    matmul = getattr(linears[0], "matmul", None)
    if (isinstance(matmul, Int8Matmul) and len(matmul.columns) == len(linears)
            and all(isinstance(m, W8A8Linear) and m.matmul is matmul and m.member == i for i, m in enumerate(linears))):
        return matmul
    return None


def together(*linears: torch.nn.Module) -> Project:
    """The linears' results for one input. w8a8 siblings that share one Int8Matmul (all of its members, in order)
    run it once, directly, and take their columns: the same product as through each module, without a module call
    and the shared result's bookkeeping for each."""
    matmul = shared_matmul(linears)
    if matmul is not None:
        if len(linears) == 1:
            return lambda x: (matmul._run(x),)
        columns = matmul.columns
        return lambda x: tuple(out[:, start:end] for out in (matmul._run(x),) for start, end in columns)
    return lambda x: tuple(m(x) for m in linears)


class Product(ctypes.Structure):
    """layer_step.c's `product`: one w8a8 matmul's tiles, shifts, scales and bias (or NULL)."""

    _fields_ = [("tiles", ctypes.c_void_p), ("shift", ctypes.c_void_p), ("scales", ctypes.c_void_p),
                ("bias", ctypes.c_void_p), ("k", ctypes.c_int64), ("n", ctypes.c_int64), ("kernel", ctypes.c_int32)]


class LayerWeights(ctypes.Structure):
    """layer_step.c's `layer_weights`."""

    _fields_ = [("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("q_norm", ctypes.c_void_p),
                ("k_norm", ctypes.c_void_p), ("eps1", ctypes.c_float), ("eps2", ctypes.c_float),
                ("qk_eps", ctypes.c_float), ("scale", ctypes.c_float), ("qkv", Product), ("o", Product),
                ("gate_up", Product), ("down", Product), ("layer", ctypes.c_int64), ("heads", ctypes.c_int64),
                ("kv_heads", ctypes.c_int64), ("head_dim", ctypes.c_int64), ("hidden", ctypes.c_int64),
                ("inner", ctypes.c_int64)]


class StepArgs(ctypes.Structure):
    """layer_step.c's `step_args`."""

    _fields_ = [("tokens", ctypes.c_int64), ("cos", ctypes.c_void_p), ("sin", ctypes.c_void_p),
                ("slots", ctypes.c_void_p), ("row_seq", ctypes.c_void_p), ("row_pos", ctypes.c_void_p),
                ("tables", ctypes.c_void_p), ("table_width", ctypes.c_int64), ("max_context", ctypes.c_int64),
                ("k_pool", ctypes.c_void_p), ("v_pool", ctypes.c_void_p), ("layer_stride", ctypes.c_int64),
                ("num_blocks", ctypes.c_int64), ("block_size", ctypes.c_int64), ("scratch", ctypes.c_void_p),
                ("threads", ctypes.c_int32), ("half_kv", ctypes.c_int32)]


LAYER_STEP_ERRORS = {1: "the w8a8 tile kernel is not in this build", 2: "no memory for a w8a8 product's scratch",
                     3: f"heads past the layer kernels' {MAX_HEAD_DIM} dimensions",
                     4: "the paged-attention kernel refused the layer's query and KV heads"}


@dataclass
class WholeLayer:
    """A layer's weights for layer_step.c (the structure, its address) and the most rows its products take."""

    weights: LayerWeights
    address: int
    max_rows: float
    scratch_per_token: int


def _product(linears: tuple[torch.nn.Module, ...]) -> tuple[Product, float] | None:
    """The w8a8 product the linears share (all of its members, in order) in a tile kernel, and the most rows it
    takes there; None for anything else."""
    matmul = shared_matmul(linears)
    if matmul is None or matmul.kernel not in native.INT8_KERNEL_CODES or not matmul.row_kernels:
        return None
    bias = matmul.bias
    if bias is not None and (bias.dtype != torch.float32 or not bias.is_contiguous()):
        return None
    product = Product(matmul.tiles.data_ptr(), matmul.shift.data_ptr(), matmul.scales.data_ptr(),
                      bias.data_ptr() if bias is not None else None, matmul.in_features, matmul.scales.shape[0],
                      native.INT8_KERNEL_CODES[matmul.kernel])
    return product, (float("inf") if matmul.kernel in WHOLE_TILE_KERNELS else VNNI_ROWS)


def whole_layer(layer) -> WholeLayer | None:
    """The layer's weights for one call of layer_step.c, or None when a linear is not w8a8 in a tile kernel or the
    shapes are not the ones it lays out (q/k/v and gate/up each one product, in that order)."""
    attn, mlp = layer.self_attn, layer.mlp
    groups = ((attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,), (mlp.gate_proj, mlp.up_proj),
              (mlp.down_proj,))
    found = [_product(group) for group in groups]
    if any(f is None for f in found):
        return None
    (qkv, r1), (o, r2), (gate_up, r3), (down, r4) = found
    d = attn.head_dim
    q_cols, k_cols, v_cols = attn.q_proj.matmul.columns
    nq, nkv = q_cols[1] - q_cols[0], k_cols[1] - k_cols[0]
    hidden, inner = qkv.k, gate_up.n // 2
    if (nq % d or nkv % d or v_cols[1] - v_cols[0] != nkv or o.k != nq or o.n != hidden or gate_up.k != hidden
            or mlp.gate_proj.matmul.columns[0] != (0, inner) or down.k != inner or down.n != hidden):
        return None
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    weights = LayerWeights(norm1.weight.data_ptr(), norm2.weight.data_ptr(),
                           q_norm.weight.data_ptr() if q_norm is not None else None,
                           k_norm.weight.data_ptr() if k_norm is not None else None,
                           norm1.variance_epsilon, norm2.variance_epsilon,
                           q_norm.variance_epsilon if q_norm is not None else 0.0, attn.scaling,
                           qkv, o, gate_up, down, attn.layer_idx, nq // d, nkv // d, d, hidden, inner)
    per_token = native.load_layer_step().layer_step_scratch(1, hidden, nq // d, nkv // d, d, inner)
    return WholeLayer(weights, ctypes.addressof(weights), min(r1, r2, r3, r4), per_token)


def in_pool(ctx, attn) -> Attend:
    """A step's attention through the C kernel: writes the rows' K/V into the pool and reads each row's context
    there. q [tokens, heads, d], k and v [tokens, kv_heads, d] -> [tokens, heads, d]."""
    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        row_seq, row_pos, tables = ctx.kernel_tensors
        i = attn.layer_idx
        return ops.kernel_step(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), ctx.kv[0, i], ctx.kv[1, i],
                               ctx.slots, row_seq, row_pos, tables, ctx.kernel_max_context, attn.scaling)

    return attend


def through_cache(cache, attn, mask: torch.Tensor | None) -> Attend:
    """`generate`'s attention with the C kernel's arithmetic (attention.kernel_reference) over transformers' own
    cache, which the rows' K/V join first; rounded to float16 first on a model set to KERNEL_REFERENCE_F16."""
    half_pool = attn.config._attn_implementation == attention.KERNEL_REFERENCE_F16

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        k_all, v_all = cache.update(k.transpose(0, 1)[None], v.transpose(0, 1)[None], attn.layer_idx)
        return attention.kernel_reference(attn, q.transpose(0, 1)[None], k_all, v_all, mask, attn.scaling,
                                          half_pool=half_pool)[0][0]

    return attend


def _new(*shape: int) -> torch.Tensor:
    return torch.empty(shape, dtype=torch.float32)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """x as rows with contiguous columns (a column slice of a wider result is taken as it is)."""
    return x if x.stride(-1) == 1 else x.contiguous()


def fused_layer(lib, layer, proj: Projections, hidden_states: torch.Tensor,
                position_embeddings: tuple[torch.Tensor, torch.Tensor], attend: Attend) -> torch.Tensor:
    """One layer over a step's packed tokens, hidden_states [1, tokens, hidden] -> the same shape."""
    threads = torch.get_num_threads()
    x = _rows(hidden_states[0])
    tokens, hidden = x.shape
    attn = layer.self_attn
    norm1, norm2 = layer.input_layernorm, layer.post_attention_layernorm
    h = _new(tokens, hidden)
    lib.rms_norm_f32(x.data_ptr(), tokens, hidden, x.stride(0), norm1.weight.data_ptr(), norm1.variance_epsilon,
                     h.data_ptr(), threads)

    q, k, v = (_rows(t) for t in proj.qkv(h))
    d = attn.head_dim
    heads, kv_heads = q.shape[1] // d, k.shape[1] // d
    cos, sin = (t[0].contiguous() for t in position_embeddings)
    q_rot, k_rot = _new(tokens, heads, d), _new(tokens, kv_heads, d)
    q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)   # Qwen3's, per head
    lib.rotary_f32(q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), tokens, heads, kv_heads, d,
                   cos.data_ptr(), sin.data_ptr(), q_norm.weight.data_ptr() if q_norm is not None else None,
                   k_norm.weight.data_ptr() if k_norm is not None else None,
                   q_norm.variance_epsilon if q_norm is not None else 0.0, q_rot.data_ptr(), k_rot.data_ptr(),
                   threads)
    out = attend(q_rot, k_rot, v.view(tokens, kv_heads, d))
    a = _rows(proj.o(out.view(tokens, heads * d))[0])

    residual, h2 = _new(tokens, hidden), _new(tokens, hidden)
    lib.add_rms_norm_f32(x.data_ptr(), x.stride(0), a.data_ptr(), a.stride(0), tokens, hidden,
                         norm2.weight.data_ptr(), norm2.variance_epsilon, residual.data_ptr(), h2.data_ptr(),
                         threads)
    gate, up = (_rows(t) for t in proj.gate_up(h2))
    inner = gate.shape[1]
    act = _new(tokens, inner)
    lib.silu_mul_f32(gate.data_ptr(), gate.stride(0), up.data_ptr(), up.stride(0), tokens, inner, act.data_ptr(),
                     threads)
    return residual.add_(proj.down(act)[0]).unsqueeze(0)
