"""OpenAI-compatible HTTP API: /v1/chat/completions (plain or server-sent events) and /v1/models."""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from typing import NamedTuple

from flask import Blueprint, Flask, Response, current_app, request, stream_with_context
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from messaging.contract import HEARTBEAT_PREFIX

from . import keyring, limits, queue
from .queue import UserError
from .security import clean_text

bp = Blueprint("api", __name__, url_prefix="/v1")

ROLES = ("system", "user", "assistant")
ROLE_ALIASES = {"developer": "system"}   # OpenAI's newer name for the system message
MAX_TOKENS_LIMIT = 4096
MAX_MESSAGES = 500
MAX_STOP_CHARS = 200
MAX_MODEL_CHARS = 256
KNOWN_FIELDS = frozenset({
    "messages", "model", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
    "repetition_penalty", "seed", "stop", "stream", "stream_options", "n",
    # Bookkeeping that changes nothing about the answer: accepted and ignored.
    "user", "metadata", "store", "service_tier", "parallel_tool_calls",
})
# OpenAI parameters this server does not implement: accepted only at the value that means "not used".
NEUTRAL = {"presence_penalty": 0, "frequency_penalty": 0, "logprobs": False, "top_logprobs": 0, "logit_bias": {},
           "tools": [], "functions": [], "tool_choice": "none", "response_format": {"type": "text"}}
# An answer that sends nothing for this long is given up on: its worker died and it was not redelivered.
SILENCE_LIMIT_S = 120


def error_response(exc: UserError):
    kind = "rate_limit_error" if exc.status == 429 else "invalid_request_error" if exc.status < 500 else "api_error"
    headers = {"Retry-After": str(exc.retry_after)} if isinstance(exc, limits.RateLimited) else {}
    return {"error": {"message": exc.message, "type": kind, "param": None, "code": exc.code}}, exc.status, headers


def http_error(exc: HTTPException):
    """Routing and protocol errors under /v1 in OpenAI's shape, so API clients can read them."""
    if not request.path.startswith(bp.url_prefix + "/"):
        return exc
    if isinstance(exc, RequestEntityTooLarge):
        return error_response(too_large())
    code = (exc.name or "error").lower().replace(" ", "_")
    return error_response(UserError(code, f"{exc.description} ({request.method} {request.path[:100]})",
                                    status=exc.code or 500))


def init_app(app: Flask) -> None:
    app.register_blueprint(bp)
    app.register_error_handler(HTTPException, http_error)


def too_large() -> UserError:
    limit = current_app.config["MAX_CONTENT_LENGTH"]
    return UserError("request_too_large", f"The request body is larger than {limit} bytes; send fewer or shorter "
                                          "messages.", status=413)


def api_session() -> str | None:
    """An API client's "session" for rate limits: its address and its key (webapp/keyring.py), never the key itself."""
    key = keyring.session_part()
    return f"{limits.client_address()} {key}" if key else None


def read_json() -> dict:
    """The body as a JSON object, or a UserError saying exactly what is wrong with it."""
    try:
        raw = request.get_data(cache=False)
    except RequestEntityTooLarge:
        raise too_large() from None
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as exc:
        raise UserError("invalid_encoding", f"The body is not valid UTF-8 (byte {raw[exc.start]:#04x} at offset "
                                            f"{exc.start}); send JSON encoded as UTF-8.") from None
    try:
        body = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError("invalid_json", f"The body is not valid JSON ({exc.msg} at line {exc.lineno} column "
                                        f"{exc.colno}); send a JSON object with Content-Type: "
                                        "application/json.") from None
    except (ValueError, RecursionError):   # a number with thousands of digits, or arrays nested thousands deep
        raise UserError("invalid_json", "The body is JSON this server does not read (a number too long or nesting "
                                        "too deep); send a plain JSON object.") from None
    if not isinstance(body, dict):
        raise UserError("invalid_json", "Send a JSON object body with Content-Type: application/json.")
    # Checked last, so a body that is not JSON at all is reported as such whatever its label. No Content-Type
    # at all is read as JSON: some minimal clients send none.
    mimetype = request.mimetype
    if mimetype and mimetype != "application/json" and not mimetype.endswith("+json"):
        raise UserError("unsupported_media_type", f"The body is JSON but sent as {mimetype[:80]}; send it with "
                                                  "Content-Type: application/json.", status=415)
    return body


