"""queue claim: a run that holds a slot of its queue is always among the candidates

``orchestrator.queue_claim`` (migration 0012) read its candidates as the ``scan`` longest
waiting ready runs of the queue (and, with priorities, the ``scan`` best). A run that had
started and went back to the queue (its worker died, or its lease lapsed) still holds its slot
and is claimed again whatever the limit, but it is ready again only from then, so it sorts
after every run submitted before that: with at least ``scan`` of those waiting and the queue's
slots all held by such runs, none of them was read, no fresh run could start, and the queue
stood still for ever (found by the chaos suite's limits profile: a queue of concurrency 3 with
its 3 holders re-queued behind 15 fresh runs, none claimed in 300 s).

The function now also reads, in a third branch, the ready runs that hold a slot (started, not
finished; in ``ix_runs_queue_held``), oldest first, whenever a limit could keep every fresh run
from starting (the slots all held, the rate window full, or per-key limits); holding their
slots already, they are admitted. Otherwise a fresh run starts, and the line moves on.

Revision ID: 0017
Revises: 0016
Create Date: 2026-12-04 09:30:00
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0017"
down_revision = "0016"
branch_labels = None
depends_on = None

PRIORITY_BRANCH = """
        (SELECT r.id FROM orchestrator.runs AS r
         WHERE cfg.priority AND r.queue = q AND r.status IN ('queued', 'waiting')
           AND r.available_at IS NOT NULL AND r.available_at <= now()
           AND r.workflow_name || '@' || r.workflow_version = ANY(workflows)
         ORDER BY r.priority, r.available_at LIMIT scan)
"""

HOLDERS_BRANCH = PRIORITY_BRANCH + """        UNION
        -- Runs that hold a slot (started, back in the queue after a lost worker): candidates
        -- whatever waits before them whenever a limit could keep every fresh run from
        -- starting (otherwise a fresh run starts and the line moves on).
        (SELECT r.id FROM orchestrator.runs AS r
         WHERE (gfree <= 0 OR rfree <= 0 OR cfg.key_concurrency IS NOT NULL)
           AND r.queue = q AND r.started_at IS NOT NULL AND r.finished_at IS NULL
           AND r.status IN ('queued', 'waiting')
           AND r.available_at IS NOT NULL AND r.available_at <= now()
           AND r.workflow_name || '@' || r.workflow_version = ANY(workflows)
         ORDER BY r.available_at LIMIT scan)
"""


def _claim_0012() -> str:
    """The function as migration 0012 created it (its text is that revision's, for ever)."""
    path = Path(__file__).with_name("0012_queues.py")
    spec = importlib.util.spec_from_file_location("orchestrator_migration_0012", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text: str = module.CLAIM_SQL
    assert text.count(PRIORITY_BRANCH) == 1, "migration 0012's queue_claim is not as expected"
    return text.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)


def upgrade() -> None:
    op.execute(_claim_0012().replace(PRIORITY_BRANCH, HOLDERS_BRANCH, 1))


def downgrade() -> None:
    op.execute(_claim_0012())
