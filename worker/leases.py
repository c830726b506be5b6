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
UNACKED = Channel.unacked_key
# A task's ack (or its hand-back to the queue) normally lands within moments. One still missing after this
# was lost: Redis went away as it was sent, and kombu does not send it again.
ACK_GRACE_S = 5
# A lost ack of an answered request is sent again by the lease thread. Any other task whose ack or hand-back
# never lands stops being leased after this, so its message is delivered again: answered from what was
# stored, or generated anew.
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
        self._ending: dict[str, tuple[float, bool]] = {}   # tag of an ended task not yet acked -> (since, answered)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="leases", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def hold(self, task_id: str, delivery_tag: str) -> None:
        # No write to Redis here: kombu stamped the lease as it delivered the message, and this runs in the
        # consumer's thread, where a round trip per message would space out the tasks of a burst.
        # The lease thread renews it within `interval`, well inside the visibility timeout.
        with self._lock:
            self._tags[task_id] = delivery_tag

    def release(self, task_id: str, answered: bool = False) -> None:
        """The task is over (`answered`: its answer is stored and sent). Its ack follows, late if Redis is
        away: until it lands the lease is kept, or the message would look abandoned and be handed out again."""
        with self._lock:
            tag = self._tags.pop(task_id, None)
            if tag is not None:
                self._ending[tag] = (time.monotonic(), answered)

    def held(self) -> list[str]:
        with self._lock:
            return [*self._tags.values(), *self._ending]

    def renew(self, tags: list[str]) -> None:
        # XX: only messages still unacked and not yet restored; an acked or requeued one stays gone.
        if tags:
            now = time.time()
            self.client.zadd(UNACKED_INDEX, {tag: now for tag in tags}, xx=True)

    def forget_acked(self) -> None:
        """Stop leasing what was acked; ack again what was answered but whose ack was lost."""
        with self._lock:
            ending = dict(self._ending)
        if not ending:
            return
        pipe = self.client.pipeline(transaction=False)
        for tag in ending:
            pipe.zscore(UNACKED_INDEX, tag)
        now = time.monotonic()
        gone = {tag for tag, score in zip(ending, pipe.execute()) if score is None}
        lost = [tag for tag, (since, answered) in ending.items()
                if answered and tag not in gone and now - since > ACK_GRACE_S]
        if lost:
            # What kombu's ack does: the answer is stored, so the message must not be delivered again.
            pipe = self.client.pipeline(transaction=True)
            pipe.zrem(UNACKED_INDEX, *lost).hdel(UNACKED, *lost)
            pipe.execute()
            log.warning("acked %d answered request(s) whose ack was lost while Redis was away", len(lost))
        too_old = {tag for tag, (since, _) in ending.items() if now - since > ACK_WAIT_S}
        with self._lock:
            for tag in gone | too_old | set(lost):
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
