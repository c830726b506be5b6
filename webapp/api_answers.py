"""OpenAI's response bodies and stream chunks from a job's events: choices, tool calls and log-probabilities, for
chat completions and the legacy completions."""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from structured.tools import Delta, StreamParser, parse

from . import queue


@dataclass(frozen=True)
class Shape:
    """What a client asked for, beyond the text: tool calls read from it, log-probabilities, the prompt echoed."""

    model: str
    tools: bool = False       # answers are read for tool calls
    forced: bool = False      # a grammar forced calls (tool_choice "required" or a named function): no text
    named: bool = False       # tool_choice named the function: its call ends with "stop", as OpenAI's does
    logprobs: bool = False    # chat: choices carry logprobs.content; completions: the legacy logprobs
    echo: bool = False        # completions: the prompt comes before the answer
    include_usage: bool = False
    token_ids: bool = False   # vLLM's return_token_ids: the prompt's token ids and each choice's
    response: dict | None = None   # the Responses API: the request's fields its Response repeats


def choices_of(done: dict) -> list[dict]:
    """The final event's choices; an older worker's (or a replayed) final event has one, in its top level."""
    return done.get("choices") or [{"index": 0, "text": done.get("text", ""), "finish_reason": done["finish_reason"],
                                    "completion_tokens": done["completion_tokens"]}]


def usage(done: dict) -> dict:
    return {"prompt_tokens": done["prompt_tokens"], "completion_tokens": done["completion_tokens"],
            "total_tokens": done["prompt_tokens"] + done["completion_tokens"]}


def finish_reason(reason: str) -> str:
    return "length" if reason == "length" else "stop"


def stop_reason(choice: dict) -> str | int | None:
    """vLLM's stop_reason: the stop string or stop token id that ended the choice, null for anything else (EOS,
    the length cap, a call's end)."""
    return choice.get("stop_reason")


def with_token_ids(choice: dict, ended: dict, shape: Shape) -> dict:
    """A choice with its token ids, when the client asked (vLLM's return_token_ids)."""
    if shape.token_ids:
        choice["token_ids"] = ended.get("token_ids")
    return choice


def call_reason(shape: Shape) -> str:
    """An answer that called tools ends with "tool_calls"; one whose tool_choice named the function with "stop"."""
    return "stop" if shape.named else "tool_calls"


def call_scope(job: dict, index: int) -> str:
    """What a choice's tool-call ids derive from: the same in a stream and in a whole answer."""
    return job["request_id"] if index == 0 else f"{job['request_id']}:{index}"


# An SSE comment: clients skip it, and proxies that close idle connections see traffic.
KEEP_ALIVE = ": keep-alive\n\n"


def error_event(event: dict) -> str:
    return f"data: {json.dumps({'error': {'message': event['message'], 'code': event['code']}})}\n\n"


STOPPED_ARRIVING = "The answer stopped arriving; send the request again."


def cancelling(job: dict, body: Callable[[], Iterator[str]], silent: Callable[[], str]) -> Iterator[str]:
    """A stream's events from `body`, which returns True once the answer's end (or an error) was sent; a stream
    whose events stopped without one ends with `silent()`. A client that goes away mid-answer frees its slot."""
    ended = False
    try:
        ended = yield from body()
        if not ended:
            yield silent()
    finally:
        if not ended:
            queue.cancel(job["request_id"])


def streamed(job: dict, body: Callable[[], Iterator[str]]) -> Iterator[str]:
    """A chat or completion stream's chunks, ended by [DONE]: never a bare [DONE] after a stream that stopped
    without its end, which gets an error chunk first (`cancelling`)."""
    yield from cancelling(job, body, lambda: error_event({"code": "timeout", "message": STOPPED_ARRIVING}))
    yield "data: [DONE]\n\n"


def parser_for(job: dict, shape: Shape) -> StreamParser | None:
    """The reader of the first choice's tool calls, when the answer is read for them."""
    return StreamParser(call_scope(job, 0), shape.forced) if shape.tools else None


def pieces(parser: StreamParser | None, text: str) -> list[Delta]:
    """A piece of answer text as text and call pieces (all text when no calls are read)."""
    return parser.feed(text) if parser is not None else [Delta(content=text)] if text else []


# ---- chat completions -----------------------------------------------------------------------------


