"""queue claim: each run claimed says when it was due

A worker counts a run's queue wait from when it became due to its first claim, and its
duration from then to its end (docs/metrics.md). ``orchestrator.queue_claim`` returned each
run's ``created_at``, its submission: a run held back by ``start_at`` or ``delay`` reported its
hold as queue wait, and in its duration.

The function now returns ``due_at`` in that column's place: the start the submission held the
run back to (``options`` records the hold, and the insert counted it from the clock that
``created_at`` read), else its creation; a continuation carries its first generation's options
but is due when it is made. The default queue's claim (``orchestrator.db.runs``) returns the
same. It is read from the row the claim updates: no other read. Everything else the claim
decides is unchanged.

A function's result columns cannot change in place: the function is dropped and made again.
It keeps the privileges a new function has (``EXECUTE`` for PUBLIC); run ``orchestrator db
grant`` after the upgrade, as after every one, for a role granted it by name.

Revision ID: 0030
Revises: 0029
Create Date: 2026-12-06 11:45:00
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0030"
down_revision = "0029"
branch_labels = None
depends_on = None

SIGNATURE = "orchestrator.queue_claim(text, text[], text, integer, float8)"

DUE = """CASE WHEN r.continued_from IS NOT NULL THEN r.created_at
                       ELSE greatest(r.created_at, (r.options ->> 'start_at')::timestamptz,
                                     r.created_at + make_interval(
                                         secs => (r.options ->> 'delay_seconds')::float8))
                  END"""

# Each part of migration 0028's function, and what it becomes.
PARTS = (
    ("               created_at timestamptz, claimed_from text, wake_at timestamptz)",
     "               due_at timestamptz, claimed_from text, wake_at timestamptz)", 1),
    ("""now(), r.created_at,
                  p.status, NULL::timestamptz;""",
     f"""now(),
                  {DUE},
                  p.status, NULL::timestamptz;""", 1),
)


def _claim_0028() -> str:
    """The claim function as migration 0028 left it (its text is that revision's, for ever)."""
    path = Path(__file__).with_name("0028_queue_claim_keys_per_tenant.py")
    spec = importlib.util.spec_from_file_location("orchestrator_migration_0028", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text: str = module._claim_0024()
    for old, new, _ in module.PARTS:
        text = text.replace(old, new)
    for old, _, count in PARTS:
        assert text.count(old) == count, "migration 0028's queue_claim is not as expected"
    return text


def upgrade() -> None:
    text = _claim_0028()
    for old, new, _ in PARTS:
        text = text.replace(old, new)
    op.execute(f"DROP FUNCTION {SIGNATURE}")
    op.execute(text)


def downgrade() -> None:
    op.execute(f"DROP FUNCTION {SIGNATURE}")
    op.execute(_claim_0028())
