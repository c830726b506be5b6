"""An answer continued from its first tokens (a worker stopped mid-answer): it ends as the whole answer would have."""

from __future__ import annotations

import json

import pytest

from structured import Structure
from tests.test_engine import QUESTIONS, chat_ids, no_fallbacks  # noqa: F401
from worker.engine import EngineConfig, InvalidRequestError, LLMEngine, RequestFinished, SamplingParams

# The chat's own sampling (worker settings' defaults), with OpenAI's penalties on top: every one of them reads the
# answer's tokens so far, so the continued tokens must count as the answer's.
CHAT = dict(temperature=0.7, top_p=0.9, dry_multiplier=0.8, dry_include_prompt=False, presence_penalty=0.6,
            frequency_penalty=0.4, repetition_penalty=1.2, seed=5, max_new_tokens=40, ignore_eos=True)
JSON = Structure({"type": "object", "properties": {"name": {"type": "string", "maxLength": 30},
                                                   "qty": {"type": "integer"}},
                  "required": ["name", "qty"], "additionalProperties": False})


def answer(tiny, ids: list[int], params: SamplingParams, continued: list[int] | None = None, overlap: bool = False,
           events: list | None = None, **config):
    """The answer to `ids` and its deltas' texts, beside another request; `events`: its deltas themselves."""
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4, num_blocks=64, overlap_steps=overlap, **config))
    engine.add_request("other", prompt_token_ids=chat_ids(tok, QUESTIONS[0]),
                       params=SamplingParams(temperature=1.0, max_new_tokens=12))
    engine.add_request("me", prompt_token_ids=ids, params=params, continued=continued)
    assert engine.stats().continued == (1 if continued else 0)   # the operators' count of continued answers
    results, deltas = {}, {}
    while engine.has_unfinished():
        for event in engine.step():
            if isinstance(event, RequestFinished):
                results[event.request_id] = event
            else:
                deltas.setdefault(event.request_id, []).append(event.text)
                if events is not None and event.request_id == "me":
                    events.append(event)
    return results["me"], deltas["me"]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_a_continued_answer_draws_the_tokens_the_whole_answer_drew(tiny, overlap):
    _, tok = tiny
    ids = chat_ids(tok, QUESTIONS[3])
    whole, _ = answer(tiny, ids, SamplingParams(**CHAT))
    assert len(whole.token_ids) == 40
    for k in (1, 17, 39):
        events = []
        done, deltas = answer(tiny, ids, SamplingParams(**CHAT), continued=[whole.token_ids[:k]], overlap=overlap,
                              events=events)
        assert done.token_ids == whole.token_ids, k
        # The first delta says the answer goes on (the publisher then sends each new token's log-probabilities).
        assert [e.continued for e in events if e.token_ids] == [k] + [0] * (39 - k)
        assert done.text == whole.text == "".join(deltas), "the deltas add up to the whole answer, continued text too"
        assert deltas[0].startswith(tok.decode(whole.token_ids[:k])), "the continued text goes out first"
        assert (done.completion_tokens, done.prompt_tokens, done.finish_reason) == (40, len(ids), "length")
        # Its TPOT and the worker's generated-token count cover the tokens this delivery wrote.
        assert done.continued_tokens == k and (done.tpot is None) == (40 - k < 2)
    # The same tokens as part of the prompt instead: the penalties and DRY no longer see them as the answer's,
    # and the draw goes elsewhere (so the comparison above can fail).
    k = 17
    as_prompt, _ = answer(tiny, ids + whole.token_ids[:k], SamplingParams(**{**CHAT, "max_new_tokens": 40 - k}))
    assert as_prompt.token_ids != whole.token_ids[k:]


