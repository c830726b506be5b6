"""Request records: the HTTP request's id (`x-request-id`, the client's own or one the web app made).

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-27 13:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | Sequence[str] | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Nullable with no default: an instant change on both backends; chat messages and older records have none.
    op.add_column("request_records", sa.Column("http_request_id", sa.String(length=128), nullable=True))


def downgrade() -> None:
    op.drop_column("request_records", "http_request_id")
