"""Connections: one async pool per event loop, the error-translation seam and notifications.

Store functions in the sibling modules take a connection and never commit; the code that owns
the transaction is here (:meth:`Database.transaction`) or in the worker's writer. Database
errors are translated into public errors once, in :func:`translate_errors`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import random
import select
import time
import weakref
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeVar, cast

import psycopg
from psycopg.rows import dict_row
from psycopg.types.json import set_json_loads
from psycopg_pool import AsyncConnectionPool, PoolTimeout
from psycopg_pool.base import AttemptWithBackoff
from tenacity import (
    AsyncRetrying,
    retry_if_exception,
    stop_after_attempt,
    wait_random_exponential,
)

from orchestrator.db.config import DatabaseTarget, display_url
from orchestrator.db.probe import (
    APPLICATION_NAME,
    DEFAULT_CONNECT_TIMEOUT,
    connect_options,
    keepalive_options,
    ping_async,
)
from orchestrator.errors import (
    ConfigurationError,
    DatabaseError,
    OrchestratorError,
    RunUnreadable,
)
from orchestrator.metrics import Metrics

if TYPE_CHECKING:
    from orchestrator.db.revisions import SchemaStatus

T = TypeVar("T")
log = logging.getLogger("orchestrator")
Conn = psycopg.AsyncConnection[dict[str, Any]]

RUNS_CHANNEL = "orchestrator_runs"
"""NOTIFY channel: new or woken work. The payload says where to look: a queue's name (news of
that queue), :data:`DEFAULT_QUEUE_NEWS` (a run outside every queue), or empty (news of any
run: look everywhere; every sender of the engine names the queues now, see
``db.runs.NEWS_OF``, and workers still read an empty payload from an older one)."""
DEFAULT_QUEUE_NEWS = "."
"""The payload on :data:`RUNS_CHANNEL` of news of the default queue alone (a run submitted
outside every queue): no queue's name can be it (names never start with '.'), and workers look
in the default queue only, not in every queue they know."""
RECONCILE_CHANNEL = "orchestrator_reconcile"
"""NOTIFY channel: a run was parked on an unknown operation."""
CANCEL_CHANNEL = "orchestrator_cancel"
"""NOTIFY channel: cancellation was requested; the payload is the run id."""
EVENTS_CHANNEL = "orchestrator_events"
"""NOTIFY channel: an event was stored for a run; the payload is the run id, a tab, and the
event's name (the worker holding the run wakes a branch waiting for it in place)."""
TOOLS_CHANNEL = "orchestrator_tools"
"""NOTIFY channel: a tool's dispatch is paused (a provider's back-off); the payload is the
tool's name, a tab, and the end of the pause in seconds since the epoch."""


def out_of_step(exc: BaseException) -> bool:
    """The driver found the connection's protocol out of step (psycopg's ``InternalError``
    raised by the client, with no SQLSTATE from a server: "received 2 results from command
    'COMMIT'", "got no result from the query"). Seen through a transaction pooler whose server
    session was terminated under a transaction. Like a lost connection it says nothing of the
    statement, and the connection cannot be trusted with another: :meth:`Database.checkout`
    closes it (:func:`discard`)."""
    return isinstance(exc, psycopg.InternalError) and exc.sqlstate is None


def connection_failed(exc: BaseException) -> bool:
    """A failure of the connection rather than of the statement: lost (psycopg's
    ``OperationalError``) or :func:`out_of_step`."""
    return isinstance(exc, psycopg.OperationalError) or out_of_step(exc)


async def discard(conn: psycopg.AsyncConnection[Any], exc: BaseException) -> None:
    """Close a connection that :func:`out_of_step` ``exc`` came from, so that the pool
    replaces it instead of lending it again (a lost one is closed already)."""
    if out_of_step(exc) and not conn.closed:
        log.warning("a database connection went out of step (%s); it is closed and the "
                    "work goes on another", exc)
        with contextlib.suppress(Exception):
            await conn.close()


