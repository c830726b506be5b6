"""The roll-up: recompute the summaries of every minute whose records changed (dirty_minutes), newest first.

A minute's 10-second and 1-minute slots are computed from its records by the database (histogram buckets,
counts, sums, requests and tokens per API key, its slowest requests; each record's latencies worked out once,
into a temporary table); 15-minute and 1-hour slots are merged from the slots below them. A minute is replaced
whole, so running it twice changes nothing; it is only marked clean if its version did not change
while its records were read, so a record written meanwhile is summarised by the next round.
"""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime

from sqlalchemy import Connection, Engine, bindparam, delete, insert, select, text

from messaging.classes import CLASSES
from models import DirtyMinute, KeyUsage, LatencyHistogram, SlowRequest, TrafficSummary, UTCDateTime

from . import histogram, lease
from .sql import Spelling

LATENCIES = ("queue_wait", "ttft", "tpot", "e2e")
# Time to first token per service class, for each class's objective: "ttft.interactive" and so on.
CLASS_TTFT = {cls: f"ttft.{cls}" for cls in CLASSES}
HISTOGRAMS = LATENCIES + tuple(CLASS_TTFT.values())
FINE = 10                     # seconds per slot computed from the records
LEVELS = (FINE, 60, 900, 3600)
PARENTS = ((900, 60), (3600, 900))   # (level, the level it is merged from)
SLOWEST_PER_MINUTE = 10
MINUTES_PER_ROUND = 30
JOB = "rollup"


@dataclass
class KeyFigures:
    """One API key's requests and tokens in a time slot."""

    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, other: KeyFigures) -> None:
        self.requests += other.requests
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens


@dataclass
class Slot:
    """The figures of one time slot: one histogram per latency, counts and sums, and per API key (by name)."""

    histograms: dict[str, Counter] = field(default_factory=lambda: {m: Counter() for m in HISTOGRAMS})
    requests: int = 0
    finish_reasons: Counter = field(default_factory=Counter)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    batch_size_sum: float = 0.0
    batch_size_count: int = 0
    keys: dict[str, KeyFigures] = field(default_factory=dict)

    def add(self, other: Slot) -> None:
        for name in HISTOGRAMS:
            self.histograms[name].update(other.histograms[name])
        self.requests += other.requests
        self.finish_reasons.update(other.finish_reasons)
        self.prompt_tokens += other.prompt_tokens
        self.completion_tokens += other.completion_tokens
        self.cached_tokens += other.cached_tokens
        self.batch_size_sum += other.batch_size_sum
        self.batch_size_count += other.batch_size_count
        for name, figures in other.keys.items():
            self.keys.setdefault(name, KeyFigures()).add(figures)


def _utc(seconds: int) -> datetime:
    return datetime.fromtimestamp(seconds, tz=UTC)


def _runs(minutes: Iterable[int]) -> list[tuple[int, int]]:
    """Contiguous runs [first, last] of the sorted minutes."""
    runs: list[tuple[int, int]] = []
    for m in sorted(minutes):
        if runs and m == runs[-1][1] + 1:
            runs[-1] = (runs[-1][0], m)
        else:
            runs.append((m, m))
    return runs


