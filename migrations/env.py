"""Alembic environment: migrates the database of `models.db` to the schema of `models`."""

from __future__ import annotations

from logging.config import fileConfig
from typing import Any

from alembic import context
from alembic.autogenerate.api import AutogenContext
from sqlalchemy import Connection, make_url, text

from models import Base, UTCDateTime, help_articles
from models.db import default_database_url, make_engine

config = context.config

# `models.db.upgrade()` runs inside an application whose logging must stay as it is.
if config.config_file_name is not None and config.attributes.get("configure_logger", True):
    fileConfig(config.config_file_name, disable_existing_loggers=False)

target_metadata = Base.metadata

# Any fixed 64-bit key: concurrent upgrades of one PostgreSQL database wait on it in turn.
PG_MIGRATION_LOCK_KEY = 0x5350_4254_4D49_4752


def database_url() -> str:
    return config.get_main_option("sqlalchemy.url") or default_database_url()


def render_item(type_: str, obj: Any, autogen_context: AutogenContext) -> str | bool:
    # Revisions must not import `models`: a later edit of the models would rewrite old migrations.
    if type_ == "type" and isinstance(obj, UTCDateTime):
        return "sa.DateTime(timezone=True)"
    return False


def configure_options(dialect_name: str) -> dict[str, Any]:
    return {
        "target_metadata": target_metadata,
        "render_item": render_item,
        # SQLite cannot ALTER most things; batch mode rebuilds the table instead.
        "render_as_batch": dialect_name == "sqlite",
        "compare_type": True,
        # The help centre's full-text search objects are the migration's own, not the models'.
        "include_object": help_articles.modelled,
    }


def run_migrations_offline() -> None:
    """Emit SQL to stdout (`alembic upgrade head --sql`) without a connection."""
    url = database_url()
    context.configure(
        url=url,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
        **configure_options(make_url(url).get_backend_name()),
    )
    with context.begin_transaction():
        context.run_migrations()


def run_with_connection(connection: Connection) -> None:
    context.configure(connection=connection, **configure_options(connection.dialect.name))
    with context.begin_transaction():
        if connection.dialect.name == "postgresql":
            # Held until this transaction ends; the waiting process then sees the new revision.
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": PG_MIGRATION_LOCK_KEY})
        context.run_migrations()


def run_migrations_online() -> None:
    # A caller may lend its own connection (config.attributes["connection"]), e.g. in tests.
    connection = config.attributes.get("connection")
    if connection is not None:
        run_with_connection(connection)
        return
    engine = make_engine(database_url())
    try:
        with engine.connect() as connection:
            run_with_connection(connection)
    finally:
        engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()
