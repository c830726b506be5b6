"""The help centre's articles, with full-text search: an FTS5 index kept by triggers on SQLite, a generated
tsvector with a GIN index on PostgreSQL.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-27 12:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | Sequence[str] | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

COLUMNS = "title, summary, keywords, body"

SQLITE = [
    f"CREATE VIRTUAL TABLE help_articles_fts USING fts5({COLUMNS}, content='help_articles', content_rowid='id', "
    "tokenize='porter unicode61')",
    f"""CREATE TRIGGER help_articles_fts_insert AFTER INSERT ON help_articles BEGIN
        INSERT INTO help_articles_fts(rowid, {COLUMNS}) VALUES (new.id, new.title, new.summary, new.keywords, new.body);
    END""",
    f"""CREATE TRIGGER help_articles_fts_delete AFTER DELETE ON help_articles BEGIN
        INSERT INTO help_articles_fts(help_articles_fts, rowid, {COLUMNS})
        VALUES ('delete', old.id, old.title, old.summary, old.keywords, old.body);
    END""",
    f"""CREATE TRIGGER help_articles_fts_update AFTER UPDATE ON help_articles BEGIN
        INSERT INTO help_articles_fts(help_articles_fts, rowid, {COLUMNS})
        VALUES ('delete', old.id, old.title, old.summary, old.keywords, old.body);
        INSERT INTO help_articles_fts(rowid, {COLUMNS}) VALUES (new.id, new.title, new.summary, new.keywords, new.body);
    END""",
]

POSTGRESQL = [
    """ALTER TABLE help_articles ADD COLUMN search tsvector GENERATED ALWAYS AS (
        setweight(to_tsvector('english', title), 'A') || setweight(to_tsvector('english', keywords), 'A') ||
        setweight(to_tsvector('english', summary), 'B') || setweight(to_tsvector('english', body), 'C')) STORED""",
    "CREATE INDEX ix_help_articles_search ON help_articles USING gin (search)",
]


def upgrade() -> None:
    op.create_table(
        "help_articles",
        sa.Column("id", sa.Integer(), nullable=False),
        sa.Column("slug", sa.String(length=64), nullable=False),
        sa.Column("title", sa.String(length=200), nullable=False),
        sa.Column("summary", sa.String(length=500), nullable=False),
        sa.Column("body", sa.Text(), nullable=False),
        sa.Column("keywords", sa.String(length=500), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_help_articles")),
        sa.UniqueConstraint("slug", name=op.f("uq_help_articles_slug")),
    )
    dialect = op.get_bind().dialect.name
    for statement in SQLITE if dialect == "sqlite" else POSTGRESQL if dialect == "postgresql" else []:
        op.execute(statement)


def downgrade() -> None:
    if op.get_bind().dialect.name == "sqlite":
        for name in ("insert", "delete", "update"):
            op.execute(f"DROP TRIGGER IF EXISTS help_articles_fts_{name}")
        op.execute("DROP TABLE IF EXISTS help_articles_fts")
    op.drop_table("help_articles")