def test_a_continued_structured_answer_keeps_its_grammar(tiny):
    _, tok = tiny
    ids = chat_ids(tok, "An order line as JSON")
    params = dict(temperature=1.0, seed=3, max_new_tokens=60)
    whole, _ = answer(tiny, ids, SamplingParams(**params, structure=JSON))
    assert whole.finish_reason == "stop" and len(whole.token_ids) > 6
    done, _ = answer(tiny, ids, SamplingParams(**params, structure=JSON), continued=[whole.token_ids[:5]])
    assert (done.token_ids, done.text, done.finish_reason) == (whole.token_ids, whole.text, "stop")
    not_json = tok.encode("no json", add_special_tokens=False)
    with pytest.raises(InvalidRequestError, match="does not fit its structure"):
        answer(tiny, ids, SamplingParams(**params, structure=JSON), continued=[not_json])


def test_a_continued_answer_that_ends_at_once_still_sends_its_text(tiny):
    _, tok = tiny
    ids = chat_ids(tok, QUESTIONS[2])
    start = tok.encode(" Yes, we ship there", add_special_tokens=False)
    # Its stop string comes with the next tokens at the latest: the text written before is never searched again.
    done, deltas = answer(tiny, ids, SamplingParams(temperature=0.0, max_new_tokens=len(start) + 1, stop=["ship"]),
                          continued=[start])
    assert done.text.startswith(" Yes, we ship there") and "".join(deltas) == done.text
    assert done.completion_tokens == len(start) + 1


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
def test_an_answer_continued_from_every_token_it_may_have_ends_as_it_was(tiny, overlap):
    """Shown whole at its cap or the model's context (a worker that died before storing it): computed, never
    drawn from again, its log-probabilities scored, and its text sent as it was."""
    _, tok = tiny
    ids = chat_ids(tok, QUESTIONS[1])
    params = dict(CHAT, logprobs=1, max_new_tokens=12)
    whole, _ = answer(tiny, ids, SamplingParams(**params))
    done, deltas = answer(tiny, ids, SamplingParams(**params), continued=[whole.token_ids], overlap=overlap)
    assert (done.token_ids, done.text, done.finish_reason) == (whole.token_ids, whole.text, "length")
    assert "".join(deltas) == whole.text and done.continued_tokens == 12 and done.tpot is None
    assert all(map(same_logprobs, done.logprobs, whole.logprobs)) and len(done.logprobs) == 12
    # Shown whole up to the model's context: the same.
    to_context = dict(temperature=0.0, max_new_tokens=2000, ignore_eos=True)
    whole, _ = answer(tiny, ids, SamplingParams(**to_context))
    assert whole.finish_reason == "length" and len(whole.token_ids) < 2000, "the context ended it"
    done, deltas = answer(tiny, ids, SamplingParams(**to_context), continued=[whole.token_ids], overlap=overlap)
    assert (done.token_ids, done.text, done.finish_reason) == (whole.token_ids, whole.text, "length")
    assert "".join(deltas) == whole.text


def same_logprobs(got, want) -> bool:
    return (got.token_id, got.rank, [t for t, _ in got.top]) == (want.token_id, want.rank, [t for t, _ in want.top]) \
        and got.logprob == pytest.approx(want.logprob, abs=1e-4) \
        and [v for _, v in got.top] == pytest.approx([v for _, v in want.top], abs=1e-4)


@pytest.mark.parametrize("overlap, chunk", [(False, None), (True, 16)], ids=["plain", "overlapped-chunked"])
def test_a_continued_answer_with_logprobs_has_the_continued_tokens_scored_as_if_drawn(tiny, overlap, chunk):
    """The continued tokens' log-probabilities come from the prefill's rows (chunked too, beside prompt
    log-probabilities): the answer's end has every token's, as the uninterrupted answer's; its deltas send only the
    new tokens' (a client has the others)."""
    _, tok = tiny
    ids = chat_ids(tok, QUESTIONS[1])
    params = dict(CHAT, logprobs=3, max_new_tokens=30)
    whole, _ = answer(tiny, ids, SamplingParams(**params, prompt_logprobs=2))
    assert len(whole.logprobs) == 30
    for k in (1, 21):
        events = []
        done, deltas = answer(tiny, ids, SamplingParams(**params, prompt_logprobs=2), continued=[whole.token_ids[:k]],
                              overlap=overlap, events=events, max_num_batched_tokens=chunk)
        assert done.token_ids == whole.token_ids and done.text == whole.text == "".join(deltas)
        assert len(done.logprobs) == 30 and all(map(same_logprobs, done.logprobs, whole.logprobs)), k
        assert len(done.prompt_logprobs) == len(ids) and all(
            a is b is None or same_logprobs(a, b) for a, b in zip(done.prompt_logprobs, whole.prompt_logprobs))
        sent = [entry for event in events for entry in event.logprobs or ()]
        assert [e.token_id for e in sent] == whole.token_ids[k:], "the deltas carry the new tokens' alone"
    # Without prompt log-probabilities only the continued tokens' rows are kept.
    done, _ = answer(tiny, ids, SamplingParams(**params), continued=[whole.token_ids[:9]])
    assert done.token_ids == whole.token_ids and all(map(same_logprobs, done.logprobs, whole.logprobs))


