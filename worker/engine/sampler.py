"""Batched next-token selection where every row carries its own sampling parameters."""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from worker.engine.sampling_params import SamplingParams

_FILTERED = float("-inf")


def apply_processors(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[Sequence[int]],
) -> torch.Tensor:
    """Apply repetition penalty, temperature, top-k and top-p in transformers' order.

    Returns a new float32 tensor; `logits` is left untouched. Greedy rows only get the
    repetition penalty, matching `generate(do_sample=False)`, which skips the warpers.
    """
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(histories) != len(params):
        raise ValueError("logits must be [B, V] with one params entry and one history per row")
    scores = logits.to(torch.float32, copy=True)
    scores = _apply_repetition_penalty(scores, params, histories)
    scores = _apply_temperature(scores, params)
    return _apply_top_k_top_p(scores, params)


def _apply_repetition_penalty(
    scores: torch.Tensor, params: Sequence[SamplingParams], histories: Sequence[Sequence[int]]
) -> torch.Tensor:
    rows = [i for i, p in enumerate(params) if p.repetition_penalty != 1.0]
    if not rows:
        return scores
    batch, vocab = scores.shape
    device = scores.device
    row_ids = torch.tensor(
        list(itertools.chain.from_iterable([i] * len(histories[i]) for i in rows)),
        dtype=torch.long,
        device=device,
    )
    token_ids = torch.tensor(
        list(itertools.chain.from_iterable(histories[i] for i in rows)), dtype=torch.long, device=device
    )
    # Ids beyond the logits' vocab (embedding larger than lm_head) cannot be generated, so
    # transformers drops them; route them to a spare column that is cut off afterwards.
    token_ids = token_ids.clamp(min=0, max=vocab)
    seen = torch.zeros(batch, vocab + 1, dtype=torch.bool, device=device)
    # Setting True twice is idempotent, which makes this "over the unique tokens".
    seen[row_ids, token_ids] = True
    seen = seen[:, :vocab]

    penalty = torch.tensor([p.repetition_penalty for p in params], dtype=torch.float32, device=device)
    penalty = penalty.unsqueeze(1)
    penalised = torch.where(scores < 0, scores * penalty, scores / penalty)
    return torch.where(seen, penalised, scores)


def _apply_temperature(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    temps = [1.0 if p.greedy else float(p.temperature) for p in params]
    if all(t == 1.0 for t in temps):
        return scores
    # Dividing by exactly 1.0 is bit-exact, so rows without a temperature stay untouched.
    t = torch.tensor(temps, dtype=torch.float32, device=scores.device).unsqueeze(1)
    return scores / t


def _effective_top_k(p: SamplingParams, vocab: int) -> int:
    if p.greedy or p.top_k <= 0:
        return vocab
    return min(p.top_k, vocab)


def _apply_top_k_top_p(scores: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    vocab = scores.shape[1]
    device = scores.device
    top_k = [_effective_top_k(p, vocab) for p in params]
    top_p_on = [not p.greedy and p.top_p < 1.0 for p in params]
    use_top_k = any(k < vocab for k in top_k)
    use_top_p = any(top_p_on)
    if not use_top_k and not use_top_p:
        return scores

    # One ascending sort serves both filters: the k-th largest value sits at V - k, and
    # top-p needs exactly this order to reproduce transformers' cumulative sums.
    sorted_scores, sorted_idx = torch.sort(scores, dim=-1, descending=False)

    remove = torch.zeros_like(scores, dtype=torch.bool)
    if use_top_k:
        kth_pos = torch.tensor([vocab - k for k in top_k], dtype=torch.long, device=device)
        kth_value = sorted_scores.gather(1, kth_pos.unsqueeze(1))
        # A disabled row points at its own minimum, so nothing compares below it.
        remove |= scores < kth_value
        # Masking keeps the order, so the sorted view of the top-k output is free.
        sorted_scores = sorted_scores.masked_fill(sorted_scores < kth_value, _FILTERED)

    if use_top_p:
        cum_probs = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        # 1 - top_p in double, then float32: the same value transformers compares against.
        threshold = torch.tensor(
            [1.0 - float(p.top_p) for p in params], dtype=torch.float32, device=device
        ).unsqueeze(1)
        sorted_remove = cum_probs <= threshold
        sorted_remove[:, -1] = False  # always keep the most likely token
        # Zero-probability tails satisfy `<= 0`; a disabled row must not drop them.
        enabled = torch.tensor(top_p_on, dtype=torch.bool, device=device).unsqueeze(1)
        sorted_remove &= enabled
        remove |= sorted_remove.scatter(1, sorted_idx, sorted_remove)

    return scores.masked_fill(remove, _FILTERED)


class Sampler:
    """Picks one token per row; sampled rows draw only from their own generator."""

    def __call__(
        self,
        logits: torch.Tensor,
        params: Sequence[SamplingParams],
        histories: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator],
    ) -> torch.Tensor:
        if all(p.greedy and p.repetition_penalty == 1.0 for p in params):
            # Hot path for plain greedy decoding: nothing to process.
            return logits.argmax(dim=-1)

        scores = apply_processors(logits, params, histories)
        tokens = scores.argmax(dim=-1)
        sampled = [i for i, p in enumerate(params) if not p.greedy]
        if sampled:
            index = torch.tensor(sampled, dtype=torch.long, device=scores.device)
            probs = scores.index_select(0, index).softmax(dim=-1)
            # One draw per row with that row's generator, so a request's randomness does
            # not depend on which other requests share the batch.
            draws = [
                torch.multinomial(probs[j], 1, generator=generators[i])
                for j, i in enumerate(sampled)
            ]
            tokens[index] = torch.cat(draws)
        return tokens


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator:
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()  # non-deterministic seed
    else:
        generator.manual_seed(seed)
    return generator
