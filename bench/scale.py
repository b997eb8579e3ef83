"""History at scale: fill the engine's tables with finished runs, their journals and operations.

Rows are generated in SQL (``INSERT … SELECT … generate_series``), shaped exactly like what the
engine writes for a succeeded run of K ``noop`` steps: the run row (``succeeded``, revision
2K+1, lease token 1), per step an operation (``committed`` with receipt and digest) and two
journal events (``call.submitted``, ``call.completed``), then ``run.completed``. On a schema
where a call's entries are its operation row (migration 0019: ``journal_entries`` exists), the
two call entries are the operation's ``seq`` and ``completed_seq`` and only ``run.completed``
is a stored row; on an older one (``bench --engine`` of an older commit), all are rows of
``journal``. Foreign keys and
triggers are skipped while loading (``session_replication_role = replica``, this session only):
the rows are consistent by construction, and the operation trigger would refuse to *create* an
operation in its final state, which is the point of it. Then VACUUM ANALYZE, as autovacuum
would have done to a table that old.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import psycopg  # noqa: TID251 - bulk fixtures

from bench.common import fetch_one, log

S = "orchestrator"

_FILLER = """
CREATE UNLOGGED TABLE public.bench_filler AS
SELECT i, gen_random_uuid() AS id,
       now() - interval '30 days' + (i::float8 / %(n)s) * interval '29 days' AS t
FROM generate_series(1, %(n)s) AS i
"""

_RUNS = f"""
INSERT INTO {S}.runs (id, tenant, principal, workflow_name, workflow_version, input, options,
                      request_digest, idempotency_key, status, result, lease_owner, lease_token,
                      revision, created_at, updated_at, finished_at)
SELECT id, 'bench', 'bench', 'k' || %(k)s, '1', jsonb_build_object('n', i), '{{}}'::jsonb,
       md5('req' || i), NULL, 'succeeded',
       jsonb_build_object('first_t', extract(epoch FROM t),
                          'last', jsonb_build_object('ok', true, 'i', %(k)s - 1,
                                                     't', extract(epoch FROM t))),
       NULL, 1, 2 * %(k)s + 1, t, t + interval '20 ms', t + interval '20 ms'
FROM public.bench_filler
"""

_OPERATIONS = f"""
INSERT INTO {S}.operations (id, run_id, position, attempt, tool_name, tool_version,
                            effect_class, tenant, principal, intent_digest, arguments,
                            idempotency_key, state, receipt, receipt_digest, worker_id,
                            lease_token, created_at, submitted_at, finished_at, updated_at
                            {{entry_columns}})
SELECT (f.i - 1) * %(k)s + p + 1, f.id, p, 1, 'noop', '1', 'consequential', 'bench', 'bench',
       md5('intent' || p), jsonb_build_object('i', p), f.id::text || ':' || p || ':1',
       'committed', jsonb_build_object('ok', true, 'i', p, 't', extract(epoch FROM f.t)),
       md5('receipt' || f.i || ':' || p), 'filler:1:000000', 1,
       f.t + p * interval '5 ms', f.t + p * interval '5 ms', f.t + p * interval '5 ms',
       f.t + p * interval '5 ms' {{entry_values}}
FROM public.bench_filler f CROSS JOIN generate_series(0, %(k)s - 1) AS p
"""
_ENTRY_COLUMNS = ", seq, completed_seq, entry_version"
_ENTRY_VALUES = ", 2 * p + 1, 2 * p + 2, 1"

_JOURNAL = f"""
INSERT INTO {S}.{{journal}} (run_id, seq, kind, position, name, schema_version, payload,
                         lease_token, created_at)
SELECT f.id, s,
       CASE WHEN s = 2 * %(k)s + 1 THEN 'run.completed'
            WHEN s %% 2 = 1 THEN 'call.submitted' ELSE 'call.completed' END,
       CASE WHEN s = 2 * %(k)s + 1 THEN NULL ELSE (s - 1) / 2 END,
       CASE WHEN s = 2 * %(k)s + 1 THEN NULL ELSE 'noop' END,
       1,
       CASE WHEN s = 2 * %(k)s + 1 THEN
                jsonb_build_object('result', jsonb_build_object('ok', true))
            WHEN s %% 2 = 1 THEN
                jsonb_build_object('tool_version', '1', 'intent', md5('intent' || (s - 1) / 2),
                                   'attempt', 1, 'op', (f.i - 1) * %(k)s + (s - 1) / 2 + 1,
                                   'key', f.id::text || ':' || (s - 1) / 2 || ':1',
                                   'effect', 'consequential')
            ELSE jsonb_build_object('result', jsonb_build_object('ok', true, 'i', (s - 1) / 2),
                                    'op', (f.i - 1) * %(k)s + (s - 1) / 2 + 1) END,
       1, f.t + s * interval '2 ms'
