"""Chat messages (tool calls and results included) and tools -> prompt ids, through the model's chat template when
it has a tool format, else with the tools described in the system prompt and results as user messages."""

from __future__ import annotations

import json
from typing import Any

from structured.tools import Tool, call_text, instructions, response_text

_PROBE = {"type": "function", "function": {"name": "probe_tool_format_x9", "description": "",
                                           "parameters": {"type": "object", "properties": {}}}}
_formats: dict[tuple[int, str | None], bool] = {}


def has_tool_format(tokenizer) -> bool:
    """Whether the chat template renders `tools=` (Qwen2.5, Qwen3, Llama 3.1 do; SmolLM2's ignores them)."""
    key = (id(tokenizer), tokenizer.chat_template)
    if key not in _formats:
        try:
            text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[_PROBE], tokenize=False,
                                                 add_generation_prompt=True)
            _formats[key] = _PROBE["function"]["name"] in text
        except Exception:   # a template that refuses tools has no tool format
            _formats[key] = False
    return _formats[key]


def render(tokenizer, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """Prompt ids for `messages` (OpenAI's shape: assistant `tool_calls`, `tool` results) offering `tools`."""
    if has_tool_format(tokenizer):
        chat, offered = [_templated(m) for m in messages], tools or None
    else:
        chat, offered = _described(messages, tools or []), None
    ids = tokenizer.apply_chat_template(chat, tools=offered, add_generation_prompt=True, return_dict=False)
    return list(ids)


def _arguments(text: Any) -> Any:
    try:
        return json.loads(text) if isinstance(text, str) else text
    except json.JSONDecodeError:
        return text


def _templated(message: dict[str, Any]) -> dict[str, Any]:
    """Templates read a call's arguments as an object, not its JSON text."""
    if not message.get("tool_calls"):
        return message
    calls = [{"type": "function", "function": {"name": c["function"]["name"],
                                               "arguments": _arguments(c["function"]["arguments"])}}
             for c in message["tool_calls"]]
    return {"role": "assistant", "content": message.get("content") or "", "tool_calls": calls}


def _described(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The fallback: the tools described in the system prompt, calls written as the model would write them, and
    results as user messages between <tool_response> tags."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if message.get("tool_calls"):
            calls = "".join(call_text(c["function"]["name"], _arguments(c["function"]["arguments"]))
                            for c in message["tool_calls"])
            out.append({"role": "assistant", "content": (message.get("content") or "") + calls})
        elif message.get("role") == "tool":
            out.append({"role": "user", "content": response_text(str(message.get("content") or ""))})
        else:
            out.append({"role": message["role"], "content": message.get("content") or ""})
    if tools:
        described = instructions([Tool.from_openai(t) for t in tools])
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + described}
        else:
            out.insert(0, {"role": "system", "content": described})
    return out
