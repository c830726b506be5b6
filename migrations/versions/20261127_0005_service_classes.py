"""Service classes: each API key's default class and its right to ask for priority, and each request record's
class.

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27 12:00:00
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0005"
down_revision: str | Sequence[str] | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    # Defaults held by the database: existing keys become standard, without the right to ask for priority, as they
    # were served until now.
    op.add_column("api_keys", sa.Column("service_class", sa.String(length=16), nullable=False,
                                        server_default="standard"))
    op.add_column("api_keys", sa.Column("priority_allowed", sa.Boolean(), nullable=False,
                                        server_default=sa.false()))
    # Nullable with no default: an instant change on both backends; records written before carry no class.
    op.add_column("request_records", sa.Column("service_class", sa.String(length=16), nullable=True))


def downgrade() -> None:
    op.drop_column("request_records", "service_class")
    op.drop_column("api_keys", "priority_allowed")
    op.drop_column("api_keys", "service_class")
