"""Connections: one async pool per event loop, the error-translation seam and notifications.

Store functions in the sibling modules take a connection and never commit; the code that owns
the transaction is here (:meth:`Database.transaction`) or in the worker's writer. Database
errors are translated into public errors once, in :func:`translate_errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar, cast

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import set_json_loads
from psycopg_pool import AsyncConnectionPool
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from orchestrator.db.config import DatabaseTarget
from orchestrator.errors import (
    ConfigurationError,
    DatabaseError,
    OrchestratorError,
    RunUnreadable,
)

T = TypeVar("T")
Conn = psycopg.AsyncConnection[dict[str, Any]]

RUNS_CHANNEL = "orchestrator_runs"
"""NOTIFY channel: new or woken work. The payload is unused; any message means 'look again'."""
RECONCILE_CHANNEL = "orchestrator_reconcile"
"""NOTIFY channel: a run was parked on an unknown operation."""
CANCEL_CHANNEL = "orchestrator_cancel"
"""NOTIFY channel: cancellation was requested; the payload is the run id."""


def _transient(exc: BaseException) -> bool:
    """Database-level failures that are safe to retry inside the storage layer (C7)."""
    if isinstance(exc, psycopg.errors.SerializationFailure | psycopg.errors.DeadlockDetected):
        return True
    return isinstance(exc, psycopg.OperationalError) and not isinstance(
        exc, psycopg.errors.QueryCanceled
    )


@contextlib.contextmanager
def translate_errors(target: DatabaseTarget) -> Any:
    """Turn driver errors into public errors, keeping the cause chained: an unreachable
    database or a missing schema is a :class:`DatabaseError`, a missing privilege a
    :class:`ConfigurationError` that names it."""
    try:
        yield
    except OrchestratorError:
        raise
    except psycopg.OperationalError as exc:
        raise DatabaseError(
            f"the database at {target.masked} is unavailable ({type(exc).__name__})"
        ) from exc
    except psycopg_pool_errors() as exc:
        raise DatabaseError(f"no database connection available from {target.masked}") from exc
    except psycopg.errors.InsufficientPrivilege as exc:
        raise privilege_denied(target, exc) from exc
    except _SCHEMA_MISSING as exc:
        raise DatabaseError(
            f"the database at {target.masked} has no orchestrator schema "
            f"({type(exc).__name__}); run `orchestrator db upgrade`",
            code="SCHEMA_MISMATCH", retryable=False,
        ) from exc


_SCHEMA_MISSING = (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName)
"""What a statement meets on a database whose schema was never created. (A missing column or
function could as well be a bug as a schema behind the code, so those are not translated; a
schema that is behind is refused by ``db check`` and when a worker starts.)"""


def load_json(data: bytes | str) -> Any:
    """The decoder of every ``json``/``jsonb`` value this package reads: a value this process
    cannot decode (nested deeper than the interpreter's recursion allows, an integer longer
    than it parses) raises :class:`RunUnreadable` instead of the interpreter's own error, so
    that it fails the one run it belongs to and never the process reading it."""
    try:
        return json.loads(data)
    except (RecursionError, ValueError) as exc:
        raise RunUnreadable(f"a stored JSON value cannot be decoded here "
                            f"({type(exc).__name__})") from None


async def _configure(conn: psycopg.AsyncConnection[Any]) -> None:
    set_json_loads(load_json, conn)


def privilege_denied(target: DatabaseTarget, exc: psycopg.Error) -> ConfigurationError:
    """A statement the database user may not run: a deployment's grants, not a bug. The
    server's primary message names the object ("permission denied for table workers") and
    nothing else, so it is kept."""
    denied = exc.diag.message_primary or type(exc).__name__
    return ConfigurationError(
        f"the database at {target.masked} refused a statement: {denied}; grant the runtime "
        "role's privileges with `orchestrator db grant --role ROLE` (see docs/security.md)")


def psycopg_pool_errors() -> type[Exception]:
    from psycopg_pool import PoolTimeout

    return PoolTimeout


class Database:
    """Async access to one database: pools per event loop, transactions with bounded retries.

    Every write path that can run twice safely (it is fenced and idempotent at the SQL level)
    goes through :meth:`run_in_transaction`, which retries serialisation failures, deadlocks and
    dropped connections with a small budget. Nothing in here ever calls a tool.
    """

    def __init__(self, target: DatabaseTarget, *, max_pool_size: int = 10) -> None:
        self.target = target
        self.max_pool_size = max_pool_size
        self._pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncConnectionPool] = (
            weakref.WeakKeyDictionary()
        )
        self._opening: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )

    async def pool(self) -> AsyncConnectionPool:
        loop = asyncio.get_running_loop()
        pool = self._pools.get(loop)
        if pool is not None:
            return pool
        lock = self._opening.setdefault(loop, asyncio.Lock())
        async with lock:  # concurrent first calls share one pool
            return await self._open_pool(loop)

    async def _open_pool(self, loop: asyncio.AbstractEventLoop) -> AsyncConnectionPool:
        pool = self._pools.get(loop)
        if pool is None:
            pool = AsyncConnectionPool(
                self.target.url,
                min_size=1,
                max_size=self.max_pool_size,
                kwargs={"row_factory": dict_row, "autocommit": True,
                        "prepare_threshold": 0},
                open=False,
                timeout=30,
                configure=_configure,
            )
            with translate_errors(self.target):
                await pool.open(wait=True, timeout=15)
            self._pools[loop] = pool
        return pool

    async def close(self) -> None:
        """Close the pool of the running loop (other loops close theirs)."""
        loop = asyncio.get_running_loop()
        pool = self._pools.pop(loop, None)
        if pool is not None:
            await pool.close()

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[Conn]:
        pool = await self.pool()
        with translate_errors(self.target):
            async with pool.connection() as conn:
                yield cast(Conn, conn)

    async def run_in_transaction(
        self, work: Callable[[Conn], Awaitable[T]], *, attempts: int = 4
    ) -> T:
        """Run ``work(conn)`` in one transaction; retry transient database failures only."""
        return await self._run(work, attempts=attempts, transaction=True)

    async def run_autocommit(
        self, work: Callable[[Conn], Awaitable[T]], *, attempts: int = 4
    ) -> T:
        """Run ``work(conn)`` without a transaction block (each statement commits on its own:
        for work that is one statement, or whose statements stand alone); retry transient
        database failures only."""
        return await self._run(work, attempts=attempts, transaction=False)

    async def _run(self, work: Callable[[Conn], Awaitable[T]], *, attempts: int,
                   transaction: bool) -> T:
        retrying = AsyncRetrying(
            retry=retry_if_exception(_transient),
            stop=stop_after_attempt(attempts),
            wait=wait_random_exponential(multiplier=0.02, max=0.5),
            reraise=True,
        )
        with translate_errors(self.target):
            async for attempt in retrying:
                with attempt:
                    pool = await self.pool()
                    async with pool.connection() as raw:
                        conn = cast(Conn, raw)
                        if not transaction:
                            return await work(conn)
                        async with conn.transaction():
                            return await work(conn)
        raise AssertionError("unreachable")  # pragma: no cover

    async def listen(self, channels: Sequence[str], on_message: Callable[[str, str], None],
                     stop: asyncio.Event) -> None:
        """LISTEN on ``channels`` until ``stop`` is set; reconnect after a dropped connection.

        ``on_message(channel, payload)`` is called for each notification, and once with
        ``("", "")`` after every (re)connection, since anything may have been missed.
        """
        while not stop.is_set():
            try:
                conn = await psycopg.AsyncConnection.connect(self.target.url, autocommit=True)
            except psycopg.OperationalError:
                await _wait_or_stop(stop, 1.0)
                continue
            try:
                async with conn:
                    for channel in channels:
                        await conn.execute(f"LISTEN {channel}")
                    on_message("", "")
                    while not stop.is_set():
                        async for note in conn.notifies(timeout=0.5):
                            on_message(note.channel, note.payload)
                            if stop.is_set():
                                break
            except psycopg.OperationalError:
                await _wait_or_stop(stop, 0.5)


async def _wait_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
