"""Report maths and outputs: percentiles, throughput, errors by kind; a table, JSON, CSV and PNG plots."""

from __future__ import annotations

import csv
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from .clients import Result, hint  # noqa: E402

PERCENTILES = (50, 90, 99)


def percentiles(values: Iterable[float | None], points: Sequence[int] = PERCENTILES) -> dict[str, float | None]:
    """Linearly interpolated percentiles (numpy's default) of the values that are not None."""
    data = np.asarray([v for v in values if v is not None], dtype=float)
    return {f"p{p}": (float(np.percentile(data, p)) if data.size else None) for p in points}


def tpot(r: Result) -> float | None:
    """Seconds per output token after the first."""
    if r.ttft_s is None or r.e2e_s is None or not r.completion_tokens or r.completion_tokens < 2:
        return None
    return (r.e2e_s - r.ttft_s) / (r.completion_tokens - 1)


@dataclass
class Summary:
    sent: int
    completed: int
    errors: dict[str, int]
    duration_s: float
    request_rate: float
    completion_tokens: int
    tokens_per_s: float
    tokens_exact: bool
    ttft_s: dict[str, float | None]
    e2e_s: dict[str, float | None]
    tpot_s: dict[str, float | None]
    offered_rate: float | None = None
    hints: dict[str, str] = field(default_factory=dict)

    @property
    def error_rate(self) -> float:
        return (self.sent - self.completed) / self.sent if self.sent else 0.0


def summarize(results: Sequence[Result], duration_s: float, offered_rate: float | None = None) -> Summary:
    ok = [r for r in results if r.ok]
    errors = dict(Counter(r.error for r in results if not r.ok).most_common())
    tokens = sum(r.completion_tokens or 0 for r in ok)
    return Summary(
        sent=len(results), completed=len(ok), errors=errors, duration_s=duration_s,
        request_rate=len(ok) / duration_s if duration_s > 0 else 0.0,
        completion_tokens=tokens, tokens_per_s=tokens / duration_s if duration_s > 0 else 0.0,
        tokens_exact=all(r.tokens_exact for r in ok),
        ttft_s=percentiles(r.ttft_s for r in ok), e2e_s=percentiles(r.e2e_s for r in ok),
        tpot_s=percentiles(tpot(r) for r in ok), offered_rate=offered_rate,
        hints={kind: hint(kind) for kind in errors if hint(kind)},
    )


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_summary(s: Summary) -> str:
    approx = "" if s.tokens_exact else " (approx.: HTTP answers without usage count one token per delta)"
    lines = [
        f"requests sent {s.sent}, completed {s.completed}, errors {s.sent - s.completed} in {s.duration_s:.1f}s "
        f"({s.request_rate:.2f} req/s completed)",
        f"completion tokens {s.completion_tokens}, {s.tokens_per_s:.1f} tokens/s{approx}",
        "",
        f"{'seconds':<8}{'p50':>9}{'p90':>9}{'p99':>9}",
    ]
    for name, values in (("TTFT", s.ttft_s), ("E2E", s.e2e_s), ("TPOT", s.tpot_s)):
        lines.append(f"{name:<8}" + "".join(f"{_s(values[f'p{p}']):>9}" for p in PERCENTILES))
    lines += ["", "errors by kind: " + (", ".join(f"{k} {n}" for k, n in s.errors.items()) or "none")]
    lines += [f"  {kind}: {text}" for kind, text in s.hints.items()]
    return "\n".join(lines)


def format_sweep(steps: Sequence[tuple[Summary, bool]]) -> str:
    head = (f"{'offered':>8}{'sent':>6}{'ok':>6}{'err':>5}{'req/s':>7}{'tok/s':>8}"
            f"{'TTFT p50':>10}{'p90':>8}{'p99':>8}{'E2E p50':>9}{'p99':>8}  sustained")
    rows = [head]
    for s, ok in steps:
        rows.append(f"{s.offered_rate or 0:>8g}{s.sent:>6}{s.completed:>6}{s.sent - s.completed:>5}"
                    f"{s.request_rate:>7.2f}{s.tokens_per_s:>8.1f}{_s(s.ttft_s['p50']):>10}{_s(s.ttft_s['p90']):>8}"
                    f"{_s(s.ttft_s['p99']):>8}{_s(s.e2e_s['p50']):>9}{_s(s.e2e_s['p99']):>8}  {'yes' if ok else 'no'}")
    return "\n".join(rows)


