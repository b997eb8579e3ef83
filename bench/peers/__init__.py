"""Peers measured on the same server in the same run, each on a fresh database of its own.

Each peer module runs as its own worker process (``python -m bench.peers.NAME worker …``) and
offers the driver the same few functions: ``install(url)``, ``enqueue(url, n)``,
``remaining(conn)`` and ``last_completion(conn)``; DBOS, whose workflows run in the process that
starts them, has its own driver (``bench.peers.dbos_peer.drain``).

Worker processes print marker lines on stdout: ``@ready`` once they can take work and, in
latency mode, ``@start <unix time>`` when a job (or first step) starts.

A drain is timed the same way for every system: from the server's clock just before the work
is released or enqueued to the last completion the system itself recorded in the database.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import signal
import sys
import time
from types import ModuleType
from typing import Any

import psycopg  # noqa: TID251 - progress and timing queries

from bench.common import Proc, Server, fetch_one, percentile, spawn

QUEUES = ("pgqueuer", "procrastinate")


def module(name: str) -> ModuleType:
    return importlib.import_module(f"bench.peers.{name}_peer")


def available(name: str) -> str | None:
    """None if the peer's package imports here, else why not."""
    try:
        module(name).check()
    except Exception as exc:  # noqa: BLE001 - any failure means the peer cannot run here
        return f"{type(exc).__name__}: {exc}"
    return None


async def start(peer: ModuleType, url: str, count: int, options: dict[str, Any],
                latency: bool = False) -> list[Proc]:
    procs = []
    for i in range(count):
        args = [sys.executable, "-m", peer.__name__, "worker", "--url", url,
                *[f"--{k.replace('_', '-')}={v}" for k, v in options.items()]]
        if latency:
            args.append("--mark")
        procs.append(await spawn(args, name=f"{peer.__name__.rsplit('.', 1)[-1]}-{i}"))
    await asyncio.gather(*(p.expect("@ready", 90) for p in procs))
    return procs


async def stop(procs: list[Proc]) -> None:
    await asyncio.gather(*(p.stop(signal.SIGTERM) for p in procs), return_exceptions=True)


async def drain(server: Server, name: str, *, jobs: int, workers: int,
                options: dict[str, Any], timeout: float = 600.0) -> dict[str, Any]:
    """Enqueue ``jobs`` no-op jobs in one batch for ``workers`` idle worker processes; time
    until the queue is empty."""
    peer = module(name)
    url = server.create_database(name)
    try:
        await peer.install(url)
        procs = await start(peer, url, workers, options)
        try:
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                t0 = (await fetch_one(conn, "SELECT clock_timestamp()"))[0]
                await peer.enqueue(url, jobs)
                deadline = time.monotonic() + timeout
                while await peer.remaining(conn) > 0:
                    for p in procs:
                        if not p.alive():
                            raise RuntimeError(f"{p.name} exited:\n" + "\n".join(p.tail[-20:]))
                    if time.monotonic() > deadline:
                        raise TimeoutError(f"{name}: jobs left after {timeout}s")
                    await asyncio.sleep(0.1)
                t1, done = await peer.last_completion(conn)
        finally:
            await stop(procs)
    finally:
        server.drop_database(url)
    seconds = (t1 - t0).total_seconds()
    return {"jobs": jobs, "done": done, "seconds": seconds, "jobs_per_s": done / seconds}


async def latency(server: Server, name: str, *, samples: int, warmup: int = 10,
                  options: dict[str, Any]) -> dict[str, Any]:
    """Enqueue one job at a time on an idle worker: enqueue → job starts."""
    peer = module(name)
    url = server.create_database(name)
    firsts: list[float] = []
    try:
        await peer.install(url)
        procs = await start(peer, url, 1, options, latency=True)
        try:
            async with contextlib.AsyncExitStack() as stack:
                enqueue_one = await stack.enter_async_context(peer.enqueuer(url))
                for i in range(warmup + samples):
                    t0 = time.time()
                    await enqueue_one()
                    line = await procs[0].expect("@start", 30)
                    if i >= warmup:
                        firsts.append(float(line.split()[1]) - t0)
                    await asyncio.sleep(0.01)
        finally:
            await stop(procs)
    finally:
        server.drop_database(url)
    return {"samples": samples, "first_step_p50": percentile(firsts, 50),
            "first_step_p99": percentile(firsts, 99)}
