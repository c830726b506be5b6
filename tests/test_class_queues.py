"""Service classes in the queue: one Redis queue per class, taken most urgent first; redelivery keeps the class and
nothing queued is lost."""

from __future__ import annotations

import base64
import json
import re
import threading
import time

import pytest
import redis
import requests

from sqlalchemy import select

from messaging.contract import CLASS_QUEUES, QUEUES, queue_for
from messaging.queue import queue_depths
from models import RequestRecord
from models.db import make_engine, make_session_factory
from tests.clients import ChatClient
from tests.stack import private_stack, wait_for
from tests.tiny_model import make_tiny_model_dir
from worker.engine.sequence import SERVICE_CLASSES
from worker.leases import LeasedChannel

CHATS = ["Where is my parcel?", "Can I return a jacket?"]


def test_the_queues_are_the_engines_classes_most_urgent_first():
    assert tuple(CLASS_QUEUES) == SERVICE_CLASSES
    assert QUEUES == ("generate.interactive", "generate", "generate.bulk")
    assert queue_for(None) == queue_for("standard") == "generate"   # jobs from older web processes


def ask_api(url: str, i: int, results: dict, tier: str | None, max_tokens: int = 64) -> None:
    body = {"model": "default", "messages": [{"role": "user", "content": f"Question {i}: what do you sell?"}],
            "temperature": 0, "max_tokens": max_tokens, **({"service_tier": tier} if tier else {})}
    response = requests.post(url + "/v1/chat/completions", json=body, timeout=300)
    results[i] = (response.status_code, response.json())


def queue_behind_a_stopped_worker(stack, url: str, tiers: list[str | None], max_tokens: int = 64):
    """With the worker stopped: API requests of these service tiers queued first, then the chat messages; returns
    the clients, the API threads and their results once everything is in Redis."""
    n_api = len(tiers)
    stack.kill_worker()
    r = redis.Redis.from_url(stack.env["REDIS_URL"])
    results: dict = {}
    threads = [threading.Thread(target=ask_api, args=(url, i, results, tier, max_tokens))
               for i, tier in enumerate(tiers)]
    for t in threads:
        t.start()
    wait_for(lambda: sum(queue_depths(r).values()) >= n_api, 30, "API requests queued")
    clients = [ChatClient(url) for _ in CHATS]
    for client, text in zip(clients, CHATS):
        client.sio.emit("chat_message", {"text": text})
    wait_for(lambda: queue_depths(r)["interactive"] == len(CHATS), 30, "chat messages queued")
    return clients, threads, results


def finish(clients, threads, results, n_api: int) -> list[str]:
    """Every chat answer and API answer arrives; the chats' request ids."""
    ids = []
    for client in clients:
        events = [client.next(120)]
        while events[-1][0] not in ("done", "error"):
            events.append(client.next(120))
        assert events[-1][0] == "done", events[-1]
        ids.append(events[0][1]["request_id"])
        client.close()
    for t in threads:
        t.join(300)
    assert sorted(results) == list(range(n_api))
    assert all(status == 200 for status, _ in results.values()), results
    return ids


def drained(r: redis.Redis) -> None:
    """Until nothing waits in the queues and no worker holds a message. A message the killed worker answered but had
    not yet acknowledged stays held until its lease lapses, then comes back, and the worker acknowledges it without
    answering again; left there, the next test's new worker would put it back in a queue it counts."""
    wait_for(lambda: sum(queue_depths(r).values()) == 0 and r.hlen(LeasedChannel.unacked_key) == 0, 60,
             "the queues drained and every message acknowledged")


def test_a_worker_takes_interactive_requests_before_the_ones_queued_ahead_of_them(stack, db):
    """Ten API requests (bulk and standard) queued before two chat messages: the worker takes both chats first."""
    url = stack.web_urls[0]
    clients, threads, results = queue_behind_a_stopped_worker(stack, url, ["flex"] * 6 + [None] * 4)
    r = redis.Redis.from_url(stack.env["REDIS_URL"])
    assert queue_depths(r) == {"interactive": 2, "standard": 4, "bulk": 6}
    log = stack.workdir / "worker.log"
    offset = log.stat().st_size
    try:
        stack.start_worker(MAX_NUM_SEQS="1")
        chat_ids = finish(clients, threads, results, 10)
    finally:
        stack.kill_worker()
        stack.start_worker()   # the session's worker for the tests that follow
    with open(log, "rb") as f:
        f.seek(offset)
        received = re.findall(r"Task supportbot\.generate\[([0-9a-f]+)\] received", f.read().decode(errors="replace"))
    assert set(received[:2]) == set(chat_ids), "the worker's first two messages are the chats"
    api_ids = [body["id"].removeprefix("chatcmpl-") for _, body in results.values()]
    with db() as s:
        chats = [s.get(RequestRecord, rid) for rid in chat_ids]
        apis = [s.get(RequestRecord, rid) for rid in api_ids]
    assert all(rec.finished_at is not None for rec in chats + apis)
    assert [c.service_class for c in chats] == ["interactive"] * 2
    assert sorted(a.service_class for a in apis) == ["bulk"] * 6 + ["standard"] * 4
    drained(r)


