"""Which API keys /v1 accepts: each web process keeps a copy of the api_keys table, read again every REFRESH_S
seconds, and checks every /v1 request against it before anything else is done (nothing is queued or stored for
a refused request).

A revoked key is refused by every web process at most REFRESH_S seconds (plus one reload's query) after the
revocation is committed; a new key is accepted at once (a key the copy lacks is looked up in the table). The raw
key is hashed on arrival and goes nowhere else: not into logs, Redis or SQL.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta

from flask import Flask, current_app, g, request
from sqlalchemy import or_, select, update
from sqlalchemy.exc import SQLAlchemyError

from models import ApiKey
from models.api_keys import hash_key

from . import limits
from .queue import UserError

log = logging.getLogger(__name__)

REFRESH_S = 2.0
# last_used_at is written at most this often per key and web process (and not at all if another process
# wrote it this recently): a busy key costs one small UPDATE a minute, not one per request.
TOUCH_S = 60.0
CREATE_HINT = "python -m webapp.keys create NAME"
KEYED_PATHS = ("/v1", "/tokenize", "/detokenize")   # and everything under /v1/


@dataclass(frozen=True)
class KeyInfo:
    id: int
    name: str
    prefix: str
    revoked: bool
    rule: limits.Rule | None
    service_class: str = "standard"      # its requests' class when they name no service_tier
    priority_allowed: bool = False       # whether it may ask for service_tier "priority"


@dataclass(frozen=True)
class Snapshot:
    by_hash: dict[str, KeyInfo]
    total: int      # every key, revoked ones included: /v1 is open only while there are none at all
    loaded_at: float


def _rule(row: ApiKey) -> limits.Rule | None:
    try:
        return limits.parse_rule(row.rate_limit, f"the rate limit of key {row.name!r}")
    except ValueError as exc:   # the CLI and the dashboard check rules; this is a row written some other way
        log.warning("%s; the key is served without a limit of its own", exc)
        return None


class KeyRing:
    def __init__(self, sessions, refresh_s: float = REFRESH_S) -> None:
        self.sessions, self.refresh_s = sessions, refresh_s
        self._snapshot: Snapshot | None = None
        self._lock = threading.Lock()   # one reload at a time; gevent's lock under the gevent worker
        self._touched: dict[int, float] = {}

    def _load(self) -> Snapshot:
        with self.sessions() as db:
            rows = db.scalars(select(ApiKey)).all()
        keys = {row.key_hash: KeyInfo(row.id, row.name, row.prefix, row.revoked, _rule(row), row.service_class,
                                      row.priority_allowed) for row in rows}
        return Snapshot(keys, len(rows), time.monotonic())

    def snapshot(self) -> Snapshot:
        """The keys as of at most `refresh_s` ago. A database this process cannot reach keeps the last copy in use:
        no completion is served meanwhile anyway (its record cannot be stored). With no copy yet, the error goes up
        (a 503 from webapp/health.py)."""
        snap = self._snapshot
        if snap is not None and time.monotonic() - snap.loaded_at < self.refresh_s:
            return snap
        with self._lock:
            snap = self._snapshot
            if snap is None or time.monotonic() - snap.loaded_at >= self.refresh_s:
                try:
                    self._snapshot = self._load()
                except SQLAlchemyError as exc:
                    if snap is None:
                        raise
                    log.warning("could not re-read the API keys (%s); using the copy from %.0f s ago", exc,
                                time.monotonic() - snap.loaded_at)
                    self._snapshot = Snapshot(snap.by_hash, snap.total, time.monotonic())
            return self._snapshot

    def find(self, key_hash: str) -> KeyInfo | None:
        """The key with this digest. A digest the copy lacks is looked up in the table, so a key works as soon as
        it is created (its copy is re-read then); an unknown key costs one indexed query."""
        key = self.snapshot().by_hash.get(key_hash)
        if key is not None:
            return key
        try:
            with self.sessions() as db:
                if db.scalar(select(ApiKey.id).where(ApiKey.key_hash == key_hash)) is None:
                    return None
            with self._lock:
                self._snapshot = self._load()
        except SQLAlchemyError as exc:
            log.warning("could not look up an API key missing from the copy: %s", exc)
            return None
        return self._snapshot.by_hash.get(key_hash)

    def touch(self, key: KeyInfo) -> None:
        """Note that `key` was used, at most once per TOUCH_S in this process; failures cost the note only."""
        now = time.monotonic()
        if now - self._touched.get(key.id, -TOUCH_S) < TOUCH_S:
            return
        self._touched[key.id] = now
        stamp = datetime.now(UTC)
        try:
            with self.sessions() as db:
                db.execute(update(ApiKey).where(ApiKey.id == key.id, or_(
                    ApiKey.last_used_at.is_(None), ApiKey.last_used_at < stamp - timedelta(seconds=TOUCH_S)))
                    .values(last_used_at=stamp))
                db.commit()
        except SQLAlchemyError as exc:
            log.warning("could not note when API key %r was last used: %s", key.name, exc)


def mask(token: str) -> str:
    """What an error may say of a key the client sent: enough to recognise it, never enough to use it."""
    return f"{token[:3]}…{token[-4:]}" if len(token) >= 16 else "…"


def bearer_token() -> str:
    """The key a client sent: `Authorization: Bearer KEY`, or `x-api-key: KEY` as Anthropic's clients send it."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    if scheme.lower() == "bearer" and token.strip():
        return token.strip()
    return request.headers.get("X-Api-Key", "").strip()


