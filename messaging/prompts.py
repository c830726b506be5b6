"""Chat messages in OpenAI's shape as a chat template is given them: in its own tool format, or the fallback (tools
described in the system prompt) for a template without one. The worker and the web app shape them alike, so both
count the same prompt."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from structured import Tool
from structured.tools import call_text, instructions, response_text


# Names a client's chat_template_kwargs may not take: the template's own inputs, and transformers'
# apply_chat_template's parameters (which would be read as those, not passed to the template).
RESERVED_TEMPLATE_NAMES = frozenset({
    "messages", "tools", "documents", "add_generation_prompt", "continue_final_message", "conversation",
    "chat_template", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "kwargs"})


@dataclass(frozen=True)
class TemplateOptions:
    """How a chat is rendered beyond its messages (vLLM's chat fields): extra template variables (Qwen3's
    `enable_thinking`, say), whether the assistant's turn is opened, and whether the final message is left open for
    the model to continue (a prefilled answer)."""

    kwargs: dict[str, Any] = field(default_factory=dict)
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    def to_json(self) -> dict[str, Any] | None:
        """The job's form; None for the defaults (a job without it renders as before)."""
        if self == TemplateOptions():
            return None
        return {"kwargs": self.kwargs, "add_generation_prompt": self.add_generation_prompt,
                "continue_final_message": self.continue_final_message}

    @classmethod
    def from_json(cls, data: dict[str, Any] | None) -> TemplateOptions | None:
        if not data:
            return None
        return cls(dict(data.get("kwargs") or {}), bool(data.get("add_generation_prompt", True)),
                   bool(data.get("continue_final_message", False)))


# transformers marks the end of a message to continue with this text, renders, and cuts the chat there.
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def tag_final(chat: list[dict]) -> list[dict]:
    """The chat with its final message's (text) content marked where the prompt is to be cut."""
    return [*chat[:-1], {**chat[-1], "content": (chat[-1].get("content") or "") + CONTINUE_TAG}]


def cut_at_tag(rendered: str) -> str:
    """The rendered chat up to the final message's mark, as transformers' continue_final_message cuts it (with
    trailing blanks the template trimmed trimmed too); ValueError when the template dropped the mark."""
    at = rendered.rfind(CONTINUE_TAG.strip())
    if at < 0:
        raise ValueError("the chat template drops part of the final message, so it cannot be continued")
    return rendered[:at] if rendered[at:at + len(CONTINUE_TAG)] == CONTINUE_TAG else rendered[:at].rstrip()


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
