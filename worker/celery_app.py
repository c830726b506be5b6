"""The worker's Celery app: the shared queue (messaging/queue.py) with leases, a thread per request and threads
kept for interactive requests."""

from __future__ import annotations

from messaging.queue import make_celery as make_queue_app
from worker.class_gate import ClassGate
from worker.settings import WorkerSettings, expected_slots


def interactive_reserve(slots: int) -> int:
    """Task threads (and prefetch places) only interactive requests may take: half the slots, at least 4."""
    return max(4, slots // 2)


def make_celery(broker_url: str | None = None):
    slots = expected_slots(WorkerSettings())
    app = make_queue_app(
        broker_url,
        # Redis, with requests under way left to their leases when the connection drops (worker/leases.py).
        broker_transport="worker.leases:LeasedTransport",
        # Twice as many task threads as engine slots: a slot that frees is refilled from requests already
        # waiting inside the engine, not after a broker round trip. Each thread holds one request. Standard and
        # bulk requests take at most those (worker/class_gate.py); the reserve is for interactive ones.
        worker_concurrency=2 * slots + interactive_reserve(slots),
        # Answers keep being generated while the broker is away; each is acked (or leased back) afterwards.
        worker_cancel_long_running_tasks_on_connection_loss=False,
    )
    ClassGate.limit = 2 * slots
    app.steps["consumer"].add(ClassGate)
    return app


celery = make_celery()
