"""runs_ready keeps its plan: PL/pgSQL instead of SQL

``orchestrator.runs_ready`` (the default queue's claim selection, migration 0007) was a SQL
function with a ``SET`` clause, which PostgreSQL neither inlines nor keeps a plan of: every
claim planned its query again, ~130 µs of the server's time per claim against a table with
the runs table's fourteen indexes (pg_stat_statements with ``track_planning``: 1,924 plans for
1,924 calls under a stream of 300 runs/s), on the way to every run's first step. The same
query in PL/pgSQL is planned once per session and its plan kept (``enable_sort = off`` still
holds while it is planned, so the plan is still the ordered scan of ``ix_runs_claimable``).
Nothing else changes: the same rows, the same order, the same locks, one snapshot per call.

Revision ID: 0021
Revises: 0020
Create Date: 2026-12-05 09:30:00
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0021"
down_revision = "0020"
branch_labels = None
depends_on = None

RUNS_READY = """
CREATE OR REPLACE FUNCTION orchestrator.runs_ready(workflows text[], lim integer)
RETURNS SETOF uuid
LANGUAGE plpgsql VOLATILE STRICT ROWS 1 SET enable_sort = off AS $$
BEGIN
    RETURN QUERY
    SELECT id FROM orchestrator.runs
    WHERE status IN ('queued', 'waiting') AND available_at IS NOT NULL AND queue IS NULL
      AND available_at <= now()
      AND workflow_name || '@' || workflow_version = ANY(workflows)
    ORDER BY available_at
    LIMIT lim
    FOR UPDATE SKIP LOCKED;
END
$$;
"""


def _runs_ready_0012() -> str:
    """The function as migration 0012 left it (its text is that revision's, for ever)."""
    path = Path(__file__).with_name("0012_queues.py")
    spec = importlib.util.spec_from_file_location("orchestrator_migration_0012", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return str(module.RUNS_READY_SQL)


def upgrade() -> None:
    op.execute(RUNS_READY)


def downgrade() -> None:
    op.execute(_runs_ready_0012())
