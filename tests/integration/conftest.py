"""Fixtures for engine tests: an orchestrator on a fresh migrated database and workers that
run inside the test's event loop."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from orchestrator import Orchestrator, Owner
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

    yield make
    for app in apps:
        app.close()


@pytest.fixture
def app(make_app: Callable[..., Orchestrator]) -> Orchestrator:
    return make_app()


@contextlib.asynccontextmanager
async def running(app: Orchestrator, **options: Any) -> AsyncIterator[Worker]:
    """A worker running in this event loop for the body of the ``async with``."""
    options.setdefault("poll_interval", 0.2)
    worker = app.create_worker(**options)
    task = asyncio.ensure_future(worker.run())
    try:
        yield worker
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 30)
        await app.database.close()


@pytest.fixture
def sql(migrated_database_url: str) -> Iterator[Callable[..., list[dict[str, Any]]]]:
    """Run one statement on the test database (autocommit) and return its rows."""
    conn = psycopg.connect(migrated_database_url, autocommit=True, row_factory=dict_row)

    def run(query: str, params: Any = None) -> list[dict[str, Any]]:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []

    yield run
    conn.close()


async def wait_for(predicate: Callable[[], Any], timeout: float = 10.0) -> None:
    """Poll a condition (a test signal read from the database), never a fixed sleep."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout
    while True:
        result = predicate()
        if asyncio.iscoroutine(result):
            result = await result
        if result:
            return
        if loop.time() > give_up:
            raise AssertionError("condition not met in time")
        await asyncio.sleep(0.02)
