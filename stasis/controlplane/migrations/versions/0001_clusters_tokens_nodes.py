"""clusters, tokens, nodes

Revision ID: 0001
Revises:
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001"
down_revision = None


def upgrade() -> None:
    op.create_table(
        "clusters",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("name", sa.String(200), nullable=False, unique=True),
        sa.Column("kind", sa.String(20), nullable=False),
        sa.Column("created", sa.String(40), nullable=False),
    )
    op.create_table(
        "tokens",
        sa.Column("id", sa.String(40), primary_key=True),
        sa.Column("kind", sa.String(20), nullable=False),
        sa.Column("cluster_id", sa.String(40), sa.ForeignKey("clusters.id"), nullable=True),
        sa.Column("sha256", sa.String(64), nullable=False, unique=True),
        sa.Column("created", sa.String(40), nullable=False),
        sa.Column("revoked", sa.String(40), nullable=True),
    )
    op.create_table(
        "nodes",
        sa.Column("cluster_id", sa.String(40), sa.ForeignKey("clusters.id"), primary_key=True),
        sa.Column("name", sa.String(200), primary_key=True),
        sa.Column("host", sa.String(200), nullable=False),
        sa.Column("stasis_version", sa.String(60), nullable=False),
        sa.Column("criu_version", sa.String(60), nullable=True),
        sa.Column("slurm_version", sa.String(60), nullable=True),
        sa.Column("check_ok", sa.Boolean, nullable=False),
        sa.Column("problems", sa.Text, nullable=False),
        sa.Column("registered", sa.String(40), nullable=False),
        sa.Column("last_heartbeat", sa.Integer, nullable=False),
        sa.Column("jobs", sa.Integer, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("nodes")
    op.drop_table("tokens")
    op.drop_table("clusters")