class Queries:
    """One range of finished_at: each record's slot and latencies computed once into a temporary table
    (`rows`), then the aggregates read from it; in the dialect's spelling."""

    def __init__(self, dialect: str) -> None:
        s = Spelling(dialect)
        latencies = []
        for name in LATENCIES:
            expr, defined = s.latency(name)
            latencies.append(f"CASE WHEN {defined} THEN {expr} END AS {name}")
        self.rows = text(
            f"CREATE TEMPORARY TABLE rollup_rows AS SELECT {s.seconds('finished_at')} / {FINE} * {FINE} AS slot, "
            f"request_id, finish_reason, prompt_tokens, completion_tokens, cached_tokens, batch_size, api_key, "
            f"service_class, "
            f"{', '.join(latencies)} FROM request_records WHERE finished_at >= :lo AND finished_at < :hi"
        ).bindparams(bindparam("lo", type_=UTCDateTime()), bindparam("hi", type_=UTCDateTime()))
        # Qualified: never a table of that name outside this connection's temporary schema.
        self.drop = text(f"DROP TABLE IF EXISTS {'temp' if dialect == 'sqlite' else 'pg_temp'}.rollup_rows")
        # Plain SQL, run on the driver's cursor: about one row per record and latency comes back.
        self.histograms = {name: f"SELECT slot, {histogram.sql_bucket(name)} AS b, count(*) FROM rollup_rows "
                                 f"WHERE {name} IS NOT NULL GROUP BY slot, b" for name in LATENCIES}
        self.class_ttft = (f"SELECT slot, service_class, {histogram.sql_bucket('ttft')} AS b, count(*) "
                           "FROM rollup_rows WHERE ttft IS NOT NULL AND service_class IS NOT NULL "
                           "GROUP BY slot, service_class, b")
        self.traffic = text(
            "SELECT slot, finish_reason, count(*), sum(prompt_tokens), sum(completion_tokens), sum(cached_tokens), "
            "sum(batch_size), count(batch_size) FROM rollup_rows GROUP BY slot, finish_reason")
        self.keys = text(
            "SELECT slot, api_key, count(*), sum(prompt_tokens), sum(completion_tokens) FROM rollup_rows "
            "WHERE api_key IS NOT NULL GROUP BY slot, api_key")
        self.slowest = text(
            f"SELECT minute, request_id, e2e FROM (SELECT slot / 60 AS minute, request_id, e2e, row_number() "
            f"OVER (PARTITION BY slot / 60 ORDER BY e2e DESC, request_id) AS n FROM rollup_rows) AS ranked "
            f"WHERE n <= {SLOWEST_PER_MINUTE}")


def _fetch(conn: Connection, sql: str) -> list[tuple]:
    cursor = conn.connection.cursor()
    try:
        cursor.execute(sql)
        return cursor.fetchall()
    finally:
        cursor.close()


def _slot(slots: dict[tuple[int, int], Slot], key: tuple[int, int]) -> Slot:
    slot = slots.get(key)
    if slot is None:
        slot = slots[key] = Slot()
    return slot


