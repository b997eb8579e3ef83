"""runs in creation order: ix_runs_created (created_at, id) for the console's pages of runs

The console lists runs newest first, ``ORDER BY created_at DESC, id DESC LIMIT n``, and a
following page starts strictly before the last row's ``(created_at, id)``. No index had that
order: ``ix_runs_owner_created`` starts with the tenant and the principal. So every page, the
first included, read every run that passed its filters and sorted them: with 1,000,000
finished runs, a parallel sequential scan and a top-N sort of the whole table, 0.4 to 1.6 s
per page (scoped to one tenant or filtered by status alike). Scanned backwards this index
yields the runs in page order, the cursor is its range condition, and a page reads about its
own rows and stops: under a millisecond, however deep. Filters are checked on the rows read,
so the same index serves the pages filtered by status, workflow or tenant: a value held by a
few runs costs more entries read (a status held by 0.1 % of the runs, 17,000 entries, 36 ms).
A submission key without its owner is found by reading the whole unique index
(tenant, principal, key), as before.

One index and not one per filter: every index on runs is written by every submission and by
every update that cannot be HOT (the claim, the end: they change indexed columns), the
engine's hot path. Its own columns never change, so it makes no update less HOT. Building it holds
writes to runs off for its duration (2.4 s for 1,000,000 runs here); a large installation
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
