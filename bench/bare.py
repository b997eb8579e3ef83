"""The least a ledgered step can cost the server: ``python -m bench.bare``.

Issue 35 asks for half the server's CPU per effect step of commit b5df86e. This measures how
far below the engine's writes any schema can go that still records a call before it is made
and its outcome after, fenced by the run's lease. In one database per repetition, on one
connection each, in batches of the same size, it drives the same number of K-step runs four
ways and measures the CPU of that database's backends (the server's work for those writes, and
nothing else the server does meanwhile):

- ``engine``: the engine's own writes (``bench.floor.drive``: its claim, its set-based
  write-ahead carrying the previous receipt, its success carrying the last; its group writer
  capped at ``--batch`` writes);
- ``engine, unguarded``: the same, in a database whose triggers, CHECK constraints and foreign
  keys on the tables a step writes were dropped after its migration (what the guards in the
  database cost; never done to a real one);
- ``bare, indexed``: two plain tables with only what those guarantees need: the run's row
  (status, lease token, revision) and an operation row per call (run, position, state,
  arguments, receipt, its journal position), a unique key on (run, position) and an index of
  in-flight calls (a reconciler must find them); per step one statement for a batch of rows,
  each moving the revision under the lease token, committing the previous call's receipt and
  inserting the call ``submitted``; no triggers, no CHECK constraints, no foreign key, no
  journal view, no queue or flow columns;
- ``bare``: the same without the two indexes (the primary keys alone).

Claims and successes go in batches too, each statement in its own transaction, as the group
writer commits. The table gives the backends' CPU µs per step (K steps per run), the median
of the repetitions, and each way's ratio to the engine's in the same repetition.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import uuid
from pathlib import Path
from typing import Any

import psycopg  # noqa: TID251 - a benchmark's own tables, outside the engine

from bench.common import Server, cpu_split, migrate

WAYS = ("engine", "engine, unguarded", "bare, indexed", "bare")
_WAY_KEYS = dict(zip(("engine", "unguarded", "indexed", "bare"), WAYS, strict=True))

_UNGUARD = """
DROP TRIGGER operations_entry_append_only ON orchestrator.operations;
DROP TRIGGER operations_guard ON orchestrator.operations;
DROP TRIGGER journal_append_only ON orchestrator.journal_entries;
DO $$
DECLARE c record;
BEGIN
    FOR c IN SELECT conrelid::regclass AS t, conname FROM pg_constraint
             WHERE connamespace = 'orchestrator'::regnamespace AND contype IN ('c', 'f')
               AND conrelid::regclass::text IN ('orchestrator.runs', 'orchestrator.operations',
                                                'orchestrator.journal_entries',
                                                'orchestrator.reconciliation_items')
    LOOP
        EXECUTE format('ALTER TABLE %s DROP CONSTRAINT %I', c.t, c.conname);
    END LOOP;
END $$;
"""
"""What "engine, unguarded" takes away: the triggers that keep the ledger's entries
append-only and its states on C5's arrows, the CHECK constraints and the foreign keys of the
tables a step writes. Never done to a real database: it measures what those guards cost."""

_TABLES = """
CREATE TABLE bare_runs (id uuid PRIMARY KEY, status text NOT NULL, lease_token bigint,
                        revision bigint NOT NULL DEFAULT 0, output jsonb);
CREATE TABLE bare_ops (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, run_id uuid NOT NULL,
                       position int NOT NULL, state text NOT NULL, arguments jsonb NOT NULL,
                       receipt jsonb, seq bigint NOT NULL, completed_seq bigint);
