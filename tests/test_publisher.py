"""The worker's publisher: each window's text for all requests in one message, exact offsets, ends after text."""

from __future__ import annotations

import json
import time

import pytest
import redis

from messaging.contract import STREAM_CHANNEL, streamed_key
from messaging.stream import decode_batch
from worker.engine import RequestFinished, TokenDelta
from worker.local_redis import start_redis
from worker.publisher import Publisher


@pytest.fixture()
def r(tmp_path):
    proc, url = start_redis(tmp_path / "redis", persist=False)
    try:
        yield redis.Redis.from_url(url)
    finally:
        proc.terminate()
        proc.wait(10)


def finished(request_id: str, text: str) -> RequestFinished:
    now = time.time()
    return RequestFinished(request_id=request_id, text=text, token_ids=[], finish_reason="stop", prompt_tokens=1,
                           completion_tokens=1, cached_tokens=0, arrival_time=now, admitted_time=now,
                           first_token_time=now, finished_time=now, mean_batch_size=1.0)


def batches(pubsub, count: int, timeout: float = 10) -> list[list]:
    out, deadline = [], time.monotonic() + timeout
    while len(out) < count and time.monotonic() < deadline:
        message = pubsub.get_message(timeout=0.1)
        if message is not None:
            out.append(decode_batch(message["data"]))
    return out


def job(rid: str, api: bool = False) -> dict:
    return {"request_id": rid, "room": None if api else f"room-{rid}", "channel": f"events:{rid}" if api else None}


def test_steps_within_a_window_go_out_as_one_message_for_every_request(r):
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(STREAM_CHANNEL)
    publisher = Publisher(r, on_redis_error=lambda: None, window_s=2.0)
    a, b = publisher.track(job("a"), [0]), publisher.track(job("b", api=True), [0])
    publisher.outbox.put([TokenDelta("a", "He", []), TokenDelta("b", "Hi", [])])   # first text: sent at once
    [first] = batches(pubsub, 1)
    assert [(e.name, e.room, e.api, e.data) for e in first] == [
        ("token", "room-a", False, {"request_id": "a", "text": "He", "offset": 0}),
        ("token", None, True, {"request_id": "b", "text": "Hi", "offset": 0})]
    # Four more steps inside the window, then one request ends: its end forces the text out first.
    for step in ([TokenDelta("a", "llo", [])], [TokenDelta("a", ",", []), TokenDelta("b", " the", [])],
                 [TokenDelta("a", " world", []), TokenDelta("b", "", [])], [TokenDelta("b", "re", [])]):
        publisher.outbox.put(step)
    assert batches(pubsub, 1, timeout=0.5) == [], "text inside the window is held back"
    publisher.outbox.put([finished("b", "Hi there")])
    [second] = batches(pubsub, 1)
    assert {e.data["request_id"]: (e.data["text"], e.data["offset"]) for e in second} == {
        "a": ("llo, world", 2), "b": (" there", 2)}
    assert b.ends.get(timeout=5).text == "Hi there"
    assert (int(r.get(streamed_key("a"))), int(r.get(streamed_key("b")))) == (12, 8)
    assert publisher.batches == 2


def test_a_window_of_zero_sends_each_step_and_a_redelivery_resumes_exactly(r):
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(STREAM_CHANNEL)
    publisher = Publisher(r, on_redis_error=lambda: None, window_s=0)
    publisher.track(job("c"), shown=[7])   # an earlier delivery showed "Hello, "
    for text in ("Hel", "lo, wo", "rld"):
        publisher.outbox.put([TokenDelta("c", text, [])])
        time.sleep(0.05)
    publisher.outbox.put([finished("c", "Hello, world")])
    got = [e.data for batch in batches(pubsub, 2) for e in batch]
    assert [(d["text"], d["offset"]) for d in got] == [("wo", 7), ("rld", 9)]
    assert int(r.get(streamed_key("c"))) == 12


