"""A run's concurrent branches: a timer fires on time while another branch works, a branch
that workflow code cancelled leaves no wait behind, a call left waiting before dispatch by
the run's end is journaled as cancelled, and a branch left running after the workflow's end
takes no new step."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import timedelta

from orchestrator import RateLimit
from tests.integration.conftest import running, wait_for
from tests.integration.contract.helpers import run_status


async def test_a_timer_fires_while_another_branch_calls_a_tool(app):
    """One branch sleeps, then calls ``mark``; the other's tool call returns only once
    ``mark`` was called. The sleep must end on time while that call is in flight."""
    marked = asyncio.Event()

    @app.tool()
    async def mark(ctx):  # type: ignore[no-untyped-def]
        marked.set()
        return "marked"

    @app.tool()
    async def long(ctx):  # type: ignore[no-untyped-def]
        await marked.wait()
        return "long"

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        async def later():  # type: ignore[no-untyped-def]
            await ctx.sleep(1.5)  # longer than an in-memory sleep: the branch parks
            return await ctx.call(mark)

        return await ctx.gather(ctx.call(long), later())

    async with running(app) as worker:
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=15) == ["long", "marked"]
    assert worker.claimed == 1  # the timer fired in memory: no park, no replay
    kinds = [(e.position, e.kind) for e in await run.journal_async()]
    assert (1, "timer") in kinds and kinds[-1] == (None, "run.completed")


async def test_a_timer_used_as_a_timeout_fires_while_another_branch_polls(app):
    polls = 0

    @app.tool()
    async def poll(ctx):  # type: ignore[no-untyped-def]
        nonlocal polls
        polls += 1
        return "pending"

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        async def poller():  # type: ignore[no-untyped-def]
            while await ctx.call(poll) == "pending":
                await ctx.sleep(0.2)  # in memory: the branch never parks

        async def timeout():  # type: ignore[no-untyped-def]
            await ctx.sleep(1.5)

        polling = asyncio.ensure_future(poller())
        timer = asyncio.ensure_future(timeout())
        done, _ = await asyncio.wait({polling, timer}, return_when=asyncio.FIRST_COMPLETED)
        polling.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await polling
        return "timed out" if timer in done else "done"

    async with running(app):
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=15) == "timed out"
    assert 1 <= polls <= 15


async def test_an_event_timeout_fires_while_another_branch_calls_a_tool(app):
    release = asyncio.Event()

    @app.tool()
    async def long(ctx):  # type: ignore[no-untyped-def]
        await release.wait()
        return "long"

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        async def approval():  # type: ignore[no-untyped-def]
            try:
                return await ctx.wait_for_event("approve", timeout=1.5)
            except TimeoutError:
                release.set()
                return "no answer"

        return await ctx.gather(ctx.call(long), approval())

    async with running(app):
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=15) == ["long", "no answer"]
    kinds = [e.kind for e in await run.journal_async()]
    assert "event.timeout" in kinds


async def test_a_branch_cancelled_by_workflow_code_leaves_no_wait(app, sql):
    """A race between a long durable timer and a call: the call wins and the timer's branch
    is cancelled. The run then parks for an event only: it neither wakes at the cancelled
    timer nor says that it waits for it."""

    @app.tool()
    async def quick(ctx):  # type: ignore[no-untyped-def]
        return "quick"

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        timer = asyncio.ensure_future(ctx.sleep(3600))
        work = asyncio.ensure_future(ctx.call(quick))
        await asyncio.wait({timer, work}, return_when=asyncio.FIRST_COMPLETED)
        timer.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await timer
        return [work.result(), await ctx.wait_for_event("go")]

    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(lambda: run_status(sql, run)["status"] == "waiting", timeout=10,
                       what="the run parked")
        (row,) = sql("SELECT waiting_for, available_at FROM orchestrator.runs WHERE id = %s",
                     (run.id,))
        assert row == {"waiting_for": "event 'go'", "available_at": None}
        await app.send_event_async(run.id, "go", "went")
        assert await run.result_async(timeout=15) == ["quick", "went"]


async def test_a_call_left_before_dispatch_by_the_runs_end_is_journaled_cancelled(app, sql):
    """A branch that workflow code does not await waits for its tool's turn (the rate is
    spent) with its intent ``pending`` when the workflow returns. The run's end cancels that
    intent, and the journal says so, in order, before the run's end."""

    @app.tool(rate=RateLimit(1, per=timedelta(seconds=60)))
    async def limited(ctx, *, n):  # type: ignore[no-untyped-def]
        return n

    @limited.approve
    async def yes(pctx):  # type: ignore[no-untyped-def]
        return True

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        first = await ctx.call(limited, n=1)
        asyncio.ensure_future(ctx.call(limited, n=2))  # parks for the tool's turn
        return first

    async with running(app):
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=15) == 1
    states = sql("SELECT position, state, error FROM orchestrator.operations ORDER BY id")
    assert [(s["position"], s["state"]) for s in states] == [(0, "committed"), (1, "cancelled")]
    assert states[1]["error"]["code"] == "CALL_CANCELLED"
    journal = [(e.position, e.kind, e.payload.get("why")) for e in await run.journal_async()]
    assert journal[-3:] == [(1, "call.pending", None), (1, "call.cancelled", "ended"),
                            (None, "run.completed", None)]


async def test_a_detached_branch_takes_no_step_once_the_workflow_ended(app, sql, caplog):
    """A branch that workflow code never awaits issues a call just as the workflow returns,
    while its outcome is being written: it is refused without a write, and without a lease
    loss (the run ended as its code said, on the lease it held)."""
    sent: list[str] = []
    stopped: list[str] = []

    @app.tool()
    async def late(ctx):  # type: ignore[no-untyped-def]
        sent.append("late")
        return "late"

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        workflow = asyncio.current_task()
        assert workflow is not None

        async def detached():  # type: ignore[no-untyped-def]
            await asyncio.wait({workflow})  # woken as the workflow's end is written
            try:
                await ctx.call(late)
            except BaseException as exc:  # noqa: BLE001 - the engine's Stop, kept for the test
                stopped.append(str(exc))

        asyncio.ensure_future(detached())
        return "ended"

    caplog.set_level(logging.WARNING, logger="orchestrator.worker")
    async with running(app) as worker:
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=15) == "ended"
        await wait_for(lambda: stopped, timeout=10, what="the detached branch stopped")
    assert sent == [] and stopped == ["let_go"]
    assert sql("SELECT count(*) AS n FROM orchestrator.operations")[0]["n"] == 0
    assert worker.metrics.snapshot().get("lease_losses", 0) == 0
    assert not [r for r in caplog.records if "lease" in r.getMessage()]

