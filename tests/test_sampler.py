"""Tests for per-row sampling parameters, logits processors and the batched sampler."""

from __future__ import annotations

import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from worker.engine import native
from worker.engine import sampler as sampler_module
from worker.engine.sampler import (CPU_CANDIDATES, Pending, Sampler, apply_processors, mix32, random_seed,
                                   seed_keys, uniforms)
from worker.engine.sequence import PENDING
from worker.engine.sampling_params import InvalidParamsError, SamplingParams

VOCAB = 64


def random_logits(batch: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, vocab, generator=g) * scale


def random_histories(batch: int, vocab: int = VOCAB, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    # Varying lengths with repeated ids, as real prompt + generated histories have.
    return [torch.randint(0, vocab, (5 + 7 * i,), generator=g).tolist() for i in range(batch)]


def hf_row(processors: list, history: list[int], row: torch.Tensor) -> torch.Tensor:
    input_ids = torch.tensor([history], dtype=torch.long)
    scores = row.unsqueeze(0).clone()
    for proc in processors:
        scores = proc(input_ids, scores)
    return scores[0]


def assert_same_filtering(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(actual), torch.isinf(expected))
    finite = ~torch.isinf(expected)
    torch.testing.assert_close(actual[finite], expected[finite], rtol=0, atol=0)


# --- processors against transformers ---------------------------------------------------


def test_repetition_penalty_matches_transformers() -> None:
    penalties = [1.3, 0.7, 2.0, 1.0, 9.5]
    params = [SamplingParams(repetition_penalty=p) for p in penalties]
    logits = random_logits(len(params))
    histories = random_histories(len(params))
    out = apply_processors(logits, params, histories)
    for i, penalty in enumerate(penalties):
        if penalty == 1.0:
            assert torch.equal(out[i], logits[i])
            continue
        expected = hf_row([RepetitionPenaltyLogitsProcessor(penalty)], histories[i], logits[i])
        assert_same_filtering(out[i], expected)
        assert not torch.equal(out[i], logits[i])


def test_repetition_penalty_ignores_ids_outside_vocab() -> None:
    logits = random_logits(1)
    history = [3, VOCAB + 5, VOCAB + 100]
    out = apply_processors(logits, [SamplingParams(repetition_penalty=1.5)], [history])
    expected = hf_row([RepetitionPenaltyLogitsProcessor(1.5)], history, logits[0])
    assert_same_filtering(out[0], expected)


def test_temperature_matches_transformers() -> None:
    temps = [0.5, 1.0, 1.7, 2.0, 0.05]
    params = [SamplingParams(temperature=t) for t in temps]
    logits = random_logits(len(params))
    out = apply_processors(logits, params, [[]] * len(params))
    for i, t in enumerate(temps):
        expected = hf_row([TemperatureLogitsWarper(t)], [], logits[i])
        torch.testing.assert_close(out[i], expected)
        if t == 1.0:
            assert torch.equal(out[i], logits[i])


def test_greedy_rows_skip_temperature_and_warpers() -> None:
    params = [SamplingParams(temperature=0, top_k=3, top_p=0.2), SamplingParams(temperature=0.5)]
    logits = random_logits(2)
    out = apply_processors(logits, params, [[], []])
    assert torch.equal(out[0], logits[0])
    torch.testing.assert_close(out[1], logits[1] / 0.5)


def test_top_k_matches_transformers() -> None:
    ks = [1, 5, 0, 17, -1, 1000]
    params = [SamplingParams(top_k=k) for k in ks]
    logits = random_logits(len(params))
    out = apply_processors(logits, params, [[]] * len(params))
    for i, k in enumerate(ks):
        if k <= 0:
            assert torch.equal(out[i], logits[i])
            continue
        expected = hf_row([TopKLogitsWarper(k)], [], logits[i])
        assert_same_filtering(out[i], expected)
        assert int(torch.isfinite(out[i]).sum()) == min(k, VOCAB)


def test_top_p_matches_transformers() -> None:
    ps = [0.1, 0.5, 1.0, 0.9, 0.95]
    params = [SamplingParams(top_p=p) for p in ps]
    logits = random_logits(len(params), scale=1.0)
    out = apply_processors(logits, params, [[]] * len(params))
    for i, p in enumerate(ps):
        if p == 1.0:
            assert torch.equal(out[i], logits[i])
            continue
        expected = hf_row([TopPLogitsWarper(p)], [], logits[i])
        assert_same_filtering(out[i], expected)
        assert torch.isinf(out[i]).any()


def test_top_p_disabled_row_keeps_zero_probability_tail() -> None:
    # exp(-200) underflows to 0 in float32, so its cumulative probability is exactly 0.
    logits = torch.tensor([[0.0, -200.0, 1.0, 2.0], [0.0, -200.0, 1.0, 2.0]])
    params = [SamplingParams(), SamplingParams(top_p=0.5)]
    out = apply_processors(logits, params, [[], []])
    assert torch.equal(out[0], logits[0])
    assert torch.isinf(out[1, 1])


def test_all_processors_combined_match_transformers_order() -> None:
    configs = [
        dict(repetition_penalty=1.2, temperature=0.7, top_k=20, top_p=0.8),
        dict(repetition_penalty=0.8, temperature=1.5, top_k=0, top_p=0.6),
        dict(repetition_penalty=1.0, temperature=1.0, top_k=7, top_p=1.0),
        dict(repetition_penalty=3.0, temperature=0.3, top_k=40, top_p=0.95),
        dict(),
    ]
    params = [SamplingParams(**c) for c in configs]
    logits = random_logits(len(params), scale=2.0)
    histories = random_histories(len(params))
    out = apply_processors(logits, params, histories)
    for i, p in enumerate(params):
        procs: list = []
        if p.repetition_penalty != 1.0:
            procs.append(RepetitionPenaltyLogitsProcessor(p.repetition_penalty))
        if p.temperature != 1.0:
            procs.append(TemperatureLogitsWarper(p.temperature))
        if p.top_k > 0:
            procs.append(TopKLogitsWarper(p.top_k))
        if p.top_p < 1.0:
            procs.append(TopPLogitsWarper(p.top_p))
        expected = hf_row(procs, histories[i], logits[i])
        assert_same_filtering(out[i], expected)
    assert torch.equal(out[4], logits[4])


def test_apply_processors_returns_new_float32_tensor() -> None:
    logits = random_logits(2).to(torch.bfloat16)
    before = logits.clone()
    params = [SamplingParams(repetition_penalty=1.5, top_k=3), SamplingParams()]
    out = apply_processors(logits, params, [[1, 2, 3], [4]])
    assert out.dtype == torch.float32
    assert torch.equal(logits, before)
    assert torch.equal(out[1], logits[1].float())

    plain = random_logits(1)
    untouched = apply_processors(plain, [SamplingParams()], [[]])
    assert untouched.data_ptr() != plain.data_ptr()


# --- sampler ---------------------------------------------------------------------------

FULL = dict(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.3)


def peaked_logits(batch: int, vocab: int, seed: int) -> torch.Tensor:
    """Logits shaped like a language model's: a few likely tokens, a long tail (Zipf-like), shuffled."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.arange(1, vocab + 1, dtype=torch.float32)
    rows = [(-1.3 * ranks.log())[torch.randperm(vocab, generator=g)] for _ in range(batch)]
    return torch.stack(rows) + torch.randn(batch, vocab, generator=g) * 0.1


def decode(target: SamplingParams, seed: int, mates: list[tuple[SamplingParams, int]], position: int,
           vocab: int = 512, steps: int = 25, sampler: Sampler | None = None) -> list[int]:
    """Decode `steps` tokens for `target` at `position` among `mates`; its logits depend only on its own history."""
    sampler = sampler or Sampler()
    rows = mates[:position] + [(target, seed)] + mates[position:]
    histories = [[(7 * i + j) % vocab for j in range(5 + 3 * i)] for i in range(len(rows))]
    histories[position] = [1, 2, 3, 2, 1]
    out = []
    for step in range(steps):
        logits = peaked_logits(len(rows), vocab, seed=10_000 + step)
        # Flat (near-uniform) logits for the mates at odd steps force top-p past the candidates.
        if step % 2:
            logits = logits * 0.01
        own = histories[position]
        logits[position] = peaked_logits(1, vocab, seed=sum(own) * 131 + len(own))[0]
        tokens = sampler(logits, [p for p, _ in rows], histories, [s for _, s in rows]).tolist()
        for history, token in zip(histories, tokens):
            history.append(token)
        out.append(tokens[position])
    return out


MATES = [
    (SamplingParams(temperature=1.0), 1),                                   # whole-row draw
    (SamplingParams(temperature=0), 2),                                     # greedy
    (SamplingParams(top_p=0.99, temperature=2.0), 3),                       # cut-off beyond the candidates
    (SamplingParams(top_k=3, repetition_penalty=0.5), 4),
    (SamplingParams(temperature=0, repetition_penalty=2.0), 5),             # greedy with a penalty
]


def test_same_seed_gives_same_tokens_alone_or_in_any_batch() -> None:
    target = SamplingParams(**FULL)
    alone = decode(target, 1234, [], 0)
    assert len(set(alone)) > 3
    for position, mates in [(2, MATES), (0, MATES[::-1]), (1, MATES[1:2]), (3, MATES[2:] + MATES[:1])]:
        assert decode(target, 1234, mates, position) == alone, (position, mates)
    # Other paths through the sampler: forced full sorts on CPU.
    assert decode(target, 1234, MATES, 4, sampler=Sampler(candidates=0)) == alone


def test_same_seed_plain_temperature_is_batch_independent() -> None:
    target = SamplingParams(temperature=1.2)
    alone = decode(target, 99, [], 0)
    assert decode(target, 99, MATES, 3) == alone
    assert decode(target, 99, MATES[::-1], 1) == alone


RACE_MATES = [(SamplingParams(temperature=1.0), 1), (SamplingParams(temperature=0), 2),
              (SamplingParams(temperature=0.5, repetition_penalty=1.5), 3)]


def test_the_race_draw_is_batch_independent_and_greedy_rows_stay_exact() -> None:
    target = SamplingParams(temperature=0.8)
    alone = decode(target, 7, [], 0, sampler=Sampler(race=True))
    assert len(set(alone)) > 3
    assert decode(target, 7, RACE_MATES, 2, sampler=Sampler(race=True)) == alone
    assert decode(target, 7, RACE_MATES[::-1], 0, sampler=Sampler(race=True)) == alone
    # a greedy row in the race batch is the exact argmax, as in the other draw
    greedy = SamplingParams(temperature=0)
    assert decode(greedy, 3, RACE_MATES, 1, sampler=Sampler(race=True)) == decode(greedy, 3, [], 0)


def test_different_seeds_give_different_samples() -> None:
    first = decode(SamplingParams(temperature=1.5), 1, [], 0)
    second = decode(SamplingParams(temperature=1.5), 2, [], 0)
    assert first != second


def test_uniforms_are_uniform_and_independent_across_positions_and_seeds() -> None:
    positions = torch.arange(250, dtype=torch.int64).repeat(400)
    keys = [seed_keys(int(s)) for s in range(400)]
    key_a = torch.tensor([a for a, _ in keys]).repeat_interleave(250)
    key_b = torch.tensor([b for _, b in keys]).repeat_interleave(250)
    u = uniforms(key_a, key_b, positions)
    assert u.dtype == torch.float32 and bool((u >= 0).all()) and bool((u < 1).all())
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert bool((counts - 10_000).abs().max() < 500), counts   # sd of a bin: about 95
    grid = u.view(400, 250)
    # Neighbouring positions of one seed, and neighbouring seeds at one position, are uncorrelated.
    for a, b in ((grid[:, :-1], grid[:, 1:]), (grid[:-1], grid[1:])):
        corr = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
        assert abs(float(corr)) < 0.02, float(corr)
    # Seeds above 32 bits matter in both halves.
    assert seed_keys(1) != seed_keys(1 + 2**32) != seed_keys(2**62 + 1)
    assert mix32(0) == mix32(0) and 0 <= mix32(2**32 - 1) < 2**32


def expected_probs(logits_row: torch.Tensor, params: SamplingParams, history: list[int]) -> torch.Tensor:
    procs: list = [RepetitionPenaltyLogitsProcessor(params.repetition_penalty), TemperatureLogitsWarper(params.temperature)]
    if params.top_k > 0:
        procs.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        procs.append(TopPLogitsWarper(params.top_p))
    return torch.softmax(hf_row(procs, history, logits_row).double(), dim=-1)


@pytest.mark.parametrize("config", [
    dict(temperature=0.7),
    dict(temperature=1.5, top_k=6),
    dict(temperature=1.0, top_p=0.7),
    dict(temperature=0.9, top_k=8, top_p=0.85, repetition_penalty=1.8),
    dict(temperature=1.3, repetition_penalty=0.6),
], ids=["temperature", "top-k", "top-p", "all", "penalty-below-one"])
@pytest.mark.parametrize("candidates", [CPU_CANDIDATES, 0, "race"], ids=["candidates", "full-sort", "race"])
def test_draw_frequencies_match_transformers_processors(config: dict, candidates: int | str) -> None:
    params = SamplingParams(**config)
    vocab, rows = 24, 40_000
    logits_row = random_logits(1, vocab=vocab, seed=5, scale=1.5)[0]
    history = [0, 3, 3, 7, 11]
    want = expected_probs(logits_row, params, history)
    sampler = Sampler(race=True) if candidates == "race" else Sampler(candidates)
    got = sampler(logits_row.expand(rows, -1), [params] * rows, [history] * rows, list(range(rows)))
    freq = torch.bincount(got, minlength=vocab).double() / rows
    assert set(got.unique().tolist()) <= set(torch.nonzero(want).flatten().tolist())
    assert bool((freq[want == 0] == 0).all())
    # sd of a frequency is at most 0.0025 here; 0.012 is about five of them.
    assert float((freq - want).abs().max()) < 0.012, (freq, want)


def test_top_k_only_samples_from_top_k() -> None:
    logits_row = random_logits(1, seed=7, scale=0.5)[0]
    params = SamplingParams(top_k=5)
    draws = Sampler()(logits_row.expand(2000, -1), [params] * 2000, [[1]] * 2000, list(range(2000)))
    allowed = set(torch.topk(logits_row, 5).indices.tolist())
    assert set(draws.tolist()) == allowed  # 2000 draws over 5 similar tokens hit each one


def nucleus(logits_row: torch.Tensor, top_p: float) -> set[int]:
    """Tokens kept by top-p, computed in float64 by walking from the most likely token."""
    probs = torch.softmax(logits_row.double(), dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda t: probs[t], reverse=True)
    kept, mass = set(), 0.0
    for token in order:
        kept.add(token)
        mass += probs[token]
        if mass >= top_p:
            break
    return kept


@pytest.mark.parametrize("vocab", [VOCAB, 4096])
def test_top_p_only_samples_from_nucleus(vocab: int) -> None:
    logits_row = peaked_logits(1, vocab, seed=11)[0] if vocab > VOCAB else random_logits(1, seed=11, scale=1.0)[0]
    expected = nucleus(logits_row, 0.5)
    assert 1 < len(expected) < vocab // 2
    params = SamplingParams(top_p=0.5)
    draws = Sampler()(logits_row.expand(2000, -1), [params] * 2000, [[1]] * 2000, list(range(2000)))
    seen = set(draws.tolist())
    assert seen <= expected
    assert len(seen) > 1


def test_greedy_rows_return_exact_argmax_in_mixed_batch() -> None:
    logits = random_logits(5, scale=0.1)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, top_p=0.3),
        SamplingParams(temperature=0, top_k=2),
        SamplingParams(temperature=2.0, repetition_penalty=1.5),
        SamplingParams(temperature=0, repetition_penalty=3.0),
    ]
    histories = [[1, 2], [3], [4, 4], [5], [int(logits[4].argmax())]]
    out = Sampler()(logits, params, histories, [1, 2, 3, 4, 5])
    assert out.dtype == torch.int64 and out.shape == (5,)
    assert int(out[0]) == int(logits[0].argmax())
    assert int(out[2]) == int(logits[2].argmax())
    penalised = hf_row([RepetitionPenaltyLogitsProcessor(3.0)], histories[4], logits[4])
    assert int(out[4]) == int(penalised.argmax()) != int(logits[4].argmax())


def test_greedy_with_repetition_penalty_uses_penalised_logits() -> None:
    logits = torch.tensor([[0.1, 4.0, 3.0, -1.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=2.0)]
    out = Sampler()(logits, params, [[1, 1, 3]], [0])
    # Token 1 (4.0) drops to 2.0 after the penalty, so token 2 (3.0) wins.
    assert int(out[0]) == 2


def test_all_greedy_batch_is_plain_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_args: object, **_kwargs: object) -> torch.Tensor:
        raise AssertionError("the all-greedy path must not run the processors")

    monkeypatch.setattr(sampler_module, "processed", fail)
    logits = random_logits(6)
    out = Sampler()(logits, [SamplingParams(temperature=0)] * 6, [[1, 2]] * 6, [0] * 6)
    assert torch.equal(out, logits.argmax(dim=-1))


def test_penalty_history_follows_rows_that_join_leave_and_move() -> None:
    vocab = 50
    sampler = Sampler()
    g = torch.Generator().manual_seed(3)
    histories = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (3, 9, 1, 30)]
    params = [SamplingParams(temperature=0, repetition_penalty=p) for p in (1.5, 0.5, 2.0, 3.0)]
    batches = [[0, 1, 2, 3], [0, 1, 2, 3], [3, 1], [2, 0, 3], [1, 2, 3, 0], [1]]
    for step, rows in enumerate(batches):
        logits = random_logits(len(rows), vocab=vocab, seed=step)
        out = sampler(logits, [params[r] for r in rows], [histories[r] for r in rows], rows)
        for i, r in enumerate(rows):
            want = hf_row([RepetitionPenaltyLogitsProcessor(params[r].repetition_penalty)], histories[r], logits[i])
            assert int(out[i]) == int(want.argmax()), (step, r)
            histories[r].append(int(out[i]))
    assert sampler.history.ids.shape[1] >= len(histories[1])


def test_penalty_reads_a_last_token_still_on_the_device() -> None:
    """Overlapped steps draw before the last step's tokens are read back: each history's last id is then a
    placeholder whose token sits in the last step's output. The penalty must see it as if it were known."""
    vocab = 50
    sampler = Sampler()
    g = torch.Generator().manual_seed(5)
    real = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (3, 9, 1, 30)]
    hosted = [list(h) for h in real]   # what the engine holds: placeholders until a step is read back
    params = [SamplingParams(temperature=0, repetition_penalty=p) for p in (1.5, 0.5, 2.0, 3.0)]
    batches = [[0, 1, 2, 3], [0, 1, 2, 3], [3, 1], [2, 0, 3], [1, 2, 3, 0], [1]]
    last, last_rows = None, []
    for step, rows in enumerate(batches):
        logits = random_logits(len(rows), vocab=vocab, seed=step)
        for i, r in enumerate(rows):   # the last token would win unpenalised: a missed penalty shows
            others = logits[i].clone()
            others[real[r][-1]] = float("-inf")
            logits[i, real[r][-1]] = others.max().abs() * 1.2
        pending = None
        if last is not None:
            where = {r: i for i, r in enumerate(last_rows)}
            pending = Pending(last, [where.get(r) for r in rows])
        out = sampler(logits, [params[r] for r in rows], [hosted[r] for r in rows], rows, pending)
        for r in last_rows:   # the last step's tokens read back, after this step drew
            hosted[r][-1] = real[r][-1]
        for i, r in enumerate(rows):
            want = hf_row([RepetitionPenaltyLogitsProcessor(params[r].repetition_penalty)], real[r], logits[i])
            assert int(out[i]) == int(want.argmax()), (step, r)
            real[r].append(int(out[i]))
            hosted[r].append(PENDING)
        last, last_rows = out, rows
    assert PENDING in hosted[1]


