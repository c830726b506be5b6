"""DRY, the repetition guard: exact penalties against a plain reference, breakers, batches, and a looping model."""

from __future__ import annotations

import math
import random

import pytest
import torch

from worker.engine import EngineConfig, InvalidParamsError, LLMEngine, SamplingParams
from worker.engine.dry import DEFAULT_BREAKERS, Breakers, BreakerTokens
from worker.engine.sampler import Pending, Sampler, apply_processors
from worker.engine.sequence import PENDING
from worker.model_loader import load_model

VOCAB = 40


def toy_breakers(strings: tuple[str, ...]) -> Breakers:
    """A toy vocabulary's breakers: "." is token 7, "|" token 8 or 9, and "ab" is written 30 31."""
    heads, sequences = set(), set()
    for s in strings:
        if s == ".":
            heads.add(7)
        elif s == "|":
            heads.update((8, 9))
        elif s == "ab":
            sequences.add((30, 31))
    return Breakers(tuple(sorted(heads)), tuple(sorted(sequences)))


def reference(scores: list[float], history: list[int], p: SamplingParams) -> list[float]:
    """DRY as llama.cpp's sampler defines it, written plainly: every earlier position's run compared token by
    token with the run that ends the context."""
    out = list(scores)
    if p.dry_multiplier == 0 or p.dry_penalty_last_n == 0:
        return out
    breakers = toy_breakers(tuple(p.dry_sequence_breakers))
    n = len(history) if p.dry_penalty_last_n == -1 else min(len(history), p.dry_penalty_last_n)
    w = history[len(history) - n:]
    if n <= p.dry_allowed_length:
        return out
    limit = n   # tokens after the last breaker
    for i in range(n):
        end = n - 1 - i
        if w[end] in breakers.heads or any(end + 1 >= len(s) and tuple(w[end + 1 - len(s):end + 1]) == s
                                            for s in breakers.sequences):
            limit = i
            break
    longest: dict[int, int] = {}
    for j in range(n - 1):
        length = 0
        while length <= j and w[j - length] == w[n - 1 - length]:
            length += 1
        length = min(length, limit)
        if length >= p.dry_allowed_length:
            longest[w[j + 1]] = max(longest.get(w[j + 1], 0), length)
    cap = 88.7228391 / math.log(p.dry_base) if p.dry_base > 1.000001 else math.inf
    for token, length in longest.items():
        out[token] -= p.dry_multiplier * p.dry_base ** min(length - p.dry_allowed_length, cap)
    return out


def dry(**kw) -> SamplingParams:
    return SamplingParams(**{"dry_multiplier": 0.8, "dry_sequence_breakers": (), **kw})


def test_the_token_that_would_extend_a_repeat_loses_multiplier_times_base_to_the_excess() -> None:
    logits = torch.zeros(1, VOCAB)
    # "1 2 3 4 ... 1 2 3": 4 would make the run 1 2 3 four long; allowed 2, so 0.8 * 1.75 ** (3 - 2)
    out = apply_processors(logits, [dry()], [[1, 2, 3, 4, 5, 1, 2, 3]])
    want = torch.zeros(VOCAB)
    want[4] = -0.8 * 1.75
    torch.testing.assert_close(out[0], want)
    # a run of exactly the allowed length costs the multiplier; shorter runs cost nothing
    out = apply_processors(logits, [dry(dry_multiplier=2.0, dry_base=3.0)], [[1, 2, 9, 5, 6, 1, 2]])
    want = torch.zeros(VOCAB)
    want[9] = -2.0
    torch.testing.assert_close(out[0], want)
    assert torch.equal(apply_processors(logits, [dry()], [[1, 9, 5, 6, 1]])[0], torch.zeros(VOCAB))
    # the longest run decides: after "1 2 3 1 2 3 1 2", 3 extends runs of 2 and 5 tokens
    out = apply_processors(logits, [dry(dry_allowed_length=3)], [[1, 2, 3, 1, 2, 3, 1, 2]])
    want = torch.zeros(VOCAB)
    want[3] = -0.8 * 1.75 ** (5 - 3)
    torch.testing.assert_close(out[0], want)


def test_an_answer_only_window_lets_the_answer_quote_its_prompt() -> None:
    logits = torch.zeros(1, VOCAB)
    prompt, answer = [1, 2, 3, 4, 5], [1, 2, 3]
    whole = apply_processors(logits, [dry()], [prompt + answer], prompt_lens=[len(prompt)])
    assert float(whole[0, 4]) == pytest.approx(-1.4)   # the prompt counts, as llama.cpp's does
    own = apply_processors(logits, [dry(dry_include_prompt=False)], [prompt + answer], prompt_lens=[len(prompt)])
    assert torch.equal(own[0], torch.zeros(VOCAB))
    looping = prompt + [6, 7, 8, 6, 7]
    own = apply_processors(logits, [dry(dry_include_prompt=False)], [looping], prompt_lens=[len(prompt)])
    assert float(own[0, 8]) == pytest.approx(-0.8)     # the answer's own repeat still counts


