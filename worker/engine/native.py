"""Builds the C kernels (attention, w8a8 rows, layer ops, whole layers, top-k) with the system compiler on first use;
loads them (ctypes)."""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path

import torch  # noqa: F401  (loaded first, so the kernel shares torch's OpenMP runtime, libgomp.so.1)

log = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "attention" / "paged_attention.c"
INT8_SOURCE = Path(__file__).parent / "weights" / "int8_rows.c"
LAYER_SOURCE = Path(__file__).parent / "layer_ops.c"
LAYER_STEP_SOURCE = Path(__file__).parent / "layer_step.c"   # built with the three above
TOP_K_SOURCE = Path(__file__).parent / "top_k.c"
FLAGS = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC"]
_P, _I64, _I32, _F32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
INT8_ARGTYPES = {"quantize_rows_s8": [_P, _I64, _I64, _I64, _P, _P, _I32],   # x, rows, cols, row stride, codes, scales
                 "scale_rows_cols": [_P, _I64, _I64, _P, _P, _P, _I32],      # acc, rows, cols, row/col scales, out
                 # codes, rows, K, N, tiles, shifts, row/col scales, out, scratch, threads
                 "matmul_vnni_s8": [_P, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _I32],
                 "matmul_amx_s8": [_P, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _I32],
                 "matmul_avx2_s8": [_P, _I64, _I64, _I64, _P, _P, _P, _P, _P, _P, _I32],
                 # x, rows, K, x's row stride, N, tiles, shifts, col scales, out, kernel (INT8_KERNEL_CODES), threads
                 "quantize_matmul_s8": [_P, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _I32, _I32],
                 "amx_ready": []}
# 0: built without the instructions (or, for AMX, refused its tile state); the caller then takes another path
INT8_KERNEL_CODES = {"vnni": 0, "amx": 1, "avx2": 2}   # quantize_matmul_s8's and layer_step.c's `kernel`
INT8_RESTYPES = {"matmul_vnni_s8": ctypes.c_int, "matmul_amx_s8": ctypes.c_int, "matmul_avx2_s8": ctypes.c_int,
                 "amx_ready": ctypes.c_int,
                 "quantize_matmul_s8": ctypes.c_int}
LAYER_ARGTYPES = {"rms_norm_f32": [_P, _I64, _I64, _I64, _P, _F32, _P, _I32],   # x, rows, cols, stride, w, eps, out
                  # x, its stride, y, its stride, rows, cols, weight, eps, sum, out, threads
                  "add_rms_norm_f32": [_P, _I64, _P, _I64, _I64, _I64, _P, _F32, _P, _P, _I32],
                  # q, its stride, k, its stride, tokens, heads, kv heads, dim, cos, sin, q and k norm weights
                  # (or NULL), their eps, q out, k out, threads
                  "rotary_f32": [_P, _I64, _P, _I64, _I64, _I64, _I64, _I64, _P, _P, _P, _P, _F32, _P, _P, _I32],
                  "silu_mul_f32": [_P, _I64, _P, _I64, _I64, _I64, _P, _I32]}   # gate, up (and strides), rows...
ARGTYPES = [_P, _I64, _I64,  _P, _I64, _I64,  _P, _I64, _I64,      # q, k, v and their token/head strides
            _P, _P, _I64, _I32,  _I32, _I32, _I32,                  # pool, num_blocks, block_size, heads
            _P, _I32,  _P, _P,  _P, _I32, _I32,                     # slots, rows, tables, max context
            _F32, _P, _I32]                                         # scale, out, threads


def cache_dir() -> Path:
    root = Path(os.environ.get("MODEL_CACHE_DIR", Path.home() / ".cache" / "supportbot")).expanduser()
    return root / "kernels"


def _cpu_identity() -> str:
    """-march=native code is only valid on the CPU it was built for: key the cache by its features."""
    try:
        flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")),
                     "")
    except OSError:
        flags = ""
    return platform.machine() + flags


def has_vnni() -> bool:
    """The CPU lists x86's int8 dot-product instructions (AVX512-VNNI or AVX-VNNI)."""
    flags = set(_cpu_identity().split())
    return bool(flags & {"avx512_vnni", "avx_vnni"})


def _compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


ATTENTION_PATHS = {0: "portable", 1: "avx2", 2: "avx512"}   # paged_attention_path()'s codes