def test_a_dead_workers_requests_come_back_to_their_own_class_queue(stack, db):
    # Answers of 200 tokens: none can end (and let the worker take another) before the worker is killed.
    url = stack.web_with(MAX_NEW_TOKENS="200")
    clients, threads, results = queue_behind_a_stopped_worker(stack, url, ["flex", None] * 3, max_tokens=200)
    r = redis.Redis.from_url(stack.env["REDIS_URL"])
    try:
        stack.start_worker(MAX_NUM_SEQS="1")
        # one slot: two task threads for standard and bulk requests, four kept for interactive ones
        wait_for(lambda: r.hlen(LeasedChannel.unacked_key) == 4, 60, "the worker holding four requests")
        stack.kill_worker()
        held = [json.loads(raw)[0] for raw in r.hvals(LeasedChannel.unacked_key)]
        # kombu puts a message back where its routing key says: the queue of the request's class.
        routes = {m["headers"]["id"]: m["properties"]["delivery_info"]["routing_key"] for m in held}
        jobs = {m["headers"]["id"]: json.loads(base64.b64decode(m["body"]))[0][0] for m in held}
        for rid, route in routes.items():
            assert route == queue_for(jobs[rid]["params"].get("service_class")), (rid, route)
        assert sorted(routes.values()).count("generate.interactive") == 2
        assert sum(depth for depth in queue_depths(r).values()) == 4, "the rest waited in Redis"
        stack.start_worker()   # restores the dead worker's messages once their leases lapse
        chat_ids = finish(clients, threads, results, 6)
    finally:
        if stack.worker.poll() is not None:
            stack.start_worker()
    with db() as s:
        for rid in chat_ids:
            assert s.get(RequestRecord, rid).finished_at is not None
    drained(r)


@pytest.fixture(scope="module")
def long_stack(tmp_path_factory, tokenizer):
    """A stack of its own whose tiny model takes an 8k-token context, so bulk answers run for seconds, not the
    fraction of one that fills the session model's 512 tokens on an idle machine."""
    workdir = tmp_path_factory.mktemp("long")
    model_dir = make_tiny_model_dir(workdir / "model", tokenizer, max_position_embeddings=8192)
    with private_stack(workdir, model_dir, MAX_NEW_TOKENS="4000") as s:
        yield s


def test_a_worker_full_of_bulk_requests_still_takes_a_chat_at_once(long_stack):
    """The worker (4 slots): 8 task threads for standard and bulk requests, 4 kept for interactive ones. With 12
    long bulk answers sent, it takes 8 and leaves 4 in Redis, and a chat sent then has its answer before any bulk
    answer ends (the engine preempts one for it). The bulk clients then leave, which cancels their answers."""
    stack = long_stack
    url = stack.web_urls[0]
    r = redis.Redis.from_url(stack.env["REDIS_URL"])
    db = make_session_factory(make_engine(stack.env["DATABASE_URL"]))
    streams: dict[int, requests.Response] = {}
    lock = threading.Lock()

    def bulk(i: int) -> None:
        body = {"messages": [{"role": "user", "content": f"Ticket {i}: summarise it."}], "max_tokens": 4000,
                "temperature": 0, "service_tier": "flex", "stream": True, "logit_bias": {"0": -100, "2": -100}}
        response = requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=300)
        with lock:
            streams[i] = response

    threads = [threading.Thread(target=bulk, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: queue_depths(r)["bulk"] == 4 and r.hlen(LeasedChannel.unacked_key) == 8, 60,
                 "the worker holding 8 bulk requests and leaving 4")
        time.sleep(1.0)
        assert queue_depths(r)["bulk"] == 4, "a full worker takes no more bulk requests"
        client = ChatClient(url)
        try:
            answer = client.ask("Where is my parcel?", timeout=120)
        finally:
            client.close()
        with db() as s:
            chat = s.get(RequestRecord, answer["accepted"]["request_id"])
            bulks = list(s.scalars(select(RequestRecord).where(RequestRecord.source == "api")))
        assert chat.service_class == "interactive" and chat.finished_at is not None
        assert len(bulks) == 12 and {b.service_class for b in bulks} == {"bulk"}
        assert all(b.finished_at is None for b in bulks), "a bulk answer ended before the chat's"
    finally:
        for t in threads:
            t.join(60)
        for response in streams.values():
            response.close()   # the clients leave: their answers, running or queued, are cancelled
    wait_for(lambda: sum(queue_depths(r).values()) == 0 and r.hlen(LeasedChannel.unacked_key) == 0, 60,
             "the cancelled bulk requests leaving the queue")