def test_sequence_breakers_end_the_run_that_is_counted() -> None:
    logits = torch.zeros(1, VOCAB)
    history = [1, 2, 3, 4, 5, 1, 2, 3]
    plain = apply_processors(logits, [dry(dry_sequence_breakers=(".",))], [history], breakers=toy_breakers)
    assert float(plain[0, 4]) == pytest.approx(-1.4)
    # a breaker inside the repeat: only the tokens after it count (here one, less than the allowed length)
    for broken in ([1, 7, 3, 4, 5, 1, 7, 3], [1, 2, 8, 3, 4, 5, 1, 2, 8, 3]):
        out = apply_processors(logits, [dry(dry_sequence_breakers=(".", "|"))], [broken], breakers=toy_breakers)
        assert torch.equal(out[0], torch.zeros(VOCAB)), broken
    # a token is no breaker unless its set names it
    out = apply_processors(logits, [dry(dry_sequence_breakers=(".",))], [[1, 2, 8, 3, 4, 5, 1, 2, 8, 3]],
                           breakers=toy_breakers)
    assert float(out[0, 4]) == pytest.approx(-0.8 * 1.75 ** 2)
    # the last token a breaker: nothing is penalised
    out = apply_processors(logits, [dry(dry_sequence_breakers=(".",))], [[1, 2, 7, 5, 1, 2, 7]],
                           breakers=toy_breakers)
    assert torch.equal(out[0], torch.zeros(VOCAB))
    # a breaker of two tokens counts only where both appear in order
    split = [30, 31, 2, 3, 4, 5, 30, 31, 2, 3]
    out = apply_processors(logits, [dry(dry_sequence_breakers=("ab",))], [split], breakers=toy_breakers)
    assert float(out[0, 4]) == pytest.approx(-0.8)   # run "2 3" after the breaker: the allowed length
    out = apply_processors(logits, [dry()], [split])
    assert float(out[0, 4]) == pytest.approx(-0.8 * 1.75 ** 2)   # without it: "30 31 2 3"
    # breaker strings need a tokenizer to become token ids
    with pytest.raises(ValueError, match="tokenizer"):
        apply_processors(logits, [dry(dry_sequence_breakers=(".",))], [split])


def random_params(rng: random.Random) -> SamplingParams:
    if rng.random() < 0.25:
        return SamplingParams(repetition_penalty=rng.choice([1.0, 1.3]))   # no DRY: left as it was
    return SamplingParams(
        dry_multiplier=rng.choice([0.5, 0.8, 2.0]), dry_base=rng.choice([1.0, 1.1, 1.75, 3.0]),
        dry_allowed_length=rng.choice([1, 2, 3, 4]), dry_penalty_last_n=rng.choice([-1, -1, 8, 20, 60]),
        dry_sequence_breakers=rng.choice([(), (".",), (".", "|"), ("ab",), ("|", "ab")]))


def looping_history(rng: random.Random, length: int) -> list[int]:
    """Repeats of a few phrases with noise and breakers: long and short runs, as a looping answer has."""
    phrases = [[rng.randrange(10, 40) for _ in range(rng.randint(2, 9))] for _ in range(3)]
    out: list[int] = []
    while len(out) < length:
        pick = rng.random()
        if pick < 0.7:
            out += rng.choice(phrases)
        elif pick < 0.85:
            out.append(rng.choice([7, 8, 9, 30]))
        else:
            out += [30, 31] if rng.random() < 0.5 else [rng.randrange(40)]
    return out[:length]


@pytest.mark.parametrize("seed", range(6))
def test_every_row_matches_the_reference_whatever_its_batch_mates(seed: int) -> None:
    rng = random.Random(seed)
    rows = 9
    params = [random_params(rng) for _ in range(rows)]
    histories = [looping_history(rng, rng.randint(1, 120)) for _ in range(rows)]
    logits = torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3
    out = apply_processors(logits, params, histories, breakers=toy_breakers)
    for i, p in enumerate(params):
        if not p.dry:
            if p.repetition_penalty == 1.0:
                assert torch.equal(out[i], logits[i])
            continue
        want = torch.tensor(reference(logits[i].tolist(), histories[i], p))
        torch.testing.assert_close(out[i], want, rtol=1e-6, atol=1e-5)
        # and alone, the same row gives the same scores
        alone = apply_processors(logits[i:i + 1], [p], [histories[i]], breakers=toy_breakers)
        assert torch.equal(alone[0], out[i])
    assert any(not torch.equal(out[i], logits[i]) for i in range(rows))


