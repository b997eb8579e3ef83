"""Group commit: one worker's concurrent runs share transactions.

Every run still writes through its own fenced statements (lease token, expected revision, row
counts checked); what is shared is the transaction and so the commit, which is what a durable
PostgreSQL pays most for. When one run's write is rejected or fails, the shared transaction is
rolled back and every write of the batch runs again in a transaction of its own, so the failure
stays with its write and never fails its neighbours. A run continues only after the
transaction holding its write has committed.

Requests that arrive while a batch is being written form the next batch: under load batches
grow by themselves; an idle worker commits a lone write at once.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import psycopg

from orchestrator.db.database import Conn, Database, translate_errors
from orchestrator.errors import DatabaseError

T = TypeVar("T")
log = logging.getLogger("orchestrator.worker")


@dataclass(frozen=True)
class Statement:
    """A write that is one SQL statement; ``check(row)`` turns its single result row into the
    caller's value or raises (then the batch is rolled back and every write runs alone).
    Statements of a batch are sent pipelined: one round trip for all of them."""

    sql: str
    params: dict[str, Any]
    check: Callable[[dict[str, Any] | None], Any]


Work = Callable[[Conn], Awaitable[Any]] | Statement


class GroupWriter:
    """Batches transactions of many runs into one commit. One per worker (per event loop)."""

    def __init__(self, db: Database, *, max_batch: int = 128, attempts: int = 3) -> None:
        self.db = db
        self.max_batch = max_batch
        self.attempts = attempts
        self._queue: list[tuple[Work, asyncio.Future[Any], int]] = []
        self._flusher: asyncio.Task[None] | None = None
        self.batches = 0  # transactions committed (for benchmarks and tests)
        self.writes = 0  # writes committed in them

    async def run_statement(self, statement: Statement) -> Any:
        """Run one statement write in a shared transaction; return ``check``'s value."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((statement, future, 0))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush())
        return await future

    async def run_in_transaction(self, work: Callable[[Conn], Awaitable[T]]) -> T:
        """Run ``work(conn)`` inside a shared transaction; return once it has committed."""
        future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._queue.append((work, future, 0))
        if self._flusher is None or self._flusher.done():
            self._flusher = asyncio.ensure_future(self._flush())
        return cast(T, await future)

    async def _flush(self) -> None:
        while self._queue:
            batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch:]
            if not await self._write(batch):
                await asyncio.sleep(0.1)  # the database is having trouble: do not spin

    async def _write(self, batch: list[tuple[Work, asyncio.Future[Any], int]]) -> bool:
        """Write a batch in one transaction. If any write fails, the transaction is rolled back
        and each write runs again in a transaction of its own, so a failure stays with the
        write that caused it (rejected writes are rare: a lost lease, a bug)."""
        try:
            with translate_errors(self.db.target):
                outcomes = await self._together(batch)
                if outcomes is None:
                    outcomes = [await self._alone(work, future) for work, future, _ in batch]
        except (DatabaseError, psycopg.Error) as exc:
            # Not committed, or we cannot know: try those writes again in a later batch. They
            # are fenced, so a write that did commit is rejected the next time.
            self._retry(batch, exc)
            return False
        self.batches += 1
        self.writes += len(batch)
        for future, value, error in outcomes:
            if future.done():
                continue
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)
        return True

    async def _together(self, batch: list[tuple[Work, asyncio.Future[Any], int]]
                        ) -> list[tuple[asyncio.Future[Any], Any, BaseException | None]] | None:
        values: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = []
        pool = await self.db.pool()
        async with pool.connection() as raw:
            conn = cast(Conn, raw)
            try:
                async with conn.transaction():
                    statements = [(w, f) for w, f, _ in batch if isinstance(w, Statement)]
                    if statements:
                        async with conn.pipeline():
                            cursors = [await conn.execute(w.sql, w.params)
                                       for w, _ in statements]
                        for (w, f), cursor in zip(statements, cursors, strict=True):
                            values.append((f, w.check(await cursor.fetchone()), None))
                    for work, future, _ in batch:
                        if not isinstance(work, Statement):
                            values.append((future, await work(conn), None))
            except psycopg.OperationalError:
                raise
            except Exception as exc:  # noqa: BLE001 - rolled back; the writes go one by one
                if len(batch) == 1:
                    return [(batch[0][1], None, exc)]
                return None
        return values

    async def _alone(self, work: Work, future: asyncio.Future[Any]
                     ) -> tuple[asyncio.Future[Any], Any, BaseException | None]:
        pool = await self.db.pool()
        async with pool.connection() as raw:
            conn = cast(Conn, raw)
            try:
                async with conn.transaction():
                    if isinstance(work, Statement):
                        cursor = await conn.execute(work.sql, work.params)
                        return future, work.check(await cursor.fetchone()), None
                    return future, await work(conn), None
            except psycopg.OperationalError:
                raise
            except Exception as exc:  # noqa: BLE001 - belongs to that write alone
                return future, None, exc

    def _retry(self, batch: list[tuple[Work, asyncio.Future[Any], int]],
               exc: BaseException) -> None:
        log.warning("a group commit failed (%s); retrying its writes", type(exc).__name__)
        for work, future, tries in batch:
            if future.done():
                continue
            if tries + 1 >= self.attempts:
                error = exc if isinstance(exc, DatabaseError) else DatabaseError(
                    f"writes to {self.db.target.masked} keep failing ({type(exc).__name__})")
                future.set_exception(error)
            else:
                self._queue.append((work, future, tries + 1))