@cache
def load(flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """The compiled paged-attention kernel, or None (logged) when there is no compiler or the build fails."""
    return _declared(_build(SOURCE, "paged-attention kernel", "falling back to gathering the context", flags),
                     {"paged_attention_f32": ARGTYPES, "paged_attention_f16kv": ARGTYPES,   # a float32, float16 pool
                      "paged_attention_path": []},
                     {"paged_attention_f32": ctypes.c_int, "paged_attention_f16kv": ctypes.c_int,
                      "paged_attention_path": ctypes.c_int})


def attention_path(flags: tuple[str, ...] = ()) -> str | None:
    """The vector path the attention kernel was built with on this CPU ("avx512", "avx2" or "portable"), or None
    without the kernel. Head sizes a path cannot take run the portable loops."""
    lib = load(flags)
    return None if lib is None else ATTENTION_PATHS[lib.paged_attention_path()]


@cache
def load_int8_rows() -> ctypes.CDLL | None:
    """The compiled w8a8 row kernels, or None (logged): w8a8 then quantises and scales with torch's ops."""
    return _declared(_build(INT8_SOURCE, "w8a8 row kernels", "w8a8 uses torch's ops for them"), INT8_ARGTYPES,
                     INT8_RESTYPES)


@cache
def load_layer_ops() -> ctypes.CDLL | None:
    """The compiled layer kernels (RMSNorm, rotary, SiLU-and-multiply), or None (logged): layers then run the
    model's own code."""
    return _declared(_build(LAYER_SOURCE, "layer kernels", "decoder layers run the model's own code"),
                     LAYER_ARGTYPES, {"rotary_f32": ctypes.c_int})


@cache
def load_layer_step() -> ctypes.CDLL | None:
    """A whole decoder layer of a CPU step in one call (layer_step.c, linked with the kernels it calls), or None
    (logged): fused layers then call the kernels one by one."""
    lib = _build(LAYER_STEP_SOURCE, "whole-layer kernel", "fused layers call the kernels one by one",
                 also=(LAYER_SOURCE, INT8_SOURCE, SOURCE))
    return _declared(lib, {"layer_step": [_P, _P, _P, _I64, _P],   # weights, step, x, x's row stride, out
                           "layer_step_scratch": [_I64] * 6},      # tokens, hidden, heads, kv heads, head dim, inner
                     {"layer_step": ctypes.c_int, "layer_step_scratch": ctypes.c_int64})


@cache
def load_top_k() -> ctypes.CDLL | None:
    """The sampler's top-k selection, row sums (of exponentials too) and argmax in C (top_k.c), or None (logged): the
    sampler then takes torch's."""
    return _declared(_build(TOP_K_SOURCE, "top-k kernel", "the sampler uses torch.topk"),
                     {"top_k_f32": [_P, _I64, _I64, _I64, _I64, _P, _P, _I32],   # x, rows, cols, stride, k, out...
                      "row_sums_f32": [_P, _I64, _I64, _I64, _P, _I32],          # x, rows, cols, stride, out, threads
                      "exp_sums_f32": [_P, _I64, _I64, _I64, _P, _P, _I32],      # ..., stride, row_max, out, threads
                      "first_largest_f32": [_P, _I64, _I64, _I64, _P, _I32]},    # as row_sums, out int64
                     {"top_k_f32": ctypes.c_int})


def _declared(lib: ctypes.CDLL | None, argtypes: dict[str, list], restypes: dict[str, type]) -> ctypes.CDLL | None:
    """lib with each named function's argument types set, and its result type (None where not named: void)."""
    if lib is not None:
        for name, types in argtypes.items():
            function = getattr(lib, name)
            function.argtypes = types
            function.restype = restypes.get(name)
    return lib


def _build(path: Path, what: str, fallback: str, flags: tuple[str, ...] = (),
           also: tuple[Path, ...] = ()) -> ctypes.CDLL | None:
    """flags: more compiler flags (benchmarks build variants with them, e.g. -DPAGED_PORTABLE); also: more sources
    linked into the same library."""
    cc = _compiler()
    if cc is None:
        log.warning("no C compiler (cc/gcc) found for the %s: %s", what, fallback)
        return None
    source = b"".join(p.read_bytes() for p in (path, *also))
    key = hashlib.sha256(source + " ".join([cc, *FLAGS, *flags, _cpu_identity()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{path.stem}-{key}.so"
    try:
        if not target.exists():
            target.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
                built = Path(tmp) / target.name
                subprocess.run([cc, *FLAGS, *flags, str(path), *map(str, also), "-o", str(built), "-lm"],
                               check=True, capture_output=True, text=True, timeout=120)
                built.rename(target)   # atomic: a half-written library is never loaded
            log.info("compiled the %s: %s", what, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        log.warning("%s unavailable (%s): %s", what, detail, fallback)
        return None


@cache
def int8_tile_kernels() -> frozenset[str]:
    """The w8a8 tile kernels that run here: "amx" (AMX int8, with Linux's leave for its tile state), "vnni"
    (AVX512-VNNI) and "avx2", probed with an empty call; none without a compiler or those instructions."""
    lib = load_int8_rows()
    if lib is None:
        return frozenset()
    empty = ctypes.c_void_p(0)
    probe = [empty, 0, 64, 0, empty, empty, empty, empty, empty, empty, 1]   # no rows, no channels
    kernels = (("amx", lib.matmul_amx_s8), ("vnni", lib.matmul_vnni_s8), ("avx2", lib.matmul_avx2_s8))
    return frozenset(name for name, kernel in kernels if kernel(*probe))
