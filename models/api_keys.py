"""API keys for the OpenAI-compatible API: a SHA-256 digest of each key is stored, never the key itself."""

from __future__ import annotations

import hashlib
import secrets
from datetime import datetime

from sqlalchemy import String, false
from sqlalchemy.orm import Mapped, mapped_column

from models.base import Base, utcnow

KEY_PREFIX = "sb-"
# Shown in lists and error messages: "sb-" and 4 random characters tell keys apart and reveal ~24 of ~256 bits.
DISPLAY_CHARS = 7
NAME_CHARS = 64


def new_key() -> str:
    """A fresh key: 256 random bits, URL-safe, recognisable by its prefix."""
    return KEY_PREFIX + secrets.token_urlsafe(32)


def hash_key(key: str) -> str:
    """The stored form. Keys are long random tokens, so one fast digest suffices (a password hash would only slow
    every API request); a database leak yields no usable key."""
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()


def display_prefix(key: str) -> str:
    return key[:DISPLAY_CHARS] + "…"


class ApiKey(Base):
    """One client's key. Revoked keys stay (their name is on past records) until deleted."""

    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(primary_key=True)
    name: Mapped[str] = mapped_column(String(NAME_CHARS), unique=True)
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    prefix: Mapped[str] = mapped_column(String(16))
    created_at: Mapped[datetime] = mapped_column(default=utcnow)
    # Written at most about once a minute per key and web process, not per request.
    last_used_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]
    # A rule like RATE_LIMIT_PER_SESSION's ("60/minute"); None: only the address limits apply.
    rate_limit: Mapped[str | None] = mapped_column(String(64))
    # The class of its requests that do not name a service_tier (interactive, standard or bulk), and whether it may
    # ask for service_tier "priority" (served as interactive).
    service_class: Mapped[str] = mapped_column(String(16), default="standard", server_default="standard")
    priority_allowed: Mapped[bool] = mapped_column(default=False, server_default=false())

    @property
    def revoked(self) -> bool:
        return self.revoked_at is not None

    def __repr__(self) -> str:
        return f"ApiKey(name={self.name!r}, prefix={self.prefix!r}, revoked={self.revoked})"
