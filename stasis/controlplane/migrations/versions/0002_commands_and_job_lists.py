"""commands, and the jobs each node reports

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002"
down_revision = "0001"


def upgrade() -> None:
    with op.batch_alter_table("nodes") as batch:
        batch.add_column(sa.Column("job_list", sa.Text, nullable=False, server_default="[]"))
    op.create_table(
        "commands",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("cluster_id", sa.String(40), sa.ForeignKey("clusters.id"), nullable=False),
        sa.Column("node", sa.String(200), nullable=False),
        sa.Column("kind", sa.String(40), nullable=False),
        sa.Column("args", sa.Text, nullable=False),
        sa.Column("state", sa.String(20), nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False),
        sa.Column("lease_until", sa.Integer, nullable=True),
        sa.Column("result", sa.Text, nullable=True),
        sa.Column("created", sa.String(40), nullable=False),
        sa.Column("finished", sa.String(40), nullable=True),
    )
    op.create_index("commands_by_node", "commands", ["cluster_id", "node", "state"])


def downgrade() -> None:
    op.drop_index("commands_by_node", "commands")
    op.drop_table("commands")
    with op.batch_alter_table("nodes") as batch:
        batch.drop_column("job_list")