"""
_INDEXES = """
CREATE UNIQUE INDEX bare_ops_run_position ON bare_ops (run_id, position);
CREATE INDEX bare_ops_inflight ON bare_ops (run_id) WHERE state IN ('pending', 'submitted');
"""
_CLAIM = """
UPDATE bare_runs SET status = 'running', lease_token = %s
WHERE id IN (SELECT id FROM bare_runs WHERE status = 'queued' LIMIT %s FOR UPDATE SKIP LOCKED)
RETURNING id, revision
"""
_STEP = """
WITH x AS (
    SELECT * FROM jsonb_to_recordset(%s::jsonb) AS r(run_id uuid, token bigint,
        expected bigint, position int, arguments jsonb, prev_op bigint, receipt jsonb)
), fence AS (
    UPDATE bare_runs r SET revision = r.revision + 1 + (x.prev_op IS NOT NULL)::int
    FROM x WHERE r.id = x.run_id AND r.lease_token = x.token AND r.status = 'running'
      AND r.revision = x.expected
    RETURNING x.run_id
), done AS (
    UPDATE bare_ops o SET state = 'committed', receipt = x.receipt,
           completed_seq = x.expected + 1
    FROM x JOIN fence USING (run_id)
    WHERE o.id = x.prev_op AND o.state = 'submitted'
    RETURNING o.run_id
)
INSERT INTO bare_ops (run_id, position, state, arguments, seq)
SELECT x.run_id, x.position, 'submitted', x.arguments,
       x.expected + 1 + (x.prev_op IS NOT NULL)::int
