"""Anthropic's Messages API (POST /v1/messages, as vLLM's and llama.cpp's servers take it) on the chat's machinery:
a request's messages and content blocks become chat messages and its fields the chat's; the chat's answer becomes a
Message with text and tool_use blocks, or a stream of the Messages API's events. Errors on /v1/messages take that
API's shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from flask import Flask, Response, request

from structured.tools import Delta

from .api_answers import KEEP_ALIVE, STOPPED_ARRIVING, Shape, cancelling, choices_of, parser_for, pieces
from .api_params import invalid
from .queue import UserError

PATH = "/v1/messages"
COUNT_PATH = PATH + "/count_tokens"   # answered from the tokenizer (webapp/tokens.py)
# Chat-completion fields these become, for errors that name the chat's (api_params.renamed).
RENAMED = {"stop": "stop_sequences", "response_format": "output_config"}
# Anthropic's error types by HTTP status.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error"}


def chat_body(body: dict, default_max_tokens: int) -> dict:
    """The chat-completions body a Messages body asks for; UserError naming the field at fault."""
    thinking = body.get("thinking")
    if thinking is not None and not (isinstance(thinking, dict) and thinking.get("type") == "disabled"):
        raise UserError("unsupported_parameter", "'thinking' is not supported by this server: the models served here "
                                                 "do not think apart from their answer; leave it out.",
                        param="thinking")
    chat: dict[str, Any] = {"messages": messages_of(body),
                            "max_tokens": body["max_tokens"] if body.get("max_tokens") is not None
                            else default_max_tokens}
    for source, target in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k"),
                           ("stop_sequences", "stop"), ("stream", "stream")):
        if body.get(source) is not None:
            chat[target] = body[source]
    config = body.get("output_config")
    if config is not None:
        fmt = config.get("format") if isinstance(config, dict) else None
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
                raise invalid("output_config", "'output_config.format' must be {\"type\": \"json_schema\", \"schema\": "
                                               "{...}}.")
            chat["response_format"] = {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": fmt["schema"]}}
    user = (body.get("metadata") or {}).get("user_id")
    if user is not None:
        chat["user"] = user
    if body.get("tools"):
        chat["tools"] = tools_of(body["tools"])
    choice = body.get("tool_choice")
    if choice is not None:
        kind = choice.get("type") if isinstance(choice, dict) else None
        if kind not in ("auto", "any", "tool", "none") or (kind == "tool" and not isinstance(choice.get("name"), str)):
            raise invalid("tool_choice", "'tool_choice' must be {\"type\": \"auto\"}, {\"type\": \"any\"}, {\"type\": "
                                         "\"none\"} or {\"type\": \"tool\", \"name\": ...}.")
        chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}.get(kind) or \
            {"type": "function", "function": {"name": choice["name"]}}
        if choice.get("disable_parallel_tool_use") is not None:
            chat["parallel_tool_calls"] = not choice["disable_parallel_tool_use"]
    return chat


def text_of(content: Any, where: str) -> str:
    """A block list's text (or a string as it is); blocks other than text are refused."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid("messages", f"'{where}' must be a string or a list of content blocks.")
    texts = []
    for k, block in enumerate(content):
        if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
            kind = block.get("type") if isinstance(block, dict) else None
            raise invalid("messages", f"'{where}[{k}]' must be a text block; got type {str(kind)[:40]!r} (only text, "
                                      "tool_use and tool_result blocks are taken here).")
        texts.append(block["text"])
    return "".join(texts)


