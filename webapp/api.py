"""OpenAI-compatible HTTP API: /v1/chat/completions (plain or server-sent events) and /v1/models."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator

from flask import Blueprint, Response, current_app, request, stream_with_context

from worker.celery_app import HEARTBEAT_PREFIX

from . import queue
from .queue import UserError

bp = Blueprint("api", __name__, url_prefix="/v1")

ROLES = ("system", "user", "assistant")
MAX_TOKENS_LIMIT = 4096
# An answer that sends nothing for this long is given up on: its worker died and it was not redelivered.
SILENCE_LIMIT_S = 120


def error_response(exc: UserError):
    kind = "rate_limit_error" if exc.status == 429 else "invalid_request_error" if exc.status < 500 else "api_error"
    return {"error": {"message": exc.message, "type": kind, "param": None, "code": exc.code}}, exc.status


def served_models() -> list[str]:
    r = current_app.extensions["redis"]
    names = {json.loads(r.get(key) or "{}").get("model") for key in r.scan_iter(HEARTBEAT_PREFIX + "*")}
    return sorted(n for n in names if n) or ["supportbot"]


@bp.get("/models")
def models():
    return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "supportbot"}
                                       for name in served_models()]}


def _number(body: dict, name: str, default, low: float, high: float, integer: bool = False):
    value = body.get(name, default)
    if value is None:
        return default
    ok = isinstance(value, int) if integer else isinstance(value, (int, float))
    if isinstance(value, bool) or not ok or not math.isfinite(value) or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        raise UserError("invalid_value", f"'{name}' must be {kind} between {low} and {high}; got {value!r}.")
    return value


def parse_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise UserError("invalid_messages", "'messages' must be a non-empty list of {role, content} objects.")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise UserError("invalid_messages", f"messages[{i}] needs a role of {', '.join(ROLES)}.")
        content = m.get("content")
        if isinstance(content, list):   # the content-parts form: only text parts are understood
            if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
                raise UserError("invalid_messages", f"messages[{i}]: only text content parts are supported.")
            content = "".join(str(p.get("text", "")) for p in content)
        if not isinstance(content, str):
            raise UserError("invalid_messages", f"messages[{i}].content must be a string.")
        out.append({"role": m["role"], "content": content})
    if sum(len(m["content"]) for m in out) > 16 * current_app.config["MAX_MESSAGE_CHARS"]:
        raise UserError("context_length_exceeded", "The messages are too long; send fewer or shorter messages.")
    if out[0]["role"] != "system":   # the shop's persona only when the client brings none
        out.insert(0, {"role": "system", "content": current_app.config["SYSTEM_PROMPT"]})
    return out


def parse_params(body: dict) -> dict:
    if body.get("n", 1) != 1:
        raise UserError("invalid_value", "Only n=1 is supported.")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise UserError("invalid_value", "'stop' must be a string or a list of at most 4 non-empty strings.")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    params = {
        "max_new_tokens": _number({"max_tokens": max_tokens}, "max_tokens", current_app.config["MAX_NEW_TOKENS"],
                                  1, MAX_TOKENS_LIMIT, integer=True),
        "temperature": _number(body, "temperature", 1.0, 0, 2),
        "top_p": _number(body, "top_p", 1.0, 0, 1),
        "top_k": _number(body, "top_k", 0, -1, 100_000, integer=True),
        "repetition_penalty": _number(body, "repetition_penalty", 1.0, 0.01, 10),
        "stop": stop,
    }
    if params["top_p"] == 0:
        raise UserError("invalid_value", "'top_p' must be greater than 0.")
    if body.get("seed") is not None:
        params["seed"] = _number(body, "seed", None, 0, 2**63 - 1, integer=True)
    return params


@bp.post("/chat/completions")
def chat_completions():
    try:
        body = request.get_json(silent=True)
        if not isinstance(body, dict):
            raise UserError("invalid_json", "Send a JSON object body with Content-Type: application/json.")
        messages, params = parse_messages(body), parse_params(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise UserError("invalid_value", "'stream' must be true or false.")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise UserError("invalid_value", "'stream_options' must be an object like {\"include_usage\": true}.")
        model = body.get("model") or served_models()[0]
        queue.check_room()
        job = queue.new_job(messages, params, source="api", channel=True)
        with current_app.extensions["db"]() as db:
            db.add(queue.record_for(job))
            db.commit()
        events = subscribe(job)   # before sending: no event can slip past
        queue.send(job)
    except UserError as exc:
        return error_response(exc)
    if stream:
        body = sse(job, events, model, options.get("include_usage", False))
        return Response(stream_with_context(body), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    text, final = [], None
    for event in events:
        if event["event"] == "token":
            text.append(event["text"])
        else:
            final = event
    if final is None or final["event"] == "error":
        return error_response(UserError(final["code"] if final else "timeout",
                                        final["message"] if final else "The answer did not arrive; retry.",
                                        retryable=True, status=400 if final and not final["retryable"] else 503))
    return completion(job, model, "".join(text), final)


def subscribe(job: dict) -> Iterator[dict]:
    pubsub = current_app.extensions["redis"].pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(job["channel"])

    def events() -> Iterator[dict]:
        last = time.monotonic()
        try:
            while time.monotonic() - last < SILENCE_LIMIT_S:
                message = pubsub.get_message(timeout=1.0)
                if message is None:
                    continue
                last = time.monotonic()
                event = json.loads(message["data"])
                yield event
                if event["event"] in ("done", "error"):
                    return
        finally:
            pubsub.close()

    return events()


def completion(job: dict, model: str, text: str, done: dict) -> dict:
    return {
        "id": f"chatcmpl-{job['request_id']}", "object": "chat.completion", "created": int(job["enqueued_at"]),
        "model": model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                     "finish_reason": finish_reason(done)}],
        "usage": usage(done),
    }


def usage(done: dict) -> dict:
    return {"prompt_tokens": done["prompt_tokens"], "completion_tokens": done["completion_tokens"],
            "total_tokens": done["prompt_tokens"] + done["completion_tokens"]}


def finish_reason(done: dict) -> str:
    return "length" if done["finish_reason"] == "length" else "stop"


def sse(job: dict, events: Iterator[dict], model: str, include_usage: bool = False) -> Iterator[str]:
    def chunk(delta: dict | None, reason: str | None = None, usage: dict | None = None) -> str:
        body = {"id": f"chatcmpl-{job['request_id']}", "object": "chat.completion.chunk",
                "created": int(job["enqueued_at"]), "model": model,
                "choices": [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": reason}]}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    finished = False
    try:
        yield chunk({"role": "assistant", "content": ""})
        for event in events:
            if event["event"] == "token":
                yield chunk({"content": event["text"]})
            elif event["event"] == "done":
                finished = True
                yield chunk({}, finish_reason(event))
                if include_usage:   # OpenAI's shape: a last chunk with no choices, only usage
                    yield chunk(None, usage=usage(event))
            else:
                finished = True
                yield f"data: {json.dumps({'error': {'message': event['message'], 'code': event['code']}})}\n\n"
        yield "data: [DONE]\n\n"
    finally:
        if not finished:   # the client went away mid-answer: free the slot
            queue.cancel(job["request_id"])
