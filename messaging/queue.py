"""The Celery app both tiers build: a durable Redis queue of generation requests per service class, taken most
urgent first, delivered at least once."""

from __future__ import annotations

import os

import redis
from celery import Celery
from kombu import Queue

from messaging.contract import CLASS_QUEUES, QUEUE, QUEUES


def visibility_timeout() -> int:
    """Seconds after which a request whose worker stopped renewing its lease is handed out again."""
    return int(os.environ.get("VISIBILITY_TIMEOUT", "20"))


def make_celery(broker_url: str | None = None, **settings) -> Celery:
    """The queue's Celery app; `settings` add to or override the shared configuration (the worker's own)."""
    app = Celery("supportbot", broker=broker_url or os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    app.conf.update(
        task_default_queue=QUEUE,
        # Consumed in this order (queue_order_strategy below): interactive, standard, bulk.
        task_queues=[Queue(name, routing_key=name) for name in QUEUES],
        task_ignore_result=True,          # answers travel over pub/sub and SQL, not the result backend
        task_acks_late=True,              # ack after the answer is stored: a dead worker's request comes back
        task_reject_on_worker_lost=True,
        worker_prefetch_multiplier=1,
        broker_connection_retry_on_startup=True,
        # A worker waits for Redis as long as it takes; it reconnects within about 30 s of Redis coming back.
        broker_connection_max_retries=None,
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
            # Every fetch asks the class queues in the order the worker consumes them (one BRPOP over all three,
            # which Redis answers from the first non-empty list), instead of kombu's default round robin that
            # would give a bulk request every third turn whatever waits in the interactive queue.
            "queue_order_strategy": "priority",
            "socket_connect_timeout": 2,
            "socket_timeout": 10,
            "health_check_interval": 10,
        },
        task_serializer="json",
        accept_content=["json"],
    )
    app.conf.update(settings)
    return app


def queue_depths(client: redis.Redis) -> dict[str, int]:
    """Requests waiting in Redis, per service class."""
    pipe = client.pipeline(transaction=False)
    for name in CLASS_QUEUES.values():
        pipe.llen(name)
    return dict(zip(CLASS_QUEUES, pipe.execute()))
