"""Behind PgBouncer in transaction mode (docs/operations.md): no statement is prepared, nothing
that lives in a session goes through the pooler, and LISTEN goes to ``listen_url``."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from orchestrator.db import workers as workers_db
from orchestrator.db.config import DatabaseTarget
from orchestrator.db.database import RUNS_CHANNEL, Conn, Database
from orchestrator.testing import wait_until_async
from tests.pgbouncer import POOL_SIZE, PgBouncer

ROOT = Path(__file__).resolve().parents[2]
CLIENTS = 3 * POOL_SIZE  # more pooled connections than PgBouncer has server sessions


def _target(url: str, *, pooler: str | None, listen_url: str | None = None) -> DatabaseTarget:
    return DatabaseTarget(url, "argument", pooler=pooler, listen_url=listen_url)


async def _busy(db: Database, rounds: int = 15) -> None:
    """Every pooled connection runs the same statements again and again, at the same time:
    a statement prepared on one server session is soon run by a client on another."""
    async def once(conn: Conn) -> Any:
        cur = await conn.execute("SELECT count(*) AS n FROM orchestrator.runs WHERE id = %s",
                                 ("00000000-0000-0000-0000-000000000000",))
        return await cur.fetchone()

    async def client() -> None:
        for _ in range(rounds):
            await db.read(once, attempts=1)
            await db.run_in_transaction(once, attempts=1)

    outcomes = await asyncio.gather(*(client() for _ in range(CLIENTS)), return_exceptions=True)
    await db.close()
    for outcome in outcomes:
        if isinstance(outcome, BaseException):
            raise outcome


async def test_no_statement_is_prepared_behind_a_transaction_pooler(
        pgbouncer: PgBouncer, migrated_database_url: str) -> None:
    pooled = pgbouncer.url(migrated_database_url)
    db = Database(_target(pooled, pooler="transaction"), max_pool_size=CLIENTS)
    await _busy(db)
    # The same work on a direct connection's terms (every statement prepared) breaks there:
    # the check above is one PgBouncer could fail.
    direct_terms = Database(_target(pooled, pooler=None), max_pool_size=CLIENTS)
    with pytest.raises(psycopg.errors.ProgrammingError, match="prepared statement"):
        await _busy(direct_terms)


async def _notified(db: Database, send: Callable[[], Awaitable[None]], *,
                    expect: int) -> list[tuple[str, str]]:
    """What ``db.listen`` hands on while ``send`` notifies: once ``expect`` messages came (or
    10 s passed), anything more that comes within half a second."""
    seen: list[tuple[str, str]] = []
    first = asyncio.Event()
    stop = asyncio.Event()

    def on_message(channel: str, payload: str) -> None:
        seen.append((channel, payload))
        first.set()

    listener = asyncio.ensure_future(db.listen([RUNS_CHANNEL], on_message, stop))
    await asyncio.wait_for(first.wait(), 10)  # ("", ""): listening, or nothing to listen to
    await send()
    with contextlib.suppress(AssertionError):
        await wait_until_async(lambda: len(seen) >= expect, timeout=10)
    await asyncio.sleep(0.5)  # room for a message that should not come
    stop.set()
    await asyncio.wait_for(listener, 10)
    return seen


async def test_notifications_go_to_listen_url_and_nowhere_without_it(
        pgbouncer: PgBouncer, migrated_database_url: str) -> None:
    pooled = pgbouncer.url(migrated_database_url)
    sender = Database(_target(pooled, pooler="transaction"))

    async def send() -> None:
        async def notify(conn: Conn) -> None:
            await conn.execute("SELECT pg_notify(%s, 'default')", (RUNS_CHANNEL,))
        await sender.run_in_transaction(notify)

    direct = Database(_target(pooled, pooler="transaction", listen_url=migrated_database_url))
    assert await _notified(direct, send, expect=2) == [("", ""), (RUNS_CHANNEL, "default")]
    polling = Database(_target(pooled, pooler="transaction"))
    assert await _notified(polling, send, expect=1) == [("", "")]
    await sender.close()


def _lock_held(sql: Callable[..., list[dict[str, Any]]], key: int) -> bool:
    return bool(sql("SELECT 1 FROM pg_locks WHERE locktype = 'advisory' AND granted "
                    "AND objsubid = 1 AND ((classid::bigint << 32) | objid::bigint) = %s",
                    (key,)))


async def test_the_liveness_lock_lives_on_listen_url_or_is_not_taken(
        pgbouncer: PgBouncer, migrated_database_url: str,
        sql: Callable[..., list[dict[str, Any]]]) -> None:
    pooled = pgbouncer.url(migrated_database_url)
    direct = _target(pooled, pooler="transaction", listen_url=migrated_database_url)
    lock = workers_db.LivenessLock(direct.session_url, 7_000_123)
    assert await lock.ensure() and lock.key == 7_000_123
    assert _lock_held(sql, 7_000_123)
    await lock.close()  # the worker's process ending: its direct session ends with it
    await wait_until_async(lambda: not _lock_held(sql, 7_000_123), timeout=10)
    # Through the pooler alone there is nowhere to hold it: a session lock taken there would
    # stay with a server session that outlives the worker. None is taken, none registered.
    none = workers_db.LivenessLock(_target(pooled, pooler="transaction").session_url, 7_000_124)
    assert await none.ensure() and none.held and none.key is None
    assert not _lock_held(sql, 7_000_124)


async def test_a_listen_url_that_reaches_another_database_stops_the_worker_before_it_starts(
        pgbouncer: PgBouncer, migrated_database_url: str,
        sql: Callable[..., list[dict[str, Any]]]) -> None:
    """A worker whose ``listen_url`` named another database (here the server's ``postgres``)
    started without a word: its liveness lock was held there, where no sweep looks, so it
    showed ``dead`` as soon as a beat was late (a pause of a second) and the next sweep of
    another worker re-queued its runs while their calls were still in flight, which the lock
    is there to prevent. It is refused before it registers or claims anything."""
    from orchestrator import Orchestrator
    from orchestrator.db.config import _with_database
    from orchestrator.errors import ConfigurationError

    elsewhere = _with_database(migrated_database_url, "postgres")
    app = Orchestrator(pgbouncer.url(migrated_database_url), pooler="transaction",
                       listen_url=elsewhere)
    try:
        worker = app.create_worker(poll_interval=0.2)
        with pytest.raises(ConfigurationError) as caught:
            await asyncio.wait_for(worker.run(), 30)
        assert "listen_url" in caught.value.message
        assert "does not reach the database" in caught.value.message
        assert sql("SELECT id FROM orchestrator.workers") == []
        # Let go of at once (its server session ends a moment after the connection closes).
        await wait_until_async(lambda: not _lock_held(sql, worker._liveness.key or 0),
                               timeout=5)
    finally:
        await app.database.close()


async def test_a_listen_url_that_reaches_another_database_stops_the_reconciler_before_it_starts(
        pgbouncer: PgBouncer, migrated_database_url: str,
        sql: Callable[..., list[dict[str, Any]]]) -> None:
    """The reconciler LISTENs on ``listen_url`` too: one that named another database (here the
    server's ``postgres``) started without a word and heard none of the database's news
    (a NOTIFY reaches only the listeners of its own database), so every unknown call waited
    for the poll, and nothing said why. It is refused as the worker is, before it claims
    anything: ``CONFIGURATION_ERROR``."""
    from orchestrator import Orchestrator
    from orchestrator.db.config import _with_database
    from orchestrator.errors import ConfigurationError

    elsewhere = _with_database(migrated_database_url, "postgres")
    # Advisory locks held in the database listen_url names (the server's other databases
    # are other tests' and other sessions' business: counting them made this test flaky
    # beside any other work on the server).
    held_there = ("SELECT count(*) AS n FROM pg_locks WHERE locktype = 'advisory' AND database "
                  "= (SELECT oid FROM pg_database WHERE datname = 'postgres')")
    before = sql(held_there)
    app = Orchestrator(pgbouncer.url(migrated_database_url), pooler="transaction",
                       listen_url=elsewhere)
    try:
        reconciler = app.create_reconciler(poll_interval=0.2)
        with pytest.raises(ConfigurationError) as caught:
            await asyncio.wait_for(reconciler.run(), 10)
        assert caught.value.code == "CONFIGURATION_ERROR"
        assert "listen_url" in caught.value.message
        assert "does not reach the database" in caught.value.message
        assert "reconciler" in caught.value.message
        # The probe's session on listen_url is closed at once.
        assert sql(held_there) == before
    finally:
        await app.database.close()


async def test_a_listen_url_that_reaches_the_database_lets_the_reconciler_start(
        pgbouncer: PgBouncer, migrated_database_url: str) -> None:
    """The same check passes for a ``listen_url`` that is the database reached directly."""
    from orchestrator import Orchestrator

    app = Orchestrator(pgbouncer.url(migrated_database_url), pooler="transaction",
                       listen_url=migrated_database_url)
    try:
        reconciler = app.create_reconciler(poll_interval=0.2)
        task = asyncio.ensure_future(reconciler.run())
        await asyncio.sleep(1.0)
        assert not task.done(), task.exception() if task.done() else None
        reconciler.request_stop()
        await asyncio.wait_for(task, 20)
    finally:
        await app.database.close()


async def test_a_command_on_a_transaction_pooler_without_pooler_says_to_set_it(
        pgbouncer: PgBouncer, migrated_database_url: str) -> None:
    """An operator who points a command at PgBouncer in transaction mode and forgets
    ``--pooler transaction`` is told so, not ``INTERNAL: unexpected
    DuplicatePreparedStatement``."""
    pooled = pgbouncer.url(migrated_database_url)
    # Earlier clients on direct terms left their prepared statements on every server session
    # (a transaction pooler resets nothing between clients), as a worker's own pool does.
    clients = [await psycopg.AsyncConnection.connect(pooled, prepare_threshold=0)
               for _ in range(POOL_SIZE)]
    try:
        for conn in clients:  # each holds a server session of its own while it prepares
            await conn.execute("BEGIN")
            await conn.execute("SELECT %s::int AS n", (1,), prepare=True)
        for conn in clients:
            await conn.execute("COMMIT")
    finally:
        for conn in clients:
            await conn.close()
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "--database-url", pooled, "workers", "list"],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=60)
    assert done.returncode == 2, done.stdout + done.stderr
    assert "CONFIGURATION_ERROR" in done.stderr and "INTERNAL" not in done.stderr
    assert "--pooler transaction" in done.stderr

