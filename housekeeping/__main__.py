"""`python -m housekeeping`: the periodic jobs, in a loop; any number may run, the lease holder works."""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass

from sqlalchemy import Engine

from models.db import make_engine

from . import lease, retention, rollup

log = logging.getLogger("housekeeping")


@dataclass(frozen=True)
class Settings:
    rollup_interval_s: float = 5.0
    records_retention_days: float = 30.0
    summary_retention_days: float = 400.0
    retention_interval_s: float = 300.0
    retention_batch: int = retention.BATCH
    lease_ttl_s: float = 60.0

    @classmethod
    def from_env(cls) -> Settings:
        def number(name: str, default: float) -> float:
            value = os.environ.get(name, "").strip()
            return float(value) if value else default
        return cls(rollup_interval_s=number("ROLLUP_INTERVAL_S", cls.rollup_interval_s),
                   records_retention_days=number("RECORDS_RETENTION_DAYS", cls.records_retention_days),
                   summary_retention_days=number("SUMMARY_RETENTION_DAYS", cls.summary_retention_days),
                   retention_interval_s=number("RETENTION_INTERVAL_S", cls.retention_interval_s),
                   retention_batch=int(number("RETENTION_BATCH", cls.retention_batch)))


def work_once(engine: Engine, settings: Settings, holder: str, retention_due: bool) -> bool | None:
    """One turn as the lease holder: bring the summaries up to date, then (when due) apply retention."""
    cutoffs = retention.Cutoffs.at(time.time(), settings.records_retention_days, settings.summary_retention_days)
    # A turn works at most about one lease's length, so the lease never runs out mid-turn.
    budget = settings.lease_ttl_s / 3
    caught_up = rollup.catch_up(engine, holder, settings.lease_ttl_s, budget, cutoffs.records // 60)
    if caught_up is False:
        log.info("summaries catching up: more minutes to summarise")
    if retention_due and caught_up is not None:
        deleted = retention.run(engine, holder, settings.lease_ttl_s, cutoffs, settings.retention_batch,
                                pause_s=0.01, budget_s=budget)
        if deleted:
            log.info("retention: deleted %d records older than %s days", deleted, settings.records_retention_days)
    return caught_up


def run(engine: Engine, settings: Settings, stop: threading.Event, holder: str | None = None) -> None:
    holder = holder or lease.me()
    next_retention = 0.0
    try:
        while not stop.is_set():
            try:
                if lease.acquire(engine, holder, settings.lease_ttl_s):
                    due = time.monotonic() >= next_retention
                    caught_up = work_once(engine, settings, holder, due)
                    if due:
                        next_retention = time.monotonic() + settings.retention_interval_s
                    if caught_up is False:
                        continue   # a backlog: straight on with it
            except Exception:   # a database away for a while: try again next turn
                log.exception("housekeeping turn failed; trying again in %.0f s", settings.rollup_interval_s)
            stop.wait(settings.rollup_interval_s)
    finally:
        try:
            lease.release(engine, holder)
        except Exception:
            log.warning("could not release the housekeeping lease; it expires in %.0f s", settings.lease_ttl_s)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if sys.argv[1:] == ["--mark-all"]:
        engine = make_engine()
        log.info("marked %d minutes to summarise again", rollup.mark_all(engine))
        return
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    engine = make_engine()
    settings = Settings.from_env()
    log.info("housekeeping: summaries every %.0f s, records kept %g days, summaries %g days",
             settings.rollup_interval_s, settings.records_retention_days, settings.summary_retention_days)
    run(engine, settings, stop)


if __name__ == "__main__":
    main()
