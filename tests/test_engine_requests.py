"""Per-request features through the engine: structured output, n choices, log-probabilities, penalties, bias."""

from __future__ import annotations

import queue
from enum import Enum
from typing import Literal, Union

import pytest
import torch
from pydantic import BaseModel, ConfigDict, Field, TypeAdapter

from structured import Structure
from tests.test_engine import (QUESTIONS, chat_ids, drain, greedy, no_fallbacks, reference,  # noqa: F401
                               ref_model, run_all)
from worker.engine import (EngineConfig, InvalidParamsError, InvalidRequestError, LLMEngine, RequestFinished,
                           SamplingParams, TokenDelta)
from worker.engine.detokenizer import token_bytes
from worker.model_loader import load_model



class Strict(BaseModel):
    """additionalProperties: false, as strict tool schemas have (else any key name, of any length, fits)."""

    model_config = ConfigDict(extra="forbid")


class Size(str, Enum):
    small = "small"
    medium = "medium"
    large = "large"


class Line(Strict):
    sku: str = Field(max_length=8)
    qty: int = Field(ge=1, le=9)


class Order(Strict):
    id: int = Field(ge=0, le=999)
    size: Size
    lines: list[Line] = Field(min_length=1, max_length=2)
    note: str = Field(max_length=12)
    gift: bool


class LookUp(Strict):
    name: Literal["look_up"]
    arguments: Line


class Cancel(Strict):
    name: Literal["cancel"]
    arguments: Order


TOOL_CALL = TypeAdapter(Union[LookUp, Cancel])
ORDER = Structure(Order.model_json_schema())
TOOLS = Structure(TOOL_CALL.json_schema(), begin="<tool_call>\n", end="\n</tool_call>", repeat=True)


def tool_calls(text: str) -> list:
    assert text.startswith("<tool_call>\n") and text.endswith("\n</tool_call>"), text
    bodies = text.removeprefix("<tool_call>\n").removesuffix("\n</tool_call>").split("\n</tool_call>\n<tool_call>\n")
    return [TOOL_CALL.validate_json(body) for body in bodies]


def engine_for(model, tok, **config) -> LLMEngine:
    return LLMEngine(model, tok, EngineConfig(**{"max_num_seqs": 4, "num_blocks": 64, **config}))


# ---- structured output --------------------------------------------------------------------------------------------

def mixed_requests(tok) -> dict[str, tuple[list[int], SamplingParams]]:
    eos = tok.eos_token_id
    return {
        "order-sampled": (chat_ids(tok, QUESTIONS[0]), SamplingParams(temperature=1.0, seed=1, max_new_tokens=300,
                                                                       structure=ORDER)),
        "order-greedy": (chat_ids(tok, QUESTIONS[1]), SamplingParams(temperature=0, max_new_tokens=300,
                                                                      structure=ORDER)),
        "order-filtered": (chat_ids(tok, QUESTIONS[2]), SamplingParams(temperature=0.8, top_k=20, top_p=0.9, seed=2,
                                                                        repetition_penalty=1.2, max_new_tokens=300,
                                                                        structure=ORDER, logprobs=2)),
        # EOS is allowed only where the calls are complete: a bias makes the model take it there.
        "tools": (chat_ids(tok, QUESTIONS[3]), SamplingParams(temperature=0.9, seed=3, max_new_tokens=400,
                                                               structure=TOOLS, logit_bias={eos: 12.0})),
        "plain0": (chat_ids(tok, QUESTIONS[4], None), greedy(20)),
        "plain1": (chat_ids(tok, QUESTIONS[5]), greedy(25)),
        "plain2": (chat_ids(tok, QUESTIONS[6]), greedy(15)),
    }


