"""The API's edges through the real stack: clients that leave, workers that go silent, time spent in the queue."""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from urllib.parse import urlsplit

import redis
import requests
from sqlalchemy import select

import pytest

from messaging.contract import job_key, streamed_key
from models import RequestRecord
from models.db import make_engine, make_session_factory
from tests.stack import private_stack, wait_for

MESSAGES = [{"role": "system", "content": "You answer questions about orders."},
            {"role": "user", "content": "Can I change the delivery address of order 1234?"}]


@pytest.fixture(scope="module")
def own_stack(tmp_path_factory, tiny_model_dir):
    """A stack of these tests' own, whose worker they pause: the session's stack never sees a paused worker."""
    with private_stack(tmp_path_factory.mktemp("edges"), tiny_model_dir, webs=0) as s:
        yield s


@pytest.fixture(scope="module")
def own_db(own_stack):
    return make_session_factory(make_engine(own_stack.env["DATABASE_URL"]))


@contextmanager
def worker_paused(stack) -> Iterator[None]:
    """SIGSTOP the worker, as a hung process or a stalled GPU would stop it, and let it go on afterwards. Kept
    shorter than VISIBILITY_TIMEOUT (6 s in tests), so its leases stand."""
    os.kill(stack.worker.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(stack.worker.pid, signal.SIGCONT)


def newest_api_record(db, since: datetime) -> RequestRecord | None:
    with db() as s:
        return s.scalars(select(RequestRecord).where(RequestRecord.source == "api", RequestRecord.enqueued_at >= since)
                         .order_by(RequestRecord.enqueued_at.desc())).first()


def api_records(db, since: datetime) -> list[RequestRecord]:
    with db() as s:
        return list(s.scalars(select(RequestRecord).where(RequestRecord.source == "api",
                                                          RequestRecord.enqueued_at >= since)))


def leave_once_under_way(stack, path: str, body: dict, db, jobs: int = 1) -> list[str]:
    """Ask for a whole answer over a raw socket, then close it the moment the answer is under way; the request ids
    of its jobs. On an idle machine the tiny model writes its whole context in under a second: the worker is held
    still from the moment the answer is under way until the client has gone, so the answer cannot end first."""
    url = urlsplit(stack.web_with(MAX_NEW_TOKENS="2000"))
    raw = json.dumps(body).encode()
    since = datetime.now(UTC).replace(microsecond=0)
    r = redis.Redis.from_url(stack.env["REDIS_URL"])
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % (path.encode(), len(raw)) + raw)
        wait_for(lambda: len(api_records(db, since)) == jobs, 30, "the request's records")
        request_ids = sorted(record.request_id for record in api_records(db, since))
        deadline = time.monotonic() + 60
        while not any(int(r.get(streamed_key(one)) or 0) for one in request_ids):
            assert time.monotonic() < deadline, "the answer never got under way"
            time.sleep(0.002)
        with worker_paused(stack):
            sock.close()
            time.sleep(2.5)   # the web process checks its client's socket every second
    return request_ids


def wait_cancelled(db, request_ids: list[str]) -> None:
    def cancelled() -> bool:
        with db() as s:
            return all(s.get(RequestRecord, one).finish_reason == "cancelled" for one in request_ids)

    wait_for(cancelled, 60, "the cancelled records")
    with db() as s:
        assert all(s.get(RequestRecord, one).completion_tokens < 2000 for one in request_ids)


def test_a_client_that_stops_waiting_for_a_whole_answer_cancels_it(own_stack, own_db):
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 2000}
    wait_cancelled(own_db, leave_once_under_way(own_stack, "/v1/chat/completions", body, own_db))


def test_a_client_that_stops_waiting_for_a_batch_of_prompts_cancels_every_one(own_stack, own_db):
    body = {"prompt": ["Order 1234 was", "Order 5678 was"], "temperature": 0, "max_tokens": 2000}
    request_ids = leave_once_under_way(own_stack, "/v1/completions", body, own_db, jobs=2)
    assert len(request_ids) == 2
    wait_cancelled(own_db, request_ids)