def test_many_requests_and_steps_lose_nothing_and_keep_order(r):
    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(STREAM_CHANNEL)
    publisher = Publisher(r, on_redis_error=lambda: None, window_s=0.02)
    ids = [f"r{i}" for i in range(64)]
    answers = {rid: publisher.track(job(rid), [0]) for rid in ids}
    for step in range(50):
        publisher.outbox.put([TokenDelta(rid, f"{step},", []) for rid in ids])
        if step % 10 == 0:
            time.sleep(0.01)
    publisher.outbox.put([finished(rid, "") for rid in ids])
    for answer in answers.values():
        answer.ends.get(timeout=10)
    texts: dict[str, str] = {rid: "" for rid in ids}
    messages = batches(pubsub, publisher.batches)
    for batch in messages:
        for e in batch:
            assert e.data["offset"] == len(texts[e.data["request_id"]]), "a gap or a repeat"
            texts[e.data["request_id"]] += e.data["text"]
    expected = "".join(f"{step}," for step in range(50))
    assert texts == {rid: expected for rid in ids}
    assert len(messages) < 50, "steps were not coalesced"
    assert json.loads(r.get(streamed_key("r0"))) == len(expected)


def test_the_web_process_sends_the_same_packet_socketio_would():
    """The stream's events go to sockets as python-socketio's own emit would encode them."""
    from engineio import packet as eio_packet
    from socketio import packet as sio_packet

    from webapp.stream import StreamQueue

    sent = []

    class Server:
        def _send_eio_packet(self, eio_sid, pkt):
            sent.append((eio_sid, pkt.encode()))

    stream = StreamQueue("redis://127.0.0.1:1/0")
    stream.server = Server()
    stream.rooms = {"/": {"conv": {"sid1": "eio1", "sid2": "eio2"}}}
    stream.get_participants = lambda namespace, room: list(stream.rooms[namespace][room].items())
    data = {"request_id": "r", "text": "Hé \"quoted\" </script>", "offset": 3}
    stream.emit_here("token", data, "conv")
    expected = eio_packet.Packet(eio_packet.MESSAGE,
                                 sio_packet.Packet(sio_packet.EVENT, namespace="/", data=["token", data]).encode())
    assert sent == [("eio1", expected.encode()), ("eio2", expected.encode())]


def test_choices_stream_with_their_index_and_logprobs_and_the_request_ends_with_its_last_choice(r, tokenizer):
    from dataclasses import replace

    from messaging.jobs import TOKENS_AS_IDS
    from worker.engine import TokenLogprob
    from worker.token_json import TokenJson

    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(STREAM_CHANNEL)
    tokens = TokenJson(tokenizer)
    publisher = Publisher(r, on_redis_error=lambda: None, window_s=0, describe=tokens)
    answer = publisher.track(job("d", api=True), [0])
    entry = TokenLogprob(token_id=7, logprob=-0.5, rank=1, top=[])
    publisher.outbox.put([TokenDelta("d", "A", [7], index=0, logprobs=[entry]),
                          TokenDelta("d", "", [8], index=1, logprobs=[replace(entry, token_id=8)])])
    [first] = batches(pubsub, 1)
    assert [e.data for e in first] == [
        {"request_id": "d", "text": "A", "offset": 0, "logprobs": [{**tokens.one(7, -0.5), "top_logprobs": []}]},
        {"request_id": "d", "text": "", "offset": 0, "index": 1,
         "logprobs": [{**tokens.one(8, -0.5), "top_logprobs": []}]}]
    # A request that asked for vLLM's return_tokens_as_token_ids: the same entries, each token named by its id.
    publisher.track({**job("e", api=True), TOKENS_AS_IDS: True}, [0])
    publisher.outbox.put([TokenDelta("e", "A", [7], index=0, logprobs=[replace(entry, top=[(9, -1.5)])])])
    [ids] = batches(pubsub, 1)
    assert ids[0].data["logprobs"] == [{"token": "token_id:7", "logprob": -0.5, "bytes": tokens.one(7, 0)["bytes"],
                                        "top_logprobs": [{"token": "token_id:9", "logprob": -1.5,
                                                          "bytes": tokens.one(9, 0)["bytes"]}]}]
    publisher.outbox.put([replace(finished("d", "A"), index=0, finished=False)])
    time.sleep(0.2)
    assert answer.ends.empty(), "one choice ended; the request has not"
    publisher.outbox.put([TokenDelta("d", "Bc", [9], index=1), replace(finished("d", "Bc"), index=1)])
    assert answer.wait().index == 1 and [e.text for e in answer.ordered()] == ["A", "Bc"]
    assert (int(r.get(streamed_key("d"))), int(r.get(streamed_key("d", 1)))) == (1, 2), "each choice's position"


