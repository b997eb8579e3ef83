"""runs.waiting_tool: the tool whose turn a parked run waits for, as a column of its own

A run whose call waits for its tool's turn (docs/flow.md: the tool's concurrency is full, its
rate window or a provider's back-off has no room) parks; when a call of the tool ends, the
worker wakes the runs that waited longest for that tool. Until now the tool was known only
from the prose in ``waiting_for`` (``the turn of tool pay``), matched with ``LIKE``, so a call
of ``pay`` ending also woke the runs waiting for ``payout`` (they asked again, found no room,
and parked again). ``waiting_tool`` holds the tool's exact name while the run is parked for
its turn (NULL otherwise; ``waiting_for`` still says it in words, for people), and the wake
matches it with ``=``. ``ix_runs_turn_waiters`` is rebuilt on it: the waiting runs of one tool,
longest waiting first.

The upgrade fills ``waiting_tool`` for the runs already parked for a turn from their
``waiting_for`` (the first tool it names, as the engine now records it), so that they are still
woken when a call of that tool ends. A row the pattern reads wrongly (an event name written to
look like a tool's turn) is at worst woken early: a woken run asks for admission again.

``orchestrator.queue_claim`` clears the column with ``waiting_for`` when it claims a run.

Revision ID: 0018
Revises: 0017
Create Date: 2026-12-04 18:00:00
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op

revision = "0018"
down_revision = "0017"
branch_labels = None
depends_on = None

S = "orchestrator"

TURN_WAITERS_0012 = "status = 'waiting' AND waiting_for LIKE '%the turn of tool %'"
TURN_WAITERS = "status = 'waiting' AND waiting_tool IS NOT NULL"

# A tool's name (orchestrator.registry.check_name) in one of the parts of waiting_for, which
# the engine joins with ", ".
BACKFILL = r"""
UPDATE orchestrator.runs
SET waiting_tool = substring(waiting_for
                             FROM '(?:^|, )the turn of tool ([A-Za-z0-9_][A-Za-z0-9_.-]*)(?:,|$)')
WHERE status = 'waiting' AND waiting_for LIKE '%the turn of tool %'
"""

CLEARED_0017 = "waiting_for = NULL,"
CLEARED = "waiting_for = NULL, waiting_tool = NULL,"


def _claim_0017() -> str:
    """The claim function as migration 0017 left it (its text is that revision's, for ever)."""
    path = Path(__file__).with_name("0017_queue_claim_holders.py")
    spec = importlib.util.spec_from_file_location("orchestrator_migration_0017", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text: str = module._claim_0012().replace(module.PRIORITY_BRANCH, module.HOLDERS_BRANCH, 1)
    assert text.count(CLEARED_0017) == 1, "migration 0017's queue_claim is not as expected"
    return text


def upgrade() -> None:
    op.add_column("runs", sa.Column("waiting_tool", sa.Text(), nullable=True), schema=S)
    op.execute(BACKFILL)
    op.drop_index("ix_runs_turn_waiters", table_name="runs", schema=S)
    op.create_index("ix_runs_turn_waiters", "runs", ["waiting_tool", "available_at"], schema=S,
                    postgresql_where=sa.text(TURN_WAITERS))
    op.execute(_claim_0017().replace(CLEARED_0017, CLEARED, 1))


def downgrade() -> None:
    op.execute(_claim_0017())
    op.drop_index("ix_runs_turn_waiters", table_name="runs", schema=S)
    op.create_index("ix_runs_turn_waiters", "runs", ["available_at"], schema=S,
                    postgresql_where=sa.text(TURN_WAITERS_0012))
    op.drop_column("runs", "waiting_tool", schema=S)
