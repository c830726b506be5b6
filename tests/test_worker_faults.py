"""A worker killed or stopped mid-answer: after a restart every accepted request ends with one stored answer."""

from __future__ import annotations

import json
import signal
import threading
import time

import pytest
import requests

from models import Message, RequestRecord
from tests.clients import ChatClient
from tests.tiny_model import make_tiny_model_dir

QUESTIONS = ["My order #1042 has not arrived, where is it?", "Can I return shoes I wore once?",
             "Do you ship to Norway?"]
API_MESSAGES = {"stream": "How long does a refund take?", "plain": "Can I change my delivery address?"}


def ask_api(url: str, text: str, stream: bool) -> dict:
    """One OpenAI-style request; returns its id and the text as the client received it."""
    body = {"model": "default", "messages": [{"role": "user", "content": text}], "temperature": 0,
            "max_tokens": 2000, "stream": stream}
    with requests.post(url + "/v1/chat/completions", json=body, stream=stream, timeout=180) as r:
        r.raise_for_status()
        if not stream:
            data = r.json()
            return {"id": data["id"], "text": data["choices"][0]["message"]["content"]}
        chunks, rid = [], None
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                rid = chunk["id"]
                chunks.append(chunk["choices"][0]["delta"].get("content") or "")
        return {"id": rid, "text": "".join(chunks)}


def collect(client: ChatClient, timeout: float) -> list[tuple[str, dict]]:
    events, deadline = [], time.monotonic() + timeout
    while not events or events[-1][0] not in ("done", "error"):
        events.append(client.next(max(0.1, deadline - time.monotonic())))
    return events


def test_a_worker_killed_mid_answer_loses_nothing_and_shows_nothing_twice(stack, db):
    url = stack.web_with(MAX_NEW_TOKENS="2000")   # long answers, so the kill lands mid-stream
    clients = [ChatClient(url) for _ in QUESTIONS]
    api_results: dict[str, dict] = {}
    api_threads = [threading.Thread(target=lambda kind=kind, text=text: api_results.__setitem__(
        kind, ask_api(url, text, stream=kind == "stream"))) for kind, text in API_MESSAGES.items()]
    try:
        # Five requests on four slots: some are being answered, one waits in the queue.
        for client, question in zip(clients, QUESTIONS):
            client.sio.emit("chat_message", {"text": question})
        for t in api_threads:
            t.start()
        first = [client.next(30) for client in clients]
        assert all(name == "accepted" for name, _ in first), first
        before_kill = [[] for _ in clients]
        while not any(name == "token" for events in before_kill for name, _ in events):
            for client, events in zip(clients, before_kill):
                if not client.events.empty():
                    events.append(client.next())
            time.sleep(0.005)

        killed_wall = time.time()
        stack.kill_worker()
        assert not any(events and events[-1][0] == "done" for events in before_kill), \
            "every answer finished before the kill; the test needs longer answers"
        killed_at = time.monotonic()
        stack.start_worker()
        restarted_at = time.monotonic()

        streams = [events + collect(client, 120) for client, events in zip(clients, before_kill)]
        for t in api_threads:
            t.join(180)
        print(f"\nworker restarted in {restarted_at - killed_at:.1f} s; all answers done "
              f"{time.monotonic() - restarted_at:.1f} s later")
    finally:
        for client in clients:
            client.close()

    for (_, accepted), events, early in zip(first, streams, before_kill):
        name, done = events[-1]
        assert name == "done", events[-1]
        assert done["finish_reason"] in ("stop", "length")
        shown = "".join(data["text"] for name, data in events if name == "token")
        assert shown == done["text"], "the stream showed text twice or skipped some"
        with db() as s:
            answers = s.query(Message).filter_by(request_id=accepted["request_id"]).all()
            record = s.get(RequestRecord, accepted["request_id"])
        assert [a.content for a in answers] == [done["text"]]
        assert record.finished_at is not None and record.completion_tokens == done["completion_tokens"]
        if any(name == "token" for name, _ in early):   # its customer's first token, not the redelivery's
            assert record.first_token_at.timestamp() < killed_wall, "the record's TTFT is not the one the customer saw"
            assert record.admitted_at <= record.first_token_at, "its queue wait is not the one the customer had"

    # The HTTP clients got exactly the answer an undisturbed greedy run gives.
    assert set(api_results) == set(API_MESSAGES)
    for kind, text in API_MESSAGES.items():
        assert api_results[kind]["text"] == ask_api(url, text, stream=False)["text"], kind
        with db() as s:
            record = s.get(RequestRecord, api_results[kind]["id"].removeprefix("chatcmpl-"))
        assert record.finished_at is not None and record.finish_reason in ("stop", "length")


@pytest.fixture()
def long_model_dir(tmp_path, tokenizer):
    """The tiny model with room for answers of thousands of tokens, which outlast a short grace period on
    any machine (the session's tiny model stops answering at 512 tokens of context, within half a second)."""
    return make_tiny_model_dir(tmp_path / "long", tokenizer, max_position_embeddings=8192)


@pytest.fixture()
def next_model_dir(tmp_path, tokenizer):
    """The model a deploy brings: the same tokenizer and shape, other weights. Generated again from the start, an
    answer would not begin as the customer already read it."""
    return make_tiny_model_dir(tmp_path / "next", tokenizer, seed=1, max_position_embeddings=8192)