def check_fields(body: dict) -> None:
    for name, value in body.items():
        if name in KNOWN_FIELDS:
            continue
        if name in NEUTRAL:
            if value is not None and value != NEUTRAL[name]:
                raise UserError("unsupported_parameter", f"'{name}' is not supported by this server; remove it.")
            continue
        raise UserError("unknown_parameter", f"Unrecognized request argument supplied: {name[:40]!r}. Remove it; "
                                             "see GET /v1/models and the README for what this server takes.")


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
    # Floats must be finite; ints are compared exactly, however many digits they have.
    if isinstance(value, bool) or not ok or (isinstance(value, float) and not math.isfinite(value)) \
            or not low <= value <= high:
        kind = "an integer" if integer else "a number"
        got = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise UserError("invalid_value", f"'{name}' must be {kind} between {low} and {high}; got {got}.")
    return value


def parse_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise UserError("invalid_messages", "'messages' must be a non-empty list of {role, content} objects.")
    if len(messages) > MAX_MESSAGES:
        raise UserError("context_length_exceeded", f"At most {MAX_MESSAGES} messages; send fewer.")
    out = []
    for i, m in enumerate(messages):
        role = ROLE_ALIASES.get(m.get("role"), m.get("role")) if isinstance(m, dict) else None
        if role not in ROLES:
            raise UserError("invalid_messages", f"messages[{i}] needs a role of {', '.join(ROLES)}.")
        content = m.get("content")
        if isinstance(content, list):   # the content-parts form: only text parts are understood
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise UserError("invalid_messages", f"messages[{i}]: only text content parts are supported.")
            content = "".join(p["text"] for p in content)
        if not isinstance(content, str):
            raise UserError("invalid_messages", f"messages[{i}].content must be a string.")
        content = clean_text(content)   # the same hygiene as the chat: control characters dropped
        if role == "user" and not content.strip():
            raise UserError("empty_message", f"messages[{i}] is an empty user message; send some text.")
        out.append({"role": role, "content": content})
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
    if isinstance(stop, list) and all(isinstance(s, str) for s in stop):
        stop = [clean_text(s) for s in stop]
    if not isinstance(stop, list) or len(stop) > 4 or \
            not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop):
        raise UserError("invalid_value", f"'stop' must be a string or a list of at most 4 non-empty strings of at "
                                         f"most {MAX_STOP_CHARS} characters.")
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
    with queue.intake():   # taking the request in; its answer streams outside the gate
        taken = take_request()
    if not isinstance(taken, Taken):
        return taken   # the error response
    job, events, model, stream, options = taken
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


class Taken(NamedTuple):
    job: dict
    events: Iterator[dict]
    model: str
    stream: bool
    options: dict


def take_request():
    """Check, store and queue a completion request; its Taken, or the error response."""
    try:
        # Counted before the body is read, so floods of malformed requests are throttled too.
        limits.limit_message(api_session(), keyring.rate_limit())
        body = read_json()
        check_fields(body)
        messages, params = parse_messages(body), parse_params(body)
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise UserError("invalid_value", "'stream' must be true or false.")
        options = body.get("stream_options") or {}
        if not isinstance(options, dict) or not isinstance(options.get("include_usage", False), bool):
            raise UserError("invalid_value", "'stream_options' must be an object like {\"include_usage\": true}.")
        model = body.get("model")
        if model is not None and (not isinstance(model, str) or len(model) > MAX_MODEL_CHARS):
            raise UserError("invalid_value", f"'model' must be a string of at most {MAX_MODEL_CHARS} characters.")
        model = model or served_models()[0]
        queue.check_room()
        job = queue.new_job(messages, params, source="api", channel=True, api_key=keyring.current_name())
        with current_app.extensions["db"]() as db:
            db.add(queue.record_for(job))
            db.commit()
        events = subscribe(job)   # before sending: no event can slip past
        queue.send(job)
    except UserError as exc:
        return error_response(exc)
    return Taken(job, events, model, stream, options)


def subscribe(job: dict) -> Iterator[dict]:
    # Survives a Redis restart: see queue.subscribe.
    return queue.subscribe(job, SILENCE_LIMIT_S)


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
