"""Redis restarted or down, a web process or the worker killed, the database away: nothing accepted is lost."""

from __future__ import annotations

import json
import queue
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime

import pytest
import redis
import requests
from sqlalchemy import make_url, text

from bench.socketio_client import InOrderClient
from models import Message, RequestRecord
from models.db import make_engine, make_session_factory, upgrade
from tests.clients import disconnect
from tests.stack import RedisServer, Stack, base_env, throwaway_database, wait_for
from webapp.metrics import API_OUTCOMES_KEY, CHAT_OUTCOMES_KEY
from webapp.queue import new_job, record_for
from messaging.contract import job_key
from messaging.queue import queue_depths
from messaging.generation import Generation
from worker.leases import LeasedChannel
from worker.local_redis import free_port

QUESTIONS = ["My order #1042 has not arrived, where is it?", "Can I return shoes I wore once?",
             "Do you ship to Norway?", "Is there a discount for students?", "Can I pay by invoice?"]
API_QUESTION = "How long does a refund take?"


# ---- a customer that behaves like the chat page -------------------------------------------------

class Customer:
    """A Socket.IO customer that, like the chat page, rejoins its room after a reconnect and, when an
    answer goes quiet, reads the stored conversation (GET /conversations/<id>)."""

    def __init__(self, url: str, reconnection: bool = False) -> None:
        self.url, self.http = url, requests.Session()
        self.http.get(url + "/", timeout=10).raise_for_status()
        self.events: queue.Queue = queue.Queue()
        self.conversation_id: str | None = None
        self.reconnects = 0
        self.sio = InOrderClient(http_session=self.http, reconnection=reconnection, reconnection_delay=0.5,
                                   reconnection_delay_max=1, randomization_factor=0)
        for name in ("accepted", "token", "done", "error"):
            self.sio.on(name, lambda data, name=name: self.events.put((name, data)))
        self.sio.on("connect", self._on_connect)
        self.sio.connect(url, transports=["websocket"], wait_timeout=10)

    def _on_connect(self) -> None:
        if self.conversation_id is None:
            return
        self.reconnects += 1
        self.sio.emit("join", {"conversation_id": self.conversation_id})
        self.events.put(("reconnected", {}))

    def send(self, text: str) -> None:
        payload = {"text": text} | ({"conversation_id": self.conversation_id} if self.conversation_id else {})
        self.sio.emit("chat_message", payload)

    def next(self, timeout: float) -> tuple[str, dict]:
        return self.events.get(timeout=timeout)

    def accepted(self, timeout: float = 30) -> dict:
        name, data = self.next(timeout)
        assert name == "accepted", (name, data)
        self.conversation_id = data["conversation_id"]
        return data

    def stored(self, request_id: str) -> tuple[str | None, bool]:
        """The stored answer to `request_id` (or None), and whether the request is still under way."""
        body = self.http.get(f"{self.url}/conversations/{self.conversation_id}", timeout=10).json()
        answer = next((m["content"] for m in body["messages"] if m.get("request_id") == request_id), None)
        return answer, request_id in body.get("unfinished", [])

    def outcome(self, request_id: str, timeout: float = 120) -> tuple[str, str]:
        """The answer as this customer ends up seeing it, and how: the live `done`, or looked up after a quiet
        spell or a reconnect (a final event published while a listener was away is lost)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                name, data = self.next(3)
            except queue.Empty:
                name, data = "quiet", {}
            if name in ("quiet", "reconnected"):
                try:
                    answer, pending = self.stored(request_id)
                except requests.RequestException:
                    continue   # the web process is down: it comes back, or the socket moves on
                if answer is not None:
                    return answer, "looked up"
                assert pending, f"{request_id} ended without an answer"
            elif data.get("request_id") == request_id and name == "done":
                return data["text"], "live"
            elif data.get("request_id") == request_id and name == "error":
                raise AssertionError(f"{request_id} failed: {data}")
        raise AssertionError(f"no answer to {request_id} within {timeout} s")

    def ask(self, text: str, timeout: float = 120) -> str:
        self.send(text)
        return self.outcome(self.accepted()["request_id"], timeout)[0]

    def close(self) -> None:
        disconnect(self.sio)


def stream_api(url: str, text: str, max_tokens: int, out: dict, streaming: threading.Event | None = None) -> None:
    """An OpenAI-style streaming request; `out` gets its request id and the text as the client assembled it.
    `streaming` is set once the first text has arrived."""
    body = {"model": "default", "messages": [{"role": "user", "content": text}], "temperature": 0,
            "max_tokens": max_tokens, "stream": True}
    chunks = []
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=180) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                out["id"] = chunk["id"].removeprefix("chatcmpl-")
                if chunk["choices"]:
                    chunks.append(chunk["choices"][0]["delta"].get("content") or "")
                if streaming is not None and "".join(chunks):
                    streaming.set()
    out["text"] = "".join(chunks)


def ask_api(url: str, text: str, max_tokens: int) -> requests.Response:
    body = {"messages": [{"role": "user", "content": text}], "temperature": 0, "max_tokens": max_tokens}
    return requests.post(url + "/v1/chat/completions", json=body, timeout=180)


def first_tokens(customers: list[Customer]) -> None:
    """Wait until some answer is streaming, leaving every event where outcome() will read it."""
    seen: list[list[tuple[str, dict]]] = [[] for _ in customers]
    deadline = time.monotonic() + 60
    while not any(name == "token" for events in seen for name, _ in events):
        assert time.monotonic() < deadline, "no answer started streaming"
        for customer, events in zip(customers, seen):
            while not customer.events.empty():
                events.append(customer.next(0))
        time.sleep(0.01)
    for customer, events in zip(customers, seen):
        for event in events:
            customer.events.put(event)


def outcome_counts(redis_url: str) -> tuple[int, int]:
    """Chat messages and API requests the web tier has queued so far (its outcome counters)."""
    r = redis.Redis.from_url(redis_url)
    return (int(r.hget(CHAT_OUTCOMES_KEY, "accepted") or 0), int(r.hget(API_OUTCOMES_KEY, "ok") or 0))


def wait_queued(redis_url: str, before: tuple[int, int], chats: int, api: int) -> None:
    """Wait until the web tier has queued `chats` more messages and `api` more API requests. A chat is told
    "accepted" just before its job is sent, so a restart in between would rightly refuse that message (retryably):
    the restart tests mean to restart Redis with every request already in its hands."""
    wait_for(lambda: outcome_counts(redis_url) >= (before[0] + chats, before[1] + api), 30, "queued")


def stored_answers(db, request_id: str) -> list[str]:
    with db() as s:
        return [m.content for m in s.query(Message).filter_by(request_id=request_id)]


def assert_answered_once(db, request_id: str, shown: str) -> None:
    assert stored_answers(db, request_id) == [shown], f"{request_id}: the customer's answer is not the one stored"
    with db() as s:
        record = s.get(RequestRecord, request_id)
    assert record.finished_at is not None and record.finish_reason in ("stop", "length"), record


# ---- a private system: its Redis is restarted and its database taken away ------------------------

@pytest.fixture(scope="module")
def infra_db_url(request, tmp_path_factory) -> Iterator[str]:
    """A throwaway PostgreSQL database when a server answers (the SQL fault needs one), else SQLite."""
    try:
        admin = request.getfixturevalue("pg_admin")
    except pytest.skip.Exception:
        yield f"sqlite:///{tmp_path_factory.mktemp('infra-db') / 'chat.db'}"
        return
    with throwaway_database(admin) as url:
        yield url


@pytest.fixture(scope="module")
def infra(tmp_path_factory, tiny_model_dir, infra_db_url) -> Iterator[tuple[Stack, RedisServer]]:
    """Redis with its append-only file, one worker with two slots (taking four standard or bulk requests at a time,
    and four more interactive ones: the rest wait in Redis's queues), one web process with answers of a couple of
    seconds, and a database of its own."""
    workdir = tmp_path_factory.mktemp("infra")
    server = RedisServer(workdir / "redis")
    server.start()
    upgrade(infra_db_url)
    env = base_env(server.url, infra_db_url, tiny_model_dir, workdir)
    env.update(MAX_NUM_SEQS="2", MAX_NEW_TOKENS="200", SQL_RETRY_S="60", REDIS_RETRY_S="60", LOST_AFTER_S="4")
    stack = Stack(workdir, env)
    try:
        stack.start_worker()
        stack.start_web()
        yield stack, server
    finally:
        stack.stop()
        server.stop()


@pytest.fixture(scope="module")
def infra_db(infra_db_url):
    return make_session_factory(make_engine(infra_db_url))


def worker_log(stack: Stack) -> str:
    return (stack.workdir / "worker.log").read_text(errors="replace")


def assert_nothing_left(redis_url: str) -> None:
    """No request waits in the queue or sits unacknowledged: nothing will be handed out again later."""
    r = redis.Redis.from_url(redis_url)
    wait_for(lambda: sum(queue_depths(r).values()) == 0 and r.hlen(LeasedChannel.unacked_key) == 0, 30, "acks")


def redeliveries(stack: Stack) -> int:
    return worker_log(stack).count("was answered before")


def test_a_redis_restart_mid_answer_loses_no_request(infra, infra_db):
    stack, server = infra
    url = stack.web_urls[0]
    # Five chat requests and one API request on a worker of two slots (eight task threads: four for standard and
    # bulk requests, four more that interactive ones may take): two are generated, the others wait in the engine.
    customers = [Customer(url) for _ in QUESTIONS]
    api: dict = {}
    before = redeliveries(stack)
    queued_before = outcome_counts(server.url)
    try:
        for customer, question in zip(customers, QUESTIONS):
            customer.send(question)
        accepted = [customer.accepted() for customer in customers]
        api_thread = threading.Thread(target=stream_api, args=(url, API_QUESTION, 200, api))
        api_thread.start()
        first_tokens(customers)
        wait_queued(server.url, queued_before, len(customers), 1)

        # A restart (SIGTERM): every write Redis acknowledged is in its append-only file, so the queue and the
        # requests being answered are read back when it starts again.
        server.stop(signal.SIGTERM)
        down_at = time.monotonic()
        server.start()
        up_at = time.monotonic()
        results = [c.outcome(a["request_id"]) for c, a in zip(customers, accepted)]
        api_thread.join(180)
        all_done_at = time.monotonic()
        after = Customer(url)
        asked_at = time.monotonic()
        answer = after.ask("Is the shop open on Sunday?")
        print(f"\nRedis was down {up_at - down_at:.2f} s; the accepted answers ended "
              f"{all_done_at - up_at:.1f} s after it was back ({', '.join(how for _, how in results)}); "
              f"a new message was answered in {time.monotonic() - asked_at:.1f} s; "
              f"{redeliveries(stack) - before} answered requests were delivered again")
        after.close()
    finally:
        for customer in customers:
            customer.close()
    for acc, (shown, _) in zip(accepted, results):
        assert_answered_once(infra_db, acc["request_id"], shown)
    assert answer.strip()
    # The streamed API text is exactly an undisturbed greedy run: no delta lost or shown twice.
    assert api.get("text") is not None, "the API stream did not finish"
    assert api["text"] == ask_api(url, API_QUESTION, 200).json()["choices"][0]["message"]["content"]
    with infra_db() as s:
        assert s.get(RequestRecord, api["id"]).finish_reason in ("stop", "length")
    assert_nothing_left(server.url)


def test_redis_down_for_ten_seconds(infra, infra_db):
    stack, server = infra
    url = stack.web_urls[0]
    customers = [Customer(url) for _ in QUESTIONS[:3]]
    late = Customer(url)
    api, streaming = {}, threading.Event()
    before = redeliveries(stack)
    try:
        for customer, question in zip(customers, QUESTIONS):
            customer.send(question)
        accepted = [customer.accepted() for customer in customers]
        # The API request is queued last: once it streams, every request is in the worker's hands.
        api_thread = threading.Thread(target=stream_api, args=(url, API_QUESTION, 200, api, streaming))
        api_thread.start()
        assert streaming.wait(60), "the API answer did not start"

        server.stop()   # SIGKILL: a crash
        down_at = time.monotonic()
        # While Redis is down: a chat message and an API request are refused at once, retryably.
        sent_at = time.monotonic()
        late.send("Hello, is anyone there?")
        name, refusal = late.next(30)
        chat_refused_in = time.monotonic() - sent_at
        sent_at = time.monotonic()
        response = ask_api(url, "Hello?", 20)
        api_refused_in = time.monotonic() - sent_at
        ready = requests.get(url + "/readyz", timeout=30)
        time.sleep(max(0.0, 10 - (time.monotonic() - down_at)))
        server.start()
        up_at = time.monotonic()

        results = [c.outcome(a["request_id"]) for c, a in zip(customers, accepted)]
        api_thread.join(180)
        all_done_at = time.monotonic()
        answer = late.ask("Hello again, is anyone there now?")
        print(f"\nwhile Redis was down a chat message was refused in {chat_refused_in:.2f} s and an API request "
              f"in {api_refused_in:.2f} s; after {up_at - down_at:.1f} s down, the accepted answers ended "
              f"{all_done_at - up_at:.1f} s after Redis was back ({', '.join(how for _, how in results)}); "
              f"a new message sent then was answered in {time.monotonic() - all_done_at:.1f} s; "
              f"{redeliveries(stack) - before} answered requests were delivered again")
    finally:
        for customer in [*customers, late]:
            customer.close()
    assert name == "error" and refusal["retryable"] and refusal["code"] == "queue_unavailable", refusal
    assert response.status_code == 503 and response.json()["error"]["code"] == "queue_unavailable", response.text
    assert ready.status_code == 503 and ready.json()["checks"]["redis"].startswith("unreachable")
    for acc, (shown, _) in zip(accepted, results):
        assert_answered_once(infra_db, acc["request_id"], shown)
    assert answer.strip()
    # Text lost in the outage was made up from the final event: the client's text is the whole answer.
    assert api.get("text") is not None, "the API stream did not finish"
    assert api["text"] == ask_api(url, API_QUESTION, 200).json()["choices"][0]["message"]["content"]
    assert_nothing_left(server.url)


@contextmanager
def database_away(admin, url: str) -> Iterator[None]:
    """No new connection to this one database, and its open ones cut; the rest of the server is untouched."""
    name = make_url(url).database
    with admin.connect() as conn:
        conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS false'))
        conn.execute(text("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = :name"),
                     {"name": name})
    try:
        yield
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'ALTER DATABASE "{name}" ALLOW_CONNECTIONS true'))


def test_the_database_away_while_an_answer_finishes(request, infra, infra_db, infra_db_url):
    if not infra_db_url.startswith("postgresql"):
        pytest.skip("needs PostgreSQL, to take one database away without touching anything else")
    admin = request.getfixturevalue("pg_admin")
    stack, _ = infra
    url = stack.web_urls[0]
    customer, late = Customer(url), Customer(url)
    try:
        customer.send(QUESTIONS[0])
        rid = customer.accepted()["request_id"]
        first_tokens([customer])
        with database_away(admin, infra_db_url):
            away_at = time.monotonic()
            sent_at = time.monotonic()
            late.send("Hello, is anyone there?")
            name, refusal = late.next(30)
            refused_in = time.monotonic() - sent_at
            page = customer.http.get(f"{url}/conversations/{customer.conversation_id}", timeout=30)
            response = ask_api(url, "Hello?", 20)
            # The answer is finished and its write is being retried: keep the database away a while longer.
            wait_for(lambda: f"storing the answer to {rid} failed" in worker_log(stack), 60, "the answer")
            finished_at = time.monotonic()
            time.sleep(3)
        back_at = time.monotonic()
        shown, how = customer.outcome(rid)
        print(f"\nwith the database away a chat message was refused in {refused_in:.2f} s; the answer finished "
              f"{finished_at - away_at:.1f} s into the outage; the database was back {back_at - away_at:.1f} s after "
              f"it went away and the answer reached the customer ({how}) {time.monotonic() - back_at:.1f} s later")
        answer = late.ask("Hello again, is anyone there now?")
    finally:
        customer.close()
        late.close()
    assert name == "error" and refusal["retryable"] and refusal["code"] == "storage_unavailable", refusal
    assert page.status_code == 503 and page.json()["error"]["code"] == "storage_unavailable", page.text
    assert response.status_code == 503 and response.headers["Retry-After"], response.text
    assert response.json()["error"]["code"] == "storage_unavailable", response.text
    assert_answered_once(infra_db, rid, shown)
    assert answer.strip()


def test_a_request_that_never_reached_the_queue_is_not_left_hanging(infra, infra_db):
    stack, _ = infra
    customer = Customer(stack.web_urls[0])
    try:
        customer.ask(QUESTIONS[3])
        # Stored and confirmed, but never queued: as when a web process dies between the two, or when Redis
        # crashes just as it hands the request to the worker.
        rid = uuid.uuid4().hex
        with infra_db() as s:
            s.add(Message(conversation_id=customer.conversation_id, role="user", content="Are you still there?"))
            s.add(RequestRecord(request_id=rid, conversation_id=customer.conversation_id, source="chat",
                                enqueued_at=datetime.now(UTC)))
            s.commit()
        lost_at = time.monotonic()
        # Soon after a Redis outage (an earlier test) the worker says each final event twice: skip the repeat.
        while (event := customer.next(60))[1].get("request_id") != rid:
            pass
        name, data = event
        print(f"\na request lost before it was queued was given up on {time.monotonic() - lost_at:.1f} s later "
              f"(LOST_AFTER_S=4)")
    finally:
        customer.close()
    assert (name, data["request_id"], data["code"], data["retryable"]) == ("error", rid, "lost", True), data
    with infra_db() as s:
        record = s.get(RequestRecord, rid)
    assert record.finish_reason == "error" and record.finished_at is not None
    assert stored_answers(infra_db, rid) == []

def test_a_request_lost_on_its_way_to_a_worker_is_queued_again(infra, infra_db):
    stack, server = infra
    customer = Customer(stack.web_urls[0])
    try:
        customer.ask(QUESTIONS[4])
        # Stored, confirmed and copied, but its message gone: as when a worker is killed between taking it
        # from the queue and recording it as unacknowledged.
        job = new_job([{"role": "user", "content": "Are you still there?"}],
                      Generation(temperature=0, max_new_tokens=20, service_class="interactive"), source="chat",
                      conversation_id=customer.conversation_id)
        with infra_db() as s:
            s.add(Message(conversation_id=customer.conversation_id, role="user", content="Are you still there?"))
            s.add(record_for(job))
            s.commit()
        redis.Redis.from_url(server.url).set(job_key(job["request_id"]), json.dumps(job))
        lost_at = time.monotonic()
        shown, how = customer.outcome(job["request_id"], timeout=60)
        print(f"\na request lost on its way to the worker was answered {time.monotonic() - lost_at:.1f} s later "
              f"(LOST_AFTER_S=4)")
    finally:
        customer.close()
    assert how == "live"
    assert_answered_once(infra_db, job["request_id"], shown)
    assert f"request {job['request_id']} was lost on its way to a worker; queued it again" in worker_log(stack)
    assert not redis.Redis.from_url(server.url).exists(job_key(job["request_id"])), "the copy outlived the answer"


# ---- the chat page in a real browser ------------------------------------------------------------

ANSWER = '#messages [data-role="assistant"]'


def open_chat(browser, url: str):
    page = browser.new_page()
    page.goto(url)
    page.wait_for_selector('#status[data-state="connected"]')
    return page


def ask_in_page(page, text: str) -> str:
    """Send a message; returns the request id once its answer has started to stream."""
    page.fill("#input", text)
    page.press("#input", "Enter")
    answer = page.wait_for_selector(f'{ANSWER}[data-request-id]:last-child .msg__text:not(:empty)', timeout=60_000)
    return answer.evaluate("el => el.closest('[data-request-id]').dataset.requestId")


def finished_text(page, request_id: str, timeout_s: float = 120) -> str:
    answer = page.wait_for_selector(f'{ANSWER}[data-request-id="{request_id}"][data-finish-reason]',
                                    timeout=timeout_s * 1000)
    return answer.query_selector(".msg__text").evaluate("el => el.textContent")


def thread_roles(page) -> list[str]:
    return page.eval_on_selector_all("#messages [data-role]", "els => els.map(e => e.dataset.role)")


def test_pages_on_a_killed_web_process_reconnect_and_catch_up(infra, infra_db, browser):
    stack, db = infra[0], infra_db
    port = free_port()
    url = stack.start_web(port=port)
    page = open_chat(browser, url)
    customer = Customer(url, reconnection=True)   # the same through the python-socketio client
    try:
        customer.send(QUESTIONS[1])
        sio_rid = customer.accepted()["request_id"]
        page_rid = ask_in_page(page, QUESTIONS[0])
        stack.kill_web(url)
        killed_at = time.monotonic()
        # Both answers finish while nobody is listening: their tokens and ends go nowhere.
        wait_for(lambda: stored_answers(db, page_rid) and stored_answers(db, sio_rid), 60, "the answers")
        stored_at = time.monotonic()
        stack.start_web(port=port)
        back_at = time.monotonic()
        shown = finished_text(page, page_rid)
        page_at = time.monotonic()
        sio_shown, how = customer.outcome(sio_rid)
        print(f"\nweb process killed; both answers stored {stored_at - killed_at:.1f} s later; it was back "
              f"{back_at - killed_at:.1f} s after the kill; the page showed its answer {page_at - back_at:.1f} s "
              f"after that, the python-socketio client ({how}, {customer.reconnects} reconnect) "
              f"{time.monotonic() - back_at:.1f} s after")
        assert page.query_selector('#status[data-state="connected"]')
        second = ask_in_page(page, "And how long does the refund take?")
        second_shown = finished_text(page, second)
        roles = thread_roles(page)
    finally:
        customer.close()
        page.close()
    assert_answered_once(db, page_rid, shown)
    assert_answered_once(db, sio_rid, sio_shown)
    assert_answered_once(db, second, second_shown)
    assert roles == ["user", "assistant", "user", "assistant"], "nothing missing, nothing twice, no error notice"


def test_the_page_completes_an_answer_whose_worker_was_killed(infra, infra_db, browser):
    stack, db = infra[0], infra_db
    url = stack.web_urls[0]
    page = open_chat(browser, url)
    try:
        rid = ask_in_page(page, QUESTIONS[2])
        stack.kill_worker()
        killed_at = time.monotonic()
        stored_before = stored_answers(db, rid)
        partial = page.text_content(f'{ANSWER}[data-request-id="{rid}"] .msg__text')
        stack.start_worker()
        back_at = time.monotonic()
        shown = finished_text(page, rid)
        print(f"\nworker killed with {len(partial)} characters on the page; restarted in {back_at - killed_at:.1f} s; "
              f"the page showed the whole answer {time.monotonic() - back_at:.1f} s later, without a reload")
        roles = thread_roles(page)
    finally:
        page.close()
    assert stored_before == [], "the answer finished before the kill; the test needs a longer one"
    assert_answered_once(db, rid, shown)
    assert shown.startswith(partial)
    assert roles == ["user", "assistant"]
