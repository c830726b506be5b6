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
from kombu.transport.redis import Channel, Transport

log = logging.getLogger(__name__)

UNACKED_INDEX = Channel.unacked_index_key
# A finished task's ack normally lands within moments, or soon after Redis is back; one that never lands
# (Redis away when it was sent) stops being leased after this, so its message is delivered again and its
# stored answer shown once more.
ACK_WAIT_S = 300


class LeasedChannel(Channel):
    """A channel whose requests outlive its connection to Redis.

    When the connection drops, kombu closes the channel and would push its unacknowledged requests back to
    the queue although their answers are still being generated; and an answer that finishes afterwards
    could not be acked through the closed channel (kombu fails with an error that stops the consumer).
    Here the requests stay where they are, each answer is acked through a fresh connection once Redis is
    back, and a request whose worker really died comes back when its lease lapses, as after a crash.
    """

    do_restore = False
    _sync_params: dict | None = None

    def _connparams(self, asynchronous: bool = False) -> dict:
        if self.connection is None and self._sync_params is not None:   # closed: only acks get here
            return dict(self._sync_params)
        params = super()._connparams(asynchronous=asynchronous)
        if not asynchronous:
            self._sync_params = params
        return params


class LeasedTransport(Transport):
    """kombu's Redis transport with LeasedChannel (Celery's `broker_transport`)."""

    Channel = LeasedChannel


class Leases:
    def __init__(self, client: redis.Redis, visibility_timeout: float) -> None:
        self.client = client
        self.interval = max(0.5, visibility_timeout / 4)
        self._tags: dict[str, str] = {}          # task id -> broker delivery tag
        self._ending: dict[str, float] = {}      # tags of finished tasks whose ack has not landed -> since
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
        """The task is over. Its ack follows, late if Redis is away: until it lands the lease is kept, or
        the message would look abandoned and be handed out again."""
        with self._lock:
            tag = self._tags.pop(task_id, None)
            if tag is not None:
                self._ending[tag] = time.monotonic()

    def held(self) -> list[str]:
        with self._lock:
            return [*self._tags.values(), *self._ending]

    def renew(self, tags: list[str]) -> None:
        # XX: only messages still unacked and not yet restored; an acked or requeued one stays gone.
        if tags:
            now = time.time()
            self.client.zadd(UNACKED_INDEX, {tag: now for tag in tags}, xx=True)

    def forget_acked(self) -> None:
        with self._lock:
            ending = list(self._ending)
        if not ending:
            return
        pipe = self.client.pipeline(transaction=False)
        for tag in ending:
            pipe.zscore(UNACKED_INDEX, tag)
        gone = {tag for tag, score in zip(ending, pipe.execute()) if score is None}
        with self._lock:
            too_old = {tag for tag, since in self._ending.items() if time.monotonic() - since > ACK_WAIT_S}
            for tag in gone | too_old:
                self._ending.pop(tag, None)

    def _run(self) -> None:
        pause = self.interval
        while not self._stop.wait(pause):
            try:
                self.renew(self.held())
                self.forget_acked()
                pause = self.interval
            except redis.RedisError as exc:
                if pause == self.interval:
                    log.warning("could not renew request leases: %s", exc)
                # Renew as soon as Redis is back, before any consumer's sweep takes the leases for lapsed.
                pause = min(0.25, self.interval)
