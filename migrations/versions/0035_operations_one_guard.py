"""operations: one guard per row instead of conditions compiled per statement

PostgreSQL keeps a table's CHECK constraints and a trigger's WHEN condition as stored node text,
and every statement that writes the table reads that text back, simplifies and compiles it
before its first row (``ExecRelCheck``, ``TriggerEnabled``), once for each part of the
statement that writes the table. A write-ahead that commits the run's previous receipt writes
``operations`` twice (the receipt's UPDATE, the new call's INSERT), so it compiled the five
CHECK constraints of ``operations`` (6.3 KB) twice and the update triggers' conditions (5.4 KB,
made small by migration 0022) once: about 18 KB of node text per statement, whatever its
number of rows. With one row a statement (a stream's writes) that was a quarter of the
server's instructions per step (``python -m bench.bare --instructions --batch 1``).

A PL/pgSQL function is compiled once per connection, so those rules now live in one trigger,
``operations_guard`` (``BEFORE INSERT OR UPDATE OF`` the columns they read), without a WHEN
condition: it is called for every row it concerns and compiles nothing per statement. It tests
a row that passes every rule (every row the engine writes) in one expression, since each
expression a PL/pgSQL function evaluates costs about as much again as its work, and the rules
one by one only to say which one a refused row broke. Server instructions per step of the
engine's writes (``python -m bench.bare --instructions --ways engine``, K = 3, PostgreSQL 18.6;
``--batch 1 --runs 400 --runs-small 200`` for one row):

    rows a statement    before       after
    1                   2,454,558    1,834,370   (0.75x)
    16                    702,151      635,362   (0.90x)
    64                    532,561      533,648   (1.00x)

Nothing a rule allows or refuses changes:

- The rules of ``operations_entry_completed_once``, ``operations_guard_update`` and
  ``operations_guard_insert`` run first, in the order those triggers fired, with their
  messages; then those of the CHECK constraints, as PostgreSQL runs BEFORE triggers before
  CHECK constraints, in the order of their names as PostgreSQL checks them (a row that breaks
  two is refused by the first). Each constraint's rule refuses a row only when its expression
  is false (not when it is NULL), as a CHECK does, with SQLSTATE ``check_violation`` and the
  constraint's name (``ck_operations_state`` …) in the error's constraint field; and not for a
  row with a NULL in a NOT NULL column, which PostgreSQL checks first (``not_null_violation``).
  The fast path is their conjunction, which is false exactly when one of them is.
- ``operations_entry_append_only`` stays as it is: it concerns the columns of a call's identity,
  which the hot statements (``orchestrator/db/steps.py``) never set, so none of them compiles
  its condition.
- The trigger is one of columns, as the triggers it replaces were; it also names the columns
  the constraints read. An UPDATE that sets none of them leaves each rule as true as it was for
  the old row (each compares its columns' old and new values, or checks the new row's), so it
  need not be called for it.
- Existing rows are not checked again (they passed the constraints), and nothing is scanned
  or rewritten: dropping a CHECK constraint and creating a trigger change the catalog only.
- The trigger is ``ENABLE ALWAYS``: it fires in a session with ``session_replication_role =
  replica`` too, since CHECK constraints never skipped it; the rules of the three triggers it
  replaces, which did skip it, are skipped there still (a bulk load such as bench/scale.py's,
  or a logical replication subscriber's copy, writes operations in their final states).

Revision ID: 0035
Revises: 0034
Create Date: 2026-12-07 07:30:00
"""

from __future__ import annotations

from alembic import op

revision = "0035"
down_revision = "0034"
branch_labels = None
depends_on = None

S = "orchestrator"

_STATES = ("pending", "submitted", "committed", "failed", "unknown", "not_applied",
           "abandoned", "cancelled")
_ARROWS = ("pending>submitted", "pending>cancelled", "submitted>committed", "submitted>failed",
           "submitted>unknown", "unknown>committed", "unknown>not_applied", "unknown>abandoned")
_FINAL = ("committed", "failed", "not_applied", "abandoned", "cancelled")
_EFFECTS = ("consequential", "idempotent", "read")

# The columns of the rules below: an UPDATE that sets none of them leaves every rule as true as
# it was for the old row (each compares the old and new values of its own columns, or checks
# the new row's), so the trigger is not even called for it.
_COLUMNS = ("state", "receipt", "receipt_digest", "completed_seq", "finished_at", "seq",
            "entry_version", "effect_class", "attempt", "position")


def _array(words: tuple[str, ...]) -> str:
    return "'{" + ",".join(words) + "}'::text[]"