def chat_completion(job: dict, shape: Shape, done: dict) -> dict:
    choices = []
    for c in choices_of(done):
        message: dict = {"role": "assistant", "content": c["text"]}
        reason = finish_reason(c["finish_reason"])
        if shape.tools:
            content, calls = parse(c["text"], call_scope(job, c["index"]), shape.forced)
            message["content"] = content
            if calls:
                message["tool_calls"] = [call.to_openai() for call in calls]
                reason = call_reason(shape) if reason != "length" else reason
        choices.append(with_token_ids({"index": c["index"], "message": message,
                                       "logprobs": {"content": c.get("logprobs") or []} if shape.logprobs else None,
                                       "finish_reason": reason, "stop_reason": stop_reason(c)}, c, shape))
    body = {"id": f"chatcmpl-{job['request_id']}", "object": "chat.completion", "created": int(job["enqueued_at"]),
            "model": shape.model, "choices": choices, "usage": usage(done)}
    if shape.token_ids:
        body["prompt_token_ids"] = done.get("prompt_token_ids")
    return body


def chat_stream(job: dict, events: Iterator[dict], shape: Shape) -> Iterator[str]:
    prompt_sent = False   # the prompt's ids go once, top-level, with the first choice that ends

    def chunk(index: int | None, delta: dict | None, reason: str | None = None, logprobs: list | None = None,
              usage_: dict | None = None, ended_by: dict | None = None, done: dict | None = None) -> str:
        nonlocal prompt_sent
        body: dict = {"id": f"chatcmpl-{job['request_id']}", "object": "chat.completion.chunk",
                      "created": int(job["enqueued_at"]), "model": shape.model, "choices": []}
        if index is not None:
            choice: dict = {"index": index, "delta": delta, "finish_reason": reason}
            if ended_by is not None:
                choice["stop_reason"] = stop_reason(ended_by)
                with_token_ids(choice, ended_by, shape)
                if shape.token_ids and not prompt_sent:
                    body["prompt_token_ids"] = done.get("prompt_token_ids")
                    prompt_sent = True
            if shape.logprobs:
                choice["logprobs"] = {"content": logprobs} if logprobs else None
            body["choices"] = [choice]
        if usage_ is not None:
            body["usage"] = usage_
        return f"data: {json.dumps(body)}\n\n"

    def body():
        n = (job.get("params") or {}).get("n", 1)
        parsers = {i: StreamParser(call_scope(job, i), shape.forced) for i in range(n)} if shape.tools else {}
        for i in range(n):
            yield chunk(i, {"role": "assistant", "content": ""})
        for event in events:
            if event["event"] == "waiting":   # nothing to send for API_KEEPALIVE_S
                yield KEEP_ALIVE
            elif event["event"] == "token":
                i, text = event.get("index", 0), event["text"]
                deltas = [d.to_openai() for d in parsers[i].feed(text)] if parsers else \
                    [{"content": text}] if text else []
                logprobs = event.get("logprobs") if shape.logprobs else None
                if logprobs and not deltas:   # tokens whose text is held back (a partial character or tag)
                    deltas = [{}]
                for k, delta in enumerate(deltas):
                    yield chunk(i, delta, logprobs=logprobs if k == 0 else None)
            elif event["event"] == "done":
                for c in choices_of(event):
                    i, reason = c["index"], finish_reason(c["finish_reason"])
                    if parsers:
                        for delta in parsers[i].finish():
                            yield chunk(i, delta.to_openai())
                        if parsers[i].calls and reason != "length":
                            reason = call_reason(shape)
                    yield chunk(i, {}, reason, ended_by=c, done=event)
                if shape.include_usage:   # OpenAI's shape: a last chunk with no choices, only usage
                    yield chunk(None, None, usage_=usage(event))
                return True
            else:
                yield error_event(event)
                return True

    return streamed(job, body)


# ---- completions ------------------------------------------------------------------------------------


