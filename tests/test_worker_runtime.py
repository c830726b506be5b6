"""Worker-side request handling: long conversations lose their oldest turns; a redelivered answer resumes its stream;
leases and lost acks."""

from __future__ import annotations

import time

import pytest
import redis

from worker.engine import EngineConfig, InvalidRequestError, LLMEngine
from worker.publisher import Answer
from worker.local_redis import start_redis
from worker.prompts import fit_to_context


def test_fit_to_context_drops_oldest_turns_but_keeps_system_and_newest(tiny):
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_model_len=160, num_blocks=64))
    turns = [{"role": "system", "content": "You are a shop assistant."}]
    for i in range(12):
        turns += [{"role": "user", "content": f"Question number {i} about my order"},
                  {"role": "assistant", "content": f"Answer number {i} about your order"}]
    turns.append({"role": "user", "content": "And the newest question?"})
    fitted, ids = fit_to_context(engine, turns, reserve=40)
    assert ids == engine.render_chat(fitted)
    assert fitted[0] == turns[0] and fitted[-1] == turns[-1]
    assert fitted[1:] == turns[len(turns) - len(fitted) + 1:], "only a run of the oldest turns is dropped"
    assert len(engine.render_chat(fitted)) <= 120 < len(engine.render_chat(turns))
    with pytest.raises(InvalidRequestError, match="shorten"):
        fit_to_context(engine, [turns[0], {"role": "user", "content": "word " * 400}], reserve=40)


def test_a_redelivered_answer_streams_only_what_clients_have_not_seen():
    answer = Answer({"request_id": "r"}, shown={0: 7, 1: 2})   # an earlier delivery showed "Hello, " and "Hi"
    assert answer.unseen("Hel") is None
    assert answer.unseen("lo, wo") == ("wo", 7)        # regenerated text resumes mid-delta
    assert answer.unseen("rld") == ("rld", 9)
    assert answer.unseen("Hi there", index=1) == (" there", 2), "each choice resumes after its own"
    assert answer.unseen("!", index=2) == ("!", 0)
    fresh = Answer({"request_id": "s"}, shown={})
    assert fresh.unseen("Hi") == ("Hi", 0) and fresh.unseen("") is None and fresh.unseen("!") == ("!", 2)


def test_a_continued_answers_log_probabilities_all_go_out_however_its_text_falls():
    """A choice generated again sends nothing of what was shown, log-probabilities included (its client has them);
    one that goes on from the earlier delivery's tokens carries only new tokens' (worker/continuation.py): each goes
    out, at the client's position, even when its delta's text was all shown (the continued text, then a token that
    writes part of a character), or when the continued text comes a few characters late."""
    again = Answer({"request_id": "r"}, shown={0: 5})
    assert again.unseen("Hello", carries=True) is None, "the earlier delivery sent these"
    continued = Answer({"request_id": "r"}, shown={0: 5, 1: 5}, continued={0, 1})
    assert continued.unseen("Hello", carries=True) == ("", 5)
    assert continued.unseen("!", carries=True) == ("!", 5)
    assert continued.unseen("Hel", index=1, carries=True) == ("", 5)
    assert continued.unseen("lo", index=1, carries=True) == ("", 5)
    assert continued.unseen(" you", index=1, carries=True) == (" you", 5)
    text_only = Answer({"request_id": "c"}, shown={0: 5}, continued={0})   # a chat: no log-probabilities
    assert text_only.unseen("Hel") is None and text_only.unseen("lo") is None and text_only.unseen("!") == ("!", 5)


def test_a_lost_ack_of_an_answered_request_is_sent_again_and_a_lost_hand_back_stays_leased(tmp_path, monkeypatch):
    from worker import leases as leases_module
    from worker.leases import UNACKED, UNACKED_INDEX, Leases

    proc, url = start_redis(tmp_path / "redis", persist=False)
    try:
        r = redis.Redis.from_url(url)
        leases = Leases(r, visibility_timeout=6)
        for tag in ("answered", "handed-back", "acked"):
            r.zadd(UNACKED_INDEX, {tag: time.time()})
            r.hset(UNACKED, tag, "the message")
            leases.hold(f"task-{tag}", tag)
        # Redis went away as two of the acks were sent: only the third landed.
        r.zrem(UNACKED_INDEX, "acked")
        r.hdel(UNACKED, "acked")
        leases.release("task-answered", answered=True)
        leases.release("task-handed-back", answered=False)
        leases.release("task-acked", answered=True)

        leases.forget_acked()   # within the grace period an ack may still be on its way
        assert sorted(leases.held()) == ["answered", "handed-back"]
        assert r.zscore(UNACKED_INDEX, "answered") is not None

        monkeypatch.setattr(leases_module, "ACK_GRACE_S", 0)
        leases.forget_acked()
        # Answered: acked now, never delivered again. Handed back: still leased until ACK_WAIT_S, then
        # delivered again, since the queue must not lose it.
        assert r.zscore(UNACKED_INDEX, "answered") is None and not r.hexists(UNACKED, "answered")
        assert leases.held() == ["handed-back"]
        assert r.zscore(UNACKED_INDEX, "handed-back") is not None and r.hexists(UNACKED, "handed-back")
    finally:
        proc.terminate()
        proc.wait(10)


def test_choices_are_stored_as_one_record_and_reported_each_with_its_own_end():
    import time
    from dataclasses import replace

    from worker.engine import RequestFinished
    from worker.ends import api_fields, combined

    now = time.time()
    first = RequestFinished(request_id="r", text="Hi", token_ids=[1], finish_reason="stop", prompt_tokens=5,
                            completion_tokens=1, cached_tokens=0, arrival_time=now, admitted_time=now,
                            first_token_time=now + 1, finished_time=now + 2, mean_batch_size=1.0, finished=False,
                            stop_reason="END")
    second = replace(first, text="Hello", completion_tokens=3, finish_reason="length", index=1, stop_reason=None,
                     first_token_time=now + 0.5, finished_time=now + 3, finished=True, continued_tokens=2)
    record = combined([first, second])
    assert (record.text, record.completion_tokens, record.finish_reason) == ("Hi", 4, "stop")
    assert record.continued_tokens == 2, "an earlier delivery wrote 2 of the 4: the worker generated 2"
    assert (record.first_token_time, record.finished_time) == (now + 0.5, now + 3)
    assert combined([first, replace(second, finish_reason="error", error="boom")]).error == "boom"
    fields = api_fields({"request_id": "r"}, [first, second], None, lambda ids: "")
    assert fields == {"choices": [
        {"index": 0, "text": "Hi", "finish_reason": "stop", "completion_tokens": 1, "stop_reason": "END"},
        {"index": 1, "text": "Hello", "finish_reason": "length", "completion_tokens": 3, "stop_reason": None}]}
