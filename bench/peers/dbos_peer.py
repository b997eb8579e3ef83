"""DBOS Transact: durable workflows on PostgreSQL. Workflows of K steps, like ours.

A DBOS workflow runs in the process that starts it (``DBOS.start_workflow_async``), which is
its fastest path: each worker process starts its share of the runs, ``--concurrency`` at a
time, and waits for their results. Every step is checkpointed in DBOS's system database
(``dbos.operation_outputs``) before the workflow goes on; the workflow's status row records
start and end. The steps are async no-ops returning a small dict, like ours.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time
from typing import Any

import psycopg  # noqa: TID251 - progress and timing queries

from bench.common import Proc, Server, fetch_one, percentile, spawn


def check() -> None:
    import dbos  # noqa: F401


def _launch(url: str, pool_size: int) -> Any:
    from dbos import DBOS, DBOSConfig

    @DBOS.step()
    async def noop(i: int) -> dict[str, Any]:
        return {"ok": True, "i": i, "t": time.time()}

    async def steps(k: int) -> dict[str, Any]:
        first: dict[str, Any] = {}
        last: dict[str, Any] = {}
        for i in range(k):
            last = await noop(i)
            if i == 0:
                first = last
        return {"first_t": first.get("t"), "last": last}

    @DBOS.workflow(name="k1")
    async def k1(n: int) -> dict[str, Any]:
        return await steps(1)

    @DBOS.workflow(name="k3")
    async def k3(n: int) -> dict[str, Any]:
        return await steps(3)

    @DBOS.workflow(name="k10")
    async def k10(n: int) -> dict[str, Any]:
        return await steps(10)

    config: DBOSConfig = {"name": "bench", "system_database_url": url,
                          "sys_db_pool_size": pool_size, "log_level": "WARNING",
                          "executor_id": f"bench-{os.getpid()}"}
    DBOS(config=config)
    DBOS.launch()
    return {1: k1, 3: k3, 10: k10}


async def worker(args: argparse.Namespace) -> None:
    from dbos import DBOS

    workflows = _launch(args.url, args.pool_size)
    go = asyncio.Event()
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGUSR1, go.set)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print("@ready", flush=True)
    if args.install:
        DBOS.destroy()
        return
    await go.wait()
    if args.samples:
        firsts: list[float] = []
        results: list[float] = []
        for i in range(args.warmup + args.samples):
            t0 = time.time()
            handle = await DBOS.start_workflow_async(workflows[1], i)
            out = await handle.get_result()
            t2 = time.time()
            if i >= args.warmup:
                firsts.append(out["first_t"] - t0)
                results.append(t2 - t0)
            await asyncio.sleep(0.01)
        print("@result " + json.dumps({"first": firsts, "result": results}), flush=True)
    else:
        gate = asyncio.Semaphore(args.concurrency)
        workflow = workflows[args.k]

        async def one(i: int) -> None:
            async with gate:
                handle = await DBOS.start_workflow_async(workflow, i)
                await handle.get_result()

        await asyncio.gather(*(one(i) for i in range(args.n)))
        print("@done", flush=True)
    await stop.wait()
    DBOS.destroy()


def _args(url: str, **options: Any) -> list[str]:
    return [sys.executable, "-m", __name__, "worker", "--url", url,
            *[f"--{k.replace('_', '-')}={v}" for k, v in options.items()]]


async def install(url: str) -> None:
    """Create DBOS's system tables once, before several processes launch on them."""
    proc = await spawn(_args(url, install=1), name="dbos-install")
    await proc.expect("@ready", 120)
    await proc.proc.wait()


async def drain(server: Server, *, k: int, runs: int, workers: int, concurrency: int,
                pool_size: int, timeout: float = 900.0) -> dict[str, Any]:
    """``runs`` workflows of K steps, split over ``workers`` processes started together."""
    url = server.create_database("dbos")
    procs: list[Proc] = []
    try:
        await install(url)
        share = [runs // workers + (1 if i < runs % workers else 0) for i in range(workers)]
        for i, n in enumerate(share):
            procs.append(await spawn(_args(url, k=k, n=n, concurrency=concurrency,
                                           pool_size=pool_size), name=f"dbos-{i}"))
        await asyncio.gather(*(p.expect("@ready", 120) for p in procs))
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            t0 = (await fetch_one(conn, "SELECT clock_timestamp()"))[0]
            for p in procs:
                os.kill(p.pid, signal.SIGUSR1)
            await asyncio.gather(*(p.expect("@done", timeout) for p in procs))
            t1, done = await fetch_one(
                conn, "SELECT to_timestamp(max(updated_at) / 1000.0), count(*) "
                "FROM dbos.workflow_status WHERE status = 'SUCCESS'")
    finally:
        await asyncio.gather(*(p.stop() for p in procs), return_exceptions=True)
        server.drop_database(url)
    seconds = (t1 - t0).total_seconds()
    return {"k": k, "runs": runs, "done": int(done), "seconds": seconds,
            "runs_per_s": done / seconds, "steps_per_s": done * k / seconds}


async def latency(server: Server, *, samples: int, warmup: int = 10,
                  pool_size: int = 4) -> dict[str, Any]:
    """Sequential K=1 workflows started in the worker's own process (DBOS's normal path)."""
    url = server.create_database("dbos")
    proc: Proc | None = None
    try:
        await install(url)
        proc = await spawn(_args(url, samples=samples, warmup=warmup, pool_size=pool_size),
                           name="dbos-lat")
        await proc.expect("@ready", 120)
        os.kill(proc.pid, signal.SIGUSR1)
        line = await proc.expect("@result", 300)
        data = json.loads(line.split(" ", 1)[1])
    finally:
        if proc is not None:
            await proc.stop()
        server.drop_database(url)
    return {"samples": samples, "first_step_p50": percentile(data["first"], 50),
            "first_step_p99": percentile(data["first"], 99),
            "result_p50": percentile(data["result"], 50),
            "result_p99": percentile(data["result"], 99)}


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--url", required=True)
    w.add_argument("--k", type=int, default=3)
    w.add_argument("--n", type=int, default=0)
    w.add_argument("--concurrency", type=int, default=32)
    w.add_argument("--pool-size", type=int, default=10)
    w.add_argument("--samples", type=int, default=0)
    w.add_argument("--warmup", type=int, default=10)
    w.add_argument("--install", type=int, default=0)
    args = parser.parse_args()
    asyncio.run(worker(args))


if __name__ == "__main__":
    main()