def test_auto_tool_choice_sends_the_offered_calls_grammar_with_the_job(own_stack, own_db):
    """tool_choice "auto": the job carries a lazy grammar of the offered tools' calls, which the engine applies
    once the model opens a call; parallel_tool_calls false allows one call."""
    stack, db = own_stack, own_db
    url = stack.web_with()
    lookup = {"type": "function", "function": {"name": "lookup_order", "parameters": {
        "type": "object", "properties": {"order_id": {"type": "integer"}}, "required": ["order_id"]}}}
    escalate = {"type": "function", "function": {"name": "escalate"}}
    r = redis.Redis.from_url(stack.env["REDIS_URL"])
    seen = {record.request_id for record in api_records(db, datetime.now(UTC).replace(microsecond=0))}
    for parallel in (False, True):
        since = datetime.now(UTC).replace(microsecond=0)
        result: dict = {}
        body = {"messages": MESSAGES, "max_tokens": 4, "tools": [lookup, escalate], "parallel_tool_calls": parallel}

        def ask() -> None:
            result["response"] = requests.post(url + "/v1/chat/completions", json=body, timeout=60)

        with worker_paused(stack):   # the job is read while it waits in the queue
            thread = threading.Thread(target=ask)
            thread.start()
            # this request's record: another of the same second may be there already
            wait_for(lambda: {rec.request_id for rec in api_records(db, since)} - seen, 5, "the request's record")
            [request_id] = {rec.request_id for rec in api_records(db, since)} - seen
            seen.add(request_id)
            wait_for(lambda: r.exists(job_key(request_id)), 5, "the queued job (stored once its record is)")
            job = json.loads(r.get(job_key(request_id)))
        thread.join(60)
        assert result["response"].status_code == 200
        structure = job["structure"]
        assert structure["lazy"] is True and structure["repeat"] is parallel
        assert structure["begin"] == "<tool_call>\n" and structure["end"] == "\n</tool_call>"
        assert [one["properties"]["name"]["const"] for one in structure["schema"]["anyOf"]] == \
            ["lookup_order", "escalate"]


def test_a_silent_stream_keeps_alive_then_ends_with_an_error_and_its_answer_is_cancelled(own_stack, own_db):
    stack, db = own_stack, own_db
    url = stack.web_with(MAX_NEW_TOKENS="2000", API_ANSWER_TIMEOUT_S="3", API_KEEPALIVE_S="0.5")
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 2000, "stream": True}
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=60) as response:
        lines = response.iter_lines()
        # The answer's first text: the worker has started it (the role chunk before it is the web's own).
        first = next(line for line in lines if line.startswith(b"data: {") and json.loads(line[6:])["choices"][0]
                     ["delta"].get("content"))
        with worker_paused(stack):
            rest = [line for line in lines if line]
    request_id = json.loads(first[6:])["id"].removeprefix("chatcmpl-")
    assert b": keep-alive" in rest
    assert rest[-1] == b"data: [DONE]"
    error = json.loads(rest[-2][6:])["error"]
    assert error["code"] == "timeout" and "send the request again" in error["message"]

    def cancelled() -> bool:
        with db() as s:
            return s.get(RequestRecord, request_id).finish_reason == "cancelled"

    wait_for(cancelled, 60, "the cancelled record")   # a client's retry will not find it still running


def test_a_silent_responses_stream_keeps_alive_then_ends_with_an_error_event(own_stack, own_db):
    """The Responses API's stream over the same waits: keep-alive comments, then a typed `error` event (no [DONE],
    which that API does not send), and the answer is cancelled."""
    stack, db = own_stack, own_db
    url = stack.web_with(MAX_NEW_TOKENS="2000", API_ANSWER_TIMEOUT_S="3", API_KEEPALIVE_S="0.5")
    body = {"input": MESSAGES[1]["content"], "instructions": MESSAGES[0]["content"], "temperature": 0,
            "max_output_tokens": 2000, "stream": True}
    with requests.post(url + "/v1/responses", json=body, stream=True, timeout=60) as response:
        lines = response.iter_lines()
        created = json.loads(next(line for line in lines if line.startswith(b"data: "))[6:])
        assert created["type"] == "response.created"
        next(line for line in lines if line == b"event: response.output_text.delta")   # the worker has started
        with worker_paused(stack):
            rest = [line for line in lines if line]
    assert b": keep-alive" in rest and b"data: [DONE]" not in rest
    assert rest[-2] == b"event: error"
    error = json.loads(rest[-1][6:])
    assert error["type"] == "error" and error["code"] == "timeout" and "send the request again" in error["message"]
    request_id = created["response"]["id"].removeprefix("resp_")

    def cancelled() -> bool:
        with db() as s:
            return s.get(RequestRecord, request_id).finish_reason == "cancelled"

    wait_for(cancelled, 60, "the cancelled record")


def test_time_in_the_queue_does_not_count_against_the_answer_timeout(own_stack):
    stack = own_stack
    url = stack.web_with(API_ANSWER_TIMEOUT_S="3")
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 8}
    result: dict = {}

    def ask() -> None:
        result["response"] = requests.post(url + "/v1/chat/completions", json=body, timeout=60)

    with worker_paused(stack):   # no worker takes the request for longer than the answer timeout
        thread = threading.Thread(target=ask)
        thread.start()
        time.sleep(4.5)
    thread.join(60)
    response = result["response"]
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"]


