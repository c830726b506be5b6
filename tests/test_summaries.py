"""Dashboard summaries: percentiles within the stated bound, records from any path summarised, catching up,
several housekeeping processes at once, retention in batches while a writer writes. SQLite and PostgreSQL."""

from __future__ import annotations

import random
import threading
import time
import uuid
from datetime import UTC, datetime

import numpy as np
import pytest
from sqlalchemy import event, func, insert, select, text, update

from housekeeping import histogram, lease, retention, rollup
from housekeeping.__main__ import Settings, run
from models import ApiKey, DirtyMinute, RequestRecord, TrafficSummary
from models.db import make_engine, upgrade
from webapp import aggregates

QS = {"p50": 50, "p90": 90, "p99": 99}


@pytest.fixture(params=["sqlite", "postgresql"])
def engine(request, tmp_path):
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'summaries.db'}"
    else:
        url = request.getfixturevalue("pg_url")
    upgrade(url)
    engine = make_engine(url)
    yield engine
    engine.dispose()


def at(ts: float) -> datetime:
    return datetime.fromtimestamp(ts, tz=UTC)


def record_rows(n: int, since: float, until: float, seed: int = 7, prefix: str = "r") -> list[dict]:
    """Records as a restore would write them; finish times include fractions just under a whole second."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        finished = rng.uniform(since, until)
        if i % 7 == 0:
            finished = int(finished) + 0.9999995   # the last microsecond of a second (and sometimes a minute)
        queue = rng.choice([0.0, rng.expovariate(50), rng.lognormvariate(-1, 1)])
        prefill = rng.lognormvariate(-2, 0.7)
        tokens = rng.choice([0, 1, 2, 30, 150, 400])
        decode = (tokens - 1) * rng.lognormvariate(-3.5, 0.4) if tokens > 1 else 0.0
        enqueued = finished - queue - prefill - decode
        reason = rng.choice(["stop"] * 7 + ["length", "cancelled", "error"])
        rows.append({"request_id": f"{prefix}{i}", "source": "api", "enqueued_at": at(enqueued),
                     "admitted_at": at(enqueued + queue) if reason != "error" else None,
                     "first_token_at": at(enqueued + queue + prefill) if tokens else None,
                     "finished_at": at(finished), "prompt_tokens": rng.randint(10, 500), "completion_tokens": tokens,
                     "cached_tokens": rng.randint(0, 10), "finish_reason": reason,
                     "batch_size": rng.uniform(1, 16)})
    return rows


def load(engine, rows: list[dict], chunk: int = 5000) -> None:
    with engine.begin() as conn:
        for i in range(0, len(rows), chunk):
            conn.execute(insert(RequestRecord), rows[i:i + chunk])


def exact(engine, first: float) -> list[RequestRecord]:
    from sqlalchemy.orm import Session
    with Session(engine) as db:
        return [r for r in db.scalars(select(RequestRecord).where(RequestRecord.finished_at >= at(first)))]


def within_bound(got, want) -> bool:
    return abs(got - want) <= histogram.RELATIVE_ERROR * abs(want) + histogram.ABSOLUTE_ERROR_S + 1e-12


def figures(engine, window: str, now: float) -> dict:
    from sqlalchemy.orm import Session
    with Session(engine) as db:
        return aggregates.figures(db, None, window, now)


def test_percentiles_from_the_summaries_are_within_the_bound_of_the_exact_ones(engine):
    now = time.time()
    load(engine, record_rows(6000, now - 7200, now - 1))
    rollup.summarise(engine)
    for window in ("5m", "1h", "24h"):
        w = aggregates.WINDOWS[window]
        body = figures(engine, window, now)
        first = body["series"]["t"][0]
        rows = exact(engine, first)
        assert body["summaries"]["catching_up"] is False
        assert body["totals"]["requests"] == len(rows) > 0
        for name in rollup.LATENCIES:
            values = [v for r in rows if (v := getattr(r, name)) is not None]
            assert body["latency"][name]["count"] == len(values)
            for q, p in QS.items():
                want = float(np.percentile(values, p))
                assert within_bound(body["latency"][name][q], want), (window, name, q, body["latency"][name][q], want)
        # Every bucket holds exactly the requests that finished in it.
        counts = np.bincount([int((r.finished_at.timestamp() - first) // w.bucket_seconds) for r in rows],
                             minlength=len(body["series"]["t"]))
        covered = [min(s + w.bucket_seconds, now) - s for s in body["series"]["t"]]
        assert body["series"]["requests_per_minute"] == pytest.approx(list(counts * 60 / np.array(covered)))


def test_records_of_a_database_migrated_from_the_previous_schema_are_summarised(tmp_path):
    url = f"sqlite:///{tmp_path / 'old.db'}"
    upgrade(url, "0001")
    engine = make_engine(url)
    now = time.time()
    rows = record_rows(500, now - 3000, now - 1)
    load(engine, rows)
    upgrade(url)
    rollup.summarise(engine)
    assert figures(engine, "1h", now)["totals"]["requests"] == len(rows)
    engine.dispose()


def test_a_record_that_finishes_or_changes_later_is_summarised_again_not_twice(engine):
    now = time.time()
    with engine.begin() as conn:
        conn.execute(insert(RequestRecord).values(request_id="late", source="chat", enqueued_at=at(now - 100)))
    rollup.summarise(engine)
    assert figures(engine, "5m", now)["totals"]["requests"] == 0
    with engine.begin() as conn:   # the worker's update, then a second one (a redelivery)
        conn.execute(update(RequestRecord).where(RequestRecord.request_id == "late").values(
            finished_at=at(now - 90), finish_reason="stop", completion_tokens=5))
        conn.execute(update(RequestRecord).where(RequestRecord.request_id == "late").values(finish_reason="error"))
    rollup.summarise(engine)
    body = figures(engine, "5m", now)
    assert body["totals"]["requests"] == 1 and body["totals"]["errors"] == 1
    assert [s["request_id"] for s in body["slowest"]] == ["late"]
    with engine.begin() as conn:   # moved to another minute: the old one is summarised again too
        conn.execute(update(RequestRecord).where(RequestRecord.request_id == "late").values(finished_at=at(now - 20)))
    rollup.summarise(engine)
    body = figures(engine, "5m", now)
    assert body["totals"]["requests"] == 1
    assert sum(x or 0 for x in body["series"]["requests_per_minute"]) * 10 / 60 == pytest.approx(1)


def test_the_dashboard_says_it_is_catching_up_rather_than_showing_partial_figures(engine):
    now = time.time()
    load(engine, record_rows(300, now - 3000, now - 600))
    body = figures(engine, "1h", now)
    assert body["summaries"]["catching_up"] is True and body["summaries"]["pending_minutes"] > 0
    assert body["totals"]["requests"] is None and body["latency"]["e2e"]["p90"] is None
    assert any(v is None for v in body["series"]["requests_per_minute"])
    assert body["live"] is None and isinstance(body["recent_errors"], list)
    rollup.summarise(engine)
    body = figures(engine, "1h", now)
    assert body["summaries"]["catching_up"] is False and body["totals"]["requests"] == 300
    assert None not in body["series"]["requests_per_minute"]


def test_usage_per_api_key_matches_the_records_in_every_window(engine):
    now = time.time()
    rows = record_rows(3000, now - 5 * 86400, now - 1, seed=11)
    for i, row in enumerate(rows):
        row["api_key"] = ("alpha", "beta", "gamma.team", None)[i % 4]
    load(engine, rows)
    with engine.begin() as conn:   # a key that exists but was not used shows too, at 0
        conn.execute(insert(ApiKey).values(name="idle", key_hash="0" * 64, prefix="sb-idle…", created_at=at(now)))
    rollup.summarise(engine)
    for window in aggregates.WINDOWS:
        body = figures(engine, window, now)
        first = body["series"]["t"][0]
        want = {"idle": [0, 0, 0]}
        for r in exact(engine, first):
            if r.api_key:
                got = want.setdefault(r.api_key, [0, 0, 0])
                got[0], got[1], got[2] = got[0] + 1, got[1] + r.prompt_tokens, got[2] + r.completion_tokens
        usage = {k["name"]: [k["requests"], k["prompt_tokens"], k["completion_tokens"]] for k in body["api_keys"]}
        assert usage == want, window
        assert [k["requests"] for k in body["api_keys"]] == sorted((k["requests"] for k in body["api_keys"]),
                                                                   reverse=True)
        assert {k["name"] for k in body["api_keys"] if k["deleted"]} == set(want) - {"idle"}
    # A record's key changed after it was summarised (whoever writes it): its minute is summarised again.
    before = {k["name"]: k["requests"] for k in figures(engine, "7d", now)["api_keys"]}
    with engine.begin() as conn:
        conn.execute(update(RequestRecord).where(RequestRecord.request_id == "r0").values(api_key="beta"))
    assert figures(engine, "7d", now)["api_keys"] is None, "catching up: no partial figures"
    rollup.summarise(engine)
    after = {k["name"]: k["requests"] for k in figures(engine, "7d", now)["api_keys"]}
    assert after["alpha"] == before["alpha"] - 1 and after["beta"] == before["beta"] + 1


def test_several_housekeeping_processes_and_a_writer_agree_with_the_records(engine):
    """Two housekeeping loops share the lease while a writer keeps adding records across minutes."""
    now = time.time()
    load(engine, record_rows(2000, now - 3000, now - 120, seed=1, prefix="old"))
    stop = threading.Event()
    settings = Settings(rollup_interval_s=0.05, retention_interval_s=3600, lease_ttl_s=5)
    loops = [threading.Thread(target=run, args=(engine, settings, stop, f"holder-{i}")) for i in range(2)]
    for t in loops:
        t.start()
    written = 0
    try:
        for batch in range(20):
            load(engine, record_rows(50, now - 3000, now - 1, seed=100 + batch, prefix=f"w{batch}-"))
            written += 50
            time.sleep(0.05)
    finally:
        stop.set()
        for t in loops:
            t.join(30)
    rollup.summarise(engine)
    body = figures(engine, "1h", now)
    assert body["totals"]["requests"] == 2000 + written
    with engine.connect() as conn:
        minute_total = conn.execute(select(func.sum(TrafficSummary.requests))
                                    .where(TrafficSummary.level == 60)).scalar()
        assert minute_total == 2000 + written
        assert conn.execute(select(func.count()).select_from(DirtyMinute)).scalar() == 0


def test_retention_deletes_exactly_the_old_records_in_batches_while_a_writer_writes(engine):
    now = time.time()
    cutoff = retention.Cutoffs.at(now, records_days=30, summary_days=400)
    old = record_rows(3000, now - 40 * 86400, cutoff.records - 0.001, seed=2, prefix="old")
    young = record_rows(500, cutoff.records, now - 1, seed=3, prefix="young")
    unfinished_old = [{"request_id": "lost-old", "source": "chat", "enqueued_at": at(cutoff.records - 5)},
                      {"request_id": "queued-now", "source": "chat", "enqueued_at": at(now - 5)}]
    load(engine, old + young)
    with engine.begin() as conn:
        conn.execute(insert(RequestRecord), unfinished_old)

    deletes = []

    @event.listens_for(engine, "before_cursor_execute")
    def count(conn, cursor, statement, *args):
        if statement.lstrip().upper().startswith("DELETE FROM REQUEST_RECORDS"):
            deletes.append(statement)

    stop, writes, errors = threading.Event(), [], []

    def writer() -> None:
        i = 0
        while not stop.is_set():
            try:
                with engine.begin() as conn:
                    conn.execute(insert(RequestRecord).values(
                        request_id=f"new-{uuid.uuid4().hex}", source="api", enqueued_at=at(time.time() - 1),
                        finished_at=at(time.time()), finish_reason="stop"))
                writes.append(i)
                i += 1
            except Exception as exc:   # pragma: no cover - reported below
                errors.append(exc)
            time.sleep(0.002)

    thread = threading.Thread(target=writer)
    thread.start()
    try:
        assert lease.acquire(engine, "retention-test", 60)
        before = len(writes)
        deleted = retention.run(engine, "retention-test", 60, cutoff, batch=200, pause_s=0.005)
        during = len(writes) - before
    finally:
        stop.set()
        thread.join(30)
    event.remove(engine, "before_cursor_execute", count)
    assert not errors, errors
    assert deleted == len(old) + 1
    assert len(deletes) >= len(old) // 200, "deleted in batches of 200"
    assert during > 0, "the writer kept writing while old records were deleted"
    with engine.connect() as conn:
        left = set(conn.execute(select(RequestRecord.request_id)).scalars())
    assert left == {r["request_id"] for r in young} | {"queued-now"} | {f for f in left if f.startswith("new-")}
    assert len([f for f in left if f.startswith("new-")]) == len(writes)


def test_records_loaded_without_triggers_are_summarised_after_mark_all(engine):
    now = time.time()
    rows = record_rows(400, now - 3000, now - 200, seed=11)
    load(engine, rows)
    with engine.begin() as conn:   # as if the records came in with triggers disabled
        conn.execute(text("DELETE FROM dirty_minutes"))
    rollup.summarise(engine)
    assert figures(engine, "1h", now)["totals"]["requests"] == 0
    assert rollup.mark_all(engine) > 0
    rollup.summarise(engine)
    assert figures(engine, "1h", now)["totals"]["requests"] == len(rows)
