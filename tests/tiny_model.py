"""Build tiny randomly initialised causal LMs (with the real SmolLM2 tokenizer) for fast tests."""

from __future__ import annotations

from pathlib import Path

import torch

TINY_CONFIGS = {
    "llama": dict(model_type="llama", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  rope_theta=10000.0, tie_word_embeddings=True),
    "qwen2": dict(model_type="qwen2", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=True),
    "mistral": dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                    tie_word_embeddings=True),
    # Qwen3 normalises q and k per head before RoPE and sets head_dim apart from hidden_size / heads.
    "qwen3": dict(model_type="qwen3", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=512,
                  tie_word_embeddings=True),
    "gpt2": dict(model_type="gpt2", n_embd=64, n_layer=2, n_head=4, n_positions=512),
}


def make_tiny_model_dir(path: str | Path, tokenizer, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """Save a tiny random model plus the given tokenizer as a loadable model directory; `overrides` change
    its config (a longer context, say)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(path)
    settings = {**TINY_CONFIGS[arch], **overrides}
    model_type = settings.pop("model_type")
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        # A wider init spreads the logits: greedy comparisons then do not hinge on float-rounding ties.
        initializer_range=0.2, **settings)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path
