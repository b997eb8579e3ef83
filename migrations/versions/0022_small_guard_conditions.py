"""the guards a one-row write compiles made small: the same rules, in less text

PostgreSQL keeps a trigger's WHEN condition and a table's CHECK constraints as stored node
text and, for every statement that writes the table, reads that text back, simplifies it and
compiles it, once per statement whatever the number of rows (``TriggerEnabled``,
``ExecRelCheck``). A drain's statements carry tens of rows and hardly notice; a stream's carry
one or two, and then it is a quarter of the server's time for a write-ahead that commits the
run's previous receipt (perf on the server under ``bench.batches``-sized writes of one row:
``stringToNode`` 15 %, the operations' update triggers 12 %, the CHECK constraints 12 %). The
receipt's commit fired both update triggers of ``operations`` for their 17 KB of conditions.

Nothing a guard allows or refuses changes:

- ``operations_entry_append_only`` is split by the columns that fire it. Its conditions on a
  call's identity and its ``seq`` stay on a trigger of those columns, which no commit of a
  receipt sets, so it is not even looked at then; its conditions on ``completed_seq`` and
  ``finished_at`` go to ``operations_entry_completed_once``, a trigger of those two columns.
  Each condition only ever concerned the columns of its own trigger (no trigger of the table
  changes a row it fires on), so a change is refused exactly when it was before, with the
  same error.
- ``operations_guard_update`` states the arrows of C5 as one array of ``from>to`` words and
  the final states as one array: no state holds ``>`` (``ck_operations_state``, and the old
  row passed it), so a pair matches an arrow exactly when it is one.
- ``operations_guard_insert`` names its two states as one array constant.

A one-row commit of a receipt now compiles 5.4 KB of trigger conditions, not 17 KB. Only
triggers change: no table is rewritten or scanned, and nothing is locked longer than the
catalog change takes. (The CHECK constraints, 6.3 KB on ``operations`` and 4.5 KB on ``runs``,
compiled by the same statements, stay as they are: written with array constants they came to
5.0 and 3.4 KB, and replacing them would check every row of both tables under a lock.)

Revision ID: 0022
Revises: 0021
Create Date: 2026-12-06 05:30:00
"""

from __future__ import annotations

from alembic import op

revision = "0022"
down_revision = "0021"
branch_labels = None
depends_on = None

S = "orchestrator"

# The columns of a call's identity and its call.submitted entry: fixed once the row has its
# seq (migration 0019).
_IDENTITY = ("id", "seq", "entry_version", "run_id", "position", "attempt", "tool_name",
             "tool_version", "intent_digest", "idempotency_key", "effect_class", "lease_token",
             "submitted_at")

_ARROWS = ("pending>submitted", "pending>cancelled", "submitted>committed", "submitted>failed",
           "submitted>unknown", "unknown>committed", "unknown>not_applied", "unknown>abandoned")
_FINAL = ("committed", "failed", "not_applied", "abandoned", "cancelled")


def _array(words: tuple[str, ...]) -> str:
    return "'{" + ",".join(words) + "}'::text[]"


UPGRADE_SQL = f"""
DROP TRIGGER operations_entry_append_only ON {S}.operations;
CREATE TRIGGER operations_entry_append_only
    BEFORE UPDATE OF {", ".join(_IDENTITY)}
    ON {S}.operations FOR EACH ROW
    WHEN (OLD.seq IS DISTINCT FROM NEW.seq
          OR (OLD.seq IS NOT NULL AND (
               OLD.id <> NEW.id
               OR OLD.tool_version IS DISTINCT FROM NEW.tool_version
               OR OLD.intent_digest IS DISTINCT FROM NEW.intent_digest
               OR OLD.attempt IS DISTINCT FROM NEW.attempt
               OR OLD.idempotency_key IS DISTINCT FROM NEW.idempotency_key
               OR OLD.effect_class IS DISTINCT FROM NEW.effect_class
               OR OLD.submitted_at IS DISTINCT FROM NEW.submitted_at
               OR OLD.entry_version IS DISTINCT FROM NEW.entry_version
               OR OLD.run_id IS DISTINCT FROM NEW.run_id
               OR OLD.position IS DISTINCT FROM NEW.position
               OR OLD.tool_name IS DISTINCT FROM NEW.tool_name
               OR OLD.lease_token IS DISTINCT FROM NEW.lease_token)))
    EXECUTE FUNCTION {S}.operations_entry_append_only();
CREATE TRIGGER operations_entry_completed_once
    BEFORE UPDATE OF completed_seq, finished_at ON {S}.operations FOR EACH ROW
    WHEN ((OLD.completed_seq IS DISTINCT FROM NEW.completed_seq
           AND NOT (OLD.completed_seq IS NULL AND OLD.state = 'submitted'
                    AND NEW.state = 'committed'))
          OR (OLD.completed_seq IS NOT NULL AND OLD.finished_at IS DISTINCT FROM NEW.finished_at))
    EXECUTE FUNCTION {S}.operations_entry_append_only();
DROP TRIGGER operations_guard_update ON {S}.operations;
CREATE TRIGGER operations_guard_update
    BEFORE UPDATE OF state, receipt ON {S}.operations FOR EACH ROW
    WHEN (NOT (
        (NEW.state = OLD.state
         AND (OLD.state <> ALL ({_array(_FINAL)})
              OR NEW.receipt IS NOT DISTINCT FROM OLD.receipt))
        OR OLD.state || '>' || NEW.state = ANY ({_array(_ARROWS)})))
    EXECUTE FUNCTION {S}.operations_guard_transition();
DROP TRIGGER operations_guard_insert ON {S}.operations;
CREATE TRIGGER operations_guard_insert
    BEFORE INSERT ON {S}.operations FOR EACH ROW
    WHEN (NEW.state <> ALL ('{{pending,submitted}}'::text[]))
    EXECUTE FUNCTION {S}.operations_guard_transition();
"""

