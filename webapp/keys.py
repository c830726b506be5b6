"""API keys for operators: create, list, revoke, delete and ensure them, and set their service class, from the
dashboard (webapp/dashboard.py) or the command line: `python -m webapp.keys create NAME [--rate-limit 60/minute]
[--class bulk] [--priority]`, `list`, `set NAME [--class C] [--priority | --no-priority]`, `revoke NAME`,
`delete NAME`, `ensure NAME --from-env VAR`. The database is DATABASE_URL's (default: instance/supportbot.db)."""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Sequence
from datetime import UTC, datetime

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session

from messaging.classes import CLASSES
from models import ApiKey
from models.api_keys import NAME_CHARS, display_prefix, hash_key, new_key

from .limits import parse_rule

NAME = re.compile(rf"^[A-Za-z0-9][A-Za-z0-9._-]{{0,{NAME_CHARS - 1}}}$")
# A key given to `ensure` (it comes from .env): long enough to be a secret, sendable in an HTTP header.
MIN_KEY_CHARS = 32
KEY_CHARS = re.compile(r"^[\x21-\x7e]+$")
MAKE_KEY = "python3 -c 'import secrets; print(\"sb-\" + secrets.token_urlsafe(32))'"
CLI = "python -m webapp.keys"


class KeyCommandError(Exception):
    """An operator's request that cannot be done as asked; the message says what to do instead."""


def check_name(name: str) -> str:
    name = name.strip()
    if not NAME.match(name):
        raise KeyCommandError(f"{name[:80]!r} is not a usable key name: use 1 to {NAME_CHARS} letters, digits, '.', "
                              "'_' or '-', starting with a letter or digit (e.g. mobile-app).")
    return name


def check_rule(text: str | None) -> str | None:
    """The rule as stored (None for no limit of its own), or KeyCommandError saying how to write it."""
    try:
        rule = parse_rule(text, "--rate-limit")
    except ValueError as exc:
        raise KeyCommandError(str(exc)) from None
    return text.strip() if rule is not None else None


def check_class(name: str | None) -> str:
    """A key's default class as stored, or KeyCommandError naming the classes."""
    value = (name or "standard").strip().lower()
    if value not in CLASSES:
        raise KeyCommandError(f"{str(name)[:40]!r} is not a service class; choose one of {', '.join(CLASSES)} "
                              "(interactive: served first, like the chat; bulk: throughput work that may wait).")
    return value


def find(db: Session, name: str) -> ApiKey:
    key = db.scalar(select(ApiKey).where(ApiKey.name == name))
    if key is None:
        raise KeyCommandError(f"No API key is named {name!r}; `{CLI} list` shows the keys there are.")
    return key


def _add(db: Session, name: str, secret: str, rate_limit: str | None, service_class: str | None = None,
         priority: bool = False) -> ApiKey:
    name, rule, cls = check_name(name), check_rule(rate_limit), check_class(service_class)
    existing = db.scalar(select(ApiKey).where(ApiKey.name == name))
    if existing is not None:
        raise KeyCommandError(f"An API key named {name!r} exists already (created {when(existing.created_at)}"
                              f"{', revoked' if existing.revoked else ''}). Choose another name, or delete that key "
                              f"first with `{CLI} delete {name}` (its clients then get 401).")
    key = ApiKey(name=name, key_hash=hash_key(secret), prefix=display_prefix(secret), rate_limit=rule,
                 service_class=cls, priority_allowed=priority)
    db.add(key)
    try:
        db.commit()
    except IntegrityError:
        db.rollback()
        if db.scalar(select(ApiKey).where(ApiKey.name == name)) is not None:
            raise KeyCommandError(f"An API key named {name!r} was created at the same moment; choose another "
                                  "name.") from None
        raise KeyCommandError(f"That key is already stored under another name; `{CLI} list` shows the keys "
                              "there are.") from None
    return key


def create(db: Session, name: str, rate_limit: str | None = None, service_class: str | None = None,
           priority: bool = False) -> tuple[ApiKey, str]:
    """A new key: (its row, the key). The key is shown to the operator once and never stored. `service_class`: its
    requests' class when they name no service_tier; `priority`: whether it may ask for service_tier "priority"."""
    secret = new_key()
    return _add(db, name, secret, rate_limit, service_class, priority), secret


def set_class(db: Session, name: str, service_class: str | None = None, priority: bool | None = None) -> ApiKey:
    """Change a key's default class and/or its right to ask for priority; every web process applies it within a
    few seconds (webapp/keyring.py)."""
    key = find(db, check_name(name))
    if service_class is not None:
        key.service_class = check_class(service_class)
    if priority is not None:
        key.priority_allowed = priority
    db.commit()
    return key


