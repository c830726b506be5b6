"""The chat end to end: Socket.IO clients -> web app -> Celery on Redis -> worker engine -> pub/sub -> SQL."""

from __future__ import annotations

import json
import threading
import time

import pytest
import redis
import requests

from bench.socketio_client import InOrderClient
from models import Message, RequestRecord
from tests.clients import ChatClient, disconnect


@pytest.fixture()
def client(stack):
    c = ChatClient(stack.web_urls[0])
    yield c
    c.close()


def test_a_message_streams_tokens_then_done_and_is_recorded(client, db):
    result = client.ask("Where is my parcel? It was due on Monday.")
    done = result["done"]
    assert len(result["tokens"]) >= 2, "the answer should stream in several deltas"
    assert "".join(result["tokens"]) == done["text"]
    assert done["finish_reason"] in ("stop", "length") and done["completion_tokens"] > 0
    with db() as s:
        record = s.get(RequestRecord, done["request_id"])
        assert record.enqueued_at <= record.admitted_at <= record.first_token_at <= record.finished_at
        assert record.finish_reason == done["finish_reason"] and record.prompt_tokens == done["prompt_tokens"]
        assert record.worker and record.model and record.batch_size >= 1
        answer = s.query(Message).filter_by(request_id=done["request_id"]).one()
        assert answer.role == "assistant" and answer.content == done["text"]


def test_the_python_clients_see_a_connections_events_in_the_order_sent(stack):
    """As a browser does. The stock python-socketio client hands each message to a thread of its own, so two deltas
    that arrive together could reach the handlers swapped (a test then read another text than `done`'s)."""
    seen: list[tuple[str, str, dict]] = []
    finished = threading.Event()
    http = requests.Session()
    http.get(stack.web_urls[0] + "/").raise_for_status()
    sio = InOrderClient(http_session=http, reconnection=False)
    for name in ("accepted", "token", "done", "error"):
        sio.on(name, lambda data, name=name: (seen.append((name, threading.current_thread().name, data)),
                                              name in ("done", "error") and finished.set()))
    sio.connect(stack.web_urls[0], transports=["websocket"], wait_timeout=10)
    try:
        sio.emit("chat_message", {"text": "Tell me everything about your return policy."})
        assert finished.wait(120), seen[-3:]
    finally:
        disconnect(sio)
    names = [name for name, _, _ in seen]
    assert names[0] == "accepted" and names[-1] == "done" and "token" in names, seen[-1]
    assert len({thread for _, thread, _ in seen}) == 1, "every event on the one reading thread, in turn"
    text = ""
    for name, _, data in seen:
        if name == "token":
            assert data["offset"] == len(text), (data, len(text))
            text += data["text"]
    assert text == seen[-1][2]["text"]


def test_a_message_may_ask_for_a_shorter_answer(client, db):
    done = client.ask("Tell me everything about your return policy.", max_new_tokens=3)["done"]
    assert done["completion_tokens"] <= 3
    with db() as s:
        assert s.get(RequestRecord, done["request_id"]).completion_tokens == done["completion_tokens"]


def test_the_second_message_sees_the_first(client, db):
    first = client.ask("Do you ship to Canada?")["done"]
    second = client.ask("And to Mexico?", conversation_id=first["conversation_id"])["done"]
    assert second["conversation_id"] == first["conversation_id"]
    # The second prompt carries the first question and answer as history.
    assert second["prompt_tokens"] > first["prompt_tokens"] + first["completion_tokens"]
    with db() as s:
        roles = [m.role for m in s.query(Message).filter_by(conversation_id=first["conversation_id"])
                 .order_by(Message.id)]
    # Each answer follows the lookups made for its question (the help centre's search), stored before it.
    assert [r for r in roles if r in ("user", "assistant")] == ["user", "assistant", "user", "assistant"]