def messages_of(body: dict) -> list[dict]:
    """`system` and `messages` (text, tool_use and tool_result blocks) as chat messages; thinking blocks from an
    earlier answer are left out."""
    out: list[dict] = []
    if body.get("system") is not None:
        out.append({"role": "system", "content": text_of(body["system"], "system")})
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "'messages' must be a non-empty list of {role, content} objects.")
    for i, message in enumerate(messages):
        where = f"messages[{i}]"
        role = message.get("role") if isinstance(message, dict) else None
        if role not in ("user", "assistant"):
            raise invalid("messages", f"'{where}.role' must be \"user\" or \"assistant\".")
        content = message.get("content")
        if isinstance(content, str):
            out.append({"role": role, "content": content})
            continue
        if not isinstance(content, list):
            raise invalid("messages", f"'{where}.content' must be a string or a list of content blocks.")
        texts, calls = [], []
        for k, block in enumerate(content):
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind == "tool_use" and role == "assistant" and isinstance(block.get("id"), str) \
                    and isinstance(block.get("name"), str):
                calls.append({"id": block["id"], "type": "function", "function": {
                    "name": block["name"], "arguments": json.dumps(block.get("input") or {}, ensure_ascii=False)}})
            elif kind == "tool_result" and role == "user" and isinstance(block.get("tool_use_id"), str):
                result = text_of(block.get("content") or "", f"{where}.content[{k}].content")
                if block.get("is_error"):
                    result = "Error: " + result
                out.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": result})
            elif kind in ("thinking", "redacted_thinking"):
                continue
            else:
                raise invalid("messages", f"'{where}.content[{k}]' must be a text block, a tool_use block "
                                          f"(assistant) or a tool_result block (user); got type {str(kind)[:40]!r}.")
        if texts or calls:
            out.append({"role": role, "content": "".join(texts), **({"tool_calls": calls} if calls else {})})
    return out


def tools_of(tools: Any) -> list[dict]:
    """Client tools in the chat's form; Anthropic's server tools (web search, code execution, ...) are refused."""
    if not isinstance(tools, list):
        raise invalid("tools", "'tools' must be a list of tools.")
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type", "custom") != "custom":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise UserError("unsupported_parameter", f"'tools[{k}]' is a {str(kind)[:40]!r} tool; only client tools "
                                                     "({name, description, input_schema}) are served here.",
                            param="tools")
        out.append({"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description", ""),
            "parameters": tool.get("input_schema") or {"type": "object"}}})
    return out


# ---- the answer ---------------------------------------------------------------------------------------


class Blocks:
    """An answer's content blocks as its pieces arrive (structured.tools.Delta): a text block for each run of
    text, a tool_use block for each call, in the order written. Each change comes back as the Messages API's
    stream events, (type, fields); a whole answer reads the blocks only."""

    def __init__(self) -> None:
        self.blocks: list[dict] = []
        self.arguments = ""   # the open tool_use block's JSON text
        self.open = False

    def feed(self, piece: Delta) -> list[tuple[str, dict]]:
        events: list[tuple[str, dict]] = []
        if piece.index is None:
            if not piece.content:
                return events
            if not (self.open and self.blocks[-1]["type"] == "text"):
                events += self.close()
                self.blocks.append({"type": "text", "text": ""})
                self.open = True
                events.append(("content_block_start", {"index": len(self.blocks) - 1,
                                                       "content_block": {"type": "text", "text": ""}}))
            self.blocks[-1]["text"] += piece.content
            events.append(("content_block_delta", {"index": len(self.blocks) - 1,
                                                   "delta": {"type": "text_delta", "text": piece.content}}))
            return events
        if piece.id is not None:   # a call begins
            events += self.close()
            self.blocks.append({"type": "tool_use", "id": piece.id, "name": piece.name or "", "input": {}})
            self.arguments, self.open = "", True
            events.append(("content_block_start", {"index": len(self.blocks) - 1,
                                                   "content_block": dict(self.blocks[-1])}))
        if piece.arguments:
            self.arguments += piece.arguments
            events.append(("content_block_delta", {"index": len(self.blocks) - 1,
                                                   "delta": {"type": "input_json_delta",
                                                             "partial_json": piece.arguments}}))
        return events

    def close(self) -> list[tuple[str, dict]]:
        if not self.open:
            return []
        self.open = False
        block = self.blocks[-1]
        if block["type"] == "tool_use":
            try:
                block["input"] = json.loads(self.arguments) if self.arguments else {}
            except ValueError:   # cut short by max_tokens
                block["input"] = {}
        return [("content_block_stop", {"index": len(self.blocks) - 1})]


