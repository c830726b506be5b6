"""Latency histograms on fixed log-spaced buckets, and percentiles read from them with a stated error bound.

Bucket 0 holds values under MIN_S (0.1 ms, and any negative value from clock skew); bucket i (1..BUCKETS)
holds [MIN_S * GROWTH**(i-1), MIN_S * GROWTH**i); bucket BUCKETS + 1 holds values from MAX_S (~27.8 h) up.
A value is represented by its bucket's geometric middle, which is within sqrt(GROWTH) - 1 = 0.995% of it.
Percentiles interpolate between closest ranks like numpy's default, on those representatives, so a
percentile read from a histogram is within 1% (relative) of the exact one over the same values, plus at
most 0.1 ms (absolute) where values under 0.1 ms take part; values over MAX_S read as MAX_S.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping

MIN_S = 1e-4
GROWTH = 1.02
MAX_S = 1e5
BUCKETS = math.ceil(math.log(MAX_S / MIN_S) / math.log(GROWTH))   # 1047
TOP_S = MIN_S * GROWTH ** BUCKETS
RELATIVE_ERROR = math.sqrt(GROWTH) - 1
ABSOLUTE_ERROR_S = MIN_S


def bucket(value: float) -> int:
    """The bucket of one value in seconds (the same rule as sql_bucket)."""
    if value < MIN_S:
        return 0
    if value >= TOP_S:
        return BUCKETS + 1
    return min(BUCKETS, int(math.floor(math.log(value / MIN_S) / math.log(GROWTH))) + 1)


def sql_bucket(expr: str) -> str:
    """SQL that computes bucket(expr) for a float expression; SQLite (math functions) and PostgreSQL alike."""
    return (f"CASE WHEN ({expr}) < {MIN_S!r} THEN 0 WHEN ({expr}) >= {TOP_S!r} THEN {BUCKETS + 1} "
            f"ELSE CAST(floor(ln(({expr}) / {MIN_S!r}) / {math.log(GROWTH)!r}) AS INTEGER) + 1 END")


def representative(index: int) -> float:
    """The value that stands for every value in bucket `index`."""
    if index <= 0:
        return 0.0
    if index > BUCKETS:
        return MAX_S
    return MIN_S * GROWTH ** (index - 1) * math.sqrt(GROWTH)


def encode(counts: Mapping[int, int]) -> str:
    return ",".join(f"{b}:{n}" for b, n in sorted(counts.items()) if n)


def decode(text: str) -> Counter[int]:
    if not text:
        return Counter()
    numbers = list(map(int, text.replace(":", ",").split(",")))
    return Counter(dict(zip(numbers[::2], numbers[1::2])))


def merge(histograms: Iterable[Mapping[int, int]]) -> Counter[int]:
    out: Counter[int] = Counter()
    for h in histograms:
        out.update(h)
    return out


def quantile(counts: Mapping[int, int], q: float) -> float | None:
    """The q-quantile (0..1) by linear interpolation between closest ranks; None for an empty histogram."""
    return quantiles(counts, (q,))[0]


def quantiles(counts: Mapping[int, int], qs: Iterable[float]) -> list[float | None]:
    """Several quantiles in one pass over the sorted buckets."""
    qs = list(qs)
    total = sum(counts.values())
    if total == 0:
        return [None] * len(qs)
    ranks = sorted({r for q in qs for r in (math.floor((total - 1) * q), math.ceil((total - 1) * q))})
    at: dict[int, float] = {}
    seen, i = 0, 0
    for b in sorted(counts):
        seen += counts[b]
        while i < len(ranks) and ranks[i] < seen:
            at[ranks[i]] = representative(b)
            i += 1
        if i == len(ranks):
            break
    out = []
    for q in qs:
        pos = (total - 1) * q
        lo, hi = math.floor(pos), math.ceil(pos)
        out.append(at[lo] + (at[hi] - at[lo]) * (pos - lo))
    return out


def share_at_most(counts: Mapping[int, int], limit: float) -> float | None:
    """The share of values at most `limit` (each value read as its bucket's representative, so within 1% of the
    limit the answer may go either way); None for an empty histogram."""
    total = sum(counts.values())
    if total == 0:
        return None
    return sum(n for b, n in counts.items() if representative(b) <= limit) / total
