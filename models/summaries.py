"""Summaries of request_records that the dashboard reads, the minutes still to summarise, and job leases."""

from __future__ import annotations

from sqlalchemy import BigInteger, Float, Integer, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from models.base import Base


class LatencyHistogram(Base):
    """Counts of one latency's values in one time slot, on the fixed log-spaced buckets of housekeeping/histogram.py.

    `level` is the slot length in seconds (10, 60, 900 or 3600); `start` the slot's first second (epoch).
    `counts` is "bucket:count" pairs separated by commas, only for buckets that are not empty.
    """

    __tablename__ = "latency_histograms"

    level: Mapped[int] = mapped_column(Integer, primary_key=True)
    start: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    metric: Mapped[str] = mapped_column(String(16), primary_key=True)
    count: Mapped[int] = mapped_column(BigInteger)
    counts: Mapped[str] = mapped_column(Text)


class TrafficSummary(Base):
    """Requests, finish reasons and token sums of one time slot (same `level` and `start` as LatencyHistogram)."""

    __tablename__ = "traffic_summaries"

    level: Mapped[int] = mapped_column(Integer, primary_key=True)
    start: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger)
    # JSON object: finish reason ("unknown" for none) -> requests.
    finish_reasons: Mapped[str] = mapped_column(Text)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)
    cached_tokens: Mapped[int] = mapped_column(BigInteger)
    batch_size_sum: Mapped[float] = mapped_column(Float)
    batch_size_count: Mapped[int] = mapped_column(BigInteger)


class KeyUsage(Base):
    """Requests and tokens of one API key (by name) in one time slot (same `level` and `start` as TrafficSummary)."""

    __tablename__ = "key_usage"

    level: Mapped[int] = mapped_column(Integer, primary_key=True)
    start: Mapped[int] = mapped_column(BigInteger, primary_key=True)
    api_key: Mapped[str] = mapped_column(String(64), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger)
    prompt_tokens: Mapped[int] = mapped_column(BigInteger)
    completion_tokens: Mapped[int] = mapped_column(BigInteger)


class SlowRequest(Base):
    """The slowest requests (end to end) of one minute: a window's slowest are the slowest of its minutes'."""

    __tablename__ = "slow_requests"

    minute: Mapped[int] = mapped_column(BigInteger, primary_key=True)   # epoch seconds // 60
    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    e2e: Mapped[float] = mapped_column(Float)


class DirtyMinute(Base):
    """A minute whose records changed since it was summarised; filled by triggers on request_records.

    `version` goes up with every change, so a roll-up only clears the minute if nothing changed while it read.
    """

    __tablename__ = "dirty_minutes"

    minute: Mapped[int] = mapped_column(BigInteger, primary_key=True)   # epoch seconds // 60
    version: Mapped[int] = mapped_column(BigInteger)


class JobState(Base):
    """A periodic job's lease (only its holder works until `lease_until`) and when it last ran to the end."""

    __tablename__ = "job_state"

    name: Mapped[str] = mapped_column(String(32), primary_key=True)
    holder: Mapped[str | None] = mapped_column(String(200))
    lease_until: Mapped[float | None] = mapped_column(Float)
    ran_at: Mapped[float | None] = mapped_column(Float)