def test_a_penalty_past_float32_stays_finite_for_other_tokens() -> None:
    history = [1, 2] * 200
    out = apply_processors(torch.zeros(1, VOCAB), [dry(dry_base=10.0, dry_multiplier=100.0)], [history])
    assert float(out[0, 1]) == -math.inf or float(out[0, 1]) < -1e30
    assert int(torch.isfinite(out[0]).sum()) == VOCAB - 1


def greedy_run(params: SamplingParams, mates: list[SamplingParams], sampler: Sampler, steps: int = 40,
               overlapped: bool = False) -> list[int]:
    """Greedy decoding of a row whose logits favour repeating its own phrase; mates get the same kind of logits."""
    rows = [params] + mates
    histories = [[3, 4, 5, 6, 3, 4, 5] + [11 + i] for i in range(len(rows))]
    hosted = [list(h) for h in histories]
    last = None
    for step in range(steps):
        logits = (torch.randn(VOCAB, generator=torch.Generator().manual_seed(step)) * 0.3).repeat(len(rows), 1)
        for i, h in enumerate(histories):   # each token that followed the last token before scores 2
            for j in range(len(h) - 1):
                if h[j] == h[-1]:
                    logits[i, h[j + 1]] = 2.0
        pending = Pending(last, list(range(len(rows)))) if overlapped and last is not None else None
        out = sampler(logits, rows, hosted if overlapped else histories, list(range(len(rows))), pending)
        for i in range(len(rows)):
            histories[i].append(int(out[i]))
            hosted[i].append(PENDING if overlapped else int(out[i]))
            if overlapped and last is not None:
                hosted[i][-2] = histories[i][-2]
        last = out
    return histories[0]


def repeats(tokens: list[int], run: int = 5, times: int = 3) -> bool:
    """Whether some run of `run` tokens occurs `times` times or more."""
    counts: dict[tuple[int, ...], int] = {}
    for i in range(len(tokens) - run + 1):
        key = tuple(tokens[i:i + run])
        counts[key] = counts.get(key, 0) + 1
    return max(counts.values(), default=0) >= times


MATES = [SamplingParams(temperature=0), SamplingParams(temperature=0, repetition_penalty=1.4),
         SamplingParams(temperature=0, dry_multiplier=2.0, dry_allowed_length=4, dry_sequence_breakers=())]


@pytest.mark.parametrize("path", ["processors", "race", "overlapped"])
def test_greedy_rows_stop_looping_and_do_not_depend_on_their_batch(path: str) -> None:
    race = path == "race"
    plain = SamplingParams(temperature=0)
    guarded = SamplingParams(temperature=0, dry_multiplier=0.8, dry_sequence_breakers=())
    assert repeats(greedy_run(plain, [], Sampler(race=race)))
    alone = greedy_run(guarded, [], Sampler(race=race))
    assert not repeats(alone)
    assert greedy_run(guarded, MATES, Sampler(race=race), overlapped=path == "overlapped") == alone
    assert greedy_run(guarded, MATES[::-1], Sampler(race=race)) == alone


def test_sampled_rows_get_dry_on_the_race_and_the_cut_off_draws() -> None:
    """A sampled DRY row draws from softmax(DRY scores / T) on every draw path: the penalised token never wins."""
    history = [1, 2, 3, 4, 5, 1, 2, 3]
    logits = torch.zeros(64, VOCAB)
    logits[:, 4] = 6.0   # without DRY, token 4 would win nearly every draw
    for sampler, extra in ((Sampler(race=True), {}), (Sampler(), {}), (Sampler(), {"top_k": 5}),
                           (Sampler(candidates=0), {"top_p": 0.9})):
        params = [SamplingParams(temperature=0.5, dry_multiplier=20.0, dry_sequence_breakers=(), **extra)] * 64
        out = sampler(logits, params, [list(history) for _ in range(64)], list(range(64)))
        assert 4 not in out.tolist(), (sampler.race, extra)
        free = sampler(logits, [SamplingParams(temperature=0.5, **extra)] * 64, [list(history)] * 64,
                       list(range(64)))
        assert free.tolist().count(4) > 60


