"""A worker keeps nothing of a run it no longer holds: the run's executor is freed as soon as
the run ends or parks, by reference counting alone. ``orchestrator worker`` collects its
youngest generation only every 20,000 allocations (``settle_garbage_collector``), so an
executor caught in a reference cycle would keep its journal, tasks and receipts in memory until
then; the benchmark's memory section saw one such cycle as 9 MiB more peak RSS at concurrency
100."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest

from orchestrator.engine.executor import RunExecutor
from tests.integration.conftest import running, wait_for

ENDINGS = {
    "succeeds": "succeeded",
    "fails": "failed",  # the workflow raises: its exception holds the workflow's frames
    "parks": "waiting",  # waits for an event
    "blocks": "needs_reconciliation",  # a consequential tool's outcome is unknown
}


@pytest.mark.parametrize("ending", list(ENDINGS))
async def test_a_runs_executor_is_freed_without_the_cycle_collector(
        app, sql, monkeypatch: pytest.MonkeyPatch, ending: str) -> None:  # type: ignore[no-untyped-def]
    @app.tool(effect="consequential")
    async def charge(ctx, *, cents):  # type: ignore[no-untyped-def]
        if ending == "blocks" and cents == 2:
            raise RuntimeError("the connection dropped mid-request")
        return {"charged": cents}

    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.call(charge, cents=1)
        if ending == "fails":
            raise ValueError("declined")
        if ending == "parks":
            await ctx.wait_for_event("approved")
        return await ctx.call(charge, cents=2)

    executors: list[weakref.ref[RunExecutor]] = []
    init = RunExecutor.__init__

    def recorded(self: RunExecutor, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        executors.append(weakref.ref(self))

    monkeypatch.setattr(RunExecutor, "__init__", recorded)
    gc.collect()
    gc.disable()
    try:
        async with running(app) as worker:
            for _ in range(3):
                await app.submit_async(pay, {})

            def settled() -> bool:
                rows = sql("SELECT status FROM orchestrator.runs")
                return all(r["status"] == ENDINGS[ending] for r in rows)

            await wait_for(settled)
            await wait_for(lambda: worker.active_runs == 0)
            assert len(executors) == 3
            assert [ref() for ref in executors] == [None, None, None]
    finally:
        gc.enable()
