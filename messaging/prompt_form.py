"""What a worker publishes so a web process can check a prompt without the model: the chat template, its special
tokens, the context length, whether the template has a tool format, and the tokenizer; their Redis keys."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

# The form and the tokenizer are kept this long past a worker's last heartbeat (each beat renews them, and puts them
# back if Redis lost them).
FORM_TTL_S = 3600
# The field of a worker's MODELS_KEY entry that names its form (by digest).
FORM_FIELD = "prompt_form"


def form_key(digest: str) -> str:
    """A PromptForm's JSON, named by its digest."""
    return f"supportbot:prompt_form:{digest}"


def tokenizer_key(digest: str) -> str:
    """A tokenizer's `tokenizer.json` text (the `tokenizers` package's own format), named by its digest."""
    return f"supportbot:tokenizer:{digest}"


def digest(text: str) -> str:
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


@dataclass(frozen=True)
class PromptForm:
    """How a model turns messages into prompt tokens, as transformers' `apply_chat_template` does."""

    template: str                    # the chat template's Jinja source
    special_tokens: dict[str, str]   # bos_token, eos_token, ...: passed to the template as transformers passes them
    max_model_len: int               # the engine's context: prompt and answer together
    tool_format: bool                # the template renders `tools=` itself (else the fallback: messaging/prompts.py)
    tokenizer: str                   # the digest of the tokenizer's JSON (tokenizer_key)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True, ensure_ascii=False)

    @classmethod
    def from_json(cls, text: str | bytes) -> PromptForm:
        data = json.loads(text)
        return cls(template=data["template"], special_tokens=dict(data["special_tokens"]),
                   max_model_len=int(data["max_model_len"]), tool_format=bool(data["tool_format"]),
                   tokenizer=data["tokenizer"])

    @property
    def digest(self) -> str:
        return digest(self.to_json())
