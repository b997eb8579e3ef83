"""Fixtures for engine tests: an orchestrator on a fresh migrated database and workers that
run inside the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest

from orchestrator import Orchestrator, Owner
from orchestrator.testing import running_worker, wait_until_async
from orchestrator.worker import Worker

OWNER = Owner(tenant="acme", principal="alice")
OTHER = Owner(tenant="globex", principal="bob")


@pytest.fixture
def make_app(migrated_database_url: str) -> Iterator[Callable[..., Orchestrator]]:
    """Build orchestrators on this test's database; closed at the end of the test."""
    apps: list[Orchestrator] = []

    def make(**options: Any) -> Orchestrator:
        options.setdefault("default_owner", OWNER)
        options.setdefault("lease_ttl", 5.0)
        app = Orchestrator(migrated_database_url, **options)
        apps.append(app)
        return app

    make.apps = apps  # type: ignore[attr-defined]
    yield make
    for app in apps:
        app.close()


@pytest.fixture
def app(make_app: Callable[..., Orchestrator]) -> Orchestrator:
    return make_app()


@pytest.fixture(autouse=True)
async def _close_pools_on_the_test_loop(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """Close the pools an async test's apps opened on its loop (a read after ``running``
    reopens one) before the test's database is dropped: a pool left open would keep trying to
    reconnect to a dropped database while the loop shuts down."""
    if "make_app" not in request.fixturenames:
        yield
        return
    make = request.getfixturevalue("make_app")  # set up before this fixture, torn down after
    yield
    for made in make.apps:
        await made.database.close()


@contextlib.asynccontextmanager
async def running(app: Orchestrator, **options: Any) -> AsyncIterator[Worker]:
    """A worker running in this event loop for the body of the ``async with``
    (:func:`orchestrator.testing.running_worker`); the app's pool, which belongs to this
    loop, is closed after it."""
    options.setdefault("poll_interval", 0.2)
    try:
        async with running_worker(app, **options) as worker:
            yield worker
    finally:
        await app.database.close()


async def wait_for(predicate: Callable[[], Any], timeout: float = 10.0,
                   what: str | None = None) -> Any:
    """Wait for a condition (a test signal read from the database or from memory), never a
    fixed sleep: :func:`orchestrator.testing.wait_until_async`."""
    return await wait_until_async(predicate, timeout=timeout, what=what)


def long_until_marked(app: Orchestrator) -> tuple[Any, Any]:
    """Two tools, ``(long, mark)``: a call of ``long`` returns ``"long"`` only once ``mark``
    was called (it returns ``"marked"``). For tests of what one branch does (a timer) while
    another's call is in flight: the branch that calls ``mark`` at the end lets it return."""
    marked = asyncio.Event()

    @app.tool()
    async def mark(ctx):  # type: ignore[no-untyped-def]
        marked.set()
        return "marked"

    @app.tool()
    async def long(ctx):  # type: ignore[no-untyped-def]
        await marked.wait()
        return "long"

    return long, mark


def held_read(app: Orchestrator) -> tuple[Any, asyncio.Event, asyncio.Event]:
    """A workflow ``pay`` whose one call (``wait``, a read) runs until released: ``(pay,
    entered, release)``; ``entered`` is set once the tool runs. For tests of what a worker
    says or shows while a run is in flight."""
    entered, release = asyncio.Event(), asyncio.Event()

    @app.tool(effect="read")
    async def wait(ctx):  # type: ignore[no-untyped-def]
        entered.set()
        await release.wait()
        return 1

    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(wait)

    return pay, entered, release


async def never_answers() -> None:
    """What a tool awaits to stay busy: it does not return; it runs until the engine cancels
    it (its timeout, the run's deadline or cancellation, a task group's sibling failing)."""
    await asyncio.get_running_loop().create_future()


def one_turn() -> asyncio.Future[None]:
    """Resolves after one turn of the event loop: every callback that was ready now (a task
    woken, a cancellation delivered) has run. Not a wait for time: the test then asserts what
    did *not* happen in that turn."""
    loop = asyncio.get_running_loop()
    turn: asyncio.Future[None] = loop.create_future()
    loop.call_soon(lambda: loop.call_soon(turn.set_result, None))
    return turn


class ClaimWatch:
    """A test signal on a worker's claims: how many began, and the size of each one that
    returned. Install it before the worker starts (:func:`watch_claims`)."""

    def __init__(self) -> None:
        self.started = 0
        self.sizes: list[int] = []

    @property
    def between_claims(self) -> bool:
        """A claim has returned and none is under way."""
        return bool(self.sizes) and self.started == len(self.sizes)


def watch_claims(worker: Worker) -> ClaimWatch:
    """Watch ``worker``'s claims (:class:`ClaimWatch`)."""
    watch = ClaimWatch()
    claim = worker._claim

    async def watched(workflows: list[str], free: int,
                      queue: str | None = None) -> list[dict[str, Any]]:
        watch.started += 1
        got = await claim(workflows, free, queue)
        watch.sizes.append(len(got))
        return got

    worker._claim = watched  # type: ignore[method-assign]
    return watch


def executor_of(worker: Worker, run_id: Any) -> Any:
    """The executor driving ``run_id`` on ``worker``, or None (not claimed, or not built yet)."""
    held = worker._running.get(run_id)
    return None if held is None else held.executor


def listening(sql: Callable[..., list[dict[str, Any]]]) -> bool:
    """Some session of this database has run LISTEN and now waits (a worker's listener)."""
    return bool(sql("SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
                    "AND state = 'idle' AND query LIKE 'LISTEN %'"))


def charge_in_flight(app):  # type: ignore[no-untyped-def]
    """A workflow ``pay(order)`` whose ``charge`` call stays in flight (its operation
    ``submitted``) until the returned ``release`` is set; ``entered`` is set once it is sent.
    Returns ``(pay, entered, release)``."""
    entered, release = asyncio.Event(), asyncio.Event()

    @app.tool()
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        entered.set()
        await release.wait()
        return {"charge": order}

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    return pay, entered, release


def refuse_connections_while(monkeypatch: pytest.MonkeyPatch, down: Callable[[], bool]) -> None:
    """Every checkout of a connection fails at once, as behind a pooler that refuses
    connections, while ``down()`` is true (an outage the engine cannot tell from a real one:
    psycopg's own error for a refused connection)."""
    import psycopg

    from orchestrator.db.database import Database

    checkout = Database.checkout

    def refusing(self: Database) -> Any:
        if down():
            raise psycopg.OperationalError("connection refused (the pooler is down)")
        return checkout(self)

    monkeypatch.setattr(Database, "checkout", refusing)
