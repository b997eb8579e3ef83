"""worker draining: workers.draining_since, when a worker began to drain

A worker told to stop claims nothing more, but went on heartbeating until its runs in flight
reached a durable point: ``workers list`` and the console showed it ``live``. It now writes
when its drain began into its own row, and is shown ``draining`` from then on. Null for a
worker that is not draining (every row this migration finds).

Revision ID: 0031
Revises: 0030
Create Date: 2026-12-06 12:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0031"
down_revision = "0030"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workers",
                  sa.Column("draining_since", sa.DateTime(timezone=True), nullable=True),
                  schema="orchestrator")


def downgrade() -> None:
    op.drop_column("workers", "draining_since", schema="orchestrator")
