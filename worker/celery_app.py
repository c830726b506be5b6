"""The worker's Celery app: the shared queue (messaging/queue.py) with leases and a thread per request."""

from __future__ import annotations

from messaging.queue import make_celery as make_queue_app
from worker.settings import WorkerSettings, expected_slots


def make_celery(broker_url: str | None = None):
    return make_queue_app(
        broker_url,
        # Redis, with requests under way left to their leases when the connection drops (worker/leases.py).
        broker_transport="worker.leases:LeasedTransport",
        # Twice as many task threads as engine slots: a slot that frees is refilled from requests already
        # waiting inside the engine, not after a broker round trip. Each thread holds one request.
        worker_concurrency=2 * expected_slots(WorkerSettings()),
        # Answers keep being generated while the broker is away; each is acked (or leased back) afterwards.
        worker_cancel_long_running_tasks_on_connection_loss=False,
    )


celery = make_celery()
