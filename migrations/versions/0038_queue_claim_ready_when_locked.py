"""queue claim: the runs ready are those ready once the claim holds its queue

``orchestrator.queue_claim`` locks the queue's row (``FOR UPDATE``) and reads the queue's
pause and limits, and every count, after the claim before it committed; but it judged which
runs were ready (``available_at <= now()``) and how far a waiting run had aged in a priority
queue by ``now()``: the time its statement began. A claim that waited for the row (held by an
operator's change, such as a resume, or by another worker's claim) started what was ready
before it waited: a run submitted meanwhile, committed and ready by the time the claim read
the queue, was passed over for one of lower priority (or of a later turn). So a queue resumed
while a worker's claim waited for it started a priority 1 run before the priority 0 run
submitted while it was paused.

Readiness and aging are now judged at the instant the claim holds the row (the time it already
took then for the rate window): every run ready then that its statement sees is ranked. The
check before the lock, which only spares a claim with nothing to do its lock, is unchanged (a
run made ready after it notifies its queue), and so is the rest: the leases, the pause, the
limits, the result. Replaced in place: the function keeps its privileges.

Revision ID: 0038
Revises: 0037
Create Date: 2026-12-07 17:30:00
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0038"
down_revision = "0037"
branch_labels = None
depends_on = None

# Each part of migration 0032's function, what it becomes, and how often it occurs there.
PARTS = (
    ("""           AND r.available_at <= now()
           AND r.workflow_name""",
     """           AND r.available_at <= at
           AND r.workflow_name""", 1),
    ("AND r.available_at IS NOT NULL AND r.available_at <= now()",
     "AND r.available_at IS NOT NULL AND r.available_at <= at", 2),
    ("floor(extract(epoch FROM now() - r.available_at)",
     "floor(extract(epoch FROM at - r.available_at)", 1),
    ("              AND o.available_at <= now()",
     "              AND o.available_at <= at", 1),
)


def _claim_0032() -> str:
    """The claim function as migration 0032 left it (its text is that revision's, for ever)."""
    path = Path(__file__).with_name("0032_runs_due_at.py")
    spec = importlib.util.spec_from_file_location("orchestrator_migration_0032", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text: str = module._claim()
    for old, _, count in PARTS:
        assert text.count(old) == count, "migration 0032's queue_claim is not as expected"
    return text


def _claim() -> str:
    text = _claim_0032()
    for old, new, _ in PARTS:
        text = text.replace(old, new)
    assert "available_at <= now()" in text  # the check before the lock, alone
    assert text.count("available_at <= now()") == 1
    return text


def upgrade() -> None:
    op.execute(_claim())


def downgrade() -> None:
    op.execute(_claim_0032())
