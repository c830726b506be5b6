"""Leases on the requests this worker holds, so a dead worker's requests go back to the queue in seconds.

The Redis broker keeps every delivered, unacknowledged message in a sorted set scored by delivery
time, and any consumer puts back those older than `visibility_timeout`. A short timeout alone would
also hand out long answers that are still being generated, so a live worker keeps re-scoring the
messages it holds; only a dead worker's scores age past the timeout.
"""

from __future__ import annotations

import logging
import threading
import time

import redis
from kombu.transport.redis import Channel

log = logging.getLogger(__name__)

UNACKED_INDEX = Channel.unacked_index_key


class Leases:
    def __init__(self, client: redis.Redis, visibility_timeout: float) -> None:
        self.client = client
        self.interval = max(0.5, visibility_timeout / 4)
        self._tags: dict[str, str] = {}          # task id -> broker delivery tag
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leases", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def hold(self, task_id: str, delivery_tag: str) -> None:
        with self._lock:
            self._tags[task_id] = delivery_tag
        self.renew([delivery_tag])

    def release(self, task_id: str) -> None:
        with self._lock:
            self._tags.pop(task_id, None)

    def held(self) -> list[str]:
        with self._lock:
            return list(self._tags.values())

    def renew(self, tags: list[str]) -> None:
        # XX: only messages still unacked and not yet restored; an acked or requeued one stays gone.
        if tags:
            now = time.time()
            self.client.zadd(UNACKED_INDEX, {tag: now for tag in tags}, xx=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            try:
                self.renew(self.held())
            except redis.RedisError as exc:
                log.warning("could not renew request leases: %s", exc)