def test_every_response_carries_a_request_id_the_clients_own_when_it_sent_one(stack, db):
    base = stack.web_urls[0]
    made = requests.get(base + "/healthz", timeout=10).headers["x-request-id"]
    assert made.startswith("req_") and made != requests.get(base + "/healthz", timeout=10).headers["x-request-id"]
    refused = requests.post(base + "/v1/chat/completions", json={"messages": []}, timeout=10,
                            headers={"X-Request-Id": "client-refused-1"})
    assert refused.status_code == 400 and refused.headers["x-request-id"] == "client-refused-1"
    unusable = requests.get(base + "/healthz", headers={"X-Request-Id": "has spaces\tand tabs"}, timeout=10)
    assert unusable.headers["x-request-id"].startswith("req_")
    answered = requests.post(base + "/v1/chat/completions", headers={"X-Request-Id": "client-answered-1"},
                             json={"messages": MESSAGES, "temperature": 0, "max_tokens": 4}, timeout=60)
    assert answered.status_code == 200 and answered.headers["x-request-id"] == "client-answered-1"
    request_id = answered.json()["id"].removeprefix("chatcmpl-")
    with db() as s:
        assert s.get(RequestRecord, request_id).http_request_id == "client-answered-1"
    log = stack.workdir / f"web{urlsplit(base).port}.log"   # the web process's log names both ids together
    wait_for(lambda: f"request client-answered-1 accepted as {request_id}" in log.read_text(), 10, "the log line")
    worker_log = (stack.workdir / "worker.log").read_text()   # and the worker's, as it starts the request
    assert f"answering {request_id} (x-request-id client-answered-1)" in worker_log


def test_rate_limited_requests_carry_openais_headers_and_retry_after(stack):
    url = stack.web_with(RATE_LIMIT_PER_IP="3/minute", TRUSTED_PROXY_HOPS="1")
    address = {"X-Forwarded-For": f"198.51.100.{int(time.time()) % 200 + 1}"}   # a budget of this test's own
    seen = []
    for _ in range(4):   # counted before the body is read: a body that is not JSON is enough
        response = requests.post(url + "/v1/chat/completions", data="not json", headers=address, timeout=10)
        seen.append((response.status_code, response.headers.get("x-ratelimit-limit-requests"),
                     response.headers.get("x-ratelimit-remaining-requests"), response.headers.get("Retry-After")))
        last = response
    assert seen[:3] == [(400, "3", "2", None), (400, "3", "1", None), (400, "3", "0", None)]
    status, limit, remaining, retry_after = seen[3]
    assert (status, limit, remaining) == (429, "3", "0") and 1 <= int(retry_after) <= 60
    assert last.headers["x-ratelimit-reset-requests"].endswith("s")


def test_a_request_no_worker_starts_in_time_is_a_503_with_retry_after_and_is_cancelled(own_stack, own_db):
    stack, db = own_stack, own_db
    url = stack.web_with(API_QUEUE_TIMEOUT_S="2")
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 4}
    with worker_paused(stack):
        response = requests.post(url + "/v1/chat/completions", json=body, timeout=60)
    assert response.status_code == 503 and int(response.headers["Retry-After"]) > 0
    assert response.json()["error"]["code"] == "timeout"
    request_id = response.headers["x-request-id"]
    with db() as s:
        record = s.scalars(select(RequestRecord).where(RequestRecord.http_request_id == request_id)).one()

    def ended_as_cancelled() -> bool:   # the worker, once back, does not answer it: the client's retry is new
        with db() as s:
            found = s.get(RequestRecord, record.request_id)
            return found.finished_at is not None and "cancelled" in (found.error or "")

    wait_for(ended_as_cancelled, 60, "the cancelled request's record")


def test_the_models_list_and_readiness_read_no_keyspace_scan(stack, tiny_model_dir):
    url = stack.web_urls[0]
    monitor = redis.Redis.from_url(stack.env["REDIS_URL"]).monitor()
    commands: list[str] = []
    with monitor as m:
        listen = m.listen()
        for _ in range(5):
            assert [e["id"] for e in requests.get(url + "/v1/models", timeout=10).json()["data"]] == \
                [str(tiny_model_dir)]
        assert requests.get(url + "/readyz", timeout=10).json()["checks"]["worker"] == "1 live"
        requests.get(url + "/healthz", timeout=10)
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            command = next(listen)["command"]
            commands.append(command)
            if sum(c.startswith("HVALS supportbot:models") for c in commands) >= 5:
                break
    assert sum(c.startswith("HVALS supportbot:models") for c in commands) >= 5
    assert not [c for c in commands if c.startswith(("SCAN", "KEYS"))]