def describe_class(key: ApiKey) -> str:
    return f"class {key.service_class}, {'may' if key.priority_allowed else 'may not'} ask for priority"


def ensure(db: Session, name: str, secret: str, rate_limit: str | None = None, service_class: str | None = None,
           priority: bool = False) -> tuple[ApiKey, bool]:
    """The key named `name` holding `secret`: created if no key has that name; (row, created). A key of that name
    that holds another value, or that was revoked, is an error: the secret in hand would be refused."""
    name = check_name(name)
    if len(secret) < MIN_KEY_CHARS or not KEY_CHARS.match(secret):
        raise KeyCommandError(f"The key must be at least {MIN_KEY_CHARS} visible ASCII characters without spaces "
                              f"(it has {len(secret)}); make one with: {MAKE_KEY}")
    existing = db.scalar(select(ApiKey).where(ApiKey.name == name))
    if existing is None:
        return _add(db, name, secret, rate_limit, service_class, priority), True
    if existing.key_hash != hash_key(secret):
        raise KeyCommandError(f"The API key {name!r} ({existing.prefix}, created {when(existing.created_at)}) holds "
                              f"another value. Set the variable back to that key, or replace the key: `{CLI} delete "
                              f"{name}`, then ensure it again.")
    if existing.revoked:
        raise KeyCommandError(f"The API key {name!r} was revoked on {when(existing.revoked_at)}: clients using it are "
                              f"refused. Put a new key in the variable ({MAKE_KEY}), then `{CLI} delete {name}` "
                              "and ensure it again.")
    return existing, False


def revoke(db: Session, name: str) -> tuple[ApiKey, bool]:
    """(the key, whether it was revoked just now). Revoked keys stay listed; their name stays on past records."""
    key = find(db, check_name(name))
    if key.revoked:
        return key, False
    key.revoked_at = datetime.now(UTC)
    db.commit()
    return key, True


def delete(db: Session, name: str) -> None:
    """Remove a key for good (its name may then be given again); past records keep the name."""
    db.delete(find(db, check_name(name)))
    db.commit()


def all_keys(db: Session) -> list[ApiKey]:
    """Live keys first, then revoked ones; each group by name."""
    return list(db.scalars(select(ApiKey).order_by(ApiKey.revoked_at.is_not(None), ApiKey.name)))


def when(moment: datetime | None, never: str = "never") -> str:
    return moment.strftime("%Y-%m-%d %H:%M UTC") if moment is not None else never


def api_base() -> str:
    host = os.environ.get("HOST", "127.0.0.1")
    host = "127.0.0.1" if host in ("", "0.0.0.0", "::") else host
    return f"http://{host}:{os.environ.get('PORT', '5000')}/v1"


def api_status(db: Session, base: str, production: bool, python: str = "python") -> str:
    """One line for an operator: whether the API at `base` is open, closed or needs keys (webapp/keyring.py)."""
    total = db.scalar(select(func.count()).select_from(ApiKey))
    live = db.scalar(select(func.count()).select_from(ApiKey).where(ApiKey.revoked_at.is_(None)))
    create_hint = f"{python} -m webapp.keys create NAME"
    if total == 0 and production:
        return (f"the OpenAI-compatible API at {base} refuses every request: no API key is configured; create one "
                f"with: {create_hint}")
    if total == 0:
        return (f"the OpenAI-compatible API at {base} is open to anyone who can reach it; create a key with: "
                f"{create_hint}")
    return (f"the OpenAI-compatible API at {base} requires an API key ({live} live of {total}; "
            f"{python} -m webapp.keys list)")


def usage(key: str, base: str) -> str:
    """How a client uses a key, shown once when it is made."""
    return (f"Send it as `Authorization: Bearer {key}`, e.g. with the openai client:\n"
            f"    OpenAI(base_url=\"{base}\", api_key=\"{key}\")")


# ---- command line ---------------------------------------------------------------------------


def _table(keys: list[ApiKey]) -> str:
    rows = [("NAME", "KEY", "CREATED", "LAST USED", "REVOKED", "RATE LIMIT", "CLASS", "PRIORITY")]
    rows += [(k.name, k.prefix, when(k.created_at), when(k.last_used_at), when(k.revoked_at, "-"),
              k.rate_limit or "-", k.service_class, "allowed" if k.priority_allowed else "-") for k in keys]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)


