"""workers: whether the worker takes a liveness lock (``lock_wanted``)

A worker whose ``listen_url`` cannot be reached starts, heartbeats and claims nothing until it
holds its liveness lock; its row had no ``lock_key`` then, as the row of a worker behind a
transaction pooler without a ``listen_url`` (which takes no lock by design, and claims), so
``workers list`` and the console showed both ``live``. With this column the first is
``waiting``. Old rows (and workers of an older release) say false: ``live`` as before.

Revision ID: 0034
Revises: 0033
Create Date: 2026-12-07 01:45:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0034"
down_revision = "0033"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("workers", sa.Column("lock_wanted", sa.Boolean(), nullable=False,
                                       server_default=sa.text("false")),
                  schema="orchestrator")


def downgrade() -> None:
    op.drop_column("workers", "lock_wanted", schema="orchestrator")
