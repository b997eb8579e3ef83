"""A call's journal entries are its operation row: ``journal`` becomes a view

An effect step used to write five rows: the operation (inserted ``submitted``, then updated
``committed``), a ``call.submitted`` and a ``call.completed`` journal entry that repeated what
the operation row says, and the run's fence. The two entries now live on the operation row
itself: ``seq`` is the position in the run's journal of the call's ``call.submitted`` entry,
``completed_seq`` that of its ``call.completed`` entry (NULL where the entry is a stored row:
written before this revision, or by the engine's general path), and
``entry_version`` the journal schema version the entries were written with.

The stored entries move to ``journal_entries`` (the table renamed, its rows, keys, trigger and
grants kept). ``journal`` is now a view with the table's columns: the stored entries and the
operations' entries in one ordered sequence per run (CONTRACT C3), what every reader reads.
The entries of a pruned run are gone from it (its operations stay, as evidence).

The entries on an operation row are append-only like the table's: ``seq`` is written with the
row and never changes, nor do the columns its ``call.submitted`` payload is made of;
``completed_seq`` is written once, in the update that moves the operation from ``submitted``
to ``committed`` (``operations_entry_append_only``; the receipt was already immutable once
final, ``operations_guard_update``). The positions are kept unique by the run's fence, which
moves ``revision`` by the entries each write appends (the stored entries' primary key no
longer sees every entry). ``prune_runs`` deletes from
``journal_entries``. The roles that could read the journal may read the view.

Revision ID: 0019
Revises: 0018
Create Date: 2026-12-05 06:00:00
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op

revision = "0019"
down_revision = "0018"
branch_labels = None
depends_on = None

S = "orchestrator"

# One text for the view, kept here for ever (a later revision that changes it writes its own).
JOURNAL_VIEW = """
CREATE VIEW orchestrator.journal AS
SELECT j.run_id, j.seq, j.kind, j.position, j.name, j.schema_version, j.payload,
       j.lease_token, j.created_at
FROM orchestrator.journal_entries j
UNION ALL
SELECT o.run_id, o.seq, 'call.submitted', o.position, o.tool_name, o.entry_version,
       jsonb_build_object('tool_version', o.tool_version, 'intent', o.intent_digest,
                          'attempt', o.attempt, 'op', o.id, 'key', o.idempotency_key,
                          'effect', o.effect_class),
       o.lease_token, o.submitted_at
FROM orchestrator.operations o JOIN orchestrator.runs r ON r.id = o.run_id
WHERE o.seq IS NOT NULL AND r.pruned_at IS NULL
UNION ALL
SELECT o.run_id, o.completed_seq, 'call.completed', o.position, o.tool_name, o.entry_version,
       jsonb_build_object('result', o.receipt, 'op', o.id),
       o.lease_token, o.finished_at
FROM orchestrator.operations o JOIN orchestrator.runs r ON r.id = o.run_id
WHERE o.completed_seq IS NOT NULL AND r.pruned_at IS NULL
"""

ENTRY_GUARD = """
CREATE FUNCTION orchestrator.operations_entry_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'operation % is a journal entry of run % (seq %): its entry is append-only',
        OLD.id, OLD.run_id, OLD.seq USING ERRCODE = 'check_violation';
END
$$;
CREATE TRIGGER operations_entry_append_only
    BEFORE UPDATE OF id, seq, completed_seq, entry_version, run_id, position, attempt,
                     tool_name, tool_version, intent_digest, idempotency_key, effect_class,
                     lease_token, submitted_at, finished_at
    ON orchestrator.operations FOR EACH ROW
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
    EXECUTE FUNCTION orchestrator.operations_entry_append_only();
"""

# The call's entries: its call.submitted entry written with the row, its call.completed entry
# once, with the state that has a receipt, after it. Both carry the row's lease token, so the
# engine writes the second on the row only under that token (else it is a stored row).
ENTRY_CHECK = ("(seq IS NULL OR (seq >= 1 AND entry_version IS NOT NULL)) "
               "AND (completed_seq IS NULL OR (state = 'committed' AND seq IS NOT NULL "
               "AND completed_seq > seq))")


# Whoever could read the journal table (its grants went with it to journal_entries) may read
# the view: a runtime role granted before the upgrade keeps working without a new grant.
VIEW_GRANTS = """
DO $$
DECLARE
    who text;
BEGIN
    FOR who IN
        SELECT DISTINCT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE a.grantee::regrole::text END
        FROM pg_class c, aclexplode(c.relacl) AS a
        WHERE c.oid = 'orchestrator.journal_entries'::regclass AND a.privilege_type = 'SELECT'
          AND a.grantee <> c.relowner
    LOOP
        EXECUTE 'GRANT SELECT ON orchestrator.journal TO ' || who;
    END LOOP;