@pytest.mark.parametrize("arrivals", ["together", "staggered"])
def test_constrained_answers_validate_beside_plain_ones_with_preemption_caching_and_overlap(tiny_model_dir, ref_model,
                                                                                          arrivals):
    """Every constrained answer parses and validates; unconstrained ones still equal generate; overlapped steps
    (constrained rows drawn after the read-back) give the same tokens as plain ones."""
    results = {}
    for overlap in (False, True):
        model, tok = load_model(str(tiny_model_dir))
        engine = engine_for(model, tok, max_num_batched_tokens=32, block_size=4, num_blocks=60, overlap_steps=overlap)
        requests = mixed_requests(tok)
        done, step = {}, 0
        order = list(requests)
        while order or engine.has_unfinished():
            if order and (arrivals == "together" or step % 3 == 0):
                for rid in (order if arrivals == "together" else order[:1]):
                    ids, params = requests[rid]
                    engine.add_request(rid, prompt_token_ids=ids, params=params)
                order = [] if arrivals == "together" else order[1:]
            drain(engine, done)
            step += 1
        assert engine.stats().preemptions > 0 and engine.stats().kv_blocks_used == 0
        assert sum(r.cached_tokens for r in done.values()) > 0
        results[overlap] = done
        for rid in ("order-sampled", "order-greedy", "order-filtered"):
            assert done[rid].finish_reason == "stop", (rid, done[rid].text)
            Order.model_validate_json(done[rid].text)
            assert tok.eos_token_id not in done[rid].token_ids   # the value completed the answer
        assert done["tools"].finish_reason == "stop" and done["tools"].token_ids[-1] == tok.eos_token_id
        assert len(tool_calls(done["tools"].text)) >= 1
        assert len(done["order-filtered"].logprobs) == done["order-filtered"].completion_tokens
        for rid in ("plain0", "plain1", "plain2"):
            ids, params = requests[rid]
            assert done[rid].token_ids == reference(ref_model, ids, params.max_new_tokens), rid
    assert {rid: r.token_ids for rid, r in results[True].items()} == \
        {rid: r.token_ids for rid, r in results[False].items()}


def test_a_constrained_answer_streams_is_not_cut_by_a_stop_string_inside_it_and_cancels(tiny):
    """Stop strings are checked after the grammar: one that the structured value holds does not cut it short."""
    model, tok = tiny
    engine = engine_for(model, tok)
    ids = chat_ids(tok, QUESTIONS[0])
    engine.add_request("full", prompt_token_ids=ids, params=SamplingParams(temperature=0, max_new_tokens=300,
                                                                           structure=ORDER))
    engine.add_request("cut", prompt_token_ids=ids, params=SamplingParams(temperature=0, max_new_tokens=300,
                                                                          structure=ORDER, stop=['"size"']))
    engine.add_request("cancelled", prompt_token_ids=ids, params=SamplingParams(temperature=0, max_new_tokens=300,
                                                                                structure=ORDER))
    done, deltas = {}, {}
    for _ in range(4):
        drain(engine, done, deltas)
    cancel = engine.abort_request("cancelled")
    assert cancel[-1].finish_reason == "cancelled" and 0 < cancel[-1].completion_tokens < 10
    more, more_deltas = run_all(engine)
    done.update(more)
    for rid, parts in more_deltas.items():
        deltas.setdefault(rid, []).extend(parts)
    full = done["full"].text
    Order.model_validate_json(full)
    assert "".join(deltas["full"]) == full
    assert '"size"' in full
    assert done["cut"].finish_reason == "stop" and done["cut"].text == full
    Order.model_validate_json(done["cut"].text)
    assert "".join(deltas["cut"]) == done["cut"].text
    assert full.startswith(cancel[-1].text)
    assert engine.stats().kv_blocks_used == 0 and engine.stats().running == 0


def test_structures_compile_once_and_bad_ones_are_refused_with_the_reason(tiny):
    model, tok = tiny
    engine = engine_for(model, tok)
    for i in range(3):
        engine.add_request(f"r{i}", prompt_token_ids=chat_ids(tok, "Hi"),
                           params=SamplingParams(max_new_tokens=5, structure=Structure(Order.model_json_schema())))
    assert engine.grammars.compiles == 1
    with pytest.raises(InvalidParamsError, match="structure: .*unclosed group"):
        engine.add_request("bad", prompt_token_ids=[1, 2], params=SamplingParams(
            structure=Structure({"type": "string", "pattern": "(("})))
    with pytest.raises(InvalidParamsError, match="structure: .*Unimplemented keys"):
        engine.add_request("bad", prompt_token_ids=[1, 2], params=SamplingParams(
            structure=Structure({"type": "object", "not": {"required": ["a"]}})))
    with pytest.raises(InvalidRequestError, match=r"logit_bias names token ids the model does not have: \[49152\]"):
        engine.add_request("bad", prompt_token_ids=[1, 2], params=SamplingParams(logit_bias={49152: 1.0, 5: 1.0}))
    assert "bad" not in engine.seqs