def run(args: argparse.Namespace, db: Session) -> str:
    if args.command == "create":
        key, secret = create(db, args.name, args.rate_limit, args.service_class, args.priority)
        limit = f"rate limit {key.rate_limit}" if key.rate_limit else "no rate limit of its own"
        return (f"Created the API key {key.name!r} ({limit}, {describe_class(key)}):\n\n    {secret}\n\nIt is shown this once and stored "
                f"only as a hash: keep it now. {usage(secret, api_base())}\nRevoke it with: {CLI} revoke {key.name}")
    if args.command == "list":
        keys = all_keys(db)
        if not keys:
            return f"No API keys: /v1 is open to anyone who can reach it (closed in production). {CLI} create NAME"
        return _table(keys)
    if args.command == "set":
        if args.service_class is None and args.priority is None:
            raise KeyCommandError("Say what to change: --class interactive|standard|bulk, --priority or "
                                  "--no-priority.")
        key = set_class(db, args.name, args.service_class, args.priority)
        return f"The API key {key.name!r} is now {describe_class(key)}; every web process applies it within seconds."
    if args.command == "revoke":
        key, now = revoke(db, args.name)
        if not now:
            return f"The API key {key.name!r} was revoked already, on {when(key.revoked_at)}."
        return (f"Revoked the API key {key.name!r} ({key.prefix}): every web process refuses it within a few "
                "seconds.")
    if args.command == "delete":
        delete(db, args.name)
        return f"Deleted the API key {args.name!r}; past requests keep its name."
    if args.command == "ensure":
        secret = os.environ.get(args.from_env, "").strip()
        if not secret:
            raise KeyCommandError(f"{args.from_env} is not set or empty: set it to the API key clients will use "
                                  f"(e.g. in .env), made with: {MAKE_KEY}")
        key, created = ensure(db, args.name, secret, args.rate_limit, args.service_class, args.priority)
        return (f"Created the API key {key.name!r} ({key.prefix}) from {args.from_env}." if created else
                f"The API key {key.name!r} ({key.prefix}) is in place already; nothing changed.")
    raise AssertionError(args.command)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=CLI, description="API keys for the OpenAI-compatible API (/v1). While no key "
                                "exists /v1 is open (closed with SUPPORTBOT_ENV=production); once one exists every "
                                "request needs one. Uses DATABASE_URL.")
    sub = p.add_subparsers(dest="command", required=True)
    c = sub.add_parser("create", help="make a key and print it (the only time it is shown)")
    c.add_argument("name")
    c.add_argument("--rate-limit", help="requests this key may make, e.g. 60/minute, 1000/hour (default: no limit "
                                        "of its own; the per-address limits still apply)")
    class_options(c, "standard")
    sub.add_parser("list", help="every key: name, prefix, created, last used, revoked, rate limit, class, priority "
                                "(never the key)")
    st = sub.add_parser("set", help="change a key's default service class or its right to ask for priority")
    st.add_argument("name")
    st.add_argument("--class", dest="service_class", choices=CLASSES, help="its requests' class when they name no "
                                                                          "service_tier")
    st.add_argument("--priority", action=argparse.BooleanOptionalAction, default=None,
                    help="whether it may send service_tier \"priority\" (served as interactive)")
    sub.add_parser("revoke", help="refuse a key from now on (within a few seconds)").add_argument("name")
    sub.add_parser("delete", help="remove a key for good, freeing its name").add_argument("name")
    e = sub.add_parser("ensure", help="create the key NAME holding the value of an environment variable, unless it "
                                      "exists already (for deployments)")
    e.add_argument("name")
    e.add_argument("--from-env", required=True, metavar="VAR", help="the environment variable holding the key")
    e.add_argument("--rate-limit", help="as for create, when the key is created")
    class_options(e, "standard")
    return p


def class_options(p: argparse.ArgumentParser, default: str) -> None:
    p.add_argument("--class", dest="service_class", choices=CLASSES, default=default,
                   help=f"the class of its requests that name no service_tier (default: {default}): interactive is "
                        "served first, like the chat; bulk waits for the others")
    p.add_argument("--priority", action="store_true", help="allow it to send service_tier \"priority\" (served as "
                                                           "interactive); without it such a request gets 400")


def main(argv: Sequence[str] | None = None) -> int:
    from models.db import default_database_url, make_engine, make_session_factory

    args = parser().parse_args(argv)
    engine = make_engine(default_database_url())
    try:
        with make_session_factory(engine)() as db:
            print(run(args, db))
    except KeyCommandError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except SQLAlchemyError as exc:
        reason = str(getattr(exc, "orig", None) or exc).strip().splitlines()[0]
        print(f"error: the database at {engine.url.render_as_string()} cannot be used ({reason}). Is DATABASE_URL "
              "right, and is its schema up to date (alembic upgrade head; `make run` does it)?", file=sys.stderr)
        return 1
    finally:
        engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
