"""A run's concurrent branches: a timer fires on time while another branch works, and so does
an event reach its branch, a branch that workflow code cancelled leaves no wait behind, a call
left waiting before dispatch by the run's end is journaled as cancelled (and its journal
replays: the branch goes no further there), and a branch left running after the workflow's
end takes no new step."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from datetime import timedelta

import pytest

from orchestrator import RateLimit, RunFailed
from orchestrator.engine import commands as engine_commands
from orchestrator.testing import replay_async
from tests.integration.conftest import long_until_marked, running, wait_for
from tests.integration.contract.helpers import run_status


async def test_a_timer_fires_while_another_branch_calls_a_tool(app):
    """One branch sleeps, then calls ``mark``; the other's tool call returns only once
    ``mark`` was called. The sleep must end on time while that call is in flight."""
    long, mark = long_until_marked(app)

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


async def test_an_event_reaches_its_branch_while_another_branch_keeps_the_run_busy(app, sql):
    """One branch waits for an event; the other keeps the run in its worker (short sleeps in
    memory, never parked) until that event came. The event reaches its branch in place,
    promptly: not at the next park, which the busy branch never lets come."""

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        got: dict[str, object] = {}

        async def approval():  # type: ignore[no-untyped-def]
            got["go"] = await ctx.wait_for_event("go")

        async def busy():  # type: ignore[no-untyped-def]
            polls = 0
            while "go" not in got and polls < 200:  # 10 s at most
                await ctx.sleep(0.05)  # in memory: the branch never parks
                polls += 1
            return polls

        _, polls = await ctx.gather(approval(), busy())
        return [got.get("go"), polls < 200]

    async with running(app) as worker:
        run = await app.submit_async(wf, {})
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.journal WHERE run_id = %s "
                                   "AND kind = 'event.wait'", (run.id,)),
                       timeout=10, what="the branch waits for its event")
        await app.send_event_async(run.id, "go", "went")
        assert await run.result_async(timeout=20) == ["went", True]
    assert worker.claimed == 1  # taken in place: no park, no replay
    kinds = [(e.position, e.kind) for e in await run.journal_async()]
    assert (0, "event.received") in kinds


async def test_an_event_is_taken_in_place_while_a_tool_call_is_in_flight(app, sql):
    """The event is taken (journaled ``event.received``) while the other branch's tool call
    is still in flight, through the path a replay takes: the run ends in one claim, and its
    journal replays."""
    release = asyncio.Event()

    @app.tool()
    async def long(ctx):  # type: ignore[no-untyped-def]
        await release.wait()
        return "long"

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.gather(ctx.wait_for_event("go"), ctx.call(long))

    def journaled(kind: str):  # type: ignore[no-untyped-def]
        return lambda: sql("SELECT 1 FROM orchestrator.journal WHERE run_id = %s AND kind = %s",
                           (run.id, kind))

    async with running(app) as worker:
        run = await app.submit_async(wf, {})
        await wait_for(journaled("event.wait"), timeout=10, what="the branch waits")
        await app.send_event_async(run.id, "go", "went")
        try:
            await wait_for(journaled("event.received"), timeout=10, what="the event taken")
        finally:
            release.set()
        assert await run.result_async(timeout=15) == ["went", "long"]
        (verdict,) = await replay_async(app, [run.id])
    assert worker.claimed == 1
    assert verdict.ok and verdict.commands == 2, verdict


async def test_news_of_an_event_heard_while_its_branch_looks_is_not_lost(app, sql,
                                                                          monkeypatch):
    """The event is stored, and its news heard, while its branch looks for it with a look that
    began before (and so finds nothing): the branch looks again instead of parking, and takes
    the event in place while the other branch's call is in flight."""
    release = asyncio.Event()
    real_take = engine_commands.event_take
    looks: list[object] = []

    @app.tool()
    async def long(ctx):  # type: ignore[no-untyped-def]
        await release.wait()
        return "long"

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.gather(ctx.wait_for_event("go"), ctx.call(long))

    async def take_then_send(conn, **where):  # type: ignore[no-untyped-def]
        got = await real_take(conn, **where)
        looks.append(got)
        if len(looks) == 1:  # the first look found nothing; the event comes before it ends
            await app.send_event_async(where["run_id"], "go", "went")
            (held,) = worker._running.values()
            ex = held.executor
            await wait_for(lambda: ex.branches.heard("go"), timeout=10, what="the news heard")
        return got

    monkeypatch.setattr(engine_commands, "event_take", take_then_send)
    async with running(app) as worker:
        run = await app.submit_async(wf, {})
        try:
            await wait_for(lambda: sql("SELECT 1 FROM orchestrator.journal WHERE run_id = %s "
                                       "AND kind = 'event.received'", (run.id,)),
                           timeout=10, what="the event taken")
        finally:
            release.set()
        assert await run.result_async(timeout=15) == ["went", "long"]
    assert worker.claimed == 1 and looks[0] is None and len(looks) == 2


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


