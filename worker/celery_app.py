"""The Celery app: one durable Redis queue of generation requests, delivered at least once."""

from __future__ import annotations

import os

from celery import Celery

QUEUE = "generate"
GENERATE_TASK = "supportbot.generate"
CANCEL_CHANNEL = "supportbot:cancel"            # web -> worker: abort this request id
HEARTBEAT_PREFIX = "supportbot:workers:"        # worker -> web: a key per live worker, short TTL


def cancelled_key(request_id: str) -> str:
    """Set when a request is cancelled, so a worker that has not started it yet skips it."""
    return f"supportbot:cancelled:{request_id}"


def visibility_timeout() -> int:
    """Seconds after which a request whose worker stopped renewing its lease is handed out again."""
    return int(os.environ.get("VISIBILITY_TIMEOUT", "20"))


def make_celery(broker_url: str | None = None) -> Celery:
    app = Celery("supportbot", broker=broker_url or os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    app.conf.update(
        task_default_queue=QUEUE,
        task_ignore_result=True,          # answers travel over pub/sub and SQL, not the result backend
        task_acks_late=True,              # ack after the answer is stored: a dead worker's request comes back
        task_reject_on_worker_lost=True,
        # Twice as many task threads as engine slots: a slot that frees is refilled from requests already
        # waiting inside the engine, not after a broker round trip. Each thread holds one request.
        worker_concurrency=2 * int(os.environ.get("MAX_NUM_SEQS", "16")),
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        broker_transport_options={
            # Live workers keep renewing what they hold (worker/leases.py), so only a dead worker's
            # requests age past this; every consumer looks for them every couple of seconds.
            "visibility_timeout": visibility_timeout(),
            "unacked_restore_interval": 2,
            "unacked_restore_throttle": 1,
        },
        task_serializer="json",
        accept_content=["json"],
    )
    return app


celery = make_celery()
