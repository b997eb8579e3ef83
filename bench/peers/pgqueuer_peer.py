"""PgQueuer: a PostgreSQL job queue (no effect ledger). No-op jobs, batched dequeue.

Its fastest configuration as its own benchmark (``tools/benchmark.py`` in its repository)
runs it: the asyncpg driver, jobs enqueued in one batch, dequeued ``--batch-size`` at a time
by each worker process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from bench.common import fetch_one

DRIVERS = ("asyncpg", "psycopg")


def check() -> None:
    import pgqueuer  # noqa: F401


async def _driver(url: str, kind: str = "asyncpg") -> Any:
    from pgqueuer import AsyncpgDriver, PsycopgDriver

    if kind == "asyncpg":
        import asyncpg  # type: ignore[import-untyped]

        return AsyncpgDriver(await asyncpg.connect(dsn=url))
    import psycopg  # noqa: TID251

    return PsycopgDriver(await psycopg.AsyncConnection.connect(url, autocommit=True))


async def install(url: str) -> None:
    from pgqueuer import Queries

    queries = Queries(await _driver(url))
    await queries.install()


async def enqueue(url: str, n: int) -> None:
    from pgqueuer import Queries

    queries = Queries(await _driver(url))
    await queries.enqueue(["noop"] * n, [None] * n, [0] * n)


@contextlib.asynccontextmanager
async def enqueuer(url: str) -> AsyncIterator[Callable[[], Awaitable[Any]]]:
    from pgqueuer import Queries

    queries = Queries(await _driver(url))
    yield lambda: queries.enqueue("noop", None)


async def remaining(conn: Any) -> int:
    row = await fetch_one(conn, "SELECT count(*) FROM pgqueuer")
    return int(row[0])


async def last_completion(conn: Any) -> tuple[Any, int]:
    row = await fetch_one(
        conn, "SELECT max(created), count(*) FROM pgqueuer_log WHERE status = 'successful'")
    return row[0], int(row[1])


async def worker(args: argparse.Namespace) -> None:
    from pgqueuer import Queries, QueueManager

    qm = QueueManager(Queries(await _driver(args.url, args.driver)))
    mark = args.mark

    @qm.entrypoint("noop")
    async def noop(job: Any) -> None:
        if mark:
            print(f"@start {time.time()}", flush=True)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, qm.shutdown.set)
    print("@ready", flush=True)
    await qm.run(batch_size=args.batch_size,
                 max_concurrent_tasks=max(args.concurrency, 2 * args.batch_size))


def main() -> None:
    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--url", required=True)
    w.add_argument("--batch-size", type=int, default=10)
    w.add_argument("--concurrency", type=int, default=32)
    w.add_argument("--driver", choices=DRIVERS, default="asyncpg")
    w.add_argument("--mark", action="store_true")
    args = parser.parse_args()
    asyncio.run(worker(args))


if __name__ == "__main__":
    main()
