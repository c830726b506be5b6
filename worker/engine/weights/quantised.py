"""Low-precision linears for the CPU (int4, int8, bfloat16 weight-only; w8a8) on torch's own kernels, for nn.Linear.

int4 is group-wise asymmetric (w = (code - 8) * scale + zero; groups of 32 when quantising here, any multiple of 32
from a checkpoint) through `_weight_int4pack_mm_for_cpu`, int8 is per-output-channel symmetric through
`_weight_int8pack_mm`, bfloat16 is a oneDNN prepacked bf16 matmul. torch's int4 and int8 weight-only CPU kernels
are vectorised for bfloat16 activations only (float32 ones take a scalar path hundreds of times slower), so these
layers round their input to bfloat16, keep bf16 scales, accumulate in float32 and hand back the caller's dtype.
w8a8 (int8 weights per output channel, int8 activations per row, quantised as they arrive) multiplies in
`torch._int_mm`, whose int32 sums are exact; layers that read one input share one quantisation and one matmul
(Int8Matmul). The rest of the model (norms, attention, residuals, the KV cache) stays as it was. Every kernel here
computes a row on its own, so a row's result does not depend on how many rows share the call (tested), nor do the
engine's greedy answers depend on the batch. They equal per-prompt `generate` run on the engine's attention
arithmetic (attention.kernel_reference); against `generate` on SDPA, the rounding of each layer's input turns the
last-bit differences between the two attentions into other tokens for some prompts (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import NamedTuple

import torch
from torch import nn

from .. import native
from .packed import PACK_ROWS_HINT

log = logging.getLogger(__name__)

WEIGHT_CHOICES = ("float32", "int4", "int8", "bfloat16", "w8a8")
# Linears of one block that read the same input: under w8a8 they share one activation quantisation and one matmul.
SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
BF16_ROWS = 32             # bfloat16 layers run in calls of at most this many rows (see BF16Linear)
GROUP = 32                 # int4 group and int8 embedding group: along the input dimension
KERNEL_GROUPS = (256, 128, 64, 32)   # the int4 group sizes torch's CPU kernel takes
INT4_N_MULTIPLE = 16       # torch's int4 packing takes output sizes that are multiples of 16
KERNEL_DTYPE = torch.bfloat16


def kernel_group(group: int) -> int:
    """The widest group torch's int4 kernel takes that divides `group`: a wider group's scale and zero are repeated
    over its parts, which computes the same weights."""
    for size in KERNEL_GROUPS:
        if group > 0 and group % size == 0:
            return size
    raise ValueError(f"int4 group size {group} is not a multiple of 32: torch's int4 kernel takes groups of "
                     f"{', '.join(map(str, sorted(KERNEL_GROUPS)))} (and multiples of them, repeated).")


@dataclass
class Int4Weights:
    """Group-wise 4-bit codes: w[n, k] = (codes[n, k] - 8) * scales[n, k // group] + zeros[n, k // group].

    `order`, when set, is a permutation of the inputs (a GPTQ checkpoint quantised in activation order): code
    column j multiplies input order[j], so the layer gathers its input in that order before the kernel."""

    codes: torch.Tensor    # int32 [N, K], 0..15
    scales: torch.Tensor   # float32 [N, K // group]
    zeros: torch.Tensor    # float32 [N, K // group]
    group: int = GROUP
    order: torch.Tensor | None = None   # int64 [K]

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] in the inputs' own order."""
        n, k = self.codes.shape
        groups = (self.codes.float() - 8).view(n, k // self.group, self.group)
        weight = (groups * self.scales.unsqueeze(-1) + self.zeros.unsqueeze(-1)).view(n, k)
        return weight if self.order is None else _unpermute(weight, self.order)

    def rounded(self) -> Int4Weights:
        """The scales and zeros the kernel holds (bfloat16), back in float32."""
        return Int4Weights(self.codes, self.scales.to(KERNEL_DTYPE).float(), self.zeros.to(KERNEL_DTYPE).float(),
                           self.group, self.order)


def _unpermute(weight: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(weight)
    out[:, order] = weight
    return out


def int4_from_float(weight: torch.Tensor) -> Int4Weights:
    """Asymmetric group-32 quantisation: each group's minimum and maximum map to codes 0 and 15."""
    n, k = weight.shape
    w = weight.detach().float().view(n, k // GROUP, GROUP)
    low, high = w.amin(-1), w.amax(-1)
    scales = ((high - low) / 15).clamp_min(torch.finfo(torch.float32).tiny)
    zeros = low + 8 * scales
    # Codes are chosen against the scale and zero the kernel will really hold.
    s, z = scales.to(KERNEL_DTYPE).float(), zeros.to(KERNEL_DTYPE).float()
    codes = torch.round((w - z.unsqueeze(-1)) / s.unsqueeze(-1) + 8).clamp_(0, 15).to(torch.int32)
    return Int4Weights(codes.view(n, k), scales, zeros)


def int4_fits(linear: nn.Linear) -> bool:
    return linear.in_features % GROUP == 0 and linear.out_features % INT4_N_MULTIPLE == 0


class Int4Linear(nn.Module):
    def __init__(self, weights: Int4Weights, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weights.codes.shape
        self.group = kernel_group(weights.group)
        repeat = weights.group // self.group
        scales, zeros = (t.repeat_interleave(repeat, dim=1) if repeat > 1 else t
                         for t in (weights.scales, weights.zeros))
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(weights.codes, 1))
        self.register_buffer("scales_and_zeros", torch.stack([scales.t(), zeros.t()], -1)
                             .to(KERNEL_DTYPE).contiguous())   # [K // group, N, 2]
        self.register_buffer("order", None if weights.order is None else weights.order.long().clone())
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        if self.order is not None:
            flat = flat.index_select(1, self.order)
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self.scales_and_zeros)
        return _finish(out, self.bias, x)

    def dequantized(self) -> torch.Tensor:
        """The float weights this layer multiplies by, unpacked through the kernel itself, in the inputs' order."""
        eye = torch.eye(self.in_features, dtype=KERNEL_DTYPE)
        weight = torch.ops.aten._weight_int4pack_mm_for_cpu(eye, self.packed, self.group,
                                                            self.scales_and_zeros).t().float()
        return weight if self.order is None else _unpermute(weight, self.order)


class Int8Linear(nn.Module):
    """Per-output-channel symmetric int8: w[n, k] = weight[n, k] * scales[n]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        codes, scales = int8_per_channel(weight, KERNEL_DTYPE)   # the kernel takes bf16 scales
        self.register_buffer("weight", codes)
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        return _finish(torch.ops.aten._weight_int8pack_mm(flat, self.weight, self.scales), self.bias, x)

    def dequantized(self) -> torch.Tensor:
        return self.weight.float() * self.scales.float()[:, None]


def bfloat16_refusal() -> str | None:
    """Why WEIGHTS=bfloat16 cannot run on this CPU, or None: oneDNN's bfloat16 matmul needs AVX-512 (BW, VL, DQ) or
    AVX-NE-CONVERT, and without them refuses at the first layer with an error that names neither the setting nor a
    way out."""
    if torch.ops.mkldnn._is_mkldnn_bf16_supported():
        return None
    return ("WEIGHTS=bfloat16 needs a CPU with AVX-512 (BW, VL and DQ) or AVX-NE-CONVERT for oneDNN's bfloat16 "
            "matmul, and this one lists neither; use WEIGHTS=auto (the measured best here), float32, int4 or w8a8.")


class BF16Linear(nn.Module):
    """bfloat16 weights prepacked for oneDNN, run in calls of 2 to `rows_per_call` rows: oneDNN gives a row the same
    result in calls of 2 to 32 rows, and not beyond (another blocking, on Xeons) nor alone (another kernel for 1536
    inputs on AMD Zen), so a request's answer would otherwise depend on what shared its steps. Calls of at most 32
    rows also bound oneDNN's per-shape state."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None,
                 rows_per_call: int = BF16_ROWS) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.rows_per_call = rows_per_call
        refusal = bfloat16_refusal()
        if refusal:
            raise ValueError(refusal)
        with torch.no_grad():
            self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(
                weight.detach().to(KERNEL_DTYPE).contiguous(), PACK_ROWS_HINT))
        self.register_buffer("bias", None if bias is None else bias.detach().float().clone())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(KERNEL_DTYPE)
        step = self.rows_per_call
        out = self._run(flat) if len(flat) <= step else torch.cat(
            [self._run(flat[i:i + step]) for i in range(0, len(flat), step)])
        return _finish(out, self.bias, x)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        if len(x) == 1:   # oneDNN takes another kernel for one row on some CPUs (AMD Zen, 1536 inputs): pad to two
            return self._run(torch.cat([x, x.new_zeros(1, x.shape[1])]))[:1]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")

    def dequantized(self) -> torch.Tensor:
        return self._run(torch.eye(self.in_features, dtype=KERNEL_DTYPE)).t().float()


def int8_per_channel(weight: torch.Tensor, scale_dtype: torch.dtype = torch.float32
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: codes [N, K] in -127..127 and scales [N] in `scale_dtype` (the codes are
    made against the scales as stored), w ~ codes * scales."""
    w = weight.detach().float()
    scales = (w.abs().amax(1) / 127).clamp_min(torch.finfo(torch.float32).tiny).to(scale_dtype)
    return torch.round(w / scales.float()[:, None]).clamp_(-127, 127).to(torch.int8), scales


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8 for activations: each row's largest magnitude maps to 127. Returns codes [M, K] and
    float32 scales [M, 1]; a row's codes depend on that row alone."""
    scales = x.abs().amax(-1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny).div_(127)
    return torch.div(x, scales).round_().to(torch.int8), scales


class Held(NamedTuple):
    """An Int8Matmul's result for one input, kept until the members in `pending` (a bit each) have taken their
    columns. A tuple: it is made for every member's call, on the decode step's path."""

    input: torch.Tensor
    version: int
    result: torch.Tensor
    pending: int


class Int8Matmul(nn.Module):
    """int8 weights times int8 activations for one or more linears that read the same input (q/k/v, gate/up):
    their weights are concatenated, so the input is quantised once and multiplied once.

    Each member (a W8A8Linear) asks for its columns of the result. The first ask for an input computes it; the
    others reuse it while the input is the same tensor, unchanged (same object, same version where it keeps one),
    and the result is let go once every member has taken its columns, so nothing outlives the block's forward pass.
    """

    def __init__(self, weights: list[torch.Tensor], biases: list[torch.Tensor | None]) -> None:
        super().__init__()
        codes, scales = int8_per_channel(torch.cat([w.detach().float() for w in weights]))
        self.in_features = codes.shape[1]
        # Where a tile kernel runs (int8_rows.c: AMX, else AVX512-VNNI for small batches, else AVX2), the codes are
        # laid out once in its tiles: torch._int_mm lays them out again on every call, which reads them at a third
        # of the memory's speed. AMX and AVX2 take every batch size; VNNI hands large ones to torch._int_mm, which
        # keeps [K, N].
        self.kernel = _tile_kernel(*codes.shape[::-1]) if codes.device.type == "cpu" else None
        tiles = _tiles(codes) if self.kernel else (None, None)
        self.register_buffer("tiles", tiles[0])
        self.register_buffer("shift", tiles[1])
        self.register_buffer("codes_t", None if self.kernel in WHOLE_TILE_KERNELS else codes.t().contiguous())
        self.register_buffer("scales", scales)
        self.register_buffer("bias", None if all(b is None for b in biases) else torch.cat(
            [b.detach().float() if b is not None else w.new_zeros(len(w), dtype=torch.float32)
             for w, b in zip(weights, biases)]))
        self.row_kernels = True   # quantise and scale in C (native) where it compiles; False: torch's ops
        edges = torch.tensor([0, *(len(w) for w in weights)]).cumsum(0).tolist()
        self.columns = list(zip(edges[:-1], edges[1:]))
        self.held: Held | None = None

    def forward(self, x: torch.Tensor, member: int) -> torch.Tensor:
        version, held, bit = _version(x), self.held, 1 << member
        if held is None or held.input is not x or held.version != version or not held.pending & bit:
            held = Held(x, version, self._run(x), (1 << len(self.columns)) - 1)
        pending = held.pending & ~bit
        # Replaced whole, never changed in place: a thread always reads an input and its own result together.
        self.held = Held(x, version, held.result, pending) if pending else None
        start, end = self.columns[member]
        return held.result if len(self.columns) == 1 else held.result[..., start:end]

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        return int8_matmul(x, self.kernel or "", self.tiles, self.shift, self.codes_t, self.scales, self.bias,
                           self.row_kernels)

    def plain_codes_t(self) -> torch.Tensor:
        """The codes as [K, N], torch._int_mm's right-hand layout (read back from the tiles where only they are
        kept)."""
        return _plain_codes_t(self.tiles, self.codes_t, self.scales.shape[0], self.in_features)

    def compiled(self, x: torch.Tensor) -> torch.Tensor:
        """The whole product through the registered operator, which a compiled forward calls without a break
        (every member asks for it; merged.StackedMatmuls keeps one call)."""
        return torch.ops.supportbot.w8a8_matmul(x, self.kernel or "", self.tiles, self.shift, self.codes_t,
                                                self.scales, self.bias, self.row_kernels)


def _plain_codes_t(tiles: torch.Tensor | None, codes_t: torch.Tensor | None, n: int, k: int) -> torch.Tensor:
    if codes_t is not None:
        return codes_t
    return tiles.view(n // 16, k // 4, 16, 4).permute(1, 3, 0, 2).reshape(k, n)


def int8_matmul(x: torch.Tensor, kernel: str, tiles: torch.Tensor | None, shift: torch.Tensor | None,
                codes_t: torch.Tensor | None, scales: torch.Tensor, bias: torch.Tensor | None,
                row_kernels: bool = True) -> torch.Tensor:
    """x [..., K] times int8 weights (laid out in tiles for `kernel` "amx", "vnni" or "avx2", else codes_t [K, N]),
    each row of x quantised to int8 on the way in; [..., N] in x's dtype."""
    n, in_features = scales.shape[0], x.shape[-1]
    flat = x.reshape(-1, in_features)
    flat = flat if flat.dtype == torch.float32 else flat.float()
    lib = native.load_int8_rows() if row_kernels else None
    if lib is None:
        codes, row_scales = quantize_rows(flat)
        # int32 sums of int8 products are exact: the only rounding is this per-element scaling.
        out = torch._int_mm(codes, _plain_codes_t(tiles, codes_t, n, in_features)) * (row_scales * scales)
    else:   # the same arithmetic in C, bit for bit (tested), at a fraction of the ops' cost
        flat = flat if flat.stride(-1) == 1 else flat.contiguous()
        rows, cols = flat.shape
        threads = torch.get_num_threads()
        out = torch.empty(rows, n)
        if kernel in WHOLE_TILE_KERNELS or (kernel == "vnni" and rows <= VNNI_ROWS):   # quantised, multiplied at once
            tile_matmul(lib, flat, kernel, tiles, shift, scales, out)
        else:
            codes = torch.empty(rows, cols, dtype=torch.int8)
            row_scales = torch.empty(rows, 1)
            lib.quantize_rows_s8(flat.data_ptr(), rows, cols, flat.stride(0), codes.data_ptr(),
                                 row_scales.data_ptr(), threads)
            acc = torch._int_mm(codes, _plain_codes_t(tiles, codes_t, n, in_features))
            lib.scale_rows_cols(acc.data_ptr(), rows, n, row_scales.data_ptr(), scales.data_ptr(),
                                out.data_ptr(), threads)
    if bias is not None:
        out += bias
    out = out if x.dtype == torch.float32 else out.to(x.dtype)
    return out.reshape(*x.shape[:-1], n)


def tile_matmul(lib, flat: torch.Tensor, kernel: str, tiles: torch.Tensor, shift: torch.Tensor,
                scales: torch.Tensor, out: torch.Tensor) -> None:
    """out [M, N] = float32 rows `flat` [M, K] (unit column stride) quantised and multiplied by tiled int8 weights
    in one C call, by `kernel` ("amx", "vnni" or "avx2") at any row count: int8_matmul's path up to VNNI_ROWS for
    VNNI."""
    rows, cols = flat.shape
    if lib.quantize_matmul_s8(flat.data_ptr(), rows, cols, flat.stride(0), scales.shape[0], tiles.data_ptr(),
                              shift.data_ptr(), scales.data_ptr(), out.data_ptr(), native.INT8_KERNEL_CODES[kernel],
                              torch.get_num_threads()) < 0:
        raise MemoryError(f"w8a8: no memory for the scratch of {rows} rows of {cols}")


@torch.library.custom_op("supportbot::w8a8_matmul", mutates_args=())
def _w8a8_op(x: torch.Tensor, kernel: str, tiles: torch.Tensor | None, shift: torch.Tensor | None,
             codes_t: torch.Tensor | None, scales: torch.Tensor, bias: torch.Tensor | None,
             row_kernels: bool) -> torch.Tensor:
    return int8_matmul(x, kernel, tiles, shift, codes_t, scales, bias, row_kernels)


@_w8a8_op.register_fake
def _(x, kernel, tiles, shift, codes_t, scales, bias, row_kernels):
    return x.new_empty(*x.shape[:-1], scales.shape[0])


UNTILED = "torch._int_mm"   # w8a8 matmuls that no tile kernel takes
VNNI_ROWS = 64   # beyond this many rows torch._int_mm (oneDNN) outruns the VNNI tiles (docs/BENCHMARKS.md)
# Tile kernels that take every row count: AMX, and AVX2, which runs where oneDNN's int8 matmul has no VNNI and takes
# several times float32's time (docs/BENCHMARKS.md, "w8a8 without VNNI").
WHOLE_TILE_KERNELS = ("amx", "avx2")


def _tile_kernel(k: int, n: int) -> str | None:
    """The tile kernel for [N, K] codes here: "amx", "vnni", "avx2" or None (shapes outside their tiles, or none)."""
    kernels = native.int8_tile_kernels()
    if "amx" in kernels and k % 64 == 0 and n % 16 == 0:
        return "amx"
    if k % 4 or n % 16:
        return None
    return next((kernel for kernel in ("vnni", "avx2") if kernel in kernels), None)


def _tiles(codes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] codes in int8_rows.c's tiles, [N / 16][K / 4][16][4], and each channel's shift (128 x its code
    sum)."""
    n, k = codes.shape
    tiles = codes.view(n // 16, 16, k // 4, 4).permute(0, 2, 1, 3).contiguous().view(-1)
    shift = codes.sum(1, dtype=torch.int32) * 128
    return tiles, shift


def _version(x: torch.Tensor) -> int:
    """The tensor's in-place write count; inference-mode tensors keep none (and the model writes none in place)."""
    return -1 if x.is_inference() else x._version


class W8A8Linear(nn.Module):
    """One linear's columns of an Int8Matmul, which it shares with its siblings (the first of them holds it)."""

    def __init__(self, matmul: Int8Matmul, member: int = 0) -> None:
        super().__init__()
        if member == 0:
            self.matmul = matmul
        else:
            self.__dict__["matmul"] = matmul   # registered once, in member 0: its buffers are not counted again
        self.member = member
        start, end = matmul.columns[member]
        self.in_features, self.out_features = matmul.in_features, end - start

    @classmethod
    def group(cls, linears: list[nn.Linear]) -> list[W8A8Linear]:
        matmul = Int8Matmul([m.weight for m in linears], [m.bias for m in linears])
        return [cls(matmul, i) for i in range(len(linears))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():
            start, end = self.matmul.columns[self.member]
            return self.matmul.compiled(x)[..., start:end]
        return self.matmul.forward(x, self.member)   # not through Module.__call__: nothing hooks the shared matmul

    def dequantized(self) -> torch.Tensor:
        start, end = self.matmul.columns[self.member]
        return self.matmul.plain_codes_t()[:, start:end].t().float() * self.matmul.scales[start:end, None]


class Int8Embedding(nn.Module):
    """Embedding rows as group-32 symmetric int8 codes with float32 scales, de-quantised as they are looked up.

    A GGUF Q8_0 table (block 32, one scale per block, the block's largest code +-127) comes out exactly as the
    float32 table transformers de-quantised from it."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        rows, dim = weight.shape
        w = weight.detach().float().view(rows, dim // GROUP, GROUP)
        scales = w.abs().amax(-1) / 127
        codes = torch.where(scales.unsqueeze(-1) > 0, w / scales.clamp_min(torch.finfo(torch.float32).tiny)
                            .unsqueeze(-1), torch.zeros(()))
        self.register_buffer("codes", torch.round(codes).clamp_(-127, 127).to(torch.int8).view(rows, dim))
        self.register_buffer("scales", scales)
        self.num_embeddings, self.embedding_dim = rows, dim

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        codes = self.codes[ids].float().view(*ids.shape, self.embedding_dim // GROUP, GROUP)
        return (codes * self.scales[ids].unsqueeze(-1)).view(*ids.shape, self.embedding_dim)

    def dequantized(self) -> torch.Tensor:
        return self.forward(torch.arange(self.num_embeddings))


def _finish(out: torch.Tensor, bias: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    out = out.to(x.dtype)
    if bias is not None:
        out = out + bias.to(x.dtype)
    return out.reshape(*x.shape[:-1], out.shape[-1])


@dataclass
class QuantReport:
    """What a swap did: the precision, layers per kind, and the tensors taken as they were stored (GGUF blocks,
    a GPTQ or AWQ checkpoint's codes)."""

    weights: str
    layers: dict[str, int] = field(default_factory=dict)
    from_gguf: int = 0           # int4 layers built from the GGUF's own 4-bit blocks
    requantized: int = 0         # layers quantised from float weights
    kept_float: list[str] = field(default_factory=list)   # linears the kernel's shape rules left dense
    head: str = ""               # the lm_head's precision where it differs from `weights`
    embedding: str = "float32"
    checkpoint: str = ""         # a quantised checkpoint's format ("GPTQ", "AWQ"), when the model came from one
    from_checkpoint: int = 0     # int4 layers built from that checkpoint's own 4-bit codes
    dequantized: int = 0         # its 4-bit layers de-quantised to dense weights instead
    int8_kernels: dict[str, int] = field(default_factory=dict)   # w8a8 matmuls per kernel (amx, vnni, torch._int_mm)

    def describe(self) -> str:
        stored = f" ({self.dequantized} de-quantised from the {self.checkpoint} checkpoint)" if self.dequantized else ""
        if self.weights == "float32":
            return "weights float32" + stored
        kinds = ", ".join(f"{n} {k}" for k, n in sorted(self.layers.items()))
        line = f"weights {self.weights}: {kinds or 'no layers swapped'}"
        if self.weights == "int4" and self.checkpoint:
            line += (f" ({self.from_checkpoint} from the {self.checkpoint} checkpoint's 4-bit codes, "
                     f"{self.requantized} quantised from float)")
        elif self.weights == "int4":
            line += f" ({self.from_gguf} from the GGUF's 4-bit blocks, {self.requantized} quantised from float)"
        line += stored
        if self.head:
            line += f"; lm_head {self.head}"
        if self.kept_float:
            line += f"; {len(self.kept_float)} kept dense"
        if self.int8_kernels:
            line += "; int8 matmuls: " + ", ".join(f"{n} {k}" for k, n in sorted(self.int8_kernels.items()))
            if self.int8_kernels.get(UNTILED) and len(self.int8_kernels) > 1:
                line += (f" (the {UNTILED} ones have shapes outside the tiles: inputs a multiple of 64 for AMX or 4"
                         " for VNNI, outputs of 16)")
        return line + f"; embedding {self.embedding}"


def check_choice(weights: str) -> str:
    if weights not in WEIGHT_CHOICES:
        raise ValueError(f"WEIGHTS={weights!r} is not a weight precision; choose one of "
                         f"{', '.join(WEIGHT_CHOICES)}, or auto for the device's measured best.")
    return weights


def quantize_model(model: nn.Module, weights: str, int4_source: Mapping[str, Int4Weights] | None = None,
                   head: str | None = None) -> QuantReport:
    """Swap the model's nn.Linear layers (lm_head included) for `weights`-precision ones, and a tied or large
    input embedding for an int8 one (int4, int8) or leave it (bfloat16). `int4_source`: qualified weight name ->
    codes to use as they are (a GGUF's blocks) instead of quantising the float weight. `head`: the lm_head's
    precision where it differs from the rest (bfloat16: better logits for 56 MB more than int4 on a 49152 x 576 head).
    """
    check_choice(weights)
    head = check_choice(head) if head else weights
    report = QuantReport(weights)
    if weights == "float32":
        return report
    param = next(model.parameters())
    if param.device.type != "cpu":
        raise ValueError(f"WEIGHTS={weights} runs on the CPU only (torch's int4/int8 weight kernels are CPU "
                         f"kernels here); the model is on {param.device.type}. Use WEIGHTS=float32 and DTYPE there.")
    if "bfloat16" in (weights, head) and bfloat16_refusal():
        raise ValueError(bfloat16_refusal())
    if "w8a8" in (weights, head) and not native.has_vnni() and "avx2" not in native.int8_tile_kernels():
        log.warning("WEIGHTS=w8a8 on a CPU that lists no VNNI instructions, without the AVX2 tile kernel (no C "
                    "compiler, or no AVX2): oneDNN's int8 matmul is slower there, and may saturate its 16-bit "
                    "partial sums; WEIGHTS=int4 or float32 avoid it.")
    int4_source = int4_source or {}
    head_module = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    targets = [(parent, name, child, f"{prefix}.{name}".lstrip(".")) for prefix, parent in model.named_modules()
               for name, child in parent.named_children() if type(child) is nn.Linear]
    with torch.no_grad():
        if weights in ("int4", "int8", "w8a8"):
            embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
            if type(embed) is nn.Embedding and embed.embedding_dim % GROUP == 0:
                _replace(model, embed, Int8Embedding(embed.weight))
                report.embedding = "int8 (group 32)"
        grouped = _w8a8_groups(targets, head_module) if weights == "w8a8" else {}
        for parent, name, child, qualified in targets:
            if child in grouped:
                setattr(parent, name, grouped[child])
                report.requantized += 1
                report.layers[weights] = report.layers.get(weights, 0) + 1
                continue
            is_head = child is head_module
            kind = head if is_head else weights
            if is_head and kind != weights:
                report.head = kind
            module = _quantized(child, kind, int4_source.get(qualified + ".weight"), report)
            if module is None:
                report.kept_float.append(qualified)
                continue
            setattr(parent, name, module)
            report.layers[kind] = report.layers.get(kind, 0) + 1
    for matmul in (m for m in model.modules() if isinstance(m, Int8Matmul)):
        kind = matmul.kernel or UNTILED
        report.int8_kernels[kind] = report.int8_kernels.get(kind, 0) + 1
    log.info("%s", report.describe())
    return report


def _quantized(linear: nn.Linear, kind: str, stored: Int4Weights | None, report: QuantReport) -> nn.Module | None:
    if kind == "float32":
        return linear
    if kind == "int4":
        if not int4_fits(linear):
            return None
        if stored is not None and torch.equal(stored.dequantize(), linear.weight.float()):
            report.from_gguf += 1
            return Int4Linear(stored, linear.bias)
        if stored is not None:
            log.warning("GGUF blocks do not reproduce a %s weight; quantising it from float",
                        tuple(linear.weight.shape))
        report.requantized += 1
        return Int4Linear(int4_from_float(linear.weight), linear.bias)
    if kind == report.weights:
        report.requantized += 1
    if kind == "int8":
        return Int8Linear(linear.weight, linear.bias)
    if kind == "w8a8":
        return W8A8Linear.group([linear])[0]
    return BF16Linear(linear.weight, linear.bias)


def _w8a8_groups(targets: list[tuple[nn.Module, str, nn.Linear, str]], head: nn.Module | None
                 ) -> dict[nn.Linear, W8A8Linear]:
    """Each SIBLINGS set found whole under one parent, with one input width: linear -> its member of a shared
    Int8Matmul. (A wrong guess would only cost speed: a member called with another input recomputes.)"""
    children: dict[nn.Module, dict[str, nn.Linear]] = {}
    for parent, name, child, _ in targets:
        if child is not head:
            children.setdefault(parent, {})[name] = child
    grouped: dict[nn.Linear, W8A8Linear] = {}
    for named in children.values():
        for names in SIBLINGS:
            linears = [named.get(n) for n in names]
            if all(linears) and len({m.in_features for m in linears}) == 1:
                grouped.update(zip(linears, W8A8Linear.group(linears)))
    return grouped


def _replace(model: nn.Module, old: nn.Module, new: nn.Module) -> None:
    for parent in model.modules():
        for name, child in parent.named_children():
            if child is old:
                setattr(parent, name, new)
