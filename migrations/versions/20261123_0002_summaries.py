"""Dashboard summaries: latency histograms, traffic counts and slowest requests per time slot; the minutes
still to summarise, kept by triggers on request_records whatever writes them; job leases.

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-23 20:40:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | Sequence[str] | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

# A change to any of these changes a finished request's figures.
FIGURE_COLUMNS = ("enqueued_at, admitted_at, first_token_at, finished_at, prompt_tokens, completion_tokens, "
                  "cached_tokens, finish_reason, batch_size")

# Whole seconds from the text without its fraction: strftime would round 59.9996 up into the next minute.
SQLITE_MINUTE = "CAST(strftime('%s', substr({row}.finished_at, 1, 19)) AS INTEGER) / 60"
SQLITE_MARK = ("INSERT INTO dirty_minutes (minute, version) SELECT {minute}, 1 WHERE {row}.finished_at IS NOT NULL "
               "ON CONFLICT (minute) DO UPDATE SET version = version + 1;")

PG_MINUTE = "CAST(floor(extract(epoch FROM {row}.finished_at) / 60) AS BIGINT)"
PG_FUNCTIONS = f"""
CREATE FUNCTION request_records_mark_inserted() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO dirty_minutes (minute, version)
    SELECT DISTINCT {PG_MINUTE.format(row="new_rows")}, 1 FROM new_rows WHERE new_rows.finished_at IS NOT NULL
    ORDER BY 1
    ON CONFLICT (minute) DO UPDATE SET version = dirty_minutes.version + 1;
    RETURN NULL;
END $$;
CREATE FUNCTION request_records_mark_updated() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    IF NEW.finished_at IS NOT NULL THEN
        INSERT INTO dirty_minutes (minute, version) VALUES ({PG_MINUTE.format(row="NEW")}, 1)
        ON CONFLICT (minute) DO UPDATE SET version = dirty_minutes.version + 1;
    END IF;
    IF OLD.finished_at IS NOT NULL AND (NEW.finished_at IS NULL
            OR {PG_MINUTE.format(row="OLD")} <> {PG_MINUTE.format(row="NEW")}) THEN
        INSERT INTO dirty_minutes (minute, version) VALUES ({PG_MINUTE.format(row="OLD")}, 1)
        ON CONFLICT (minute) DO UPDATE SET version = dirty_minutes.version + 1;
    END IF;
    RETURN NULL;
END $$;
"""


def create_triggers(dialect: str) -> None:
    if dialect == "sqlite":
        new, old = SQLITE_MINUTE.format(row="NEW"), SQLITE_MINUTE.format(row="OLD")
        op.execute(f"""
            CREATE TRIGGER request_records_mark_inserted AFTER INSERT ON request_records
            WHEN NEW.finished_at IS NOT NULL
            BEGIN {SQLITE_MARK.format(minute=new, row="NEW")} END""")
        op.execute(f"""
            CREATE TRIGGER request_records_mark_updated AFTER UPDATE OF {FIGURE_COLUMNS} ON request_records
            WHEN NEW.finished_at IS NOT NULL OR OLD.finished_at IS NOT NULL
            BEGIN {SQLITE_MARK.format(minute=new, row="NEW")} {SQLITE_MARK.format(minute=old, row="OLD")} END""")
        return
    op.execute(PG_FUNCTIONS)
    # One statement's rows at once, so a bulk load (a restore, an import) marks each minute once.
    op.execute("CREATE TRIGGER request_records_mark_inserted AFTER INSERT ON request_records "
               "REFERENCING NEW TABLE AS new_rows FOR EACH STATEMENT EXECUTE FUNCTION request_records_mark_inserted()")
    op.execute(f"CREATE TRIGGER request_records_mark_updated AFTER UPDATE OF {FIGURE_COLUMNS} ON request_records "
               "FOR EACH ROW WHEN (NEW.finished_at IS NOT NULL OR OLD.finished_at IS NOT NULL) "
               "EXECUTE FUNCTION request_records_mark_updated()")


def upgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.create_table(
        "latency_histograms",
        sa.Column("level", sa.Integer(), nullable=False),
        sa.Column("start", sa.BigInteger(), nullable=False),
        sa.Column("metric", sa.String(length=16), nullable=False),
        sa.Column("count", sa.BigInteger(), nullable=False),
        sa.Column("counts", sa.Text(), nullable=False),
        sa.PrimaryKeyConstraint("level", "start", "metric", name=op.f("pk_latency_histograms")),
    )
    op.create_table(
        "traffic_summaries",
        sa.Column("level", sa.Integer(), nullable=False),
        sa.Column("start", sa.BigInteger(), nullable=False),
        sa.Column("requests", sa.BigInteger(), nullable=False),
        sa.Column("finish_reasons", sa.Text(), nullable=False),
        sa.Column("prompt_tokens", sa.BigInteger(), nullable=False),
        sa.Column("completion_tokens", sa.BigInteger(), nullable=False),
        sa.Column("cached_tokens", sa.BigInteger(), nullable=False),
        sa.Column("batch_size_sum", sa.Float(), nullable=False),
        sa.Column("batch_size_count", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("level", "start", name=op.f("pk_traffic_summaries")),
    )
    op.create_table(
        "slow_requests",
        sa.Column("minute", sa.BigInteger(), nullable=False),
        sa.Column("request_id", sa.String(length=64), nullable=False),
        sa.Column("e2e", sa.Float(), nullable=False),
        sa.PrimaryKeyConstraint("minute", "request_id", name=op.f("pk_slow_requests")),
    )
    op.create_table(
        "dirty_minutes",
        sa.Column("minute", sa.BigInteger(), nullable=False),
        sa.Column("version", sa.BigInteger(), nullable=False),
        sa.PrimaryKeyConstraint("minute", name=op.f("pk_dirty_minutes")),
    )
    op.create_table(
        "job_state",
        sa.Column("name", sa.String(length=32), nullable=False),
        sa.Column("holder", sa.String(length=200), nullable=True),
        sa.Column("lease_until", sa.Float(), nullable=True),
        sa.Column("ran_at", sa.Float(), nullable=True),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_job_state")),
    )
    op.create_index("ix_request_records_finish_reason_finished_at", "request_records",
                    ["finish_reason", "finished_at"])
    create_triggers(dialect)
    # Records written before this revision: every minute they finished in is summarised by the next roll-up.
    minute = (SQLITE_MINUTE if dialect == "sqlite" else PG_MINUTE).format(row="request_records")
    op.execute(f"INSERT INTO dirty_minutes (minute, version) SELECT DISTINCT {minute}, 1 FROM request_records "
               "WHERE request_records.finished_at IS NOT NULL")


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.execute("DROP TRIGGER IF EXISTS request_records_mark_inserted" + ("" if dialect == "sqlite" else
                                                                         " ON request_records"))
    op.execute("DROP TRIGGER IF EXISTS request_records_mark_updated" + ("" if dialect == "sqlite" else
                                                                        " ON request_records"))
    if dialect != "sqlite":
        op.execute("DROP FUNCTION IF EXISTS request_records_mark_inserted()")
        op.execute("DROP FUNCTION IF EXISTS request_records_mark_updated()")
    op.drop_index("ix_request_records_finish_reason_finished_at", table_name="request_records")
    op.drop_table("job_state")
    op.drop_table("dirty_minutes")
    op.drop_table("slow_requests")
    op.drop_table("traffic_summaries")
    op.drop_table("latency_histograms")
