"""Rate limits and connection counts kept in Redis, so every web process enforces the same budget."""

from __future__ import annotations

import hashlib
import logging
import math
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass

import redis
from flask import Flask, current_app, g, request

from .queue import UserError

log = logging.getLogger(__name__)

PREFIX = "supportbot:limits:"
# A live connection refreshes its entry this often; one not refreshed for CONNECTION_TTL_S (its web
# process died) stops counting, so a crash cannot lock an address out for good.
CONNECTION_REFRESH_S = 20
CONNECTION_TTL_S = 60

UNITS = {"second": 1, "minute": 60, "hour": 3600, "day": 86400}
RULE = re.compile(r"^\s*(\d+)\s*/\s*(\d+)?\s*(second|minute|hour|day)s?\s*$", re.IGNORECASE)
OFF = ("", "0", "off", "none", "unlimited")


@dataclass(frozen=True)
class Rule:
    """At most `limit` events in any `period` seconds (a sliding window, so no burst at a window's edge)."""

    limit: int
    period: float


def parse_rule(text: str | None, name: str) -> Rule | None:
    """`"10/minute"`, `"100/hour"`, `"5/10 seconds"`; `off` (or 0) for no limit."""
    if text is None or text.strip().lower() in OFF:
        return None
    match = RULE.match(text)
    if not match or int(match.group(1)) < 1 or int(match.group(2) or 1) < 1:
        raise ValueError(f"{name}={text!r}: write it like '10/minute', '100/hour' or '5/10 seconds', or 'off'.")
    count = int(match.group(2) or 1)
    return Rule(int(match.group(1)), count * UNITS[match.group(3).lower()])


class RateLimited(UserError):
    """Too many requests for now; `retry_after` says in how many seconds one will be accepted again."""

    def __init__(self, retry_after: int, message: str, outcome: Outcome | None = None) -> None:
        super().__init__("rate_limited", message, retryable=True, status=429)
        self.retry_after = retry_after
        self.outcome = outcome


# Checks every (key, rule) pair first and records the event in all of them only if each has room,
# so a refused request costs nothing and two processes cannot both take the last slot. Returns the wait (0: allowed)
# and the tightest rule's limit, the room it has left after this event, and the seconds until a slot comes back.
_HIT = """
local now, member = tonumber(ARGV[1]), ARGV[2]
local wait, left, limit_of, reset = 0, nil, 0, 0
for i, key in ipairs(KEYS) do
  local period, limit = tonumber(ARGV[1 + 2 * i]), tonumber(ARGV[2 + 2 * i])
  redis.call('ZREMRANGEBYSCORE', key, '-inf', now - period)
  local count = redis.call('ZCARD', key)
  if count >= limit then
    local oldest = redis.call('ZRANGE', key, -limit, -limit, 'WITHSCORES')
    wait = math.max(wait, tonumber(oldest[2]) + period - now)
  end
  if left == nil or limit - count < left then
    left, limit_of = limit - count, limit
    local first = redis.call('ZRANGE', key, 0, 0, 'WITHSCORES')
    reset = first[2] and (tonumber(first[2]) + period - now) or period
  end
end
if wait > 0 then return {tostring(wait), tostring(limit_of), '0', tostring(wait)} end
for i, key in ipairs(KEYS) do
  redis.call('ZADD', key, now, member)
  redis.call('EXPIRE', key, math.ceil(tonumber(ARGV[1 + 2 * i])) + 1)
end
return {'0', tostring(limit_of), tostring(math.max(0, left - 1)), tostring(reset)}
"""


@dataclass(frozen=True)
class Outcome:
    """One checked event: `wait` seconds before it would be allowed (0: allowed and counted), its id, and the
    tightest rule's `limit`, `remaining` room after it and seconds until a slot comes back (`reset_s`); the
    `x-ratelimit-*` headers report these. `limit` is None when no rule applies."""

    wait: float
    member: str
    limit: int | None = None
    remaining: int | None = None
    reset_s: float = 0.0


_CONNECT = """
local now, ttl, limit, member = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), ARGV[4]
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now - ttl)
if redis.call('ZCARD', KEYS[1]) >= limit then return 0 end
redis.call('ZADD', KEYS[1], now, member)
redis.call('EXPIRE', KEYS[1], math.ceil(ttl))
return 1
"""


def hit(r: redis.Redis, checks: list[tuple[str, Rule | None]]) -> Outcome:
    """Record one event against every configured (key, rule), all at once or not at all."""
    active = [(key, rule) for key, rule in checks if rule is not None]
    member = uuid.uuid4().hex
    if not active:
        return Outcome(0.0, member)
    args: list = [time.time(), member]
    for _, rule in active:
        args += [rule.period, rule.limit]
    try:
        wait, limit, remaining, reset = r.eval(_HIT, len(active), *(PREFIX + key for key, _ in active), *args)
    except redis.RedisError as exc:
        # Without Redis nothing can be queued either; the caller's next step reports that clearly.
        log.warning("rate limit not checked: %s", exc)
        return Outcome(0.0, member)
    return Outcome(float(wait), member, int(float(limit)), int(float(remaining)), float(reset))


def refund(r: redis.Redis, keys: list[str], member: str) -> None:
    """Take back an event that should not count (a successful login)."""
    try:
        for key in keys:
            r.zrem(PREFIX + key, member)
    except redis.RedisError as exc:
        log.warning("rate limit refund failed: %s", exc)