FROM public.bench_filler f CROSS JOIN generate_series(1, 2 * %(k)s + 1) AS s
{{only_end}}
"""


async def _load(url: str, sql: str, params: dict[str, Any], what: str) -> float:
    started = time.monotonic()
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute("SET session_replication_role = replica")
        await conn.execute("SET maintenance_work_mem = '256MB'")
        await conn.execute(sql, params)
    seconds = time.monotonic() - started
    log(f"scale: {what} loaded in {seconds:.0f}s")
    return seconds


async def fill(url: str, *, runs: int, k: int = 3) -> dict[str, Any]:
    """Load ``runs`` finished runs of ``k`` steps (runs, operations and journal in parallel)."""
    started = time.monotonic()
    params = {"n": runs, "k": k}
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(_FILLER, params)
        entries_on_operations = (await fetch_one(
            conn, f"SELECT to_regclass('{S}.journal_entries') IS NOT NULL"))[0]
    if entries_on_operations:
        operations = _OPERATIONS.format(entry_columns=_ENTRY_COLUMNS, entry_values=_ENTRY_VALUES)
        journal = _JOURNAL.format(journal="journal_entries",
                                  only_end="WHERE s = 2 * %(k)s + 1")
        stored = runs
    else:
        operations = _OPERATIONS.format(entry_columns="", entry_values="")
        journal = _JOURNAL.format(journal="journal", only_end="")
        stored = runs * (2 * k + 1)
    table = "journal_entries" if entries_on_operations else "journal"
    await asyncio.gather(
        _load(url, _RUNS, params, f"{runs:,} runs"),
        _load(url, operations, params, f"{runs * k:,} operations"),
        _load(url, journal, params, f"{stored:,} stored journal entries"))
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute("DROP TABLE public.bench_filler")
        await conn.execute(
            f"SELECT setval(pg_get_serial_sequence('{S}.operations', 'id'), %s)",
            (runs * k + 1,))
        await conn.execute(f"VACUUM ANALYZE {S}.runs")
        await conn.execute(f"VACUUM ANALYZE {S}.operations")
        await conn.execute(f"VACUUM ANALYZE {S}.{table}")
        row = await fetch_one(
            conn, "SELECT pg_total_relation_size(%s) + pg_total_relation_size(%s) "
            "+ pg_total_relation_size(%s)", (f"{S}.runs", f"{S}.operations", f"{S}.{table}"))
        size = int(row[0])
    seconds = time.monotonic() - started
    log(f"scale: {runs:,} finished runs ready in {seconds:.0f}s ({size / 2**30:.1f} GiB)")
    return {"filler_runs": runs, "filler_k": k, "fill_seconds": seconds,
            "tables_gib": size / 2**30}


async def unsettle(url: str, *, runs: int) -> list[str]:
    """Give ``runs`` of the loaded history an operation whose outcome is unknown (submitted,
    then moved to unknown, as the engine would): runs retention must never prune."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        cur = await conn.execute(
            f"""
            WITH picked AS (SELECT id, tenant, principal FROM {S}.runs
                            WHERE status = 'succeeded' ORDER BY random() LIMIT %s)
            INSERT INTO {S}.operations (run_id, position, attempt, tool_name, tool_version,
                                        effect_class, tenant, principal, intent_digest,
                                        arguments, idempotency_key, state)
            SELECT id, 99, 1, 'noop', '1', 'consequential', tenant, principal, 'held',
                   '{{}}'::jsonb, id::text || ':99:1', 'submitted' FROM picked
            RETURNING run_id""", (runs,))
        ids = [str(row[0]) for row in await cur.fetchall()]
        await conn.execute(f"UPDATE {S}.operations SET state = 'unknown' WHERE position = 99 "
                           "AND intent_digest = 'held'")
    return ids


async def unpruned(url: str, ids: list[str]) -> int:
    """How many of the runs ``ids`` are not pruned."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        row = await fetch_one(conn, f"SELECT count(*) FROM {S}.runs WHERE id = ANY(%s::uuid[]) "
                              "AND pruned_at IS NULL", (ids,))
    return int(row[0])
