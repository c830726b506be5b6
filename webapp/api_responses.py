"""OpenAI's Responses API (POST /v1/responses) on the chat's machinery: a request's input items become chat
messages and its fields the chat's; the chat's answer becomes a Response, or a stream of the Responses API's typed
events. No response is kept: a conversation is sent whole in `input`, as with chat completions."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from structured.tools import Delta, StreamParser

from . import api_params
from .api_answers import KEEP_ALIVE, STOPPED_ARRIVING, Shape, cancelling, choices_of, parser_for, pieces
from .api_params import invalid
from .queue import UserError

# Fields a Responses request may carry that this server cannot honour: a value other than these is refused, saying
# why. Each maps to its neutral values.
UNSUPPORTED = {
    "previous_response_id": ((None,), "this server keeps no responses; send the whole conversation in 'input'"),
    "conversation": ((None,), "this server keeps no conversations; send the whole conversation in 'input'"),
    "background": ((None, False), "answers are not run in the background here; leave it out"),
    "prompt": ((None,), "stored prompts are not kept here; send 'instructions' and 'input'"),
    "reasoning": ((None,), "the models served here do not reason apart from their answer; leave it out"),
    "max_tool_calls": ((None,), "tool calls are not capped here; leave it out"),
}
# What `include` may name: the answer's log-probabilities (each output_text's `logprobs`).
LOGPROBS = "message.output_text.logprobs"
# Chat-completion fields the Responses fields become, for errors that name the chat's (api_params.renamed).
RENAMED = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}
ROLES = ("user", "system", "developer", "assistant")


def chat_body(body: dict) -> dict:
    """The chat-completions body a Responses body asks for; UserError naming the field at fault."""
    for name, (neutral, why) in UNSUPPORTED.items():
        if body.get(name) not in neutral:
            raise UserError("unsupported_parameter", f"'{name}' is not supported by this server: {why}.", param=name)
    if body.get("truncation") not in (None, "auto", "disabled"):
        raise invalid("truncation", "'truncation' must be \"auto\" or \"disabled\".")
    chat: dict[str, Any] = {"messages": messages_of(body)}
    for source, target in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                           ("parallel_tool_calls", "parallel_tool_calls"), ("stream", "stream"),
                           ("service_tier", "service_tier"), ("user", "user"), ("metadata", "metadata")):
        if body.get(source) is not None:
            chat[target] = body[source]
    if body.get("tools") is not None:
        chat["tools"] = tools_of(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = tool_choice_of(body["tool_choice"])
    if logprobs_asked(body):
        if chat.get("tools") and chat.get("tool_choice") != "none":
            raise UserError("unsupported_parameter", f"'include' {LOGPROBS!r} is not served with tools here; ask "
                                                     "/v1/chat/completions (logprobs: true) or leave the tools out.",
                            param="include")
        chat["logprobs"], chat["top_logprobs"] = True, body.get("top_logprobs") or 0
    elif body.get("top_logprobs") is not None:   # checked as the chat checks it; without `include`, none are sent
        api_params.chat_logprobs({"logprobs": True, "top_logprobs": body["top_logprobs"]})
    text = body.get("text")
    if text is not None:
        if not isinstance(text, dict):
            raise invalid("text", "'text' must be an object like {\"format\": {\"type\": \"json_schema\", ...}}.")
        fmt = text.get("format")
        if fmt is not None:
            if not isinstance(fmt, dict) or fmt.get("type") not in ("text", "json_object", "json_schema"):
                raise invalid("text.format", "'text.format' must be {\"type\": \"text\"}, {\"type\": \"json_object\"} "
                                             "or {\"type\": \"json_schema\", \"name\": ..., \"schema\": {...}}.")
            if fmt["type"] == "json_schema":
                chat["response_format"] = {"type": "json_schema", "json_schema": {
                    k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}}
            else:
                chat["response_format"] = {"type": fmt["type"]}
    return chat


def logprobs_asked(body: dict) -> bool:
    """Whether `include` asks for the answer's log-probabilities; a 400 for anything else it names."""
    include = body.get("include")
    if include is None:
        return False
    if not isinstance(include, list) or not all(isinstance(x, str) for x in include):
        raise invalid("include", f"'include' must be a list of strings, like [{LOGPROBS!r}].")
    other = [x for x in include if x != LOGPROBS]
    if other:
        raise UserError("unsupported_parameter", f"'include' names {other[0][:60]!r}, which is not served here (no "
                                                 f"reasoning, files or tools run on the server); only {LOGPROBS!r} is.",
                        param="include")
    return bool(include)


