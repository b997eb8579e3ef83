"""Database-level transient failures are retried inside the storage layer only (C7)."""

from __future__ import annotations

import psycopg
import pytest

from orchestrator.db.config import DatabaseTarget
from orchestrator.db.database import Database


async def test_serialisation_failures_are_retried_and_others_are_not(migrated_database_url):
    db = Database(DatabaseTarget(migrated_database_url, "argument"))
    calls = {"transient": 0, "bug": 0}

    async def flaky(conn):  # type: ignore[no-untyped-def]
        calls["transient"] += 1
        if calls["transient"] < 3:
            raise psycopg.errors.SerializationFailure("could not serialize access")
        return "done"

    async def broken(conn):  # type: ignore[no-untyped-def]
        calls["bug"] += 1
        raise psycopg.errors.UniqueViolation("duplicate key")

    assert await db.run_in_transaction(flaky) == "done"
    assert calls["transient"] == 3
    with pytest.raises(psycopg.errors.UniqueViolation):
        await db.run_in_transaction(broken)
    assert calls["bug"] == 1  # not transient: never retried
    await db.close()


async def test_a_connection_out_of_step_is_retried_on_another_and_closed(migrated_database_url,
                                                                        caplog):
    """psycopg's own InternalError (no SQLSTATE) means the connection's protocol went out of
    step, not that the work is wrong: retried like a lost connection, on another connection
    (the pool is not lent the suspect one again); translated when it persists. Work that is
    not idempotent is not repeated: its outcome is unknown. A server's InternalError (with a
    SQLSTATE) is not retried."""
    from orchestrator.errors import DatabaseError

    db = Database(DatabaseTarget(migrated_database_url, "argument"))
    used: list[psycopg.AsyncConnection] = []  # type: ignore[type-arg]

    async def once_out_of_step(conn):  # type: ignore[no-untyped-def]
        used.append(conn)
        if len(used) == 1:
            raise psycopg.InternalError("got no result from the query")
        return "done"

    assert await db.run_in_transaction(once_out_of_step) == "done"
    assert len(used) == 2 and used[0].closed and not used[1].closed
    assert "went out of step (got no result from the query)" in caplog.text  # said, once

    async def always(conn):  # type: ignore[no-untyped-def]
        raise psycopg.InternalError("received 2 results from command 'COMMIT'")

    with pytest.raises(DatabaseError) as info:
        await db.run_in_transaction(always)
    assert info.value.code == "DATABASE_UNAVAILABLE" and "out of step" in info.value.message

    calls = 0

    async def not_idempotent(conn):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        raise psycopg.InternalError("received 2 results from command 'COMMIT'")

    with pytest.raises(DatabaseError) as info:
        await db.run_autocommit(not_idempotent, idempotent=False)
    assert calls == 1 and not info.value.retryable
    assert "may or may not have been applied" in info.value.message

    async def server_internal(conn):  # type: ignore[no-untyped-def]
        await conn.execute("DO $$ BEGIN RAISE EXCEPTION 'broken' USING ERRCODE = 'XX000'; "
                           "END $$")

    with pytest.raises(psycopg.errors.InternalError_):
        await db.run_in_transaction(server_internal)

    # A block on a connection of its own (no retries): translated, and the connection closed.
    with pytest.raises(DatabaseError):
        async with db.connection() as conn:
            held = conn
            raise psycopg.InternalError("got no result from the query")
    assert held.closed
    await db.close()


async def test_a_commit_gone_out_of_step_is_repeated_only_for_idempotent_work(
        migrated_database_url, sql):
    """The driver going out of step on a transaction's COMMIT (the statement was sent; whether
    it applied is not known) is the lost-connection case of :meth:`run_in_transaction`: work
    that is not idempotent runs once and its caller hears that the outcome is unknown, work
    that is fenced or keyed is run again on another connection. Here the COMMIT does apply,
    so the count of rows says how often the work ran to its commit."""
    from orchestrator.errors import DatabaseError

    sql("CREATE TABLE commit_probe (note text)")
    db = Database(DatabaseTarget(migrated_database_url, "argument"))
    used: list[psycopg.AsyncConnection] = []  # type: ignore[type-arg]

    def out_of_step_after_the_commit(conn):  # type: ignore[no-untyped-def]
        """The next wait on ``conn`` (the COMMIT, as the work returns next) runs, then the
        driver says it lost step."""
        real = conn.wait

        async def wait(gen, *args, **kwargs):  # type: ignore[no-untyped-def]
            del conn.wait
            await real(gen, *args, **kwargs)
            raise psycopg.InternalError("received 2 results from command 'COMMIT'")

        conn.wait = wait

    def work(note: str):  # type: ignore[no-untyped-def]
        async def insert(conn):  # type: ignore[no-untyped-def]
            used.append(conn)
            await conn.execute("INSERT INTO commit_probe VALUES (%s)", (note,))
            if len(used) == 1:
                out_of_step_after_the_commit(conn)
            return note
        return insert

    with pytest.raises(DatabaseError) as info:
        await db.run_in_transaction(work("once"), idempotent=False)
    assert len(used) == 1 and used[0].closed  # not run again; the connection not lent again
    assert not info.value.retryable and "may or may not have been applied" in info.value.message
    assert sql("SELECT note FROM commit_probe") == [{"note": "once"}]

    used.clear()
    assert await db.run_in_transaction(work("again"), idempotent=True) == "again"
    assert len(used) == 2 and used[0].closed and not used[1].closed
    assert sorted(row["note"] for row in sql("SELECT note FROM commit_probe")) == [
        "again", "again", "once"]
    await db.close()


async def test_a_call_cancelled_while_its_connection_is_checked_gives_the_connection_back(
        migrated_database_url, sql, monkeypatch):
    """A pooled connection that may have been ended by the server is checked (one round trip)
    before it is lent. A call cancelled during that check (its task cancelled, a worker
    stopping) must still give the connection back to the pool: with one connection, the next
    call gets it at once instead of waiting for the pool timeout."""
    import asyncio

    from psycopg_pool import AsyncConnectionPool

    from orchestrator.db.database import _may_be_dead
    from orchestrator.testing import wait_until_async

    db = Database(DatabaseTarget(migrated_database_url, "argument"), max_pool_size=1)
    async with db.checkout() as conn:
        await conn.execute("LISTEN pool_probe")
    sql("NOTIFY pool_probe")  # the idle connection's socket has something to read
    await wait_until_async(lambda: _may_be_dead(conn), timeout=5)

    checking, real = asyncio.Event(), AsyncConnectionPool.check_connection

    async def slow_check(conn):  # type: ignore[no-untyped-def]
        checking.set()
        await asyncio.sleep(3600)  # the server is slow to answer
        await real(conn)

    monkeypatch.setattr(AsyncConnectionPool, "check_connection", staticmethod(slow_check))

    async def one(conn):  # type: ignore[no-untyped-def]
        return (await (await conn.execute("SELECT 1 AS one")).fetchone())["one"]

    call = asyncio.ensure_future(db.read(one))
    await asyncio.wait_for(checking.wait(), 5)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    monkeypatch.setattr(AsyncConnectionPool, "check_connection", real)
    assert await asyncio.wait_for(db.read(one), 5) == 1
    await db.close()
