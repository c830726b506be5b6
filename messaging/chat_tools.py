"""The chat assistant's server-side tools: their definitions (OpenAI's shape, carried by each chat job), the
settings that turn them on, and how a conversation's stored tool calls and results become chat messages again."""

from __future__ import annotations

import json
from typing import Any

LOOKUP_ORDER = "lookup_order"
ORDER_TOOL: dict[str, Any] = {"type": "function", "function": {
    "name": LOOKUP_ORDER,
    "description": "An order's status, items, carrier and tracking number.",
    "parameters": {"type": "object", "properties": {"order_number": {
        "type": "string", "description": "as the customer gave it, like NW-10042", "pattern": "^[A-Za-z0-9-]{1,24}$"}},
        "required": ["order_number"], "additionalProperties": False}}}
# CHAT_TOOLS names sets of tools, comma-separated.
TOOL_SETS: dict[str, list[dict[str, Any]]] = {"orders": [ORDER_TOOL]}
# How a stored conversation holds the exchange behind an answer: a call the model made, and the result it got.
CALL_ROLE, RESULT_ROLE = "tool_call", "tool"


def tools_setting(value: str | None) -> list[dict[str, Any]]:
    """CHAT_TOOLS ("orders"; empty or "off": none) -> the tools' definitions."""
    names = [n.strip().lower() for n in (value or "").split(",") if n.strip()]
    if names in ([], ["off"], ["none"], ["0"]):
        return []
    unknown = [n for n in names if n not in TOOL_SETS]
    if unknown:
        raise ValueError(f"CHAT_TOOLS names {', '.join(map(repr, unknown))}; the tools there are "
                         f"{', '.join(TOOL_SETS)} (comma-separated), or leave it empty for none.")
    return [tool for name in dict.fromkeys(names) for tool in TOOL_SETS[name]]


def choice_setting(value: str | None, tools: list[dict[str, Any]]) -> str:
    """CHAT_TOOL_CHOICE: "auto" (the model decides; needs a model trained for tools), "required" (always calls
    one first) or a tool's name (always calls that one first)."""
    choice = (value or "auto").strip()
    names = [t["function"]["name"] for t in tools]
    if choice in ("auto", "required") or choice in names:
        return choice
    raise ValueError(f"CHAT_TOOL_CHOICE must be auto, required or the name of a tool CHAT_TOOLS turns on "
                     f"({', '.join(names) or 'none is on'}); got {choice!r}.")


def stored_call(call_id: str, name: str, arguments: str) -> str:
    """A tool call as a conversation stores it (role CALL_ROLE); `arguments` is the JSON text the model wrote."""
    return json.dumps({"id": call_id, "name": name, "arguments": arguments}, ensure_ascii=False)


def history(stored: list[tuple[str, str]], with_tools: bool) -> list[dict[str, Any]]:
    """A conversation's stored (role, content) turns as chat messages: consecutive calls become one assistant
    message with `tool_calls`, each result a `tool` message answering its call. Without tools the exchange is
    left out (the answers built on it stay)."""
    messages: list[dict[str, Any]] = []
    waiting: list[str] = []   # ids of calls whose results come next
    for role, content in stored:
        if role not in (CALL_ROLE, RESULT_ROLE):
            messages.append({"role": role, "content": content})
            continue
        if not with_tools:
            continue
        if role == CALL_ROLE:
            call = json.loads(content)
            entry = {"id": call["id"], "type": "function",
                     "function": {"name": call["name"], "arguments": call["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls"):
                last["tool_calls"].append(entry)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [entry]})
            waiting.append(call["id"])
        else:
            messages.append({"role": "tool", "tool_call_id": waiting.pop(0) if waiting else "", "content": content})
    return messages
