"""Redis connections for the web app and the worker: they fail fast while Redis is down and reconnect by themselves."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterator

import redis
import socketio
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from messaging.contract import SOCKETIO_CHANNEL

log = logging.getLogger(__name__)

# The web processes' listener retries this often at most, so it is back soon after Redis is.
LISTEN_RETRY_MAX_S = 1.0


def redis_options() -> dict:
    """Timeouts and a short retry, so a command against a Redis that is down fails in about a second."""
    return {
        "socket_connect_timeout": float(os.environ.get("REDIS_CONNECT_TIMEOUT_S", "2")),
        "socket_timeout": float(os.environ.get("REDIS_SOCKET_TIMEOUT_S", "5")),
        "socket_keepalive": True,
        # Pub/sub and idle pooled connections are pinged now and then, so a dead one is replaced.
        "health_check_interval": 10,
        "retry": Retry(ExponentialBackoff(cap=0.5, base=0.05), 3),
    }


def redis_client(url: str) -> redis.Redis:
    return redis.Redis.from_url(url, **redis_options())


class SocketIOQueue(socketio.RedisManager):
    """Flask-SocketIO's Redis message queue, with fail-fast connections and a listener that keeps retrying.

    The stock listener doubles its pause after every failed attempt up to a minute, so after a long outage a
    web process could stay deaf for a minute after Redis is back; this one retries every second.
    With `strict`, a publish that fails raises instead of being logged and dropped, so the caller can retry.
    """

    def __init__(self, url: str, write_only: bool = False, strict: bool = False) -> None:
        super().__init__(url, channel=SOCKETIO_CHANNEL, write_only=write_only, logger=log,
                         redis_options=redis_options())
        self.strict = strict

    def encode(self, event: str, data: dict, room: str) -> str:
        """An emit to `room` as the web processes' listeners read it, for a caller that publishes it itself."""
        return self.json.dumps({"method": "emit", "event": event, "data": [data], "binary": False, "namespace": "/",
                                "room": room, "skip_sid": None, "callback": None, "host_id": self.host_id})

    def _publish(self, data):
        if not self.strict:
            return super()._publish(data)
        if not self.connected:
            self._redis_connect()
        return self.redis.publish(self.channel, self.json.dumps(data))   # the client reconnects by itself

    def _redis_listen_with_retries(self) -> Iterator[dict]:
        pause, subscribed = 0.5, False
        while True:
            try:
                if not subscribed:
                    self._redis_connect()
                    self.pubsub.subscribe(self.channel)
                    subscribed, pause = True, 0.5
                    log.info("Socket.IO message queue: listening on Redis")
                yield from self.pubsub.listen()
            except redis.RedisError as exc:   # anything else: the manager's own loop logs it and calls again
                log.warning("Socket.IO message queue: lost Redis (%s); retrying in %.1f s", exc, pause)
                subscribed = False
                time.sleep(pause)
                pause = min(LISTEN_RETRY_MAX_S, pause * 2)