def text_of(content: Any, where: str) -> str:
    """A message's content: its text, or the text of its input_text / output_text parts."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for k, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in ("input_text", "output_text", "text") or not isinstance(part.get("text"), str):
                raise invalid("input", f"'{where}.content[{k}]' must be a text part ({{\"type\": \"input_text\", "
                                       f"\"text\": ...}}); got type {str(kind)[:40]!r} (only text is taken here).")
            texts.append(part["text"])
        return "".join(texts)
    raise invalid("input", f"'{where}.content' must be a string or a list of text parts.")


def messages_of(body: dict) -> list[dict]:
    """`instructions` and `input` (a string, or a list of messages, function calls and their outputs) as chat
    messages; reasoning items from an earlier answer are left out."""
    out: list[dict] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise invalid("instructions", "'instructions' must be a string.")
        out.append({"role": "system", "content": instructions})
    items = body.get("input")
    if isinstance(items, str):
        return [*out, {"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise invalid("input", "'input' must be a string or a non-empty list of input items (messages, function calls "
                               "and their outputs).")
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ROLES:
            out.append({"role": item["role"], "content": text_of(item.get("content"), where)})
        elif kind == "function_call":
            if not all(isinstance(item.get(k), str) for k in ("call_id", "name", "arguments")):
                raise invalid("input", f"'{where}' must have string 'call_id', 'name' and 'arguments'.")
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant":   # calls after (or with) the assistant's text
                last.setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not isinstance(item.get("call_id"), str):
                raise invalid("input", f"'{where}.call_id' must be a string.")
            out.append({"role": "tool", "tool_call_id": item["call_id"], "content": text_of(item.get("output"),
                                                                                            where)})
        elif kind == "reasoning":
            continue
        else:
            raise invalid("input", f"'{where}' must be a message (role user, system, developer or assistant), a "
                                   f"function_call or a function_call_output; got type {str(kind)[:40]!r}.")
    return out


def tools_of(tools: Any) -> list[dict]:
    """Function tools in the chat's form; other kinds (web search, file search, ...) are refused."""
    if not isinstance(tools, list):
        raise invalid("tools", "'tools' must be a list of function tools.")
    out = []
    for k, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise UserError("unsupported_parameter", f"'tools[{k}]' is a {str(kind)[:40]!r} tool; only function "
                                                     "tools are served here.", param="tools")
        out.append({"type": "function", "function": {k2: tool[k2] for k2 in ("name", "description", "parameters",
                                                                              "strict") if k2 in tool}})
    return out


def tool_choice_of(choice: Any) -> Any:
    if choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise invalid("tool_choice", "'tool_choice' must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", "
                                 "\"name\": ...}.")


def echoed(body: dict) -> dict:
    """The request's fields a Response repeats."""
    fmt = (body.get("text") or {}).get("format") or {"type": "text"}
    return {"instructions": body.get("instructions"), "max_output_tokens": body.get("max_output_tokens"),
            "metadata": body.get("metadata") or {}, "parallel_tool_calls": body.get("parallel_tool_calls", True),
            "temperature": body.get("temperature", 1.0), "top_p": body.get("top_p", 1.0),
            "tool_choice": body.get("tool_choice") or "auto", "tools": body.get("tools") or [],
            "text": {"format": fmt}, "truncation": body.get("truncation") or "disabled",
            "user": body.get("user"), "store": False, "top_logprobs": body.get("top_logprobs")}


