"""a credential per node (bound to its cluster and name) and a lease id per command

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0009"
down_revision = "0008"


def upgrade() -> None:
    op.create_table(
        "node_credentials",
        sa.Column("cluster_id", sa.String(40), sa.ForeignKey("clusters.id"), primary_key=True),
        sa.Column("node", sa.String(200), primary_key=True),
        sa.Column("sha256", sa.String(64), nullable=False, unique=True),
        sa.Column("created", sa.String(40), nullable=False),
    )
    with op.batch_alter_table("commands") as batch:
        batch.add_column(sa.Column("lease_id", sa.String(40), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("commands") as batch:
        batch.drop_column("lease_id")
    op.drop_table("node_credentials")
