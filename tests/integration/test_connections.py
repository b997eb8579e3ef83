"""Connections from the Python API: a database that cannot be reached fails fast and says why,
the way the CLI does; connections that died (terminated backends, a restarted server) never
fail a call; a listener refused by a server in recovery listens once it is promoted; a lost
listener says so once and listens again, and its connection has TCP keepalives."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import sys
import time
import uuid
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import psycopg
import pytest

from orchestrator import DatabaseError, Orchestrator, Owner, ResultTimeout
from orchestrator.db import migrate
from orchestrator.db.config import DatabaseTarget, validate_url
from orchestrator.db.database import Database
from orchestrator.db.probe import ping
from orchestrator.testing import wait_until_async
from tests import dbtools
from tests.integration.conftest import charge_in_flight
from tests.private_server import PrivateServer, private_server

OWNER = Owner(tenant="acme", principal="alice")


@pytest.fixture(scope="module")
def server() -> Iterator[PrivateServer]:
    """A server of this module's own: password authentication, and free to restart."""
    with private_server() as running:
        yield running


def _app(url: str) -> Orchestrator:
    app = Orchestrator(url, default_owner=OWNER)

    @app.workflow()
    async def echo(ctx, data):  # type: ignore[no-untyped-def]
        return data

    return app


def _bad_url(case: str, admin_url: str, server: PrivateServer) -> str:
    """A URL that is wrong in one way. A missing role is asked of the shared server (trust
    authentication): under password authentication a server answers for a missing role
    exactly as for a wrong password, so as not to tell which roles exist."""
    if case == "role":
        parts = urlsplit(admin_url)
        host = parts.netloc.rsplit("@", 1)[-1]
        return urlunsplit(parts._replace(netloc=f"no_such_role@{host}"))
    if case == "database":
        return dbtools.url_for_database(admin_url, f"missing_{uuid.uuid4().hex[:8]}")
    host = "no-such-host.invalid" if case == "host" else "127.0.0.1"
    port = 1 if case == "port" else server.port
    password = "not-the-password" if case == "password" else server.password
    return f"postgresql://postgres:{password}@{host}:{port}/postgres"


@pytest.mark.parametrize(
    ("case", "reason", "retryable"),
    [
        ("host", "the host name cannot be resolved", True),
        ("port", "connection refused", True),
        ("database", "the database does not exist", False),
        ("role", "the user (role) does not exist", False),
        ("password", "authentication failed (wrong password?)", False),
    ],
)
def test_a_database_that_cannot_be_reached_fails_fast_with_the_clis_words(
    case: str, reason: str, retryable: bool, pg_admin_url: str, server: PrivateServer,
    caplog: pytest.LogCaptureFixture,
) -> None:
    url = _bad_url(case, pg_admin_url, server)
    target = DatabaseTarget(validate_url(url), "argument")
    with pytest.raises(DatabaseError) as cli:  # what `orchestrator db …` prints
        ping(target)
    app = _app(url)
    caplog.set_level(logging.INFO)
    started = time.monotonic()
    try:
        with pytest.raises(DatabaseError) as api:
            app.list_runs()
    finally:
        elapsed = time.monotonic() - started
        app.close()

    assert elapsed < 5, f"{elapsed:.1f} s"
    assert api.value.code == "DATABASE_UNAVAILABLE"
    assert str(api.value) == str(cli.value)
    assert api.value.message.startswith(f"cannot connect to {target.display}: {reason}")
    assert api.value.retryable is retryable is cli.value.retryable
    assert "not-the-password" not in str(api.value)
    assert not [r for r in caplog.records if r.name.startswith("psycopg")], caplog.text


async def _terminate_others(url: str) -> int:
    """End every session of the database but this one; returns once they are gone."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as admin:
        cur = await admin.execute(
            "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid, 10000)) FROM "
            "pg_stat_activity WHERE datname = current_database() AND pid <> pg_backend_pid()")
        row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def _sessions(url: str) -> int:
    """How many other sessions the database has."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as admin:
        cur = await admin.execute(
            "SELECT count(*) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()")
        row = await cur.fetchone()
    assert row is not None
    return int(row[0])


async def _warm(app: Orchestrator, sessions: int = 6) -> None:
    """Hold several pooled connections at once, so that several idle ones die together."""
    async with contextlib.AsyncExitStack() as held:
        for _ in range(sessions):
            await held.enter_async_context(app.database.connection())


