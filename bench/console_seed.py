"""A console's history: finished runs of several tenants, workflows and versions, and a
reconciliation queue, loaded by SQL and kept between benchmark runs.

``ensure(server, runs=N)`` returns the URL of a database named ``bench_console_<N>_<digest>``
that holds, on the engine's current schema:

- ``N`` runs created over 90 days (evenly spread, newest last) by four tenants (40, 30, 20 and
  10 %), six workflows (35 % down to 5 %) in versions 1 to 3 (by age); 90 % succeeded, 7 %
  failed, 3 % cancelled; inputs like ``{"customer": "c123", "amount": 42, "currency":
  "EUR"}``; a third of them with a submission key; ids are version 7 UUIDs of their time,
  as the engine makes them.
- one operation in the reconciliation queue for every 333rd run: in its last 30 days still
  unresolved (30 % ``open``, 70 % ``operator``, the run ``needs_reconciliation``), before that
  ``resolved`` (committed, not applied or abandoned).

The name's digest covers the migrations' revisions and the loading statements: a database made for
another schema or another shape is not reused (a stale one is dropped). Foreign keys and
triggers are off while loading (``session_replication_role = replica``, as bench/scale.py
does: the operation trigger refuses to create an operation in a final state); CHECK
constraints hold. The runs go in ten slices, each logged, then VACUUM ANALYZE. Nothing writes
to it afterwards: the console sections only read it.
"""

from __future__ import annotations

import hashlib
import time
from pathlib import Path
from typing import Any

import psycopg  # noqa: TID251 - bulk fixtures

from bench.common import Server, log, migrate

S = "orchestrator"
ROOT = Path(__file__).resolve().parents[1]
TENANTS = ("acme", "globex", "initech", "umbrella")
WORKFLOWS = ("invoice", "refund", "onboarding", "report", "sync", "payout")
TOOLS = ("charge_card", "send_email", "create_invoice", "ship_order")
QUEUE_EVERY = 333
SLICES = 10

# Deterministic per run number i (1 = oldest): its time, id, tenant, workflow and status.
_FUNCTIONS = f"""
CREATE FUNCTION public.bench_t(i bigint, n bigint, anchor timestamptz) RETURNS timestamptz
LANGUAGE sql IMMUTABLE AS $$
    SELECT anchor - interval '90 days' + (i::float8 / n) * interval '90 days'
$$;
CREATE FUNCTION public.bench_id(i bigint, t timestamptz) RETURNS uuid
LANGUAGE sql IMMUTABLE AS $$
    SELECT (lpad(to_hex((extract(epoch FROM t) * 1000)::bigint), 12, '0') || '7'
            || substr(md5(i::text), 1, 3) || '8' || substr(md5(i::text), 4, 15))::uuid
$$;
CREATE FUNCTION public.bench_status(i bigint, n bigint) RETURNS text
LANGUAGE sql IMMUTABLE AS $$
    SELECT CASE
        WHEN i % {QUEUE_EVERY} = 0 AND i > n - n / 3 THEN 'needs_reconciliation'
        WHEN (i * 7919 + 13) % 1000 < 900 THEN 'succeeded'
        WHEN (i * 7919 + 13) % 1000 < 970 THEN 'failed'
        ELSE 'cancelled' END
$$;
"""

_DROP_FUNCTIONS = """
DROP FUNCTION public.bench_t(bigint, bigint, timestamptz);
DROP FUNCTION public.bench_id(bigint, timestamptz);
DROP FUNCTION public.bench_status(bigint, bigint);
"""

