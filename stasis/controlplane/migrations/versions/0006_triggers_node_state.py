"""policy triggers (memory, drain), stop, retention of completed jobs; node memory, scheduler state, lost since

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0006"
down_revision = "0005"


def upgrade() -> None:
    with op.batch_alter_table("policies") as batch:
        batch.add_column(
            sa.Column("trigger", sa.String(20), nullable=False, server_default="every")
        )
        batch.add_column(sa.Column("threshold_pct", sa.Float, nullable=True))
        batch.add_column(sa.Column("stop", sa.Boolean, nullable=False, server_default=sa.false()))
        batch.add_column(
            sa.Column("completed", sa.Boolean, nullable=False, server_default=sa.false())
        )
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("mem_total_bytes", sa.BigInteger, nullable=True))
        batch.add_column(sa.Column("scheduler_state", sa.String(60), nullable=True))
        batch.add_column(sa.Column("lost_since", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("lost_since")
        batch.drop_column("scheduler_state")
        batch.drop_column("mem_total_bytes")
    with op.batch_alter_table("policies") as batch:
        batch.drop_column("completed")
        batch.drop_column("stop")
        batch.drop_column("threshold_pct")
        batch.drop_column("trigger")
