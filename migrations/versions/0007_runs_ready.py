"""claiming reads the ready runs in index order: runs_ready()

A worker claims the oldest ready runs of its workflows, ``ORDER BY available_at LIMIT n``, and
``ix_runs_claimable`` holds exactly the ready runs in that order, so a claim should read about
``n`` index entries. The planner did not take that path: without fresh statistics (a table
that just received a burst of submissions, or any server with autovacuum off) it expects one
ready run and prefers a bitmap scan plus a sort; with statistics it expects the workflow filter
to drop most rows and prefers a sequential scan plus a sort. Either way every claim read and
sorted the whole backlog: with 3,000 runs queued, 3 to 5 ms for the selection instead of
0.15 ms, and more as the backlog grows.

``orchestrator.runs_ready(workflows, lim)`` is that selection (``FOR UPDATE SKIP LOCKED``
included) planned with ``enable_sort = off``: the only plan without a sort is the ordered scan
of ``ix_runs_claimable``, which the planner then takes whatever its statistics say (if that
index were missing it would still sort, at a penalty, never fail). ``ROWS 1`` keeps the claim
probing ``runs`` by primary key for the rows it returns, as ``batch_rows`` does for the writes.
When most ready runs belong to workflows the worker does not serve, the ordered read walks past
them to find its own: no more than the sort read, which read them all.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-30 07:00:00
"""

from __future__ import annotations

from alembic import op

revision = "0007"
down_revision = "0006"
branch_labels = None
depends_on = None

UPGRADE_SQL = """
CREATE FUNCTION orchestrator.runs_ready(workflows text[], lim integer) RETURNS SETOF uuid
LANGUAGE sql VOLATILE STRICT ROWS 1 SET enable_sort = off AS $$
    SELECT id FROM orchestrator.runs
    WHERE status IN ('queued', 'waiting') AND available_at IS NOT NULL
      AND available_at <= now()
      AND workflow_name || '@' || workflow_version = ANY(workflows)
    ORDER BY available_at
    LIMIT lim
    FOR UPDATE SKIP LOCKED
$$;
"""

DOWNGRADE_SQL = """
DROP FUNCTION orchestrator.runs_ready(text[], integer);
"""


def upgrade() -> None:
    op.execute(UPGRADE_SQL)


def downgrade() -> None:
    op.execute(DOWNGRADE_SQL)
