"""Procrastinate: a PostgreSQL task queue (no effect ledger). No-op async tasks.

Jobs are deferred in one batch (``batch_defer_async``); each worker process runs
``run_worker_async`` with the matched ``concurrency``, LISTEN/NOTIFY on, jobs kept (the
default), so every job goes todo → doing → succeeded like ours.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from bench.common import fetch_one

QUEUE = "bench"


def check() -> None:
    import procrastinate  # noqa: F401


def build(url: str, *, pool_size: int = 10, mark: bool = False) -> Any:
    import procrastinate

    app = procrastinate.App(connector=procrastinate.PsycopgConnector(
        conninfo=url, min_size=1, max_size=pool_size))

    @app.task(name="noop", queue=QUEUE)
    async def noop(i: int = 0) -> None:
        if mark:
            print(f"@start {time.time()}", flush=True)

    return app


async def install(url: str) -> None:
    app = build(url)
    async with app.open_async():
        await app.schema_manager.apply_schema_async()


async def enqueue(url: str, n: int) -> None:
    app = build(url)
    async with app.open_async():
        await app.tasks["noop"].batch_defer_async(*({"i": i} for i in range(n)))


@contextlib.asynccontextmanager
async def enqueuer(url: str) -> AsyncIterator[Callable[[], Awaitable[Any]]]:
    app = build(url, pool_size=2)
    async with app.open_async():
        yield lambda: app.tasks["noop"].defer_async(i=0)


async def remaining(conn: Any) -> int:
    row = await fetch_one(
        conn, "SELECT count(*) FROM procrastinate_jobs WHERE status IN ('todo', 'doing')")
    return int(row[0])


async def last_completion(conn: Any) -> tuple[Any, int]:
    row = await fetch_one(
        conn, "SELECT max(at), count(*) FROM procrastinate_events WHERE type = 'succeeded'")
    return row[0], int(row[1])


async def worker(args: argparse.Namespace) -> None:
    logging.basicConfig(level=logging.WARNING)
    app = build(args.url, pool_size=args.pool_size, mark=args.mark)
    async with app.open_async():
        task = asyncio.ensure_future(app.run_worker_async(
            queues=[QUEUE], concurrency=args.concurrency, wait=True, listen_notify=True,
            install_signal_handlers=False, name=f"bench-{args.url[-6:]}"))
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await asyncio.sleep(0.2)  # let the worker register and LISTEN before we say ready
        print("@ready", flush=True)
        await stop.wait()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--url", required=True)
    w.add_argument("--concurrency", type=int, default=32)
    w.add_argument("--pool-size", type=int, default=10)
    w.add_argument("--mark", action="store_true")
    args = parser.parse_args()
    asyncio.run(worker(args))


if __name__ == "__main__":
    main()
