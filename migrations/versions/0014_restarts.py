"""restarts: a run restarted without repeating its effects, linked both ways

``runs.restarted_from``: the run this one restarts (``orchestrator runs restart``,
``handle.restart``); ``runs.superseded_by``: the run that restarted this one, the
authoritative one. A run is restarted at most once (the second restart names the first's run).

Revision ID: 0014
Revises: 0013
Create Date: 2026-12-04 01:45:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import UUID

revision = "0014"
down_revision = "0013"
branch_labels = None
depends_on = None

S = "orchestrator"


def upgrade() -> None:
    op.add_column("runs", sa.Column("restarted_from", UUID(as_uuid=True), nullable=True),
                  schema=S)
    op.add_column("runs", sa.Column("superseded_by", UUID(as_uuid=True), nullable=True),
                  schema=S)


def downgrade() -> None:
    op.drop_column("runs", "superseded_by", schema=S)
    op.drop_column("runs", "restarted_from", schema=S)
