"""operation guard: the C5 rules as WHEN conditions, the function only for a row that breaks them

The guard used to call its PL/pgSQL function for every operation inserted and every state or
receipt change, so each effect step paid for two function calls. The triggers now state the
same rules as WHEN conditions, which the executor evaluates without calling anything; the
function (unchanged) runs only for a row that breaks them, and raises as before.

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-29 21:30:00
"""

from __future__ import annotations

from alembic import op

revision = "0004"
down_revision = "0003"
branch_labels = None
depends_on = None

_FINAL = "('committed', 'failed', 'not_applied', 'abandoned', 'cancelled')"
# The arrows of CONTRACT C5 (the same list as the function's).
_ARROWS = """(
    ('pending', 'submitted'), ('pending', 'cancelled'),
    ('submitted', 'committed'), ('submitted', 'failed'), ('submitted', 'unknown'),
    ('unknown', 'committed'), ('unknown', 'not_applied'), ('unknown', 'abandoned')
)"""

UPGRADE_SQL = f"""
DROP TRIGGER operations_guard_transition ON orchestrator.operations;
CREATE TRIGGER operations_guard_insert
    BEFORE INSERT ON orchestrator.operations FOR EACH ROW
    WHEN (NEW.state NOT IN ('pending', 'submitted'))
    EXECUTE FUNCTION orchestrator.operations_guard_transition();
CREATE TRIGGER operations_guard_update
    BEFORE UPDATE OF state, receipt ON orchestrator.operations FOR EACH ROW
    WHEN (NOT (
        (NEW.state = OLD.state
         AND (OLD.state NOT IN {_FINAL} OR NEW.receipt IS NOT DISTINCT FROM OLD.receipt))
        OR (OLD.state, NEW.state) IN {_ARROWS}))
    EXECUTE FUNCTION orchestrator.operations_guard_transition();
"""

DOWNGRADE_SQL = """
DROP TRIGGER operations_guard_insert ON orchestrator.operations;
DROP TRIGGER operations_guard_update ON orchestrator.operations;
CREATE TRIGGER operations_guard_transition
    BEFORE INSERT OR UPDATE OF state, receipt ON orchestrator.operations
    FOR EACH ROW EXECUTE FUNCTION orchestrator.operations_guard_transition();
"""


def upgrade() -> None:
    op.execute(UPGRADE_SQL)


def downgrade() -> None:
    op.execute(DOWNGRADE_SQL)
