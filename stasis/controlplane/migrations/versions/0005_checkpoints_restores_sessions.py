"""checkpoints and restores the nodes report, dashboard sessions

Revision ID: 0005
Revises: 0004
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0005"
down_revision = "0004"


def upgrade() -> None:
    op.create_table(
        "checkpoints",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("cluster_id", sa.String(40), nullable=False),
        sa.Column("node", sa.String(200), nullable=False),
        sa.Column("job", sa.String(100), nullable=False),
        sa.Column("label", sa.String(200), nullable=False),
        sa.Column("user", sa.String(100), nullable=False),
        sa.Column("size_bytes", sa.BigInteger, nullable=False),
        sa.Column("stored_size_bytes", sa.BigInteger, nullable=False),
        sa.Column("duration_s", sa.Float, nullable=False),
        sa.Column("frozen_s", sa.Float, nullable=False),
        sa.Column("work_s", sa.Float, nullable=False),
        sa.Column("leave_running", sa.Boolean, nullable=False),
        sa.Column("reason", sa.String(60), nullable=False),
        sa.Column("store", sa.String(500), nullable=False),
        sa.Column("created", sa.Float, nullable=False),
        sa.Column("deleted", sa.Float, nullable=True),
    )
    op.create_index("checkpoints_by_label", "checkpoints", ["cluster_id", "user", "label"])
    op.create_table(
        "restores",
        sa.Column("id", sa.Integer, primary_key=True, autoincrement=True),
        sa.Column("cluster_id", sa.String(40), nullable=False),
        sa.Column("node", sa.String(200), nullable=False),
        sa.Column("checkpoint", sa.String(64), nullable=False),
        sa.Column("job", sa.String(100), nullable=False),
        sa.Column("label", sa.String(200), nullable=False),
        sa.Column("user", sa.String(100), nullable=False),
        sa.Column("work_s", sa.Float, nullable=False),
        sa.Column("duration_s", sa.Float, nullable=False),
        sa.Column("reason", sa.String(60), nullable=False),
        sa.Column("at", sa.Float, nullable=False),
        sa.UniqueConstraint("cluster_id", "node", "job", "checkpoint", name="restores_once"),
    )
    op.create_table(
        "sessions",
        sa.Column("sha256", sa.String(64), primary_key=True),
        sa.Column("token_id", sa.String(40), nullable=False),
        sa.Column("csrf", sa.String(64), nullable=False),
        sa.Column("expires", sa.Integer, nullable=False),
    )


def downgrade() -> None:
    op.drop_table("sessions")
    op.drop_table("restores")
    op.drop_index("checkpoints_by_label", "checkpoints")
    op.drop_table("checkpoints")