def _transient(exc: BaseException) -> bool:
    """Database-level failures that are safe to retry inside the storage layer (C7). (A
    connection that cannot be had is not one: :meth:`Database.checkout` has already waited
    and raised the reason.)"""
    if isinstance(exc, psycopg.errors.SerializationFailure | psycopg.errors.DeadlockDetected):
        return True
    return connection_failed(exc) and not isinstance(
        exc, psycopg.errors.QueryCanceled | PoolTimeout
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
    except PoolTimeout as exc:
        raise DatabaseError(f"no database connection available from {target.display}") from exc
    except psycopg.OperationalError as exc:
        raise DatabaseError(
            f"the database at {target.display} is unavailable ({type(exc).__name__})"
        ) from exc
    except psycopg.InternalError as exc:
        if not out_of_step(exc):
            raise
        raise DatabaseError(
            f"the connection to {target.display} went out of step ({exc})") from exc
    except psycopg.errors.InsufficientPrivilege as exc:
        raise privilege_denied(target, exc) from exc
    except _UNDEFINED as exc:
        mismatch = schema_mismatch(target)
        if mismatch is not None:
            raise mismatch from exc
        if isinstance(exc, _SCHEMA_MISSING):
            raise schema_missing(target) from exc
        raise  # a column or function missing from a schema that matches: a bug, as it is


def schema_missing(target: DatabaseTarget) -> DatabaseError:
    """``SCHEMA_MISMATCH`` for a database whose orchestrator schema was never created: the one
    wording of the Python API, a worker and a reconciler."""
    return DatabaseError(
        f"the database at {target.display} has no orchestrator schema; "
        "run `orchestrator db upgrade`", code="SCHEMA_MISMATCH", retryable=False)


def schema_error(target: DatabaseTarget, status: SchemaStatus) -> DatabaseError:
    """``SCHEMA_MISMATCH`` for a database that does not match the code (behind, ahead or
    empty, in the words of :meth:`SchemaStatus.describe`): what a worker or a reconciler
    refuses to start on, and what a statement that met a missing table, column or function
    on such a database says (:func:`translate_errors`)."""
    if status.state == "empty":
        return schema_missing(target)
    return DatabaseError(f"{target.display}: {status.describe()}", code="SCHEMA_MISMATCH",
                         retryable=False)


def schema_mismatch(target: DatabaseTarget) -> DatabaseError | None:
    """:func:`schema_error` for the database's stamp when it does not match the code; None
    when it matches or cannot be read. One short statement on a connection of its own (the
    failed statement's may be in an aborted transaction), only on the error path of a
    missing table, column or function."""
    from orchestrator.db import revisions  # loads Alembic's script reader: only on this path

    try:
        with psycopg.connect(target.url, connect_timeout=5, autocommit=True) as conn:
            row = conn.execute(
                "SELECT version_num FROM orchestrator.alembic_version").fetchone()
    except (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName):
        row = None  # no schema at all
    except psycopg.Error:
        return None
    status = revisions.status_of(None if row is None else str(row[0]))
    return None if status.ok else schema_error(target, status)


_SCHEMA_MISSING = (psycopg.errors.UndefinedTable, psycopg.errors.InvalidSchemaName)
_UNDEFINED = (*_SCHEMA_MISSING, psycopg.errors.UndefinedColumn,
              psycopg.errors.UndefinedFunction)
"""What a statement meets on a database whose schema is missing, behind the code or ahead of
it: :func:`schema_mismatch` tells which from the stamp. A missing column or function on a
schema that matches the code is a bug and stays as it is; a missing table there (dropped by
hand) reads as no schema."""


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


POOL_FAILURES_EVERY = 30.0
"""Seconds between two of the pool's lines for failed attempts to connect in one outage."""

_POOL_FAILED = "error connecting in %r: %s"  # psycopg_pool's own line for a failed attempt


class PoolFailuresOnce(logging.Filter):
    """A filter for psycopg_pool's logger: its WARNING for each failed attempt of this
    package's pools to connect (``error connecting in 'orchestrator': …``), which comes about
    once a second per pool while the database is down (:class:`_Pool`), is let through once,
    then at most once every ``every`` seconds with how many it left out; a connection made
    (:meth:`connected`, or the pool's own line saying so where its level shows it) ends the
    streak. Every other line, and other pools', passes."""

    def __init__(self, every: float = POOL_FAILURES_EVERY,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.every = every
        self.clock = clock
        self._said_at: float | None = None  # None: no streak
        self._left_out = 0

    def connected(self) -> None:
        self._said_at, self._left_out = None, 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == "adding new connection to the pool":
            self.connected()
            return True
        args = record.args
        if record.msg != _POOL_FAILED or not isinstance(args, tuple) or not args \
                or args[0] != POOL_NAME:
            return True
        now = self.clock()
        if self._said_at is not None and now - self._said_at < self.every:
            self._left_out += 1
            return False
        if self._left_out:
            record.msg += f" ({self._left_out} more attempts failed since the last such line)"
        self._said_at, self._left_out = now, 0
        return True


POOL_LOG_FILTER = PoolFailuresOnce()
"""The one filter on psycopg_pool's logger (``psycopg.pool``), added when a pool first opens."""


async def _configure(conn: psycopg.AsyncConnection[Any]) -> None:
    set_json_loads(load_json, conn)
    POOL_LOG_FILTER.connected()


def privilege_denied(target: DatabaseTarget, exc: psycopg.Error) -> ConfigurationError:
    """A statement the database user may not run: a deployment's grants, not a bug. The
    server's primary message names the object ("permission denied for table workers") and
    nothing else, so it is kept."""
    denied = exc.diag.message_primary or type(exc).__name__
    return ConfigurationError(
        f"the database at {target.display} refused a statement: {denied}; grant the runtime "
        "role's privileges with `orchestrator db grant --role ROLE` (see docs/security.md)")


POOL_TIMEOUT = 30.0
"""Seconds a call waits for a pooled connection while every one is in use."""
QUICK_WAIT = 1.0
"""A call that has waited this long for a pooled connection asks whether the server can be
reached at all (see :meth:`Database.checkout`)."""
PROBE_TTL = 1.0
"""Seconds one such answer is shared by every call of an event loop, so that a busy pool does
not open a probing connection per waiting call."""
POOL_NAME = "orchestrator"
RECONNECT_PAUSE = 1.0
"""The longest pause, in seconds (give or take a tenth), between a pool's attempts to connect
after its connections were lost (see :class:`_Pool`)."""


class _Reconnecting(AttemptWithBackoff):
    """psycopg_pool's record of its attempts to add a connection, whose pause doubles from one
    second without a bound (1, 2, 4, 8 s …), with the pause capped at :data:`RECONNECT_PAUSE`,
    jittered so that a fleet's pools do not knock in step. It still gives up after the pool's
    ``reconnect_timeout``."""

    def update_delay(self, now: float) -> None:
        super().update_delay(now)
        self.delay = min(self.delay, RECONNECT_PAUSE * random.uniform(0.9, 1.1))


class _Pool(AsyncConnectionPool):
    """The pool, reconnecting at most :data:`RECONNECT_PAUSE` apart. With psycopg_pool's own
    pauses an outage was over for a worker only at the pool's next attempt: the attempts came
    about 1, 3, 7 and 15 s after the first failure, so the database back after 8 s was reached
    at 15 s, as long as a write waits with the default 30 s lease (and the runs writing then
    were let go). An attempt against a server that is down is refused at once; one per second
    per pool costs it nothing."""

    async def _add_connection(self, attempt: AttemptWithBackoff | None,
                              growing: bool = False) -> None:
        await super()._add_connection(
            attempt or _Reconnecting(timeout=self.reconnect_timeout), growing)


@dataclasses.dataclass
class _LoopPool:
    """One event loop's pool, and the last answer to "can the server be reached?"."""

    pool: AsyncConnectionPool
    probing: asyncio.Lock
    probed_at: float
    probe_error: OrchestratorError | None = None


class Database:
    """Async access to one database: pools per event loop, transactions with bounded retries.

    Connections. The first use in an event loop connects once on its own (with the connect
    timeout, :data:`~orchestrator.db.probe.DEFAULT_CONNECT_TIMEOUT`) before it opens the pool,
    so a database that cannot be reached fails at once with the reason the CLI gives
    (:func:`~orchestrator.db.probe.connect_error`), and ``retryable`` is false for a missing
    database or role or a wrong password. Every checkout hands out a live connection: one whose
    server went away (a restart, a failover, ``pg_terminate_backend``) is noticed before any
    statement is sent on it, and replaced (see :meth:`checkout`).

    Retries. :meth:`read`, :meth:`run_in_transaction` and :meth:`run_autocommit` run their work
    again, with a small budget, after a serialisation failure, a deadlock or a connection lost
    under it. A transaction lost before its COMMIT was sent never committed, so running it
    again is always safe; work lost while it may have committed (an autocommit statement, a
    COMMIT under way) runs again only when it is idempotent: reads, and writes that are fenced
    or keyed at the SQL level (every caller's default). Work that is not (``idempotent=False``)
    raises ``DATABASE_UNAVAILABLE`` saying the outcome is unknown instead. Work that runs again
    after a COMMIT that applied finds its own writes: work whose answer depends on them runs
    as :func:`orchestrator.db.xact.answered_once`, which answers as the attempt that committed
    did. Nothing in here
    ever calls a tool.
    """

    def __init__(self, target: DatabaseTarget, *, max_pool_size: int = 10,
                 connect_timeout: float = DEFAULT_CONNECT_TIMEOUT) -> None:
        self.target = target
        self.max_pool_size = max_pool_size
        self.connect_timeout = connect_timeout
        # What its connections are called in pg_stat_activity (a worker or a reconciler
        # names those it opens after itself: probe.connection_name).
        self.application_name = APPLICATION_NAME
        # Where the statements tried again, the group commits and the writes the fence refused
        # are counted (the application's; a database of its own counts in one of its own).
        self.metrics = Metrics()
        self._pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopPool] = (
            weakref.WeakKeyDictionary()
        )
        self._opening: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, asyncio.Lock] = (
            weakref.WeakKeyDictionary()
        )

    async def pool(self) -> AsyncConnectionPool:
        """The running loop's pool, opened on first use (after one connection succeeded)."""
        return (await self._loop_pool()).pool

    async def _loop_pool(self) -> _LoopPool:
        loop = asyncio.get_running_loop()
        state = self._pools.get(loop)
        if state is not None:
            return state
        lock = self._opening.setdefault(loop, asyncio.Lock())
        async with lock:  # concurrent first calls share one pool
            return await self._open_pool(loop)

    async def _open_pool(self, loop: asyncio.AbstractEventLoop) -> _LoopPool:
        state = self._pools.get(loop)
        if state is not None:
            return state
        # One connection of our own first: a pool that cannot connect only retries and logs
        # the driver's text, and its caller learns nothing but a timeout.
        await ping_async(self.target, timeout=self.connect_timeout)
        pool = _Pool(
            self.target.url,
            min_size=1,
            max_size=self.max_pool_size,
            kwargs={"row_factory": dict_row, "autocommit": True,
                    "prepare_threshold": self.target.prepare_threshold,
                    **connect_options(self.target, self.connect_timeout,
                                      name=self.application_name)},
            open=False,
            timeout=POOL_TIMEOUT,
            configure=_configure,
            name=POOL_NAME,
        )
        pool_logger = logging.getLogger("psycopg.pool")
        if POOL_LOG_FILTER not in pool_logger.filters:
            pool_logger.addFilter(POOL_LOG_FILTER)
        await pool.open(wait=False)
        state = _LoopPool(pool, asyncio.Lock(), probed_at=time.monotonic())
        self._pools[loop] = state
        return state

    async def close(self) -> None:
        """Close the pool of the running loop (other loops close theirs)."""
        loop = asyncio.get_running_loop()
        state = self._pools.pop(loop, None)
        if state is not None:
            await state.pool.close()

    @contextlib.asynccontextmanager
    async def checkout(self) -> AsyncIterator[Conn]:
        """A live pooled connection for the block, returned to the pool after it; driver
        errors are not translated (:meth:`connection` does that).

        Before it is handed out, a connection whose socket has something to read while it sits
        idle (what a server that ended the session sends: an ``AdminShutdown`` notice, or the
        end of the stream) is checked with psycopg_pool's own ``check_connection`` (one round
        trip); one that fails it is given back (the pool closes it and opens another) and the
        pool's other idle connections are replaced too, since whatever ended one session most
        likely ended them all. A healthy connection costs no round trip. (The pool's own
        ``check=`` hook is not used: it pauses one second, then two, four … between failed
        checks, so a pool full of dead connections would outlast the pool timeout.)

        A call that waits more than :data:`QUICK_WAIT` seconds for a connection asks whether
        the server can be reached (:func:`~orchestrator.db.probe.ping_async`, its answer shared
        for :data:`PROBE_TTL`): if not, ``DATABASE_UNAVAILABLE`` with the reason, within about
        the connect timeout; if so, the pool is busy and the call keeps waiting, up to
        :data:`POOL_TIMEOUT`.

        A connection the block's error shows :func:`out_of_step` is closed before it goes
        back, so the pool replaces it (:func:`discard`).
        """
        state = await self._loop_pool()
        conn = await self._live_connection(state)
        try:
            async with conn:
                try:
                    yield cast(Conn, conn)
                except psycopg.InternalError as exc:
                    await discard(conn, exc)  # closed first: no ROLLBACK sent on it
                    raise
        finally:
            await state.pool.putconn(conn)

    async def _live_connection(self, state: _LoopPool) -> psycopg.AsyncConnection[Any]:
        conn = await self._getconn(state)
        for _ in range(self.max_pool_size):
            if not _may_be_dead(conn):
                return conn
            try:
                await AsyncConnectionPool.check_connection(conn)
                return conn
            except psycopg.Error:
                await state.pool.putconn(conn)  # the pool sees it broken and replaces it
                await state.pool.drain()  # the idle ones, without a round trip each
            except BaseException:  # cancelled under the check: the connection is not lost
                await state.pool.putconn(conn)  # (one left mid-query is closed by the pool)
                raise
            conn = await self._getconn(state)
        return conn  # a statement on it fails and is retried like any lost connection

    async def _getconn(self, state: _LoopPool) -> psycopg.AsyncConnection[Any]:
        with contextlib.suppress(PoolTimeout):
            return await state.pool.getconn(timeout=QUICK_WAIT)
        deadline = time.monotonic() + POOL_TIMEOUT - QUICK_WAIT
        while True:
            await self._reachable(state)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise DatabaseError(
                    f"no connection to {self.target.display} became free within "
                    f"{POOL_TIMEOUT:.0f} s: all {self.max_pool_size} pooled connections are "
                    "in use (the pool_size option)")
            with contextlib.suppress(PoolTimeout):
                return await state.pool.getconn(timeout=min(remaining, self.connect_timeout))

    async def _reachable(self, state: _LoopPool) -> None:
        """Raise the reason the server cannot be reached, asking it at most once per
        :data:`PROBE_TTL` whatever the number of waiting calls."""
        async with state.probing:
            if time.monotonic() - state.probed_at >= PROBE_TTL:
                try:
                    await ping_async(self.target, timeout=self.connect_timeout)
                    state.probe_error = None
                except OrchestratorError as exc:
                    state.probe_error = exc
                state.probed_at = time.monotonic()
            known = state.probe_error
        if known is not None:
            raise type(known)(known.message, code=known.code,
                              retryable=known.retryable) from known.__cause__

    @contextlib.asynccontextmanager
    async def connection(self) -> AsyncIterator[Conn]:
        """A live pooled connection (see :meth:`checkout`) with errors translated. The block
        is not run again after a connection lost under it: reads that should be use
        :meth:`read`."""
        with translate_errors(self.target):
            async with self.checkout() as conn:
                yield conn

    async def read(self, work: Callable[[Conn], Awaitable[T]], *, attempts: int = 4) -> T:
        """Run ``work(conn)``, which only reads, without a transaction block; a connection
        lost under it (or a serialisation failure) runs it again: a read is always safe to
        repeat."""
        return await self._run(work, attempts=attempts, transaction=False, idempotent=True)

    async def run_in_transaction(
        self, work: Callable[[Conn], Awaitable[T]], *, attempts: int = 4,
        idempotent: bool = True,
    ) -> T:
        """Run ``work(conn)`` in one transaction; retry transient database failures only.

        A failure before the COMMIT was sent is always retried (nothing was committed); a
        connection lost during the COMMIT is retried only when ``idempotent`` (the work is
        fenced or keyed, so a second run of a committed one changes nothing), else it raises
        ``DATABASE_UNAVAILABLE`` saying the outcome is unknown."""
        return await self._run(work, attempts=attempts, transaction=True,
                               idempotent=idempotent)

    async def run_autocommit(
        self, work: Callable[[Conn], Awaitable[T]], *, attempts: int = 4,
        idempotent: bool = True,
    ) -> T:
        """Run ``work(conn)`` without a transaction block (each statement commits on its own:
        for work that is one statement, or whose statements stand alone); retry transient
        database failures only. Any statement may have committed when its connection is lost,
        so that is retried only when ``idempotent`` (see :meth:`run_in_transaction`)."""
        return await self._run(work, attempts=attempts, transaction=False,
                               idempotent=idempotent)

    async def _run(self, work: Callable[[Conn], Awaitable[T]], *, attempts: int,
                   transaction: bool, idempotent: bool) -> T:
        retrying = AsyncRetrying(
            retry=retry_if_exception(_transient),
            stop=stop_after_attempt(attempts),
            wait=wait_random_exponential(multiplier=0.02, max=0.5),
            reraise=True,
            before_sleep=self._retrying,
        )
        with translate_errors(self.target):
            async for attempt in retrying:
                with attempt:
                    async with self.checkout() as conn:
                        return await self._once(conn, work, transaction=transaction,
                                                idempotent=idempotent)
        raise AssertionError("unreachable")  # pragma: no cover

    def _retrying(self, _: Any) -> None:
        self.metrics.incr("database_retries")

    async def _once(self, conn: Conn, work: Callable[[Conn], Awaitable[T]], *,
                    transaction: bool, idempotent: bool) -> T:
        committing = not transaction  # an autocommit statement commits as it runs
        try:
            if not transaction:
                return await work(conn)
            async with conn.transaction():
                result = await work(conn)
                committing = True
            return result
        except psycopg.Error as exc:
            if not connection_failed(exc):
                raise
            if committing and not idempotent and (conn.broken or out_of_step(exc)):
                await discard(conn, exc)  # what goes up is not the driver's error any more
                raise DatabaseError(
                    f"the connection to {self.target.display} was lost while a change was "
                    "being committed: it may or may not have been applied, and it is not "
                    "safe to repeat blindly", retryable=False) from exc
            raise

    async def listen(self, channels: Sequence[str], on_message: Callable[[str, str], None],
                     stop: asyncio.Event) -> None:
        """LISTEN on ``channels`` until ``stop`` is set; reconnect after a dropped connection,
        and try again after a refused LISTEN (a server in recovery), saying so once. A lost
        connection is said once, however many reconnections fail after it, and its return
        once. The connection has TCP keepalives (:data:`~orchestrator.db.probe.LISTEN_KEEPALIVES`,
        unless the URL sets its own): it only waits, and a path that dropped without a word
        would otherwise never be noticed.

        ``on_message(channel, payload)`` is called for each notification, and once with
        ``("", "")`` after every (re)connection, since anything may have been missed. An
        exception it raises is logged with the channel and the payload (a run's id, a queue's
        name), and the listener goes on: one bad notification does not leave it deaf.

        The connection is the target's :attr:`~DatabaseTarget.session_url` (a LISTEN lives in a
        session, which a transaction pooler does not keep). Without one nothing is listened
        to: ``on_message("", "")`` is called once and the caller's poll does the rest.
        """
        url = self.target.session_url
        if url is None:
            _deliver(on_message, "", "")
            await stop.wait()
            return
        refused = False  # LISTEN was refused since it last succeeded (said once)
        lost = False  # the connection was lost and none listens again yet (said once)
        options = (connect_options(self.target, self.connect_timeout,
                                   name=self.application_name) | keepalive_options(url))
        while not stop.is_set():
            try:
                conn = await psycopg.AsyncConnection.connect(url, autocommit=True, **options)
            except psycopg.OperationalError:
                await _wait_or_stop(stop, 1.0)
                continue
            try:
                async with conn:
                    for channel in channels:
                        await conn.execute(f"LISTEN {channel}")
                    refused = False
                    if lost:
                        log.info("listening on %s again; news that came meanwhile is looked "
                                 "for now", display_url(url))
                        lost = False
                    _deliver(on_message, "", "")
                    while not stop.is_set():
                        async for note in conn.notifies(timeout=0.5):
                            _deliver(on_message, note.channel, note.payload)
                            if stop.is_set():
                                break
            except psycopg.OperationalError as exc:
                if not lost and not stop.is_set():
                    log.warning("the listening connection to %s was lost (%s): until it is "
                                "back, news is found by polling only; reconnecting",
                                display_url(url),
                                exc.diag.message_primary or type(exc).__name__)
                lost = True
                await _wait_or_stop(stop, 0.5)
            except psycopg.Error as exc:
                # Refused, not lost: a server in recovery (a standby not promoted yet) refuses
                # LISTEN with an error of its own. Ending here would leave the caller deaf for
                # good; it polls meanwhile, and the server may be promoted.
                if not refused:
                    log.warning("LISTEN on %s was refused (%s): until it is accepted, news is "
                                "found by polling only; trying again every second",
                                display_url(url), exc.diag.message_primary or type(exc).__name__)
                refused = True
                await _wait_or_stop(stop, 1.0)


def _deliver(on_message: Callable[[str, str], None], channel: str, payload: str) -> None:
    try:
        on_message(channel, payload)
    except Exception:
        log.exception("the listener's callback failed on a notification on %r (payload %r); "
                      "listening goes on", channel, payload)


def _may_be_dead(conn: psycopg.AsyncConnection[Any]) -> bool:
    """Whether an idle connection shows a sign of its session having ended: closed, broken,
    or its socket readable (an idle session in autocommit is sent nothing but the server's
    goodbye; anything else, a stray notice, is read by the check that follows)."""
    if conn.closed or conn.broken:
        return True
    try:
        fd = conn.pgconn.socket
    except psycopg.OperationalError:
        return True
    poll = getattr(select, "poll", None)
    if poll is None:  # pragma: no cover - Windows
        return bool(select.select([fd], [], [], 0)[0])
    poller = poll()
    poller.register(fd, select.POLLIN)
    return bool(poller.poll(0))


async def _wait_or_stop(stop: asyncio.Event, seconds: float) -> None:
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), seconds)