def test_clients_on_two_web_processes_each_get_their_own_answers(stack):
    a, b = ChatClient(stack.web_urls[0]), ChatClient(stack.web_urls[1])
    try:
        a.sio.emit("chat_message", {"text": "Hello from A"})
        b.sio.emit("chat_message", {"text": "Hello from B"})
        for c in (a, b):
            events = []
            while not events or events[-1][0] != "done":
                events.append(c.next())
            ids = {data["request_id"] for _, data in events}
            assert len(ids) == 1, "a client must only see its own request's events"
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("payload, code", [
    ({"text": "   "}, "empty_message"),
    ({"text": "x" * 5000}, "message_too_long"),
    ("just a string", "bad_request"),
    ({"text": 42}, "empty_message"),
    ({"text": "hi", "conversation_id": "0" * 32}, "unknown_conversation"),
    ({"text": "hi", "conversation_id": ["not", "a", "string"]}, "bad_request"),
    ({"text": "hi", "max_new_tokens": 0}, "invalid_value"),
    ({"text": "hi", "max_new_tokens": 10_000}, "invalid_value"),   # above the shop's limit
    ({"text": "hi", "max_new_tokens": "20"}, "invalid_value"),
])
def test_bad_input_gets_a_clear_error(client, payload, code):
    client.sio.emit("chat_message", payload)
    name, data = client.next(10)
    assert name == "error" and data["code"] == code and data["retryable"] is False
    assert len(data["message"]) > 10


def test_another_session_cannot_use_a_conversation(stack, client):
    mine = client.ask("Is the teapot in stock?")["done"]["conversation_id"]
    stranger = ChatClient(stack.web_urls[0])
    try:
        stranger.sio.emit("chat_message", {"text": "show me", "conversation_id": mine})
        name, data = stranger.next(10)
        assert name == "error" and data["code"] == "unknown_conversation"
        assert requests.get(f"{stack.web_urls[0]}/conversations/{mine}").status_code == 404
        assert client.http.get(f"{stack.web_urls[0]}/conversations/{mine}").status_code == 200
    finally:
        stranger.close()


def test_cancel_mid_answer_frees_the_slot_and_records_cancelled(stack, db):
    web = stack.web_urls[0]
    c = ChatClient(web)
    r = redis.Redis.from_url(stack.env["REDIS_URL"])
    try:
        # This web process answers at length, so there is time to press stop: without grounding's lead, whose
        # answers end at the model's first line break, the random model writes to the cap.
        long_web = stack.web_with(MAX_NEW_TOKENS="2000", CHAT_GROUNDING="off")
        c.close()
        c = ChatClient(long_web)
        c.sio.emit("chat_message", {"text": "Tell me everything about your return policy."})
        name, accepted = c.next()
        assert name == "accepted"
        name, _ = c.next()
        assert name == "token"
        c.sio.emit("cancel", {"request_id": accepted["request_id"]})
        while True:
            name, data = c.next()
            if name == "done":
                break
        assert data["finish_reason"] == "cancelled" and data["completion_tokens"] < 2000
        with db() as s:
            assert s.get(RequestRecord, accepted["request_id"]).finish_reason == "cancelled"
        time.sleep(2.5)   # one heartbeat
        beats = [r.get(k) for k in r.scan_iter("supportbot:workers:*")]
        assert all(b'"running": 0' in b for b in beats)
    finally:
        c.close()


def test_readyz_reports_redis_database_and_a_live_worker(stack):
    body = requests.get(stack.web_urls[0] + "/readyz").json()
    assert body["status"] == "ready", body
    assert requests.get(stack.web_urls[0] + "/healthz").json() == {"status": "ok"}


def test_readyz_says_what_is_missing_when_no_worker_is_live(stack):
    # Another Redis database: the same server, but no worker's heartbeat in it.
    url = stack.web_with(REDIS_URL=stack.env["REDIS_URL"].rsplit("/", 1)[0] + "/7")
    response = requests.get(url + "/readyz")
    assert response.status_code == 503
    body = response.json()
    assert body["status"] == "not ready" and body["checks"]["redis"] == "ok" and body["checks"]["database"] == "ok"
    assert "start the worker" in body["checks"]["worker"]


def test_a_prompt_over_the_context_is_refused_through_the_stack(client, db):
    # The tiny model's context is 512 tokens; 3900 characters of digits is far more.
    client.sio.emit("chat_message", {"text": " ".join(str(i) for i in range(1000))[:3900]})
    name, accepted = client.next()
    assert name == "accepted"
    name, data = client.next()
    assert name == "error" and data["code"] == "prompt_too_long" and data["retryable"] is False
    assert "shorten" in data["message"]
    with db() as s:
        record = s.get(RequestRecord, accepted["request_id"])
        assert record.finish_reason == "error" and record.finished_at is not None


