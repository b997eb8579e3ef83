"""A worker's companions (the schedules' ticker): started once the worker is registered, told
to stop when it drains, cancelled after a grace period if they do not; one that fails leaves
the worker claiming."""

from __future__ import annotations

import asyncio
import time

from orchestrator import worker as worker_module
from orchestrator.worker import Worker
from tests.integration.conftest import wait_for


def _worker(app, companions) -> Worker:  # type: ignore[no-untyped-def]
    return Worker(app.engine_config, app.registry, app.database, app.metrics,
                  poll_interval=0.1, drain_timeout=2.0, companions=companions)


async def test_a_companion_that_ignores_the_stop_is_cancelled_after_the_grace(
        make_app, monkeypatch):
    app = make_app()
    monkeypatch.setattr(worker_module, "COMPANION_GRACE", 0.2)
    seen: dict[str, bool] = {}

    async def stubborn(stop: asyncio.Event) -> None:
        seen["started"] = True
        try:
            await asyncio.sleep(3600)  # never looks at ``stop``
        except asyncio.CancelledError:
            seen["cancelled"] = True
            raise

    worker = _worker(app, [stubborn])
    task = asyncio.ensure_future(worker.run())
    await wait_for(lambda: seen.get("started"))
    began = time.monotonic()
    worker.request_stop()
    await asyncio.wait_for(task, 10)
    assert seen.get("cancelled") and time.monotonic() - began < 5
    await app.database.close()


async def test_a_failing_companion_leaves_the_worker_claiming(make_app):
    app = make_app()

    @app.workflow()
    async def echo(ctx, data):  # type: ignore[no-untyped-def]
        return data

    stopped: dict[str, bool] = {}

    async def broken(stop: asyncio.Event) -> None:
        raise RuntimeError("a bug in a companion")

    async def polite(stop: asyncio.Event) -> None:
        await stop.wait()
        stopped["polite"] = True

    worker = _worker(app, [broken, polite])
    task = asyncio.ensure_future(worker.run())
    run = await app.submit_async(echo, {"x": 1})
    assert await run.result_async(timeout=10) == {"x": 1}
    worker.request_stop()
    await asyncio.wait_for(task, 10)
    assert stopped == {"polite": True}  # told to stop, and finished before the worker did
    await app.database.close()
