"""runs.due_at: when a run became due, written once when the run is inserted

Both claims (the default queue's, ``orchestrator.db.runs``, and ``orchestrator.queue_claim``)
return when each run they claim became due (migration 0030): what a worker counts the run's
queue wait and duration from (docs/metrics.md). They worked it out again at every claim from
the run's ``options`` (``start_at`` and ``delay_seconds`` cast from its JSON), although the
insert had computed the same time already, for ``available_at``. A value in ``options`` edited
by hand into something that is no time failed every claim that picked the run, and with it the
start of the other runs of that claim.

The time is now kept in ``runs.due_at``, written by the statements that insert a run (a
submission, a child run, a schedule's run, a restart: the start its submission held it back
to, else now; a continuation: now) and read by both claims; nothing else writes it (a retry, a
sleep, a lost lease make a run ready again, not due for the first time). Its default, now(),
is for an insert by code older than this revision (a submitter not upgraded yet): such a run
is due when it was submitted, held back or not.

The upgrade fills the column for every run that has not finished, from the same expression
the claims used; a run whose ``options`` hold something that is no time is due when it was
created (the upgrade does not fail on it). Finished runs keep NULL: no claim reads them again
(a restart makes a new run), and rewriting every row of the history would hold the table for
as long. ``orchestrator.queue_claim`` is replaced in place (the same result columns): it keeps
its privileges.

Revision ID: 0032
Revises: 0031
Create Date: 2026-12-06 14:00:00
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op

revision = "0032"
down_revision = "0031"
branch_labels = None
depends_on = None

S = "orchestrator"

# The expression of migration 0030 (its runs due as the claims had them), for one run's
# created_at, options and continued_from; a value that is no time reads as its creation.
DUE_OF = """
CREATE FUNCTION orchestrator.due_0032(created timestamptz, options jsonb, continued uuid)
RETURNS timestamptz LANGUAGE plpgsql AS $$
BEGIN
    IF continued IS NOT NULL THEN
        RETURN created;
    END IF;
    RETURN greatest(created, (options ->> 'start_at')::timestamptz,
                    created + make_interval(secs => (options ->> 'delay_seconds')::float8));
EXCEPTION WHEN data_exception THEN
    RETURN created;
END
$$
"""

BACKFILL = """
UPDATE orchestrator.runs
SET due_at = orchestrator.due_0032(created_at, options, continued_from)
WHERE status NOT IN ('succeeded', 'failed', 'cancelled')
"""


def _migration_0030() -> ModuleType:
    path = Path(__file__).with_name("0030_queue_claim_says_when_due.py")
    spec = importlib.util.spec_from_file_location("orchestrator_migration_0030", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _claim_0030() -> str:
    """The claim function as migration 0030 left it (its text is that revision's, for ever)."""
    module = _migration_0030()
    text: str = module._claim_0028()
    for old, new, _ in module.PARTS:
        text = text.replace(old, new)
    assert text.count(module.DUE) == 1, "migration 0030's queue_claim is not as expected"
    return text


def _claim() -> str:
    """This revision's claim: the column in the place of 0030's expression."""
    return _claim_0030().replace(_migration_0030().DUE, "r.due_at", 1)


def upgrade() -> None:
    # Added without a default, then given one: a default given with the column would be
    # every existing row's value (finished runs included), read once at the upgrade.
    op.add_column("runs", sa.Column("due_at", sa.DateTime(timezone=True), nullable=True),
                  schema=S)
    op.alter_column("runs", "due_at", server_default=sa.text("now()"), schema=S)
    op.execute(DUE_OF)
    op.execute(BACKFILL)
    op.execute("DROP FUNCTION orchestrator.due_0032(timestamptz, jsonb, uuid)")
    op.execute(_claim())


def downgrade() -> None:
    op.execute(_claim_0030())
    op.drop_column("runs", "due_at", schema=S)
