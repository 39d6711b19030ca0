"""policies checkpointing at each job's own Young/Daly interval (policies.every_auto)

Revision ID: 0012
Revises: 0011
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0012"
down_revision = "0011"


def upgrade() -> None:
    with op.batch_alter_table("policies") as batch:
        batch.add_column(
            sa.Column("every_auto", sa.Boolean, nullable=False, server_default=sa.false())
        )


def downgrade() -> None:
    with op.batch_alter_table("policies") as batch:
        batch.drop_column("every_auto")
