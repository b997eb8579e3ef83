"""worker liveness lock: workers.lock_key, the advisory lock a live worker holds

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-29 17:50:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003"
down_revision = "0002"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("lock_key", sa.BigInteger(), nullable=True),
                  schema="orchestrator")


def downgrade() -> None:
    op.drop_column("workers", "lock_key", schema="orchestrator")