async def _hundred_calls(app: Orchestrator, first: uuid.UUID, break_them: object) -> None:
    """100 rounds of a read and keyed submissions; every 25th, the connections die first (the
    first call after that is a read, which nothing retried before)."""
    for i in range(100):
        if i % 25 == 0:
            await break_them()  # type: ignore[operator]
        assert (await app.get_run_async(first)).id == first
        run = await app.submit_async("echo", {"i": i}, idempotency_key=f"key-{i}")
        again = await app.submit_async("echo", {"i": i}, idempotency_key=f"key-{i}")
        assert again.id == run.id
        assert (await run.info_async()).status == "queued"
    assert len(await app.list_runs_async(limit=200)) == 101  # and the first one


async def test_calls_succeed_after_every_session_of_the_database_is_terminated(
    migrated_database_url: str,
) -> None:
    app = _app(migrated_database_url)
    first = await app.submit_async("echo", {}, idempotency_key="warm")
    terminated: list[int] = []

    async def break_them() -> None:
        await _warm(app)
        terminated.append(await _terminate_others(migrated_database_url))

    try:
        await _hundred_calls(app, first.id, break_them)
    finally:
        await app.database.close()
    assert min(terminated) >= 2, terminated  # several pooled connections died each time


async def test_calls_succeed_after_the_server_restarts(server: PrivateServer) -> None:
    name = dbtools.unique_name("restart")
    url = dbtools.create_database(server.url(), name)
    try:
        assert migrate.upgrade(DatabaseTarget(validate_url(url), "argument")).ok
        app = _app(url)
        first = await app.submit_async("echo", {}, idempotency_key="warm")

        open_before: list[int] = []

        async def break_them() -> None:
            await _warm(app)
            open_before.append(await _sessions(url))
            server.restart()

        try:
            await _hundred_calls(app, first.id, break_them)
        finally:
            await app.database.close()
        assert min(open_before) >= 6, open_before  # each restart ended that many sessions
    finally:
        dbtools.drop_database(server.url(), name)


async def test_a_submission_repeated_after_a_lost_connection_makes_no_second_run(
    migrated_database_url: str,
) -> None:
    """What a retry after a lost COMMIT does: the same row again, keyed or not, finds the run
    the first attempt made (its id was chosen before the first attempt)."""
    from orchestrator.db import runs as runs_db

    app = _app(migrated_database_url)
    (echo,) = app.registry.workflows.values()
    row = app.new_run_row(echo, {"x": 1}, owner=OWNER, idempotency_key=None, deadline=None)
    try:
        first = await app.database.run_autocommit(lambda conn: runs_db.run_insert(conn, row))
        again = await app.database.run_autocommit(lambda conn: runs_db.run_insert(conn, row))
        assert first == again == (row["id"], True, None)
        assert len(await app.list_runs_async()) == 1
    finally:
        await app.database.close()


def test_the_app_says_once_which_database_it_uses(
    server: PrivateServer, caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="orchestrator")
    app = Orchestrator(server.url())
    assert app.target is app.target
    said = [r.getMessage() for r in caplog.records if r.name == "orchestrator"]
    assert said == [f"using the database postgresql://postgres@127.0.0.1:{server.port}/postgres "
                    "(given as an argument)"]
    assert server.password not in caplog.text


async def test_a_listener_refused_by_a_server_in_recovery_listens_once_it_is_promoted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """LISTEN on a server in recovery (a standby, or an old primary back as one, reached by
    ``listen_url`` or a multi-host URL) is refused with an error of its own, not a lost
    connection. The listener says so once, tries again, and listens once the server is
    promoted. Before, it ended at the first refusal, and its worker heard no NOTIFY again."""
    caplog.set_level(logging.WARNING, logger="orchestrator")

    def refusals() -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.name == "orchestrator" and "LISTEN" in r.getMessage()]

    with private_server() as standby:
        (standby.data_dir / "standby.signal").touch()
        standby.restart()  # in recovery with no primary to follow: read-only until promoted
        db = Database(DatabaseTarget(validate_url(standby.url()), "argument"))
        seen: list[tuple[str, str]] = []
        stop = asyncio.Event()
        listener = asyncio.ensure_future(
            db.listen(["news"], lambda channel, payload: seen.append((channel, payload)), stop))
        try:
            await wait_until_async(lambda: listener.done() or refusals(), timeout=15)
            assert not listener.done()
            assert seen == []
            standby.pg_ctl("-w", "promote")
            await wait_until_async(lambda: seen, timeout=15)  # ("", ""): it listens
            with psycopg.connect(standby.url(), autocommit=True) as conn:
                conn.execute("NOTIFY news, 'promoted'")
            await wait_until_async(lambda: ("news", "promoted") in seen, timeout=10)
            assert len(refusals()) == 1, refusals()  # said once, not at every attempt
            assert "during recovery" in refusals()[0]
        finally:
            stop.set()
            await asyncio.wait_for(asyncio.gather(listener, return_exceptions=True), 10)


