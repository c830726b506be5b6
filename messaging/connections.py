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


def pool_size() -> int:
    """Connections one process keeps to Redis at most; more callers at once wait for one to be free."""
    return int(os.environ.get("REDIS_MAX_CONNECTIONS", "256"))


def pool_timeout_s() -> float:
    """How long a caller waits for a free pooled connection before the call fails as Redis being unavailable."""
    return float(os.environ.get("REDIS_POOL_TIMEOUT_S", "10"))


def redis_client(url: str, max_connections: int | None = None) -> redis.Redis:
    """A client whose pool makes callers wait (up to `pool_timeout_s()`) when every connection is in use.

    redis-py's default pool refuses a caller outright past its limit ("Too many connections"), so a burst
    of customers would be refused by our own plumbing while Redis itself is healthy.
    """
    pool = redis.BlockingConnectionPool.from_url(url, max_connections=max_connections or pool_size(),
                                                 timeout=pool_timeout_s(), **redis_options())
    return redis.Redis(connection_pool=pool)


class SocketIOQueue(socketio.RedisManager):
    """Flask-SocketIO's Redis message queue, with fail-fast connections and a listener that keeps retrying.

    The stock listener doubles its pause after every failed attempt up to a minute, so after a long outage a
    web process could stay deaf for a minute after Redis is back; this one retries every second.
    Messages on `extra_channels`, read on the same connection (so in the order they were published across all
    the channels), go to `on_message` instead of Socket.IO's own handling.
    """

    def __init__(self, url: str, write_only: bool = False, extra_channels: tuple[str, ...] = ()) -> None:
        super().__init__(url, channel=SOCKETIO_CHANNEL, write_only=write_only, logger=log,
                         redis_options=redis_options())
        self.extra_channels = {name.encode(): name for name in extra_channels}

    def on_message(self, channel: str, data: bytes) -> None:
        """A message on one of `extra_channels`, in the listener's thread."""

    def _listen(self) -> Iterator[bytes]:
        own = self.channel.encode()
        for message in self._redis_listen_with_retries():
            if message["type"] != "message":
                continue
            if message["channel"] == own:
                yield message["data"]
            elif message["channel"] in self.extra_channels:
                try:
                    self.on_message(self.extra_channels[message["channel"]], message["data"])
                except Exception:   # one bad message must not stop the listener
                    log.exception("handling a message on %s failed", message["channel"])

    def _redis_listen_with_retries(self) -> Iterator[dict]:
        pause, subscribed = 0.5, False
        while True:
            try:
                if not subscribed:
                    self._redis_connect()
                    self.pubsub.subscribe(self.channel, *self.extra_channels.values())
                    subscribed, pause = True, 0.5
                    log.info("Socket.IO message queue: listening on Redis")
                yield from self.pubsub.listen()
            except redis.RedisError as exc:   # anything else: the manager's own loop logs it and calls again
                log.warning("Socket.IO message queue: lost Redis (%s); retrying in %.1f s", exc, pause)
                subscribed = False
                time.sleep(pause)
                pause = min(LISTEN_RETRY_MAX_S, pause * 2)