def legacy_logprobs(entries: list[dict], start: int) -> dict:
    """Chat-shaped token entries as the legacy {tokens, token_logprobs, top_logprobs, text_offset}; the offsets
    count from `start`. A prompt's first token has no log-probability: null, as OpenAI reports it."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    offset = start
    for e in entries:
        out["tokens"].append(e["token"])
        out["token_logprobs"].append(e["logprob"])
        if e["logprob"] is None:
            out["top_logprobs"].append(None)
        else:   # the best alternatives and, always, the token itself
            out["top_logprobs"].append({**{t["token"]: t["logprob"] for t in e["top_logprobs"]},
                                        e["token"]: e["logprob"]})
        out["text_offset"].append(offset)
        offset += len(e["token"])
    return out


def echoed(done: dict) -> tuple[str, list[dict]]:
    prompt = done.get("prompt") or {}
    return prompt.get("text", ""), prompt.get("logprobs") or []


def completion(job: dict, shape: Shape, done: dict) -> dict:
    prompt_text, prompt_logprobs = echoed(done) if shape.echo else ("", [])
    choices = []
    for c in choices_of(done):
        logprobs = None
        if shape.logprobs:
            logprobs = legacy_logprobs(prompt_logprobs, 0)
            more = legacy_logprobs(c.get("logprobs") or [], len(prompt_text))
            for key in logprobs:
                logprobs[key] += more[key]
        choice = with_token_ids({"index": c["index"], "text": prompt_text + c["text"], "logprobs": logprobs,
                                 "finish_reason": finish_reason(c["finish_reason"]), "stop_reason": stop_reason(c)},
                                c, shape)
        if shape.token_ids:   # vLLM's completions carry them on each choice
            choice["prompt_token_ids"] = done.get("prompt_token_ids")
        choices.append(choice)
    return {"id": f"cmpl-{job['request_id']}", "object": "text_completion", "created": int(job["enqueued_at"]),
            "model": shape.model, "choices": choices, "usage": usage(done)}


def completion_stream(job: dict, events: Iterator[dict], shape: Shape) -> Iterator[str]:
    """Each choice's text as it comes. With echo, each choice starts with the prompt (its text and, when asked,
    its log-probabilities), which comes with choice 0's first delta; the end carries it too, for an answer with
    no tokens or a delta that was lost. A choice's tokens wait only until the prompt is known."""
    def chunk(index: int | None, text: str, logprobs: dict | None = None, reason: str | None = None,
              usage_: dict | None = None, ended_by: dict | None = None, done: dict | None = None) -> str:
        body: dict = {"id": f"cmpl-{job['request_id']}", "object": "text_completion",
                      "created": int(job["enqueued_at"]), "model": shape.model, "choices": []}
        if index is not None:
            body["choices"] = [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": reason}]
            if ended_by is not None:
                body["choices"][0]["stop_reason"] = stop_reason(ended_by)
                with_token_ids(body["choices"][0], ended_by, shape)
                if shape.token_ids:
                    body["choices"][0]["prompt_token_ids"] = done.get("prompt_token_ids")
        if usage_ is not None:
            body["usage"] = usage_
        return f"data: {json.dumps(body)}\n\n"

    def body():
        offsets: dict[int, int] = {}
        prompt: tuple[str, list[dict]] | None = None if shape.echo else ("", [])
        opened: set[int] = set()   # choices whose prompt was sent
        held: list[dict] = []      # tokens that came before the prompt

        def deliver(event: dict) -> Iterator[str]:
            index = event.get("index", 0)
            if shape.echo and index not in opened:
                opened.add(index)
                offsets[index] = len(prompt[0])
                yield chunk(index, prompt[0], legacy_logprobs(prompt[1], 0) if shape.logprobs else None)
            if event["event"] == "token":
                yield token_chunk(event, offsets, chunk)

        for event in events:
            if event["event"] == "waiting":   # nothing to send for API_KEEPALIVE_S
                yield KEEP_ALIVE
            elif event["event"] == "token":
                if prompt is None and "prompt" in event:
                    prompt = echoed(event)
                if prompt is None:
                    held.append(event)
                    continue
                for waiting in held + [event]:
                    yield from deliver(waiting)
                held.clear()
            elif event["event"] == "done":
                if prompt is None:
                    prompt = echoed(event)
                for waiting in held:
                    yield from deliver(waiting)
                for c in choices_of(event):
                    yield from deliver({"event": "done", "index": c["index"]})
                    yield chunk(c["index"], "", None, finish_reason(c["finish_reason"]), ended_by=c, done=event)
                if shape.include_usage:
                    yield chunk(None, "", usage_=usage(event))
                return True
            else:
                yield error_event(event)
                return True

    def token_chunk(event: dict, offsets: dict[int, int], chunk) -> str:
        i = event.get("index", 0)
        logprobs = None
        if shape.logprobs:
            logprobs = legacy_logprobs(event.get("logprobs") or [], offsets.get(i, 0))
            offsets[i] = offsets.get(i, 0) + sum(len(t) for t in logprobs["tokens"])
        return chunk(i, event["text"], logprobs)

    return streamed(job, body)
