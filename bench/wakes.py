"""What a stream costs, commit against commit: a steady stream of submissions (by default
``k1c`` runs, each running ``k1`` as its child, whose end wakes the parent) with the bench
app's three queues declared, on each committed revision named, interleaved, each on a fresh
database.

    python -m bench.wakes 8ef8a27 HEAD --rate 100 --seconds 15 --rounds 2
    python -m bench.wakes 8ef8a27 HEAD --workflow k3 --rate 300     # a stream of K=3 runs

For each engine: the CPU of the workers and of the server in cores and per submitted run, and
the claims per submitted run, of the default queue (``runs_ready``) and of the declared
queues (``queue_claim``), from ``pg_stat_user_functions`` (``track_functions = 'all'`` on the
drain's database). A wake that does not name its queue sends every idle worker to claim from
every queue it knows. A stream's writes go in batches of one or two, so its CPU per step is
what a drain's is not: mostly the cost of a transaction (docs/architecture.md, "Streams").
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from bench.common import Table, log, median, run_in_snapshot, snapshot_engine


async def _one(args: argparse.Namespace) -> None:
    import psycopg  # noqa: TID251 - its own database and the function statistics

    from bench import ours
    from bench.common import CpuMeter, Server, migrate, spawn

    server = Server.find(None)
    url = server.create_database("wakes")
    name = url.rsplit("/", 1)[1].split("?")[0]
    with psycopg.connect(server.admin_url, autocommit=True) as conn:
        conn.execute(f"ALTER DATABASE {name} SET track_functions = 'all'")
    migrate(url)
    try:
        setup = ours.Setup(workers=args.workers, concurrency=args.concurrency, pool_size=16)
        procs = await ours.start_workers(url, setup, k=1)
        try:
            await ours.wait_registered(url, [p.pid for p in procs], procs)
            load = await spawn([sys.executable, "-m", "bench.load", "--url", url, "--rate",
                                str(args.rate), "--workflow", args.workflow], name="load")
            await load.expect("@ready", 60)
            await asyncio.sleep(2.0)  # a steady state first
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                pids = {"worker": [p.pid for p in procs],
                        "server": await ours.server_processes(conn)}
                await conn.execute("SELECT pg_stat_reset()")
                before = (await (await conn.execute(
                    "SELECT count(*) FROM orchestrator.runs WHERE workflow_name = %s",
                    (args.workflow,))).fetchone() or [0])[0]
            meter = CpuMeter()
            meter.start(pids)
            await asyncio.sleep(args.seconds)
            meter.stop(pids)
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                calls = dict(await (await conn.execute(
                    "SELECT funcname, calls FROM pg_stat_user_functions "
                    "WHERE schemaname = 'orchestrator'")).fetchall())
                after = (await (await conn.execute(
                    "SELECT count(*) FROM orchestrator.runs WHERE workflow_name = %s",
                    (args.workflow,))).fetchone() or [0])[0]
            await load.stop()
        finally:
            await asyncio.gather(*(p.stop() for p in procs))
    finally:
        server.drop_database(url)
    runs = max(after - before, 1)
    print(json.dumps({
        "runs_per_s": runs / args.seconds,
        "worker_cores": meter.used.get("worker", 0.0) / args.seconds,
        "server_cores": meter.used.get("server", 0.0) / args.seconds,
        "worker_us_per_run": meter.used.get("worker", 0.0) / runs * 1e6,
        "server_us_per_run": meter.used.get("server", 0.0) / runs * 1e6,
        "default_claims_per_run": calls.get("runs_ready", 0) / runs,
        "queue_claims_per_run": calls.get("queue_claim", 0) / runs}))


def _in(folder: str, sha: str, args: argparse.Namespace) -> dict[str, Any]:
    return run_in_snapshot(folder, sha, "bench.wakes", [
        "--one", "--rate", str(args.rate), "--seconds", str(args.seconds),
        "--workflow", args.workflow,
        "--workers", str(args.workers), "--concurrency", str(args.concurrency)], "a stream")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.wakes", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engines", nargs="*", metavar="REF",
                        help="the first is the baseline (default: HEAD~1 HEAD)")
    parser.add_argument("--rate", type=float, default=100.0, help="runs submitted per s")
    parser.add_argument("--workflow", default="k1c",
                        help="the bench app's workflow streamed (default k1c; k3: three steps)")
    parser.add_argument("--seconds", type=float, default=15.0, help="measured per stream")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        asyncio.run(_one(args))
        return 0
    refs = args.engines or ["HEAD~1", "HEAD"]
    snapshots = {ref: snapshot_engine(ref) for ref in refs}
    found: dict[str, list[dict[str, Any]]] = {ref: [] for ref in refs}
    for i in range(args.rounds):
        for ref in refs if i % 2 == 0 else list(reversed(refs)):
            folder, sha = snapshots[ref]
            log(f"round {i + 1}/{args.rounds}: {ref} ({sha[:10]})")
            found[ref].append(_in(str(folder), sha, args))
    what = ("k1c runs/s (a parent and its child)" if args.workflow == "k1c"
            else f"{args.workflow} runs/s")
    table = Table(f"wakes: a stream of {args.rate:g} {what}, "
                  f"{args.workers} workers × concurrency {args.concurrency}, three queues "
                  f"declared, {args.rounds} rounds interleaved",
                  ["engine", "commit", "runs/s", "worker cores", "server cores",
                   "worker µs/run", "÷ first", "server µs/run", "÷ first",
                   "default-queue claims per run", "queue claims per run"])
    base = found[refs[0]]
    for ref in refs:
        rs = found[ref]
        ratios = {kind: median([r[f"{kind}_us_per_run"] / b[f"{kind}_us_per_run"]
                                for r, b in zip(rs, base, strict=True)])
                  for kind in ("worker", "server")}
        table.add(ref, snapshots[ref][1][:10], median([r["runs_per_s"] for r in rs]),
                  f"{median([r['worker_cores'] for r in rs]):.2f}",
                  f"{median([r['server_cores'] for r in rs]):.2f}",
                  f"{median([r['worker_us_per_run'] for r in rs]):,.0f}",
                  "—" if ref == refs[0] else f"{ratios['worker']:.3f}×",
                  f"{median([r['server_us_per_run'] for r in rs]):,.0f}",
                  "—" if ref == refs[0] else f"{ratios['server']:.3f}×",
                  f"{median([r['default_claims_per_run'] for r in rs]):.1f}",
                  f"{median([r['queue_claims_per_run'] for r in rs]):.2f}")
    table.notes.append(f"median of {args.rounds}; {args.seconds:g} s measured per stream after "
                       "2 s of warm-up; cores = CPU seconds per second (/proc), µs per run "
                       "submitted and its ÷ first the median of each round's ratio; claims "
                       "from pg_stat_user_functions")
    table.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
