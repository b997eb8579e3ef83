"""reconciliation items: resolved once, as the ledger says, and then fixed

The runtime role holds UPDATE on ``reconciliation_items``: reconcilers claim items, count
lookups and hand items to operators, and a resolution settles them. Nothing kept a resolved
item as it was resolved: any role holding UPDATE could rewrite its resolution, move it back
to the operators' queue, or resolve an item as ``committed`` while its operation was
``not_applied`` (or still ``unknown``). An operation's receipt was already immutable once
final (``operations_guard_update``); the item that records how it was settled was not.

Two triggers, which hold for every role, the schema's owner too:

- ``reconciliation_items_resolved_fixed``: once an item is ``resolved``, its ``state``,
  ``resolution``, ``resolved_at``, ``evidence``, ``reason``, ``operation_id`` and ``run_id``
  never change. (A late lookup is still numbered in turn, ``lookup_attempts``, and a lapsed
  claim cleared: the engine does both to a settled item and they decide nothing.)
- ``reconciliation_items_resolved_as_settled`` (an UPDATE) and
  ``reconciliation_items_created_as_settled`` (an INSERT): an item is ``resolved`` only with
  a resolution, and a time, equal to the state its operation is settled in, in the same
  transaction or before; an item not resolved carries neither.

No table is rewritten or scanned.

Revision ID: 0029
Revises: 0028
Create Date: 2026-12-06 13:00:00
"""

from __future__ import annotations

from alembic import op

revision = "0029"
down_revision = "0028"
branch_labels = None
depends_on = None

S = "orchestrator"

UPGRADE_SQL = f"""
CREATE FUNCTION {S}.reconciliation_items_guard() RETURNS trigger
LANGUAGE plpgsql AS $$
DECLARE
    settled text;
BEGIN
    IF TG_OP = 'UPDATE' AND OLD.state = 'resolved' THEN
        RAISE EXCEPTION 'reconciliation item % is resolved (%); what it says cannot change',
            OLD.id, OLD.resolution
            USING ERRCODE = 'check_violation';
    END IF;
    IF NEW.state <> 'resolved' THEN
        RAISE EXCEPTION 'reconciliation item of operation % is %: it has no resolution',
            NEW.operation_id, NEW.state
            USING ERRCODE = 'check_violation';
    END IF;
    SELECT o.state INTO settled FROM {S}.operations AS o
    WHERE o.id = NEW.operation_id AND o.run_id = NEW.run_id;
    IF NEW.resolution IS NULL OR settled IS DISTINCT FROM NEW.resolution
       OR NEW.resolved_at IS NULL THEN
        RAISE EXCEPTION 'reconciliation item of operation % cannot be resolved as %: '
                        'its operation is %', NEW.operation_id, NEW.resolution,
            coalesce(settled, 'missing')
            USING ERRCODE = 'check_violation';
    END IF;
    RETURN NEW;
END
$$;
CREATE TRIGGER reconciliation_items_resolved_fixed
    BEFORE UPDATE OF state, resolution, resolved_at, evidence, reason, operation_id, run_id
    ON {S}.reconciliation_items FOR EACH ROW
    WHEN (OLD.state = 'resolved'
          AND (NEW.state, NEW.resolution, NEW.resolved_at, NEW.evidence, NEW.reason,
               NEW.operation_id, NEW.run_id)
              IS DISTINCT FROM (OLD.state, OLD.resolution, OLD.resolved_at, OLD.evidence,
                                OLD.reason, OLD.operation_id, OLD.run_id))
    EXECUTE FUNCTION {S}.reconciliation_items_guard();
CREATE TRIGGER reconciliation_items_resolved_as_settled
    BEFORE UPDATE OF state, resolution, resolved_at
    ON {S}.reconciliation_items FOR EACH ROW
    WHEN (OLD.state <> 'resolved'
          AND (NEW.state = 'resolved' OR NEW.resolution IS NOT NULL
               OR NEW.resolved_at IS NOT NULL))
    EXECUTE FUNCTION {S}.reconciliation_items_guard();
CREATE TRIGGER reconciliation_items_created_as_settled
    BEFORE INSERT ON {S}.reconciliation_items FOR EACH ROW
    WHEN (NEW.state = 'resolved' OR NEW.resolution IS NOT NULL OR NEW.resolved_at IS NOT NULL)
    EXECUTE FUNCTION {S}.reconciliation_items_guard();
"""

DOWNGRADE_SQL = f"""
DROP TRIGGER reconciliation_items_created_as_settled ON {S}.reconciliation_items;
DROP TRIGGER reconciliation_items_resolved_as_settled ON {S}.reconciliation_items;
DROP TRIGGER reconciliation_items_resolved_fixed ON {S}.reconciliation_items;
DROP FUNCTION {S}.reconciliation_items_guard();
"""


def upgrade() -> None:
    op.execute(UPGRADE_SQL)


def downgrade() -> None:
    op.execute(DOWNGRADE_SQL)