END
$$;
"""


def _prune_0013() -> str:
    """``prune_runs`` as migration 0013 wrote it (its text is that revision's, for ever)."""
    path = Path(__file__).with_name("0013_retention.py")
    spec = importlib.util.spec_from_file_location("orchestrator_migration_0013", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text: str = module.PRUNE_SQL
    return text


JOURNAL_0013 = ("WITH gone AS (DELETE FROM orchestrator.journal j WHERE j.run_id = ANY(ids) "
                "RETURNING 1)\n    SELECT count(*) INTO n_journal FROM gone;")
# The stored entries deleted, and the operations' entries that leave the view with them (the
# operations stay, as evidence): the journal entries a run had, as before.
ENTRIES = """WITH gone AS (DELETE FROM orchestrator.journal_entries j WHERE j.run_id = ANY(ids)
                  RETURNING 1)
    SELECT count(*) + (SELECT count(o.seq) + count(o.completed_seq)
                       FROM orchestrator.operations o WHERE o.run_id = ANY(ids))
    INTO n_journal FROM gone;"""


def _prune(deletes: str) -> str:
    """0013's ``prune_runs``, replacing itself, deleting the stored entries with ``deletes``."""
    text = _prune_0013()
    assert text.count(JOURNAL_0013) == 1, "migration 0013's prune_runs is not as expected"
    return (text.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
            .replace(JOURNAL_0013, deletes, 1))


def upgrade() -> None:
    op.execute(f"ALTER TABLE {S}.journal RENAME TO journal_entries")
    op.execute(f"ALTER TABLE {S}.journal_entries RENAME CONSTRAINT pk_journal "
               "TO pk_journal_entries")
    op.execute(f"ALTER TABLE {S}.journal_entries RENAME CONSTRAINT ck_journal_seq_positive "
               "TO ck_journal_entries_seq_positive")
    op.execute(f"ALTER TABLE {S}.journal_entries RENAME CONSTRAINT fk_journal_run_id_runs "
               "TO fk_journal_entries_run_id_runs")
    op.add_column("operations", sa.Column("seq", sa.BigInteger(), nullable=True), schema=S)
    op.add_column("operations", sa.Column("completed_seq", sa.BigInteger(), nullable=True),
                  schema=S)
    op.add_column("operations", sa.Column("entry_version", sa.SmallInteger(), nullable=True),
                  schema=S)
    op.execute(f"ALTER TABLE {S}.operations ADD CONSTRAINT ck_operations_entry "
               f"CHECK ({ENTRY_CHECK}) NOT VALID")
    op.execute(f"ALTER TABLE {S}.operations VALIDATE CONSTRAINT ck_operations_entry")
    op.execute(ENTRY_GUARD)
    op.execute(JOURNAL_VIEW)
    op.execute(VIEW_GRANTS)
    op.execute(_prune(ENTRIES))


def downgrade() -> None:
    # Back to stored entries: the operations' entries become rows of the table again.
    op.execute(f"""
        INSERT INTO {S}.journal_entries (run_id, seq, kind, position, name, schema_version,
                                         payload, lease_token, created_at)
        SELECT run_id, seq, kind, position, name, schema_version, payload, lease_token,
               created_at
        FROM {S}.journal
        WHERE (kind = 'call.submitted' AND (run_id, seq) IN (
                   SELECT run_id, seq FROM {S}.operations WHERE seq IS NOT NULL))
           OR (kind = 'call.completed' AND (run_id, seq) IN (
                   SELECT run_id, completed_seq FROM {S}.operations
                   WHERE completed_seq IS NOT NULL))
    """)  # a position taken twice fails here, on the primary key, rather than being skipped
    op.execute(f"DROP VIEW {S}.journal")
    op.execute(_prune(JOURNAL_0013))
    op.execute(f"DROP TRIGGER operations_entry_append_only ON {S}.operations")
    op.execute(f"DROP FUNCTION {S}.operations_entry_append_only()")
    op.execute(f"ALTER TABLE {S}.operations DROP CONSTRAINT ck_operations_entry")
    for column in ("entry_version", "completed_seq", "seq"):
        op.drop_column("operations", column, schema=S)
    op.execute(f"ALTER TABLE {S}.journal_entries RENAME CONSTRAINT fk_journal_entries_run_id_runs "
               "TO fk_journal_run_id_runs")
    op.execute(f"ALTER TABLE {S}.journal_entries RENAME CONSTRAINT "
               "ck_journal_entries_seq_positive TO ck_journal_seq_positive")
    op.execute(f"ALTER TABLE {S}.journal_entries RENAME CONSTRAINT pk_journal_entries "
               "TO pk_journal")
    op.execute(f"ALTER TABLE {S}.journal_entries RENAME TO journal")