def test_choice_0s_text_is_recorded_with_the_tokens_that_wrote_it(r, tokenizer):
    """What a redelivery goes on from (worker/continuation.py): the text as sent, a lead the worker wrote apart from
    the model's tokens, a character's first bytes with the token that finished it; another choice's on its own."""
    from messaging.contract import shown_key
    from worker.continuation import Shown, Written

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    publisher = Publisher(r, on_redis_error=lambda: None, window_s=0)
    answer = publisher.track(job("s"), [0])
    emoji = ids(" 👋")
    assert len(emoji) > 1, "the test needs a character written by more than one token"
    steps = [[Written("s", "Order 12 shipped. ", [])], [TokenDelta("s", "It", ids("It"))],
             [TokenDelta("s", "", emoji[:1])], [TokenDelta("s", " 👋", emoji[1:]), TokenDelta("s", "x", [5], index=1)],
             [TokenDelta("s", " arrives", ids(" arrives"))]]
    for step in steps:
        publisher.outbox.put(step)
        time.sleep(0.05)
    publisher.outbox.put([finished("s", "")])
    answer.ends.get(timeout=5)   # handed over after its text was sent
    shown = Shown.read(r.lrange(shown_key("s"), 0, -1), int(r.get(streamed_key("s"))))
    assert shown.text == "Order 12 shipped. It 👋 arrives"
    lead, written = shown.split_lead()
    assert lead == "Order 12 shipped. " and written.text == "It 👋 arrives"
    assert written.pieces[0][1] == ids("It"), "the recorded tokens, not the text tokenized again"
    assert written.tokens(tokenizer) == ids("It") + emoji + ids(" arrives")
    assert Shown.read(r.lrange(shown_key("s"), 0, -1), 5) is None, "a record short of what was sent is not used"
    assert Shown.read(r.lrange(shown_key("s", 1), 0, -1), 1).pieces == [("x", [5])]

    # A redelivery that showed "Hello," before: the text and tokens after it are added.
    answer = publisher.track(job("t"), shown=[6])
    for text in ("Hello", ", world"):
        publisher.outbox.put([TokenDelta("t", text, ids(text))])
        time.sleep(0.05)
    publisher.outbox.put([finished("t", "")])
    answer.ends.get(timeout=5)
    assert [json.loads(e) for e in r.lrange(shown_key("t"), 0, -1)] == [[[" world", ids(", world")]]]


def test_an_answer_generated_again_sends_no_log_probability_twice(r, tokenizer):
    """A redelivery that cannot go on from the earlier tokens (their record is lost) generates the answer again: its
    tokens within what was shown had their log-probabilities sent by the earlier delivery, so a window that straddles
    that point sends only the rest's. One that goes on from them sends every new token's."""
    from dataclasses import replace

    from worker.engine import TokenLogprob
    from worker.token_json import TokenJson

    pubsub = r.pubsub(ignore_subscribe_messages=True)
    pubsub.subscribe(STREAM_CHANNEL)
    entry = TokenLogprob(token_id=0, logprob=-0.5, rank=1, top=[])
    publisher = Publisher(r, on_redis_error=lambda: None, window_s=0.5, describe=TokenJson(tokenizer))

    def delta(text: str, token: int, **kwargs) -> TokenDelta:
        return TokenDelta("g", text, [token], logprobs=[replace(entry, token_id=token)], **kwargs)

    def sent() -> list[tuple[str, list[str]]]:
        return [(e.data["text"], [lp["token"] for lp in e.data["logprobs"]]) for batch in batches(pubsub, 1)
                for e in batch]

    tokens = {text: tokenizer(text, add_special_tokens=False)["input_ids"][0] for text in ("Hi", " there", ",", " how")}
    spelled = {text: TokenJson(tokenizer).one(token, 0)["token"] for text, token in tokens.items()}
    # An earlier delivery showed "Hi there" (two tokens, their log-probabilities sent); this one generates it again.
    answer = publisher.track(job("g", api=True), [8])
    publisher.outbox.put([delta(text, tokens[text]) for text in ("Hi", " there", ",", " how")])
    assert sent() == [(", how", [spelled[","], spelled[" how"]])]
    publisher.outbox.put([finished("g", "Hi there, how")])
    answer.ends.get(timeout=5)
    batches(pubsub, 1)
    # Going on from those tokens instead: the deltas carry only new tokens, each sent.
    publisher.forget("g")
    answer = publisher.track(job("g", api=True), [8])
    publisher.outbox.put([delta("Hi there,", tokens[","], continued=2), delta(" how", tokens[" how"])])
    assert sent() == [(", how", [spelled[","], spelled[" how"]])]