_RUNS = f"""
INSERT INTO {S}.runs (id, tenant, principal, workflow_name, workflow_version, input, options,
                      request_digest, idempotency_key, status, outcome_code, result, error,
                      lease_token, revision, created_at, updated_at, finished_at)
SELECT public.bench_id(i, t),
       CASE WHEN h1 < 40 THEN 'acme' WHEN h1 < 70 THEN 'globex' WHEN h1 < 90 THEN 'initech'
            ELSE 'umbrella' END,
       'svc-' || (i %% 7),
       CASE WHEN h2 < 35 THEN 'invoice' WHEN h2 < 60 THEN 'refund'
            WHEN h2 < 75 THEN 'onboarding' WHEN h2 < 87 THEN 'report'
            WHEN h2 < 95 THEN 'sync' ELSE 'payout' END,
       (1 + (3 * i - 1) / %(n)s)::text,
       jsonb_build_object('customer', 'c' || (i * 31 %% 50000), 'amount', i %% 1000,
                          'currency', 'EUR'),
       '{{}}'::jsonb, md5('req' || i),
       CASE WHEN i %% 3 = 0 THEN 'sub-' || i END, status,
       CASE status WHEN 'failed' THEN 'TOOL_FAILED' WHEN 'cancelled' THEN 'CANCELLED' END,
       CASE WHEN status = 'succeeded' THEN jsonb_build_object('ok', true, 'n', i %% 100) END,
       CASE WHEN status = 'failed' THEN jsonb_build_object(
                'code', 'TOOL_FAILED', 'message', 'the upstream answered 502') END,
       1, 7, t, t + interval '1.5 s',
       CASE WHEN status <> 'needs_reconciliation' THEN t + interval '1.5 s' END
FROM (SELECT i, public.bench_t(i, %(n)s, %(anchor)s) AS t, public.bench_status(i, %(n)s) AS status,
             abs(hashtext('t' || i)) %% 100 AS h1, abs(hashtext('w' || i)) %% 100 AS h2
      FROM generate_series(%(lo)s::bigint, %(hi)s::bigint) AS i) g
"""

# One queued operation for every QUEUE_EVERY-th run; state by the run's status and number.
_OPERATIONS = f"""
INSERT INTO {S}.operations (id, run_id, position, attempt, tool_name, tool_version,
                            effect_class, tenant, principal, intent_digest, arguments,
                            idempotency_key, state, receipt, receipt_digest, worker_id,
                            lease_token, created_at, submitted_at, finished_at, updated_at)
SELECT r.i / {QUEUE_EVERY}, r.id, 0, 1, (%(tools)s::text[])[1 + r.i %% 4], '1', 'consequential',
       r.tenant, r.principal, md5('intent' || r.i), r.input,
       r.id::text || ':0:1', r.state,
       CASE WHEN r.state = 'committed' THEN jsonb_build_object('ref', 'ch_' || r.i) END,
       CASE WHEN r.state = 'committed' THEN md5('receipt' || r.i) END,
       'bench:1:000000', 1, r.created_at + interval '0.5 s', r.created_at + interval '0.5 s',
       CASE WHEN r.state <> 'unknown' THEN r.created_at + interval '1 hour' END,
       r.created_at + interval '1 hour'
FROM (SELECT g.i, x.id, x.tenant, x.principal, x.input, x.created_at,
             CASE WHEN x.status = 'needs_reconciliation' THEN 'unknown'
                  ELSE (ARRAY['committed', 'not_applied', 'abandoned'])
                           [1 + g.i / {QUEUE_EVERY} %% 3] END AS state
      FROM generate_series({QUEUE_EVERY}, %(n)s, {QUEUE_EVERY}) AS g(i)
      JOIN {S}.runs x ON x.id = public.bench_id(g.i, public.bench_t(g.i, %(n)s, %(anchor)s))
     ) r
"""

_ITEMS = f"""
INSERT INTO {S}.reconciliation_items (operation_id, run_id, reason, state, lookup_attempts,
                                      next_attempt_at, resolution, evidence, created_at,
                                      resolved_at)
SELECT o.id, o.run_id, 'lease_expired_after_submit', item_state, lookups,
       CASE WHEN item_state = 'open' THEN %(anchor)s::timestamptz + interval '10 min'
            ELSE o.created_at + interval '1 min' END,
       CASE WHEN item_state = 'resolved' THEN o.state END,
       CASE WHEN item_state = 'resolved' THEN jsonb_build_array(jsonb_build_object(
                'operator', 'alice', 'evidence', 'checked the provider dashboard'))
            ELSE '[]'::jsonb END,
       o.created_at + interval '1 min',
       CASE WHEN item_state = 'resolved' THEN o.created_at + interval '1 hour' END
FROM (SELECT o.*, CASE WHEN o.state <> 'unknown' THEN 'resolved'
                       WHEN o.id %% 10 < 3 THEN 'open' ELSE 'operator' END AS item_state,
             CASE WHEN o.state = 'unknown' AND o.id %% 10 < 3 THEN 1 ELSE 3 END AS lookups
      FROM {S}.operations o) o
"""


