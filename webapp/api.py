"""OpenAI-compatible HTTP API: /v1/chat/completions, /v1/completions and /v1/responses (plain or server-sent events),
/v1/models."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import NamedTuple

import redis
from flask import Blueprint, Flask, Response, current_app, request, stream_with_context
from werkzeug.exceptions import HTTPException, RequestEntityTooLarge

from messaging import jobs
from messaging.contract import MODEL_ENTRY_TTL_S, MODELS_KEY
from messaging.generation import Generation
from messaging.prompts import TemplateOptions

from . import (api_answers, api_batch, api_messages, api_params, api_responses, headers, keyring, limits, prompt_check,
               protocol, queue)
from .disconnect import CLIENT_CHECK_S, ClientGone, final_event
from .queue import UserError
from .security import clean_text

log = logging.getLogger(__name__)

bp = Blueprint("api", __name__, url_prefix="/v1")

ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}   # OpenAI's newer name for the system message
MAX_MESSAGES = 500
MAX_MODEL_CHARS = 256
MAX_PROMPT_TOKENS = 32_768
MAX_PROMPTS = 64          # /v1/completions' prompts per request
LEGACY_MAX_TOKENS = 16   # /v1/completions' default answer length, as OpenAI's


def error_response(exc: UserError):
    kind = "rate_limit_error" if exc.status == 429 else "invalid_request_error" if exc.status < 500 else "api_error"
    retry_after = getattr(exc, "retry_after", None)
    headers = {"Retry-After": str(retry_after)} if retry_after else {}
    return {"error": {"message": exc.message, "type": kind, "param": getattr(exc, "param", None), "code": exc.code}}, \
        exc.status, headers


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


def served() -> dict[str, int | None]:
    """The models the live workers serve, each with its context length (the shortest where workers differ; None
    from a worker that does not announce it): one hash read (MODELS_KEY), never a scan of Redis's keyspace."""
    now, out = time.time(), {}
    for raw in current_app.extensions["redis"].hvals(MODELS_KEY):
        entry = json.loads(raw)
        name = entry.get("model")
        if not name or now - float(entry.get("time", 0)) >= MODEL_ENTRY_TTL_S:
            continue
        length = entry.get("max_model_len")
        known = [n for n in (out.get(name), length) if isinstance(n, int)]
        out[name] = min(known) if known else None
    return dict(sorted(out.items())) or {"supportbot": None}


def served_models() -> list[str]:
    return list(served())


def model_entry(name: str, max_model_len: int | None) -> dict:
    """A model card, with vLLM's max_model_len (prompt and answer together) when the workers announce it."""
    entry: dict = {"id": name, "object": "model", "created": 0, "owned_by": "supportbot"}
    if max_model_len is not None:
        entry["max_model_len"] = max_model_len
    return entry


@bp.get("/models")
def models():
    return {"object": "list", "data": [model_entry(name, length) for name, length in served().items()]}


@bp.get("/models/<path:model>", merge_slashes=False)
@bp.get("/models//<path:model>", merge_slashes=False)
def model(model: str):
    """One served model (the openai client's `models.retrieve`). A name that is a path keeps its slashes, its
    leading one included (`/v1/models//srv/models/x`); names are compared without a leading slash."""
    for name, length in served().items():
        if name.strip("/") == model.strip("/"):
            return model_entry(name, length)
    shown = model if len(model) <= MAX_MODEL_CHARS else model[:MAX_MODEL_CHARS] + "..."
    return error_response(UserError("model_not_found", f"The model '{shown}' is not served here; GET /v1/models "
                                                       "lists the models this server serves.", param="model",
                                    status=404))


def parse_messages(body: dict) -> list[dict]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise UserError("invalid_messages", "'messages' must be a non-empty list of {role, content} objects.",
                        param="messages")
    if len(messages) > MAX_MESSAGES:
        raise UserError("context_length_exceeded", f"At most {MAX_MESSAGES} messages; send fewer.", param="messages")
    out = [parse_message(m, i) for i, m in enumerate(messages)]
    if sum(len(m["content"]) for m in out) > 16 * current_app.config["MAX_MESSAGE_CHARS"]:
        raise UserError("context_length_exceeded", "The messages are too long; send fewer or shorter messages.",
                        param="messages")
    if out[0]["role"] != "system":   # the shop's persona only when the client brings none
        out.insert(0, {"role": "system", "content": current_app.config["SYSTEM_PROMPT"]})
    return out


