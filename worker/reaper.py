"""Accepted requests that no longer exist anywhere in Redis end with a retryable error instead of silence."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

import redis
from sqlalchemy import select, update
from sqlalchemy.exc import SQLAlchemyError

from models import RequestRecord
from messaging.contract import GENERATE_TASK, QUEUES, events_channel, job_key, queue_for
from messaging.jobs import service_class
from worker.celery_app import celery
from worker.leases import LeasedChannel

log = logging.getLogger(__name__)

LOCK_KEY = "supportbot:reaper"   # one sweep at a time across workers
# A message in transit (a worker taking it, a web process's publish being retried) is out of sight for
# well under this long: a request must be missing from two looks this far apart to count as lost.
SECOND_LOOK_S = 3.0
OLDEST = timedelta(days=1)       # older unfinished records are history, not customers waiting
MAX_RESENDS = 3                  # a request lost again and again is given up on rather than looping
LOST_MESSAGE = "Your message was lost in a system fault before it could be answered; please send it again."


def message_ids(raw_messages: list[bytes], wrapped: bool) -> set[str]:
    """Task ids of kombu messages as stored in the queue list, or (wrapped) in the unacked hash."""
    ids = set()
    for raw in raw_messages:
        try:
            message = json.loads(raw)
            ids.add((message[0] if wrapped else message)["headers"]["id"])
        except (ValueError, KeyError, IndexError, TypeError):
            continue
    return ids


class Reaper:
    """Gives up, visibly, on requests that no worker will ever answer.

    A request lives in the queue, then among the unacknowledged messages of the worker answering it, until
    its answer is stored. It falls out of both only through a fault: a web process that dies between storing
    a request and queueing it, or a worker killed (or Redis crashing) while a message is handed over (kombu's
    BRPOP gives a message away before the worker records it as unacknowledged). Once it has been missing for
    LOST_AFTER_S it is queued again from the copy the web app kept (`job_key`); its seed travels with it, so
    the answer is the one it would have been. Without a copy (the web process died before writing it, or
    Redis lost it), its record says it was lost and the customer is told to send it again.
    """

    def __init__(self, r: redis.Redis, sessions: Callable, name: str, stopped: threading.Event,
                 finish: Callable[[str, dict, dict], None], lost_after_s: float) -> None:
        """`sessions`: the worker's SQL sessions; `name`: the worker's; `stopped`: set when the worker stops;
        `finish(event, payload, job)`: sends a request's last event to its client."""
        self.redis, self.sessions, self.name, self.stopped, self.finish = r, sessions, name, stopped, finish
        self.lost_after_s = lost_after_s
        self.interval = max(1.0, lost_after_s / 4)

    def start(self) -> None:
        threading.Thread(target=self._run, name="reaper", daemon=True).start()

    def _run(self) -> None:
        while not self.stopped.wait(self.interval):
            try:
                self.sweep()
            except (redis.RedisError, SQLAlchemyError) as exc:
                log.debug("no sweep for lost requests this time: %s", exc)

    def sweep(self) -> list[str]:
        """Queue again (or give up on) the requests lost from Redis; returns their ids."""
        if not self.redis.set(LOCK_KEY, self.name, nx=True, ex=int(self.interval + SECOND_LOOK_S)):
            return []
        candidates = self.unfinished()
        missing = set(candidates) - self.in_redis()
        if missing:
            time.sleep(SECOND_LOOK_S)
            missing -= self.in_redis()
        for request_id in missing:
            self.recover(request_id, *candidates[request_id])
        return sorted(missing)

    def unfinished(self) -> dict[str, tuple[str | None, str]]:
        """Requests accepted more than LOST_AFTER_S ago and not finished: id -> (conversation, source)."""
        now = datetime.now(UTC)
        with self.sessions() as db:
            rows = db.execute(select(RequestRecord.request_id, RequestRecord.conversation_id, RequestRecord.source)
                              .where(RequestRecord.finished_at.is_(None),
                                     RequestRecord.enqueued_at < now - timedelta(seconds=self.lost_after_s),
                                     RequestRecord.enqueued_at > now - OLDEST)
                              .limit(500))
            return {rid: (conversation, source) for rid, conversation, source in rows}

    def in_redis(self) -> set[str]:
        """Every request waiting in a class's queue or held by a worker."""
        r = self.redis
        pipe = r.pipeline(transaction=False)
        for name in QUEUES:
            pipe.lrange(name, 0, -1)
        waiting = set().union(*(message_ids(raw, wrapped=False) for raw in pipe.execute()))
        return waiting | message_ids(r.hvals(LeasedChannel.unacked_key), wrapped=True)

    def recover(self, request_id: str, conversation_id: str | None, source: str) -> None:
        if not self.resend(request_id):
            self.give_up(request_id, conversation_id, source)

    def resend(self, request_id: str) -> bool:
        """Queue a lost request again from its copy; False when there is no copy or it was resent too often."""
        raw = self.redis.get(job_key(request_id))
        if raw is None:
            return False
        resends = self.redis.incr(job_key(request_id) + ":resends")
        self.redis.expire(job_key(request_id) + ":resends", int(OLDEST.total_seconds()))
        if resends > MAX_RESENDS:
            return False
        job = json.loads(raw)
        celery.send_task(GENERATE_TASK, args=[job], task_id=request_id, queue=queue_for(service_class(job)))
        log.warning("request %s was lost on its way to a worker; queued it again (%d/%d)",
                    request_id, resends, MAX_RESENDS)
        return True

    def give_up(self, request_id: str, conversation_id: str | None, source: str) -> None:
        with self.sessions() as db:
            ended = db.execute(update(RequestRecord)
                               .where(RequestRecord.request_id == request_id, RequestRecord.finished_at.is_(None))
                               .values(finished_at=datetime.now(UTC), finish_reason="error",
                                       error="lost: in no queue and held by no worker"))
            db.commit()
        if ended.rowcount != 1:   # answered meanwhile after all
            return
        log.warning("request %s was lost before it could be answered; its customer is told to send it again",
                    request_id)
        job = {"request_id": request_id, "conversation_id": conversation_id, "room": conversation_id,
               "channel": events_channel(request_id) if source == "api" else None}
        self.finish("error", {"request_id": request_id, "code": "lost", "message": LOST_MESSAGE,
                                 "retryable": True}, job)
