"""POST /tokenize and /detokenize, as vLLM's and llama.cpp's servers take them, and Anthropic's
/v1/messages/count_tokens: a text, chat messages or token ids through the served model's tokenizer, answered by the
web process from what the workers publish (no queue)."""

from __future__ import annotations

import redis
from flask import Blueprint, current_app, request

from messaging import chat_template
from messaging.prompts import TemplateOptions, template_refusal

from . import api, api_messages, api_params, prompt_check
from .prompt_check import Model
from .queue import UserError

bp = Blueprint("tokens", __name__)


def served() -> Model:
    """The first live worker's published tokenizer and template; a 503 to retry while none has published one."""
    try:
        models = prompt_check.live_models(current_app.extensions["redis"])
    except redis.RedisError:
        models = []
    if not models:
        raise UserError("model_unavailable", "No worker has published its tokenizer yet; retry in a few seconds.",
                        retryable=True, status=503, retry_after=5)
    return models[0]


def body() -> dict:
    data = request.get_json(silent=True)
    if not isinstance(data, dict):
        raise UserError("invalid_json", "Send a JSON object body with Content-Type: application/json.")
    return data


def flag(data: dict, name: str, default: bool) -> bool:
    value = data.get(name, default)
    if not isinstance(value, bool):
        raise api_params.invalid(name, f"'{name}' must be true or false.")
    return value


def chat_ids(model: Model, messages: list[dict], tools: list[dict] | None,
             options: TemplateOptions | None = None, add_special_tokens: bool = False) -> list[int]:
    """A chat's prompt ids as the worker renders them; a template's refusal is the client's 400."""
    try:
        return model.chat_ids(messages, tools, options, add_special_tokens)
    except chat_template.TemplateError as exc:
        raise UserError("invalid_messages", template_refusal(str(exc.message or exc)), param="messages") from None


def tokenized(data: dict) -> tuple[list[int], Model]:
    """The ids of vLLM's `prompt` or `messages`, or llama.cpp's `content`."""
    model = served()
    if data.get("messages") is not None:
        messages = api.parse_messages(data)
        options = api_params.template_options(data, messages)
        tools = data.get("tools")
        if tools is not None:
            tools = [tool.to_openai() for tool in api_params.tool_use({"tools": tools}).tools]
        return chat_ids(model, messages, tools, options, flag(data, "add_special_tokens", False)), model
    name = "prompt" if "prompt" in data else "content"
    text = data.get(name)
    if not isinstance(text, str):
        raise api_params.invalid(name, "Send the text to tokenize as 'prompt' (or llama.cpp's 'content'), or chat "
                                       "'messages'.")
    if len(text) > 16 * current_app.config["MAX_MESSAGE_CHARS"]:
        raise UserError("context_length_exceeded", f"'{name}' is too long; send a shorter one.", param=name)
    # vLLM adds the special tokens by default, llama.cpp (add_special) does not.
    add = flag(data, "add_special_tokens", True) if name == "prompt" else flag(data, "add_special", False)
    return model.text_ids(text, add), model


@bp.post("/tokenize")
def tokenize():
    try:
        data = body()
        ids, model = tokenized(data)
        out: dict = {"count": len(ids), "max_model_len": model.form.max_model_len, "tokens": ids, "token_strs": None}
        if flag(data, "return_token_strs", False):
            out["token_strs"] = [model.tokenizer.id_to_token(i) for i in ids]
        if flag(data, "with_pieces", False):   # llama.cpp's: each id with its text
            out["tokens"] = [{"id": i, "piece": model.tokenizer.decode([i], skip_special_tokens=False)} for i in ids]
        return out
    except UserError as exc:
        return api.error_response(exc)


@bp.post("/detokenize")
def detokenize():
    try:
        data = body()
        ids = data.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise api_params.invalid("tokens", "'tokens' must be a list of token ids.")
        if len(ids) > api.MAX_PROMPT_TOKENS:
            raise UserError("context_length_exceeded", f"At most {api.MAX_PROMPT_TOKENS} tokens; send fewer.",
                            param="tokens")
        model = served()
        vocab = model.tokenizer.get_vocab_size(with_added_tokens=True)
        outside = sorted({t for t in ids if not 0 <= t < vocab})
        if outside:
            raise api_params.invalid("tokens", f"The model has no token ids {outside[:5]}; its ids run from 0 to "
                                               f"{vocab - 1}.")
        text = model.tokenizer.decode(ids, skip_special_tokens=False)
        return {"prompt": text, "content": text}   # vLLM's name, llama.cpp's
    except UserError as exc:
        return api.error_response(exc)


@bp.post(api_messages.COUNT_PATH)
def count_tokens():
    """Anthropic's count of a Messages request's input tokens: the prompt its answer would be charged for (system,
    messages and the tools it offers, through the chat template)."""
    try:
        chat = api_messages.chat_body(body(), 1)   # the answer's length plays no part in the count
        messages = api.parse_messages(chat)
        use = api_params.tool_use(chat)
        tools = [tool.to_openai() for tool in use.tools] if use.offered else None
        return {"input_tokens": len(chat_ids(served(), messages, tools))}
    except UserError as exc:
        return api.error_response(api_params.renamed(exc, api_messages.RENAMED))
