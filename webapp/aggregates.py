"""The dashboard's figures: per-slot summaries (housekeeping/rollup.py) for every window, exact slowest requests
and recent errors from indexed queries, live engine state from Redis.

A window's summary figures cost the same whatever the traffic: they read one histogram per latency and one
row of counts per bucket. A window starts at the start of its first bucket (at most one bucket before
now - window). Percentiles come from log-spaced histograms: within 1% of the exact ones (housekeeping/histogram.py).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import asdict, dataclass
from datetime import UTC, datetime

import redis
from sqlalchemy import bindparam, select, text
from sqlalchemy.orm import Session

from housekeeping import histogram, lease, rollup
from housekeeping.sql import Spelling
from models import FINISH_REASONS, ApiKey, DirtyMinute, RequestRecord, SlowRequest, UTCDateTime
from messaging.classes import ttft_objectives
from messaging.workers import heartbeats
from messaging.queue import queue_depths


@dataclass(frozen=True)
class Window:
    key: str
    label: str
    seconds: int
    bucket_seconds: int   # one of rollup.LEVELS


WINDOWS = {w.key: w for w in (Window("5m", "5 min", 300, 10), Window("1h", "1 h", 3600, 60),
                              Window("24h", "24 h", 86400, 900), Window("7d", "7 days", 7 * 86400, 3600))}
DEFAULT_WINDOW = "5m"
LATENCIES = rollup.LATENCIES
QUANTILES = (("p50", 0.50), ("p90", 0.90), ("p99", 0.99))
SLOWEST = 10
RECENT_ERRORS = 10
# Minutes this recent are summarised by the next roll-up as a matter of course; older ones waiting mean a backlog.
SETTLING_S = 120


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
    continued_tokens: int | None   # of completion_tokens, those written before a hand-back (models/records.py)
    queue_wait: float | None
    ttft: float | None
    tpot: float | None
    e2e: float | None


def quantiles(counts: Counter | None) -> dict[str, float | None]:
    values = histogram.quantiles(counts, (q for _, q in QUANTILES)) if counts is not None else [None] * len(QUANTILES)
    return {name: v for (name, _), v in zip(QUANTILES, values)}


def _utc(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    return None if start is None or end is None else (end - start).total_seconds()


@dataclass(frozen=True)
class Progress:
    """How far the summaries are: minutes of the window not yet summarised beyond the usual few seconds."""

    backlog: list[int]   # dirty minutes of the window older than SETTLING_S
    recent: list[int]    # dirty minutes of the last SETTLING_S: read from the records directly where exactness needs it
    updated_at: float | None

    def json(self, now: float) -> dict:
        return {"catching_up": bool(self.backlog), "pending_minutes": len(self.backlog),
                "oldest_pending": self.backlog[0] * 60 if self.backlog else None, "updated_at": self.updated_at,
                "stale": self.updated_at is None or now - self.updated_at > SETTLING_S}


def progress(db: Session, first: float, now: float) -> Progress:
    dirty = db.scalars(select(DirtyMinute.minute).where(DirtyMinute.minute >= int(first // 60))
                       .order_by(DirtyMinute.minute)).all()
    settled = (now - SETTLING_S) // 60
    return Progress([m for m in dirty if m < settled], [m for m in dirty if m >= settled],
                    lease.ran_at(db.connection(), rollup.JOB))


def series(slots: dict[int, rollup.Slot], starts: list[int], bucket: int, now: float, incomplete: set[int]) -> dict:
    """Per bucket: percentiles, throughput and errors; None throughout for a bucket not yet summarised."""
    out: dict = {"t": starts}
    covered = [max(1e-9, min(s + bucket, now) - s) for s in starts]
    empty = rollup.Slot()
    picked = [None if s in incomplete else slots.get(s, empty) for s in starts]
    for name in LATENCIES:
        per_bucket = [quantiles(p.histograms[name] if p is not None else None) for p in picked]
        out[name] = {q: [b[q] for b in per_bucket] for q, _ in QUANTILES}
    out["requests_per_minute"] = [p.requests * 60 / c if p is not None else None for p, c in zip(picked, covered)]
    out["errors_per_minute"] = [p.finish_reasons["error"] * 60 / c if p is not None else None
                                for p, c in zip(picked, covered)]
    out["tokens_per_second"] = [p.completion_tokens / c if p is not None else None for p, c in zip(picked, covered)]
    return out


def totals(total: rollup.Slot | None, seconds: float) -> dict:
    if total is None:   # catching up: no figure rather than a wrong one
        return {"requests": None, "errors": None, "error_rate": None, "prompt_tokens": None,
                "completion_tokens": None, "prefix_cache_hit_rate": None, "mean_batch_size": None,
                "tokens_per_second": None, "requests_per_minute": None, "finish_reasons": {}}
    reasons = dict.fromkeys(FINISH_REASONS, 0) | dict(total.finish_reasons)
    requests, prompt = total.requests, total.prompt_tokens
    return {
        "requests": requests,
        "errors": reasons["error"],
        "error_rate": reasons["error"] / requests if requests else None,
        "prompt_tokens": prompt,
        "completion_tokens": total.completion_tokens,
        "prefix_cache_hit_rate": total.cached_tokens / prompt if prompt else None,
        "mean_batch_size": total.batch_size_sum / total.batch_size_count if total.batch_size_count else None,
        "tokens_per_second": total.completion_tokens / seconds,
        "requests_per_minute": requests / (seconds / 60),
        "finish_reasons": reasons,
    }


def key_usage(db: Session, total: rollup.Slot | None) -> list[dict] | None:
    """Requests and tokens per API key over the window, from the summaries: every key there is (unused ones at
    0) and any deleted key that was used; busiest first. None while catching up."""
    if total is None:
        return None
    keys = {name: (prefix, revoked is not None)
            for name, prefix, revoked in db.execute(select(ApiKey.name, ApiKey.prefix, ApiKey.revoked_at))}
    rows = []
    for name in keys.keys() | total.keys.keys():
        used = total.keys.get(name, rollup.KeyFigures())
        prefix, revoked = keys.get(name, (None, None))
        rows.append({"name": name, "prefix": prefix, "revoked": revoked, "deleted": name not in keys,
                     "requests": used.requests, "prompt_tokens": used.prompt_tokens,
                     "completion_tokens": used.completion_tokens})
    return sorted(rows, key=lambda r: (-r["requests"], r["name"]))


def _slowest_in(db: Session, lo: float, hi: float, limit: int) -> list[tuple[str, float]]:
    """The slowest requests that finished in [lo, hi), straight from the records (a short range)."""
    e2e = Spelling(db.get_bind().dialect.name).latency("e2e")[0]
    query = text(f"SELECT request_id, {e2e} AS e2e FROM request_records WHERE finished_at >= :lo "
                 f"AND finished_at < :hi ORDER BY e2e DESC LIMIT {int(limit)}").bindparams(
        bindparam("lo", type_=UTCDateTime()), bindparam("hi", type_=UTCDateTime()))
    return [(rid, e) for rid, e in db.execute(query, {"lo": _utc(lo), "hi": _utc(hi)})]


def slowest(db: Session, since: float, now: float, progress: Progress, limit: int = SLOWEST) -> list[Timing]:
    """Exact: every minute keeps its slowest `limit`, so the window's slowest are among those; the partial first
    minute and the minutes the roll-up has not reached yet are read from the records."""
    first_full = math.ceil(since / 60)
    skip = progress.backlog + progress.recent
    query = select(SlowRequest.request_id, SlowRequest.e2e).where(SlowRequest.minute >= first_full)
    if skip:
        query = query.where(SlowRequest.minute.not_in(skip))
    candidates = list(db.execute(query.order_by(SlowRequest.e2e.desc()).limit(limit)).tuples())
    if since < first_full * 60:
        candidates += _slowest_in(db, since, first_full * 60, limit)
    for m in progress.recent:
        candidates += _slowest_in(db, max(since, m * 60), m * 60 + 60, limit)
    ids = [rid for rid, _ in sorted(candidates, key=lambda c: c[1], reverse=True)[:limit]]
    return sorted(timings(db, ids), key=lambda t: t.e2e, reverse=True)


def timings(db: Session, ids: list[str]) -> list[Timing]:
    r = RequestRecord
    if not ids:
        return []
    rows = db.execute(select(r.request_id, r.source, r.worker, r.finish_reason, r.prompt_tokens, r.completion_tokens,
                             r.continued_tokens, r.enqueued_at, r.admitted_at, r.first_token_at, r.finished_at)
                      .where(r.request_id.in_(ids))).all()
    out = []
    for row in rows:
        decode = _seconds(row.first_token_at, row.finished_at)
        n = row.completion_tokens
        out.append(Timing(
            request_id=row.request_id, finished_at=row.finished_at.timestamp(), source=row.source,
            worker=row.worker, finish_reason=row.finish_reason, prompt_tokens=row.prompt_tokens,
            completion_tokens=n, continued_tokens=row.continued_tokens,
            queue_wait=_seconds(row.enqueued_at, row.admitted_at),
            ttft=_seconds(row.enqueued_at, row.first_token_at),
            tpot=decode / (n - 1) if decode is not None and n is not None and n >= 2 else None,
            e2e=_seconds(row.enqueued_at, row.finished_at)))
    return out


def recent_errors(db: Session, since: float, limit: int = RECENT_ERRORS) -> list[dict]:
    """The newest errors, along the (finish_reason, finished_at) index."""
    r = RequestRecord
    rows = db.execute(select(r.request_id, r.finished_at, r.source, r.error)
                      .where(r.finish_reason == "error", r.finished_at >= _utc(since))
                      .order_by(r.finished_at.desc()).limit(limit)).all()
    return [{"request_id": row.request_id, "finished_at": row.finished_at.timestamp(), "source": row.source,
             "error": row.error or ""} for row in rows]


def live(r: redis.Redis, now: float | None = None) -> dict:
    """What the engines are doing now, from the workers' heartbeats, and the broker queue's length."""
    now = time.time() if now is None else now
    try:
        workers = []
        for name, beat in heartbeats(r).items():
            workers.append({"name": name, "model": beat.get("model"),
                            "running": beat.get("running", 0), "waiting": beat.get("waiting", 0),
                            "kv_usage": beat.get("kv_usage"), "age_seconds": now - beat.get("time", now)})
        depths = queue_depths(r)
    except redis.RedisError as exc:
        return {"error": f"Redis unreachable: {exc}", "queue_depth": None, "queue_depths": None, "running": None,
                "waiting": None, "kv_cache_usage": None, "workers": []}
    usages = [w["kv_usage"] for w in workers if w["kv_usage"] is not None]
    return {"error": None, "queue_depth": sum(depths.values()), "queue_depths": depths, "running": sum(w["running"] for w in workers),
            "waiting": sum(w["waiting"] for w in workers),
            "kv_cache_usage": sum(usages) / len(usages) if usages else None, "workers": workers}


def classes(total: rollup.Slot | None, objectives: dict[str, float]) -> dict:
    """Per service class: its TTFT objective, TTFT percentiles and the share of its requests that met the objective
    (read from the class's histogram: within 1% of the objective a request may count either way)."""
    out = {}
    for cls, metric in rollup.CLASS_TTFT.items():
        counts = total.histograms[metric] if total is not None else None
        out[cls] = {"objective_s": objectives[cls], "ttft": quantiles(counts),
                    "count": sum(counts.values()) if counts is not None else None,
                    "attainment": histogram.share_at_most(counts, objectives[cls]) if counts is not None else None}
    return out


def figures(db: Session, r: redis.Redis | None, window: str, now: float | None = None,
            objectives: dict[str, float] | None = None) -> dict:
    """Everything the dashboard shows for one window; the page reads nothing else. `objectives`: each service
    class's TTFT objective (messaging/classes.py)."""
    w = WINDOWS[window]
    now = time.time() if now is None else now
    bucket = w.bucket_seconds
    first = math.floor((now - w.seconds) / bucket) * bucket
    starts = list(range(first, math.floor(now / bucket) * bucket + 1, bucket))
    state = progress(db, first, now)
    incomplete = {m * 60 // bucket * bucket for m in state.backlog}
    slots = rollup.read_slots(db.connection(), bucket, first, starts[-1] + bucket)
    total: rollup.Slot | None = None
    if not incomplete:
        total = rollup.Slot()
        for slot in slots.values():
            total.add(slot)
    seconds = now - first
    return {
        "window": {"key": w.key, "label": w.label, "seconds": w.seconds, "bucket_seconds": bucket},
        "generated_at": now,
        "live": live(r, now) if r is not None else None,
        "summaries": state.json(now),
        "totals": totals(total, seconds),
        "latency": {name: {**quantiles(total.histograms[name] if total else None),
                           "count": sum(total.histograms[name].values()) if total else None}
                    for name in LATENCIES},
        "series": series(slots, starts, bucket, now, incomplete),
        "slowest": [asdict(t) for t in slowest(db, first, now, state)],
        "recent_errors": recent_errors(db, first),
        "api_keys": key_usage(db, total),
        "classes": classes(total, objectives or ttft_objectives()),
    }
