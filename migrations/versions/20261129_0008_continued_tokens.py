"""Request records: how many of an answer's tokens an earlier delivery wrote (an answer handed back mid-stream).

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-29 16:30:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | Sequence[str] | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable with no default: an instant change on both backends; older records have none.
    op.add_column("request_records", sa.Column("continued_tokens", sa.Integer(), nullable=True))


def downgrade() -> None:
    op.drop_column("request_records", "continued_tokens")
