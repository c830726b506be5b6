"""Declarative base with stable constraint names and a UTC-only datetime column type."""

from __future__ import annotations

from datetime import UTC, datetime

from sqlalchemy import DateTime, Dialect, MetaData
from sqlalchemy.orm import DeclarativeBase
from sqlalchemy.types import TypeDecorator

# Named constraints let Alembic's SQLite batch mode (copy-and-move) find and alter them later.
NAMING_CONVENTION = {
    "ix": "ix_%(column_0_label)s",
    "uq": "uq_%(table_name)s_%(column_0_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}


def utcnow() -> datetime:
    """The current time, timezone-aware in UTC."""
    return datetime.now(UTC)


class UTCDateTime(TypeDecorator[datetime]):
    """`DateTime(timezone=True)` that only accepts aware datetimes and always returns them in UTC.

    PostgreSQL stores `timestamptz` and hands values back in the session's time zone; SQLite keeps
    no zone at all and returns naive values. Storing UTC and re-attaching it on load makes both
    backends give comparable, subtractable datetimes.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None or value.utcoffset() is None:
            # A naive value is ambiguous (local time? UTC?); refusing it catches the bug at the source.
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware value, e.g. datetime.now(UTC)")
        value = value.astimezone(UTC)
        if dialect.name == "sqlite":
            # SQLite's DATETIME text format has no offset; the stored value is implicitly UTC.
            return value.replace(tzinfo=None)
        return value

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            return value.replace(tzinfo=UTC)
        return value.astimezone(UTC)


class Base(DeclarativeBase):
    """Base class of every model; its metadata is what Alembic compares against."""

    metadata = MetaData(naming_convention=NAMING_CONVENTION)
    type_annotation_map = {datetime: UTCDateTime()}