def test_candidate_path_and_full_sort_give_the_same_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = []
    draw = sampler_module.draw_candidates
    monkeypatch.setattr(sampler_module, "draw_candidates", lambda cut, *a: taken.append(cut.values.shape[1])
                        or draw(cut, *a))
    vocab, rows = 4096, 64
    logits = peaked_logits(rows, vocab, seed=21)
    params = [SamplingParams(temperature=0.7, top_p=0.9, top_k=k, repetition_penalty=1.2) for k in (0, 40) * 32]
    histories = [[i, i + 1, 2 * i] for i in range(rows)]
    seeds = list(range(rows))
    fast = Sampler()(logits, params, histories, seeds)
    assert taken, "peaked logits keep every nucleus among the candidates"
    assert max(taken) < sampler_module.CPU_CANDIDATES   # drawn among the widest row's kept tokens only
    full = Sampler(candidates=0)(logits, params, histories, seeds)
    assert torch.equal(fast, full)


@pytest.mark.parametrize("kernel", ["c", "torch"])
def test_exp_sums_are_top_ps_normaliser_with_the_same_bits_alone_or_in_any_batch(
        kernel: str, two_threads, monkeypatch: pytest.MonkeyPatch) -> None:
    if kernel == "c" and native.load_top_k() is None:
        pytest.skip("no C compiler for top_k.c")
    if kernel == "torch":
        monkeypatch.setattr(sampler_module.native, "load_top_k", lambda: None)
    scores = random_logits(7, 49_157, seed=5) * 4.0
    scores[1, :20_000] = float("-inf")               # masked tokens weigh nothing
    scores[2, 7] = scores[2].max() - 90.0            # below exp's range: nothing either
    scores[3] = 0.0                                  # every weight 1
    row_max = scores.amax(dim=-1, keepdim=True)
    sums = sampler_module.exp_sums(scores, row_max)
    assert sums.shape == (7, 1)
    reference = (scores.double() - row_max.double()).exp().sum(dim=-1, keepdim=True)
    torch.testing.assert_close(sums.double(), reference, rtol=2e-5, atol=0)
    assert sums[3].item() == 49_157
    for i in range(7):
        assert torch.equal(sampler_module.exp_sums(scores[i:i + 1], row_max[i:i + 1]), sums[i:i + 1]), i
        assert torch.equal(sampler_module.exp_sums(scores[i:], row_max[i:]), sums[i:]), i
    # each exponential to within 2 ulp of float32's: rows of 16 equal scores, summed exactly (times 16)
    values = torch.linspace(-87.0, 0.0, 2001)
    each = sampler_module.exp_sums(values.unsqueeze(1).expand(-1, 16).contiguous(), torch.zeros(2001, 1)) / 16
    torch.testing.assert_close(each.squeeze(1).double(), values.double().exp(), rtol=2.5e-7, atol=0)
    short = random_logits(3, 37, seed=6)             # two blocks of 16 and a tail
    short_max = short.amax(dim=-1, keepdim=True)
    torch.testing.assert_close(sampler_module.exp_sums(short, short_max).double(),
                               (short.double() - short_max.double()).exp().sum(dim=-1, keepdim=True), rtol=1e-6, atol=0)