def test_a_wider_lm_head_never_lets_a_constrained_row_pick_a_padding_id(tokenizer, tiny_model_dir):
    model, tok = load_model(str(tiny_model_dir))
    width = len(tok) + 40
    model.resize_token_embeddings(width)
    with torch.no_grad():   # padding ids the model would love to pick
        model.get_output_embeddings().weight[len(tok):] = model.get_output_embeddings().weight[:40] * 50
    engine = engine_for(model, tok)
    assert engine.vocab == width
    engine.add_request("c", prompt_token_ids=chat_ids(tok, "Hi"),
                       params=SamplingParams(temperature=1.0, seed=4, max_new_tokens=300, structure=ORDER,
                                             logit_bias={width - 1: 1.0}))
    done = run_all(engine)[0]["c"]
    Order.model_validate_json(done.text)
    assert max(done.token_ids) < len(tok)


# ---- n choices ----------------------------------------------------------------------------------------------------

def test_choices_share_the_prompt_blocks_and_seeded_ones_reproduce(tiny, ref_model):
    model, tok = tiny
    ids = chat_ids(tok, QUESTIONS[3])

    def run(params: SamplingParams) -> tuple[list[RequestFinished], LLMEngine, list]:
        engine = engine_for(model, tok, block_size=4, num_blocks=128)
        engine.add_request("n", prompt_token_ids=ids, params=params)
        events = []
        while engine.has_unfinished():
            events += engine.step()
        return [e for e in events if isinstance(e, RequestFinished)], engine, events

    sampled = SamplingParams(temperature=1.0, seed=9, max_new_tokens=12, ignore_eos=True, n=3)
    first, engine, events = run(sampled)
    assert sorted(f.index for f in first) == [0, 1, 2]
    assert [f.finished for f in first] == [False, False, True]   # the request's last event ends it
    # The first choice computed the prompt; the others found its full blocks in the cache.
    shared = (len(ids) - 1) // 4 * 4
    assert engine.blocks.prefix_hit_tokens == 2 * shared
    assert sorted(f.cached_tokens for f in first) == [0, shared, shared]
    texts = {f.index: "".join(e.text for e in events if isinstance(e, TokenDelta) and e.index == f.index)
             for f in first}
    assert all(texts[f.index] == f.text for f in first)
    assert len({tuple(f.token_ids) for f in first}) == 3   # copies draw differently
    again, _, _ = run(sampled)
    assert {f.index: f.token_ids for f in again} == {f.index: f.token_ids for f in first}
    one, _, _ = run(SamplingParams(**{**sampled.__dict__, "n": 1}))
    assert one[0].token_ids == next(f.token_ids for f in first if f.index == 0)   # choice 0 is the request alone

    greedy_choices, _, _ = run(greedy(10, n=2))
    assert [f.token_ids for f in greedy_choices] == [reference(ref_model, ids, 10)] * 2


def test_constrained_choices_each_follow_their_own_matcher(tiny):
    model, tok = tiny
    engine = engine_for(model, tok)
    engine.add_request("n", prompt_token_ids=chat_ids(tok, "Hi"),
                       params=SamplingParams(temperature=1.0, seed=5, max_new_tokens=300, structure=ORDER, n=3))
    events = []
    while engine.has_unfinished():
        events += engine.step()
    finals = [e for e in events if isinstance(e, RequestFinished)]
    assert len(finals) == 3
    orders = [Order.model_validate_json(f.text) for f in finals]
    assert len({o.model_dump_json() for o in orders}) == 3


