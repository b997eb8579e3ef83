"""expire_evidence: an audit row stays while the run or operation it is about does

``orchestrator.expire_evidence`` (migrations 0013, 0023 and 0025) deleted every operator audit
row older than the evidence period, whatever it was about. A run is never pruned while it has
an operation without an outcome or an unresolved reconciliation item, and its evidence stays
for the evidence period after it finished; but the audit of what operators did to it went by
the row's own age: who resolved an earlier attempt of a call that waits for a resolution again,
who cancelled a run parked on an unknown operation, was deleted while the run, its journal and
its operations were kept.

An audit row about an operation (``target_kind`` ``operation``) or a run (``run``) now stays
while that operation or run does, and goes with it (or at the next batch) once older than the
period; other rows (a queue's) go by their age as before. The dry run counts the same rows.
Only the function changes.

Revision ID: 0026
Revises: 0025
Create Date: 2026-12-06 12:00:00
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0026"
down_revision = "0025"
branch_labels = None
depends_on = None

EXPIRE_SQL = """
CREATE OR REPLACE FUNCTION orchestrator.expire_evidence(keep float8, lim integer, dry boolean)
RETURNS TABLE (runs bigint, operations bigint, audit bigint, incidents bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    cutoff timestamptz;
    followed uuid[];
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
    -- The runs a schedule follows: from the one it fired last through the generations it
    -- continued as, while the newest of them has not finished.
    WITH RECURSIVE chain AS (
        SELECT s.id AS schedule_id, r.id, r.outcome_code, r.superseded_by, r.finished_at
        FROM orchestrator.schedules s JOIN orchestrator.runs r ON r.id = s.last_run_id
        UNION ALL
        SELECT c.schedule_id, n.id, n.outcome_code, n.superseded_by, n.finished_at
        FROM chain c JOIN orchestrator.runs n ON n.id = c.superseded_by
        WHERE c.outcome_code = 'CONTINUED_AS_NEW')
    SELECT array_agg(c.id) INTO followed FROM chain c
    WHERE EXISTS (SELECT 1 FROM chain e
                  WHERE e.schedule_id = c.schedule_id AND e.finished_at IS NULL);
    followed := coalesce(followed, '{}');
    IF dry THEN
        RETURN QUERY
        WITH expiring AS (
            SELECT r.id FROM orchestrator.runs r
            WHERE r.pruned_at IS NOT NULL AND r.finished_at < cutoff
              AND NOT EXISTS (SELECT 1 FROM orchestrator.runs c
                              WHERE c.parent_run_id = r.id)
              AND r.id <> ALL(followed))
        SELECT (SELECT count(*) FROM expiring),
               (SELECT count(*) FROM orchestrator.operations op
                WHERE op.run_id IN (SELECT e.id FROM expiring e)),
               (SELECT count(*) FROM orchestrator.operator_audit a
                WHERE a.created_at < cutoff AND NOT (CASE a.target_kind
                    WHEN 'operation' THEN EXISTS (
                        SELECT 1 FROM orchestrator.operations op
                        WHERE op.id = a.target_id::bigint
                          AND op.run_id NOT IN (SELECT e.id FROM expiring e))
                    WHEN 'run' THEN EXISTS (
                        SELECT 1 FROM orchestrator.runs r
                        WHERE r.id = a.target_id::uuid
                          AND r.id NOT IN (SELECT e.id FROM expiring e))
                    ELSE false END)),
               (SELECT count(*) FROM orchestrator.incidents i
                WHERE i.run_id IN (SELECT e.id FROM expiring e)
                   OR (i.run_id IS NULL AND i.created_at < cutoff));
        RETURN;
    END IF;
    SELECT array_agg(picked.id) INTO ids FROM (
        SELECT r.id FROM orchestrator.runs r
        WHERE r.pruned_at IS NOT NULL AND r.finished_at < cutoff
          AND NOT EXISTS (SELECT 1 FROM orchestrator.runs c WHERE c.parent_run_id = r.id)
          AND r.id <> ALL(followed)
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
                      WHERE a2.created_at < cutoff AND NOT (CASE a2.target_kind
                          WHEN 'operation' THEN EXISTS (
                              SELECT 1 FROM orchestrator.operations op
                              WHERE op.id = a2.target_id::bigint)
                          WHEN 'run' THEN EXISTS (
                              SELECT 1 FROM orchestrator.runs r
                              WHERE r.id = a2.target_id::uuid)
                          ELSE false END)
                      ORDER BY a2.id LIMIT lim)
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


def _expire_0025() -> str:
    """``expire_evidence`` as migration 0025 left it (that revision's text, for ever)."""
    path = Path(__file__).with_name("0025_expire_evidence_keeps_schedule_chains.py")
    spec = importlib.util.spec_from_file_location("orchestrator_migration_0025", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text: str = module.EXPIRE_SQL
    return text


def upgrade() -> None:
    op.execute(EXPIRE_SQL)


def downgrade() -> None:
    op.execute(_expire_0025())
