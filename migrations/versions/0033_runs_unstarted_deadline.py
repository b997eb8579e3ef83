"""runs: an index of the runs that have not started yet and carry a deadline

A run held back by its queue (paused, its concurrency or its key's full, its rate window) or
by the lack of a worker that serves it stayed ``queued`` past its deadline, and failed
``DEADLINE_EXCEEDED`` only once a claim admitted it: its owner's ``result()`` waited on after
the deadline, and the run took a slot of its queue (a start of its rate window) only to fail.
Every worker's sweep now ends such a run when its deadline passes; this partial index is what
it reads, so that a queue's backlog costs the sweep nothing. Its predicate leaves ``revision``
out (the sweep reads it from the row): a column named by any index of ``runs`` would make every
step's fence, which moves ``revision``, update every index of the table instead of the row in
place (a HOT update; tests/integration/test_hot_fence.py).

Revision ID: 0033
Revises: 0032
Create Date: 2026-12-06 21:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0033"
down_revision = "0032"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_index(
        "ix_runs_unstarted_deadline",
        "runs",
        ["deadline_at"],
        schema="orchestrator",
        postgresql_where=sa.text("status = 'queued' AND deadline_at IS NOT NULL"),
    )


def downgrade() -> None:
    op.drop_index("ix_runs_unstarted_deadline", "runs", schema="orchestrator")
