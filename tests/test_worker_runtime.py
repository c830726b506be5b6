"""Worker-side request handling: long conversations lose their oldest turns; a redelivered answer resumes its stream."""

from __future__ import annotations

import pytest

from worker.engine import EngineConfig, InvalidRequestError, LLMEngine
from worker.publisher import Answer
from worker.runtime import fit_to_context


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
    answer = Answer({"request_id": "r"}, shown=7)   # an earlier delivery showed "Hello, "
    assert answer.unseen("Hel") is None
    assert answer.unseen("lo, wo") == ("wo", 7)        # regenerated text resumes mid-delta
    assert answer.unseen("rld") == ("rld", 9)
    fresh = Answer({"request_id": "s"}, shown=0)
    assert fresh.unseen("Hi") == ("Hi", 0) and fresh.unseen("") is None and fresh.unseen("!") == ("!", 2)
