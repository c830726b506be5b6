"""Chat messages in OpenAI's shape as a chat template is given them: in its own tool format, or the fallback (tools
described in the system prompt) for a template without one. The worker and the web app shape them alike, so both
count the same prompt."""

from __future__ import annotations

import json
from typing import Any

from structured import Tool
from structured.tools import call_text, instructions, response_text


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
    """Only system, user and assistant messages of text: every template renders them as they are."""
    return all(set(m) <= {"role", "content"} and m["role"] in ("system", "user", "assistant") for m in messages)


def template_refusal(complaint: str) -> str:
    """What a client is told when the model's chat template raises on its messages (`raise_exception`)."""
    complaint = complaint.strip()
    end = "" if complaint.endswith((".", "!", "?")) else "."
    return (f"The model's chat template refused these messages: {complaint}{end} Change the messages as it says "
            "(the order of their roles, their content) and send them again.")


def template_failure(exc: Exception) -> str:
    """What a client is told when the model's chat template fails on its messages with an error of its own (a
    TypeError from adding text to a list, say) rather than refusing them."""
    detail = " ".join(str(exc).split())[:200]
    return (f"The model's chat template failed on these messages ({type(exc).__name__}: {detail}). Check that each "
            "message has the shape this model takes (a role, and text content) and send them again; if they do, tell "
            "the server's operator that its chat template fails on them.")


def shaped(messages: list[dict], tools: list[dict] | None, tool_format: bool) -> tuple[list[dict], dict[str, Any]]:
    """The chat and the template's extra arguments (`tools`, when its format has them) for `messages` offering
    `tools`."""
    if tool_format:
        return native(messages), ({"tools": tools} if tools else {})
    return fallback(messages, tools), {}
