"""The Celery app: one durable Redis queue of generation requests, delivered at least once."""

from __future__ import annotations

import os

from celery import Celery

QUEUE = "generate"
GENERATE_TASK = "supportbot.generate"
CANCEL_CHANNEL = "supportbot:cancel"            # web -> worker: abort this request id
HEARTBEAT_PREFIX = "supportbot:workers:"        # worker -> web: a key per live worker, short TTL
FINAL_TTL_S = 3600
JOB_TTL_S = 86400                               # a queued request's copy outlives any wait in the queue


def cancelled_key(request_id: str) -> str:
    """Set when a request is cancelled, so a worker that has not started it yet skips it."""
    return f"supportbot:cancelled:{request_id}"


def events_channel(request_id: str) -> str:
    """The pub/sub channel of one API request's events."""
    return f"supportbot:events:{request_id}"


def final_key(request_id: str) -> str:
    """The last event of an API request, kept a while for a listener that was away when it was published."""
    return f"supportbot:final:{request_id}"


def job_key(request_id: str) -> str:
    """A copy of a queued request, kept until it is answered, so a message lost in transit can be sent again."""
    return f"supportbot:job:{request_id}"


def visibility_timeout() -> int:
    """Seconds after which a request whose worker stopped renewing its lease is handed out again."""
    return int(os.environ.get("VISIBILITY_TIMEOUT", "20"))


def make_celery(broker_url: str | None = None) -> Celery:
    app = Celery("supportbot", broker=broker_url or os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    app.conf.update(
        # Redis, with requests under way left to their leases when the connection drops (worker/leases.py).
        broker_transport="worker.leases:LeasedTransport",
        task_default_queue=QUEUE,
        task_ignore_result=True,          # answers travel over pub/sub and SQL, not the result backend
        task_acks_late=True,              # ack after the answer is stored: a dead worker's request comes back
        task_reject_on_worker_lost=True,
        # Twice as many task threads as engine slots: a slot that frees is refilled from requests already
        # waiting inside the engine, not after a broker round trip. Each thread holds one request.
        worker_concurrency=2 * int(os.environ.get("MAX_NUM_SEQS", "16")),
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        # A worker waits for Redis as long as it takes; it reconnects within about 30 s of Redis coming back.
        broker_connection_max_retries=None,
        # Answers keep being generated while the broker is away; each is acked (or leased back) afterwards.
        worker_cancel_long_running_tasks_on_connection_loss=False,
        # A web process told "Redis is down" answers the customer at once with a retryable error.
        task_publish_retry=True,
        task_publish_retry_policy={"max_retries": 2, "interval_start": 0, "interval_step": 0.5,
                                   "interval_max": 1},
        broker_transport_options={
            # Live workers keep renewing what they hold (worker/leases.py), so only a dead worker's
            # requests age past this; every consumer looks for them every couple of seconds.
            "visibility_timeout": visibility_timeout(),
            "unacked_restore_interval": 2,
            "unacked_restore_throttle": 1,
            # The sweep holds a lock in Redis for milliseconds; kombu's 300 s expiry would let a worker killed
            # (or a Redis stopped) while holding it block every sweep, and so every redelivery, for 5 minutes.
            "unacked_mutex_expire": 10,
            "socket_connect_timeout": 2,
            "socket_timeout": 10,
            "health_check_interval": 10,
        },
        task_serializer="json",
        accept_content=["json"],
    )
    return app


celery = make_celery()