def write_json(path: Path, payload: dict, results: Sequence[Result]) -> None:
    body = {**payload, "results": [asdict(r) for r in results]}
    path.write_text(json.dumps(body, indent=2, default=_plain))


def _plain(value):
    if isinstance(value, Summary):
        return asdict(value)
    raise TypeError(f"cannot write {type(value).__name__} as JSON")


def write_results_csv(path: Path, results: Sequence[Result]) -> None:
    names = [f.name for f in fields(Result)]
    with path.open("w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=names)
        writer.writeheader()
        writer.writerows(asdict(r) for r in results)


def write_sweep_csv(path: Path, steps: Sequence[tuple[Summary, bool]]) -> None:
    with path.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["offered_rate", "sent", "completed", "errors", "request_rate", "tokens_per_s",
                         *(f"{m}_p{p}" for m in ("ttft", "e2e", "tpot") for p in PERCENTILES), "sustained"])
        for s, ok in steps:
            writer.writerow([s.offered_rate, s.sent, s.completed, s.sent - s.completed, round(s.request_rate, 4),
                             round(s.tokens_per_s, 3),
                             *(getattr(s, f"{m}_s")[f"p{p}"] for m in ("ttft", "e2e", "tpot") for p in PERCENTILES),
                             ok])


def plot_run(path: Path, results: Sequence[Result], title: str) -> None:
    """Latency over the run (each request at its send time) and the latency histograms."""
    ok = [r for r in results if r.ok]
    fig, (over_time, hist) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, attr, colour in (("TTFT", "ttft_s", "tab:blue"), ("end-to-end", "e2e_s", "tab:orange")):
        xs = [r.offset_s for r in ok if getattr(r, attr) is not None]
        ys = [getattr(r, attr) for r in ok if getattr(r, attr) is not None]
        over_time.scatter(xs, ys, s=12, label=name, color=colour, alpha=0.7)
        if ys:
            hist.hist(ys, bins=min(40, max(5, len(ys) // 2)), alpha=0.6, label=name, color=colour)
    failed = [r.offset_s for r in results if not r.ok]
    if failed:
        over_time.scatter(failed, [0] * len(failed), marker="x", color="tab:red", label="error")
    over_time.set(xlabel="sent at (s since start)", ylabel="seconds", title="latency over the run")
    hist.set(xlabel="seconds", ylabel="requests", title="latency distribution")
    for ax in (over_time, hist):
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plot_sweep(path: Path, steps: Sequence[tuple[Summary, bool]], bound: float, sustained: float | None,
               title: str) -> None:
    """Latency percentiles and achieved throughput against the offered request rate."""
    steps = sorted(steps, key=lambda step: step[0].offered_rate or 0)
    rates = [s.offered_rate for s, _ in steps]
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(12, 4.5))
    for metric, style in (("ttft_s", "-"), ("e2e_s", ":")):
        for p in PERCENTILES:
            ys = [np.nan if getattr(s, metric)[f"p{p}"] is None else getattr(s, metric)[f"p{p}"] for s, _ in steps]
            lat.plot(rates, ys, style, marker="o", label=f"{metric[:-2].upper()} p{p}")
    lat.axhline(bound, color="tab:red", linestyle="--", label=f"TTFT p99 bound {bound:g}s")
    if sustained is not None:
        lat.axvline(sustained, color="tab:green", linestyle="--", label=f"sustained {sustained:g} req/s")
    lat.set(xlabel="offered load (requests/s)", ylabel="seconds (log scale)", title="latency against offered load",
            yscale="log")
    thr.plot(rates, [s.request_rate for s, _ in steps], marker="o", label="completed req/s")
    thr.plot(rates, rates, color="grey", linestyle=":", label="offered")
    tokens = thr.twinx()
    tokens.plot(rates, [s.tokens_per_s for s, _ in steps], marker="s", color="tab:purple", label="tokens/s")
    tokens.set_ylabel("completion tokens/s")
    thr.set(xlabel="offered load (requests/s)", ylabel="requests/s", title="throughput")
    for ax in (lat, thr):
        ax.grid(alpha=0.3)
    lat.legend(fontsize=8)
    thr.legend(loc="upper left", fontsize=8)
    tokens.legend(loc="lower right", fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
