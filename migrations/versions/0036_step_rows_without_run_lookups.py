"""a step's inserts without foreign-key checks; keyless runs out of the submission key's index

Two costs of the engine's writes that bought nothing the statements do not already give
(server instructions per step of the engine's writes, ``python -m bench.bare --instructions
--ways engine,unguarded --batch 16 --runs 1152 --runs-small 640``, K = 3, PostgreSQL 18.6, each
change made alone to the migrated database of the "unguarded" way):

    the foreign keys of operations.run_id and journal_entries.run_id dropped   0.92x
    the submission key's unique index partial on keyed runs                    0.94x
    both                                                                       0.86x

**The foreign keys of a step's inserts.** Every row inserted into ``operations`` or
``journal_entries`` ran PostgreSQL's referential check (``RI_FKey_check_ins``: a query through
SPI, ``SELECT 1 FROM runs WHERE id = $1 FOR KEY SHARE``, about 35,000 instructions), four a
K = 3 run. Every statement that inserts those rows already reads the run's row in the same
statement: the hot statements update it (the fence, under the lease token and the expected
revision), ``operation_begin`` inserts only ``WHERE EXISTS`` the run running under the
writer's lease, a journal append moves the run's revision, a restart inserts the new run
first. So no writer can insert an entry or an operation of a run that is not there, and runs
are deleted only by ``expire_evidence`` (retention's last stage, for runs pruned long ago,
which nothing writes any more) or by hand. What the foreign keys also did, deleting a run's
operations and stored entries with it (``ON DELETE CASCADE``), the trigger ``runs_delete_ledger``
does now: after a DELETE on ``runs``, one statement for each table removes the rows of the
runs deleted (as the table's owner, as a cascade does; rows of ``reconciliation_items`` still
go with their operation by its own foreign key). A run's row lock is what kept a writer and a
deletion apart, and still is: the fence and the journal's append update the run's row.

**The submission key's unique index.** ``uq_runs_tenant_principal_idempotency_key`` held an
entry for every run, the keyless ones too (NULLs are distinct: they never conflict), and every
update of a run that cannot be HOT (the claim, the end) inserted another. It is now a unique
index of the runs that have a key (``WHERE idempotency_key IS NOT NULL``): the same
conflicts, found the same way (the submission's ``ON CONFLICT DO NOTHING`` names no index;
a lookup ``idempotency_key = …`` implies the predicate).

The migration builds the index first, which holds writes to ``runs`` off (not reads) for its
duration (about as long as 0009's index: 2.4 s for 1,000,000 runs); then it drops the old
constraint and the two foreign keys, each an exclusive lock on ``runs`` (and ``operations``,
``journal_entries``) that blocks reads too and is held until the migration commits, a moment
later. A large installation may build the index first with ``CREATE UNIQUE INDEX
CONCURRENTLY uq_runs_keyed ON orchestrator.runs (tenant, principal, idempotency_key) WHERE
idempotency_key IS NOT NULL``: the migration then checks that it is that index, valid and
ready (a concurrent build that failed leaves an invalid one: it stops, saying so), and only
renames it. ``TRUNCATE orchestrator.runs CASCADE`` no longer reaches ``operations`` and
``journal_entries``, which no foreign key ties to it any more: name them too.

Revision ID: 0036
Revises: 0035
Create Date: 2026-12-07 14:00:00
"""

from __future__ import annotations

from alembic import op

revision = "0036"
down_revision = "0035"
branch_labels = None
depends_on = None

S = "orchestrator"

_DELETE_LEDGER = f"""
CREATE FUNCTION {S}.runs_delete_ledger() RETURNS trigger
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    DELETE FROM {S}.operations o USING gone g WHERE o.run_id = g.id;
    DELETE FROM {S}.journal_entries j USING gone g WHERE j.run_id = g.id;
    RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION {S}.runs_delete_ledger() FROM PUBLIC;
CREATE TRIGGER runs_delete_ledger AFTER DELETE ON {S}.runs
REFERENCING OLD TABLE AS gone FOR EACH STATEMENT EXECUTE FUNCTION {S}.runs_delete_ledger();
"""