def every_choice(tiny, ids: list[int], params: SamplingParams, continued: list[list[int]] | None = None,
                 overlap: bool = False):
    """Each choice's end and the text its deltas carried, by choice."""
    model, tok = tiny
    engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4, num_blocks=96, overlap_steps=overlap))
    engine.add_request("me", prompt_token_ids=ids, params=params, continued=continued)
    ends, texts = {}, {}
    while engine.has_unfinished():
        for event in engine.step():
            if isinstance(event, RequestFinished):
                ends[event.index] = event
            else:
                texts[event.index] = texts.get(event.index, "") + event.text
    return ends, texts


@pytest.mark.parametrize("logprobs, overlap", [(None, False), (2, True)], ids=["plain", "logprobs-overlapped"])
def test_each_choice_goes_on_from_its_own_tokens(tiny, logprobs, overlap):
    """n choices, each shown in part (one not at all): every one ends as it would have, from its own seed."""
    _, tok = tiny
    ids = chat_ids(tok, QUESTIONS[2])
    params = dict(CHAT, n=3, max_new_tokens=24, logprobs=logprobs)
    whole, _ = every_choice(tiny, ids, SamplingParams(**params))
    assert len({tuple(e.token_ids) for e in whole.values()}) == 3, "the choices differ"
    shown = [whole[0].token_ids[:5], [], whole[2].token_ids[:11]]
    done, texts = every_choice(tiny, ids, SamplingParams(**params), continued=shown, overlap=overlap)
    for i in range(3):
        assert done[i].token_ids == whole[i].token_ids and done[i].text == whole[i].text == texts[i], i
        assert done[i].continued_tokens == len(shown[i])
        if logprobs:
            assert all(map(same_logprobs, done[i].logprobs, whole[i].logprobs)) and len(done[i].logprobs) == 24


@pytest.mark.parametrize("change, error, answers", [
    (dict(n=2), "choices", 3),
    (dict(max_new_tokens=1), "more than max_new_tokens", 1),
])
def test_what_cannot_continue_is_refused_with_the_reason(tiny, change, error, answers):
    _, tok = tiny
    params = SamplingParams(**{"temperature": 0.0, "max_new_tokens": 20, **change})
    start = tok.encode(" Hello there", add_special_tokens=False)
    assert len(start) == 2
    with pytest.raises(InvalidRequestError, match=error):
        answer(tiny, chat_ids(tok, "Hi"), params, continued=[start] * answers)
    with pytest.raises(InvalidRequestError, match="model does not have"):
        answer(tiny, chat_ids(tok, "Hi"), SamplingParams(max_new_tokens=20), continued=[[len(tok) + 5]])
    with pytest.raises(InvalidRequestError, match="context"):
        answer(tiny, chat_ids(tok, "Hi"), SamplingParams(max_new_tokens=10_000), continued=[[7] * 600])


