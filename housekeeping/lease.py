"""A lease in job_state: whoever holds it does the periodic work, so several processes may run but one works."""

from __future__ import annotations

import os
import socket
import time

from sqlalchemy import Connection, Engine, insert, select, update
from sqlalchemy.exc import IntegrityError

from models import JobState

HOUSEKEEPING = "housekeeping"


def me() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def acquire(engine: Engine, holder: str, ttl_s: float, name: str = HOUSEKEEPING) -> bool:
    """Take the lease if it is free or expired, or extend it if `holder` has it already."""
    now = time.time()
    with engine.begin() as conn:
        if conn.execute(select(JobState.name).where(JobState.name == name)).first() is None:
            try:
                with conn.begin_nested():
                    conn.execute(insert(JobState).values(name=name))
            except IntegrityError:   # another process created it first
                pass
        taken = conn.execute(update(JobState).where(
            JobState.name == name,
            (JobState.holder == holder) | JobState.holder.is_(None) | JobState.lease_until.is_(None)
            | (JobState.lease_until < now)).values(holder=holder, lease_until=now + ttl_s))
        return taken.rowcount == 1


def renew(conn: Connection, holder: str, ttl_s: float, name: str = HOUSEKEEPING) -> bool:
    """Inside a writing transaction, first: True if `holder` still holds the lease (now extended).

    The row stays locked (PostgreSQL) or the database stays locked (SQLite) until that transaction ends, so no
    other process can take the lease over while the holder's writes are on their way.
    """
    renewed = conn.execute(update(JobState).where(JobState.name == name, JobState.holder == holder)
                           .values(lease_until=time.time() + ttl_s))
    return renewed.rowcount == 1


def release(engine: Engine, holder: str, name: str = HOUSEKEEPING) -> None:
    with engine.begin() as conn:
        conn.execute(update(JobState).where(JobState.name == name, JobState.holder == holder)
                     .values(holder=None, lease_until=None))


def mark_ran(conn: Connection, name: str, at: float | None = None) -> None:
    """Record that job `name` just finished a run (the dashboard shows it)."""
    at = time.time() if at is None else at
    if conn.execute(update(JobState).where(JobState.name == name).values(ran_at=at)).rowcount == 0:
        conn.execute(insert(JobState).values(name=name, ran_at=at))


def ran_at(conn: Connection, name: str) -> float | None:
    return conn.execute(select(JobState.ran_at).where(JobState.name == name)).scalar()
