"""a hook token per policy (its SHA-256), for its webhook alone

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"


def upgrade() -> None:
    with op.batch_alter_table("policies") as batch:
        batch.add_column(sa.Column("hook_sha256", sa.String(64), nullable=True))
        batch.add_column(sa.Column("hook_created", sa.String(40), nullable=True))
        batch.create_unique_constraint("policies_hook_once", ["hook_sha256"])


def downgrade() -> None:
    with op.batch_alter_table("policies") as batch:
        batch.drop_constraint("policies_hook_once", type_="unique")
        batch.drop_column("hook_created")
        batch.drop_column("hook_sha256")
