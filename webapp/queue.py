"""Turning a validated request into a queued job: its latency record, the queue check, the send."""

from __future__ import annotations

import json
import logging
import queue
import secrets
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from datetime import UTC, datetime

import redis
from flask import current_app
from sqlalchemy.exc import SQLAlchemyError

from messaging.contract import (CANCEL_CHANNEL, DEFAULT_CLASS, GENERATE_TASK, JOB_TTL_S, cancelled_key, events_channel, final_key,
                                job_key, queue_for)
from messaging.classes import RETRY_AFTER_S
from messaging.generation import Generation
from messaging.jobs import service_class
from messaging.queue import queue_depths
from messaging.stream import STARTED
from models import RequestRecord

from . import capacity

log = logging.getLogger(__name__)


class UserError(Exception):
    """A request we refuse; the message tells the user what to do."""

    def __init__(self, code: str, message: str, retryable: bool = False, status: int = 400,
                 param: str | None = None, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.code, self.message, self.retryable, self.status = code, message, retryable, status
        self.param = param   # the request parameter at fault, for OpenAI's error shape
        self.retry_after = retry_after   # seconds before trying again (HTTP's Retry-After)


# While silent this long, an API listener looks for a final event it may have missed.
FINAL_CHECK_S = 3.0
# Messages taken in (checked, stored, queued) at once by one web process; the rest of a burst waits its turn,
# in arrival order, without a refusal. A thousand messages at once would otherwise each get a slice of the
# process in turn, and everything else it serves (/healthz, streaming answers) would wait behind them all.
INTAKE_CONCURRENCY = 16
_intake = threading.BoundedSemaphore(INTAKE_CONCURRENCY)   # gevent's semaphore under the gevent worker


def intake() -> threading.BoundedSemaphore:
    """Hold while a message is checked, stored and queued."""
    return _intake


# Seconds a client is asked to wait (Retry-After) when Redis or the database is briefly away.
OUTAGE_RETRY_S = 5


def unavailable() -> UserError:
    return UserError("queue_unavailable", "The assistant cannot take messages for a moment; please send yours "
                                          "again in a few seconds.", retryable=True, status=503,
                     retry_after=OUTAGE_RETRY_S)


def served_class(service_class: str) -> str:
    """The class a request is queued and served as: its own, or standard for all with SERVICE_CLASSES=off (one FIFO,
    as before classes existed; the benchmark's baseline)."""
    return service_class if current_app.config["SERVICE_CLASSES"] else DEFAULT_CLASS


def check_room(service_class: str = DEFAULT_CLASS) -> None:
    """Refuse a request of this class once everything queued fills its share of the queue limit: bulk first, then
    standard, so the last part of the queue is kept for interactive requests."""
    try:
        depth = sum(queue_depths(current_app.extensions["redis"]).values())
    except redis.RedisError as exc:
        log.warning("Redis unavailable: %s", exc)
        raise unavailable() from exc
    if depth >= capacity.queue_limit() * current_app.config["QUEUE_SHARES"][service_class]:
        wait = RETRY_AFTER_S[service_class]
        if service_class == "interactive":
            message = "The assistant is busy right now; please try again in a moment."
        else:
            message = (f"The queue is full for {service_class} requests ({depth} waiting); retry after {wait} "
                       "seconds, or send fewer requests at once.")
        raise UserError("queue_full", message, retryable=True, status=429, retry_after=wait)


def new_job(messages: list[dict], generation: Generation, source: str, conversation_id: str | None = None,
            channel: bool = False, received_at: float | None = None, api_key: str | None = None,
            extra: dict | None = None) -> dict:
    """A request to queue, its generation checked by the caller. Its `enqueued_at` (when the message came in, by
    default now) orders the worker's queue and starts the request's latency clock; `api_key` is the name of the API
    key it came with. `extra` adds the API's fields (messaging/jobs.py says which), each absent from jobs that do
    not use it."""
    request_id = uuid.uuid4().hex
    # Fixed now, so a redelivery after a worker crash samples the same tokens and resumes the stream.
    if generation.seed is None:
        generation = replace(generation, seed=secrets.randbits(63))
    return {"request_id": request_id, "conversation_id": conversation_id, "room": conversation_id,
            "channel": events_channel(request_id) if channel else None, "source": source,
            "enqueued_at": received_at or time.time(), "messages": messages, "params": generation.to_wire(),
            "api_key": api_key, **(extra or {})}


def record_for(job: dict) -> RequestRecord:
    return RequestRecord(request_id=job["request_id"], conversation_id=job["conversation_id"], source=job["source"],
                         enqueued_at=datetime.fromtimestamp(job["enqueued_at"], tz=UTC), api_key=job.get("api_key"),
                         service_class=service_class(job))


def send(job: dict) -> None:
    """Queue a job whose record is stored; if Redis refuses it, the record says so and the caller is told.

    A copy of the job is kept first: a message that goes missing between the web app and a worker (a crash
    mid-handover) is sent again from it by the worker's reaper instead of being lost.
    """
    try:
        current_app.extensions["redis"].set(job_key(job["request_id"]), json.dumps(job), ex=JOB_TTL_S)
        current_app.extensions["celery"].send_task(GENERATE_TASK, args=[job], task_id=job["request_id"],
                                                   queue=queue_for(service_class(job)))
    except Exception as exc:
        log.warning("could not queue %s: %s", job["request_id"], exc)
        mark_unqueued(job["request_id"], exc)
        try:
            current_app.extensions["redis"].delete(job_key(job["request_id"]))   # refused: not to be sent again
        except redis.RedisError:
            pass   # it expires; the reaper never resends a request whose record is finished
        raise unavailable() from exc


def mark_unqueued(request_id: str, exc: Exception) -> None:
    """Best effort: with the database down too, the customer is still told to send the message again."""
    try:
        with current_app.extensions["db"]() as db:
            record = db.get(RequestRecord, request_id)
            record.finish_reason, record.error = "error", f"not queued: {exc}"
            record.finished_at = datetime.now(UTC)
            db.commit()
    except SQLAlchemyError as db_exc:
        log.warning("could not record that %s was not queued: %s", request_id, db_exc)


def cancel(request_id: str, r: redis.Redis | None = None) -> bool:
    """Stop an answer; False when Redis is down (the answer then runs to its end and is stored)."""
    r = r if r is not None else current_app.extensions["redis"]
    try:
        r.set(cancelled_key(request_id), 1, ex=3600)   # for a worker that has not started it yet
        r.publish(CANCEL_CHANNEL, request_id)           # for the worker that is answering it
    except redis.RedisError as exc:
        log.warning("could not cancel %s: %s", request_id, exc)
        return False
    return True


@dataclass(frozen=True)
class Waits:
    """How long an API listener waits: for a worker to start the request (`queue_s`), then for each next event
    (`answer_s`); `tick_s`: how often it says it is still waiting (a `waiting` event) while nothing comes."""

    answer_s: float
    queue_s: float
    tick_s: float


def subscribe(job: dict, waits: Waits) -> Iterator[dict]:
    """The job's events, ending with `done` or `error`; call it before sending the job, so none slips past.

    They come through this web process's one subscription to the workers' stream (webapp/stream.py). Redis
    going away does not end them: the subscription is renewed once Redis is back, and a final event
    published meanwhile is read from where the worker keeps it. Text deltas lost in between are made up from
    the final text, so the deltas always add up to exactly the answer. While nothing comes, a `waiting` event
    every `waits.tick_s`; past a wait's limit the request is cancelled and ends with a `timeout` error.
    """
    stream = current_app.extensions["stream"]
    stream.start()
    return _events(current_app.extensions["redis"], stream, job["request_id"], waits)


def _events(r: redis.Redis, stream, request_id: str, waits: Waits) -> Iterator[dict]:
    events = stream.wait_for(request_id)
    text = _Deltas()
    started = False   # a worker began the request: from then on the answer's own limit counts
    heard = checked = said = time.monotonic()
    try:
        while True:
            limit = waits.answer_s if started else waits.queue_s
            if time.monotonic() - heard >= limit:
                # Cancelled, so a client that sends the request again does not have it answered twice.
                cancel(request_id, r)
                yield timed_out(request_id, started, limit)
                return
            try:
                event = events.get(timeout=min(1.0, waits.tick_s))
            except queue.Empty:
                event = None
                if time.monotonic() - checked > FINAL_CHECK_S:
                    checked = time.monotonic()
                    event = _kept_final(r, request_id)
            if event is not None and event.get("stored"):   # too large for the stream: read where it is kept
                event = _kept_final(r, request_id)
            if event is None or event["event"] == STARTED:
                if event is not None:
                    started, heard = True, time.monotonic()
                if time.monotonic() - said >= waits.tick_s:
                    said = time.monotonic()
                    yield {"event": "waiting", "request_id": request_id}
                continue
            started, heard = True, time.monotonic()
            for out in text.feed(event):
                said = time.monotonic()
                yield out
            if event["event"] in ("done", "error"):
                return
    finally:
        stream.stop_waiting(request_id)


def timed_out(request_id: str, started: bool, limit: float) -> dict:
    what = "sent nothing" if started else "was not started by any worker"
    return {"event": "error", "request_id": request_id, "code": "timeout", "retryable": True,
            "message": f"The answer {what} for {limit:.0f} seconds, so it was cancelled; send the request again."}


def _kept_final(r: redis.Redis, request_id: str) -> dict | None:
    """The request's final event where the worker keeps it; None while there is none, or Redis is away (the wait
    goes on, and looks again)."""
    try:
        kept = r.get(final_key(request_id))
    except redis.RedisError as exc:
        log.warning("lost Redis while waiting for %s (%s)", request_id, exc)
        return None
    return json.loads(kept) if kept else None


class _Deltas:
    """Turns the worker's deltas (each with its choice and its offset into that choice's answer) into deltas with no
    gap or repeat."""

    def __init__(self) -> None:
        self.received: dict[int, int] = {}   # choice -> characters passed on
        self.gap: set[int] = set()           # choices whose text was lost: the rest comes with the final event

    def feed(self, event: dict) -> list[dict]:
        if event["event"] == "token":
            index = event.get("index", 0)
            received = self.received.get(index, 0)
            offset = event.get("offset", received)
            if index in self.gap or offset > received:
                self.gap.add(index)
                return []
            new = event["text"][received - offset:]
            if not new and (offset < received or not event.get("logprobs")):   # nothing this listener lacks
                return []
            self.received[index] = received + len(new)
            return [{**event, "text": new, "offset": received}]
        if event["event"] == "done":
            fillers = []
            for choice in event.get("choices") or [{"index": 0, "text": event.get("text", "")}]:
                index, text = choice["index"], choice["text"]
                received = self.received.get(index, 0)
                if len(text) > received:
                    fillers.append({"event": "token", "request_id": event["request_id"], "text": text[received:],
                                    "offset": received, **({"index": index} if index else {})})
                    self.received[index] = len(text)
            return fillers + [event]
        return [event]
