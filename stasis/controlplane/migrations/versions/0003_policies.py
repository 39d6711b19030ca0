"""policies

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"


def upgrade() -> None:
    op.create_table(
        "policies",
        sa.Column("name", sa.String(100), primary_key=True),
        sa.Column("every_s", sa.Integer, nullable=False),
        sa.Column("action", sa.String(40), nullable=False),
        sa.Column("filters", sa.Text, nullable=False),
        sa.Column("keep", sa.Integer, nullable=True),
        sa.Column("enabled", sa.Boolean, nullable=False),
        sa.Column("last_run", sa.Integer, nullable=False),
        sa.Column("created", sa.String(40), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("policies")
