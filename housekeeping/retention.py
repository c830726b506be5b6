"""Retention: request records and summaries past their age are deleted in small batches, one short transaction
each, so workers writing records wait at most for one batch."""

from __future__ import annotations

import time
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import Connection, Engine, delete, select

from models import DirtyMinute, KeyUsage, LatencyHistogram, RequestRecord, SlowRequest, TrafficSummary

from . import lease

BATCH = 2000
FINE_SUMMARY_DAYS = 2   # the 10-second slots serve only the 5-minute window
JOB = "retention"


@dataclass(frozen=True)
class Cutoffs:
    records: int    # epoch seconds, whole minutes: records that finished (or, unfinished, were queued) before go
    summaries: int  # epoch seconds: minute, 15-minute and hour slots that start before go
    fine: int       # epoch seconds: 10-second slots that start before go

    @classmethod
    def at(cls, now: float, records_days: float, summary_days: float) -> Cutoffs:
        def minute(days: float) -> int:
            return int((now - days * 86400) // 60 * 60)
        return cls(minute(records_days), minute(summary_days), minute(min(FINE_SUMMARY_DAYS, summary_days)))


def _batch(conn: Connection, where, oldest_first, batch: int) -> int:
    """Delete up to `batch` records matching `where`, oldest first (along an index), by primary key."""
    r = RequestRecord
    ids = select(r.request_id).where(where).order_by(oldest_first).limit(batch)
    return conn.execute(delete(r).where(r.request_id.in_(ids))).rowcount


def delete_records(engine: Engine, holder: str, ttl_s: float, cutoff: int, batch: int = BATCH,
                   pause_s: float = 0.0, budget_s: float = float("inf")) -> int | None:
    """Delete the records that finished before `cutoff` (epoch seconds), and those never finished that were queued
    before it, `batch` rows a transaction. Returns how many; None if the lease was lost on the way."""
    r = RequestRecord
    before = datetime.fromtimestamp(cutoff, tz=UTC)
    deadline = time.monotonic() + budget_s
    total = 0
    for where, order in ((r.finished_at < before, r.finished_at),
                         (r.finished_at.is_(None) & (r.enqueued_at < before), r.enqueued_at)):
        while True:
            with engine.begin() as conn:
                if not lease.renew(conn, holder, ttl_s):
                    return None
                n = _batch(conn, where, order, batch)
            total += n
            if n < batch or time.monotonic() > deadline:
                break
            if pause_s:
                time.sleep(pause_s)   # room for the writers between batches
    return total


def delete_summaries(engine: Engine, holder: str, ttl_s: float, cutoffs: Cutoffs) -> bool:
    with engine.begin() as conn:
        if not lease.renew(conn, holder, ttl_s):
            return False
        for table in (LatencyHistogram, TrafficSummary, KeyUsage):
            conn.execute(delete(table).where(table.level == 10, table.start < cutoffs.fine))
            conn.execute(delete(table).where(table.level > 10, table.start < cutoffs.summaries))
        # The slowest requests name records: they go with them.
        conn.execute(delete(SlowRequest).where(SlowRequest.minute < cutoffs.records // 60))
        conn.execute(delete(DirtyMinute).where(DirtyMinute.minute < cutoffs.records // 60))
    return True


def run(engine: Engine, holder: str, ttl_s: float, cutoffs: Cutoffs, batch: int = BATCH, pause_s: float = 0.0,
        budget_s: float = float("inf")) -> int | None:
    deleted = delete_records(engine, holder, ttl_s, cutoffs.records, batch, pause_s, budget_s)
    if deleted is None or not delete_summaries(engine, holder, ttl_s, cutoffs):
        return None
    with engine.begin() as conn:
        lease.mark_ran(conn, JOB)
    return deleted