async def test_a_listener_whose_callback_raises_logs_it_and_keeps_listening(
    migrated_database_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A callback that raises on one notification is logged with the channel and the payload
    (a run's id, a queue's name) and the listener goes on: the next notification is heard.
    Before, the exception ended the listener for good and nothing was heard again."""
    caplog.set_level(logging.ERROR, logger="orchestrator")
    db = Database(DatabaseTarget(validate_url(migrated_database_url), "argument"))
    seen: list[tuple[str, str]] = []

    def on_message(channel: str, payload: str) -> None:
        if payload == "bad":
            raise ValueError("the callback's own bug")
        seen.append((channel, payload))

    stop = asyncio.Event()
    listener = asyncio.ensure_future(db.listen(["news"], on_message, stop))
    try:
        await wait_until_async(lambda: ("", "") in seen, timeout=10)  # it listens
        with psycopg.connect(migrated_database_url, autocommit=True) as conn:
            conn.execute("NOTIFY news, 'bad'")
            conn.execute("NOTIFY news, 'good'")
        await wait_until_async(lambda: listener.done() or ("news", "good") in seen, timeout=10)
        assert not listener.done()
        assert seen == [("", ""), ("news", "good")]  # no reconnection either
        (said,) = [r for r in caplog.records if r.name.startswith("orchestrator")]
        assert "'news'" in said.getMessage() and "'bad'" in said.getMessage()
        assert said.exc_info is not None and said.exc_info[0] is ValueError
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(listener, return_exceptions=True), 10)
        await db.close()


async def test_a_listener_whose_connection_is_lost_says_so_once_and_listens_again(
    migrated_database_url: str, pg_admin_url: str, caplog: pytest.LogCaptureFixture,
) -> None:
    """A listening connection that ends (a failover, ``pg_terminate_backend``, a dropped path
    found dead) is said lost once, however many reconnections fail after it, and said back
    once it listens again; notifications are heard again then. Before, both went unsaid: a
    listener that never came back left its workers polling without a word."""
    caplog.set_level(logging.INFO, logger="orchestrator")
    db = Database(DatabaseTarget(validate_url(migrated_database_url), "argument"))
    seen: list[tuple[str, str]] = []
    stop = asyncio.Event()
    listener = asyncio.ensure_future(
        db.listen(["news"], lambda channel, payload: seen.append((channel, payload)), stop))

    def said(word: str) -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.name == "orchestrator" and word in r.getMessage()]

    try:
        await wait_until_async(lambda: ("", "") in seen, timeout=10)  # it listens
        with psycopg.connect(migrated_database_url, autocommit=True) as conn:
            name = conn.execute("SELECT current_database()").fetchone()[0]  # type: ignore[index]
        with psycopg.connect(pg_admin_url, autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
            try:
                (row,) = admin.execute(
                    "SELECT pg_terminate_backend(pid, 10000) FROM pg_stat_activity "
                    "WHERE datname = %s AND query LIKE 'LISTEN %%'", (name,)).fetchall()
                assert row[0]
                await wait_until_async(lambda: said("was lost"), timeout=10)
                await asyncio.sleep(2.5)  # reconnections meanwhile, each refused (1 s apart)
                assert not listener.done()
            finally:
                admin.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')
        await wait_until_async(lambda: seen.count(("", "")) == 2, timeout=10)
        with psycopg.connect(migrated_database_url, autocommit=True) as conn:
            conn.execute("NOTIFY news, 'again'")
        await wait_until_async(lambda: ("news", "again") in seen, timeout=10)
        assert len(said("was lost")) == 1, caplog.text  # not once per refused reconnection
        assert len(said("listening on")) == 1, caplog.text
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(listener, return_exceptions=True), 10)
        await db.close()


def _socket_of_client_port(port: int) -> socket.socket | None:
    """A duplicate of this process's TCP socket whose local port is ``port``."""
    for fd in map(int, os.listdir("/proc/self/fd")):
        try:
            sock = socket.socket(fileno=os.dup(fd))
        except OSError:
            continue
        try:
            if sock.type == socket.SOCK_STREAM and sock.family == socket.AF_INET \
                    and sock.getsockname()[1] == port:
                return sock
        except OSError:
            pass
        sock.close()
    return None


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux socket options")
@pytest.mark.parametrize(("query", "idle"), [("", 30), ("?keepalives_idle=7", 7)])
async def test_the_listening_connection_has_tcp_keepalives(
    migrated_database_url: str, sql: Any, query: str, idle: int,
) -> None:
    """The listener only waits: without TCP keepalives a path that dropped without a word is
    never noticed. Its socket probes after 30 s of silence, 3 times 10 s apart (a dead path
    is given up within about a minute), unless the URL says otherwise."""
    db = Database(DatabaseTarget(validate_url(migrated_database_url + query), "argument"))
    seen: list[tuple[str, str]] = []
    stop = asyncio.Event()
    listener = asyncio.ensure_future(
        db.listen(["news"], lambda channel, payload: seen.append((channel, payload)), stop))
    try:
        await wait_until_async(lambda: ("", "") in seen, timeout=10)
        (row,) = sql("SELECT client_port FROM pg_stat_activity WHERE datname = "
                     "current_database() AND query LIKE 'LISTEN %%'")
        sock = _socket_of_client_port(row["client_port"])
        assert sock is not None
        with sock:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == idle
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 10
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 3
    finally:
        stop.set()
        await asyncio.wait_for(asyncio.gather(listener, return_exceptions=True), 10)
        await db.close()


@pytest.fixture
def outage_app(server: PrivateServer) -> Iterator[tuple[Orchestrator, str]]:
    """An app on a database of the private server (which a test may stop; it is started
    again afterwards) and that database's URL."""
    name = dbtools.unique_name("outage")
    url = dbtools.create_database(server.url(), name)
    app = _app(url)
    try:
        assert migrate.upgrade(DatabaseTarget(validate_url(url), "argument")).ok
        yield app, url
    finally:
        app.close()
        if not (server.data_dir / "postmaster.pid").exists():
            server.start()
        dbtools.drop_database(server.url(), name)


async def _close_in_this_loop(app: Orchestrator, server: PrivateServer) -> None:
    """Close what the test opened in its own event loop (the pool, the result poller), with
    the server up again: a pool left to refill against a stopped server keeps reconnecting
    while pytest closes the loop (app.close() closes only the sync calls' pools)."""
    if not (server.data_dir / "postmaster.pid").exists():
        await asyncio.to_thread(server.start)
    await app._waits.close()
    await app.database.close()


async def test_result_waits_whose_database_goes_down_raise_database_unavailable(
    server: PrivateServer, outage_app: tuple[Orchestrator, str],
) -> None:
    """The database stops while results are awaited (no worker: the runs stay queued), by
    ``result(timeout=)``, ``app.wait`` and ``app.as_completed``: each raises
    ``DATABASE_UNAVAILABLE`` within about the connect timeout, not at its own timeout (the
    shared poller cannot ask, wakes every waiter, and each reads its runs itself). Once the
    database is back, a wait works again."""
    app, _ = outage_app
    try:
        runs = [await app.submit_async("echo", {"n": n}) for n in range(3)]
        waits = [asyncio.ensure_future(run.result_async(timeout=120)) for run in runs]
        waits.append(asyncio.ensure_future(app.wait_async(runs, timeout=120)))
        waits.append(asyncio.ensure_future(anext(app.as_completed_async(runs, timeout=120))))
        poller = app._waits.poller()
        await wait_until_async(lambda: poller.polls >= 2 and len(poller.waiting) == 3,
                               timeout=10)
        await asyncio.to_thread(server.stop)
        started = time.monotonic()
        outcomes = await asyncio.wait_for(asyncio.gather(*waits, return_exceptions=True), 30)
        assert time.monotonic() - started < 20
        for outcome in outcomes:
            assert isinstance(outcome, DatabaseError), outcome
            assert outcome.code == "DATABASE_UNAVAILABLE" and outcome.retryable
        assert poller.waiting == {}
        await asyncio.to_thread(server.start)
        with pytest.raises(ResultTimeout) as still:
            await runs[0].result_async(timeout=0.2)
        assert still.value.status == "queued"
    finally:
        await _close_in_this_loop(app, server)


async def test_a_long_poll_whose_database_goes_down_answers_503(
    server: PrivateServer, outage_app: tuple[Orchestrator, str],
) -> None:
    """``GET /api/runs/{id}/result?wait=`` while the database stops: 503 with the public
    error ``DATABASE_UNAVAILABLE`` (retryable), soon, not after ``wait`` seconds."""
    import httpx

    from tests.consoletools import GRANTS, Served, from_header

    app, _ = outage_app
    console = app.console(from_header, GRANTS, authenticate_owner=lambda request: OWNER)
    try:
        run = await app.submit_async("echo", {"n": 1})
        with Served(console) as served:
            async with httpx.AsyncClient(base_url=served.base, timeout=60) as http:
                waiting = asyncio.ensure_future(http.get(f"/api/runs/{run.id}/result",
                                                         params={"wait": "60"}))
                await wait_until_async(
                    lambda: any(p.polls >= 1 and p.waiting for p in
                                list(app._waits._pollers.values())), timeout=10)
                await asyncio.to_thread(server.stop)
                started = time.monotonic()
                answer = await asyncio.wait_for(waiting, 30)
                assert time.monotonic() - started < 20
    finally:
        await _close_in_this_loop(app, server)
    assert answer.status_code == 503, answer.text
    body = answer.json()
    assert body["code"] == "DATABASE_UNAVAILABLE" and body["retryable"] is True
    assert set(body) == {"code", "message", "retryable", "incident"}
    # the message says what to do, not where the database lives (the console's log keeps
    # "cannot connect to …" under the incident), nor the code again in front of it
    assert body["message"] == "the database is unavailable; try again later", body["message"]


async def test_a_database_that_went_away_is_said_once_with_its_code_not_twice(
    server: PrivateServer, outage_app: tuple[Orchestrator, str],
) -> None:
    """A call that waits for a connection while the server is down raises the reason the
    server cannot be reached (asked once for every waiting call): its message said its code
    twice (``DATABASE_UNAVAILABLE: DATABASE_UNAVAILABLE: cannot connect …`` in a worker's
    ``lease sweep failed`` line and in an API caller's error), the code put in front of a
    message that had it already."""
    app, _ = outage_app
    try:
        await app.submit_async("echo", {}, idempotency_key="warm")
        await asyncio.to_thread(server.stop)
        with pytest.raises(DatabaseError) as lost:
            for _ in range(5):  # a dead pooled connection is replaced first: then it waits
                async with app.database.connection() as conn:
                    await conn.execute("SELECT 1")
        assert lost.value.code == "DATABASE_UNAVAILABLE"
        assert not lost.value.message.startswith("DATABASE_UNAVAILABLE"), lost.value.message
        assert str(lost.value).count("DATABASE_UNAVAILABLE") == 1, str(lost.value)
    finally:
        await _close_in_this_loop(app, server)


async def test_a_run_whose_writes_meet_a_short_outage_keeps_its_lease_and_finishes(
    server: PrivateServer, outage_app: tuple[Orchestrator, str],
) -> None:
    """The database stops while a run's call is in flight and starts again about four seconds
    later, well within the lease TTL: the call's receipt and the run's success are written
    once the database is back, by the same worker, under the same lease. (The writer tried
    three times, each attempt waiting about a second for a connection, and the run let go of
    its lease at once, "database unavailable": it was claimed again once the lease lapsed and
    its consequential call, sent and without a receipt, went to reconciliation.)"""
    from orchestrator.testing import running_worker

    app, url = outage_app
    entered, release = asyncio.Event(), asyncio.Event()

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        entered.set()
        await release.wait()
        return "charged"

    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    try:
        run = await app.submit_async(pay, {})
        async with running_worker(app, lease_ttl=12.0, poll_interval=0.2) as worker:
            await asyncio.wait_for(entered.wait(), 10)
            await asyncio.to_thread(server.stop)
            release.set()  # the receipt and the success are written while it is down
            await asyncio.sleep(3.5)
            await asyncio.to_thread(server.start)
            assert await run.result_async(timeout=20) == "charged"
        assert worker.claimed == 1
        assert worker.metrics.snapshot().get("lease_losses", 0) == 0
    finally:
        await _close_in_this_loop(app, server)
    with psycopg.connect(url) as conn:
        assert conn.execute("SELECT lease_token FROM orchestrator.runs").fetchall() == [(1,)]
        assert conn.execute("SELECT state FROM orchestrator.operations").fetchall() == [
            ("committed",)]
        assert conn.execute(
            "SELECT count(*) FROM orchestrator.reconciliation_items").fetchone() == (0,)


async def test_a_worker_writes_again_within_about_a_second_of_the_database_coming_back(
    server: PrivateServer, outage_app: tuple[Orchestrator, str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The database stops for about 7.5 s while a run's call is in flight, with the default
    30 s lease: the receipt and the success are written within about a second of the server
    accepting connections again, by the same worker under the same lease, and the pool's
    attempts meanwhile are logged once. (The connection
    pool's own pauses between attempts to connect doubled, 1, 2, 4, 8 s: its attempts came
    about 1, 3 and 7 s after the first failure, all refused, and the next only at about 15 s,
    some 6 s after the server was back and as long as a write waits with this lease.)"""
    from orchestrator.testing import running_worker

    app, _ = outage_app
    pay, entered, release = charge_in_flight(app)
    try:
        run = await app.submit_async(pay, "o1")
        async with running_worker(app, lease_ttl=30.0, poll_interval=0.2) as worker:
            await asyncio.wait_for(entered.wait(), 10)
            await asyncio.to_thread(server.stop)
            release.set()  # the receipt and the success are written while it is down
            await asyncio.sleep(7.5)
            await asyncio.to_thread(server.start)
            back = time.monotonic()
            assert await run.result_async(timeout=30) == {"charge": "o1"}
            took = time.monotonic() - back
        assert took < 4.0, f"the run finished {took:.1f} s after the database was back"
        # The pool tried about once a second, and said so once (database.PoolFailuresOnce).
        failed = [r for r in caplog.records if r.name == "psycopg.pool"
                  and r.getMessage().startswith("error connecting in 'orchestrator'")]
        assert len(failed) == 1, [r.getMessage() for r in failed]
        assert worker.claimed == 1
        assert worker.metrics.snapshot().get("lease_losses", 0) == 0
    finally:
        await _close_in_this_loop(app, server)


async def test_after_a_server_restart_a_worker_has_the_dead_after_time_to_take_its_lock_again(
    server: PrivateServer, outage_app: tuple[Orchestrator, str],
) -> None:
    """A restart ends every liveness lock, and every heartbeat from before it is old: the
    sweep counts such a heartbeat from the server's start, so a worker's runs are not taken
    for a dead worker's until ``stale`` seconds after the restart (the first worker back swept
    every worker's runs, its own too, and their calls in flight went to reconciliation)."""
    from psycopg.rows import dict_row

    from orchestrator.db import runs as runs_db

    _, url = outage_app
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO orchestrator.workers (id, hostname, pid, workflows, concurrency, "
            "lock_key, heartbeat_at) VALUES ('h:1:w', 'h', 1, '{}', 1, 12345, "
            "now() - interval '1 hour')")
        conn.execute(
            "INSERT INTO orchestrator.runs (id, tenant, principal, workflow_name, "
            "workflow_version, input, request_digest, status, lease_owner, lease_token, "
            "lease_expires_at) VALUES (gen_random_uuid(), 'acme', 'alice', 'echo', '1', "
            "'{}', 'd', 'running', 'h:1:w', 1, now() + interval '1 hour')")
    await asyncio.to_thread(server.stop)
    await asyncio.to_thread(server.start)
    aconn = await psycopg.AsyncConnection.connect(url, autocommit=True, row_factory=dict_row)
    try:
        assert await runs_db.run_release_orphaned(aconn, stale=30.0) == 0  # just restarted
        assert await runs_db.run_release_orphaned(aconn, stale=0.0) == 1  # dead all along
    finally:
        await aconn.close()
