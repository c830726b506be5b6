"""The dashboard's figures: SQL aggregates and percentiles over request_records, live engine state from Redis."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

import redis
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from models import FINISH_REASONS, RequestRecord
from messaging.contract import HEARTBEAT_PREFIX, QUEUE


@dataclass(frozen=True)
class Window:
    key: str
    label: str
    seconds: int
    bucket_seconds: int


WINDOWS = {w.key: w for w in (Window("5m", "5 min", 300, 10), Window("1h", "1 h", 3600, 60),
                              Window("24h", "24 h", 86400, 900))}
DEFAULT_WINDOW = "5m"
LATENCIES = ("queue_wait", "ttft", "tpot", "e2e")
QUANTILES = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99))
SLOWEST = 10
RECENT_ERRORS = 10


@dataclass
class Timing:
    """One finished request's latencies in seconds (None where the request never got that far)."""

    request_id: str
    finished_at: float
    source: str
    worker: str | None
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    queue_wait: float | None
    ttft: float | None
    tpot: float | None
    e2e: float | None


def percentile(values: Sequence[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def quantiles(values: Sequence[float]) -> dict[str, float | None]:
    return {name: percentile(values, q) for name, q in QUANTILES}


def values(timings: Sequence[Timing], name: str) -> list[float]:
    return [v for t in timings if (v := getattr(t, name)) is not None]


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    return None if start is None or end is None else (end - start).total_seconds()


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def _in_window(since: float):
    return RequestRecord.finished_at >= _utc(since)


def window_timings(db: Session, since: float) -> list[Timing]:
    """Every request that finished since `since` (epoch seconds), with the same definitions as RequestRecord."""
    r = RequestRecord
    rows = db.execute(select(r.request_id, r.source, r.worker, r.finish_reason, r.prompt_tokens, r.completion_tokens,
                             r.enqueued_at, r.admitted_at, r.first_token_at, r.finished_at)
                      .where(_in_window(since))).all()
    out = []
    for row in rows:
        decode = _seconds(row.first_token_at, row.finished_at)
        n = row.completion_tokens
        out.append(Timing(
            request_id=row.request_id, finished_at=row.finished_at.timestamp(), source=row.source,
            worker=row.worker, finish_reason=row.finish_reason, prompt_tokens=row.prompt_tokens,
            completion_tokens=n, queue_wait=_seconds(row.enqueued_at, row.admitted_at),
            ttft=_seconds(row.enqueued_at, row.first_token_at),
            tpot=decode / (n - 1) if decode is not None and n is not None and n >= 2 else None,
            e2e=_seconds(row.enqueued_at, row.finished_at)))
    return out


def totals(db: Session, since: float, seconds: float) -> dict:
    """Counts per finish reason and token sums, aggregated by the database."""
    r = RequestRecord
    rows = db.execute(select(r.finish_reason, func.count(), func.sum(r.prompt_tokens), func.sum(r.completion_tokens),
                             func.sum(r.cached_tokens), func.sum(r.batch_size), func.count(r.batch_size))
                      .where(_in_window(since)).group_by(r.finish_reason)).all()
    reasons = dict.fromkeys(FINISH_REASONS, 0)
    requests = prompt = completion = cached = batch_sum = batch_n = 0
    for reason, count, p, c, cached_sum, b_sum, b_n in rows:
        reasons[reason or "unknown"] = reasons.get(reason or "unknown", 0) + count
        requests += count
        prompt, completion, cached = prompt + (p or 0), completion + (c or 0), cached + (cached_sum or 0)
        batch_sum, batch_n = batch_sum + (b_sum or 0.0), batch_n + b_n
    return {
        "requests": requests,
        "errors": reasons["error"],
        "error_rate": reasons["error"] / requests if requests else None,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "prefix_cache_hit_rate": cached / prompt if prompt else None,
        "mean_batch_size": batch_sum / batch_n if batch_n else None,
        "tokens_per_second": completion / seconds,
        "requests_per_minute": requests / (seconds / 60),
        "finish_reasons": reasons,
    }


def series(timings: Sequence[Timing], since: float, now: float, bucket: int) -> dict:
    """Per time bucket (aligned to multiples of `bucket` seconds): percentiles, throughput and errors."""
    first = math.floor(since / bucket) * bucket
    n = math.floor(now / bucket) - math.floor(since / bucket) + 1
    starts = [first + i * bucket for i in range(n)]
    groups: list[list[Timing]] = [[] for _ in range(n)]
    for t in timings:
        groups[min(n - 1, max(0, math.floor((t.finished_at - first) / bucket)))].append(t)
    # The first and last buckets are partly outside the window: rates use the part inside it.
    covered = [max(1e-9, min(s + bucket, now) - max(s, since)) for s in starts]
    out: dict = {"t": starts}
    for name in LATENCIES:
        per_bucket = [quantiles(values(g, name)) for g in groups]
        out[name] = {q: [b[q] for b in per_bucket] for q, _ in QUANTILES}
    out["requests_per_minute"] = [len(g) * 60 / c for g, c in zip(groups, covered)]
    out["errors_per_minute"] = [sum(t.finish_reason == "error" for t in g) * 60 / c for g, c in zip(groups, covered)]
    out["tokens_per_second"] = [sum(t.completion_tokens or 0 for t in g) / c for g, c in zip(groups, covered)]
    return out


def recent_errors(db: Session, since: float, limit: int = RECENT_ERRORS) -> list[dict]:
    r = RequestRecord
    rows = db.execute(select(r.request_id, r.finished_at, r.source, r.error)
                      .where(_in_window(since), r.finish_reason == "error")
                      .order_by(r.finished_at.desc()).limit(limit)).all()
    return [{"request_id": row.request_id, "finished_at": row.finished_at.timestamp(), "source": row.source,
             "error": row.error or ""} for row in rows]


def live(r: redis.Redis, now: float | None = None) -> dict:
    """What the engines are doing now, from the workers' heartbeats, and the broker queue's length."""
    now = time.time() if now is None else now
    try:
        workers = []
        for key in sorted(r.scan_iter(HEARTBEAT_PREFIX + "*")):
            raw = r.get(key)
            if raw is None:   # expired between the scan and the read
                continue
            beat = json.loads(raw)
            workers.append({"name": key.decode()[len(HEARTBEAT_PREFIX):], "model": beat.get("model"),
                            "running": beat.get("running", 0), "waiting": beat.get("waiting", 0),
                            "kv_usage": beat.get("kv_usage"), "age_seconds": now - beat.get("time", now)})
        queue_depth = r.llen(QUEUE)
    except redis.RedisError as exc:
        return {"error": f"Redis unreachable: {exc}", "queue_depth": None, "running": None, "waiting": None,
                "kv_cache_usage": None, "workers": []}
    usages = [w["kv_usage"] for w in workers if w["kv_usage"] is not None]
    return {"error": None, "queue_depth": queue_depth, "running": sum(w["running"] for w in workers),
            "waiting": sum(w["waiting"] for w in workers),
            "kv_cache_usage": sum(usages) / len(usages) if usages else None, "workers": workers}


def figures(db: Session, r: redis.Redis, window: str, now: float | None = None) -> dict:
    """Everything the dashboard shows for one window; the page reads nothing else."""
    w = WINDOWS[window]
    now = time.time() if now is None else now
    since = now - w.seconds
    timings = window_timings(db, since)
    slowest = sorted((t for t in timings if t.e2e is not None), key=lambda t: t.e2e, reverse=True)[:SLOWEST]
    return {
        "window": {"key": w.key, "label": w.label, "seconds": w.seconds, "bucket_seconds": w.bucket_seconds},
        "generated_at": now,
        "live": live(r, now),
        "totals": totals(db, since, w.seconds),
        "latency": {name: {**quantiles(values(timings, name)), "count": len(values(timings, name))}
                    for name in LATENCIES},
        "series": series(timings, since, now, w.bucket_seconds),
        "slowest": [asdict(t) for t in slowest],
        "recent_errors": recent_errors(db, since),
    }
