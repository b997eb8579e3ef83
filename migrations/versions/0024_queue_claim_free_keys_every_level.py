"""queue claim: a busy key's backlog hides no other key; every priority level is read

``orchestrator.queue_claim`` reads its candidates in windows: the ``scan`` longest waiting
ready runs of the queue and, with priorities, the ``scan`` best by stored priority (migration
0012). Two waits the docs bound had no bound:

- With ``key_concurrency``, a key whose slots are all held cannot start a run, yet its ready
  runs filled the window: with more of them waiting than the window reads (500 for a worker
  with up to 10 free slots), every other key waited behind them, however free, until the busy
  key's backlog drained below the window (one customer's bulk import held every other
  customer back for as long as it ran).
- With priorities, a run's rank gains a level per ``priority_aging``, so the best ranked run
  may be neither among the longest waiting nor among the best by stored priority: a run of
  priority 1 that had waited past its bound stayed behind runs of priority 0 submitted after
  it for as long as older runs of a worse priority stood at the head of the line (with a
  priority of 1000 at the head and the default aging, about 16 hours instead of 60 seconds).

The function now reads, before its candidates, the keys whose slots are all held (from
``ix_runs_queue_held``: the runs started and not finished) and passes over their runs that
would need a slot; and, with priorities, in place of the best by stored priority, the
``take`` longest waiting ready runs of each priority level that a waiting run has, the 64
lowest at most (the levels found by a skip scan of ``ix_runs_queue_priority``, one probe each;
with 2,001 levels in use, all of them made a claim ten times slower: ``python -m
bench.claim_cost --levels 2001``). Within a level the longest waiting run ranks first, so the
best ranked runs are among these while no more than 64 levels wait. How a claim chooses among
its candidates, and every limit, are unchanged.

Revision ID: 0024
Revises: 0023
Create Date: 2026-12-06 12:00:00
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0024"
down_revision = "0023"
branch_labels = None
depends_on = None

DECLARED_0020 = """    froms text[];
"""
DECLARED = """    froms text[];
    busy text[] := '{}';
    levels integer[] := '{}';
"""

BUSY = """
    -- The keys whose slots are all held: none of their runs that needs a slot can start
    -- now, so the windows below pass them over (one key's backlog never hides the others).
    IF cfg.key_concurrency IS NOT NULL THEN
        busy := ARRAY(
            SELECT h.concurrency_key FROM orchestrator.runs AS h
            WHERE h.queue = q AND h.concurrency_key IS NOT NULL
              AND h.started_at IS NOT NULL AND h.finished_at IS NULL
              AND (cfg.count_parked OR h.status <> 'waiting')
            GROUP BY h.concurrency_key
            HAVING count(*) >= cfg.key_concurrency);
    END IF;
    -- With priorities: each priority level a waiting run has, lowest first (a skip scan of
    -- ix_runs_queue_priority, one probe per level), the 64 lowest at most: each costs the
    -- claim a probe and a window (2,001 levels in use made a claim ten times slower).
    IF cfg.priority THEN
        levels := ARRAY(
            WITH RECURSIVE found (level) AS (
                SELECT min(r.priority) FROM orchestrator.runs AS r
                WHERE r.queue = q AND r.status IN ('queued', 'waiting')
                  AND r.available_at IS NOT NULL
                UNION ALL
                SELECT (SELECT min(r.priority) FROM orchestrator.runs AS r
                        WHERE r.queue = q AND r.status IN ('queued', 'waiting')
                          AND r.available_at IS NOT NULL AND r.priority > f.level)
                FROM found AS f WHERE f.level IS NOT NULL)
            SELECT found.level FROM found WHERE found.level IS NOT NULL LIMIT 64);
    END IF;
"""

# A run that may start as far as its key says: no key, a key with a free slot, or a slot of
# its own already held. (Plain ORs, which the planner estimates: the windows stay index scans.)
FREE_KEY = """
           AND (r.concurrency_key IS NULL OR r.concurrency_key <> ALL(busy)
                OR (r.started_at IS NOT NULL AND (r.status = 'queued' OR cfg.count_parked)))"""
LATERAL_KEY = FREE_KEY.replace("\n", "\n    ")

WINDOWS_0020 = """    WITH scanned AS (
        -- The longest waiting and (with priorities) the best by priority, each read in index
        -- order: a run that waits long enough is among the candidates whatever its priority.
        (SELECT r.id FROM orchestrator.runs AS r
         WHERE r.queue = q AND r.status IN ('queued', 'waiting') AND r.available_at IS NOT NULL
           AND r.available_at <= now()
           AND r.workflow_name || '@' || r.workflow_version = ANY(workflows)
         ORDER BY r.available_at LIMIT scan)
        UNION
        (SELECT r.id FROM orchestrator.runs AS r
         WHERE cfg.priority AND r.queue = q AND r.status IN ('queued', 'waiting')
           AND r.available_at IS NOT NULL AND r.available_at <= now()
           AND r.workflow_name || '@' || r.workflow_version = ANY(workflows)
         ORDER BY r.priority, r.available_at LIMIT scan)
"""

WINDOWS = BUSY.lstrip("\n") + f"""
    WITH scanned AS (
        -- The longest waiting, and (with priorities) the ``take`` longest waiting of each
        -- priority level, each read in index order: within a level the longest waiting ranks
        -- first, so the best ranked runs are among these whatever their priority and age.
        (SELECT r.id FROM orchestrator.runs AS r
         WHERE r.queue = q AND r.status IN ('queued', 'waiting') AND r.available_at IS NOT NULL
           AND r.available_at <= now()
           AND r.workflow_name || '@' || r.workflow_version = ANY(workflows){FREE_KEY}
         ORDER BY r.available_at LIMIT scan)
        UNION
        (SELECT w.id FROM unnest(levels) AS l(level)
         CROSS JOIN LATERAL (
             SELECT r.id FROM orchestrator.runs AS r
             WHERE r.queue = q AND r.priority = l.level AND r.status IN ('queued', 'waiting')
               AND r.available_at IS NOT NULL AND r.available_at <= now()
               AND r.workflow_name || '@' || r.workflow_version = ANY(workflows){LATERAL_KEY}
             ORDER BY r.available_at LIMIT take) AS w)
"""


def _claim_0020() -> str:
    """The claim function as migration 0020 left it (its text is that revision's, for ever)."""
    path = Path(__file__).with_name("0020_queue_claim_when_ready.py")
    spec = importlib.util.spec_from_file_location("orchestrator_migration_0020", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text: str = module._claim_0018().replace(module.OPENING, module.READY_FIRST, 1)
    for part in (DECLARED_0020, WINDOWS_0020):
        assert text.count(part) == 1, "migration 0020's queue_claim is not as expected"
    return text


def upgrade() -> None:
    op.execute(_claim_0020().replace(DECLARED_0020, DECLARED, 1)
               .replace(WINDOWS_0020, WINDOWS, 1))


def downgrade() -> None:
    op.execute(_claim_0020())
