"""A queue's claim returns at once, without its lock, when none of its runs is ready

Workers claim from a queue whenever there may be news of it, and news of "any run" (a run
submitted outside every queue, a run released or resolved) may concern every queue. Each
such claim took the queue's row lock (``FOR UPDATE``, which serialises the claims of a queue
across workers) before finding out that no run of the queue was ready: with a few queues
declared and most runs outside them, a stream of submissions cost every worker a locked
claim per queue per submission, the workers waiting on each other's locks.

``orchestrator.queue_claim`` now first looks for one ready run of the queue that the worker
serves (through ``ix_runs_queue_ready``, no lock), and returns nothing when there is none.
This decides nothing the locked path would decide otherwise: with no run ready at that
snapshot, the locked path admits nothing either, and a run that becomes ready after the
snapshot is committed with a notification of its queue, after which the workers claim
again. A rate-limited queue's ``wake_at`` is still returned when runs are ready and its
window is full (with no run ready there is nothing to wake for).

Revision ID: 0020
Revises: 0019
Create Date: 2026-12-05 09:00:00
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0020"
down_revision = "0019"
branch_labels = None
depends_on = None

OPENING = """    IF lim < 1 THEN
        RETURN;
    END IF;
"""

READY_FIRST = """    IF lim < 1 THEN
        RETURN;
    END IF;
    -- Nothing of this queue is ready for this worker: nothing to admit, and no lock to take
    -- (the claims of a queue with no news are the common case when most runs are outside
    -- every queue). A run made ready after this snapshot notifies its queue when it commits.
    IF NOT EXISTS (
        SELECT 1 FROM orchestrator.runs AS r
        WHERE r.queue = q AND r.status IN ('queued', 'waiting') AND r.available_at IS NOT NULL
          AND r.available_at <= now()
          AND r.workflow_name || '@' || r.workflow_version = ANY(workflows)) THEN
        RETURN;
    END IF;
"""


def _claim_0018() -> str:
    """The claim function as migration 0018 left it (its text is that revision's, for ever)."""
    path = Path(__file__).with_name("0018_runs_waiting_tool.py")
    spec = importlib.util.spec_from_file_location("orchestrator_migration_0018", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text: str = module._claim_0017().replace(module.CLEARED_0017, module.CLEARED, 1)
    assert text.count(OPENING) == 1, "migration 0018's queue_claim is not as expected"
    return text


def upgrade() -> None:
    op.execute(_claim_0018().replace(OPENING, READY_FIRST, 1))


def downgrade() -> None:
    op.execute(_claim_0018())
