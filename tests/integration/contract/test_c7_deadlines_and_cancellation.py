"""CONTRACT C7: deadlines and cancellation are checked at every effect-admission boundary; a
run never ends (cancelled, deadline exceeded) while an effect of it is unknown."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta

import pytest

from orchestrator import RunFailed
from tests.integration.conftest import executor_of, never_answers, running, wait_for
from tests.integration.contract.helpers import (
    lease_lapsed,
    operations,
    parked,
    run_status,
)


async def test_an_unknown_effect_left_by_the_deadline_can_still_be_resolved(app, sql):
    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        await never_answers()  # still running at the run's deadline

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    async with running(app):
        run = await app.submit_async(wf, {}, deadline=timedelta(seconds=1))
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=10)
    assert info.value.code == "DEADLINE_EXCEEDED"
    (op,) = operations(sql)
    assert op["state"] == "unknown"
    assert await app.operators.resolve_committed(
        op["id"], receipt={"x": 1}, evidence="the PSP shows it", operator="al") == "resolved"
    assert [o["state"] for o in operations(sql)] == ["committed"]
    assert run_status(sql, run)["outcome_code"] == "DEADLINE_EXCEEDED"  # its journal is closed
    await app.database.close()


async def test_no_dispatch_once_the_deadline_passed_during_approval(app, sql):
    calls: list[object] = []

    @app.tool(approve_timeout=timedelta(seconds=20))
    async def charge(ctx):  # type: ignore[no-untyped-def]
        calls.append(ctx.remaining())
        return "charged"

    @charge.approve
    async def slow_human(pctx):  # type: ignore[no-untyped-def]
        # approved once the run's deadline has passed, by the clock its worker goes by
        await wait_for(lambda: executor_of(worker, pctx.run_id).run.remaining() == 0)
        return True

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    async with running(app) as worker:
        run = await app.submit_async(wf, {}, deadline=timedelta(seconds=1))
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=10)
    assert info.value.code == "DEADLINE_EXCEEDED"
    assert calls == [] and [o["state"] for o in operations(sql)] == ["cancelled"]


async def test_cancel_with_gather_ends_cancelled_only_once_nothing_is_unknown(app, sql):
    started, entered, release = asyncio.Event(), asyncio.Event(), asyncio.Event()

    @app.tool()
    async def slow(ctx):  # type: ignore[no-untyped-def]
        started.set()
        await never_answers()

    @app.tool(authorize_timeout=timedelta(seconds=20))
    async def gated(ctx):  # type: ignore[no-untyped-def]
        return 1

    @gated.authorize
    async def gate(pctx):  # type: ignore[no-untyped-def]
        entered.set()
        await release.wait()
        return True

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.gather(ctx.call(slow), ctx.call(gated))

    async with running(app):
        run = await app.submit_async(wf, {})
        await asyncio.wait_for(started.wait(), 10)
        await asyncio.wait_for(entered.wait(), 10)
        await run.cancel_async()
        await wait_for(parked(sql, run))
        states = {o["tool_name"]: o["state"] for o in operations(sql)}
        assert states == {"slow": "unknown", "gated": "cancelled"}
        await app.operators.resolve_not_applied(
            [o for o in operations(sql) if o["tool_name"] == "slow"][0]["id"],
            evidence="no effect", operator="al")
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=10)
    assert info.value.code == "CANCELLED"


async def test_a_queued_run_with_a_dispatched_call_is_not_cancelled_blindly(app, sql):
    from orchestrator.db import operations as ops_db
    from orchestrator.db import runs as runs_db

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        return 1

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    run = await app.submit_async(wf, {})
    async with app.database.connection() as conn:
        (claim,) = await runs_db.run_claim_ready(conn, worker="w", workflows=["wf@1"],
                                                 limit=1, ttl=0.05)

    async def begin(conn):  # type: ignore[no-untyped-def]
        await ops_db.operation_begin(conn, {
            "run_id": run.id, "position": 0, "attempt": 1, "tool_name": "charge",
            "tool_version": "1", "effect_class": "consequential", "tenant": "acme",
            "principal": "alice", "intent_digest": "a" * 64, "arguments": "{}",
            "idempotency_key": "k", "worker_id": "w", "token": claim["lease_token"]},
            pending=False)

    await app.database.run_in_transaction(begin)
    await wait_for(lambda: lease_lapsed(sql))  # the "dead" worker's 50 ms lease
    async with app.database.connection() as conn:
        await runs_db.run_release_expired(conn)
    assert await run.cancel_async() == "queued"  # requested, not done: an effect is unsettled
    assert run_status(sql, run)["status"] == "queued"
    await app.database.close()


async def test_a_cancelled_run_replaying_a_withdrawn_call_ends_cancelled(app, sql):
    """The replay of a withdrawn call waits there for workflow code to cancel it again; if
    the run is cancelled meanwhile, it ends ``cancelled`` instead of waiting for ever."""
    hooks: list[int] = []
    entered = asyncio.Event()

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        return {"charged": True}

    @charge.authorize
    async def gate(pctx):  # type: ignore[no-untyped-def]
        hooks.append(1)
        entered.set()
        await never_answers()

    executions: list[int] = []

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        executions.append(1)
        call = asyncio.ensure_future(ctx.call(charge))
        if len(executions) == 1:
            await entered.wait()
            call.cancel()  # withdrawn during its policy stage, the first time only
        with contextlib.suppress(asyncio.CancelledError):
            await call
        await ctx.sleep(1.2)  # long enough to park: what follows is a replay
        return "done"

    def waits_at_the_withdrawn_call():  # type: ignore[no-untyped-def]
        ex = executor_of(worker, run.id)
        return len(executions) == 2 and ex is not None and ex.run._cancel_waiters

    async with running(app) as worker:
        run = await app.submit_async(wf, {})
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.journal WHERE kind = 'timer'"))
        await wait_for(waits_at_the_withdrawn_call, timeout=15)  # the replay waits there
        await run.cancel_async()
        await wait_for(lambda: run_status(sql, run)["status"] == "cancelled", timeout=15)
    assert len(hooks) == 1 and len(executions) == 2


async def test_a_cancellation_between_submitted_and_dispatch_leaves_the_tool_uncalled(
        app, sql):
    """The run is cancelled after its call's write-ahead ``submitted`` landed and before the
    tool was called (the worker heard of it in between). The tool is not called, so nothing
    is uncertain: the operation settles as not dispatched, nothing goes to reconciliation,
    and the run ends ``CANCELLED``."""
    from orchestrator.testing import fault_gate

    called: list[str] = []

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        called.append("charge")
        return {"charged": True}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    with fault_gate("after_submitted", tool="charge") as gate:
        async with running(app) as worker:
            run = await app.submit_async(wf, {})
            await gate.arrived()
            await run.cancel_async()
            await wait_for(lambda: executor_of(worker, run.id).run.cancel_requested)
            gate.release()
            with pytest.raises(RunFailed) as info:
                await run.result_async(timeout=10)
    assert info.value.code == "CANCELLED"
    assert called == []
    assert [o["state"] for o in operations(sql)] == ["failed"]
    assert sql("SELECT count(*) AS n FROM orchestrator.reconciliation_items")[0]["n"] == 0


async def test_a_deadline_that_passes_between_submitted_and_dispatch_leaves_the_tool_uncalled(
        app, sql):
    """The same for the run's deadline: it passes after the call's write-ahead ``submitted``
    landed (the write, a tool's turn or the lease's renewal took the rest of the run's time)
    and before the tool was called. The tool is not called with no time left, only to be
    cut off at once and leave an unknown outcome for reconciliation: the operation settles as
    not dispatched and the run ends ``DEADLINE_EXCEEDED`` with nothing unknown."""
    from orchestrator.testing import fault_gate

    called: list[str] = []

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        called.append("charge")
        await asyncio.sleep(0.05)  # the provider's answer
        return {"charged": True}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    with fault_gate("after_submitted", tool="charge") as gate:
        async with running(app) as worker:
            run = await app.submit_async(wf, {}, deadline=timedelta(seconds=1))
            await gate.arrived()
            await wait_for(lambda: executor_of(worker, run.id).run.remaining() == 0)
            gate.release()
            with pytest.raises(RunFailed) as info:
                await run.result_async(timeout=10)
    assert info.value.code == "DEADLINE_EXCEEDED"
    assert called == []
    assert [o["state"] for o in operations(sql)] == ["failed"]
    assert sql("SELECT count(*) AS n FROM orchestrator.reconciliation_items")[0]["n"] == 0


async def test_a_child_started_while_its_parent_is_cancelled_inherits_the_request(app, sql):
    """A parent past its last check starts a child while a cancellation of the parent holds
    the parent's row: the child's insert waits for that cancellation, then takes its request
    too, so the cancelled parent leaves no child running (the cancellation reaches the
    children it can see; this one it could not see yet)."""
    from orchestrator import admin
    from orchestrator.canonical import JsonLimits
    from orchestrator.db import runs as runs_db
    from tests.integration.conftest import OWNER

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return 1

    run = await app.submit_async(wf, {})
    async with app.database.connection() as conn:  # a worker's claim: the parent is running
        await runs_db.run_claim_ready(conn, worker="w", workflows=["wf@1"], limit=1, ttl=30)
    holding, release = asyncio.Event(), asyncio.Event()

    async def cancel(conn):  # type: ignore[no-untyped-def]
        row = await runs_db.run_lock_last(conn, run.id)
        after = await admin.cancel_locked(conn, row)
        holding.set()
        await release.wait()
        return after

    cancelling = asyncio.create_task(app.database.run_in_transaction(cancel))
    await holding.wait()
    child = runs_db.run_row("wf", "1", {}, limits=JsonLimits(), owner=OWNER,
                            idempotency_key=None, deadline=None, parent=(run.id, 0))
    starting = asyncio.create_task(app.database.run_in_transaction(
        lambda conn: runs_db.run_insert(conn, child)))
    await wait_for(lambda: sql("SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                               "AND query LIKE '%%INSERT INTO%%runs%%'"))
    release.set()
    assert await cancelling == ("running", 0)  # requested; the child was not there to see
    await starting
    assert sql("SELECT status, cancel_requested_at IS NOT NULL AS asked FROM orchestrator.runs "
               "WHERE id = %s", (child["id"],)) == [{"status": "queued", "asked": True}]
    await app.database.close()


@pytest.mark.parametrize(("sleep", "deadline"), [(0.8, 0.4), (2.0, 1.2)],
                         ids=["in_memory", "parked"])
async def test_a_sleep_that_ends_past_the_deadline_fails_the_run_at_the_deadline(
        app, sleep, deadline):
    """Every wait is debited from the run's deadline (C7): a sleep that would end after it
    does not end; the run fails ``DEADLINE_EXCEEDED`` at the deadline. (A short sleep is
    slept in memory, a longer one parks the run and its replay sleeps what is left in memory:
    both went on past the deadline, and the run succeeded after it.)"""
    after: list[str] = []

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.sleep(timedelta(seconds=sleep))
        after.append("went on")
        return "done"

    async with running(app):
        run = await app.submit_async(wf, {}, deadline=timedelta(seconds=deadline))
        began = asyncio.get_running_loop().time()
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=10)
        took = asyncio.get_running_loop().time() - began
    assert info.value.code == "DEADLINE_EXCEEDED"
    assert after == []
    assert took < sleep, f"the run ended {took:.2f} s after it was submitted"
    await app.database.close()
