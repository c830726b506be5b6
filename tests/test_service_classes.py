"""Service classes in the engine: interactive requests first, lower classes preempted for them with their answers
unchanged, bulk never starved."""

from __future__ import annotations

import pytest

from worker.engine import EngineConfig, InvalidRequestError, LLMEngine, RequestFinished, SamplingParams
from worker.engine.sequence import SERVICE_CLASSES


def greedy(cap: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=cap, ignore_eos=True)


def prompt(i: int, length: int = 12) -> list[int]:
    return [(7 * i + 3 * j) % 500 + 5 for j in range(length)]


def run(engine: LLMEngine, results: dict, steps: int | None = None) -> list:
    """Step (all the way, or `steps` times); the step at which each request got its first token."""
    firsts, n = {}, 0
    while engine.has_unfinished() and (steps is None or n < steps):
        for event in engine.step():
            if isinstance(event, RequestFinished):
                results[event.request_id] = event
            elif event.request_id not in firsts:
                firsts[event.request_id] = engine.steps
        n += 1
    return firsts


def alone(tiny, ids: list[int], cap: int) -> list[int]:
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4, max_num_batched_tokens=64, block_size=4,
                                                num_blocks=200))
    engine.add_request("x", prompt_token_ids=ids, params=greedy(cap))
    results = {}
    run(engine, results)
    engine.release_model()
    return results["x"].token_ids


def test_an_interactive_request_preempts_bulk_when_every_slot_is_taken_and_answers_stay_the_same(tiny):
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=3, max_num_batched_tokens=64, block_size=4,
                                                num_blocks=200, bulk_token_share=0.0))
    for i in range(3):
        engine.add_request(f"bulk{i}", prompt_token_ids=prompt(i), params=greedy(30), service_class="bulk")
    results: dict = {}
    run(engine, results, steps=4)   # every slot decoding bulk
    assert engine.stats().running == 3
    engine.add_request("chat", prompt_token_ids=prompt(9), params=greedy(10), service_class="interactive")
    start = engine.steps
    firsts = run(engine, results)
    assert firsts["chat"] == start + 1   # its first token in the very next step
    assert engine.stats().class_preemptions >= 1
    assert sum(results[f"bulk{i}"].preemptions for i in range(3)) >= 1
    engine.release_model()
    for i in range(3):   # a preempted request resumes with no change to its output
        assert results[f"bulk{i}"].token_ids == alone(tiny, prompt(i), 30), i
    assert results["chat"].token_ids == alone(tiny, prompt(9), 10)


def test_an_interactive_request_preempts_lower_classes_when_the_pool_is_short(tiny):
    model, tok = tiny
    # 13 blocks of 4 tokens: after 12 steps two standard requests (12-token prompts) hold 12 of them
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=8, max_num_batched_tokens=64, block_size=4,
                                                num_blocks=13, bulk_token_share=0.0))
    for i in range(2):
        engine.add_request(f"std{i}", prompt_token_ids=prompt(i), params=greedy(20))
    results: dict = {}
    run(engine, results, steps=12)
    engine.add_request("chat", prompt_token_ids=prompt(9), params=greedy(6), service_class="interactive")
    start = engine.steps
    firsts = run(engine, results)
    assert firsts["chat"] == start + 1
    assert engine.stats().class_preemptions >= 1
    engine.release_model()
    for i in range(2):
        assert results[f"std{i}"].token_ids == alone(tiny, prompt(i), 20), i


def test_waiting_requests_are_served_by_class_then_arrival(tiny):
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=1, max_num_batched_tokens=64, block_size=4,
                                                num_blocks=200, bulk_token_share=0.0))
    arrivals = [("b", "bulk"), ("s1", "standard"), ("i", "interactive"), ("s2", "standard")]
    for t, (rid, cls) in enumerate(arrivals):
        engine.add_request(rid, prompt_token_ids=prompt(t), params=greedy(3), service_class=cls, arrival_time=100 + t)
    results: dict = {}
    firsts = run(engine, results)
    assert sorted(firsts, key=firsts.get) == ["i", "s1", "s2", "b"]


@pytest.mark.parametrize("share", [0.25, 0.0])
def test_bulk_keeps_its_share_of_the_steps_while_standard_requests_keep_coming(tiny, share):
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=2, max_num_batched_tokens=40, block_size=4,
                                                num_blocks=400, bulk_token_share=share))
    results: dict = {}
    for i in range(2):
        engine.add_request(f"s{i}", prompt_token_ids=prompt(i), params=greedy(4))
    bulk = engine.add_request("bulk", prompt_token_ids=prompt(0, 30), params=greedy(4), service_class="bulk")
    for i in range(2, 14):   # a standard request arrives every step, more than the slots can take
        engine.add_request(f"s{i}", prompt_token_ids=prompt(i), params=greedy(4))
        run(engine, results, steps=1)
    assert len(engine.scheduler.waiting) > 2   # standard requests were always waiting
    # with a share, bulk is admitted as soon as a slot frees; without, it waits behind every standard request
    assert (bulk.admitted_time is not None) == (share > 0)
    engine.release_model()


def test_an_unknown_service_class_is_refused_naming_the_classes(tiny):
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=2, num_blocks=64, block_size=4))
    with pytest.raises(InvalidRequestError, match="choose one of interactive, standard, bulk"):
        engine.add_request("x", prompt_token_ids=[1, 2, 3], service_class="priority")
    assert SERVICE_CLASSES == ("interactive", "standard", "bulk")
    with pytest.raises(ValueError, match="bulk_token_share"):
        EngineConfig(bulk_token_share=1.5).validate()
    engine.release_model()


@pytest.mark.real_model
def test_preempted_bulk_answers_equal_their_answers_alone_on_the_real_default_model(served_model):
    """The default model as the worker serves it (WEIGHTS=auto): three bulk requests fill every slot, a chat
    arrives mid-decode and preempts one; every answer equals the same request's answer in an engine of its own."""
    from tests.test_engine import QUESTIONS, chat_ids

    model, tok = served_model
    config = EngineConfig(max_num_seqs=3, max_num_batched_tokens=64, bulk_token_share=0.0)
    prompts = {f"bulk{i}": chat_ids(tok, QUESTIONS[i]) for i in range(3)} | {"chat": chat_ids(tok, QUESTIONS[3])}
    caps = {"bulk0": 40, "bulk1": 40, "bulk2": 40, "chat": 16}
    engine = LLMEngine(model, tok, config)
    for i in range(3):
        engine.add_request(f"bulk{i}", prompt_token_ids=prompts[f"bulk{i}"], params=greedy(caps[f"bulk{i}"]),
                           service_class="bulk")
    results: dict = {}
    run(engine, results, steps=8)
    assert engine.stats().running == 3
    engine.add_request("chat", prompt_token_ids=prompts["chat"], params=greedy(caps["chat"]),
                       service_class="interactive")
    start = engine.steps
    firsts = run(engine, results)
    assert firsts["chat"] == start + 1
    assert engine.stats().class_preemptions >= 1
    assert sum(results[f"bulk{i}"].preemptions for i in range(3)) >= 1
    engine.release_model()
    for rid, ids in prompts.items():   # each alone, in a fresh engine on the same model
        solo = LLMEngine(model, tok, config)
        solo.add_request(rid, prompt_token_ids=ids, params=greedy(caps[rid]))
        alone_results: dict = {}
        run(solo, alone_results)
        solo.release_model()
        assert results[rid].token_ids == alone_results[rid].token_ids, rid
    assert results["bulk0"].text.strip(), "the real model answers in words"
