"""Engine, sessions and schema upgrades for the web app and the worker, with or without Flask."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import URL, Engine, create_engine, event, make_url
from sqlalchemy.orm import Session, sessionmaker

from models.sqlite import connection_class

REPO_ROOT = Path(__file__).resolve().parent.parent
ALEMBIC_INI = REPO_ROOT / "alembic.ini"

# Seconds a SQLite writer waits for the other process's write lock before failing.
SQLITE_BUSY_TIMEOUT_S = 30


def normalize_url(url: str | URL) -> URL:
    """Parse a database URL; bare `postgres://` / `postgresql://` get the installed psycopg 3 driver."""
    url = make_url(url)
    if url.drivername in ("postgres", "postgresql"):
        url = url.set(drivername="postgresql+psycopg")
    return url


def default_database_url() -> str:
    """`DATABASE_URL` from the environment, else a SQLite file under `<repo>/instance/`."""
    env = os.environ.get("DATABASE_URL")
    if env:
        return normalize_url(env).render_as_string(hide_password=False)
    instance = REPO_ROOT / "instance"
    instance.mkdir(parents=True, exist_ok=True)
    return f"sqlite:///{instance / 'supportbot.db'}"


def _on_sqlite_connect(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    try:
        # WAL lets the web processes read while the worker writes; the busy timeout makes
        # concurrent writers queue up instead of failing with "database is locked" (a cooperative
        # connection waits by itself instead: models/sqlite.py).
        cursor.execute("PRAGMA journal_mode=WAL")
        busy_ms = 0 if getattr(dbapi_connection, "cooperative", False) else SQLITE_BUSY_TIMEOUT_S * 1000
        cursor.execute(f"PRAGMA busy_timeout={busy_ms}")
        cursor.execute("PRAGMA synchronous=NORMAL")
        # SQLite ignores ON DELETE CASCADE / SET NULL unless asked per connection.
        cursor.execute("PRAGMA foreign_keys=ON")
    finally:
        cursor.close()


def make_engine(url: str | URL | None = None, **kwargs: Any) -> Engine:
    """An engine for `url` (default: `default_database_url()`), tuned for several processes sharing it."""
    url = normalize_url(url if url is not None else default_database_url())
    if url.get_backend_name() == "sqlite":
        connect_args = dict(kwargs.pop("connect_args", None) or {})
        # Sessions may be used from request threads other than the one that opened the connection.
        connect_args.setdefault("check_same_thread", False)
        connect_args.setdefault("timeout", SQLITE_BUSY_TIMEOUT_S)
        # Threads of one process queue for the write lock instead of polling SQLite for it (models/sqlite.py).
        connect_args.setdefault("factory", connection_class())
        engine = create_engine(url, connect_args=connect_args, **kwargs)
        event.listen(engine, "connect", _on_sqlite_connect)
        return engine
    # Connections dropped by the server (restarts, idle timeouts) are replaced instead of failing a request.
    kwargs.setdefault("pool_pre_ping", True)
    return create_engine(url, **kwargs)


def make_session_factory(engine: Engine) -> sessionmaker[Session]:
    """Sessions bound to `engine`; objects stay readable after commit (no reload per attribute)."""
    return sessionmaker(engine, expire_on_commit=False)


@contextmanager
def _sqlite_upgrade_lock(url: URL) -> Iterator[None]:
    """Serialise upgrades of one SQLite file across processes (PostgreSQL locks in env.py)."""
    database = url.database
    if url.get_backend_name() != "sqlite" or not database or database == ":memory:" or database.startswith("file:"):
        yield
        return
    lock_path = Path(database).with_name(Path(database).name + ".migrate-lock")
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    with open(lock_path, "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


def alembic_config(url: str | URL | None = None) -> Config:
    """The repo's Alembic config aimed at `url`, usable from any working directory."""
    url = normalize_url(url if url is not None else default_database_url())
    config = Config(str(ALEMBIC_INI))
    # ConfigParser treats '%' as interpolation; URL-encoded passwords contain it.
    config.set_main_option("sqlalchemy.url", url.render_as_string(hide_password=False).replace("%", "%%"))
    # Called from inside an application: keep its logging setup rather than alembic.ini's.
    config.attributes["configure_logger"] = False
    return config


def upgrade(url: str | URL | None = None, revision: str = "head") -> None:
    """Bring the schema at `url` (default: `default_database_url()`) up to `revision`."""
    url = normalize_url(url if url is not None else default_database_url())
    with _sqlite_upgrade_lock(url):
        command.upgrade(alembic_config(url), revision)
