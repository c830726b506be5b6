"""Prompts the model cannot take, refused by the web app before they are queued (through a stack of these tests' own,
whose worker serves a template that checks the order of roles): a template's refusal is a 400 naming it, a prompt
that leaves no room for an answer is OpenAI's context_length_exceeded, and one just under the limit is answered."""

from __future__ import annotations

import json
import time
import uuid

import pytest
import redis
import requests

from messaging.contract import GENERATE_TASK, MODELS_KEY, QUEUE, QUEUES, events_channel, final_key
from messaging.generation import Generation
from messaging.prompt_form import FORM_FIELD, PromptForm, form_key, tokenizer_key
from models import RequestRecord
from messaging.queue import make_celery
from models.db import make_engine, make_session_factory
from structured import Tool
from tests.stack import private_stack, wait_for
from tests.test_prompts import ALTERNATE, CRASH, LOOKUP, ROLE_CHECK
from tests.tiny_model import make_tiny_model_dir
from worker.model_loader import load_tokenizer
from worker.prompts import render, text_ids

CONTEXT = 512   # the tiny model's
SYSTEM = {"role": "system", "content": "You answer questions about orders."}
WRONG_ORDER = [SYSTEM, {"role": "user", "content": "Where is order 1234?"}, {"role": "user", "content": "Hello?"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    """The tiny model with a template that raises when roles do not alternate, as Mistral's and Llama 2's do, and
    fails (a TypeError) on a message that says "crash"."""
    own = tokenizer.chat_template
    tokenizer.chat_template = ROLE_CHECK + CRASH + own
    try:
        return make_tiny_model_dir(tmp_path_factory.mktemp("role-check"), tokenizer)
    finally:
        tokenizer.chat_template = own


@pytest.fixture(scope="module")
def own_stack(tmp_path_factory, model_dir):
    with private_stack(tmp_path_factory.mktemp("prompts"), model_dir) as s:
        yield s


@pytest.fixture(scope="module")
def records(own_stack):
    sessions = make_session_factory(make_engine(own_stack.env["DATABASE_URL"]))

    def of(request_id: str) -> list[RequestRecord]:
        with sessions() as db:
            return db.query(RequestRecord).filter_by(http_request_id=request_id).all()
    return of


@pytest.fixture(scope="module")
def served(model_dir):
    """The worker's tokenizer, to count prompts as it renders them."""
    return load_tokenizer(str(model_dir))


def post(url: str, path: str, body: dict) -> tuple[requests.Response, str]:
    request_id = f"prompt-check-{uuid.uuid4().hex}"
    return requests.post(url + path, json=body, headers={"X-Request-Id": request_id}, timeout=60), request_id


def sized(tokenizer, tokens: int, tools: list[dict] | None = None) -> list[dict]:
    """A system and a user message whose prompt is exactly `tokens` long as the worker renders it."""
    def messages(words: int) -> list[dict]:
        return [SYSTEM, {"role": "user", "content": " ".join(["order"] * words)}]

    start = tokens - len(render(tokenizer, messages(1), tools))   # about one token a word
    for words in sorted(range(max(1, start - 8), start + 9), key=lambda w: abs(w - start)):
        if len(render(tokenizer, messages(words), tools)) == tokens:
            return messages(words)
    raise AssertionError(f"no message renders to {tokens} tokens")


def refused_before_the_queue(response: requests.Response, request_id: str, records, code: str) -> dict:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error", error
    assert records(request_id) == [], "the request was stored and queued"
    return error


def queued(stack) -> int:
    r = redis.Redis.from_url(stack.env["REDIS_URL"])
    return sum(r.llen(name) for name in QUEUES)


def test_a_template_that_raises_is_a_400_naming_its_complaint_before_the_queue(own_stack, records):
    url = own_stack.web_urls[0]
    response, request_id = post(url, "/v1/chat/completions", {"messages": WRONG_ORDER, "max_tokens": 4})
    error = refused_before_the_queue(response, request_id, records, "invalid_messages")
    assert ALTERNATE in error["message"] and "Change the messages" in error["message"], error
    assert error["param"] == "messages" and queued(own_stack) == 0
    response, _ = post(url, "/v1/chat/completions", {"messages": WRONG_ORDER[:2], "max_tokens": 4})
    assert response.status_code == 200, response.text


def test_a_chat_prompt_without_room_for_an_answer_is_context_length_exceeded(own_stack, records, served):
    url = own_stack.web_urls[0]
    tools = [Tool.from_openai(LOOKUP).to_openai()]   # as the job carries them
    for offered in (None, tools):
        extra = {"tools": offered} if offered else {}
        full = sized(served, CONTEXT, offered)
        response, request_id = post(url, "/v1/chat/completions", {"messages": full, "max_tokens": 1, **extra})
        error = refused_before_the_queue(response, request_id, records, "context_length_exceeded")
        assert error["message"].startswith(f"This model's maximum context length is {CONTEXT} tokens. However, "
                                           f"your messages resulted in {CONTEXT} tokens"), error
        just_under = sized(served, CONTEXT - 1, offered)
        response, _ = post(url, "/v1/chat/completions", {"messages": just_under, "max_tokens": 1, **extra})
        assert response.status_code == 200, response.text
        assert response.json()["usage"]["prompt_tokens"] == CONTEXT - 1, "the web and the worker count alike"
    short = sized(served, CONTEXT - 3)
    response, request_id = post(url, "/v1/chat/completions", {"messages": short, "max_tokens": 4, "min_tokens": 4})
    error = refused_before_the_queue(response, request_id, records, "context_length_exceeded")
    assert "'min_tokens'" in error["message"], error


def test_a_completion_prompt_without_room_for_an_answer_is_context_length_exceeded(own_stack, records, served):
    url = own_stack.web_urls[0]
    response, request_id = post(url, "/v1/completions", {"prompt": [7] * CONTEXT, "max_tokens": 1})
    error = refused_before_the_queue(response, request_id, records, "context_length_exceeded")
    assert f"your prompt resulted in {CONTEXT} tokens" in error["message"] and error["param"] == "prompt", error
    text = "order " * 600
    response, request_id = post(url, "/v1/completions", {"prompt": ["Hello", text], "max_tokens": 1})
    error = refused_before_the_queue(response, request_id, records, "context_length_exceeded")
    assert f"your prompt resulted in {len(text_ids(served, text))} tokens" in error["message"], error
    response, _ = post(url, "/v1/completions", {"prompt": [7] * (CONTEXT - 1), "max_tokens": 1})
    assert response.status_code == 200, response.text
    assert response.json()["usage"]["prompt_tokens"] == CONTEXT - 1


def test_without_a_form_it_can_load_the_web_leaves_the_check_to_the_worker_whose_refusal_is_final(own_stack,
                                                                                                 records):
    r = redis.Redis.from_url(own_stack.env["REDIS_URL"])
    digest = next(json.loads(raw)[FORM_FIELD] for raw in r.hvals(MODELS_KEY))
    tokenizer = tokenizer_key(PromptForm.from_json(r.get(form_key(digest))).tokenizer)
    r.set(tokenizer, "not a tokenizer")
    url = own_stack.start_web()   # a web process that has not loaded the form yet
    try:
        response, request_id = post(url, "/v1/chat/completions", {"messages": WRONG_ORDER, "max_tokens": 4})
        assert response.status_code == 400, response.text   # not a 503 after the request was sent three times
        error = response.json()["error"]
        # the web's own check would have said the same: a template's refusal is invalid_messages either way
        assert error["code"] == "invalid_messages" and ALTERNATE in error["message"], error
        assert [rec.finish_reason for rec in records(request_id)] == ["error"], "the worker answered it, once"
        response, request_id = post(url, "/v1/completions", {"prompt": [7] * CONTEXT, "max_tokens": 1})
        assert response.status_code == 400 and response.json()["error"]["code"] == "context_length_exceeded"
        assert len(records(request_id)) == 1
        port = url.rsplit(":", 1)[1]
        assert "checked by the worker alone" in (own_stack.workdir / f"web{port}.log").read_text()
    finally:
        r.delete(tokenizer)   # the worker puts it back at its next heartbeat
        own_stack.kill_web(url)


def test_a_template_that_fails_on_the_messages_is_a_400_saying_so(own_stack, records):
    response, request_id = post(own_stack.web_urls[0], "/v1/chat/completions",
                                {"messages": [{"role": "user", "content": "crash"}], "max_tokens": 4})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["code"] == "invalid_messages" and "chat template failed" in error["message"], error
    assert [rec.finish_reason for rec in records(request_id)] == ["error"], "the worker answered it, once"


def test_a_job_the_worker_fails_on_ends_with_an_internal_error_and_its_record(own_stack):
    """A fault of the worker's own (here a job without its messages, as a foreign producer might queue it) is told
    to the client as a retryable internal_error and recorded, not dropped with the task."""
    env = own_stack.env
    r = redis.Redis.from_url(env["REDIS_URL"])
    request_id = uuid.uuid4().hex
    job = {"request_id": request_id, "conversation_id": None, "room": None, "channel": events_channel(request_id),
           "source": "api", "enqueued_at": time.time(), "params": Generation(max_new_tokens=4).to_wire()}
    make_celery(env["REDIS_URL"]).send_task(GENERATE_TASK, args=[job], task_id=request_id, queue=QUEUE)
    wait_for(lambda: r.exists(final_key(request_id)), timeout=60, what="the job's final event")
    event = json.loads(r.get(final_key(request_id)))
    assert event["event"] == "error" and event["code"] == "internal_error" and event["retryable"], event
    assert "KeyError" in event["message"] and "tell the server's operator" in event["message"], event
    with make_session_factory(make_engine(env["DATABASE_URL"]))() as db:
        record = db.get(RequestRecord, request_id)
        assert record is not None and record.finish_reason == "error" and "KeyError" in record.error
    response, _ = post(own_stack.web_urls[0], "/v1/chat/completions",
                       {"messages": [{"role": "user", "content": "Hello"}], "max_tokens": 2})
    assert response.status_code == 200, "the worker goes on serving"