def test_the_candidate_search_is_the_cpus_default_and_a_devices_only_when_asked() -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert Sampler().candidate_limit(cpu) == sampler_module.CPU_CANDIDATES
    assert Sampler().candidate_limit(cuda) == 0          # no host read mid-step unless asked
    assert Sampler(candidates=0).candidate_limit(cpu) == 0
    assert Sampler(candidates=512).candidate_limit(cuda) == 512
    assert Sampler(candidates=512).candidate_limit(cpu) == 512


@pytest.mark.parametrize("kernel", ["c", "torch"])
def test_row_sums_have_the_same_bits_alone_or_in_any_batch(kernel: str, two_threads,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """top-p's normaliser over a vocabulary-sized row: torch's sum splits a lone row between two threads (and only
    a lone one), which gave a request alone other draws than in a batch, e.g. after a redelivery."""
    if kernel == "c" and native.load_top_k() is None:
        pytest.skip("no C compiler for top_k.c")
    if kernel == "torch":
        monkeypatch.setattr(sampler_module.native, "load_top_k", lambda: None)
    weights = (random_logits(6, 49_157, seed=3) - 9.0).exp()
    together = sampler_module.row_sums(weights)
    assert together.shape == (6, 1)
    torch.testing.assert_close(together.double(), weights.double().sum(dim=-1, keepdim=True), rtol=1e-5, atol=0)
    for i in range(6):
        assert torch.equal(sampler_module.row_sums(weights[i:i + 1]), together[i:i + 1]), i
        assert torch.equal(sampler_module.row_sums(weights[i:]), together[i:]), i


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kinds", [
    [SamplingParams(**FULL)],
    [SamplingParams(temperature=0.9)],
    [SamplingParams(**FULL), SamplingParams(temperature=0), SamplingParams(temperature=1.1, top_p=0.8)],
], ids=["all-processors", "temperature", "mixed"])
def test_tensor_ops_per_call_do_not_grow_with_the_batch(kinds: list[SamplingParams]) -> None:
    def ops(rows: int) -> list[str]:
        params = [kinds[i % len(kinds)] for i in range(rows)]
        histories = [[1, 2, 3 + i] for i in range(rows)]
        logits = peaked_logits(rows, 2048, seed=rows)
        sampler = Sampler()
        sampler(logits, params, histories, list(range(rows)))   # builds the per-row tensors
        for h in histories:
            h.append(5)
        with OpCounter() as counter:
            sampler(logits, params, histories, list(range(rows)))
        return counter.ops

    small, large = ops(6), ops(96)
    assert small == large
    assert not any("multinomial" in op for op in small)


