"""joins approved by an admin, per cluster (clusters.approve_joins, nodes.approved)

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"


def upgrade() -> None:
    with op.batch_alter_table("clusters") as batch:
        batch.add_column(
            sa.Column("approve_joins", sa.Boolean, nullable=False, server_default=sa.false())
        )
    # The nodes joined so far stay as they were: approved.
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(
            sa.Column("approved", sa.Boolean, nullable=False, server_default=sa.true())
        )


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("approved")
    with op.batch_alter_table("clusters") as batch:
        batch.drop_column("approve_joins")
