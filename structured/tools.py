"""Tool calls: the text a model writes them in, the grammar that forces one, and reading them back, whole or streamed."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from .grammar import Structure

# Qwen2.5/Qwen3 and Hermes-style templates: each call is a JSON object between these lines.
OPEN = "<tool_call>"
CLOSE = "</tool_call>"
BEGIN, END = OPEN + "\n", "\n" + CLOSE
NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
# How a call's JSON starts when its name comes first (always so when a grammar wrote it): the arguments then stream.
HEAD = re.compile(r'^\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


class ToolError(ValueError):
    """A tool definition or choice that cannot be used; the message says what to change."""


@dataclass(frozen=True)
class Tool:
    """A function the model may call: its name, what it does, and a JSON schema of its arguments."""

    name: str
    description: str = ""
    parameters: dict[str, Any] = field(default_factory=lambda: {"type": "object", "properties": {}})

    @classmethod
    def from_openai(cls, spec: Any, where: str = "tools[0]") -> Tool:
        """One entry of OpenAI's `tools`: {"type": "function", "function": {"name", "description", "parameters"}}."""
        if not isinstance(spec, dict) or spec.get("type") != "function" or not isinstance(spec.get("function"), dict):
            raise ToolError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\": ..., "
                            "\"parameters\": {...}}}}.")
        function = spec["function"]
        name, description = function.get("name"), function.get("description") or ""
        parameters = function.get("parameters")
        parameters = {"type": "object", "properties": {}} if parameters is None else parameters
        if not isinstance(name, str) or not NAME.match(name):
            raise ToolError(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-'.")
        if not isinstance(description, str):
            raise ToolError(f"{where}.function.description must be a string.")
        if not isinstance(parameters, dict):
            raise ToolError(f"{where}.function.parameters must be a JSON schema object.")
        return cls(name, description, parameters)

    def to_openai(self) -> dict[str, Any]:
        return {"type": "function", "function": {"name": self.name, "description": self.description,
                                                 "parameters": self.parameters}}

    def call_schema(self) -> dict[str, Any]:
        """A call of this tool as the model writes it: the name first, so it can be streamed before the arguments."""
        return {"type": "object", "properties": {"name": {"const": self.name}, "arguments": self.parameters},
                "required": ["name", "arguments"], "additionalProperties": False}


def forced(tools: list[Tool], name: str | None = None, parallel: bool = True) -> Structure:
    """The grammar of an answer that is only tool calls: of the tool named, or (None) of any, one or (parallel)
    several."""
    if name is not None:
        chosen = [t for t in tools if t.name == name]
        if not chosen:
            raise ToolError(f"tool_choice names {name!r}, which is not among the tools; name one of "
                            f"{', '.join(repr(t.name) for t in tools) or 'the tools you send'}.")
        return Structure(chosen[0].call_schema(), begin=BEGIN, end=END, repeat=False)
    if not tools:
        raise ToolError("tool_choice 'required' needs at least one tool in 'tools'.")
    schema = tools[0].call_schema() if len(tools) == 1 else {"anyOf": [t.call_schema() for t in tools]}
    return Structure(schema, begin=BEGIN, end=END, repeat=parallel)


def offered(tools: list[Tool], parallel: bool = True) -> Structure:
    """The grammar of an answer under tool_choice "auto": free text, but once the model opens a call it can only
    be a valid call of an offered tool; without `parallel`, at most one call."""
    if not tools:
        raise ToolError("tool_choice 'auto' with a grammar needs at least one tool in 'tools'.")
    schema = tools[0].call_schema() if len(tools) == 1 else {"anyOf": [t.call_schema() for t in tools]}
    return Structure(schema, begin=BEGIN, end=END, repeat=parallel, lazy=True)


def call_text(name: str, arguments: Any) -> str:
    """A call as the model writes it, for a conversation's history."""
    return BEGIN + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + END


def instructions(tools: list[Tool]) -> str:
    """What a system prompt says about the tools for a chat template that has no tool format of its own."""
    listed = "\n".join(json.dumps(t.to_openai(), ensure_ascii=False) for t in tools)
    return ("You can call these tools; each is described by a JSON schema of its arguments:\n<tools>\n" + listed
            + "\n</tools>\nTo call a tool, answer with only this, once per call:\n" + BEGIN
            + '{"name": "<tool name>", "arguments": <the arguments as a JSON object>}' + END
            + "\nThe results come back in <tool_response> blocks.")


def response_text(content: str) -> str:
    """A tool's result as a message for templates without a tool role."""
    return f"<tool_response>\n{content}\n</tool_response>"


def call_id(request_id: str, index: int) -> str:
    """A call's id, the same wherever the answer is read (a stream, the whole answer, a redelivery)."""
    return "call_" + hashlib.sha256(f"{request_id}:{index}".encode()).hexdigest()[:24]


@dataclass
class ToolCall:
    """A call read from an answer; `arguments` is its JSON text, as the model wrote it."""

    index: int
    id: str
    name: str
    arguments: str = ""

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class Delta:
    """A piece of a streamed answer: text, or part of a call (its id and name come once, in its first piece)."""

    content: str | None = None
    index: int | None = None
    id: str | None = None
    name: str | None = None
    arguments: str | None = None

    def to_openai(self) -> dict[str, Any]:
        """OpenAI's chat.completion.chunk delta."""
        if self.index is None:
            return {"content": self.content}
        call: dict[str, Any] = {"index": self.index}
        if self.id is not None:
            call.update(id=self.id, type="function")
        function = {k: v for k, v in (("name", self.name), ("arguments", self.arguments)) if v is not None}
        return {"tool_calls": [{**call, "function": function}]}


class StreamParser:
    """Reads an answer as it streams: text passes through, each call between <tool_call> and </tool_call> comes
    out as OpenAI tool-call pieces, its arguments streamed as they arrive. Text that may be the start of a call is
    held back until it is known; a "call" that turns out not to be one comes out as text.

    `forced`: a grammar made the answer calls only (tool_choice "required" or a named function), so none of it is
    text: an answer cut short (max_tokens) before a call's name was written gives no call and no content, rather
    than the markup written so far."""

    def __init__(self, request_id: str, forced: bool = False) -> None:
        self.request_id = request_id
        self.forced = forced
        self.calls: list[ToolCall] = []
        self.buffer = ""
        self.in_call = False
        self.head_end: int | None = None   # where the arguments begin in the buffer, once the head is read
        self.sent = 0                      # argument characters of the current call already sent
        self.blanks = ""                   # blanks held back before the current call
        self.after_call = False            # no text since the last call yet

    def feed(self, text: str) -> list[Delta]:
        self.buffer += text
        out: list[Delta] = []
        while True:
            if not self.in_call:
                start = self.buffer.find(OPEN)
                if start < 0:
                    keep = _partial(self.buffer, OPEN, blanks=True)
                    self._content(out, self.buffer[:len(self.buffer) - keep])
                    self.buffer = self.buffer[len(self.buffer) - keep:]
                    return out
                before = self.buffer[:start]
                self._content(out, before.rstrip())
                self.blanks = before[len(before.rstrip()):]   # given back if this is not a call after all
                self.buffer, self.in_call, self.head_end, self.sent = self.buffer[start + len(OPEN):], True, None, 0
                continue
            end = self.buffer.find(CLOSE)
            if end < 0:
                self._stream_arguments(out, "open")
                return out
            body, rest = self.buffer[:end], self.buffer[end + len(CLOSE):]
            self.after_call = self._complete(out, body) or self.after_call
            self.buffer, self.in_call = rest, False

    def finish(self) -> list[Delta]:
        """The answer ended: a call cut short keeps what was read of it; held-back text comes out."""
        out: list[Delta] = []
        if self.in_call:
            # Cut inside its closing tag, the call itself is whole: the partial tag is not part of it.
            tail = _partial(self.buffer, CLOSE)
            if tail and _is_json(self.buffer[:len(self.buffer) - tail]):
                self.buffer = self.buffer[:len(self.buffer) - tail]
            self._complete(out, self.buffer, cut=True)
        elif not self.forced:
            self._content(out, self.buffer)
        self.buffer, self.in_call = "", False
        return out

    def _content(self, out: list[Delta], text: str) -> None:
        if self.after_call:   # the blanks that separate calls, or a call from later text, are not content
            text = text.lstrip()
            self.after_call = not text
        if text:
            out.append(Delta(content=text))

    def _stream_arguments(self, out: list[Delta], end: str) -> None:
        """Send the arguments read so far; `end`: "open" holds back what may be the call's end, "closed" drops the
        call's own closing brace, "raw" sends everything (a call cut short never got its brace)."""
        if self.head_end is None:
            match = HEAD.match(self.buffer)
            if match is None or match.end() == len(self.buffer):   # blanks before the arguments may yet come
                return
            try:
                name = json.loads(f'"{match.group(1)}"')
            except json.JSONDecodeError:
                return
            self.head_end = match.end()
            index = len(self.calls)
            self.calls.append(ToolCall(index, call_id(self.request_id, index), name))
            out.append(Delta(index=index, id=self.calls[-1].id, name=name, arguments=""))
        arguments = self.buffer[self.head_end:]
        if arguments.startswith('"'):   # the arguments' JSON written as a string: sent decoded, once it is whole
            if end != "closed" or self.sent or not _is_json(self.buffer):
                return
            value = json.loads(self.buffer)
            arguments = value.get("arguments") if isinstance(value, dict) else None
            if not isinstance(arguments, str):
                return
        elif end == "closed":
            arguments = arguments.rstrip()
            arguments = arguments[:-1].rstrip() if arguments.endswith("}") else arguments
        elif end == "open":
            arguments = arguments[:len(arguments) - _closing(arguments)]
        if len(arguments) > self.sent:
            piece, self.sent = arguments[self.sent:], len(arguments)
            self.calls[-1].arguments += piece
            out.append(Delta(index=self.calls[-1].index, arguments=piece))

    def _complete(self, out: list[Delta], body: str, cut: bool = False) -> bool:
        """A call's whole text is in: finish streaming it, or read it whole if its head never matched. False when
        it was not a call at all."""
        self.buffer = body
        if self.head_end is None and not HEAD.match(body):
            value = json.loads(body) if _is_json(body) else None
            if not (isinstance(value, dict) and isinstance(value.get("name"), str) and "arguments" in value):
                self.buffer = ""
                if not self.forced:
                    out.append(Delta(content=self.blanks + OPEN + body + ("" if cut else CLOSE)))
                return False
            index = len(self.calls)
            arguments = value["arguments"]
            text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
            self.calls.append(ToolCall(index, call_id(self.request_id, index), value["name"], text))
            out.append(Delta(index=index, id=self.calls[-1].id, name=value["name"], arguments=text))
        else:
            self._stream_arguments(out, "raw" if cut and not _is_json(body) else "closed")
        self.buffer, self.head_end = "", None
        return True


def parse(text: str, request_id: str, forced: bool = False) -> tuple[str | None, list[ToolCall]]:
    """A whole answer's text and calls, exactly as a stream of it would have given them."""
    parser = StreamParser(request_id, forced)
    deltas = parser.feed(text) + parser.finish()
    content = "".join(d.content for d in deltas if d.content is not None)
    return (content if content.strip() or not (parser.calls or forced) else None), parser.calls


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except json.JSONDecodeError:
        return False
    return True


def _partial(text: str, marker: str, blanks: bool = False) -> int:
    """Length of the tail of `text` that may grow into `marker` (with the blanks before it, when asked)."""
    keep = 0
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            keep = n
            break
    if blanks:
        while keep < len(text) and text[len(text) - keep - 1].isspace():
            keep += 1
    return keep


def _closing(arguments: str) -> int:
    """Length of the tail of a call's arguments that may be its end: the call's own '}', blanks, a partial tag."""
    keep = _partial(arguments, CLOSE, blanks=True)
    rest = arguments[:len(arguments) - keep]
    if rest.endswith("}"):
        keep += 1
        while keep < len(arguments) and arguments[len(arguments) - keep - 1].isspace():
            keep += 1
    return keep