def test_a_stream_ends_after_its_last_choice_and_abort_cancels_every_choice(tiny):
    model, tok = tiny
    engine = engine_for(model, tok, max_num_seqs=6)
    engine.start()
    try:
        stream = engine.submit("n", prompt_token_ids=chat_ids(tok, "Hi"),
                               params=SamplingParams(temperature=0.7, seed=1, max_new_tokens=6, ignore_eos=True, n=3))
        finals = [e for e in stream if isinstance(e, RequestFinished)]
        assert sorted(f.index for f in finals) == [0, 1, 2] and finals[-1].finished
        outbox: queue.Queue = queue.Queue()
        engine.submit("long", prompt_token_ids=chat_ids(tok, "Hi"), outbox=outbox,
                      params=SamplingParams(temperature=0.7, seed=1, max_new_tokens=5000, ignore_eos=True, n=4))
        seen = []
        while not any(isinstance(e, TokenDelta) and e.index == 3 for e in seen):
            seen += outbox.get(timeout=60)
        engine.abort("long")
        while not any(isinstance(e, RequestFinished) and e.finished for e in seen):
            seen += outbox.get(timeout=60)
        cancelled = [e for e in seen if isinstance(e, RequestFinished)]
        assert sorted(e.index for e in cancelled) == [0, 1, 2, 3]
        assert {e.finish_reason for e in cancelled} == {"cancelled"}
        stats = engine.stats()
        assert stats.running == 0 and stats.kv_blocks_used == 0
    finally:
        engine.shutdown()


# ---- log-probabilities ---------------------------------------------------------------------------------------------

def model_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of a plain forward pass over `ids`: row i scores the token after position i."""
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(dim=-1)


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_sampled_tokens_logprobs_rank_and_alternatives_follow_the_model(tiny, ref_model, overlap):
    model, tok = tiny
    engine = engine_for(model, tok, overlap_steps=overlap)
    ids = chat_ids(tok, QUESTIONS[2])
    params = SamplingParams(temperature=1.3, top_k=30, seed=2, max_new_tokens=12, ignore_eos=True, logprobs=4,
                            presence_penalty=0.5)
    engine.add_request("lp", prompt_token_ids=ids, params=params)
    engine.add_request("plain", prompt_token_ids=ids, params=greedy(8))
    done, _ = run_all(engine)
    final = done["lp"]
    assert final.prompt_token_ids == ids and done["plain"].logprobs is None
    scores = model_logprobs(ref_model, ids + final.token_ids)
    ranks = []
    for i, (token, entry) in enumerate(zip(final.token_ids, final.logprobs)):
        row = scores[len(ids) - 1 + i]
        assert entry.token_id == token
        assert entry.logprob == pytest.approx(float(row[token]), abs=1e-4)
        assert entry.rank == 1 + int((row > row[token]).sum())
        assert [t for t, _ in entry.top] == row.topk(4).indices.tolist()
        assert [v for _, v in entry.top] == sorted((v for _, v in entry.top), reverse=True)
        ranks.append(entry.rank)
    assert max(ranks) > 1   # sampled at a high temperature: not always the best token


def test_deltas_carry_each_tokens_logprob_and_index(tiny):
    model, tok = tiny
    engine = engine_for(model, tok)
    engine.add_request("lp", prompt_token_ids=chat_ids(tok, "Hi"),
                       params=SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True, logprobs=0, n=2))
    events = []
    while engine.has_unfinished():
        events += engine.step()
    for index in (0, 1):
        deltas = [e for e in events if isinstance(e, TokenDelta) and e.index == index and e.token_ids]
        final = next(e for e in events if isinstance(e, RequestFinished) and e.index == index)
        assert [lp for d in deltas for lp in d.logprobs] == final.logprobs
        assert all(len(d.logprobs) == len(d.token_ids) for d in deltas)
        assert all(entry.rank == 1 and entry.top == [] for entry in final.logprobs)   # greedy: the best token


def test_each_choices_first_delta_says_when_the_request_was_admitted(tiny):
    """So a redelivery can keep its customer's queue wait (worker/publisher.py): the engine's admission comes with
    each choice's first token, and with no other."""
    model, tok = tiny
    engine = engine_for(model, tok)
    engine.add_request("adm", prompt_token_ids=chat_ids(tok, "Hi"),
                       params=SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True, n=2))
    events = []
    while engine.has_unfinished():
        events += engine.step()
    for index in (0, 1):
        deltas = [e for e in events if isinstance(e, TokenDelta) and e.index == index]
        final = next(e for e in events if isinstance(e, RequestFinished) and e.index == index)
        assert len(deltas) == 5 and final.admitted_time is not None
        assert [d.admitted_time for d in deltas] == [final.admitted_time] + [None] * 4


