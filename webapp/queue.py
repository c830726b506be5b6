"""Turning a validated request into a queued job: its latency record, the queue check, the send."""

from __future__ import annotations

import logging
import secrets
import time
import uuid
from datetime import UTC, datetime

from flask import current_app

from models import RequestRecord
from worker.celery_app import CANCEL_CHANNEL, GENERATE_TASK, QUEUE, cancelled_key

log = logging.getLogger(__name__)


class UserError(Exception):
    """A request we refuse; the message tells the user what to do."""

    def __init__(self, code: str, message: str, retryable: bool = False, status: int = 400) -> None:
        super().__init__(message)
        self.code, self.message, self.retryable, self.status = code, message, retryable, status


def check_room() -> None:
    if current_app.extensions["redis"].llen(QUEUE) >= current_app.config["QUEUE_LIMIT"]:
        raise UserError("queue_full", "The assistant is busy right now; please try again in a moment.",
                        retryable=True, status=429)


def new_job(messages: list[dict], params: dict, source: str, conversation_id: str | None = None,
            channel: bool = False) -> dict:
    request_id = uuid.uuid4().hex
    # Fixed now, so a redelivery after a worker crash samples the same tokens and resumes the stream.
    params = {**params, "seed": params["seed"] if params.get("seed") is not None else secrets.randbits(63)}
    return {"request_id": request_id, "conversation_id": conversation_id, "room": conversation_id,
            "channel": f"supportbot:events:{request_id}" if channel else None, "source": source,
            "enqueued_at": time.time(), "messages": messages, "params": params}


def record_for(job: dict) -> RequestRecord:
    return RequestRecord(request_id=job["request_id"], conversation_id=job["conversation_id"], source=job["source"],
                         enqueued_at=datetime.fromtimestamp(job["enqueued_at"], tz=UTC))


def send(job: dict) -> None:
    """Queue a job whose record is stored; if Redis refuses it, the record says so and the caller is told."""
    try:
        current_app.extensions["celery"].send_task(GENERATE_TASK, args=[job], task_id=job["request_id"])
    except Exception as exc:
        log.exception("could not queue %s", job["request_id"])
        with current_app.extensions["db"]() as db:
            record = db.get(RequestRecord, job["request_id"])
            record.finish_reason, record.error = "error", f"not queued: {exc}"
            record.finished_at = datetime.now(UTC)
            db.commit()
        raise UserError("queue_unavailable", "The message could not be queued; please send it again.",
                        retryable=True, status=503) from exc


def cancel(request_id: str) -> None:
    r = current_app.extensions["redis"]
    r.set(cancelled_key(request_id), 1, ex=3600)   # for a worker that has not started it yet
    r.publish(CANCEL_CHANNEL, request_id)           # for the worker that is answering it