def stop_reason(blocks: Blocks, done: dict) -> tuple[str, str | None]:
    """The Message's stop_reason and stop_sequence: the length cap, a call, one of the stop_sequences, or the end
    of the model's turn."""
    choice = choices_of(done)[0]
    if choice["finish_reason"] == "length":
        return "max_tokens", None
    if any(b["type"] == "tool_use" for b in blocks.blocks):
        return "tool_use", None
    matched = choice.get("stop_reason")
    return ("stop_sequence", matched) if isinstance(matched, str) else ("end_turn", None)


def usage(done: dict) -> dict:
    return {"input_tokens": done["prompt_tokens"], "output_tokens": done["completion_tokens"]}


def message(job: dict, shape: Shape, content: list[dict], reason: tuple[str | None, str | None],
            done: dict | None) -> dict:
    return {"id": f"msg_{job['request_id']}", "type": "message", "role": "assistant", "model": shape.model,
            "content": content, "stop_reason": reason[0], "stop_sequence": reason[1],
            "usage": usage(done) if done is not None else {"input_tokens": 0, "output_tokens": 0}}


def answer(job: dict, shape: Shape, done: dict) -> dict:
    """The whole answer as a Message."""
    blocks, parser = Blocks(), parser_for(job, shape)
    for piece in [*pieces(parser, choices_of(done)[0]["text"]), *(parser.finish() if parser else [])]:
        blocks.feed(piece)
    blocks.close()
    return message(job, shape, blocks.blocks, stop_reason(blocks, done), done)


def answer_stream(job: dict, events: Iterator[dict], shape: Shape) -> Iterator[str]:
    """The answer as the Messages API streams it: message_start, a content block per run of text and per call
    (text_delta and input_json_delta), message_delta with the stop reason and usage, message_stop."""
    def event(kind: str, fields: dict) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    blocks, parser = Blocks(), parser_for(job, shape)

    def body() -> Iterator[str]:
        yield event("message_start", {"message": message(job, shape, [], (None, None), None)})
        yield event("ping", {})
        for ev in events:
            if ev["event"] == "waiting":
                yield KEEP_ALIVE
            elif ev["event"] == "token":
                if ev.get("index", 0) == 0:
                    for piece in pieces(parser, ev["text"]):
                        for kind, fields in blocks.feed(piece):
                            yield event(kind, fields)
            elif ev["event"] == "done":
                for piece in parser.finish() if parser else []:
                    for kind, fields in blocks.feed(piece):
                        yield event(kind, fields)
                for kind, fields in blocks.close():
                    yield event(kind, fields)
                reason, sequence = stop_reason(blocks, ev)
                yield event("message_delta", {"delta": {"stop_reason": reason, "stop_sequence": sequence},
                                              "usage": usage(ev)})
                yield event("message_stop", {})
                return True
            else:   # an error
                yield event("error", {"error": {"type": "overloaded_error" if ev.get("retryable") else
                                                "invalid_request_error", "message": ev["message"]}})
                return True
        return False

    return cancelling(job, body, lambda: event("error", {"error": {"type": "overloaded_error",
                                                                   "message": STOPPED_ARRIVING}}))


def anthropic_errors(response: Response) -> Response:
    """Errors on /v1/messages and its count_tokens (refusals, routing, keys) in the Messages API's shape: {type:
    error, error: {type, message}}."""
    if request.path not in (PATH, COUNT_PATH) or response.status_code < 400 or response.is_streamed or not response.is_json:
        return response
    body = response.get_json(silent=True)
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and "message" in error:
        kind = ERROR_TYPES.get(response.status_code, "api_error")
        response.set_data(json.dumps({"type": "error", "error": {"type": kind, "message": error["message"]}}))
    return response


def init_app(app: Flask) -> None:
    app.after_request(anthropic_errors)
