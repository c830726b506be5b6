"""API keys for /v1 (only their SHA-256 digests), the key's name on each request record, and per-key usage per
time slot for the dashboard; the records' update trigger also watches the new column.

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-25 09:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | Sequence[str] | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# As in 0002: a change to any of these changes a finished request's summaries.
FIGURE_COLUMNS = ("enqueued_at, admitted_at, first_token_at, finished_at, prompt_tokens, completion_tokens, "
                  "cached_tokens, finish_reason, batch_size")
SQLITE_MINUTE = "CAST(strftime('%s', substr({row}.finished_at, 1, 19)) AS INTEGER) / 60"
SQLITE_MARK = ("INSERT INTO dirty_minutes (minute, version) SELECT {minute}, 1 WHERE {row}.finished_at IS NOT NULL "
               "ON CONFLICT (minute) DO UPDATE SET version = version + 1;")


def update_trigger(dialect: str, columns: str) -> None:
    """Re-create 0002's update trigger on `columns`; its body (and PostgreSQL's function) stays the same."""
    if dialect == "sqlite":
        new, old = SQLITE_MINUTE.format(row="NEW"), SQLITE_MINUTE.format(row="OLD")
        op.execute("DROP TRIGGER IF EXISTS request_records_mark_updated")
        op.execute(f"""
            CREATE TRIGGER request_records_mark_updated AFTER UPDATE OF {columns} ON request_records
            WHEN NEW.finished_at IS NOT NULL OR OLD.finished_at IS NOT NULL
            BEGIN {SQLITE_MARK.format(minute=new, row="NEW")} {SQLITE_MARK.format(minute=old, row="OLD")} END""")
        return
    op.execute("DROP TRIGGER IF EXISTS request_records_mark_updated ON request_records")
    op.execute(f"CREATE TRIGGER request_records_mark_updated AFTER UPDATE OF {columns} ON request_records "
               "FOR EACH ROW WHEN (NEW.finished_at IS NOT NULL OR OLD.finished_at IS NOT NULL) "
               "EXECUTE FUNCTION request_records_mark_updated()")


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.create_table(
        "api_keys",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("name", sa.String(length=64), nullable=False),
        sa.Column("key_hash", sa.String(length=64), nullable=False),
        sa.Column("prefix", sa.String(length=16), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_used_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("revoked_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("rate_limit", sa.String(length=64), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_api_keys")),
        sa.UniqueConstraint("name", name=op.f("uq_api_keys_name")),
        sa.UniqueConstraint("key_hash", name=op.f("uq_api_keys_key_hash")),
    )
    op.create_table(
        "key_usage",
        sa.Column("level", sa.Integer(), nullable=False),
        sa.Column("start", sa.BigInteger(), nullable=False),
        sa.Column("api_key", sa.String(length=64), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("level", "start", "api_key", name=op.f("pk_key_usage")),
    )
    # Nullable with no default: an instant change on both backends, whatever the table holds. Records written
    # before carry no key, so no minute needs summarising again.
    op.add_column("request_records", sa.Column("api_key", sa.String(length=64), nullable=True))
    update_trigger(dialect, FIGURE_COLUMNS + ", api_key")


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    # The trigger first: SQLite refuses to drop a column a trigger names.
    update_trigger(dialect, FIGURE_COLUMNS)
    # SQLite 3.35+ drops a column in place; a batch copy of the table would lose 0002's triggers.
    op.drop_column("request_records", "api_key")
    op.drop_table("key_usage")
    op.drop_table("api_keys")