def compute(conn: Connection, minutes: Iterable[int]) -> tuple[dict[tuple[int, int], Slot], list[dict]]:
    """The 10-second and 1-minute slots and the slowest requests of these minutes, from their records."""
    q = Queries(conn.dialect.name)
    slots: dict[tuple[int, int], Slot] = {}
    slow: list[dict] = []
    for first, last in _runs(minutes):
        conn.execute(q.drop)
        conn.execute(q.rows, {"lo": _utc(first * 60), "hi": _utc((last + 1) * 60)})
        try:
            for name in LATENCIES:
                current, counts = None, None
                for start, b, n in _fetch(conn, q.histograms[name]):   # grouped by slot: one lookup per slot
                    if start != current:
                        current, counts = start, _slot(slots, (FINE, int(start))).histograms[name]
                    counts[int(b)] += n
            for start, cls, b, n in _fetch(conn, q.class_ttft):
                if cls in CLASS_TTFT:
                    _slot(slots, (FINE, int(start))).histograms[CLASS_TTFT[cls]][int(b)] += n
            for start, reason, n, prompt, completion, cached, batch_sum, batch_n in conn.execute(q.traffic):
                slot = _slot(slots, (FINE, int(start)))
                slot.requests += n
                slot.finish_reasons[reason or "unknown"] += n
                slot.prompt_tokens += prompt or 0
                slot.completion_tokens += completion or 0
                slot.cached_tokens += cached or 0
                slot.batch_size_sum += batch_sum or 0.0
                slot.batch_size_count += batch_n or 0
            for start, name, n, prompt, completion in conn.execute(q.keys):
                _slot(slots, (FINE, int(start))).keys[name] = KeyFigures(n, prompt or 0, completion or 0)
            slow += [{"minute": int(m), "request_id": rid, "e2e": e2e} for m, rid, e2e in conn.execute(q.slowest)]
        finally:
            conn.execute(q.drop)
    for (_, start), slot in list(slots.items()):
        _slot(slots, (60, start // 60 * 60)).add(slot)
    return slots, slow


def _rows(level: int, start: int, slot: Slot) -> tuple[list[dict], dict, list[dict]]:
    hists = [{"level": level, "start": start, "metric": name, "count": sum(h.values()),
              "counts": histogram.encode(h)} for name, h in slot.histograms.items() if h]
    traffic = {"level": level, "start": start, "requests": slot.requests,
               "finish_reasons": json.dumps(dict(sorted(slot.finish_reasons.items()))),
               "prompt_tokens": slot.prompt_tokens, "completion_tokens": slot.completion_tokens,
               "cached_tokens": slot.cached_tokens, "batch_size_sum": slot.batch_size_sum,
               "batch_size_count": slot.batch_size_count}
    keys = [{"level": level, "start": start, "api_key": name, "requests": k.requests,
             "prompt_tokens": k.prompt_tokens, "completion_tokens": k.completion_tokens}
            for name, k in sorted(slot.keys.items())]
    return hists, traffic, keys


def _replace(conn: Connection, level: int, starts: list[int], slots: dict[tuple[int, int], Slot]) -> None:
    """Make the stored slots of `level` at `starts` equal `slots` (an empty slot is stored as no row)."""
    if not starts:
        return
    for table in (LatencyHistogram, TrafficSummary, KeyUsage):
        conn.execute(delete(table).where(table.level == level, table.start.in_(starts)))
    hists, traffic, keys = [], [], []
    for start in starts:
        slot = slots.get((level, start))
        if slot is not None and slot.requests:
            h, t, k = _rows(level, start, slot)
            hists += h
            traffic.append(t)
            keys += k
    if hists:
        conn.execute(insert(LatencyHistogram), hists)
    if traffic:
        conn.execute(insert(TrafficSummary), traffic)
    if keys:
        conn.execute(insert(KeyUsage), keys)


def read_slots(conn: Connection, level: int, first: int, end: int) -> dict[int, Slot]:
    """Stored slots of `level` with first <= start < end."""
    out: dict[int, Slot] = {}
    for start, metric, counts in conn.execute(
            select(LatencyHistogram.start, LatencyHistogram.metric, LatencyHistogram.counts)
            .where(LatencyHistogram.level == level, LatencyHistogram.start >= first, LatencyHistogram.start < end)):
        out.setdefault(start, Slot()).histograms[metric] = histogram.decode(counts)
    for row in conn.execute(select(TrafficSummary).where(TrafficSummary.level == level,
                                                         TrafficSummary.start >= first, TrafficSummary.start < end)):
        slot = out.setdefault(row.start, Slot())
        slot.requests, slot.finish_reasons = row.requests, Counter(json.loads(row.finish_reasons))
        slot.prompt_tokens, slot.completion_tokens, slot.cached_tokens = (row.prompt_tokens, row.completion_tokens,
                                                                          row.cached_tokens)
        slot.batch_size_sum, slot.batch_size_count = row.batch_size_sum, row.batch_size_count
    for start, name, requests, prompt, completion in conn.execute(
            select(KeyUsage.start, KeyUsage.api_key, KeyUsage.requests, KeyUsage.prompt_tokens,
                   KeyUsage.completion_tokens)
            .where(KeyUsage.level == level, KeyUsage.start >= first, KeyUsage.start < end)):
        out.setdefault(start, Slot()).keys[name] = KeyFigures(requests, prompt, completion)
    return out


def write(conn: Connection, minutes: list[int], slots: dict[tuple[int, int], Slot], slow: list[dict]) -> None:
    """Replace every summary of these minutes, then the 15-minute and hour slots that contain them."""
    if not minutes:
        return
    _replace(conn, FINE, [m * 60 + i for m in minutes for i in range(0, 60, FINE)], slots)
    _replace(conn, 60, [m * 60 for m in minutes], slots)
    conn.execute(delete(SlowRequest).where(SlowRequest.minute.in_(minutes)))
    done = set(minutes)
    rows = [r for r in slow if r["minute"] in done]
    if rows:
        conn.execute(insert(SlowRequest), rows)
    for level, child in PARENTS:
        starts = sorted({m * 60 // level * level for m in minutes})
        merged: dict[tuple[int, int], Slot] = {}
        for start in starts:
            total = merged[(level, start)] = Slot()
            for part in read_slots(conn, child, start, start + level).values():
                total.add(part)
        _replace(conn, level, starts, merged)


def run_round(engine: Engine, holder: str, ttl_s: float, oldest_minute: int | None = None,
              limit: int = MINUTES_PER_ROUND) -> int | None:
    """Summarise up to `limit` dirty minutes, newest first. Returns how many were dirty (0: caught up), or None
    when `holder` no longer holds the lease. Minutes before `oldest_minute` are left alone: retention has deleted
    their records (and clears them from the queue), their summaries stay as they are."""
    with engine.connect() as conn:
        # Versions first, records after: whatever changed in between leaves a newer version behind.
        query = select(DirtyMinute.minute, DirtyMinute.version).order_by(DirtyMinute.minute.desc()).limit(limit)
        if oldest_minute is not None:
            query = query.where(DirtyMinute.minute >= oldest_minute)
        dirty = conn.execute(query).all()
        if not dirty:
            conn.rollback()
            with engine.begin() as w:
                lease.mark_ran(w, JOB)
            return 0
        slots, slow = compute(conn, [m for m, _ in dirty])
        conn.rollback()
    with engine.begin() as conn:
        if not lease.renew(conn, holder, ttl_s):
            return None
        # Minutes a writer is changing right now are locked (PostgreSQL): skipped, never waited for, so a roll-up
        # and a bulk load cannot deadlock; the writer leaves a newer version behind for the next round anyway.
        seen = dict(dirty)
        locked = conn.execute(select(DirtyMinute.minute, DirtyMinute.version)
                              .where(DirtyMinute.minute.in_(list(seen))).order_by(DirtyMinute.minute)
                              .with_for_update(skip_locked=True)).all()
        done = [m for m, v in locked if seen.get(m) == v]
        if done:
            conn.execute(delete(DirtyMinute).where(DirtyMinute.minute.in_(done)))
        write(conn, done, slots, slow)
        lease.mark_ran(conn, JOB)
    return len(dirty)


def catch_up(engine: Engine, holder: str, ttl_s: float, budget_s: float, oldest_minute: int | None = None,
             limit: int = MINUTES_PER_ROUND) -> bool | None:
    """Rounds until nothing is dirty (True) or `budget_s` is spent (False); None if the lease was lost."""
    deadline = time.monotonic() + budget_s
    while True:
        n = run_round(engine, holder, ttl_s, oldest_minute, limit)
        if n is None:
            return None
        if n < limit:   # fewer than a full round: whatever is dirty now was written while this round ran
            return True
        if time.monotonic() > deadline:
            return False


def summarise(engine: Engine, holder: str = "summarise", ttl_s: float = 60.0) -> None:
    """Everything dirty summarised now, by `holder` (tests, benchmarks, a one-off run): waits for the lease."""
    while not lease.acquire(engine, holder, ttl_s):
        time.sleep(0.1)
    try:
        while catch_up(engine, holder, ttl_s, budget_s=ttl_s / 3) is not True:
            if not lease.acquire(engine, holder, ttl_s):
                raise RuntimeError("lost the housekeeping lease")
    finally:
        lease.release(engine, holder)


def mark_all(engine: Engine) -> int:
    """Mark every minute that has finished records as dirty (after loading records with triggers disabled, e.g.
    `pg_restore --disable-triggers`); the next rounds summarise them all again. Returns how many minutes."""
    minute = f"({Spelling(engine.dialect.name).seconds('finished_at')} / 60)"
    with engine.begin() as conn:
        return conn.execute(text(
            f"INSERT INTO dirty_minutes (minute, version) SELECT DISTINCT {minute}, 1 FROM request_records "
            "WHERE finished_at IS NOT NULL ORDER BY 1 "
            "ON CONFLICT (minute) DO UPDATE SET version = dirty_minutes.version + 1")).rowcount
