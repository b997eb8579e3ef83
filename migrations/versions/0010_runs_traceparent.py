"""runs.traceparent: the W3C traceparent of the span that submitted the run

A run is often executed long after it was submitted, by another process, after a crash by a
third. Storing the submitter's ``traceparent`` (``00-<trace id>-<span id>-<flags>``, 55
characters; never baggage or tracestate) lets each execution's ``run`` span join that trace, as
a child of the submit span or linked to it (docs/tracing.md). NULL for runs submitted without a
current span and for runs submitted before this revision: those start traces of their own.

A nullable column without a default: adding it rewrites nothing and takes the table's lock for
a moment only.

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02 20:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0010"
down_revision = "0009"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column("runs", sa.Column("traceparent", sa.Text(), nullable=True),
                  schema="orchestrator")


def downgrade() -> None:
    op.drop_column("runs", "traceparent", schema="orchestrator")