def test_the_record_of_what_was_shown_reads_back_into_the_tokens_that_wrote_it(tokenizer):
    """worker/continuation.py's record: the worker's own text apart, a cut piece and another vocabulary's tokens
    written again from their text, a generation's end left out."""
    from worker.continuation import Shown, record

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    eos = tokenizer.eos_token_id
    parts = [("Order 7 shipped. ", None), ("It", ids("It")), ("", [eos]), (" comes", ids(" comes")),
             (" today", [99_999_999])]
    shown = Shown.read([record(parts[:2], 0), record(parts[2:], 0)], len("Order 7 shipped. It comes today"))
    lead, written = shown.split_lead()
    assert (lead, written.text) == ("Order 7 shipped. ", "It comes today")
    assert written.tokens(tokenizer) == ids("It") + ids(" comes") + ids(" today")
    # A redelivery that had shown "Order 7 shipped. I": the rest of "It" is recorded with the tokens of all of it.
    assert json.loads(record(parts[:2], len("Order 7 shipped. I"))) == [["t", ids("It")]]
    assert Shown([("t", ids("It"))]).tokens(tokenizer) == ids("t")


def test_a_character_cut_between_windows_reads_back_into_the_tokens_that_wrote_it(tokenizer):
    """A window can end inside a character: its first bytes' tokens went out (with their log-probabilities) and its
    text with the next window. The record keeps them, so the answer goes on from the very tokens sent, not from
    its text tokenized again (a different count of tokens: log-probabilities that no longer match the answer)."""
    from worker.continuation import Shown, record
    from worker.engine.detokenizer import IncrementalDetokenizer

    ids = tokenizer(" 🦜🦜 parrot", add_special_tokens=False)["input_ids"]
    detokenizer = IncrementalDetokenizer(tokenizer)
    parts = [(detokenizer.push_token(t), [t]) for t in ids]
    cut = next(i for i in range(2, len(parts)) if parts[i - 1][0] == "" and parts[i - 2][0])   # inside the 2nd 🦜
    text = "".join(t for t, _ in parts)
    whole = Shown.read([record(parts[:cut], 0), record(parts[cut:], 0)], len(text))
    assert whole.tokens(tokenizer) == ids
    # Sent up to inside the character: its first bytes are where the answer goes on from.
    upto = Shown.read([record(parts[:cut], 0)], len("".join(t for t, _ in parts[:cut])))
    assert upto.text == " 🦜" and upto.tokens(tokenizer) == ids[:cut]


@pytest.mark.parametrize("entry", ["not json", '{"a": 1}', '[["Hi", 5]]', '[[1, [2]]]', '[["Hi"]]'])
def test_a_record_that_cannot_be_read_means_generating_again(entry):
    from worker.continuation import Shown

    assert Shown.read([entry], 2) is None


def test_a_continued_answer_with_logprobs_preempted_mid_way_scores_each_token_once(tiny):
    """Chunked, preempted and computed again: each continued token's log-probability is kept once, as drawn."""
    model, tok = tiny

    def run(continued, blocks):
        engine = LLMEngine(model, tok, EngineConfig(max_num_seqs=4, num_blocks=blocks, max_num_batched_tokens=16))
        for i in range(3):   # others filling the pool
            engine.add_request(f"o{i}", prompt_token_ids=list(range(100 + i, 160 + i)),
                               params=SamplingParams(temperature=1.0, seed=i, max_new_tokens=40, ignore_eos=True))
        engine.add_request("me", prompt_token_ids=list(range(300, 350)), continued=continued, params=SamplingParams(
            temperature=0.8, seed=7, max_new_tokens=50, logprobs=2, prompt_logprobs=1, ignore_eos=True))
        results = {}
        while engine.has_unfinished():
            results.update((e.request_id, e) for e in engine.step() if isinstance(e, RequestFinished))
        return results["me"]

    whole = run(None, 200)
    done = run([whole.token_ids[:30]], 19)   # preempted mid-way through the continued tokens, more than once
    assert done.preemptions > 0, "the test needs the continued answer preempted"
    assert done.token_ids == whole.token_ids and len(done.logprobs) == 50
    assert all(map(same_logprobs, done.logprobs, whole.logprobs))
    assert all(a is b is None or same_logprobs(a, b) for a, b in zip(done.prompt_logprobs, whole.prompt_logprobs))