FROM x JOIN fence USING (run_id)
RETURNING id, run_id
"""
_SUCCEED = """
WITH x AS (
    SELECT * FROM jsonb_to_recordset(%s::jsonb) AS r(run_id uuid, token bigint,
        expected bigint, prev_op bigint, receipt jsonb, output jsonb)
), fence AS (
    UPDATE bare_runs r SET status = 'succeeded', output = x.output,
           revision = r.revision + 2
    FROM x WHERE r.id = x.run_id AND r.lease_token = x.token AND r.status = 'running'
      AND r.revision = x.expected
    RETURNING x.run_id
)
UPDATE bare_ops o SET state = 'committed', receipt = x.receipt, completed_seq = x.expected + 1
FROM x JOIN fence USING (run_id)
WHERE o.id = x.prev_op AND o.state = 'submitted'
RETURNING o.run_id
"""


def _analyze_runs(conn: psycopg.Connection[Any], table: str) -> None:
    """Vacuum and analyze the submitted runs, and only them: the tables a drain fills stay never
    vacuumed, as in a new database, which the planner takes for at least ten pages. A table
    vacuumed while empty is planned as empty, and the generic plan a connection caches early in
    a drain then scans it sequentially for as long as the connection lives: with batches of one
    row, the write-ahead's probe of ``operations`` became a sequential scan that grew with the
    table (36 % of the server's instructions at 400 runs, measured before this)."""
    conn.execute(f"VACUUM ANALYZE {table}")


def _backends(conn: psycopg.Connection[Any]) -> list[int]:
    """The backends connected to this connection's database, this one's included."""
    rows = conn.execute("SELECT pid FROM pg_stat_activity WHERE datname = current_database()"
                        " AND backend_type = 'client backend'").fetchall()
    return [int(r[0]) for r in rows]


def _cpu(pids: list[int]) -> float:
    return sum(sum(split) for pid in pids if (split := cpu_split(pid)) is not None)


Measured = tuple[float, list[int]]
"""The CPU seconds the measured backends used, and their pids."""


def bare_once(server: Server, *, runs: int, k: int, batch: int, indexed: bool) -> Measured:
    """``runs`` K-step runs through the bare tables, on one connection of their own."""
    url = server.create_database("bare")
    try:
        with psycopg.connect(url, autocommit=True) as setup:
            setup.execute(_TABLES)
            if indexed:
                setup.execute(_INDEXES)
            with setup.cursor() as cur:
                cur.executemany("INSERT INTO bare_runs (id, status) VALUES (%s, 'queued')",
                                [(uuid.uuid4(),) for _ in range(runs)])
            _analyze_runs(setup, "bare_runs")
        with psycopg.connect(url, autocommit=True) as conn:
            pids = [conn.info.backend_pid]
            before = _cpu(pids)
            token = 1
            while True:
                claimed = conn.execute(_CLAIM, (token, batch)).fetchall()
                if not claimed:
                    break
                state = {rid: [rev, None, None] for rid, rev in claimed}  # expected, op, receipt
                for i in range(k):
                    rows = [{"run_id": str(rid), "token": token, "expected": s[0], "position": i,
                             "arguments": {"i": i}, "prev_op": s[1], "receipt": s[2]}
                            for rid, s in state.items()]
                    got = conn.execute(_STEP, (json.dumps(rows),)).fetchall()
                    if len(got) != len(rows):
                        raise RuntimeError(f"a step applied {len(got)} of {len(rows)} rows")
                    for op_id, rid in got:
                        s = state[rid]
                        s[0] += 1 if s[1] is None else 2
                        s[1], s[2] = op_id, {"ok": i}
                rows = [{"run_id": str(rid), "token": token, "expected": s[0], "prev_op": s[1],
                         "receipt": s[2], "output": {"n": k}} for rid, s in state.items()]
                got = conn.execute(_SUCCEED, (json.dumps(rows),)).fetchall()
                if len(got) != len(rows):
                    raise RuntimeError(f"a success applied {len(got)} of {len(rows)} rows")
                token += 1
            used = _cpu(pids) - before
    finally:
        server.drop_database(url)
    return used, pids


async def engine_once(server: Server, *, runs: int, k: int, batch: int,
                      unguarded: bool = False) -> Measured:
    """``runs`` K-step runs through the engine's writes, on a pool of one connection."""
    from bench.floor import drive
    from bench.ours import submit_many
    from orchestrator.db import runs as runs_db
    from orchestrator.db.config import resolve_database
    from orchestrator.db.database import Database
    from orchestrator.db.writer import GroupWriter

    url = server.create_database("bare_engine")
    migrate(url)
    try:
        if unguarded:
            with psycopg.connect(url, autocommit=True) as conn:
                conn.execute(_UNGUARD)
        await submit_many(url, f"k{k}", runs)
        with psycopg.connect(url, autocommit=True) as conn:
            _analyze_runs(conn, "orchestrator.runs")
        db = Database(resolve_database(url), max_pool_size=1)
        writer = GroupWriter(db, max_batch=batch)
        try:
            async with db.connection() as conn:  # the pool's one connection, opened now
                await conn.execute("SELECT 1")
            with psycopg.connect(url, autocommit=True) as watch:
                pids = [p for p in _backends(watch) if p != watch.info.backend_pid]
            before = _cpu(pids)
            while True:
                async with db.connection() as conn:
                    claims = await runs_db.run_claim_ready(
                        conn, worker="bench-bare", workflows=[f"k{k}@1"], limit=batch,
                        ttl=600.0)
                if not claims:
                    break
                await asyncio.gather(*(drive(writer, claim, k, "bench-bare")
                                       for claim in claims))
            used = _cpu(pids) - before
        finally:
            await db.close()
    finally:
        server.drop_database(url)
    return used, pids


def _key(way: str) -> str:
    return next(key for key, name in _WAY_KEYS.items() if name == way)


def _once(server: Server, way: str, *, runs: int, k: int, batch: int) -> Measured:
    if way.startswith("engine"):
        return asyncio.run(engine_once(server, runs=runs, k=k, batch=batch,
                                       unguarded=way == "engine, unguarded"))
    return bare_once(server, runs=runs, k=k, batch=batch, indexed=way == "bare, indexed")


def _cpu_table(server: Server, args: argparse.Namespace) -> None:
    got: dict[str, list[float]] = {way: [] for way in args.ways}
    for rep in range(args.reps):
        for way in args.ways:
            used, _ = _once(server, way, runs=args.runs, k=args.k, batch=args.batch)
            got[way].append(used / (args.runs * args.k) * 1e6)
        print(f"repetition {rep + 1}/{args.reps}: "
              + ", ".join(f"{w} {got[w][-1]:.1f}" for w in args.ways), file=sys.stderr,
              flush=True)
    print(f"\nserver CPU per step (backends of the database; K={args.k}, {args.runs} runs, "
          f"batches of {args.batch}, median of {args.reps})")
    print(f"{'way':<20}{'µs/step':>10}{'× engine':>11}")
    for way in args.ways:
        ratios = [v / e for v, e in zip(got[way], got["engine"], strict=True)]
        print(f"{way:<20}{statistics.median(got[way]):>10.1f}"
              f"{statistics.median(ratios):>11.2f}")


def _instruction_table(args: argparse.Namespace) -> None:
    from bench.callgrind import CallgrindServer

    small, large = args.runs_small, args.runs
    if large <= small:
        raise SystemExit(f"--runs ({large}) must be more than --runs-small ({small})")
    per_step: dict[str, float] = {}
    with CallgrindServer.start() as cg:
        server = Server(cg.admin_url, "callgrind")
        for way in args.ways:
            counts = []
            for runs in (small, large):
                _, pids = _once(server, way, runs=runs, k=args.k, batch=args.batch)
                keep = (None if args.keep_profiles is None
                        else args.keep_profiles / f"{_key(way)}-{runs}")
                counts.append(cg.instructions(pids, keep=keep))
                print(f"{way}: {runs} runs, {counts[-1]:,} instructions", file=sys.stderr,
                      flush=True)
            per_step[way] = (counts[1] - counts[0]) / ((large - small) * args.k)
    print(f"\nserver instructions per step (callgrind, PostgreSQL {cg.version}; the backends' "
          f"count for {large} runs less that for {small}, K={args.k}, batches of "
          f"{args.batch})")
    print(f"{'way':<20}{'instr/step':>12}{'× engine':>11}")
    for way in args.ways:
        print(f"{way:<20}{per_step[way]:>12,.0f}{per_step[way] / per_step['engine']:>11.2f}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.bare", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=6000, help="runs per way and repetition")
    parser.add_argument("--k", type=int, default=3, help="steps per run")
    parser.add_argument("--batch", type=int, default=64, help="writes per transaction")
    parser.add_argument("--reps", type=int, default=3, help="repetitions (interleaved)")
    parser.add_argument("--server", help="a PostgreSQL admin URL (default: as bench.run)")
    parser.add_argument("--ways", default=",".join(_WAY_KEYS),
                        help=f"comma-separated, from {', '.join(_WAY_KEYS)} (the engine's "
                             "way is always measured)")
    parser.add_argument("--instructions", action="store_true",
                        help="count the server's instructions instead (callgrind: a private "
                             "server under valgrind; repeatable whatever else the machine "
                             "does, so commits can be compared one at a time)")
    parser.add_argument("--runs-small", type=int, default=640,
                        help="with --instructions: the smaller run count (its count is "
                             "subtracted, with the backends' start and warm-up)")
    parser.add_argument("--keep-profiles", type=Path, metavar="DIR",
                        help="with --instructions: keep each backend's callgrind file in "
                             "DIR/<way>-<runs>/ (callgrind_annotate names the functions)")
    args = parser.parse_args(argv)
    wanted = {w.strip() for w in args.ways.split(",") if w.strip()}
    unknown = wanted - set(_WAY_KEYS)
    if unknown:
        parser.error(f"unknown way(s): {', '.join(sorted(unknown))}; choose from "
                     f"{', '.join(_WAY_KEYS)}")
    args.ways = [w for key, w in _WAY_KEYS.items() if key in wanted or w == "engine"]
    if args.instructions:
        if args.runs == 6000:
            args.runs = 1152  # under valgrind the server is 30 to 50 times slower
        _instruction_table(args)
    else:
        _cpu_table(Server.find(args.server), args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
