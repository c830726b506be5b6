"""Per-request latency and usage records, written by the worker and read by the dashboard."""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import Float, ForeignKey, Index, String, Text
from sqlalchemy.orm import Mapped, mapped_column

from models.base import Base

SOURCES = ("chat", "api")
FINISH_REASONS = ("stop", "length", "cancelled", "error")


def _seconds(start: datetime | None, end: datetime | None) -> float | None:
    if start is None or end is None:
        return None
    return (end - start).total_seconds()


class RequestRecord(Base):
    """The life of one generation request: queue, admission, first token, finish."""

    __tablename__ = "request_records"
    # The dashboard's recent errors: the newest few with finish_reason 'error', without reading the others.
    __table_args__ = (Index("ix_request_records_finish_reason_finished_at", "finish_reason", "finished_at"),)

    request_id: Mapped[str] = mapped_column(String(64), primary_key=True)
    # Kept when the conversation is deleted: latency history outlives chat history.
    conversation_id: Mapped[str | None] = mapped_column(ForeignKey("conversations.id", ondelete="SET NULL"))
    source: Mapped[str] = mapped_column(String(16))
    model: Mapped[str | None] = mapped_column(String(200))
    worker: Mapped[str | None] = mapped_column(String(200))
    # The dashboard selects time windows on these two.
    enqueued_at: Mapped[datetime] = mapped_column(index=True)
    admitted_at: Mapped[datetime | None]
    first_token_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None] = mapped_column(index=True)
    prompt_tokens: Mapped[int | None]
    completion_tokens: Mapped[int | None]
    # Of completion_tokens, those an earlier delivery wrote: the answer was handed back mid-stream (a worker stopped
    # or died) and went on from what its customer had read (worker/continuation.py). 0 or None: written at once.
    continued_tokens: Mapped[int | None]
    cached_tokens: Mapped[int | None]
    finish_reason: Mapped[str | None] = mapped_column(String(16))
    # Mean number of sequences that shared this request's forward passes.
    batch_size: Mapped[float | None] = mapped_column(Float)
    error: Mapped[str | None] = mapped_column(Text)
    # The name of the API key a request came with (models/api_keys.py), never the key; kept when the key goes.
    api_key: Mapped[str | None] = mapped_column(String(64))
    # interactive, standard or bulk (messaging/classes.py); None on records written before classes existed.
    service_class: Mapped[str | None] = mapped_column(String(16))
    # An API request's x-request-id (the client's own, or one the web app made); None for chat messages.
    http_request_id: Mapped[str | None] = mapped_column(String(128))

    @property
    def queue_wait(self) -> float | None:
        """Seconds from enqueue to admission into the running batch."""
        return _seconds(self.enqueued_at, self.admitted_at)

    @property
    def ttft(self) -> float | None:
        """Time to first token in seconds, as the client sees it (queueing included; for an answer handed back, its
        first text from the earlier delivery)."""
        return _seconds(self.enqueued_at, self.first_token_at)

    @property
    def tpot(self) -> float | None:
        """Mean seconds per output token after the first, as the client had them (a hand-back's pause included);
        None with fewer than two tokens."""
        decode = _seconds(self.first_token_at, self.finished_at)
        if decode is None or self.completion_tokens is None or self.completion_tokens < 2:
            return None
        return decode / (self.completion_tokens - 1)

    @property
    def e2e(self) -> float | None:
        """End-to-end seconds from enqueue to finish."""
        return _seconds(self.enqueued_at, self.finished_at)

    def __repr__(self) -> str:
        return f"RequestRecord(request_id={self.request_id!r}, finish_reason={self.finish_reason!r})"