def test_per_row_tensors_are_built_once_per_set_of_requests(monkeypatch: pytest.MonkeyPatch) -> None:
    builds = []
    build = sampler_module.RowParams.build.__func__
    monkeypatch.setattr(sampler_module.RowParams, "build",
                        classmethod(lambda cls, *a: builds.append(1) or build(cls, *a)))
    params = [SamplingParams(**FULL), SamplingParams(temperature=0.5)]
    histories = [[1], [2]]
    sampler = Sampler()
    for _ in range(3):
        sampler(random_logits(2), params, histories, [1, 2])
        for h in histories:
            h.append(3)
    assert len(builds) == 1
    sampler(random_logits(1), params[:1], histories[:1], [1])
    assert len(builds) == 2


def test_random_seed_is_random_and_in_range() -> None:
    seeds = {random_seed() for _ in range(8)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)


# --- validation ------------------------------------------------------------------------


def test_valid_params_pass() -> None:
    SamplingParams().validate()
    SamplingParams(
        temperature=2.0, top_k=-1, top_p=1.0, repetition_penalty=10.0, seed=2**63 - 1,
        max_new_tokens=1, stop=["x" * 64] * 4, ignore_eos=True,
    ).validate()
    SamplingParams(temperature=0, top_k=1, top_p=1e-6, repetition_penalty=0.01, seed=0).validate()


def test_stop_is_normalised_to_tuple() -> None:
    assert SamplingParams(stop="END").stop == ("END",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("temperature", "1"),
        ("temperature", True),
        ("top_k", -2),
        ("top_k", 1.5),
        ("top_k", True),
        ("top_p", 0),
        ("top_p", 1.01),
        ("top_p", math.nan),
        ("repetition_penalty", 0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.inf),
        ("seed", -1),
        ("seed", 2**63),
        ("seed", 1.0),
        ("seed", False),
        ("max_new_tokens", 0),
        ("max_new_tokens", 2.0),
        ("max_new_tokens", True),
        ("stop", [""]),
        ("stop", [1]),
        ("stop", 5),
        ("ignore_eos", "yes"),
    ],
)
def test_invalid_params_raise(field: str, value: object) -> None:
    params = SamplingParams(**{field: value})
    with pytest.raises(InvalidParamsError, match=field):
        params.validate()


