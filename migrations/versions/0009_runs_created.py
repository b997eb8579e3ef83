"""runs in creation order: ix_runs_created (created_at, id) for the console's pages of runs

The console lists runs newest first, ``ORDER BY created_at DESC, id DESC LIMIT n``, and a
following page starts strictly before the last row's ``(created_at, id)``. No index had that
order: ``ix_runs_owner_created`` starts with the tenant and the principal. So every page,
the first included, read every run that passed its filters and sorted them: with 1,000,000
finished runs, a sequential scan and a top-N sort of the whole table, about a second per page
(scoped to one tenant, a bitmap scan of a quarter of the table and the same sort). Scanned
backwards this index yields the runs in page order, the cursor is its range condition, and
a page reads its rows and stops: about a millisecond, however deep. Filters that most runs
pass (a terminal status, a large workflow, a tenant) are checked on the rows read, so the
same index serves them; a rare value makes the planner read the other indexes (``running``:
``ix_runs_lease_expiry``; one tenant's few runs: ``ix_runs_owner_created``) and sort.

One index and not one per filter: every index on runs is written by every submission and
every write that moves a run out of or into the claimable set, the engine's hot path. Its
columns never change, so it never stops a write from being a HOT update. Building it holds
writes to runs off for its duration (a few seconds per million runs); a large installation
may create it first with ``CREATE INDEX CONCURRENTLY`` under the same name and definition.

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02 09:00:00
"""

from __future__ import annotations

from alembic import op

revision = "0009"
down_revision = "0008"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("CREATE INDEX IF NOT EXISTS ix_runs_created "
               "ON orchestrator.runs (created_at, id)")


def downgrade() -> None:
    op.drop_index("ix_runs_created", table_name="runs", schema="orchestrator")