def test_the_time_an_answers_text_was_first_sent_is_kept_across_deliveries(r):
    """A redelivered answer's time to first token is its customer's (worker/job.py reads it back)."""
    from messaging.contract import shown_at_key

    publisher = Publisher(r, on_redis_error=lambda: None, window_s=0)
    before = time.time()
    answer = publisher.track(job("u"), [0])
    publisher.outbox.put([TokenDelta("u", "", [1])])
    time.sleep(0.1)
    assert r.get(shown_at_key("u")) is None, "no text was sent yet"
    publisher.outbox.put([TokenDelta("u", "Hi", [2])])
    time.sleep(0.1)
    first = float(r.get(shown_at_key("u")))
    assert before <= first <= time.time()
    publisher.outbox.put([TokenDelta("u", " there", [3])])
    publisher.outbox.put([finished("u", "Hi there")])
    answer.ends.get(timeout=5)
    assert float(r.get(shown_at_key("u"))) == first, "later text leaves the first time as it was"
    assert r.ttl(shown_at_key("u")) > 0

    # A redelivery keeps the earlier delivery's time.
    publisher.forget("u")
    answer = publisher.track(job("u"), shown=[8])
    for text in ("Hi there", ", how"):
        publisher.outbox.put([TokenDelta("u", text, [4])])
        time.sleep(0.05)
    publisher.outbox.put([finished("u", "Hi there, how")])
    answer.ends.get(timeout=5)
    assert float(r.get(shown_at_key("u"))) == first


def test_the_time_an_answer_was_first_admitted_is_kept_across_deliveries(r):
    """A redelivered answer's queue wait is its customer's: the engine's admission that came with the first delivery's
    first delta, kept once text went out (worker/job.py reads it back)."""
    from messaging.contract import admitted_at_key

    publisher = Publisher(r, on_redis_error=lambda: None, window_s=0)
    answer = publisher.track(job("a"), [0])
    publisher.outbox.put([TokenDelta("a", "", [1], admitted_time=1000.5)])   # a character's first bytes
    time.sleep(0.1)
    assert r.get(admitted_at_key("a")) is None, "nothing was sent yet"
    publisher.outbox.put([TokenDelta("a", "Hi", [2])])
    time.sleep(0.1)
    assert float(r.get(admitted_at_key("a"))) == 1000.5 and r.ttl(admitted_at_key("a")) > 0
    publisher.outbox.put([finished("a", "Hi")])
    answer.ends.get(timeout=5)

    publisher.forget("a")   # the redelivery's own admission is later: the first stays
    answer = publisher.track(job("a"), shown=[2])
    publisher.outbox.put([TokenDelta("a", "Hi", [2], admitted_time=2000.25)])
    publisher.outbox.put([TokenDelta("a", " you", [3])])
    publisher.outbox.put([finished("a", "Hi you")])
    answer.ends.get(timeout=5)
    assert float(r.get(admitted_at_key("a"))) == 1000.5
