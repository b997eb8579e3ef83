"""expire_evidence: the chain of runs a schedule follows stays while it runs

A schedule's overlap policy reads ``schedules.last_run_id``, the run it fired last, and, when
that run continued as new (``ctx.continue_as_new``), follows ``superseded_by`` to the newest
generation of its chain to see whether it is still running (``run_last_id``). The first
generations finish long before the chain does, so they were pruned and, once the evidence
period had passed, deleted: the schedule then found no run, took the chain for ended and fired
its next slot beside the generation still running (``skip`` and the buffers let runs overlap;
``cancel_other`` cancelled nothing).

``orchestrator.expire_evidence`` (migrations 0013 and 0023) now keeps every run of such a
chain, from the run a schedule names to the newest generation, while that generation has not
finished; once it has, the chain's rows go as any others (the schedule then finds it ended, as
it would find the run itself). Its dry run counts the same runs. Only the function changes.

Revision ID: 0025
Revises: 0024
Create Date: 2026-12-06 11:00:00
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0025"
down_revision = "0024"
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
               (SELECT count(*) FROM orchestrator.operator_audit a WHERE a.created_at < cutoff),
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


def _expire_0023() -> str:
    """``expire_evidence`` as migration 0023 left it (that revision's text, for ever)."""
    path = Path(__file__).with_name("0023_expire_evidence_dry_run.py")
    spec = importlib.util.spec_from_file_location("orchestrator_migration_0023", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text: str = module._fixed()
    return text


def upgrade() -> None:
    op.execute(EXPIRE_SQL)


def downgrade() -> None:
    op.execute(_expire_0023())