def test_a_full_queue_refuses_new_messages_with_a_retryable_error(stack, db):
    full = stack.start_web(QUEUE_LIMIT="0")   # a limit of 0 makes every queue count as full
    c = ChatClient(full)
    try:
        c.sio.emit("chat_message", {"text": "Anyone there?"})
        name, data = c.next(10)
        assert name == "error" and data["code"] == "queue_full" and data["retryable"] is True
        assert "try again" in data["message"]
    finally:
        c.close()
    response = requests.post(full + "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]})
    assert response.status_code == 429 and response.json()["error"]["code"] == "queue_full"


def test_replies_to_the_sender_skip_the_message_queue_and_answers_use_the_stream(client, stack):
    """`accepted` and `error` go straight to the sender's socket; the worker's tokens and end reach it through the
    stream every web process reads, addressed to the conversation's room."""
    from messaging.contract import SOCKETIO_CHANNEL, STREAM_CHANNEL
    from messaging.stream import decode_batch

    pubsub = redis.Redis.from_url(stack.env["REDIS_URL"]).pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(SOCKETIO_CHANNEL, STREAM_CHANNEL)
    try:
        client.sio.emit("chat_message", {"text": "   "})
        assert client.next()[0] == "error"
        result = client.ask("Do you sell gift cards?", max_new_tokens=4)
        done = result["done"]
        on_queue, streamed, deadline = [], [], time.monotonic() + 5
        while not any(e.name == "done" for e in streamed) and time.monotonic() < deadline:
            message = pubsub.get_message(timeout=0.5)
            if message is None:
                continue
            if message["channel"] == SOCKETIO_CHANNEL.encode():
                on_queue.append(json.loads(message["data"]))
            else:
                streamed += [e for e in decode_batch(message["data"]) if e.data["request_id"] == done["request_id"]]
    finally:
        pubsub.close()
    assert on_queue == [], on_queue
    assert [e.name for e in streamed][-1] == "done" and {e.name for e in streamed} == {"token", "done"}
    assert all(e.room == done["conversation_id"] and not e.api for e in streamed)
    assert "".join(e.data["text"] for e in streamed if e.name == "token") == done["text"]


def test_a_worker_with_overlapped_steps_answers_as_the_plain_one(stack, db):
    """OVERLAP_STEPS=1 through the whole stack: the same greedy answers over HTTP, streamed chat recorded."""
    url = stack.web_urls[0]
    questions = ["Where is my parcel?", "Can I return shoes I wore once?", "Do you ship to Norway?"]

    def ask_all() -> list[str]:
        answers: dict[int, str] = {}

        def ask(i: int) -> None:
            body = {"model": "default", "messages": [{"role": "user", "content": questions[i]}],
                    "temperature": 0, "max_tokens": 40}
            r = requests.post(url + "/v1/chat/completions", json=body, timeout=120)
            r.raise_for_status()
            answers[i] = r.json()["choices"][0]["message"]["content"]
        threads = [threading.Thread(target=ask, args=(i,)) for i in range(len(questions))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(150)
        return [answers[i] for i in range(len(questions))]

    def starts() -> list[str]:
        return [line for line in (stack.workdir / "worker.log").read_text().splitlines() if "ready with" in line]

    plain = ask_all()
    before = len(starts())
    stack.kill_worker()
    try:
        stack.start_worker(OVERLAP_STEPS="1")
        # The heartbeat start_worker waits for begins before Celery logs the ready line: wait for that too.
        deadline = time.monotonic() + 30
        while len(starts()) == before and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "steps overlapped" in starts()[-1], starts()[-1]
        assert ask_all() == plain
        c = ChatClient(url)
        try:
            result = c.ask("Is the blue teapot back in stock?")
        finally:
            c.close()
        done = result["done"]
        assert "".join(result["tokens"]) == done["text"] and done["completion_tokens"] > 0
        with db() as s:
            assert s.query(Message).filter_by(request_id=done["request_id"]).one().content == done["text"]
            assert s.get(RequestRecord, done["request_id"]).finish_reason == done["finish_reason"]
    finally:
        stack.kill_worker()
        stack.start_worker()   # the session's worker, as the tests that follow expect