def refuse(message: str):
    """HTTP 401 in OpenAI's shape: its client raises AuthenticationError."""
    return ({"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}},
            401, {"WWW-Authenticate": 'Bearer realm="supportbot"'})


def check_request():
    """Before every request under /v1 (and /tokenize, /detokenize): None to go on, or the refusal (OpenAI's shape,
    so clients raise AuthenticationError). The key that passed is `g.api_key`; None while no key exists
    (development)."""
    if request.path not in KEYED_PATHS and not request.path.startswith("/v1/"):
        return None
    g.api_key = None
    ring: KeyRing = current_app.extensions["keyring"]
    snap = ring.snapshot()
    if snap.total == 0:
        if current_app.config.get("SUPPORTBOT_ENV") == "production":
            return refuse("No API key is configured on this server, so the API is closed. An operator creates one "
                          f"with: {CREATE_HINT} (or on the dashboard's API keys page).")
        return None
    token = bearer_token()
    if not token:
        return refuse("You didn't provide an API key. Send it in the Authorization header "
                      "(Authorization: Bearer YOUR_KEY; the openai client: api_key=...). Ask an operator of this "
                      "server for a key.")
    key = ring.find(hash_key(token))
    if key is None:
        return refuse(f"Incorrect API key provided: {mask(token)}. Check the key, or ask an operator of this "
                      "server for one.")
    if key.revoked:
        return refuse(f"The API key {key.prefix} has been revoked; ask an operator of this server for a new one.")
    g.api_key = key
    ring.touch(key)
    return None


def current_name() -> str | None:
    """The name of the key this request came with, for its job and record."""
    key = g.get("api_key")
    return key.name if key is not None else None


def session_part() -> str | None:
    """What tells this client's key apart for the per-session limit: the key's id, or with keys off a digest of
    whatever bearer token it sends (many clients share a dummy key). Never the token itself."""
    key = g.get("api_key")
    if key is not None:
        return f"key:{key.id}"
    token = bearer_token()
    return f"token:{limits.digest(token)}" if token else None


def rate_limit() -> tuple[str, limits.Rule] | None:
    """The key's own limit, counted by its id, or None."""
    key = g.get("api_key")
    return (str(key.id), key.rule) if key is not None and key.rule is not None else None


def init_app(app: Flask) -> None:
    app.extensions["keyring"] = KeyRing(app.extensions["db"])
    app.before_request(check_request)


# OpenAI's service_tier values and the class each asks for; None: the key's own class.
SERVICE_TIERS = {"auto": None, "default": None, "flex": "bulk", "priority": "interactive"}


def service_class(tier: object = None) -> str:
    """The class of this /v1 request: its `service_tier` ("priority": interactive, for keys allowed it; "flex":
    bulk; "auto", "default" or none: the key's own class, standard without keys). UserError (400) otherwise."""
    key = g.get("api_key")
    if tier is not None and (not isinstance(tier, str) or tier not in SERVICE_TIERS):
        shown = repr(tier) if len(repr(tier)) <= 40 else repr(tier)[:37] + "..."
        raise UserError("invalid_value", f"'service_tier' must be one of {', '.join(map(repr, SERVICE_TIERS))}; got "
                                         f"{shown}.", param="service_tier")
    asked = SERVICE_TIERS.get(tier) if tier is not None else None
    if asked is None:
        return key.service_class if key is not None else "standard"
    if asked == "interactive" and key is not None and not key.priority_allowed:
        raise UserError("invalid_value", f"The API key {key.prefix} may not ask for service_tier 'priority'; send "
                                         "'auto', 'default' or 'flex', or ask an operator to allow it priority "
                                         "(python -m webapp.keys set NAME --priority).", param="service_tier")
    return asked
