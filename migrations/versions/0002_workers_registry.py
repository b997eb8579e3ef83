"""workers registry: live workers and the workflow versions they run (for `runs show`)

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-29 17:26:06.455224
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0002"
down_revision = "0001"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "workers",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("hostname", sa.Text(), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("workflows", postgresql.ARRAY(sa.Text()), nullable=False),
        sa.Column("concurrency", sa.Integer(), nullable=False),
        sa.Column(
            "started_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "heartbeat_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_workers")),
        schema="orchestrator",
    )
    op.create_index(
        "ix_workers_heartbeat", "workers", ["heartbeat_at"], unique=False, schema="orchestrator"
    )


def downgrade() -> None:
    op.drop_index("ix_workers_heartbeat", table_name="workers", schema="orchestrator")
    op.drop_table("workers", schema="orchestrator")