# ---- the answer ---------------------------------------------------------------------------------------


def usage(done: dict) -> dict:
    return {"input_tokens": done["prompt_tokens"], "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": done["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": done["prompt_tokens"] + done["completion_tokens"]}


def envelope(job: dict, shape: Shape, status: str, output: list[dict], done: dict | None = None) -> dict:
    return {"id": f"resp_{job['request_id']}", "object": "response", "created_at": int(job["enqueued_at"]),
            "status": status, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "model": shape.model, "output": output, **(shape.response or {}),
            "usage": usage(done) if done is not None else None}


def text_part(text: str, logprobs: list[dict] | None = None) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


class Output:
    """An answer's output items as its pieces arrive (structured.tools.Delta): a message item for each run of
    text, a function_call item for each call, in the order the model wrote them. Each change comes back as the
    Responses API's stream events, (type, fields); a whole answer reads the items only. Log-probabilities, when
    asked, ride on the text they came with: tokens that brought no text yet (part of a character) wait for the next
    delta."""

    def __init__(self, job: dict) -> None:
        self.request_id = job["request_id"]
        self.items: list[dict] = []
        self.text: list[str] = []   # the open message's text
        self.entries: list[dict] = []   # the open message's log-probabilities
        self.held: list[dict] = []      # log-probabilities of tokens whose text has not come yet
        self.messages = 0

    def _open(self) -> bool:
        return bool(self.items) and self.items[-1]["status"] == "in_progress"

    def hold(self, logprobs: list[dict] | None) -> None:
        self.held += logprobs or []

    def feed(self, piece: Delta, logprobs: list[dict] | None = None) -> list[tuple[str, dict]]:
        events: list[tuple[str, dict]] = []
        if piece.index is None:
            if not piece.content:
                self.hold(logprobs)
                return events
            if not (self._open() and self.items[-1]["type"] == "message"):
                events += self.close()
                self.messages += 1
                suffix = "" if self.messages == 1 else f"_{self.messages}"
                item = {"type": "message", "id": f"msg_{self.request_id}{suffix}", "status": "in_progress",
                        "role": "assistant", "content": []}
                self.items.append(item)
                self.text, self.entries = [], []
                events += [("response.output_item.added", {"output_index": len(self.items) - 1, "item": dict(item)}),
                           ("response.content_part.added", {"item_id": item["id"], "output_index": len(self.items) - 1,
                                                            "content_index": 0, "part": text_part("")})]
            self.text.append(piece.content)
            entries, self.held = self.held + (logprobs or []), []
            self.entries += entries
            events.append(("response.output_text.delta", {"item_id": self.items[-1]["id"],
                                                          "output_index": len(self.items) - 1, "content_index": 0,
                                                          "delta": piece.content, "logprobs": entries}))
            return events
        if piece.id is not None:   # a call begins
            events += self.close()
            item = {"type": "function_call", "id": f"fc_{piece.id}", "call_id": piece.id, "name": piece.name or "",
                    "arguments": "", "status": "in_progress"}
            self.items.append(item)
            events.append(("response.output_item.added", {"output_index": len(self.items) - 1, "item": dict(item)}))
        if piece.arguments:
            item = self.items[-1]
            item["arguments"] += piece.arguments
            events.append(("response.function_call_arguments.delta", {"item_id": item["id"],
                                                                      "output_index": len(self.items) - 1,
                                                                      "delta": piece.arguments}))
        return events

    def close(self, status: str = "completed") -> list[tuple[str, dict]]:
        """End the item being written: `completed`, or `incomplete` when the answer was cut in it."""
        if not self._open():
            return []
        index, item = len(self.items) - 1, self.items[-1]
        events: list[tuple[str, dict]] = []
        if item["type"] == "message":
            if self.held:   # tokens that brought no text (an end-of-turn token, say): an empty delta carries them
                events.append(("response.output_text.delta", {"item_id": item["id"], "output_index": index,
                                                              "content_index": 0, "delta": "", "logprobs": self.held}))
                self.entries, self.held = self.entries + self.held, []
            whole, entries = "".join(self.text), self.entries
            events += [("response.output_text.done", {"item_id": item["id"], "output_index": index,
                                                      "content_index": 0, "text": whole, "logprobs": entries}),
                       ("response.content_part.done", {"item_id": item["id"], "output_index": index,
                                                       "content_index": 0, "part": text_part(whole, entries)})]
            item.update(content=[text_part(whole, entries)], status=status)
        else:
            events.append(("response.function_call_arguments.done", {"item_id": item["id"], "output_index": index,
                                                                     "name": item["name"],
                                                                     "arguments": item["arguments"]}))
            item["status"] = status
        events.append(("response.output_item.done", {"output_index": index, "item": dict(item)}))
        return events


def finished(output: Output, parser: StreamParser | None, job: dict, shape: Shape,
             done: dict) -> tuple[list[tuple[str, dict]], dict]:
    """The last events of an answer (its parser's held-back text, the item being written closed) and its
    Response."""
    events = [e for piece in (parser.finish() if parser is not None else []) for e in output.feed(piece)]
    cut = choices_of(done)[0]["finish_reason"] == "length"
    events += output.close("incomplete" if cut else "completed")
    return events, envelope(job, shape, "incomplete" if cut else "completed", output.items, done)


def response(job: dict, shape: Shape, done: dict) -> dict:
    """The whole answer as a Response: its text and calls as items, in the order the model wrote them (as a
    stream of the same answer gives them)."""
    output, parser = Output(job), parser_for(job, shape)
    choice = choices_of(done)[0]
    logprobs = choice.get("logprobs") if shape.logprobs else None
    for piece in pieces(parser, choice["text"]):
        output.feed(piece, logprobs)
        logprobs = None
    return finished(output, parser, job, shape, done)[1]


def response_stream(job: dict, events: Iterator[dict], shape: Shape) -> Iterator[str]:
    """The answer as the Responses API streams it: response.created, then for each run of text a message item
    whose text arrives in output_text deltas, for each call a function_call item whose arguments arrive in
    deltas, and response.completed (or response.incomplete) with the whole Response."""
    seq = 0

    def event(kind: str, fields: dict) -> str:
        nonlocal seq
        seq += 1
        return f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n"

    output, parser = Output(job), parser_for(job, shape)

    def body() -> Iterator[str]:
        for kind in ("response.created", "response.in_progress"):
            yield event(kind, {"response": envelope(job, shape, "in_progress", [])})
        for ev in events:
            if ev["event"] == "waiting":
                yield KEEP_ALIVE
            elif ev["event"] == "token":
                if ev.get("index", 0) == 0:
                    logprobs = ev.get("logprobs") if shape.logprobs else None
                    found = pieces(parser, ev["text"])
                    if not found:
                        output.hold(logprobs)
                    for piece in found:
                        for kind, fields in output.feed(piece, logprobs):
                            yield event(kind, fields)
                        logprobs = None
            elif ev["event"] == "done":
                last, final = finished(output, parser, job, shape, ev)
                for kind, fields in last:
                    yield event(kind, fields)
                yield event("response.incomplete" if final["status"] == "incomplete" else "response.completed",
                            {"response": final})
                return True
            else:   # an error
                yield event("error", {"code": ev["code"], "message": ev["message"], "param": None})
                return True
        return False

    return cancelling(job, body, lambda: event("error", {"code": "timeout", "message": STOPPED_ARRIVING,
                                                         "param": None}))
