"""Finding the highest open-loop request rate whose TTFT p99 stays under a bound: doubling, then bisection."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .report import Summary


@dataclass
class Criterion:
    ttft_p99_s: float
    max_error_rate: float = 0.0

    def holds(self, s: Summary) -> bool:
        p99 = s.ttft_s["p99"]
        return s.completed > 0 and p99 is not None and p99 <= self.ttft_p99_s and s.error_rate <= self.max_error_rate


@dataclass
class Step:
    rate: float
    summary: Summary
    sustained: bool
    stopped: bool = False   # interrupted or refused: no further rates are tried


def highest_sustained(steps: Sequence[Step]) -> float | None:
    """The highest tested rate below the lowest rate that failed (a lucky pass above a failure does not count)."""
    best = None
    for step in sorted(steps, key=lambda s: s.rate):
        if not step.sustained:
            break
        best = step.rate
    return best


def search(measure: Callable[[float], Step], rates: Sequence[float] | None = None, start: float = 0.5,
           max_rate: float = 64.0, bisect: int = 2, min_rate: float | None = None) -> list[Step]:
    """Each given rate in turn; or double from `start` until a rate fails, then bisect `bisect` times.

    When `start` already fails, halve down to `min_rate` (default start/8) to find a sustained one first.
    """
    min_rate = start / 8 if min_rate is None else min_rate
    steps: list[Step] = []

    def run(rate: float) -> Step:
        steps.append(measure(rate))
        return steps[-1]

    if rates:
        for rate in rates:
            if run(rate).stopped:
                break
        return steps
    rate = start
    while rate <= max_rate:
        step = run(rate)
        if step.stopped or not step.sustained:
            break
        rate *= 2
    else:
        return steps
    if step.stopped:
        return steps
    good, bad = highest_sustained(steps), step.rate
    if good is None:   # even the start rate fails: halve down towards min_rate
        good = 0.0
        while bad / 2 >= min_rate:
            step = run(bad / 2)
            if step.stopped:
                return steps
            if step.sustained:
                good = step.rate
                break
            bad = step.rate
    for _ in range(bisect if good > 0 else 0):
        step = run(round((good + bad) / 2, 4))
        if step.stopped:
            break
        good, bad = (step.rate, bad) if step.sustained else (good, step.rate)
    return steps
