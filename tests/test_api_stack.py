"""The OpenAI-compatible API through the real queue and worker, driven by the official `openai` client."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

import openai
import pytest
import redis
import requests

from messaging.contract import INLINE_FINAL_BYTES, STREAM_CHANNEL, final_key, job_key
from messaging.generation import MAX_STOP_CHARS, Generation
from messaging.generation import VERSION as GENERATION_VERSION
from messaging.stream import decode_batch

from models import RequestRecord
from tests.clients import ChatClient
from tests.stack import wait_for
from worker.engine import EngineConfig, LLMEngine, RequestFinished, SamplingParams
from worker.model_loader import load_model
from worker.settings import weights_setting

MESSAGES = [{"role": "system", "content": "You answer questions about orders."},
            {"role": "user", "content": "Can I change the delivery address of order 1234?"}]


@pytest.fixture()
def client(stack):
    return openai.OpenAI(base_url=stack.web_urls[1] + "/v1", api_key="not-needed", max_retries=0, timeout=60)


def engine_direct(model_dir, messages: list[dict], max_tokens: int) -> str:
    model, tokenizer = load_model(str(model_dir), weights=weights_setting())   # the worker's precision
    engine = LLMEngine(model, tokenizer, EngineConfig(num_blocks=64))
    engine.add_request("direct", messages=messages, params=SamplingParams(temperature=0, max_new_tokens=max_tokens))
    while engine.has_unfinished():
        for event in engine.step():
            if isinstance(event, RequestFinished):
                return event.text
    raise AssertionError("no answer")


def test_greedy_completion_equals_the_engine_run_directly(client, tiny_model_dir, db):
    reply = client.chat.completions.create(model="any", messages=MESSAGES, temperature=0, max_tokens=20)
    text = reply.choices[0].message.content
    assert text and text == engine_direct(tiny_model_dir, MESSAGES, 20)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert reply.usage.completion_tokens > 0 and reply.usage.total_tokens > reply.usage.prompt_tokens
    with db() as s:
        record = s.get(RequestRecord, reply.id.removeprefix("chatcmpl-"))
        assert record.source == "api" and record.finish_reason == reply.choices[0].finish_reason


def test_streaming_sends_the_same_answer_in_pieces(client):
    plain = client.chat.completions.create(model="any", messages=MESSAGES, temperature=0, max_tokens=20)
    chunks = list(client.chat.completions.create(model="any", messages=MESSAGES, temperature=0, max_tokens=20,
                                                 stream=True))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert len(pieces) > 1
    assert "".join(pieces) == plain.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == plain.choices[0].finish_reason


def test_streaming_reports_usage_when_asked(client):
    plain = client.chat.completions.create(model="any", messages=MESSAGES, temperature=0, max_tokens=20)
    chunks = list(client.chat.completions.create(model="any", messages=MESSAGES, temperature=0, max_tokens=20,
                                                 stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == plain.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_a_streaming_client_that_goes_away_cancels_its_answer(stack, db):
    url = stack.web_with(MAX_NEW_TOKENS="2000")
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 2000, "stream": True}
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=60) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith(b"data: {"))
    request_id = json.loads(first[6:])["id"].removeprefix("chatcmpl-")
    # Closing the response dropped the connection; the web app notices at its next write and cancels.

    def cancelled() -> bool:
        with db() as s:
            return s.get(RequestRecord, request_id).finish_reason == "cancelled"

    wait_for(cancelled, 60, "the cancelled record")
    with db() as s:
        record = s.get(RequestRecord, request_id)
    assert record.completion_tokens < 2000


def test_models_lists_what_the_worker_serves(client, stack, tiny_model_dir):
    listed = client.models.list().data
    assert [m.id for m in listed] == [str(tiny_model_dir)]
    # vLLM's max_model_len: the context length the worker checks prompts against.
    counted = requests.post(stack.web_urls[0] + "/tokenize", json={"prompt": "hi"}, timeout=10).json()
    assert listed[0].model_extra["max_model_len"] == counted["max_model_len"] > 0
    # A name that is a path: the client asks for /v1/models//tmp/...
    assert client.models.retrieve(str(tiny_model_dir)).id == str(tiny_model_dir)
    with pytest.raises(openai.NotFoundError, match="GET /v1/models lists") as missing:
        client.models.retrieve("someone/other-model")
    assert missing.value.code == "model_not_found"


@pytest.mark.parametrize("body, code", [
    ({"messages": []}, "invalid_messages"),
    ({"messages": [{"role": "wizard", "content": "hi"}]}, "invalid_messages"),
    ({"messages": MESSAGES, "temperature": 5}, "invalid_value"),
    ({"messages": MESSAGES, "max_tokens": 0}, "invalid_value"),
    ({"messages": MESSAGES, "stop": ["a", "b", "c", "d", "e"]}, "invalid_value"),
    ({"messages": MESSAGES, "n": 9}, "invalid_value"),
    ({"messages": MESSAGES, "stream": True, "stream_options": {"include_usage": "yes"}}, "invalid_value"),
])
def test_bad_requests_get_openai_style_errors(stack, body, code):
    response = requests.post(stack.web_urls[0] + "/v1/chat/completions", json=body, timeout=10)
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error" and error["message"]


def test_a_body_that_is_not_json_is_refused(stack):
    response = requests.post(stack.web_urls[0] + "/v1/chat/completions", data="hello", timeout=10)
    assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"


def test_the_openai_client_raises_a_bad_request_error(client):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="any", messages=MESSAGES, temperature=-1)


class Heard(list):
    """Answer events heard on the stream, in order; `sizes`: each message's bytes."""

    sizes: list[int]