def _check(name: str, expression: str) -> str:
    return f"""
    IF NOT ({expression}) THEN
        RAISE EXCEPTION 'new row for relation "operations" violates check constraint "{name}"'
            USING ERRCODE = 'check_violation', CONSTRAINT = '{name}', TABLE = 'operations',
                  SCHEMA = '{S}';
    END IF;"""


# The former CHECK constraints, as the migrations that made them wrote them, in the order of
# their names: PostgreSQL checks a table's CHECK constraints in that order (``relcache.c``,
# ``CheckConstraintFetch``) and names the first one a row breaks.
_CHECKS = (
    ("ck_operations_committed_receipt",
     "NEW.state <> 'committed' OR NEW.receipt_digest IS NOT NULL"),
    ("ck_operations_effect_class", f"NEW.effect_class = ANY ({_array(_EFFECTS)})"),
    ("ck_operations_entry",
     "(NEW.seq IS NULL OR (NEW.seq >= 1 AND NEW.entry_version IS NOT NULL)) "
     "AND (NEW.completed_seq IS NULL OR (NEW.state = 'committed' AND NEW.seq IS NOT NULL "
     "AND NEW.completed_seq > NEW.seq))"),
    ("ck_operations_identity", "NEW.attempt >= 1 AND NEW.position >= 0"),
    ("ck_operations_state", f"NEW.state = ANY ({_array(_STATES)})"),
)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


# The constraints as migration 0001 and 0019 made them (for the downgrade).
_FORMER_CHECKS = (
    ("ck_operations_state", _in("state", _STATES)),
    ("ck_operations_entry", "(seq IS NULL OR (seq >= 1 AND entry_version IS NOT NULL)) "
                            "AND (completed_seq IS NULL OR (state = 'committed' AND seq IS NOT "
                            "NULL AND completed_seq > seq))"),
    ("ck_operations_effect_class", _in("effect_class", _EFFECTS)),
    ("ck_operations_identity", "attempt >= 1 AND position >= 0"),
    ("ck_operations_committed_receipt", "state <> 'committed' OR receipt_digest IS NOT NULL"),
)

_ENTRY_CHANGED = """(OLD.completed_seq IS DISTINCT FROM NEW.completed_seq
             AND NOT (OLD.completed_seq IS NULL AND OLD.state = 'submitted'
                      AND NEW.state = 'committed'))
            OR (OLD.completed_seq IS NOT NULL
                AND OLD.finished_at IS DISTINCT FROM NEW.finished_at)"""
"""A call's ``call.completed`` entry on its row written other than once, with its commit (what
the former operations_entry_completed_once refused). NULL only for a row with a NULL
``state``, which its NOT NULL refuses after the trigger."""

_MOVE_OK = f"""(NEW.state = OLD.state
             AND (OLD.state <> ALL ({_array(_FINAL)})
                  OR NEW.receipt IS NOT DISTINCT FROM OLD.receipt))
            OR OLD.state || '>' || NEW.state = ANY ({_array(_ARROWS)})"""
"""An arrow of CONTRACT C5, or no move that changes a final operation's receipt (what the
former operations_guard_update allowed). NULL only for a row with a NULL ``state``, as
above."""

_CREATE_OK = "NEW.state = ANY ('{pending,submitted}'::text[])"
"""An operation starts pending or submitted (the former operations_guard_insert)."""

_CHECKS_OK = "\n                AND ".join(f"({expr})" for _, expr in _CHECKS)
"""The former CHECK constraints at once. A conjunction is false exactly when one of its terms
is, so ``IF NOT`` it refuses what one of them refused, and nothing that was NULL for all of
them (a CHECK refuses only a false row)."""