def test_breaker_strings_become_the_tokenizers_ids(tokenizer) -> None:
    tokens = BreakerTokens(tokenizer)
    found = tokens(DEFAULT_BREAKERS)
    newline = tokenizer.encode("\n", add_special_tokens=False)
    assert newline[0] in found.heads
    for text in ("Order:", " \"", "**", "\n\n"):   # every token holding a breaker is one
        assert all(t in found.heads for t in tokenizer.encode(text, add_special_tokens=False)
                   if any(b in tokenizer.decode([t]) for b in DEFAULT_BREAKERS))
    assert not any(tokenizer.decode([t]) == "Order" for t in found.heads)
    several = tokens(("Customer said",))
    assert tuple(tokenizer.encode("Customer said", add_special_tokens=False)) in several.sequences
    assert tokens(DEFAULT_BREAKERS) is found   # looked up once


@pytest.mark.parametrize("bad", [
    dict(dry_multiplier=-0.1), dict(dry_multiplier=float("nan")), dict(dry_base=0.9), dict(dry_base=math.inf),
    dict(dry_allowed_length=0), dict(dry_allowed_length=1.5), dict(dry_penalty_last_n=-2),
    dict(dry_sequence_breakers=["\n", ""]), dict(dry_sequence_breakers="\n"), dict(dry_sequence_breakers=[3]),
    dict(dry_include_prompt="no"),
])
def test_bad_dry_settings_are_refused_with_the_rule(bad: dict) -> None:
    name = next(iter(bad))
    with pytest.raises(InvalidParamsError, match=name):
        SamplingParams(**bad).validate()
    SamplingParams(dry_multiplier=0.8, dry_sequence_breakers=["\n", ":"]).validate()


def test_a_looping_greedy_answer_stops_looping(tiny_model_dir) -> None:
    """The tiny random model's greedy answer repeats a phrase over and over; with DRY it does not, and requests
    without DRY in the same batch answer as before."""
    model, tokenizer = load_model(str(tiny_model_dir))
    engine = LLMEngine(model, tokenizer, EngineConfig(max_num_seqs=4))
    prompt = tokenizer.encode("no")
    plain = SamplingParams(temperature=0, max_new_tokens=80, ignore_eos=True)
    guarded = SamplingParams(temperature=0, max_new_tokens=80, ignore_eos=True, dry_multiplier=0.8)
    engine.add_request("plain", prompt_token_ids=prompt, params=plain)
    engine.add_request("guarded", prompt_token_ids=prompt, params=guarded)
    done = {}
    while engine.has_unfinished():
        for event in engine.step():
            if getattr(event, "finished", False):
                done[event.request_id] = event
    loop, fixed = done["plain"].token_ids, done["guarded"].token_ids
    assert repeats(loop), tokenizer.decode(loop)
    assert not repeats(fixed), tokenizer.decode(fixed)
    reference_model = load_model(str(tiny_model_dir))[0]   # the engine switched the first one's attention
    assert loop == reference_model.generate(torch.tensor([prompt]), max_new_tokens=80, do_sample=False,
                                  min_new_tokens=80)[0, len(prompt):].tolist()


def test_the_chat_page_asks_for_dry_on_its_answers_only_unless_turned_off(monkeypatch) -> None:
    from webapp import config

    for name in ("DRY_MULTIPLIER", "DRY_BASE", "DRY_ALLOWED_LENGTH"):
        monkeypatch.delenv(name, raising=False)
    chat = config.chat_generation_settings()["CHAT_DRY"]
    assert chat == {"dry_multiplier": 0.8, "dry_base": 1.75, "dry_allowed_length": 2, "dry_include_prompt": False}
    monkeypatch.setenv("DRY_MULTIPLIER", "0")
    assert config.chat_generation_settings()["CHAT_DRY"] == {}
    for name, value in (("DRY_MULTIPLIER", "-1"), ("DRY_BASE", "0.5"), ("DRY_ALLOWED_LENGTH", "two")):
        monkeypatch.setenv("DRY_MULTIPLIER", "0.8")
        monkeypatch.setenv(name, value)
        with pytest.raises(config.ConfigError, match=f"{name}|fix the environment"):
            config.chat_generation_settings()
        monkeypatch.delenv(name)


def test_the_loop_count_sees_a_five_word_run_three_times(tiny_model_dir) -> None:
    from bench import loops

    assert loops.loops("Your order is on its way. Your order is on its way, and your order is on its way!")
    assert not loops.loops("Your order is on its way. Your order is on its way; your order is late.")
    report = loops.main(["--model", str(tiny_model_dir), "--seeds", "1", "--max-new-tokens", "8",
                         "--settings", "off", "0.8/1.75/2 answer"])
    assert [s["answers"] for s in report["summary"].values()] == [len(loops.QUESTIONS)] * 2
