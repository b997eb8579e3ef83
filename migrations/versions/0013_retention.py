"""retention: pruning finished runs, and the ledger's evidence on its own longer period

``runs.pruned_at``: when the run was pruned. A pruned run keeps its row as a tombstone (its
identity, owner, workflow, submission key and request digest, status, outcome and public error)
so that its submission key still answers with it; its journal, its external events, its input
and its result are gone. Its operations, reconciliation items and lookups, its incidents and
the operator audit (the evidence) stay until the evidence period ends.

``orchestrator.prune_runs(keep, names, keeps, lim, dry)`` prunes at most ``lim`` runs finished
longer ago than ``keep`` seconds (or a workflow's own ``keeps`` entry), oldest first, in one
transaction, and never a run with an operation without an outcome (pending, submitted,
unknown), an unresolved reconciliation item, a child that has not finished or a parent that
has not finished. ``dry`` counts them instead and changes nothing.

``orchestrator.expire_evidence(keep, lim, dry)`` deletes at most ``lim`` pruned runs finished
longer ago than ``keep`` seconds and with no child row left (their operations, items and
lookups go with them, by the foreign keys), their incidents, and audit rows and run-less
incidents older than that.

Both are SECURITY DEFINER (owned by the migration role, with a fixed search_path): the runtime
role may EXECUTE ``prune_runs`` (granted by ``orchestrator db grant``), which deletes only the
journals of settled, finished runs, and keeps no DELETE on the journal; ``expire_evidence``,
which deletes evidence, is for the migration role alone.

Revision ID: 0013
Revises: 0012
Create Date: 2026-12-04 01:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0013"
down_revision = "0012"
branch_labels = None
depends_on = None

S = "orchestrator"

PRUNABLE = """
    r.finished_at IS NOT NULL AND r.pruned_at IS NULL
    AND r.finished_at < now() - make_interval(secs => least_keep)
    AND r.finished_at < now() - make_interval(secs => COALESCE(
        (SELECT o.k FROM unnest(names, keeps) AS o(n, k) WHERE o.n = r.workflow_name), keep))
    AND NOT EXISTS (SELECT 1 FROM orchestrator.operations op
                    WHERE op.run_id = r.id AND op.state IN ('pending', 'submitted', 'unknown'))
    AND NOT EXISTS (SELECT 1 FROM orchestrator.reconciliation_items it
                    WHERE it.run_id = r.id AND it.state <> 'resolved')
    AND NOT EXISTS (SELECT 1 FROM orchestrator.runs c
                    WHERE c.parent_run_id = r.id AND c.finished_at IS NULL)
    AND (r.parent_run_id IS NULL OR EXISTS (
        SELECT 1 FROM orchestrator.runs p
        WHERE p.id = r.parent_run_id AND p.finished_at IS NOT NULL))
"""

PRUNE_SQL = f"""
CREATE FUNCTION orchestrator.prune_runs(keep float8, names text[], keeps float8[], lim integer,
                                        dry boolean)