KEYED = (f"CREATE UNIQUE INDEX IF NOT EXISTS uq_runs_keyed ON {S}.runs "
         "(tenant, principal, idempotency_key) WHERE idempotency_key IS NOT NULL")

# A ``uq_runs_keyed`` built beforehand must be this index, whole: a ``CREATE INDEX
# CONCURRENTLY`` that failed or was cancelled leaves an invalid one behind, and one of another
# definition would not keep the submission keys unique.
_CHECK_PREBUILT = f"""
DO $$
DECLARE got record;
BEGIN
    SELECT i.indisvalid AND i.indisready AND i.indisunique
               AND i.indrelid = '{S}.runs'::regclass AND i.indexprs IS NULL
               AND am.amname = 'btree'
               AND pg_get_expr(i.indpred, i.indrelid) = '(idempotency_key IS NOT NULL)'
               AND ARRAY(SELECT a.attname::text
                         FROM unnest(i.indkey::int2[]) WITH ORDINALITY AS k(attnum, n)
                         JOIN pg_attribute a ON a.attrelid = i.indrelid
                                            AND a.attnum = k.attnum
                         ORDER BY k.n) = ARRAY['tenant', 'principal', 'idempotency_key']
               AS right, pg_get_indexdef(i.indexrelid) AS def
    INTO got
    FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid JOIN pg_am am ON am.oid = c.relam
    WHERE i.indexrelid = to_regclass('{S}.uq_runs_keyed');
    IF FOUND AND NOT coalesce(got.right, false) THEN
        RAISE EXCEPTION 'the index {S}.uq_runs_keyed is not the one migration 0036 builds'
            USING DETAIL = 'found ' || got.def || ' (or it is not valid and ready)',
                  HINT = 'drop it (DROP INDEX CONCURRENTLY {S}.uq_runs_keyed) and upgrade '
                         'again, or build it again as the migration''s text says';
    END IF;
END $$;
"""


def upgrade() -> None:
    # The index first: building it holds writes to runs off, not reads. Then the catalog
    # changes, each an exclusive lock on runs (and operations, journal_entries) held briefly
    # to the commit.
    op.execute(_CHECK_PREBUILT)
    op.execute(KEYED)
    op.execute(f"ALTER TABLE {S}.runs DROP CONSTRAINT uq_runs_tenant_principal_idempotency_key")
    op.execute(f"ALTER INDEX {S}.uq_runs_keyed RENAME TO uq_runs_tenant_principal_idempotency_key")
    op.execute(f"ALTER TABLE {S}.operations DROP CONSTRAINT fk_operations_run_id_runs")
    op.execute(f"ALTER TABLE {S}.journal_entries DROP CONSTRAINT fk_journal_entries_run_id_runs")
    op.execute(_DELETE_LEDGER)


def downgrade() -> None:
    op.execute(f"DROP INDEX {S}.uq_runs_tenant_principal_idempotency_key")
    op.execute(f"ALTER TABLE {S}.runs ADD CONSTRAINT uq_runs_tenant_principal_idempotency_key "
               "UNIQUE (tenant, principal, idempotency_key)")
    op.execute(f"DROP TRIGGER runs_delete_ledger ON {S}.runs")
    op.execute(f"DROP FUNCTION {S}.runs_delete_ledger()")
    # An operation or an entry of a run deleted while the trigger was disabled makes the keys
    # refuse to be added: the downgrade stops there and deletes no evidence.
    op.execute(f"ALTER TABLE {S}.operations ADD CONSTRAINT fk_operations_run_id_runs "
               f"FOREIGN KEY (run_id) REFERENCES {S}.runs (id) ON DELETE CASCADE")
    op.execute(f"ALTER TABLE {S}.journal_entries ADD CONSTRAINT fk_journal_entries_run_id_runs "
               f"FOREIGN KEY (run_id) REFERENCES {S}.runs (id) ON DELETE CASCADE")