def digest(runs: int) -> str:
    """What the kept database depends on: the schema (the migrations' revisions, by their file
    names), the statements that load it (their words: reflowing them changes nothing) and the
    size."""
    h = hashlib.sha256(str(runs).encode())
    for path in sorted((ROOT / "migrations" / "versions").glob("*.py")):
        h.update(path.name.encode())
    for sql in (_FUNCTIONS, _RUNS, _OPERATIONS, _ITEMS, str(QUEUE_EVERY)):
        h.update(" ".join(sql.replace("[", " [").split()).encode())
    return h.hexdigest()[:10]


def name_for(runs: int) -> str:
    return f"bench_console_{runs}_{digest(runs)}"


def ensure(server: Server, *, runs: int) -> tuple[str, dict[str, Any]]:
    """The kept database's URL (made now if missing), and how it was got."""
    name = name_for(runs)
    prefix = f"bench_console_{runs}_"
    with psycopg.connect(server.admin_url, autocommit=True) as conn:
        found = [r[0] for r in conn.execute(
            "SELECT datname FROM pg_database WHERE starts_with(datname, %s)", (prefix,))]
        for stale in found:
            if stale != name:
                log(f"console: dropping {stale} (another schema or shape)")
                conn.execute(f'DROP DATABASE "{stale}" WITH (FORCE)')
        if name in found:
            ready = _ready(server.url(name))
            if ready:
                log(f"console: reusing {name} ({runs:,} runs)")
                return server.url(name), {"database": name, "reused": True, "seconds": 0.0}
            conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{name}"')
    url = server.url(name)
    started = time.monotonic()
    try:
        migrate(url)
        _load(url, runs)
    except BaseException:
        server.drop_database(url)
        raise
    seconds = time.monotonic() - started
    return url, {"database": name, "reused": False, "seconds": seconds}


def _ready(url: str) -> bool:
    """Whether the load finished (its last step leaves a marker comment on the database)."""
    with psycopg.connect(url) as conn:
        row = conn.execute(
            "SELECT shobj_description(oid, 'pg_database') FROM pg_database "
            "WHERE datname = current_database()").fetchone()
    return row is not None and row[0] == "bench console history: complete"


def _load(url: str, runs: int) -> None:
    started = time.monotonic()
    params: dict[str, Any] = {"n": runs, "tools": list(TOOLS)}
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET session_replication_role = replica")
        conn.execute("SET maintenance_work_mem = '256MB'")
        conn.execute(_FUNCTIONS)
        params["anchor"] = fetch_sync(conn, "SELECT date_trunc('second', now())")
        step = -(-runs // SLICES)
        for lo in range(1, runs + 1, step):
            hi = min(runs, lo + step - 1)
            conn.execute(_RUNS, {**params, "lo": lo, "hi": hi})
            log(f"console: runs {hi:,}/{runs:,} loaded ({time.monotonic() - started:.0f}s)")
        conn.execute(_OPERATIONS, params)
        conn.execute(_ITEMS, params)
        conn.execute(f"SELECT setval(pg_get_serial_sequence('{S}.operations', 'id'), "
                     f"{runs // QUEUE_EVERY + 1})")
        items = fetch_sync(conn, f"SELECT count(*) FROM {S}.reconciliation_items")
        log(f"console: {items:,} queue items loaded ({time.monotonic() - started:.0f}s)")
        conn.execute(_DROP_FUNCTIONS)
        for table in ("runs", "operations", "reconciliation_items"):
            conn.execute(f"VACUUM ANALYZE {S}.{table}")
        conn.execute("DO $$ BEGIN EXECUTE format('COMMENT ON DATABASE %I IS %L', "
                     "current_database(), 'bench console history: complete'); END $$")
    log(f"console: history ready in {time.monotonic() - started:.0f}s")


def fetch_sync(conn: psycopg.Connection[Any], sql: str) -> Any:
    row = conn.execute(sql).fetchone()
    if row is None:
        raise RuntimeError(f"no row from: {sql[:80]}")
    return row[0]
