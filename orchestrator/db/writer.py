"""Group commit: one worker's concurrent runs share transactions.

Every run still writes through its own fenced statements (lease token, expected revision, row
counts checked); what is shared is the transaction and so the commit, which is what a durable
PostgreSQL pays most for. When one run's write is rejected or fails, the shared transaction is
rolled back and every write of the batch runs again in a transaction of its own, so the failure
stays with its write and never fails its neighbours. A run continues only after the
transaction holding its write has committed.

Requests that arrive while a batch is being written form the next batch: under load batches
grow by themselves; an idle worker commits a lone write at once.

The hot writes (a call's write-ahead ``submitted``, its receipt, a run's success: their
statements are in :mod:`orchestrator.db.steps`) are :class:`Statement` s whose SQL takes a
JSON array of rows: the writes of one kind in a batch go to the server as *one* statement that
fences, writes and appends per row and returns one result row per input row (by its position
in the array). Each row is still checked on its own, by the statement itself (a row that did
not apply raises, so the transaction cannot commit); what is shared is the round trip and the
per-statement work, which is what a busy worker spends its CPU on. A batch of statements is
one round trip: the statements are pipelined, committed together at the pipeline's Sync, and
the worker waits once.

A write that fails because the database cannot be reached (a refused or lost connection, a
pooler down: nothing the write itself did) is tried again with a growing pause (50 ms,
doubling, at most a second) for as long as the writer's ``patience`` allows, counted from its
first failed attempt: a worker gives it half its lease TTL, so that a short outage costs the
runs writing during it nothing but the wait; once it is spent, the write gets
``DATABASE_UNAVAILABLE``. Any other failure (and any failure, for a writer without patience) is
tried ``attempts`` times, without a growing pause. A row the database rejects (SQLSTATE
``OR001``, a constraint) is not a failed attempt: it is answered at once. Retrying late is safe
whenever it lands: every write is fenced by its run's lease token and expected revision, so a
write that lands after another worker took the run is rejected, and one that committed before
its connection was lost is rejected the next time.

A run's reads (its journal's when it is claimed, and those while it runs) wait out such an
outage the same way (:meth:`GroupWriter.patiently`:
the same patience and pauses, counted from the read's first failed attempt); :meth:`hurry` ends
their wait as it ends the writes'.

The writer logs one WARNING when its writes start failing because the database cannot be
reached, not one per attempt, and one INFO when a batch commits again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import psycopg

from orchestrator.db.database import (
    Conn,
    Database,
    connection_failed,
    privilege_denied,
    translate_errors,
)
from orchestrator.errors import DatabaseError, LeaseLost

T = TypeVar("T")
log = logging.getLogger("orchestrator.worker")

FIRST_PAUSE = 0.05
"""Seconds between the first failed attempt of writes that could not reach the database and the
next; each pause is as long as the writes have been failing, so it doubles, up to
:data:`LONGEST_PAUSE`."""
LONGEST_PAUSE = 1.0
RETRY_PAUSE = 0.1
"""Seconds before writes that failed for another reason are tried again."""


def unreachable_pause(failing_for: float, left: float) -> float:
    """Seconds to wait before trying again work that has been failing to reach the database
    for ``failing_for`` seconds with ``left`` seconds of patience left: as long as it has been
    failing (so the pauses double from :data:`FIRST_PAUSE`), at most :data:`LONGEST_PAUSE`,
    and no longer than the patience left (but :data:`FIRST_PAUSE` at least)."""
    return min(LONGEST_PAUSE, max(FIRST_PAUSE, min(failing_for, left)))


@dataclass(frozen=True)
class Statement:
    """A write that is one row of a set-based SQL statement.

    ``sql`` takes one parameter, a JSON array of rows, and returns a column ``i`` (the row's
    1-based position in the array) with each row's result; ``row`` is this write's JSON text
    (an object or an array, as its SQL reads it); ``key`` names what the row writes (its
    run): two rows with the same key never share a statement. The SQL must refuse a row that
    does not apply by calling ``orchestrator.row_applied(applied, what)`` (which raises
    SQLSTATE ``OR001``), for it or for all of the statement's rows at once: a batch is
    committed without looking at its results first, so a miss has to stop the
    transaction on the server. The batch is then rolled back and every write runs alone; the
    write that missed gets ``check(None)``, which raises the caller's error. After a commit,
    ``check(result)`` turns the write's result row into the caller's value.
    """

    sql: str
    row: str
    key: object
    check: Callable[[dict[str, Any] | None], Any]


class Landing(asyncio.Future[Any]):
    """The outcome of a queued write. It cannot be cancelled: a queued write is written whether
    or not anyone still waits for it (a write already in a batch cannot be taken back), so a
    task cancelled while it awaits one is woken only once the write has landed, with
    ``CancelledError``, and can still read the outcome here (``result()``)."""

    def cancel(self, msg: Any = None) -> bool:
        return False


Work = Callable[[Conn], Awaitable[Any]] | Statement
Failed = tuple[int, float] | None  # a queued write's attempts failed and when the first began
Group = list[tuple[Statement, "asyncio.Future[Any]"]]  # statements sent as one
Outcome = tuple["asyncio.Future[Any]", Any, BaseException | None]  # a write's value or error


class GroupWriter:
    """Batches transactions of many runs into one commit. One per worker (per event loop).

    ``patience``: seconds for which a write (or a read, :meth:`patiently`) that cannot reach
    the database is tried again (see the module's text); 0 tries a write ``attempts`` times
    like any other failed write, and a read once."""

    def __init__(self, db: Database, *, max_batch: int = 128, attempts: int = 3,
                 patience: float = 0.0) -> None:
        self.db = db
        self.max_batch = max_batch
        self.attempts = attempts
        self.patience = patience
        self._pause = RETRY_PAUSE  # before the next batch, after one that failed
        self._queue: list[tuple[Work, asyncio.Future[Any], Failed]] = []
        self._flusher: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of the first write
        self._in_flight: list[tuple[Work, asyncio.Future[Any], Failed]] = []  # the batch sent
        self._abandoned: str | None = None  # why nothing more is written (see abandon)
        self._hurried: asyncio.Event | None = None  # set by hurry: reads stop waiting
        self._unreachable_since: float | None = None  # writes fail: the database is away
        self.batches = 0  # transactions committed (for benchmarks and tests)
        self.writes = 0  # writes committed in them
        self.statements = 0  # set-based statements sent for Statement writes

    async def run_statement(self, statement: Statement) -> Any:
        """Run one statement write in a shared transaction; return ``check``'s value."""
        return await self.enqueue(statement)

    async def run_in_transaction(self, work: Callable[[Conn], Awaitable[T]]) -> T:
        """Run ``work(conn)`` inside a shared transaction; return once it has committed."""
        return cast(T, await self.enqueue(work))

    def enqueue(self, work: Work) -> Landing:
        """Queue a write; the returned :class:`Landing` gets its outcome once its transaction
        has ended."""
        loop = self._loop
        if loop is None:  # asyncio's lookup costs a getpid() system call on Python 3.11
            loop = self._loop = asyncio.get_running_loop()
        future = Landing(loop=loop)
        if self._abandoned is not None:  # the worker is stopping: nothing more is written
            future.set_exception(DatabaseError(self._abandoned))
            return future
        self._queue.append((work, future, None))
        # One flusher at a time (a second one measured slower: smaller batches). A task is
        # done in the very step its loop finds the queue empty, so a write queued after that
        # always starts a new one.
        if self._flusher is None or self._flusher.done():
            self._flusher = loop.create_task(self._flush())
        return future

    async def _flush(self) -> None:
        while self._queue:
            batch, self._queue = self._queue[: self.max_batch], self._queue[self.max_batch:]
            self._in_flight = batch
            try:
                written = await self._write(batch)
            finally:
                self._in_flight = []
            if not written:
                await asyncio.sleep(self._pause)  # the database is having trouble: do not spin

    async def drain(self, timeout: float) -> None:
        """Let the writes queued or in flight land for up to ``timeout`` seconds, then
        :meth:`abandon` whatever is left (nothing, normally)."""
        if self._flusher is not None and not self._flusher.done():
            await asyncio.wait([self._flusher], timeout=timeout)
        if self._queue or self._in_flight:
            self.abandon("the worker stopped before the database answered")

    @property
    def abandoned(self) -> bool:
        """Whether writes were given up (:meth:`abandon`): one in flight may still land."""
        return self._abandoned is not None

    def abandon(self, reason: str) -> None:
        """Answer every write still waiting, and every later one, with :class:`DatabaseError`:
        for a worker that must stop and cannot wait for the database any longer. A queued write was
        never sent; one in flight may or may not have committed, which its run's fence settles
        (the run is dropped here and replayed from its journal elsewhere)."""
        self._abandoned = reason
        if self._hurried is not None:
            self._hurried.set()  # and the reads waiting out an outage
        for _, future, _ in [*self._in_flight, *self._queue]:
            if not future.done():
                future.set_exception(DatabaseError(reason))
        self._queue.clear()
        if self._flusher is not None:
            self._flusher.cancel()

    def hurry(self, reason: str) -> None:
        """Stop waiting for a database that cannot be reached: the writes waiting to be tried
        again get :class:`DatabaseError` now, and a write that fails from now on is tried
        ``attempts`` times, however long its patience. For a worker whose drain has run out of
        time or been hurried: the backoff must not hold its stop."""
        self.patience = 0.0
        if self._hurried is not None:
            self._hurried.set()  # the reads waiting out the outage (patiently) give up now
        waiting = [item for item in self._queue if item[2] is not None]
        if waiting:
            self._queue = [item for item in self._queue if item[2] is None]
            for _, future, _ in waiting:
                if not future.done():
                    future.set_exception(DatabaseError(reason))

    async def patiently(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """``attempt()`` (work that is not a queued write: a run's read), tried again like a
        write when it fails because the database cannot be reached (``DATABASE_UNAVAILABLE``,
        retryable, or a connection failure): with the same growing pause, for up to the
        writer's ``patience`` from the start of its first failed attempt; then, or at once for
        any other failure (a query the database rejects), the error is raised. :meth:`hurry`
        and :meth:`abandon` end the wait at once (the last error is raised); with a writer
        without patience (or hurried, or abandoned) ``attempt`` is tried once (with whatever
        retries of its own it makes)."""
        first: float | None = None
        while True:
            began = time.monotonic()
            try:
                return await attempt()
            except Exception as exc:
                now = time.monotonic()
                if first is None:
                    first = began
                left = first + self.patience - now
                if (self.patience <= 0 or left <= 0 or self._abandoned is not None
                        or not _unreachable(exc)):
                    raise
                if self._hurried is None:
                    self._hurried = asyncio.Event()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._hurried.wait(),
                                           unreachable_pause(now - first, left))

    async def _write(self, batch: list[tuple[Work, asyncio.Future[Any], Failed]]) -> bool:
        """Write a batch in one transaction. If any write fails, the transaction is rolled back
        and each write runs again in a transaction of its own, so a failure stays with the
        write that caused it (rejected writes are rare: a lost lease, a bug)."""
        began = time.monotonic()
        outcomes: list[Outcome] | None = None
        try:
            with translate_errors(self.db.target):
                outcomes = await self._together(batch)
                if outcomes is None:
                    outcomes = []
                    for work, future, _ in batch:
                        outcomes.append(await self._alone(work, future))
        except (DatabaseError, psycopg.Error) as exc:
            # Not committed, or we cannot know: try those writes again in a later batch. They
            # are fenced, so a write that did commit is rejected the next time. The writes
            # that already ran alone have ended (committed or refused): they keep their
            # outcome and are not written again.
            if outcomes:
                self._settle(outcomes)
            self._retry(batch[len(outcomes or ()):], exc, began)
            return False
        self.batches += 1
        self.writes += len(batch)
        if self._unreachable_since is not None:
            log.info("group commits succeed again, %.1f s after the first that failed "
                     "because the database could not be reached",
                     time.monotonic() - self._unreachable_since)
            self._unreachable_since = None
        metrics = self.db.metrics
        metrics.observe("commit_latency_seconds", time.monotonic() - began)
        metrics.observe("commit_batch_size", len(batch))
        self._settle(outcomes)
        return True

    def _settle(self, outcomes: list[Outcome]) -> None:
        """Answer each write of ``outcomes`` with its value or its error."""
        metrics = self.db.metrics
        for future, value, error in outcomes:
            if future.done():
                continue
            if isinstance(error, LeaseLost):
                metrics.incr("fenced_writes_rejected")
            if isinstance(error, psycopg.errors.InsufficientPrivilege):
                denied = privilege_denied(self.db.target, error)
                denied.__cause__, error = error, denied
            if error is not None:
                future.set_exception(error)
            else:
                future.set_result(value)

    async def _together(self, batch: list[tuple[Work, asyncio.Future[Any], Failed]]
                        ) -> list[Outcome] | None:
        values: list[Outcome] = []
        async with self.db.checkout() as conn:
            try:
                groups = _group([(w, f) for w, f, _ in batch if isinstance(w, Statement)])
                if sum(len(group) for group in groups) == len(batch):
                    # Statements only (the hot path): one round trip (see _commit_statements).
                    await self._commit_statements(conn, groups, values)
                else:
                    # Other work reads row counts as it goes: it runs outside pipeline mode.
                    async with conn.transaction():
                        await self._statements(conn, groups, values)
                        for work, future, _ in batch:
                            if not isinstance(work, Statement):
                                values.append((future, await work(conn), None))
            except Exception as exc:  # noqa: BLE001 - rolled back; the writes go one by one
                if connection_failed(exc):  # not the writes': the batch goes again
                    raise
                await _roll_back(conn)
                if len(batch) == 1:
                    return [_miss(batch[0][0], batch[0][1], exc)]
                return None
        return values

    async def _commit_statements(self, conn: Conn, groups: list[Group],
                                 values: list[Outcome]) -> None:
        """Every group's statement in one pipeline: one round trip, one transaction. The
        connection is in autocommit mode and the pipeline ends with a single Sync, and in the
        extended query protocol everything up to a Sync is one transaction, committed at the
        Sync (no BEGIN or COMMIT to send). A row that does not apply makes its statement raise
        (``row_applied``), which aborts that transaction: nothing of the batch is committed.
        The rows' results are read once it has committed.

        A batch of one statement (most batches of a stream) is sent outside pipeline mode: an
        autocommit statement is its own transaction, committed at its own Sync, which is the
        same round trip and the same transaction without the pipeline's machinery (45 µs of
        the writer's CPU per batch: ``bench.batches`` at a batch size of 1, 350 → 305)."""
        if not conn.autocommit:  # psycopg would open a transaction that nothing commits
            raise DatabaseError("the group writer needs connections in autocommit mode")
        if len(groups) == 1:
            cursors = await self._send(conn, groups)
        else:
            async with conn.pipeline():
                cursors = await self._send(conn, groups)
        await _read(groups, cursors, values)

    async def _statements(self, conn: Conn, groups: list[Group],
                          values: list[Outcome]) -> None:
        """Each group as one statement (pipelined) inside the caller's transaction."""
        if groups:
            async with conn.pipeline():
                cursors = await self._send(conn, groups)
            await _read(groups, cursors, values)

    async def _send(self, conn: Conn, groups: list[Group]) -> list[Any]:
        self.statements += len(groups)
        return [await conn.execute(group[0][0].sql, (_rows(group),)) for group in groups]

    async def _alone(self, work: Work, future: asyncio.Future[Any]) -> Outcome:
        async with self.db.checkout() as conn:
            try:
                if isinstance(work, Statement):
                    values: list[Outcome] = []
                    await self._commit_statements(conn, [[(work, future)]], values)
                    return values[0]
                async with conn.transaction():
                    return future, await work(conn), None
            except Exception as exc:  # noqa: BLE001 - belongs to that write alone
                if connection_failed(exc):  # unless the connection failed under it
                    raise
                await _roll_back(conn)
                return _miss(work, future, exc)

    def _retry(self, batch: list[tuple[Work, asyncio.Future[Any], Failed]],
               exc: BaseException, began: float) -> None:
        """Queue the writes of a batch that failed (begun at ``began``) again, or answer them
        with the error when they have been tried enough: for as long as the patience lasts
        when the database could not be reached, else ``attempts`` times."""
        unreachable = _unreachable(exc)
        if not unreachable:
            log.warning("a group commit failed (%s); retrying its writes", type(exc).__name__)
        elif self._unreachable_since is None:  # once, until a batch commits again
            self._unreachable_since = began
            log.warning("a group commit failed (%s); retrying its writes while the database "
                        "cannot be reached (said once: a line says when commits succeed "
                        "again)", type(exc).__name__)
        patient = self.patience > 0 and unreachable
        now = time.monotonic()
        pause = LONGEST_PAUSE  # as long as the youngest failure, within its patience
        waiting = False
        for work, future, failed in batch:
            if future.done():
                continue
            tries, since = failed if failed is not None else (0, began)
            tries += 1
            left = since + self.patience - now
            if patient and left > 0:
                self._queue.append((work, future, (tries, since)))
                pause = min(pause, unreachable_pause(now - since, left))
                waiting = True
            elif not patient and tries < self.attempts:
                self._queue.append((work, future, (tries, since)))
            else:
                error = exc if isinstance(exc, DatabaseError) else DatabaseError(
                    f"writes to {self.db.target.display} keep failing ({type(exc).__name__})")
                future.set_exception(error)
        self._pause = pause if waiting else RETRY_PAUSE


def _unreachable(exc: BaseException) -> bool:
    """A failed batch's error says the database could not be reached or the connection failed
    (nothing about its writes): ``DATABASE_UNAVAILABLE`` and retryable (a wrong password or a
    schema that does not match is not), or a connection failure not yet translated."""
    if isinstance(exc, DatabaseError):
        return exc.retryable and exc.code == "DATABASE_UNAVAILABLE"
    return connection_failed(exc)


ROW_NOT_APPLIED = "OR001"
"""SQLSTATE raised by ``orchestrator.row_applied`` for a row of a Statement that did not apply."""


def _miss(work: Work, future: asyncio.Future[Any], exc: BaseException) -> Outcome:
    """The outcome of a write that failed alone: a Statement row that did not apply gets what
    its ``check`` says of no result (its own error); anything else keeps the database's."""
    if isinstance(work, Statement) and getattr(exc, "sqlstate", None) == ROW_NOT_APPLIED:
        try:
            return future, work.check(None), None
        except Exception as miss:  # noqa: BLE001 - the check's verdict is the outcome
            return future, None, miss
    return future, None, exc


async def _roll_back(conn: Conn) -> None:
    """End a transaction that an error may have left open, so that the connection goes back to
    the pool idle; nothing to do when the server ended it already (a pipeline's Sync does)."""
    if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
        await conn.execute("ROLLBACK")


def _group(statements: Group) -> list[Group]:
    """Statements by SQL, in arrival order; a key seen twice in a group starts another one."""
    groups: list[Group] = []
    open_: dict[str, tuple[Group, set[object]]] = {}
    for item in statements:
        found = open_.get(item[0].sql)
        if found is None or item[0].key in found[1]:
            found = ([], set())
            open_[item[0].sql] = found
            groups.append(found[0])
        found[0].append(item)
        found[1].add(item[0].key)
    return groups


async def _read(groups: list[Group], cursors: list[Any], values: list[Outcome]) -> None:
    """Each row's value from its statement's result (by ``i``). The statements refused any row
    that did not apply, so a check that still objects answers its own write only."""
    for group, cursor in zip(groups, cursors, strict=True):
        got = {row["i"]: row for row in await cursor.fetchall()}
        for i, (w, f) in enumerate(group, start=1):
            try:
                values.append((f, w.check(got.get(i)), None))
            except Exception as exc:  # noqa: BLE001
                values.append((f, None, exc))


def _rows(group: Group) -> str:
    return "[" + ",".join(w.row for w, _ in group) + "]"
