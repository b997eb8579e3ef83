"""A ``listen_url`` that cannot be reached when a worker or a reconciler starts: it starts (the
database URL works; a worker claims nothing until it holds its liveness lock), and the check
that ``listen_url`` reaches the database URL's database is made once it connects, before the
lock is used. One that turns out to reach another database then stops it with
``CONFIGURATION_ERROR``, as it would have at start."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import parse_qs, parse_qsl, urlencode, urlsplit, urlunsplit

import pytest

from orchestrator.db import workers as workers_db
from orchestrator.errors import ConfigurationError
from tests.consoletools import GRANTS, Client, from_header
from tests.integration.test_ops_bulk import cli


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _socket_dir(url: str) -> str | None:
    """The Unix socket directory ``url`` names (``?host=/dir``, as the embedded server's URL
    does), or None for a TCP address."""
    hosts = [h for h in parse_qs(urlsplit(url).query).get("host", []) if h.startswith("/")]
    return hosts[0] if hosts else None


def _at(url: str, port: int, database: str | None = None) -> str:
    """``url`` reached through 127.0.0.1:``port`` (and in ``database``, if given)."""
    parts = urlsplit(url)
    userinfo, _, _ = parts.netloc.rpartition("@")
    netloc = f"{userinfo}@127.0.0.1:{port}" if userinfo else f"127.0.0.1:{port}"
    query = urlencode([(k, v) for k, v in parse_qsl(parts.query) if k != "host"])
    return urlunsplit(parts._replace(netloc=netloc, query=query,
                                     path=parts.path if database is None else f"/{database}"))


@contextlib.asynccontextmanager
async def _relay(port: int, url: str) -> AsyncIterator[None]:
    """From now on, 127.0.0.1:``port`` leads to ``url``'s server (the path comes up)."""
    parts = urlsplit(url)
    pumps: set[asyncio.Task[None]] = set()

    async def pump(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                sink.write(data)
                await sink.drain()
        finally:
            sink.close()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        where = _socket_dir(url)
        if where is not None:  # the embedded server: its socket
            port_given = parse_qs(parts.query).get("port", [None])[0]
            up_reader, up_writer = await asyncio.open_unix_connection(
                f"{where}/.s.PGSQL.{parts.port or port_given or 5432}")
        else:
            up_reader, up_writer = await asyncio.open_connection(
                parts.hostname or "127.0.0.1", parts.port or 5432)
        pumps.add(asyncio.ensure_future(pump(reader, up_writer)))
        pumps.add(asyncio.ensure_future(pump(up_reader, writer)))

    server = await asyncio.start_server(serve, "127.0.0.1", port)
    try:
        yield
    finally:
        server.close()
        for task in pumps:
            task.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def _until(predicate: Callable[[], Any], what: str, timeout: float = 15.0) -> None:
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout
    while not predicate():
        assert loop.time() < give_up, f"timed out waiting for {what}"
        await asyncio.sleep(0.05)


async def _stopped(service: Any, task: asyncio.Future[Any], app: Any) -> None:
    """A test's worker or reconciler stopped at once (asked twice) if it still runs."""
    if not task.done():
        service.request_stop()
        service.request_stop()
        with contextlib.suppress(BaseException):
            await asyncio.wait_for(task, 20)
    await app.database.close()


async def test_a_worker_checks_a_listen_url_that_comes_up_late_before_it_uses_its_lock(
        make_app, sql, migrated_database_url) -> None:
    """``listen_url`` names another database (the server's ``postgres``) and cannot be reached
    at start, so the start's check was skipped; once it came up, the liveness lock taken there
    was published and used without a word (a late beat then made the worker look dead to every
    sweep, its runs re-queued while their calls were in flight). It is checked when it is
    first taken: the worker never publishes it, and stops with ``CONFIGURATION_ERROR``."""
    port = _free_port()
    app = make_app(listen_url=_at(migrated_database_url, port, "postgres"), lease_ttl=1.5)
    worker = app.create_worker(poll_interval=0.2, worker_id="W")
    task = asyncio.ensure_future(worker.run())
    try:
        await _until(lambda: sql("SELECT 1 FROM orchestrator.workers WHERE id = 'W'"),
                     "the worker to register without its lock")
        published: list[Any] = []
        async with _relay(port, migrated_database_url):
            give_up = asyncio.get_running_loop().time() + 15
            while not task.done() and asyncio.get_running_loop().time() < give_up:
                published += sql("SELECT lock_key FROM orchestrator.workers WHERE id = 'W' "
                                 "AND lock_key IS NOT NULL")
                await asyncio.wait([task], timeout=0.05)
        assert published == []  # never used: no sweep could take it for dead
        assert task.done(), "the worker went on"
        with pytest.raises(ConfigurationError) as caught:
            task.result()
        assert "does not reach the database" in caught.value.message
        assert sql("SELECT id FROM orchestrator.workers") == []
    finally:
        await _stopped(worker, task, app)


async def test_a_worker_whose_listen_url_comes_up_late_takes_its_lock_then(
        make_app, sql, migrated_database_url) -> None:
    """The same database reached directly, unreachable at start: the worker starts (it says
    so), and takes and publishes its liveness lock once the path comes up."""
    port = _free_port()
    app = make_app(listen_url=_at(migrated_database_url, port), lease_ttl=1.5)
    worker = app.create_worker(poll_interval=0.2, worker_id="W")
    task = asyncio.ensure_future(worker.run())
    try:
        await _until(lambda: sql("SELECT 1 FROM orchestrator.workers WHERE id = 'W'"),
                     "the worker to register without its lock")
        async with _relay(port, migrated_database_url):
            await _until(lambda: task.done() or sql(
                "SELECT 1 FROM orchestrator.workers WHERE id = 'W' AND lock_key IS NOT NULL"),
                "the worker to publish its lock")
            assert not task.done(), task.exception()
            worker.request_stop()
            await asyncio.wait_for(task, 20)
    finally:
        await _stopped(worker, task, app)


async def test_a_reconciler_checks_a_listen_url_that_comes_up_late(
        make_app, migrated_database_url) -> None:
    """The reconciler's LISTEN on a ``listen_url`` that reaches another database hears nothing;
    refused at start, but not checked at all when ``listen_url`` could not be reached then.
    It is checked once it can be: the reconciler stops with ``CONFIGURATION_ERROR``."""
    port = _free_port()
    app = make_app(listen_url=_at(migrated_database_url, port, "postgres"))
    reconciler = app.create_reconciler(poll_interval=0.2)
    task = asyncio.ensure_future(reconciler.run())
    try:
        await asyncio.sleep(1.0)
        assert not task.done(), task.exception()  # started: the database URL works
        async with _relay(port, migrated_database_url):
            with pytest.raises(ConfigurationError) as caught:
                await asyncio.wait_for(asyncio.shield(task), 15)
        assert "does not reach the database" in caught.value.message
        assert "reconciler" in caught.value.message
    finally:
        await _stopped(reconciler, task, app)


async def test_a_worker_waiting_for_its_lock_is_listed_waiting_not_live(
        make_app, sql, migrated_database_url) -> None:
    """A worker whose ``listen_url`` cannot be reached heartbeats but claims nothing until it
    holds its liveness lock; ``workers list`` (its table and ``--json``), ``GET /api/workers``
    and the console's pages showed it ``live``, like a worker taking work. It is ``waiting``
    until it holds its lock (then ``live``); a worker behind a transaction pooler without a
    ``listen_url``, which takes no lock by design, is ``live`` as before."""
    port = _free_port()
    app = make_app(listen_url=_at(migrated_database_url, port), lease_ttl=1.5)
    async with app.database.connection() as conn:  # no place for a lock: it takes none
        await workers_db.worker_register(conn, worker_id="pooled", hostname="h", pid=1,
                                         workflows=[], concurrency=1)

    async def beat() -> None:  # the pooled worker's heartbeat
        while True:
            sql("UPDATE orchestrator.workers SET heartbeat_at = now() WHERE id = 'pooled'")
            await asyncio.sleep(0.2)

    beating = asyncio.ensure_future(beat())
    worker = app.create_worker(poll_interval=0.2, worker_id="W")
    task = asyncio.ensure_future(worker.run())
    console = app.console(from_header, grants=GRANTS)
    try:
        await _until(lambda: sql("SELECT 1 FROM orchestrator.workers WHERE id = 'W'"),
                     "the worker to register without its lock")
        code, doc, err = await cli(migrated_database_url, "workers", "list", "--json")
        assert code == 0, err
        states = {w["id"]: (w["state"], w["liveness_lock"]) for w in json.loads(doc)["workers"]}
        assert states == {"W": ("waiting", None), "pooled": ("live", None)}
        code, out, err = await cli(migrated_database_url, "workers", "list")
        assert code == 0, err
        assert next(line for line in out.splitlines()
                    if line.startswith("W ")).split()[1] == "waiting"
        assert "waiting: it heartbeats, but holds no liveness lock yet" in out
        async with Client(console, "alice") as client:
            listed = (await client.get("/api/workers")).json()["workers"]
            page = (await client.get("/workers")).text
            overview = (await client.get("/api/overview")).json()["workers"]
            overview_page = (await client.get("/")).text
        assert {w["id"]: w["state"] for w in listed} == {"W": "waiting", "pooled": "live"}
        assert 'class="holder h-waiting">waiting</strong>' in page
        assert overview == {"alive": 2, "draining": 0, "waiting": 1, "registered": 2}
        assert "of which 1 waiting (no liveness lock yet, taking no work)" in overview_page
        async with _relay(port, migrated_database_url):
            await _until(lambda: task.done() or sql(
                "SELECT 1 FROM orchestrator.workers WHERE id = 'W' AND lock_key IS NOT NULL"),
                "the worker to publish its lock")
            code, doc, err = await cli(migrated_database_url, "workers", "list", "--json")
            assert code == 0, err
            (mine,) = [w for w in json.loads(doc)["workers"] if w["id"] == "W"]
            assert (mine["state"], mine["liveness_lock"]) == ("live", True)
            worker.request_stop()
            await asyncio.wait_for(task, 20)
    finally:
        beating.cancel()
        await _stopped(worker, task, app)