def test_choice_zeros_first_delta_carries_the_whole_prompts_logprobs_when_asked(tiny):
    """So an echo streams before the answer ends: the prompt's figures come with the answer's first token."""
    model, tok = tiny
    engine = engine_for(model, tok, max_num_batched_tokens=16, block_size=4)
    ids = chat_ids(tok, QUESTIONS[0])
    for rid, asked in (("asked", 2), ("not", None)):
        engine.add_request(rid, prompt_token_ids=ids, params=SamplingParams(
            temperature=0, max_new_tokens=4, ignore_eos=True, n=2, prompt_logprobs=asked))
    events = []
    while engine.has_unfinished():
        events += engine.step()
    deltas = [e for e in events if isinstance(e, TokenDelta) and e.token_ids]
    carrying = [(e.request_id, e.index) for e in deltas if e.prompt_logprobs is not None]
    assert carrying == [("asked", 0)]
    first = next(e for e in deltas if e.request_id == "asked" and e.index == 0)
    final = next(e for e in events if isinstance(e, RequestFinished) and e.request_id == "asked" and e.index == 0)
    assert first.prompt_logprobs == final.prompt_logprobs and len(first.prompt_logprobs) == len(ids) > 16


def test_prompt_logprobs_score_the_prompt_without_an_answer(tiny, ref_model):
    """Scoring a prompt (an evaluation harness's echo + logprobs + max_tokens=0): chunked prefill, no cache hits,
    and the same figures as a full forward pass."""
    model, tok = tiny
    engine = engine_for(model, tok, max_num_batched_tokens=16, block_size=4)
    ids = chat_ids(tok, QUESTIONS[0])
    params = SamplingParams(max_new_tokens=0, prompt_logprobs=3)
    events = []
    for rid in ("a", "b"):   # the same prompt twice: the second takes no cache hits
        engine.add_request(rid, prompt_token_ids=ids, params=params)
        while engine.has_unfinished():
            events += engine.step()
    finals = {e.request_id: e for e in events if isinstance(e, RequestFinished)}
    assert not [e for e in events if isinstance(e, TokenDelta) and e.token_ids]
    scores = model_logprobs(ref_model, ids)
    for final in finals.values():
        assert final.finish_reason == "length" and final.completion_tokens == 0 and final.cached_tokens == 0
        assert final.token_ids == [] and final.text == ""
        assert final.prompt_logprobs[0] is None and len(final.prompt_logprobs) == len(ids)
        for position, entry in enumerate(final.prompt_logprobs[1:], start=1):
            row = scores[position - 1]
            assert entry.token_id == ids[position]
            assert entry.logprob == pytest.approx(float(row[ids[position]]), abs=1e-4)
            # The reference's arithmetic differs from the engine's in the last bits: a logit within them of
            # the token's may rank on either side.
            x = float(row[ids[position]])
            assert 1 + int((row > x + 1e-4).sum()) <= entry.rank <= 1 + int((row > x - 1e-4).sum())
            assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()
    assert finals["a"].prompt_logprobs == finals["b"].prompt_logprobs
    assert len(ids) > 16   # the prompt took several chunks