def parse_message(m, i: int) -> dict:
    def bad(what: str) -> UserError:
        return UserError("invalid_messages", f"messages[{i}]{what}", param=f"messages[{i}]")

    role = ROLE_ALIASES.get(m.get("role"), m.get("role")) if isinstance(m, dict) else None
    if role not in ROLES:
        raise bad(f" needs a role of {', '.join(ROLES)}.")
    content = m.get("content")
    if isinstance(content, list):   # the content-parts form: only text parts are understood
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise bad(": only text content parts are supported.")
        content = "".join(p["text"] for p in content)
    calls = m.get("tool_calls") if role == "assistant" else None
    if content is None and calls:
        content = ""
    if not isinstance(content, str):
        raise bad(".content must be a string.")
    content = clean_text(content)   # the same hygiene as the chat: control characters dropped
    if role == "user" and not content.strip():
        raise UserError("empty_message", f"messages[{i}] is an empty user message; send some text.",
                        param=f"messages[{i}]")
    out = {"role": role, "content": content}
    if calls:
        out["tool_calls"] = parse_calls(calls, bad)
    if role == "tool":
        call = m.get("tool_call_id")
        if call is not None and not isinstance(call, str):
            raise bad(".tool_call_id must be a string.")
        out["tool_call_id"] = call or ""
        if isinstance(m.get("name"), str):
            out["name"] = m["name"][:64]
    return out


def parse_calls(calls, bad) -> list[dict]:
    """An assistant message's earlier tool calls, as OpenAI writes them."""
    if not isinstance(calls, list):
        raise bad(".tool_calls must be a list of tool calls.")
    out = []
    for k, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments", ""), str) or not isinstance(call.get("id", ""), str):
            raise bad(f".tool_calls[{k}] must be {{\"id\": ..., \"type\": \"function\", \"function\": {{\"name\": "
                      "..., \"arguments\": \"<JSON text>\"}}}}.")
        arguments = clean_text(function.get("arguments", ""))
        out.append({"id": call.get("id") or "", "type": "function",
                    "function": {"name": function["name"][:64], "arguments": arguments}})
    return out


def parse_prompts(body: dict) -> list[str | list[int]]:
    """A completion's prompts: text, token ids, or a list of either (one job each, at most MAX_PROMPTS)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        if len(prompt) > MAX_PROMPTS:
            raise UserError("invalid_prompt", f"'prompt' holds {len(prompt)} prompts; send at most {MAX_PROMPTS} per "
                                              "request.", param="prompt")
        return [parse_prompt(p, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [parse_prompt(prompt, "prompt")]


def parse_prompt(prompt, name: str) -> str | list[int]:
    """One prompt: text or token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise UserError("invalid_prompt", f"'{name}' is empty; send some text.", param="prompt")
        if len(prompt) > 16 * current_app.config["MAX_MESSAGE_CHARS"]:
            raise UserError("context_length_exceeded", f"'{name}' is too long; send a shorter one.", param="prompt")
        return clean_text(prompt)
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**31
                                                   for t in prompt):
        if len(prompt) > MAX_PROMPT_TOKENS:
            raise UserError("context_length_exceeded", f"'{name}' has too many tokens; send fewer.", param="prompt")
        return prompt
    raise UserError("invalid_prompt", "'prompt' must be a string, a list of token ids, or a list of either (one "
                                      f"choice or n for each); '{name}' is neither.", param="prompt")


@bp.post("/chat/completions")
def chat_completions():
    return answer(protocol.ChatCompletionRequest, read_chat, api_answers.chat_completion, api_answers.chat_stream)


@bp.post("/responses")
def responses():
    return answer(protocol.ResponsesRequest, read_responses, api_responses.response, api_responses.response_stream)


@bp.post("/messages")
def messages():
    return answer(protocol.MessagesRequest, read_messages, api_messages.answer, api_messages.answer_stream)


@bp.route("/responses/<path:response_id>", methods=["GET", "POST", "DELETE"])
def kept_response(response_id: str):
    """OpenAI's stored-response calls (retrieve, delete, cancel, input_items): nothing is kept here for them."""
    return error_response(UserError("not_found", "This server keeps no responses, so none can be retrieved, "
                                                 "deleted or cancelled; keep the answer you were sent, and send the "
                                                 "whole conversation in 'input'.", param="response_id", status=404))


@bp.post("/completions")
def completions():
    return answer(protocol.CompletionRequest, read_completion, api_answers.completion,
                  api_answers.completion_stream)


