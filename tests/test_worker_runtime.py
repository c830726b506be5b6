"""Worker-side request preparation: long conversations are trimmed from their oldest turns."""

from __future__ import annotations

import pytest

from worker.engine import EngineConfig, InvalidRequestError, LLMEngine
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