def test_prompt_logprobs_with_an_answer_and_choices(tiny, ref_model):
    model, tok = tiny
    engine = engine_for(model, tok, block_size=4, num_blocks=128)
    ids = chat_ids(tok, QUESTIONS[1])
    engine.add_request("p", prompt_token_ids=ids, params=greedy(6, prompt_logprobs=0, n=2))
    events = []
    while engine.has_unfinished():
        events += engine.step()
    finals = [e for e in events if isinstance(e, RequestFinished)]
    assert [f.token_ids for f in finals] == [reference(ref_model, ids, 6)] * 2
    assert finals[0].prompt_logprobs == finals[1].prompt_logprobs and finals[0].prompt_logprobs[0] is None
    assert sorted(f.cached_tokens for f in finals) == [0, (len(ids) - 1) // 4 * 4]   # the copy shared the prompt
    scores = model_logprobs(ref_model, ids)
    assert [e.logprob for e in finals[0].prompt_logprobs[1:]] == pytest.approx(
        [float(scores[i - 1, ids[i]]) for i in range(1, len(ids))], abs=1e-4)


# ---- penalties and bias through the engine ----------------------------------------------------------------------

def test_greedy_presence_frequency_and_bias_follow_a_plain_decoding_loop(tiny, ref_model):
    model, tok = tiny
    engine = engine_for(model, tok)
    ids = chat_ids(tok, QUESTIONS[3])
    bias = {int(t): -4.0 for t in reference(ref_model, ids, 3)} | {13: 2.5}
    params = greedy(16, presence_penalty=1.2, frequency_penalty=0.8, logit_bias=bias, ignore_eos=True)
    engine.add_request("p", prompt_token_ids=ids, params=params)
    got = run_all(engine)[0]["p"].token_ids
    want: list[int] = []
    for _ in range(16):
        with torch.no_grad():
            row = ref_model(torch.tensor([ids + want])).logits[0, -1].float()
        for token, value in bias.items():
            row[token] += value
        for token in set(want):
            row[token] -= 0.8 * want.count(token) + 1.2
        want.append(int(row.argmax()))
    assert got == want
    assert got != reference(ref_model, ids, 16)


# ---- vLLM's extras: min_tokens, ignore_eos, skip_special_tokens -----------------------------------------------

def test_min_tokens_keeps_eos_out_until_the_answer_is_long_enough(tiny):
    """EOS biased to be every token's pick: alone it ends the answer at once; with min_tokens it cannot be drawn
    (for any choice) until the answer has that many tokens, and is the first token after."""
    model, tok = tiny
    engine = engine_for(model, tok)
    eos = tok.eos_token_id
    ids = chat_ids(tok, QUESTIONS[0])
    engine.add_request("plain", prompt_token_ids=ids, params=greedy(20, logit_bias={eos: 100.0}))
    engine.add_request("min", prompt_token_ids=ids, params=greedy(20, logit_bias={eos: 100.0}, min_tokens=5))
    engine.add_request("sampled", prompt_token_ids=ids, params=SamplingParams(
        temperature=1.0, seed=3, n=2, max_new_tokens=20, logit_bias={eos: 100.0}, min_tokens=7))
    done = run_all(engine)[0]
    assert done["plain"].completion_tokens == 1 and done["plain"].finish_reason == "stop"
    assert done["min"].completion_tokens == 6 and done["min"].finish_reason == "stop"
    assert eos not in done["min"].token_ids[:5] and done["min"].token_ids[5] == eos
    assert done["sampled"].completion_tokens == 8 and eos not in done["sampled"].token_ids[:7]


def test_stop_strings_count_only_from_min_tokens_on(tiny):
    model, tok = tiny
    engine = engine_for(model, tok)
    ids = chat_ids(tok, QUESTIONS[1])
    engine.add_request("full", prompt_token_ids=ids, params=greedy(24, ignore_eos=True))
    full = run_all(engine)[0]["full"]
    first = tok.decode(full.token_ids[:1])   # the answer's first token's text: a stop string at once
    engine.add_request("cut", prompt_token_ids=ids, params=greedy(24, ignore_eos=True, stop=[first]))
    engine.add_request("late", prompt_token_ids=ids, params=greedy(24, ignore_eos=True, stop=[first], min_tokens=24))
    done = run_all(engine)[0]
    assert done["cut"].finish_reason == "stop" and done["cut"].text == ""
    assert done["late"].finish_reason == "length" and done["late"].text == full.text


def test_stop_token_ids_end_the_answer_and_say_which_one_did(tiny):
    """A stop token ends a greedy answer where it is first drawn, kept as EOS is, and is the stop_reason; EOS and
    the length cap leave stop_reason None; min_tokens keeps stop tokens out of the draw as it keeps EOS."""
    model, tok = tiny
    engine = engine_for(model, tok)
    ids = chat_ids(tok, QUESTIONS[1])
    eos = tok.eos_token_id
    engine.add_request("full", prompt_token_ids=ids, params=greedy(24, ignore_eos=True))
    full = run_all(engine)[0]["full"]
    assert full.finish_reason == "length" and full.stop_reason is None
    at = 5
    token = full.token_ids[at]
    first = full.token_ids.index(token)
    engine.add_request("cut", prompt_token_ids=ids, params=greedy(24, ignore_eos=True, stop_token_ids=[token]))
    engine.add_request("late", prompt_token_ids=ids, params=greedy(24, ignore_eos=True, stop_token_ids=[token],
                                                                   min_tokens=first + 1))
    engine.add_request("eos", prompt_token_ids=ids, params=greedy(24, logit_bias={eos: 100.0},
                                                                  stop_token_ids=[token]))
    done = run_all(engine)[0]
    assert done["cut"].finish_reason == "stop" and done["cut"].stop_reason == token
    assert done["cut"].token_ids == full.token_ids[:first + 1]
    assert done["cut"].text == tok.decode(full.token_ids[:first + 1], skip_special_tokens=True)
    assert token not in done["late"].token_ids[:first + 1], "min_tokens let a stop token be drawn"
    assert done["eos"].finish_reason == "stop" and done["eos"].stop_reason is None and done["eos"].token_ids == [eos]


def test_a_matched_stop_string_is_the_stop_reason_and_can_stay_in_the_text(tiny):
    model, tok = tiny
    engine = engine_for(model, tok)
    ids = chat_ids(tok, QUESTIONS[2])
    engine.add_request("full", prompt_token_ids=ids, params=greedy(30, ignore_eos=True))
    full = run_all(engine)[0]["full"].text
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = full.index(stop)
    for rid, include in (("cut", False), ("kept", True)):
        engine.add_request(rid, prompt_token_ids=ids, params=greedy(
            30, ignore_eos=True, stop=["\x00never", stop], include_stop_str_in_output=include))
    done, deltas = run_all(engine)
    assert done["cut"].stop_reason == done["kept"].stop_reason == stop
    assert done["cut"].text == full[:cut] == "".join(deltas["cut"])
    assert done["kept"].text == full[:cut + len(stop)] == "".join(deltas["kept"])


def test_stop_token_ids_the_model_lacks_are_refused_naming_them(tiny):
    model, tok = tiny
    engine = engine_for(model, tok)
    with pytest.raises(InvalidRequestError, match="stop_token_ids.*10000000"):
        engine.add_request("x", prompt_token_ids=[1, 2], params=greedy(4, stop_token_ids=[3, 10_000_000]))
    with pytest.raises(InvalidParamsError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=[-1]).validate()


def test_skip_special_tokens_false_shows_them_in_the_text(tiny):
    model, tok = tiny
    engine = engine_for(model, tok)
    eos = tok.eos_token_id
    ids = chat_ids(tok, QUESTIONS[2])
    for rid, skip in (("skip", True), ("show", False)):
        engine.add_request(rid, prompt_token_ids=ids, params=greedy(
            3, ignore_eos=True, logit_bias={eos: 100.0}, skip_special_tokens=skip))
    done, deltas = run_all(engine)
    assert done["skip"].token_ids == done["show"].token_ids == [eos] * 3
    assert done["skip"].text == "" and done["show"].text == tok.eos_token * 3
    assert "".join(deltas["show"]) == done["show"].text


# ---- token bytes --------------------------------------------------------------------------------------------------

def test_token_bytes_of_a_byte_level_vocabulary(tokenizer):
    text = "Grüße 👋 <|im_end|> ok\n"
    ids = tokenizer.encode(text, add_special_tokens=False)
    pieces = token_bytes(tokenizer, ids)
    assert b"".join(pieces) == text.encode()
    assert any(len(p) == 1 and p[0] >= 0x80 for p in pieces)   # a token that is part of a character
    assert b"<|im_end|>" in pieces


def test_token_bytes_of_a_sentencepiece_vocabulary():
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "\u2581Hello": 1, "\u2581w": 2, "orld": 3, "<0x0A>": 4, "<0xF0>": 5, "!": 6}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         decoders.Strip(" ", 1, 0)])
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>")
    assert token_bytes(fast, [1, 2, 3, 4, 5, 6]) == [b" Hello", b" w", b"orld", b"\n", b"\xf0", b"!"]