def retry_after(wait: float) -> int:
    return max(1, math.ceil(wait))


def check(r: redis.Redis, checks: list[tuple[str, Rule | None]], what: str) -> Outcome:
    """Raise RateLimited when any of the checks is exhausted; the counted event otherwise."""
    outcome = hit(r, checks)
    if outcome.wait > 0:
        seconds = retry_after(outcome.wait)
        raise RateLimited(seconds, f"Too many {what} in a short time; please wait {seconds} "
                                   f"second{'s' if seconds != 1 else ''} and try again.", outcome)
    return outcome


class ConnectionCounter:
    """Open Socket.IO connections per client address, shared by all web processes through Redis.

    `limit` is a number, or a function giving the current one (it follows the workers' capacity); 0 for none.
    """

    def __init__(self, r: redis.Redis, limit: int | Callable[[], int]) -> None:
        self.redis, self._limit = r, limit
        self._mine: dict[str, str] = {}   # sid -> address, for this process's refresh loop
        self._lock = threading.Lock()
        self._refresher: threading.Thread | None = None

    @property
    def limit(self) -> int:
        return self._limit() if callable(self._limit) else self._limit

    @staticmethod
    def key(address: str) -> str:
        return f"{PREFIX}connections:{address}"

    def acquire(self, address: str, sid: str) -> bool:
        limit = self.limit
        if limit <= 0:
            return True
        try:
            ok = bool(self.redis.eval(_CONNECT, 1, self.key(address), time.time(), CONNECTION_TTL_S, limit, sid))
        except redis.RedisError as exc:
            log.warning("connection count not checked: %s", exc)
            return True
        if ok:
            with self._lock:
                self._mine[sid] = address
                if self._refresher is None:
                    self._refresher = threading.Thread(target=self._refresh_loop, name="connection-refresh",
                                                       daemon=True)
                    self._refresher.start()
        return ok

    def release(self, sid: str) -> None:
        with self._lock:
            address = self._mine.pop(sid, None)
        if address is None:
            return
        try:
            self.redis.zrem(self.key(address), sid)
        except redis.RedisError as exc:
            log.warning("connection count not released (it expires by itself): %s", exc)

    def refresh(self) -> None:
        with self._lock:
            mine = list(self._mine.items())
        now = time.time()
        pipe = self.redis.pipeline(transaction=False)
        for sid, address in mine:
            pipe.zadd(self.key(address), {sid: now}, xx=True)
            pipe.expire(self.key(address), CONNECTION_TTL_S)
        pipe.execute()

    def _refresh_loop(self) -> None:
        while True:
            time.sleep(CONNECTION_REFRESH_S)
            try:
                self.refresh()
            except redis.RedisError as exc:
                log.warning("could not refresh connection counts: %s", exc)


@dataclass(frozen=True)
class Limits:
    per_session: Rule | None
    per_ip: Rule | None
    login: Rule | None
    connections: ConnectionCounter


def init_app(app: Flask) -> None:
    """Read the limits once; a setting that does not parse stops the app with the variable's name."""
    cfg = app.config
    app.extensions["limits"] = Limits(
        per_session=parse_rule(cfg["RATE_LIMIT_PER_SESSION"], "RATE_LIMIT_PER_SESSION"),
        per_ip=parse_rule(cfg["RATE_LIMIT_PER_IP"], "RATE_LIMIT_PER_IP"),
        login=parse_rule(cfg["LOGIN_RATE_LIMIT"], "LOGIN_RATE_LIMIT"),
        connections=ConnectionCounter(app.extensions["redis"], lambda: app.extensions["capacity"].connections_per_ip(
            None if cfg["MAX_CONNECTIONS_PER_IP"] is None else int(cfg["MAX_CONNECTIONS_PER_IP"]))),
    )


def client_address() -> str:
    return request.remote_addr or "unknown"


def digest(text: str) -> str:
    """Keys stay short and hold nothing a reader of Redis could reuse (API keys, typed usernames)."""
    return hashlib.sha256(text.encode("utf-8", "replace")).hexdigest()[:32]


def limit_message(session_key: str | None, per_key: tuple[str, Rule] | None = None) -> None:
    """One chat message or completion: counted per session (when there is one) and per client address, and for an
    API key with a limit of its own per key (by its id, never the key): all at once, so a refusal costs none."""
    lim: Limits = current_app.extensions["limits"]
    checks = [(f"messages:ip:{client_address()}", lim.per_ip)]
    if session_key:
        checks.append((f"messages:session:{digest(session_key)}", lim.per_session))
    if per_key:
        checks.append((f"messages:key:{per_key[0]}", per_key[1]))
    try:
        g.rate_limit = check(current_app.extensions["redis"], checks, "messages")
    except RateLimited as exc:
        g.rate_limit = exc.outcome
        raise


def limit_login(username: str) -> tuple[list[str], str]:
    """One login attempt per address and per username; the keys and event id let a success be refunded."""
    lim: Limits = current_app.extensions["limits"]
    keys = [f"login:ip:{client_address()}", f"login:user:{digest(username.strip().lower())}"]
    outcome = check(current_app.extensions["redis"], [(key, lim.login) for key in keys], "login attempts")
    return keys, outcome.member