@contextmanager
def stream_heard(redis_url: str) -> Iterator[Heard]:
    """Every answer event the workers publish while the block runs, once it has ended."""
    listener = redis.Redis.from_url(redis_url).pubsub(ignore_subscribe_messages=True)
    listener.subscribe(STREAM_CHANNEL)
    heard: list[bytes] = []
    stop = threading.Event()

    def listen() -> None:
        # Past the block's end, until 0.2 s pass with nothing: the web may have read an answer's last event and
        # closed its response before this connection's copy of the same message was taken off the socket.
        while (message := listener.get_message(timeout=0.2)) is not None or not stop.is_set():
            if message is not None:
                heard.append(message["data"])

    events = Heard()
    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    try:
        yield events
    finally:
        stop.set()
        thread.join()
        listener.close()
        events += [e for raw in heard for e in decode_batch(raw)]
        events.sizes = [len(raw) for raw in heard]


def test_an_end_too_large_for_the_stream_is_read_where_the_worker_keeps_it(stack, client):
    """n=4 choices with 20 alternatives per token end in an event of about a megabyte. Broadcast, every web process
    would take it, and Redis drops a subscriber whose unread messages pass its pub/sub limit, with every stream
    on it: the stream carries a stub, and the process that waits reads the end from final_key, whole."""
    with stream_heard(stack.env["REDIS_URL"]) as heard:
        reply = client.chat.completions.create(model="any", messages=MESSAGES, temperature=1.0, seed=7, n=4,
                                               max_tokens=160, logprobs=True, top_logprobs=20)
    rid = reply.id.removeprefix("chatcmpl-")
    kept = redis.Redis.from_url(stack.env["REDIS_URL"]).get(final_key(rid))
    assert len(kept) > INLINE_FINAL_BYTES   # the case this test is about
    ends = [e for e in heard if e.data["request_id"] == rid and e.name == "done"]
    assert ends and all(e.data == {"request_id": rid, "stored": True} for e in ends)
    assert max(heard.sizes) < INLINE_FINAL_BYTES
    assert len(reply.choices) == 4 and reply.usage.completion_tokens == sum(len(c.logprobs.content)
                                                                            for c in reply.choices)
    for choice, kept_choice in zip(reply.choices, json.loads(kept)["choices"]):
        assert choice.message.content == kept_choice["text"]
        assert all(len(entry.top_logprobs) == 20 for entry in choice.logprobs.content)


def test_a_stop_string_the_web_accepts_is_one_the_worker_takes(client):
    """One limit for both tiers: a stop string of 150 characters (past the engine's former 64) is answered."""
    plain = client.chat.completions.create(model="any", messages=MESSAGES, temperature=0, max_tokens=20)
    reply = client.chat.completions.create(model="any", messages=MESSAGES, temperature=0, max_tokens=20,
                                           stop=["never written " * 10 + "at all"])
    assert reply.choices[0].message.content == plain.choices[0].message.content
    assert reply.choices[0].finish_reason == plain.choices[0].finish_reason


def test_a_stop_string_past_the_shared_limit_is_refused_before_the_queue(stack):
    response = requests.post(stack.web_urls[0] + "/v1/chat/completions", timeout=10,
                             json={"messages": MESSAGES, "stop": ["z" * (MAX_STOP_CHARS + 1)]})
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["param"] == "stop" and str(MAX_STOP_CHARS) in error["message"]


def test_jobs_go_on_the_queue_as_the_versioned_contract_with_their_class(stack, db):
    """The chat page's messages are queued as interactive, the API's as standard, in the wire form's version."""
    idle = stack.env["REDIS_URL"].rsplit("/", 1)[0] + "/7"   # a queue no worker reads: the jobs stay put
    url = stack.web_with(REDIS_URL=idle)
    r = redis.Redis.from_url(idle)
    chat = ChatClient(url)
    try:
        chat.sio.emit("chat_message", {"text": "Where is my parcel?", "max_new_tokens": 5})
        name, accepted = chat.next(30)
        assert name == "accepted", accepted
        with pytest.raises(requests.exceptions.ReadTimeout):   # no worker: no answer; the job is queued
            requests.post(url + "/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 7}, timeout=3)
        jobs = [json.loads(r.get(key)) for key in r.scan_iter(job_key("*"))]
    finally:
        chat.close()
        with db() as s:   # settled, so no reaper looks for them
            for job in jobs:
                record = s.get(RequestRecord, job["request_id"])
                record.finish_reason, record.finished_at = "cancelled", datetime.now(UTC)
            s.commit()
        r.flushdb()
    by_source = {job["source"]: Generation.from_wire(job["params"]) for job in jobs}
    assert all(job["params"]["v"] == GENERATION_VERSION for job in jobs)
    assert by_source["chat"].service_class == "interactive" and by_source["chat"].max_new_tokens == 5
    assert by_source["api"].service_class == "standard" and by_source["api"].max_new_tokens == 7
