"""Room kept in a worker for interactive requests: while it holds `limit` standard and bulk requests, it stops
consuming their queues, so a task thread and a prefetch place stay free and a chat is fetched at once.

Redis hands out interactive requests first (messaging/queue.py), but a worker takes a message only while it has a
free task thread; with every thread holding a bulk answer a chat would wait for one of them to end. The worker
therefore has `limit` threads for standard and bulk requests plus a reserve (worker/celery_app.py), and this gate,
a step of Celery's consumer, cancels the consumer of the standard and bulk queues (Celery's own
`cancel_task_queue`, as the `cancel_consumer` control command does) when they fill their threads, and adds it back
(`add_task_queue`) once one ends. Both run in the consumer's thread: pausing as a message is received, resuming
from a timer of the consumer's event loop.
"""

from __future__ import annotations

import logging
import threading

from celery import bootsteps
from celery.signals import task_postrun, task_received, task_revoked

from messaging.contract import CLASS_QUEUES

log = logging.getLogger(__name__)

GATED = (CLASS_QUEUES["standard"], CLASS_QUEUES["bulk"])   # in the order they are consumed again
CHECK_S = 0.1


class Held:
    """The standard and bulk requests this worker holds: received and not yet ended."""

    def __init__(self) -> None:
        self._ids: set[str] = set()
        self._lock = threading.Lock()

    def add(self, task_id: str) -> int:
        with self._lock:
            self._ids.add(task_id)
            return len(self._ids)

    def discard(self, task_id: str) -> None:
        with self._lock:
            self._ids.discard(task_id)

    def __len__(self) -> int:
        with self._lock:
            return len(self._ids)


held = Held()
_gate: ClassGate | None = None


class ClassGate(bootsteps.StartStopStep):
    """A consumer step: pauses the standard and bulk queues while `limit` of their requests are held."""

    requires = {"celery.worker.consumer.tasks:Tasks"}
    limit = 0   # set by worker/celery_app.py; 0: never pause

    def __init__(self, parent, **kwargs) -> None:
        super().__init__(parent, **kwargs)
        self.consumer = None
        self.paused = False
        self.tref = None

    def start(self, c) -> None:
        global _gate
        # Also after a lost broker connection, when Celery starts the consumer again from the queues still selected:
        # a queue paused then is taken up again by the next check.
        consuming = c.app.amqp.queues.consume_from
        self.consumer, _gate = c, self
        self.paused = any(name not in consuming for name in GATED)
        if self.limit:
            self.tref = c.timer.call_repeatedly(CHECK_S, self.check, priority=10)
            self.check()

    def stop(self, c) -> None:
        if self.tref is not None:
            self.tref.cancel()
            self.tref = None

    def check(self) -> None:
        """In the consumer's thread: pause or resume to match what is held."""
        full = len(held) >= self.limit
        if full and not self.paused:
            self.paused = True
            for name in GATED:
                self.consumer.cancel_task_queue(name)
            log.info("holding %d standard and bulk requests: taking only interactive ones until one ends", len(held))
        elif not full and self.paused:
            self.paused = False
            for name in GATED:
                self.consumer.add_task_queue(name)


@task_received.connect
def _received(request=None, **_) -> None:
    # In the consumer's thread, before it fetches again: pause at once rather than at the next check.
    if (request.delivery_info or {}).get("routing_key") in GATED:
        held.add(request.id)
        if _gate is not None and _gate.limit:
            _gate.check()


@task_postrun.connect
def _ended(task_id=None, **_) -> None:
    held.discard(task_id)


@task_revoked.connect
def _revoked(request=None, **_) -> None:
    if request is not None:
        held.discard(request.id)
