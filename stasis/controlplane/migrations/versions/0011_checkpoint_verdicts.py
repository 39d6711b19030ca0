"""the verdict of `stasis verify` kept with each checkpoint (checkpoints.verified_*)

Revision ID: 0011
Revises: 0010
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0011"
down_revision = "0010"


def upgrade() -> None:
    # The checkpoints reported so far stay as they were: not verified (all None).
    with op.batch_alter_table("checkpoints") as batch:
        batch.add_column(sa.Column("verified_ok", sa.Boolean, nullable=True))
        batch.add_column(sa.Column("verify_reason", sa.Text, nullable=True))
        batch.add_column(sa.Column("verified_by", sa.String(200), nullable=True))
        batch.add_column(sa.Column("verified_at", sa.Float, nullable=True))
        batch.add_column(sa.Column("verify_duration_s", sa.Float, nullable=True))
        batch.add_column(sa.Column("verify_processes", sa.Integer, nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("checkpoints") as batch:
        for column in (
            "verify_processes",
            "verify_duration_s",
            "verified_at",
            "verified_by",
            "verify_reason",
            "verified_ok",
        ):
            batch.drop_column(column)
