"""A job's prompt as token ids: chat messages through the template (tools in its own format, or the fallback), or a
completion's text or ids as they are."""

from __future__ import annotations

import json
from typing import Any

from structured import Tool
from structured.tools import call_text, instructions, response_text
from worker.engine import InvalidRequestError


_PROBE = {"type": "function", "function": {"name": "probe_tool_format_x9", "description": "",
                                           "parameters": {"type": "object", "properties": {}}}}
_formats: dict[tuple[int, str | None], bool] = {}


def has_tool_format(tokenizer) -> bool:
    """Whether the chat template renders `tools=` (Qwen2.5, Qwen3, Llama 3.1 and Hermes-style templates do;
    SmolLM2's ignores them): a probe tool is rendered once per template and looked for."""
    template = getattr(tokenizer, "chat_template", None)
    key = (id(tokenizer), template if isinstance(template, str) else repr(template))
    if key not in _formats:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[_PROBE], tokenize=False,
                                                 add_generation_prompt=True)
            _formats[key] = _PROBE["function"]["name"] in text
        except Exception:   # a template that refuses tools has no tool format
            _formats[key] = False
    return _formats[key]


def _arguments(text: Any) -> Any:
    """A call's arguments as templates expect them: an object, not its JSON text."""
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def native(messages: list[dict]) -> list[dict]:
    """Messages for a template with a tool format: calls' arguments parsed, no content left null."""
    out = []
    for m in messages:
        m = {**m, "content": m.get("content") or ""}
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": _arguments(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
        out.append(m)
    return out


def fallback(messages: list[dict], tools: list[dict] | None) -> list[dict]:
    """Messages for a template without a tool format: the tools described in the system prompt, calls written as
    the model would write them, tool results as user messages in <tool_response> blocks."""
    out = []
    for m in messages:
        role, content = m["role"], m.get("content") or ""
        if role == "tool":
            out.append({"role": "user", "content": response_text(content)})
        elif role == "assistant" and m.get("tool_calls"):
            calls = "\n".join(call_text(c["function"]["name"], _arguments(c["function"]["arguments"]))
                              for c in m["tool_calls"])
            out.append({"role": "assistant", "content": (content + "\n" if content else "") + calls})
        else:
            out.append({"role": role, "content": content})
    if tools:
        described = instructions([Tool.from_openai(spec) for spec in tools])
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + described}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out


def plain(messages: list[dict]) -> bool:
    return all(set(m) <= {"role", "content"} and m["role"] in ("system", "user", "assistant") for m in messages)


def render(tokenizer, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Prompt ids of chat messages in OpenAI's shape (assistant `tool_calls`, `tool` results) offering `tools`."""
    if has_tool_format(tokenizer):
        chat, kwargs = native(messages), ({"tools": tools} if tools else {})
    else:
        chat, kwargs = fallback(messages, tools), {}
    return list(tokenizer.apply_chat_template(chat, add_generation_prompt=True, return_dict=False, **kwargs))


def render_chat(engine, messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """Prompt ids of chat messages; plain messages without tools go through the engine's own rendering unchanged."""
    if not tools and plain(messages):
        return engine.render_chat(messages)
    return render(engine.tokenizer, messages, tools)


def completion_ids(engine, prompt: str | list[int]) -> list[int]:
    """A completion's prompt as ids: text tokenized as the model's tokenizer does by default, ids checked."""
    if isinstance(prompt, str):
        return list(engine.tokenizer(prompt)["input_ids"])
    outside = sorted({t for t in prompt if t >= engine.vocab})
    if outside:
        raise InvalidRequestError(f"The prompt has token ids the model does not have: {outside[:5]}; its ids run "
                                  f"from 0 to {engine.vocab - 1}.")
    return list(prompt)


def fit_to_context(engine, messages: list[dict], reserve: int,
                   tools: list[dict] | None = None) -> tuple[list[dict], list[int]]:
    """Drop the oldest turns (never the system prompt or the newest message) until the prompt fits.

    Returns the kept messages and their rendered prompt ids (with `tools`, if any), so the template is rendered once.
    """
    messages = list(messages)
    budget = engine.max_model_len - reserve
    first = 1 if messages and messages[0].get("role") == "system" else 0
    while len(ids := render_chat(engine, messages, tools)) > budget:
        if len(messages) - first <= 1:
            raise InvalidRequestError("This message is too long for the assistant to answer; "
                                      "shorten it or split it into several messages.")
        del messages[first]
    return messages, ids
