"""Limits that follow what the live workers can hold: the queue's length and open chats per address.

Each worker announces its engine slots in its heartbeat (worker/runtime.py). A web process reads them
every few seconds and, unless QUEUE_LIMIT or MAX_CONNECTIONS_PER_IP is set, sizes those limits to the
slots of all live workers together: a GPU worker answering hundreds of conversations at once gets a
queue and per-address limits to match, and a CPU worker keeps the defaults its 16 slots were sized for.
"""

from __future__ import annotations

import logging
import time

import redis
from flask import current_app

from messaging import workers

log = logging.getLogger(__name__)

QUEUE_LIMIT_FLOOR = 200           # with no (or small) workers: what the queue takes
QUEUE_PER_SLOT = 8                # queued requests per engine slot: about eight answers' time of waiting
CONNECTIONS_PER_IP_FLOOR = 50     # open chats from one address (one office behind one NAT)
CONNECTIONS_PER_SLOT = 1
REFRESH_S = 5.0


class Capacity:
    """The slots of all live workers, read from their heartbeats at most every REFRESH_S seconds."""

    def __init__(self, client: redis.Redis) -> None:
        self.redis = client
        self._slots, self._read_at = 0, float("-inf")

    def slots(self) -> int:
        now = time.monotonic()
        if now - self._read_at >= REFRESH_S:
            self._read_at = now   # one caller refreshes; the others use the figure it had
            try:
                self._slots = sum(int(beat.get("slots") or 0) for beat in workers.heartbeats(self.redis).values())
            except (redis.RedisError, ValueError) as exc:
                log.warning("could not read the workers' capacity: %s", exc)
        return self._slots

    def queue_limit(self, configured: int | None) -> int:
        return configured if configured is not None else max(QUEUE_LIMIT_FLOOR, QUEUE_PER_SLOT * self.slots())

    def connections_per_ip(self, configured: int | None) -> int:
        if configured is not None:
            return configured
        return max(CONNECTIONS_PER_IP_FLOOR, CONNECTIONS_PER_SLOT * self.slots())


def queue_limit() -> int:
    return current_app.extensions["capacity"].queue_limit(current_app.config["QUEUE_LIMIT"])
