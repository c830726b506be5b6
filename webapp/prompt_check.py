"""An API prompt checked before it is queued, as the worker will see it: the model's chat template must take the
messages, and the prompt must leave room in the model's context for the smallest answer.

The workers publish what this needs (messaging/prompt_form.py); it is loaded once per form. Without it (no worker
has published yet, or its tokenizer cannot be loaded here) the check is skipped and the worker's own apply."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass

import redis
from tokenizers import Tokenizer

from messaging import chat_template
from messaging.contract import MODEL_ENTRY_TTL_S, MODELS_KEY
from messaging.prompt_form import FORM_FIELD, PromptForm, form_key, tokenizer_key
from messaging.prompts import TemplateOptions, shaped, template_refusal

from .queue import UserError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Model:
    """A published form, ready to count prompts with."""

    form: PromptForm
    tokenizer: Tokenizer

    def chat_ids(self, messages: list[dict], tools: list[dict] | None = None, options: TemplateOptions | None = None,
                 add_special_tokens: bool = False) -> list[int]:
        """The prompt ids of chat messages offering `tools`, rendered with `options`, as worker/prompts.py's
        `render` makes them (`add_special_tokens`: the tokenizer's own on top of the template's, as vLLM's /tokenize
        may ask); chat_template.TemplateError when the template refuses them."""
        chat, kwargs = shaped(messages, tools, self.form.tool_format)
        options = options or TemplateOptions()
        text = chat_template.render(self.form.template, chat, self.form.special_tokens, tools=kwargs.get("tools"),
                                    add_generation_prompt=options.add_generation_prompt,
                                    continue_final_message=options.continue_final_message, extra=options.kwargs)
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def chat_tokens(self, messages: list[dict], tools: list[dict] | None = None,
                    options: TemplateOptions | None = None) -> int:
        return len(self.chat_ids(messages, tools, options))

    def text_ids(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A text's ids, with the tokenizer's special tokens (its BOS, say) by default, as the worker tokenizes a
        completion's prompt."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids

    def completion_tokens(self, prompt: str | list[int]) -> int:
        """A completion prompt's tokens: its text tokenized as the worker does by default, or its ids."""
        return len(self.text_ids(prompt)) if isinstance(prompt, str) else len(prompt)


_models: dict[str, Model | None] = {}   # form digest -> its Model; None: it cannot be loaded here (said once)
_missing: set[str] = set()              # digests whose form or tokenizer was not in Redis (said once)
_lock = threading.Lock()


def load(client: redis.Redis, digest: str) -> Model | None:
    """The Model of a published form, loaded once per digest; None when it cannot be (logged once)."""
    if digest in _models:
        return _models[digest]
    with _lock:
        if digest in _models:
            return _models[digest]
        raw = client.get(form_key(digest))
        form = PromptForm.from_json(raw) if raw is not None else None
        text = client.get(tokenizer_key(form.tokenizer)) if form is not None else None
        if text is None:   # gone from Redis; its worker publishes it again at its next heartbeat
            if digest not in _missing:
                _missing.add(digest)
                log.info("prompt form %s or its tokenizer is not in Redis; prompts are checked by the worker alone "
                         "meanwhile", digest[:12])
            return None
        try:
            model = Model(form, Tokenizer.from_str(text.decode("utf-8")))
            chat_template.compiled(form.template)
        except redis.RedisError:
            raise
        except Exception as exc:   # a form this process cannot read: the workers check these prompts themselves
            log.warning("cannot load prompt form %s (%s: %s); prompts are checked by the worker alone",
                        digest[:12], type(exc).__name__, exc)
            model = None
        _models[digest] = model
        return model


def live_models(client: redis.Redis) -> list[Model]:
    """The forms of the live workers (usually one), as far as they can be loaded."""
    now, digests = time.time(), set()
    for raw in client.hvals(MODELS_KEY):
        entry = json.loads(raw)
        if now - float(entry.get("time", 0)) < MODEL_ENTRY_TTL_S and entry.get(FORM_FIELD):
            digests.add(entry[FORM_FIELD])
    models = [load(client, digest) for digest in sorted(digests)]
    return [m for m in models if m is not None]


def too_long(limit: int, tokens: int, min_answer: int, what: str) -> UserError:
    """OpenAI's refusal of a prompt that leaves no room for an answer."""
    room = "" if tokens > limit else \
        f", which leaves no room for the {min_answer} answer tokens 'min_tokens' asks for" if min_answer > 1 else \
        ", which leaves no room for an answer"
    return UserError("context_length_exceeded",
                     f"This model's maximum context length is {limit} tokens. However, your {what} resulted in "
                     f"{tokens} tokens{room}. Please reduce the length of the {what}.",
                     param="messages" if what == "messages" else "prompt")


def check_chat(client: redis.Redis, messages: list[dict], tools: list[dict] | None, min_tokens: int,
               options: TemplateOptions | None = None) -> None:
    """UserError when a live worker's template refuses the messages or their prompt leaves no room for an answer
    of at least max(1, min_tokens) tokens."""
    for model in live_models(client):
        try:
            tokens = model.chat_tokens(messages, tools, options)
        except chat_template.TemplateError as exc:
            raise UserError("invalid_messages", template_refusal(str(exc.message or exc)),
                            param="messages") from None
        except Exception as exc:   # the worker renders with transformers, and answers for what it makes of them
            log.warning("could not render a prompt with form %s (%s: %s); left to the worker",
                        model.form.digest[:12], type(exc).__name__, exc)
            continue
        if tokens + max(1, min_tokens) > model.form.max_model_len:
            raise too_long(model.form.max_model_len, tokens, max(1, min_tokens), "messages")


def check_completion(client: redis.Redis, prompts: list[str | list[int]], min_tokens: int) -> None:
    """UserError when one of the prompts leaves no room in a live worker's context for an answer of at least
    max(1, min_tokens) tokens."""
    for model in live_models(client):
        for prompt in prompts:
            tokens = model.completion_tokens(prompt)
            if tokens + max(1, min_tokens) > model.form.max_model_len:
                raise too_long(model.form.max_model_len, tokens, max(1, min_tokens), "prompt")
