"""Tests for per-row sampling parameters, logits processors and the batched sampler."""

from __future__ import annotations

import math

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from worker.engine import sampler as sampler_module
from worker.engine.sampler import Sampler, apply_processors, make_generator
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


def draw_sequence(
    target: SamplingParams, others: list[SamplingParams], position: int, steps: int = 30
) -> list[int]:
    """Sample `steps` tokens for `target` while it shares the batch with `others`."""
    batch = others[:position] + [target] + others[position:]
    generators = [make_generator(p.seed, "cpu") for p in batch]
    sampler = Sampler()
    tokens = []
    for step in range(steps):
        logits = random_logits(len(batch), seed=100 + step, scale=0.5)
        # The target row sees the same logits whatever its position or batch size.
        logits[position] = random_logits(1, seed=1000 + step, scale=0.5)[0]
        out = sampler(logits, batch, [[]] * len(batch), generators)
        tokens.append(int(out[position]))
    return tokens


def test_same_seed_reproduces_regardless_of_batch_mates() -> None:
    target = SamplingParams(temperature=1.0, seed=1234)
    alone = draw_sequence(target, [], position=0)
    crowded = draw_sequence(
        target,
        [SamplingParams(seed=1), SamplingParams(temperature=0), SamplingParams(top_k=3, seed=9)],
        position=2,
    )
    other_mates = draw_sequence(target, [SamplingParams(temperature=0.3, top_p=0.5)], position=1)
    assert alone == crowded == other_mates


def test_different_seeds_give_different_samples() -> None:
    first = draw_sequence(SamplingParams(seed=1), [], position=0)
    second = draw_sequence(SamplingParams(seed=2), [], position=0)
    # 30 draws from near-uniform logits over 64 tokens: a full match is essentially impossible.
    assert first != second


def sample_many(logits_row: torch.Tensor, params: SamplingParams, rows: int, rounds: int) -> torch.Tensor:
    logits = logits_row.expand(rows, -1).clone()
    batch = [params] * rows
    generators = [make_generator(seed, "cpu") for seed in range(rows)]
    sampler = Sampler()
    return torch.cat([sampler(logits, batch, [[]] * rows, generators) for _ in range(rounds)])


def test_top_k_only_samples_from_top_k() -> None:
    logits_row = random_logits(1, seed=7, scale=0.5)[0]
    draws = sample_many(logits_row, SamplingParams(top_k=5), rows=200, rounds=10)
    allowed = set(torch.topk(logits_row, 5).indices.tolist())
    seen = set(draws.tolist())
    assert seen <= allowed
    assert seen == allowed  # 2000 draws over 5 similar tokens should hit each one


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


def test_top_p_only_samples_from_nucleus() -> None:
    logits_row = random_logits(1, seed=11, scale=1.0)[0]
    expected = nucleus(logits_row, 0.5)
    assert 1 < len(expected) < VOCAB // 2
    draws = sample_many(logits_row, SamplingParams(top_p=0.5), rows=200, rounds=10)
    seen = set(draws.tolist())
    assert seen <= expected
    assert len(seen) > 1


def test_greedy_rows_return_argmax_in_mixed_batch() -> None:
    logits = random_logits(4, scale=0.1)
    params = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.0, seed=3),
        SamplingParams(temperature=0, top_k=2),
        SamplingParams(temperature=2.0, seed=4),
    ]
    generators = [make_generator(p.seed, "cpu") for p in params]
    out = Sampler()(logits, params, [[]] * 4, generators)
    assert out.dtype == torch.int64 and out.shape == (4,)
    assert int(out[0]) == int(logits[0].argmax())
    assert int(out[2]) == int(logits[2].argmax())


def test_greedy_with_repetition_penalty_uses_penalised_logits() -> None:
    logits = torch.tensor([[0.1, 4.0, 3.0, -1.0]])
    params = [SamplingParams(temperature=0, repetition_penalty=2.0)]
    out = Sampler()(logits, params, [[1, 1, 3]], [make_generator(0, "cpu")])
    # Token 1 (4.0) drops to 2.0 after the penalty, so token 2 (3.0) wins.
    assert int(out[0]) == 2
    assert int(out[0]) != int(logits[0].argmax())


def test_fast_path_is_plain_argmax(monkeypatch: pytest.MonkeyPatch) -> None:
    def fail(*_args: object, **_kwargs: object) -> torch.Tensor:
        raise AssertionError("fast path must not run the processors")

    monkeypatch.setattr(sampler_module, "apply_processors", fail)
    logits = random_logits(6)
    params = [SamplingParams(temperature=0)] * 6
    out = Sampler()(logits, params, [[1, 2]] * 6, [make_generator(0, "cpu")] * 6)
    assert torch.equal(out, logits.argmax(dim=-1))


def test_make_generator_seeding() -> None:
    a = torch.rand(4, generator=make_generator(42, "cpu"))
    b = torch.rand(4, generator=make_generator(42, "cpu"))
    assert torch.equal(a, b)
    assert make_generator(None, "cpu").initial_seed() != make_generator(None, "cpu").initial_seed()


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
        ("temperature", 2.01),
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
        ("repetition_penalty", 10.5),
        ("repetition_penalty", math.inf),
        ("seed", -1),
        ("seed", 2**63),
        ("seed", 1.0),
        ("seed", False),
        ("max_new_tokens", 0),
        ("max_new_tokens", 2.0),
        ("max_new_tokens", True),
        ("stop", ["a", "b", "c", "d", "e"]),
        ("stop", [""]),
        ("stop", ["x" * 65]),
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
    with pytest.raises(ValueError, match=r"temperature must be between 0 and 2 \(0 = greedy\); got -1"):
        SamplingParams(temperature=-1).validate()
