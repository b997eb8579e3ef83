"""What one claim from a declared queue costs the server, by the claim function of a revision.

    python -m bench.claim_cost [--runs 20000] [--keys 200] [--levels 20] [--claims 300]
                               [--revisions 0023,head]

One database per revision named (migrated to it), filled with the same runs: ``--runs`` K=1
runs queued in a queue with ``priority=True`` and ``key_concurrency=2``, spread over
``--keys`` concurrency keys and ``--levels`` priority levels, and a third of the keys with
both slots held (their runs claimed once beforehand), as a busy multi-tenant queue looks. Then
``--claims`` calls of ``orchestrator.queue_claim`` for up to 10 runs, each in a transaction
that is rolled back (so every call sees the same queue), the revisions alternating; the
table prints the median and p95 of the server's execution time of one call (from
``EXPLAIN (ANALYZE)`` of the call, which excludes the round trip) and the runs it admitted.

Revision 0023 is the claim of migrations 0012–0020; 0024 reads the keys whose slots are all
held before its windows and every priority level (docs/flow.md). Both are run by this
checkout's migrations, so the one difference is the function.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
import uuid
from typing import Any

import psycopg  # noqa: TID251 - the benchmark builds and inspects its own databases

from bench.common import Server, Table, log
from orchestrator import Orchestrator, Owner
from orchestrator.admission import MAX_PRIORITY
from orchestrator.db import migrate
from orchestrator.db.config import DatabaseTarget

QUEUE = "tenants"


def _app(url: str) -> tuple[Orchestrator, Any]:
    app = Orchestrator(url, default_owner=Owner(tenant="bench", principal="claims"))
    app.queue(QUEUE, key_concurrency=2, priority=True)

    @app.workflow(version="1", name="job", queue=QUEUE)
    async def job(ctx: Any, data: Any) -> Any:
        return data

    return app, job


async def _fill(url: str, runs: int, keys: int, levels: int, seed: int) -> None:
    """The same runs in every database (``seed``), and the same keys busy. The runs are
    written as a submission writes them, by one INSERT of the columns every revision here has
    (this checkout's submission writes columns an older revision lacks): each its own id,
    submitted (and ready) a millisecond after the one before."""
    app, _ = _app(url)
    worker = app.create_worker(concurrency=1)  # writes the queue's declaration
    async with app.database.connection() as conn:
        from orchestrator.db import queues as queues_db

        await queues_db.queue_declare(conn, worker.declared_queues)
    await app.database.close()
    rng = random.Random(seed)
    span = MAX_PRIORITY * 2 // max(levels - 1, 1)  # the levels spread over the whole range
    plan = [(f"k{rng.randrange(keys)}", -MAX_PRIORITY + rng.randrange(levels) * span)
            for _ in range(runs)]
    ids = [uuid.UUID(int=rng.getrandbits(128), version=4) for _ in range(runs)]
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            """INSERT INTO orchestrator.runs (id, tenant, principal, workflow_name,
                   workflow_version, input, options, request_digest, status, available_at,
                   created_at, queue, priority, concurrency_key)
               SELECT t.id, 'bench', 'claims', 'job', '1', to_jsonb(t.i),
                      jsonb_build_object('queue', %(q)s::text, 'priority', t.p,
                                         'concurrency_key', t.k),
                      md5(t.i::text), 'queued', at.t, at.t, %(q)s, t.p, t.k
               FROM unnest(%(ids)s::uuid[], %(keys)s::text[], %(levels)s::int[])
                    WITH ORDINALITY AS t(id, k, p, i)
               CROSS JOIN LATERAL (SELECT now() - (%(n)s - t.i) * interval '1 ms') AS at(t)""",
            {"q": QUEUE, "ids": ids, "keys": [k for k, _ in plan],
             "levels": [p for _, p in plan], "n": runs})
        log(f"claim_cost: {runs:,} runs submitted")
    # A third of the keys with both slots held: started (as a claim leaves them) and running.
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            """WITH busy AS (
                   SELECT id, row_number() OVER (PARTITION BY concurrency_key ORDER BY id) AS n
                   FROM orchestrator.runs
                   WHERE concurrency_key = ANY(%s))
               UPDATE orchestrator.runs r SET status = 'running', started_at = now(),
                      lease_owner = 'bench', lease_token = 1,
                      lease_expires_at = now() + interval '1 hour'
               FROM busy WHERE r.id = busy.id AND busy.n <= 2""",
            ([f"k{i}" for i in range(0, keys, 3)],))
        conn.execute("ANALYZE orchestrator.runs")


def _claim_ms(conn: psycopg.Connection[Any]) -> tuple[float, int]:
    """One claim of up to 10 runs, rolled back: the server's execution time and the runs.
    The connection is kept from claim to claim, as a worker's pooled ones are (the function's
    plans are kept by the session)."""
    row = conn.execute(
        "EXPLAIN (ANALYZE, FORMAT JSON) SELECT * FROM orchestrator.queue_claim("
        "%s, %s, 'bench-claimer', 10, 30.0)", (QUEUE, ["job@1"])).fetchone()
    conn.rollback()
    admitted = conn.execute(
        "SELECT count(*) FROM orchestrator.queue_claim(%s, %s, 'bench-claimer', 10, 30.0) "
        "WHERE id IS NOT NULL", (QUEUE, ["job@1"])).fetchone()
    conn.rollback()
    assert row is not None and admitted is not None
    return float(row[0][0]["Execution Time"]), int(admitted[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=20_000)
    parser.add_argument("--keys", type=int, default=200)
    parser.add_argument("--levels", type=int, default=20, help="at most 2,001")
    parser.add_argument("--claims", type=int, default=300)
    parser.add_argument("--revisions", default="0023,head")
    args = parser.parse_args()
    server = Server.find()
    revisions = args.revisions.split(",")
    urls: dict[str, str] = {}
    try:
        for revision in revisions:
            url = urls[revision] = server.create_database("claims")
            migrate.upgrade(DatabaseTarget(url, "argument"), revision)
            log(f"claim_cost: filling the database at revision {revision}")
            asyncio.run(_fill(url, args.runs, args.keys, args.levels, seed=7))
        times: dict[str, list[float]] = {r: [] for r in revisions}
        admitted: dict[str, list[int]] = {r: [] for r in revisions}
        began = time.monotonic()
        conns = {r: psycopg.connect(urls[r]) for r in revisions}
        for i in range(args.claims):
            for revision in (revisions if i % 2 == 0 else revisions[::-1]):
                ms, n = _claim_ms(conns[revision])
                times[revision].append(ms)
                admitted[revision].append(n)
            if (i + 1) % 100 == 0:
                log(f"claim_cost: {i + 1}/{args.claims} claims each "
                    f"({time.monotonic() - began:.0f} s)")
        for conn in conns.values():
            conn.close()
        table = Table(f"claim_cost: one queue_claim of up to 10 runs ({args.runs:,} queued, "
                      f"{args.keys} keys, a third busy, {args.levels} priority levels)",
                      ["revision", "median ms", "p95 ms", "÷ first", "runs admitted"])
        first = statistics.median(times[revisions[0]])
        for revision in revisions:
            ms = sorted(times[revision])
            median = statistics.median(ms)
            table.add(revision, f"{median:.2f}", f"{ms[int(len(ms) * 0.95) - 1]:.2f}",
                      f"{median / first:.2f}×", f"{statistics.median(admitted[revision]):g}")
        table.notes.append(f"{args.claims} claims per revision, alternating, each rolled back; "
                           "execution time from EXPLAIN (ANALYZE) of the call")
        table.print()
    finally:
        for url in urls.values():
            server.drop_database(url)


if __name__ == "__main__":
    main()