def test_invalid_params_error_is_value_error_with_range() -> None:
    with pytest.raises(ValueError, match=r"temperature must be a number >= 0 \(0 = greedy\); got -1"):
        SamplingParams(temperature=-1).validate()


# --- presence and frequency penalties, logit bias, min_p, grammar masks, log-probabilities -------------------------


def reference_counts(row: torch.Tensor, generated: list[int], presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's definition, token by token: logit -= frequency * count + presence * (count > 0)."""
    out = row.clone()
    for token in set(generated):
        if token < len(out):
            count = generated.count(token)
            out[token] -= frequency * count + presence * (count > 0)
    return out


def test_presence_and_frequency_penalties_count_generated_tokens_only() -> None:
    settings = [(0.0, 0.0), (1.5, 0.0), (0.0, 0.7), (-0.5, 2.0), (2.0, -2.0), (0.3, 0.3)]
    params = [SamplingParams(presence_penalty=p, frequency_penalty=f) for p, f in settings]
    logits = random_logits(len(params))
    histories = random_histories(len(params))
    prompt_lens = [3, 0, 5, 9, 1, 4]
    out = apply_processors(logits, params, histories, prompt_lens)
    for i, (presence, frequency) in enumerate(settings):
        want = reference_counts(logits[i], histories[i][prompt_lens[i]:], presence, frequency)
        torch.testing.assert_close(out[i], want)
    assert torch.equal(out[0], logits[0])
    # A token only in the prompt is not penalised.
    only_prompt = set(histories[2][:5]) - set(histories[2][5:])
    assert only_prompt and all(out[2, t] == logits[2, t] for t in only_prompt)


def test_penalties_combine_with_the_repetition_penalty_in_order() -> None:
    params = [SamplingParams(repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.25),
              SamplingParams(repetition_penalty=0.8, frequency_penalty=1.0), SamplingParams()]
    logits = random_logits(3)
    histories = random_histories(3)
    out = apply_processors(logits, params, histories, [2, 4, 0])
    for i, p in enumerate(params):
        want = hf_row([RepetitionPenaltyLogitsProcessor(p.repetition_penalty)], histories[i], logits[i])
        want = reference_counts(want, histories[i][[2, 4, 0][i]:], p.presence_penalty, p.frequency_penalty)
        torch.testing.assert_close(out[i], want)


def test_logit_bias_is_added_per_row_and_ids_past_the_vocab_are_dropped() -> None:
    biases = [{3: 5.0, 10: -100.0}, None, {VOCAB - 1: 0.5, VOCAB + 3: 9.0}, {0: 100.0}]
    params = [SamplingParams(logit_bias=b) for b in biases]
    logits = random_logits(len(params))
    out = apply_processors(logits, params, [[]] * len(params))
    for i, bias in enumerate(biases):
        want = logits[i].clone()
        for token, value in (bias or {}).items():
            if token < VOCAB:
                want[token] += value
        torch.testing.assert_close(out[i], want)
    assert torch.equal(out[1], logits[1])


class ReadCounting(dict):
    def __init__(self, *args) -> None:
        super().__init__(*args)
        self.reads = 0

    def items(self):
        self.reads += 1
        return super().items()


def test_a_requests_logit_bias_is_read_once_however_often_the_batch_changes() -> None:
    """The batch's bias is rebuilt whenever a request joins or leaves; each request's own tensors are kept (a long
    bias, such as the chat's digit ban in a vocabulary of digit groups, took half a second a rebuild at 256 rows)."""
    biases = [{3: 5.0, 10: -100.0}, None, {VOCAB - 1: 0.5, VOCAB + 3: 9.0}, {0: 100.0, 7: -1.0, 9: 2.0}]
    params = [SamplingParams(temperature=0.0, logit_bias=b) for b in biases]
    for p in params:   # after the params' own checks
        p.logit_bias = ReadCounting(p.logit_bias) if p.logit_bias else None
    sampler = Sampler()
    batches = ([0, 1, 2], [1, 2], [2, 3, 0], [0, 2], [3, 2, 1, 0])
    for batch in batches:
        rows = [params[i] for i in batch]
        logits = random_logits(len(rows))
        want = logits.clone()
        for row, p in enumerate(rows):
            for token, value in dict(p.logit_bias or {}).items():
                if token < VOCAB:
                    want[row, token] += value
        assert torch.equal(sampler(logits, rows, [[1]] * len(rows), list(range(len(rows)))), want.argmax(-1))
        got = sampler.rows_for(rows, list(range(len(rows))), logits.shape[1], logits.device).bias
        table = torch.zeros_like(logits).index_put_((got.rows, got.ids), got.values, accumulate=True)
        torch.testing.assert_close(logits + table, want)
    # once each time a request joins the batch: 0 at the first and third, 2 at the first, 3 at the third and fifth
    # (a build from the dicts reads each at every build it is in: 4, 5 and 2 times)
    joins = [sum(i in b and (k == 0 or i not in batches[k - 1]) for k, b in enumerate(batches)) for i in (0, 2, 3)]
    assert [params[i].logit_bias.reads for i in (0, 2, 3)] == joins == [2, 1, 2]


def test_logit_bias_comes_first_then_the_penalty_sees_it() -> None:
    logits = torch.tensor([[1.0, 2.0, -1.0, 0.5]])
    out = apply_processors(logits, [SamplingParams(logit_bias={0: -3.0}, repetition_penalty=2.0)], [[0]])
    assert out[0, 0].item() == pytest.approx(-4.0)   # (1 - 3) * 2: the biased score is negative, so multiplied


@pytest.mark.parametrize("config", [dict(min_p=0.1), dict(min_p=0.3, temperature=0.5),
                                    dict(min_p=0.05, top_k=5, temperature=1.5), dict(min_p=0.2, top_p=0.8)])
def test_min_p_matches_transformers_after_temperature_top_k_and_top_p(config: dict) -> None:
    from transformers.generation.logits_process import MinPLogitsWarper

    params = SamplingParams(**config)
    logits = random_logits(1, scale=2.0)
    greedy = SamplingParams(min_p=params.min_p, temperature=0)
    out = apply_processors(logits.expand(2, -1).contiguous(), [params, greedy], [[], []])
    procs: list = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        procs.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        procs.append(TopPLogitsWarper(params.top_p))
    procs.append(MinPLogitsWarper(params.min_p))
    assert_same_filtering(out[0], hf_row(procs, [], logits[0]))
    assert torch.isinf(out[0]).any()
    assert torch.equal(out[1], logits[0])   # greedy rows skip min_p


def random_masks(rows: int, vocab: int, seed: int, words: int | None = None) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    words = words if words is not None else (vocab + 31) // 32
    return torch.randint(-2**31, 2**31 - 1, (rows, words), generator=g, dtype=torch.int64).to(torch.int32)


def reference_allowed(bits: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.tensor([[bool((int(bits[r, t // 32]) >> (t % 32)) & 1) if t // 32 < bits.shape[1] else False
                          for t in range(vocab)] for r in range(bits.shape[0])])


@pytest.mark.parametrize("vocab,words", [(VOCAB, None), (70, None), (100, 2)], ids=["exact", "ragged", "wider-logits"])
def test_grammar_masks_apply_to_their_rows_only(vocab: int, words: int | None) -> None:
    from worker.engine.sampler import GrammarMasks, mask_addend

    bits = random_masks(2, vocab, seed=vocab, words=words)
    addend = mask_addend(bits, vocab)
    assert torch.equal(addend == 0, reference_allowed(bits, vocab)) and bool(torch.isinf(addend[addend != 0]).all())
    logits = random_logits(4, vocab=vocab)
    masks = GrammarMasks(rows=torch.tensor([3, 1]), bits=bits, every_row=False)
    params = [SamplingParams(temperature=0)] * 4
    out = apply_processors(logits, params, [[]] * 4, masks=masks)
    allowed = reference_allowed(bits, vocab)
    for row, mask in ((3, allowed[0]), (1, allowed[1])):
        assert torch.equal(out[row], logits[row].masked_fill(~mask, float("-inf")))
    assert torch.equal(out[0], logits[0]) and torch.equal(out[2], logits[2])
    # Greedy rows take the argmax of what the mask allows.
    tokens = Sampler()(logits, params, [[]] * 4, [0] * 4, masks=masks)
    for row, mask in ((3, allowed[0]), (1, allowed[1])):
        assert int(tokens[row]) == int(logits[row].masked_fill(~mask, float("-inf")).argmax())
    assert int(tokens[0]) == int(logits[0].argmax())


def test_sampled_rows_draw_only_allowed_tokens() -> None:
    from worker.engine.sampler import GrammarMasks

    vocab, rows = 200, 64
    bits = torch.zeros(rows, 7, dtype=torch.int32)
    allowed = [{(7 * r + j * 13) % vocab for j in range(4)} for r in range(rows)]
    for r, tokens in enumerate(allowed):
        for t in tokens:
            bits[r, t // 32] |= torch.tensor(1 << (t % 32), dtype=torch.int64).to(torch.int32)
    kinds = [dict(temperature=1.0), dict(temperature=0.7, top_k=2), dict(temperature=1.2, top_p=0.5, min_p=0.1),
             dict(temperature=0.0), dict(temperature=1.0, logit_bias={5: 50.0})]
    params = [SamplingParams(**kinds[r % len(kinds)]) for r in range(rows)]
    masks = GrammarMasks(rows=torch.arange(rows), bits=bits, every_row=True)
    for candidates in (None, 0):
        tokens = Sampler(candidates)(random_logits(rows, vocab=vocab, seed=3), params, [[1]] * rows,
                                     list(range(rows)), masks=masks)
        assert all(int(t) in allowed[r] for r, t in enumerate(tokens)), candidates


def test_greedy_rows_stay_exact_argmax_after_every_processor() -> None:
    from worker.engine.sampler import GrammarMasks

    logits = random_logits(4, scale=0.5)
    params = [SamplingParams(temperature=0, logit_bias={7: 1.0}, presence_penalty=0.5, frequency_penalty=0.5,
                             repetition_penalty=1.3, min_p=0.5, top_k=2),
              SamplingParams(temperature=0.9, seed=1), SamplingParams(temperature=0),
              SamplingParams(temperature=0, frequency_penalty=2.0)]
    histories = [[7, 7, 1, 2, 9], [3], [4, 4], [1, 1, 1, 5]]
    bits = random_masks(1, VOCAB, seed=9)
    masks = GrammarMasks(rows=torch.tensor([0]), bits=bits, every_row=False)
    out = Sampler()(logits, params, histories, [1, 2, 3, 4], prompt_lens=[2, 0, 0, 1], masks=masks)
    processed = apply_processors(logits, [SamplingParams(**{**p.__dict__, "temperature": 0}) for p in params],
                                 histories, [2, 0, 0, 1], masks)
    for row in (0, 2, 3):
        assert int(out[row]) == int(processed[row].argmax())
    want0 = reference_counts(hf_row([RepetitionPenaltyLogitsProcessor(1.3)], histories[0],
                                    logits[0] + torch.nn.functional.one_hot(torch.tensor(7), VOCAB)),
                             histories[0][2:], 0.5, 0.5)
    want0 = want0.masked_fill(~reference_allowed(bits, VOCAB)[0], float("-inf"))
    assert int(out[0]) == int(want0.argmax())
    assert int(out[3]) == int(reference_counts(logits[3], [1, 1, 5], 0.0, 2.0).argmax())


@pytest.mark.parametrize("config", [
    dict(temperature=0.8, min_p=0.15),
    dict(temperature=1.1, presence_penalty=1.0, frequency_penalty=0.5, logit_bias={2: 1.5, 9: -2.0}),
    dict(temperature=0.9, top_k=8, min_p=0.05, logit_bias={0: 3.0}),
], ids=["min-p", "penalties-and-bias", "top-k-min-p-bias"])
@pytest.mark.parametrize("candidates", [CPU_CANDIDATES, 0], ids=["candidates", "device-path"])
def test_draw_frequencies_with_the_new_processors(config: dict, candidates: int) -> None:
    from transformers.generation.logits_process import MinPLogitsWarper

    params = SamplingParams(**config)
    vocab, rows = 24, 40_000
    logits_row = random_logits(1, vocab=vocab, seed=6, scale=1.5)[0]
    history, prompt_len = [0, 3, 3, 7, 11, 9, 9], 2
    row = logits_row.clone()
    for token, value in (params.logit_bias or {}).items():
        row[token] += value
    row = reference_counts(row, history[prompt_len:], params.presence_penalty, params.frequency_penalty)
    procs: list = [TemperatureLogitsWarper(params.temperature)]
    if params.top_k:
        procs.append(TopKLogitsWarper(params.top_k))
    if params.min_p:
        procs.append(MinPLogitsWarper(params.min_p))
    want = torch.softmax(hf_row(procs, history, row).double(), dim=-1)
    got = Sampler(candidates)(logits_row.expand(rows, -1), [params] * rows, [history] * rows, list(range(rows)),
                              prompt_lens=[prompt_len] * rows)
    freq = torch.bincount(got, minlength=vocab).double() / rows
    assert bool((freq[want == 0] == 0).all())
    assert float((freq - want).abs().max()) < 0.012, (freq, want)


def test_a_binding_top_k_draws_among_candidates_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """top-k cut-offs are found among k + 1 candidates: the one left out shows that none was cut short, so no
    row is redrawn over its whole vocabulary."""
    full = []
    draw_full = sampler_module.draw_full
    monkeypatch.setattr(sampler_module, "draw_full", lambda *a: full.append(1) or draw_full(*a))
    logits = peaked_logits(16, 4096, seed=4)
    params = [SamplingParams(temperature=0.7, top_k=k, top_p=0.9) for k in (50, 20) * 8]
    fast = Sampler()(logits, params, [[1]] * 16, list(range(16)))
    assert full == []
    assert torch.equal(fast, Sampler(candidates=0)(logits, params, [[1]] * 16, list(range(16))))


HOST_READS = ("nonzero", "_local_scalar_dense", "is_nonzero", "item")


@pytest.mark.parametrize("kinds", [
    [SamplingParams(**FULL)],
    [SamplingParams(temperature=0.9, top_p=0.8), SamplingParams(temperature=0)],
    [SamplingParams(temperature=0.7, top_k=40, min_p=0.05, presence_penalty=0.4, logit_bias={3: 2.0})],
], ids=["top-k-top-p", "top-p-alone", "top-k-min-p-penalties-bias"])
def test_the_device_path_reads_nothing_on_the_host(kinds: list[SamplingParams], monkeypatch) -> None:
    """Outside the CPU a read in the middle of a step would wait for the device's queue: none may happen (the CPU
    runs the same path with candidates=0, and torch.topk as a device does, not the C top-k)."""
    monkeypatch.setattr(sampler_module.native, "load_top_k", lambda: None)
    rows = 12
    params = [kinds[i % len(kinds)] for i in range(rows)]
    histories = [[1, 2, 3 + i] for i in range(rows)]
    sampler = Sampler(candidates=0)
    logits = peaked_logits(rows, 2048, seed=1)
    sampler(logits, params, histories, list(range(rows)), prompt_lens=[1] * rows)
    for h in histories:
        h.append(5)
    with OpCounter() as counter:
        sampler(logits, params, histories, list(range(rows)), prompt_lens=[1] * rows)
    assert not [op for op in counter.ops if any(name in op for name in HOST_READS)]
    sorts = [op for op in counter.ops if op.startswith("aten.sort")]
    if any(p.top_p < 1 and not p.top_k for p in params):
        assert sorts   # a top-p row without top-k: its cut-off may lie anywhere
    else:   # a top-k cut-off lies among the best max(k) + 1 tokens: no sort
        assert not sorts and any(op.startswith("aten.topk") for op in counter.ops)


@pytest.mark.parametrize("kinds", [
    [SamplingParams(temperature=0.8, presence_penalty=0.5, frequency_penalty=0.2, min_p=0.1, logit_bias={4: 1.0})],
    [SamplingParams(temperature=0), SamplingParams(temperature=1.1, logit_bias={1: -5.0}), SamplingParams(**FULL)],
], ids=["new-processors", "mixed"])
def test_new_processors_take_a_fixed_number_of_tensor_ops(kinds: list[SamplingParams]) -> None:
    from worker.engine.sampler import GrammarMasks

    def ops(rows: int) -> list[str]:
        params = [kinds[i % len(kinds)] for i in range(rows)]
        histories = [[1, 2, 3 + i, 4] for i in range(rows)]
        logits = peaked_logits(rows, 2048, seed=rows)
        bits = random_masks(rows // 2, 2048, seed=rows)
        masks = GrammarMasks(rows=torch.arange(0, rows, 2), bits=bits, every_row=False)
        sampler = Sampler()
        sampler(logits, params, histories, list(range(rows)), prompt_lens=[2] * rows, masks=masks)
        for h in histories:
            h.append(5)
        with OpCounter() as counter:
            sampler(logits, params, histories, list(range(rows)), prompt_lens=[2] * rows, masks=masks)
        return counter.ops

    assert ops(6) == ops(96)


def test_logprobs_of_sampled_tokens_are_the_raw_distributions() -> None:
    from worker.engine.logprobs import unpack

    logits = random_logits(5, scale=2.0)
    params = [SamplingParams(temperature=0.9, logprobs=3, logit_bias={0: 50.0}), SamplingParams(temperature=0),
              SamplingParams(temperature=0, logprobs=0, repetition_penalty=2.0), SamplingParams(logprobs=5),
              SamplingParams(temperature=1.5, top_k=2, logprobs=1)]
    histories = [[1], [2], [3, int(logits[2].argmax())], [4], [5]]
    seeds = [1, 2, 3, 4, 5]
    sampler = Sampler()
    tokens = sampler(logits, params, histories, seeds)
    packed = sampler.logprobs(logits, tokens, params, seeds).tolist()
    assert len(packed) == 4
    reference = logits.log_softmax(dim=-1)
    for row, values in zip((0, 2, 3, 4), packed):
        token = int(tokens[row])
        entry = unpack(token, values, params[row].logprobs, (len(values) - 2) // 2)
        assert entry.logprob == pytest.approx(float(reference[row, token]), abs=1e-5)
        assert entry.rank == 1 + int((reference[row] > reference[row, token]).sum())
        best = reference[row].topk(params[row].logprobs)
        assert [t for t, _ in entry.top] == best.indices.tolist()
        assert [v for _, v in entry.top] == pytest.approx(best.values.tolist(), abs=1e-5)
    assert int(tokens[0]) == 0   # the bias decided the draw; the reported distribution is the model's own
    assert sampler.logprobs(logits, tokens, [SamplingParams()] * 5, seeds) is None


def test_choice_seeds_are_reproducible_distinct_and_in_range() -> None:
    from worker.engine.sampler import choice_seed

    assert choice_seed(42, 0) == 42
    seeds = [choice_seed(42, i) for i in range(8)]
    assert len(set(seeds)) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert seeds == [choice_seed(42, i) for i in range(8)]
    assert choice_seed(43, 1) != choice_seed(42, 1)


def test_new_params_validate() -> None:
    SamplingParams(presence_penalty=-2, frequency_penalty=2, logit_bias={"5": -100, 7: 100.0}, min_p=1.0,
                   logprobs=20, prompt_logprobs=0, n=8, max_new_tokens=0).validate()
    assert SamplingParams(logit_bias={"12": 1.0}).logit_bias == {12: 1.0}
    from structured import Structure
    SamplingParams(structure=Structure()).validate()


@pytest.mark.parametrize(("field", "value"), [
    ("presence_penalty", math.nan), ("frequency_penalty", "1"), ("min_p", -0.1), ("min_p", 1.5), ("logprobs", -1),
    ("logprobs", 1.0), ("prompt_logprobs", -1), ("n", 0), ("n", True), ("structure", {"type": "object"}),
    ("logit_bias", [1, 2]), ("logit_bias", {"x": 1.0}), ("logit_bias", {-1: 1.0}), ("logit_bias", {5: math.inf}),
])
def test_invalid_new_params_raise(field: str, value: object) -> None:
    with pytest.raises(InvalidParamsError, match=field):
        SamplingParams(**{field: value}).validate()


def test_max_new_tokens_zero_only_scores_a_prompt() -> None:
    with pytest.raises(InvalidParamsError, match=r"max_new_tokens must be an integer >= 1"):
        SamplingParams(max_new_tokens=0).validate()
    SamplingParams(max_new_tokens=0, prompt_logprobs=2).validate()
    with pytest.raises(InvalidParamsError, match=r">= 0"):
        SamplingParams(max_new_tokens=-1, prompt_logprobs=2).validate()


@pytest.mark.parametrize("candidates", [None, 0], ids=["candidates", "device-path"])
def test_unconstrained_rows_draw_the_same_beside_a_constrained_one(candidates: int | None) -> None:
    """Masked scores take another route to their zero weights (exp of -inf is slow on a CPU): the other rows'
    draws must not notice."""
    from worker.engine.sampler import GrammarMasks

    vocab, rows = 4096, 24
    kinds = [dict(temperature=1.0), dict(temperature=0.7, top_k=30), dict(temperature=1.2, top_p=0.9),
             dict(temperature=0.9, min_p=0.05), dict(temperature=0.8, top_k=40, top_p=0.8, presence_penalty=0.3)]
    params = [SamplingParams(**kinds[r % len(kinds)]) for r in range(rows)]
    histories = [[r, r + 1] for r in range(rows)]
    mates = [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=30)]
    bits = random_masks(2, vocab, seed=2)
    for step in range(5):
        logits = peaked_logits(rows + 2, vocab, seed=step)
        alone = Sampler(candidates)(logits[:rows], params, histories, list(range(rows)))
        masks = GrammarMasks(rows=torch.tensor([rows, rows + 1]), bits=bits, every_row=False)
        mixed = Sampler(candidates)(logits, params + mates, histories + [[1], [2]], list(range(rows + 2)),
                                    masks=masks)
        assert torch.equal(mixed[:rows], alone), step
        allowed = reference_allowed(bits, vocab)
        assert bool(allowed[0, mixed[rows]]) and bool(allowed[1, mixed[rows + 1]])


def test_the_compiled_race_draws_what_the_race_draws() -> None:
    logits = peaked_logits(6, 4096, seed=3)
    rows = sampler_module.RowParams.build([SamplingParams(temperature=t) for t in (0.0, 0.6, 1.0, 1.4, 0.6, 0.0)],
                                          list(range(6)), 4096, logits.device)
    positions = torch.tensor([5, 6, 7, 8, 9, 10])
    args = (logits, rows.temperature, rows.greedy, rows.key_a, rows.key_b, positions)
    assert torch.equal(sampler_module.race_compiled(*args), sampler_module.race(*args))


def test_warming_up_compiles_the_fused_draw_for_one_row_and_more(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(sampler_module, "race_compiled", lambda *args: calls.append(args[0].shape))
    Sampler(race=True).warm_up(64, torch.device("cpu"))
    assert calls == [(2, 64), (1, 64)]
    calls.clear()
    Sampler().warm_up(64, torch.device("cpu"))   # the CPU's draw is not the race: nothing to compile
    assert calls == []


@pytest.mark.parametrize("kernel", ["c", "torch"])
def test_greedy_takes_each_rows_first_largest_score_as_argmax_does(kernel: str, two_threads,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    if kernel == "c" and native.load_top_k() is None:
        pytest.skip("no C compiler for top_k.c")
    if kernel == "torch":
        monkeypatch.setattr(sampler_module.native, "load_top_k", lambda: None)
    first_largest = sampler_module.first_largest
    scores = torch.randn(12, 300)
    scores[0, [7, 40]] = 9.0                        # a tie: the first
    scores[1, [3, 250]] = float("inf")
    scores[2] = 0.0                                  # all equal
    scores[3, 100] = float("nan")                    # NaN is the largest, as argmax has it
    scores[4] = float("-inf")
    scores[5, [18, 5]] = 50.0                        # a tie in two lanes: the lower column in the later lane
    scores[6, [299, 298]] = float("nan")             # NaN in the tail past the last block of 16
    scores[7, [290, 16]] = 50.0                      # a tie between the tail and a block
    scores[8, 299] = 50.0                            # the largest alone in the tail
    scores[9, [3, 19, 35]] = 50.0                    # one lane's tie: its first
    scores[10, [40, 41]] = float("nan")
    scores[10, 2] = float("inf")
    assert torch.equal(first_largest(scores), scores.argmax(dim=-1))
    assert first_largest(scores)[:10].tolist() == [7, 3, 0, 100, 0, 5, 298, 16, 299, 3]
    for cols in (1, 15, 16, 17, 49_152):             # rows of one block, less, more, and a vocabulary
        wide = torch.randn(5, cols)
        assert torch.equal(first_largest(wide), wide.argmax(dim=-1)), cols
    view = torch.randn(4, 700)[:, 3:603]             # rows apart by more than their width, off a vector's start
    assert torch.equal(first_largest(view), view.argmax(dim=-1))
    assert torch.equal(first_largest(scores[9:10]), torch.tensor([3]))


def _valid_top_k(scores: torch.Tensor, values: torch.Tensor, indices: torch.Tensor) -> None:
    """values are the row's k best, best first, at `indices` (distinct columns); among equal scores the lower column
    ranks first, so at a tie on the k-th score the lowest columns are kept."""
    k = values.shape[1]
    assert torch.equal(values, scores.topk(k, dim=-1).values)
    assert torch.equal(scores.gather(1, indices), values)
    for row, cols, kept in zip(scores, indices.tolist(), values):
        assert len(set(cols)) == k
        for a, b, va, vb in zip(cols, cols[1:], kept.tolist(), kept[1:].tolist()):
            assert va > vb or (va == vb and a < b)
        last = kept[-1]
        tied = (row == last).nonzero().squeeze(1).tolist()
        assert [c for c in cols if row[c] == last] == tied[:len([c for c in cols if row[c] == last])]


@pytest.mark.parametrize("rows,cols,k", [(1, 49152, 256), (16, 49152, 51), (3, 49152, 1024), (5, 1000, 7),
                                         (4, 100, 100), (2, 300, 40), (2, 256 * 3 + 17, 5)])
def test_top_k_finds_each_rows_best_scores_as_torch_topk(rows, cols, k) -> None:
    g = torch.Generator().manual_seed(rows * cols + k)
    scores = torch.randn(rows, cols, generator=g) * 4
    _valid_top_k(scores, *sampler_module.top_k(scores, k))
    wide = torch.randn(rows, cols + 9, generator=g)[:, 3:cols + 3]   # rows a stride apart, as a slice's are
    _valid_top_k(wide, *sampler_module.top_k(wide, k))


def test_top_k_keeps_the_lowest_columns_among_ties_and_takes_masked_and_nan_rows() -> None:
    g = torch.Generator().manual_seed(0)
    ties = torch.randint(0, 4, (3, 5000), generator=g).float()   # a quarter of each row shares the best score
    _valid_top_k(ties, *sampler_module.top_k(ties, 300))
    masked = torch.full((2, 49152), float("-inf"))   # a grammar mask leaves a few tokens
    masked[0, [5, 40000, 77]] = torch.tensor([1.0, 2.0, 1.0])
    values, indices = sampler_module.top_k(masked, 256)
    _valid_top_k(masked, values, indices)
    assert indices[0, :3].tolist() == [40000, 5, 77] and indices[1, :2].tolist() == [0, 1]
    nan = torch.randn(2, 49152, generator=g)
    nan[0, ::2] = float("nan")
    nan[1] = float("nan")
    values, indices = sampler_module.top_k(nan, 256)   # no meaningful answer, but in range and distinct
    assert all(len(set(row)) == 256 and 0 <= min(row) and max(row) < 49152 for row in indices.tolist())
    assert torch.equal(values[0], nan[0].nan_to_num(nan=float("-inf")).topk(256).values)
