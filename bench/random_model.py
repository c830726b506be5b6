"""Build a model of a given shape with random weights, for benchmarks of models whose weights are not here."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from worker.model_loader import ModelLoadError, load_tokenizer, pick_device, pick_dtype

CONFIG_DIR = Path(__file__).resolve().parent / "data" / "configs"


def builtin_configs() -> list[str]:
    return sorted(p.stem for p in CONFIG_DIR.glob("*.json"))


def resolve_config(ref: str) -> Path:
    """A config.json path, a directory holding one, or a built-in name such as `qwen3-0.6b`."""
    path = Path(ref).expanduser()
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return path
    builtin = CONFIG_DIR / f"{ref}.json"
    if builtin.is_file():
        return builtin
    raise ModelLoadError(f"--random-weights {ref!r}: no such config.json, directory or built-in shape; "
                         f"built-in: {', '.join(builtin_configs())}")


def read_config(ref: str, **overrides):
    """The transformers config of `ref` (see resolve_config), its model type's defaults filling what it leaves out."""
    from transformers import AutoConfig

    path = resolve_config(ref)
    settings = json.loads(path.read_text())
    model_type = settings.pop("model_type", None)
    if not model_type:
        raise ModelLoadError(f"{path} names no model_type")
    return AutoConfig.for_model(model_type, **{**settings, **overrides})


def load_random_model(ref: str, device: str | None = None, dtype: str | torch.dtype | None = None,
                      tokenizer_model: str | None = None, seed: int = 0):
    """(model, tokenizer): the config's shape with seeded random weights, and the default model's tokenizer.

    The tokenizer's special tokens replace the config's own, so EOS and padding mean the same to every method.
    """
    from transformers import AutoModelForCausalLM

    path = resolve_config(ref)
    tokenizer = load_tokenizer(tokenizer_model)
    settings = {name: getattr(tokenizer, name) for name in ("bos_token_id", "eos_token_id", "pad_token_id")}
    config = read_config(ref, **settings)
    config.vocab_size = max(config.vocab_size, len(tokenizer))
    dev = pick_device(device)
    dt = pick_dtype(dev, dtype)
    torch.manual_seed(seed)
    with dev:   # initialise in place: a 0.6B model is built on the GPU, not copied there
        model = AutoModelForCausalLM.from_config(config, dtype=dt, attn_implementation="sdpa")
    model.eval()
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.name_or_source = f"random:{path.stem if path.parent == CONFIG_DIR else path}"
    return model, tokenizer