async def test_a_journal_with_a_call_left_by_the_runs_end_replays(app, sql):
    """The journal of a run whose end left a detached branch's call unsent (``call.cancelled``,
    ``why: ended``) replays: the offline check says so, and a worker replaying it (a restart
    that carries the whole journal) takes that branch no further, neither sending the call
    nor waiting for it before the run's end. The branch's ``finally`` takes a step when the
    call stops: the first execution refused it (the run had ended), so the replay must not
    take it either, nor hand the branch an exception while the run goes on."""
    sent: list[int] = []
    stopped: list[str] = []

    @app.tool(rate=RateLimit(1, per=timedelta(seconds=60)))
    async def limited(ctx, *, n):  # type: ignore[no-untyped-def]
        sent.append(n)
        return n

    @limited.approve
    async def yes(pctx):  # type: ignore[no-untyped-def]
        return True

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        async def detached():  # type: ignore[no-untyped-def]
            try:
                await ctx.call(limited, n=2)  # parks for the tool's turn
            finally:
                try:
                    ctx.now()
                    stopped.append("took a step")
                except BaseException as exc:  # noqa: BLE001 - the engine's Stop, for the test
                    stopped.append(str(exc))

        first = await ctx.call(limited, n=1)
        asyncio.ensure_future(detached())
        return first

    async with running(app) as worker:
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=15) == 1
        await wait_for(lambda: stopped, timeout=10, what="the detached branch stopped")
        recorded = [(e.position, e.kind, e.payload.get("why"))
                    for e in await run.journal_async()]
        assert (1, "call.cancelled", "ended") in recorded

        # A worker replays the same history: the new run's journal carries every entry of
        # positions 0 and 1, the cancelled call's included.
        new = await run.restart_async(reason="replay the history", from_position=2)
        assert await new.result_async(timeout=15) == 1
        assert worker.claimed == 2
        await wait_for(lambda: len(stopped) == 2, timeout=10, what="the replayed branch stopped")
        assert stopped == ["let_go", "let_go"]  # its step refused both times: the run had ended

        (verdict,) = await replay_async(app, [run.id])
        assert verdict.ok, verdict.message
        assert verdict.commands == 2  # both calls matched what the journal holds
    assert sent == [1]  # the replay sent neither call
    replayed = [(e.position, e.kind, e.payload.get("why")) for e in await new.journal_async()]
    assert replayed == [*(r for r in recorded if r[0] is not None),
                        (None, "run.completed", None)]
    assert sql("SELECT count(*) AS n FROM orchestrator.operations WHERE run_id = %s",
               (new.id,))[0]["n"] == 0
    assert await new.status_async() == "succeeded"


async def test_a_detached_branch_that_differs_from_its_journal_differs_for_both(app, sql):
    """Changed code whose detached branch issues another call than its journal recorded at the
    position the run's end left unsent: a worker's replay fails the run ``NONDETERMINISM``, and
    the offline check, run with that code, says so too."""
    detached = {"n": 2}

    @app.tool(rate=RateLimit(1, per=timedelta(seconds=60)))
    async def limited(ctx, *, n):  # type: ignore[no-untyped-def]
        return n

    @limited.approve
    async def yes(pctx):  # type: ignore[no-untyped-def]
        return True

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        first = await ctx.call(limited, n=1)
        asyncio.ensure_future(ctx.call(limited, n=detached["n"]))
        return first

    async with running(app):
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=15) == 1
        detached["n"] = 3  # the code changed: another intent at position 1
        (verdict,) = await replay_async(app, [run.id])
        new = await run.restart_async(reason="replay the history", from_position=2)
        with pytest.raises(RunFailed) as failed:
            await new.result_async(timeout=15)
    assert failed.value.code == "NONDETERMINISM"
    assert (verdict.verdict, verdict.position) == ("nondeterminism", 1), verdict


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



async def test_a_poll_loop_beside_an_up_front_wait_replays_and_beside_a_late_one_differs(app):
    """README: a branch that polls (call, sleep, call …) may run beside a wait issued up front
    and replays after the run parks; beside a coroutine whose wait is issued only once the
    poll's first call was awaited, the replay gives that position to the poll's sleep."""
    @app.tool()
    async def check(ctx, *, n):  # type: ignore[no-untyped-def]
        return n >= 1

    async def poll(ctx):  # type: ignore[no-untyped-def]
        n = 0
        while not await ctx.call(check, n=n):
            n += 1
            await ctx.sleep(1.1)  # parks the run: its next turn is a replay
        return n

    @app.workflow()
    async def up_front(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.gather(poll(ctx), ctx.wait_for_event("go"))

    @app.workflow()
    async def late(ctx, data):  # type: ignore[no-untyped-def]
        async def wait():  # type: ignore[no-untyped-def]
            return await ctx.wait_for_event("go")
        return await ctx.gather(poll(ctx), wait())

    async with running(app):
        good = await app.submit_async(up_front, {})
        bad = await app.submit_async(late, {})
        for run in (good, bad):
            assert await app.send_event_async(run.id, "go", "now")
        assert await good.result_async(timeout=20) == [1, "now"]
        with pytest.raises(RunFailed) as failed:
            await bad.result_async(timeout=20)
        assert failed.value.code == "NONDETERMINISM"


async def test_a_child_whose_wait_workflow_code_cancelled_runs_on_to_its_end(app, sql):
    """README: cancelling a ``ctx.run_child`` await (the loser of a race) stops the wait, not
    the child run, which runs on to its end after its parent has finished."""
    @app.workflow()
    async def slow_child(ctx, n):  # type: ignore[no-untyped-def]
        await ctx.sleep(1.5)
        return n

    @app.workflow()
    async def racer(ctx, data):  # type: ignore[no-untyped-def]
        kid = asyncio.ensure_future(ctx.run_child(slow_child, 5))
        event = asyncio.ensure_future(ctx.wait_for_event("go"))
        done, _ = await asyncio.wait([kid, event], return_when=asyncio.FIRST_COMPLETED)
        (kid if event in done else event).cancel()
        return "event" if event in done else "child"

    async with running(app):
        parent = await app.submit_async(racer, {})
        assert await app.send_event_async(parent.id, "go", 1)
        assert await parent.result_async(timeout=20) == "event"
        (child,) = sql("SELECT id FROM orchestrator.runs WHERE parent_run_id = %s",
                       (parent.id,))
        assert await (await app.get_run_async(child["id"])).result_async(timeout=20) == 5