def answer(schema: type[protocol.CommonRequest], read, whole, stream):
    """Take a request in (its body checked against `schema`, then turned into a Request by `read`), then its
    answer whole or streamed."""
    with queue.intake():   # taking the request in; its answer streams outside the gate
        taken = take_request(schema, read)
    if not isinstance(taken, Taken):
        return taken   # the error response
    job, events, shape, streaming, batch = taken
    if batch is not None:
        return answer_batch(batch, shape, streaming)
    if streaming:
        return Response(stream_with_context(stream(job, events, shape)), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        final = final_event(events)
    except ClientGone:   # nobody will read the answer: free its slot at the engine's next step
        return cancelled([job])
    if final is None or final["event"] == "error":
        retryable = final is None or final["retryable"]
        return error_response(UserError(final["code"] if final else "timeout",
                                        final["message"] if final else "The answer did not arrive; retry.",
                                        retryable=retryable, status=503 if retryable else 400,
                                        retry_after=queue.OUTAGE_RETRY_S if retryable else None))
    return whole(job, shape, final)


def cancelled(jobs_: list[dict]):
    """The client of a whole answer went away: its jobs are cancelled (their slots freed at the engine's next step)."""
    for job in jobs_:
        queue.cancel(job["request_id"])
    return error_response(UserError("client_closed", "The client closed the connection; the request was cancelled.",
                                    status=499))


def answer_batch(parts: list[api_batch.Part], shape: api_answers.Shape, streaming: bool):
    """A completion of several prompts, whole or streamed (webapp/api_batch.py)."""
    n = (parts[0][0].get("params") or {}).get("n", 1)
    if streaming:
        return Response(stream_with_context(api_batch.stream(parts, shape, n)), mimetype="text/event-stream",
                        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    try:
        done = api_batch.finals(parts)
    except ClientGone:
        return cancelled([job for job, _ in parts])
    failed = next((final for final in done if final is None or final["event"] == "error"), False)
    if failed is not False:
        for job, _ in parts:
            queue.cancel(job["request_id"])
        return error_response(UserError(failed["code"] if failed else "timeout",
                                        failed["message"] if failed else "The answer did not arrive; retry.",
                                        retryable=True, status=400 if failed and not failed["retryable"] else 503))
    return api_batch.completion(parts, shape, done, n)


class Request(NamedTuple):
    """A request's body read into what its job carries."""

    messages: list[dict]
    generation: Generation
    extra: dict          # the job's API fields (messaging/jobs.py)
    shape: api_answers.Shape
    more_prompts: list = []   # /v1/completions: the prompts after the first, a job each


class Taken(NamedTuple):
    job: dict
    events: Iterator[dict]
    shape: api_answers.Shape
    stream: bool
    batch: list[api_batch.Part] | None = None   # several prompts: each one's job and events, the first's first


def read_chat(body: dict, model: str, include_usage: bool) -> Request:
    messages = parse_messages(body)
    logprobs = api_params.chat_logprobs(body)
    generation = api_params.sampling(body, current_app.config["MAX_NEW_TOKENS"], logprobs=logprobs)
    extra: dict = {**api_params.token_names(body), **api_params.token_ids(body)}
    use = api_params.tool_use(body)
    structure = api_params.response_format(body)
    guided = api_params.structured_outputs(body)
    if structure is not None and guided is not None:
        raise UserError("invalid_value", "'response_format' and vLLM's structured outputs cannot be used together; "
                                         "send one of them.", param="response_format")
    structure = structure or guided
    if structure is not None and use.forces:
        raise UserError("invalid_value", "'response_format' (or structured outputs) and a 'tool_choice' that forces "
                                         "a call cannot be used together; send one of them.", param="response_format")
    if structure is None:   # with a response_format, the answer is its JSON and "auto" calls cannot be written
        structure = use.structure
    if use.offered:
        extra[jobs.TOOLS] = [tool.to_openai() for tool in use.tools]
    options = api_params.template_options(body, messages)
    if options is not None:
        extra[jobs.TEMPLATE] = options.to_json()
    if structure is not None:
        extra[jobs.STRUCTURE] = structure.to_json()
    shape = api_answers.Shape(model, tools=use.offered, forced=use.forces,
                              named=use.choice == "function",
                              logprobs=logprobs is not None, include_usage=include_usage,
                              token_ids=bool(body.get("return_token_ids")))
    return Request(messages, generation, extra, shape)


def read_responses(body: dict, model: str, include_usage: bool) -> Request:
    """A Responses API request read as the chat completion it asks for (webapp/api_responses.py)."""
    try:
        request = read_chat(api_responses.chat_body(body), model, include_usage)
    except UserError as exc:
        raise api_params.renamed(exc, api_responses.RENAMED) from None
    return request._replace(shape=replace(request.shape, response=api_responses.echoed(body)))


def read_messages(body: dict, model: str, include_usage: bool) -> Request:
    """An Anthropic Messages API request read as the chat completion it asks for (webapp/api_messages.py)."""
    try:
        return read_chat(api_messages.chat_body(body, current_app.config["MAX_NEW_TOKENS"]), model, include_usage)
    except UserError as exc:
        raise api_params.renamed(exc, api_messages.RENAMED) from None


def read_completion(body: dict, model: str, include_usage: bool) -> Request:
    prompts = parse_prompts(body)
    echo = body.get("echo", False)
    if not isinstance(echo, bool):
        raise api_params.invalid("echo", "'echo' must be true or false.")
    logprobs = api_params.legacy_logprobs(body)
    # No answer at all (max_tokens 0) only scores the prompt, which the client sees through echo.
    generation = api_params.sampling(body, LEGACY_MAX_TOKENS, min_max_tokens=0 if echo else 1, logprobs=logprobs,
                                     score_prompt=echo)
    extra = {jobs.PROMPT: prompts[0], **({jobs.ECHO: True} if echo else {}), **api_params.token_names(body),
             **api_params.token_ids(body)}
    structure = api_params.structured_outputs(body)
    if structure is not None:
        extra[jobs.STRUCTURE] = structure.to_json()
    shape = api_answers.Shape(model, logprobs=logprobs is not None, echo=echo, include_usage=include_usage,
                              token_ids=bool(body.get("return_token_ids")))
    return Request([], generation, extra, shape, prompts[1:])


def check_prompt(request: Request) -> None:
    """The prompt as a worker will build it, checked before it is queued: UserError when the model's chat template
    refuses the messages or the prompt leaves no room for an answer (webapp/prompt_check.py)."""
    client, least = current_app.extensions["redis"], request.generation.min_tokens
    try:
        if request.messages:
            prompt_check.check_chat(client, request.messages, request.extra.get(jobs.TOOLS), least,
                                    TemplateOptions.from_json(request.extra.get(jobs.TEMPLATE)))
        else:
            prompt_check.check_completion(client, [request.extra[jobs.PROMPT], *request.more_prompts], least)
    except redis.RedisError as exc:   # queueing reports Redis's absence; the worker checks the prompt itself
        log.warning("prompt not checked before queueing: %s", exc)


def take_request(schema: type[protocol.CommonRequest], read) -> Taken | tuple:
    """Check, store and queue a completion request; its Taken, or the error response."""
    try:
        # Counted before the body is read, so floods of malformed requests are throttled too.
        limits.limit_message(api_session(), keyring.rate_limit())
        body = read_json()
        typed = protocol.read(schema, body)
        stream = bool(typed.stream)
        options = getattr(typed, "stream_options", None)   # Anthropic's Messages API has none
        include_usage = options is not None and options.include_usage
        model = typed.model
        if model is not None and len(model) > MAX_MODEL_CHARS:
            raise api_params.invalid("model", f"'model' must be a string of at most {MAX_MODEL_CHARS} characters.")
        request = read(body, model or served_models()[0], include_usage)
        check_prompt(request)
        # Anthropic's service_tier values (auto, standard_only) are not OpenAI's: such a request takes its key's class.
        tier = body.get("service_tier") if schema is not protocol.MessagesRequest else None
        service_class = queue.served_class(keyring.service_class(tier))
        queue.check_room(service_class)
        generation = replace(request.generation, service_class=service_class)
        extra = {**request.extra, jobs.HTTP_REQUEST_ID: headers.request_id()}
        batch = [queue.new_job(request.messages, generation, source="api", channel=True,
                               api_key=keyring.current_name(), extra={**extra, **prompt})
                 for prompt in [{}] + [{jobs.PROMPT: p} for p in request.more_prompts]]
        job = batch[0]
        records = [queue.record_for(one) for one in batch]
        for record in records:
            record.http_request_id = extra[jobs.HTTP_REQUEST_ID]
        with current_app.extensions["db"]() as db:
            db.add_all(records)
            db.commit()
        if unused := {name: body[name] for name in protocol.NO_EFFECT if body.get(name) is not None}:
            log.info("request %s: taken without effect on the answer: %s", job["request_id"],
                     json.dumps(unused, ensure_ascii=False)[:500])
        log.info("request %s accepted as %s", records[0].http_request_id,
                 ", ".join(one["request_id"] for one in batch))
        parts = [(one, subscribe(one, stream)) for one in batch]   # before sending: no event can slip past
        for one in batch:
            queue.send(one)
    except UserError as exc:
        return error_response(exc)
    return Taken(job, parts[0][1], request.shape, stream, parts if len(parts) > 1 else None)


def subscribe(job: dict, streaming: bool) -> Iterator[dict]:
    """The job's events (they survive a Redis restart: see queue.subscribe). While none comes, a stream hears of it
    every API_KEEPALIVE_S (for its keep-alive comments), a client waiting for the whole answer every second."""
    cfg = current_app.config
    return queue.subscribe(job, queue.Waits(answer_s=cfg["API_ANSWER_TIMEOUT_S"], queue_s=cfg["API_QUEUE_TIMEOUT_S"],
                                            tick_s=cfg["API_KEEPALIVE_S"] if streaming else CLIENT_CHECK_S))