# As migrations 0004 and 0019 left them.
DOWNGRADE_SQL = f"""
DROP TRIGGER operations_entry_completed_once ON {S}.operations;
DROP TRIGGER operations_entry_append_only ON {S}.operations;
CREATE TRIGGER operations_entry_append_only
    BEFORE UPDATE OF id, seq, completed_seq, entry_version, run_id, position, attempt,
                     tool_name, tool_version, intent_digest, idempotency_key, effect_class,
                     lease_token, submitted_at, finished_at
    ON {S}.operations FOR EACH ROW
    WHEN (OLD.seq IS DISTINCT FROM NEW.seq
          OR (OLD.completed_seq IS DISTINCT FROM NEW.completed_seq
              AND NOT (OLD.completed_seq IS NULL AND OLD.state = 'submitted'
                       AND NEW.state = 'committed'))
          OR (OLD.seq IS NOT NULL AND (
               OLD.id <> NEW.id
               OR OLD.tool_version IS DISTINCT FROM NEW.tool_version
               OR OLD.intent_digest IS DISTINCT FROM NEW.intent_digest
               OR OLD.attempt IS DISTINCT FROM NEW.attempt
               OR OLD.idempotency_key IS DISTINCT FROM NEW.idempotency_key
               OR OLD.effect_class IS DISTINCT FROM NEW.effect_class
               OR OLD.submitted_at IS DISTINCT FROM NEW.submitted_at
               OR OLD.entry_version IS DISTINCT FROM NEW.entry_version
               OR OLD.run_id IS DISTINCT FROM NEW.run_id
               OR OLD.position IS DISTINCT FROM NEW.position
               OR OLD.tool_name IS DISTINCT FROM NEW.tool_name
               OR OLD.lease_token IS DISTINCT FROM NEW.lease_token))
          OR (OLD.completed_seq IS NOT NULL AND OLD.finished_at IS DISTINCT FROM NEW.finished_at))
    EXECUTE FUNCTION {S}.operations_entry_append_only();
DROP TRIGGER operations_guard_update ON {S}.operations;
CREATE TRIGGER operations_guard_update
    BEFORE UPDATE OF state, receipt ON {S}.operations FOR EACH ROW
    WHEN (NOT (
        (NEW.state = OLD.state
         AND (OLD.state NOT IN ('committed', 'failed', 'not_applied', 'abandoned', 'cancelled')
              OR NEW.receipt IS NOT DISTINCT FROM OLD.receipt))
        OR (OLD.state, NEW.state) IN (
            ('pending', 'submitted'), ('pending', 'cancelled'),
            ('submitted', 'committed'), ('submitted', 'failed'), ('submitted', 'unknown'),
            ('unknown', 'committed'), ('unknown', 'not_applied'), ('unknown', 'abandoned'))))
    EXECUTE FUNCTION {S}.operations_guard_transition();
DROP TRIGGER operations_guard_insert ON {S}.operations;
CREATE TRIGGER operations_guard_insert
    BEFORE INSERT ON {S}.operations FOR EACH ROW
    WHEN (NEW.state NOT IN ('pending', 'submitted'))
    EXECUTE FUNCTION {S}.operations_guard_transition();
"""


def upgrade() -> None:
    op.execute(UPGRADE_SQL)


def downgrade() -> None:
    op.execute(DOWNGRADE_SQL)
