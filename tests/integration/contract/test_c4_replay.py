"""CONTRACT C4: workflows are replayed, effects are not; a replay that goes another way stops
the run with ``NONDETERMINISM``."""

from __future__ import annotations

import pytest

from orchestrator import RunFailed
from tests.integration.conftest import running, wait_for
from tests.integration.contract.helpers import run_status


async def test_caught_nondeterminism_still_stops_the_run(app, sql):
    calls: list[str] = []
    flip = {"changed": False}

    @app.tool()
    async def a(ctx):  # type: ignore[no-untyped-def]
        calls.append("a")

    @app.tool()
    async def b(ctx):  # type: ignore[no-untyped-def]
        calls.append("b")

    @app.tool()
    async def c(ctx):  # type: ignore[no-untyped-def]
        calls.append("c")

    @app.workflow()
    async def drifting(ctx, data):  # type: ignore[no-untyped-def]
        try:
            await ctx.call(b if flip["changed"] else a)
        except Exception:  # noqa: BLE001 - ordinary defensive code must not swallow it
            pass
        flip["changed"] = True
        await ctx.sleep(1.2)
        await ctx.call(c)

    async with running(app):
        run = await app.submit_async(drifting, {})
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=20)
    assert info.value.code == "NONDETERMINISM" and calls == ["a"]


async def test_a_workflow_that_catches_its_parking_takes_no_new_step(app, sql):
    """Parking a run cancels its workflow in this process; the next claim replays it. Workflow
    code that catches that cancellation (cleanup in ``except CancelledError``) must not take a
    new step meanwhile: no intent is written and no tool is called while the run is being
    parked. The replay goes the ordinary way (the timer fired) and the run completes."""
    import asyncio

    calls: list[str] = []

    @app.tool()
    async def cleanup(ctx):  # type: ignore[no-untyped-def]
        calls.append("cleanup")
        return {"cleaned": True}

    @app.workflow()
    async def napping(ctx, data):  # type: ignore[no-untyped-def]
        try:
            await ctx.sleep(1.2)
        except asyncio.CancelledError:
            await ctx.call(cleanup)
            raise
        return "rested"

    async with running(app):
        run = await app.submit_async(napping, {})
        assert await run.result_async(timeout=20) == "rested"
    assert calls == []
    assert sql("SELECT count(*) AS n FROM orchestrator.operations")[0]["n"] == 0


async def test_a_workflow_that_catches_its_parking_records_nothing(app, sql):
    """The same for what takes a position without a write of its own: a message published,
    or a value recorded, by workflow code that catches the cancellation of its parking. It
    is not journaled; the replay, where the event has arrived and nothing is cancelled, goes
    on to the next command at that position. (The message was journaled with the park, and
    that replay failed with ``NONDETERMINISM``: a message recorded where the code calls.)"""
    import asyncio

    calls: list[str] = []

    @app.tool()
    async def ship(ctx):  # type: ignore[no-untyped-def]
        calls.append("ship")
        return {"shipped": True}

    @app.workflow()
    async def approving(ctx, data):  # type: ignore[no-untyped-def]
        try:
            approval = await ctx.wait_for_event("approved")
        except asyncio.CancelledError:
            ctx.publish({"approval": "no longer awaited", "at": ctx.now().isoformat()})
            raise
        return [approval, await ctx.call(ship)]

    async with running(app):
        run = await app.submit_async(approving, {})
        await wait_for(lambda: run_status(sql, run)["status"] == "waiting")
        await app.send_event_async(run.id, "approved", {"by": "al"})
        assert await run.result_async(timeout=20) == [{"by": "al"}, {"shipped": True}]
    assert calls == ["ship"]
    kinds = [e["kind"] for e in sql("SELECT kind FROM orchestrator.journal ORDER BY seq")]
    assert "message" not in kinds and "value" not in kinds