RETURNS TABLE (runs bigint, journal_rows bigint, events bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    least_keep float8;
    ids uuid[];
    n_runs bigint;
    n_journal bigint;
    n_events bigint;
BEGIN
    IF keep IS NULL OR keep < 0 OR lim IS NULL OR lim < 1
       OR coalesce(array_length(names, 1), 0) <> coalesce(array_length(keeps, 1), 0)
       OR EXISTS (SELECT 1 FROM unnest(keeps) AS k WHERE k IS NULL OR k < 0) THEN
        RAISE EXCEPTION 'prune_runs: keep periods must be >= 0, one per name, and lim >= 1'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    SELECT least(keep, coalesce(min(k), keep)) INTO least_keep FROM unnest(keeps) AS k;
    IF dry THEN
        RETURN QUERY SELECT count(*)::bigint, NULL::bigint, NULL::bigint
                     FROM orchestrator.runs r WHERE {PRUNABLE};
        RETURN;
    END IF;
    SELECT array_agg(picked.id) INTO ids FROM (
        SELECT r.id FROM orchestrator.runs r WHERE {PRUNABLE}
        ORDER BY r.finished_at LIMIT lim FOR UPDATE OF r SKIP LOCKED) AS picked;
    IF ids IS NULL THEN
        RETURN QUERY SELECT 0::bigint, 0::bigint, 0::bigint;
        RETURN;
    END IF;
    WITH gone AS (DELETE FROM orchestrator.journal j WHERE j.run_id = ANY(ids) RETURNING 1)
    SELECT count(*) INTO n_journal FROM gone;
    WITH gone AS (DELETE FROM orchestrator.external_events e WHERE e.run_id = ANY(ids)
                  RETURNING 1)
    SELECT count(*) INTO n_events FROM gone;
    WITH done AS (
        UPDATE orchestrator.runs r SET pruned_at = now(), input = 'null'::jsonb, result = NULL
        WHERE r.id = ANY(ids) AND r.pruned_at IS NULL AND r.finished_at IS NOT NULL
        RETURNING 1)
    SELECT count(*) INTO n_runs FROM done;
    RETURN QUERY SELECT n_runs, n_journal, n_events;
END
$$;
REVOKE ALL ON FUNCTION orchestrator.prune_runs(float8, text[], float8[], integer, boolean)
    FROM PUBLIC;
"""

EXPIRE_SQL = """
CREATE FUNCTION orchestrator.expire_evidence(keep float8, lim integer, dry boolean)
RETURNS TABLE (runs bigint, operations bigint, audit bigint, incidents bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    cutoff timestamptz;
    ids uuid[];
    n_runs bigint;
    n_ops bigint;
    n_audit bigint;
    n_incidents bigint;
    n_more bigint;
BEGIN
    IF keep IS NULL OR keep < 0 OR lim IS NULL OR lim < 1 THEN
        RAISE EXCEPTION 'expire_evidence: keep must be >= 0 and lim >= 1'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    cutoff := now() - make_interval(secs => keep);
    IF dry THEN
        RETURN QUERY
        WITH expiring AS (
            SELECT r.id FROM orchestrator.runs r
            WHERE r.pruned_at IS NOT NULL AND r.finished_at < cutoff)
        SELECT (SELECT count(*) FROM expiring),
               (SELECT count(*) FROM orchestrator.operations op
                WHERE op.run_id IN (SELECT e.id FROM expiring)),
               (SELECT count(*) FROM orchestrator.operator_audit a WHERE a.created_at < cutoff),
               (SELECT count(*) FROM orchestrator.incidents i
                WHERE i.run_id IN (SELECT e.id FROM expiring)
                   OR (i.run_id IS NULL AND i.created_at < cutoff));
        RETURN;
    END IF;
    SELECT array_agg(picked.id) INTO ids FROM (
        SELECT r.id FROM orchestrator.runs r
        WHERE r.pruned_at IS NOT NULL AND r.finished_at < cutoff
          AND NOT EXISTS (SELECT 1 FROM orchestrator.runs c WHERE c.parent_run_id = r.id)
        ORDER BY r.finished_at LIMIT lim FOR UPDATE OF r SKIP LOCKED) AS picked;
    ids := coalesce(ids, '{}');
    SELECT count(*) INTO n_ops FROM orchestrator.operations op WHERE op.run_id = ANY(ids);
    WITH gone AS (DELETE FROM orchestrator.incidents i WHERE i.run_id = ANY(ids) RETURNING 1)
    SELECT count(*) INTO n_incidents FROM gone;
    WITH gone AS (DELETE FROM orchestrator.runs r
                  WHERE r.id = ANY(ids) AND r.pruned_at IS NOT NULL RETURNING 1)
    SELECT count(*) INTO n_runs FROM gone;
    WITH gone AS (DELETE FROM orchestrator.operator_audit a WHERE a.id IN (
                      SELECT a2.id FROM orchestrator.operator_audit a2
                      WHERE a2.created_at < cutoff ORDER BY a2.id LIMIT lim)
                  RETURNING 1)
    SELECT count(*) INTO n_audit FROM gone;
    WITH gone AS (DELETE FROM orchestrator.incidents i WHERE i.ref IN (
                      SELECT i2.ref FROM orchestrator.incidents i2
                      WHERE i2.run_id IS NULL AND i2.created_at < cutoff LIMIT lim)
                  RETURNING 1)
    SELECT count(*) INTO n_more FROM gone;
    RETURN QUERY SELECT n_runs, n_ops, n_audit, n_incidents + n_more;
END
$$;
REVOKE ALL ON FUNCTION orchestrator.expire_evidence(float8, integer, boolean) FROM PUBLIC;
"""


def upgrade() -> None:
    op.add_column("runs", sa.Column("pruned_at", sa.DateTime(timezone=True), nullable=True),
                  schema=S)
    op.create_index("ix_runs_prunable", "runs", ["finished_at"], schema=S,
                    postgresql_where=sa.text("finished_at IS NOT NULL AND pruned_at IS NULL"))
    op.create_index("ix_runs_pruned", "runs", ["finished_at"], schema=S,
                    postgresql_where=sa.text("pruned_at IS NOT NULL"))
    op.create_index("ix_reconciliation_items_run_unresolved", "reconciliation_items",
                    ["run_id"], schema=S, postgresql_where=sa.text("state <> 'resolved'"))
    op.execute(PRUNE_SQL)
    op.execute(EXPIRE_SQL)


def downgrade() -> None:
    op.execute("DROP FUNCTION orchestrator.expire_evidence(float8, integer, boolean)")
    op.execute("DROP FUNCTION orchestrator.prune_runs(float8, text[], float8[], integer, "
               "boolean)")
    op.drop_index("ix_reconciliation_items_run_unresolved", table_name="reconciliation_items",
                  schema=S)
    op.drop_index("ix_runs_pruned", table_name="runs", schema=S)
    op.drop_index("ix_runs_prunable", table_name="runs", schema=S)
    op.drop_column("runs", "pruned_at", schema=S)