UPGRADE_SQL = f"""
CREATE FUNCTION {S}.operations_guard() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- Every rule in one expression for the row that passes them all (each expression a
    -- function evaluates costs as much again as its work); one by one only to say which
    -- rule a refused row broke, in the order the former triggers and constraints ran.
    IF TG_OP = 'INSERT' THEN
        IF {_CREATE_OK}
           AND {_CHECKS_OK}
        THEN
            RETURN NEW;
        END IF;
    ELSE
        IF NOT ({_ENTRY_CHANGED})
           AND ({_MOVE_OK})
           AND {_CHECKS_OK}
        THEN
            RETURN NEW;
        END IF;
    END IF;
    -- The former triggers' rules, which a session with session_replication_role = replica
    -- skipped (they were ENABLE, not ALWAYS): a bulk load or a subscriber's copy of final rows.
    IF current_setting('session_replication_role') <> 'replica' THEN
        IF TG_OP = 'INSERT' THEN
            IF NOT ({_CREATE_OK}) THEN
                RAISE EXCEPTION 'operation % cannot be created in state %', NEW.id, NEW.state
                    USING ERRCODE = 'check_violation';
            END IF;
        ELSE
            IF {_ENTRY_CHANGED} THEN
                RAISE EXCEPTION 'operation % is a journal entry of run % (seq %): its entry '
                                'is append-only', OLD.id, OLD.run_id, OLD.seq
                    USING ERRCODE = 'check_violation';
            END IF;
            IF NOT ({_MOVE_OK}) THEN
                IF NEW.state = OLD.state THEN
                    RAISE EXCEPTION 'operation % is final (%); its receipt cannot change',
                        OLD.id, OLD.state USING ERRCODE = 'check_violation';
                END IF;
                RAISE EXCEPTION 'operation % cannot move from % to %', OLD.id, OLD.state,
                    NEW.state USING ERRCODE = 'check_violation';
            END IF;
        END IF;
    END IF;
    -- The former CHECK constraints, one by one, for a row that breaks one. PostgreSQL checks
    -- NOT NULL before them: a row with a NULL where none may be is left to it
    -- (not_null_violation, naming the column), as before.
    IF NOT ({_CHECKS_OK}) THEN
        IF EXISTS (SELECT FROM pg_catalog.pg_attribute a
                   WHERE a.attrelid = TG_RELID AND a.attnum > 0 AND a.attnotnull
                         AND NOT a.attisdropped
                         AND pg_catalog.jsonb_typeof(pg_catalog.to_jsonb(NEW)
                                                     -> a.attname::text) = 'null') THEN
            RETURN NEW;
        END IF;{"".join(_check(name, expr) for name, expr in _CHECKS)}
    END IF;
    RETURN NEW;
END
$$;
DROP TRIGGER operations_entry_completed_once ON {S}.operations;
DROP TRIGGER operations_guard_update ON {S}.operations;
DROP TRIGGER operations_guard_insert ON {S}.operations;
ALTER TABLE {S}.operations
    {", ".join(f"DROP CONSTRAINT {name}" for name, _ in _CHECKS)};
CREATE TRIGGER operations_guard BEFORE INSERT OR UPDATE OF {", ".join(_COLUMNS)}
    ON {S}.operations FOR EACH ROW EXECUTE FUNCTION {S}.operations_guard();
ALTER TABLE {S}.operations ENABLE ALWAYS TRIGGER operations_guard;
"""

# As migrations 0001, 0019 and 0022 left them (operations_entry_append_only stays as it is).
DOWNGRADE_SQL = f"""
DROP TRIGGER operations_guard ON {S}.operations;
DROP FUNCTION {S}.operations_guard();
ALTER TABLE {S}.operations
    {", ".join(f"ADD CONSTRAINT {name} CHECK ({expr})" for name, expr in _FORMER_CHECKS)};
CREATE TRIGGER operations_entry_completed_once
    BEFORE UPDATE OF completed_seq, finished_at ON {S}.operations FOR EACH ROW
    WHEN ((OLD.completed_seq IS DISTINCT FROM NEW.completed_seq
           AND NOT (OLD.completed_seq IS NULL AND OLD.state = 'submitted'
                    AND NEW.state = 'committed'))
          OR (OLD.completed_seq IS NOT NULL AND OLD.finished_at IS DISTINCT FROM NEW.finished_at))
    EXECUTE FUNCTION {S}.operations_entry_append_only();
CREATE TRIGGER operations_guard_update
    BEFORE UPDATE OF state, receipt ON {S}.operations FOR EACH ROW
    WHEN (NOT (
        (NEW.state = OLD.state
         AND (OLD.state <> ALL ({_array(_FINAL)})
              OR NEW.receipt IS NOT DISTINCT FROM OLD.receipt))
        OR OLD.state || '>' || NEW.state = ANY ({_array(_ARROWS)})))
    EXECUTE FUNCTION {S}.operations_guard_transition();
CREATE TRIGGER operations_guard_insert
    BEFORE INSERT ON {S}.operations FOR EACH ROW
    WHEN (NEW.state <> ALL ('{{pending,submitted}}'::text[]))
    EXECUTE FUNCTION {S}.operations_guard_transition();
"""


def upgrade() -> None:
    op.execute(UPGRADE_SQL)


def downgrade() -> None:
    op.execute(DOWNGRADE_SQL)