def stream_logprobs(url: str, text: str, started: threading.Event, out: dict) -> None:
    """A streaming API answer of two choices with log-probabilities: its id, each choice's text and the tokens
    whose log-probabilities came with it, its usage; `started` is set at its first text."""
    body = {"model": "default", "messages": [{"role": "user", "content": text}], "temperature": 0.8, "seed": 4,
            "max_tokens": 600, "n": 2, "stream": True, "stream_options": {"include_usage": True}, "logprobs": True,
            "top_logprobs": 2}
    out.update(id=None, text={}, tokens={}, usage=None)
    with requests.post(url + "/v1/chat/completions", json=body, stream=True, timeout=300) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith(b"data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                out["id"], out["usage"] = chunk["id"].removeprefix("chatcmpl-"), chunk.get("usage") or out["usage"]
                if not chunk["choices"]:
                    continue
                choice = chunk["choices"][0]
                i = choice["index"]
                out["text"][i] = out["text"].get(i, "") + (choice["delta"].get("content") or "")
                out["tokens"][i] = out["tokens"].get(i, []) + [
                    bytes(e["bytes"]) for e in (choice.get("logprobs") or {}).get("content") or ()]
                if any(out["text"].values()):
                    started.set()


def test_a_worker_stopped_with_sigterm_hands_back_what_it_cannot_finish(stack, db, long_model_dir, next_model_dir):
    import redis

    from messaging.contract import admitted_at_key, shown_at_key, shown_key

    # Without grounding's lead, whose answers end at their first line break: on the random model that came within
    # 100-350 tokens, at times before the grace was over, and nothing was left to hand back.
    url = stack.web_with(MAX_NEW_TOKENS="1500", CHAT_GROUNDING="off")
    stack.kill_worker()
    # A short grace, so the answers are cut off.
    worker = stack.start_worker(SHUTDOWN_GRACE_S="0.5", MODEL=str(long_model_dir))
    clients = [ChatClient(url) for _ in QUESTIONS]
    try:
        for client, question in zip(clients, QUESTIONS):
            client.sio.emit("chat_message", {"text": question})
        accepted = [client.next(30) for client in clients]
        assert all(name == "accepted" for name, _ in accepted), accepted
        seen = [[client.next(30)] for client in clients]   # every answer has started streaming
        # An API client streaming two choices with log-probabilities: they go on too.
        api, api_started = {}, threading.Event()
        api_thread = threading.Thread(target=stream_logprobs, args=(url, API_MESSAGES["stream"], api_started, api))
        api_thread.start()
        assert api_started.wait(30), "the API answer never started"

        stopped_at, stopped_wall = time.monotonic(), time.time()
        worker.send_signal(signal.SIGTERM)
        code = worker.wait(60)   # bounded: the grace period, then the hand-back
        print(f"\nthe worker exited {time.monotonic() - stopped_at:.1f} s after SIGTERM with code {code}")
        handed_back = "back to the queue" in (stack.workdir / "worker.log").read_text()
        stack.start_worker(MODEL=str(next_model_dir))   # a deploy: the answers go on with other weights
        streams = [events + collect(client, 300) for client, events in zip(clients, seen)]   # 1500 tokens each, on a busy machine too
        api_thread.join(300)
    finally:
        for client in clients:
            client.close()
        stack.kill_worker()
        stack.start_worker()   # the session's worker, on the session's model, for the tests that follow
    assert handed_back, "no answer was still running when the grace period ended"
    log = (stack.workdir / "worker.log").read_text()
    assert "goes on from the" in log, "no answer continued from its tokens"
    # The API answer's choices went on from their tokens, log-probabilities and all: each token's came once.
    assert not api_thread.is_alive() and set(api["text"]) == {0, 1} and api["usage"]
    assert sum(map(len, api["tokens"].values())) == api["usage"]["completion_tokens"]
    assert f"{api['id']} goes on from the" in log, "the answer with choices and log-probabilities was generated again"
    r = redis.Redis.from_url(stack.env["REDIS_URL"])
    assert not r.exists(*(shown_key(api["id"], i) for i in range(2)), shown_at_key(api["id"]), admitted_at_key(api["id"]))
    with db() as s:
        record = s.get(RequestRecord, api["id"])
    assert record.continued_tokens and record.first_token_at.timestamp() < stopped_wall
    # Kept from the first delivery, before its prefill: not the redelivery's, nor bounded by the first text alone.
    assert record.admitted_at < record.first_token_at, "the API answer's queue wait is not the one its client had"
    continued = []
    for (_, acc), events in zip(accepted, streams):
        name, done = events[-1]
        assert name == "done" and done["finish_reason"] in ("stop", "length"), events[-1]
        # The text each customer read first is where the answer goes on from, and the stream adds up to it.
        assert "".join(d["text"] for n, d in events if n == "token") == done["text"]
        with db() as s:
            assert [m.content for m in s.query(Message).filter_by(request_id=acc["request_id"])] == [done["text"]]
            record = s.get(RequestRecord, acc["request_id"])
        # Its time to first token is the one its customer saw, before the stop, not the continuation's.
        assert record.first_token_at.timestamp() < stopped_wall
        assert record.admitted_at < record.first_token_at, "its queue wait is not the one its customer had"
        continued.append(record.continued_tokens)
        assert not r.exists(shown_key(acc["request_id"]), shown_at_key(acc["request_id"]),
                            admitted_at_key(acc["request_id"])), \
            "the record of what was shown goes with the answer's end"
    assert any(continued), f"the records say which answers went on after a hand-back: {continued}"
