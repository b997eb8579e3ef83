"""A call's receipt rides with the run's next write (CONTRACT C5, C8; issue 7's "one commit per
effect step"): the operation stays ``submitted`` until the transaction that carries the receipt
commits, that transaction is the next call's write-ahead ``submitted`` or the run's end, and
nothing waits on the receipt in memory for longer than the workflow's next step."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.conftest import executor_of, running, wait_for


def _journal(sql):  # type: ignore[no-untyped-def]
    return [(e["kind"], e["position"]) for e in sql(
        "SELECT kind, position FROM orchestrator.journal ORDER BY seq")]


def _ops(sql):  # type: ignore[no-untyped-def]
    return sql("SELECT position, state, receipt FROM orchestrator.operations ORDER BY id")


async def test_each_receipt_is_committed_before_the_next_call_and_rides_with_it(app, sql):
    seen = []

    @app.tool()
    async def step(ctx, *, n):  # type: ignore[no-untyped-def]
        seen.append([(o["position"], o["state"]) for o in _ops(sql)])
        return {"n": n}

    @app.workflow()
    async def three(ctx, data):  # type: ignore[no-untyped-def]
        total = 0
        for n in range(3):
            total += (await ctx.call(step, n=n))["n"]
        return {"total": total}

    async with running(app) as worker:
        run = await app.submit_async(three, {})
        assert await run.result_async(timeout=10) == {"total": 3}
        # Three write-ahead `submitted` (the last two carrying the receipt before them) and the
        # success (carrying the last receipt): four writes for three effect steps.
        assert worker.writer.writes == 4
    assert seen == [[(0, "submitted")],
                    [(0, "committed"), (1, "submitted")],
                    [(0, "committed"), (1, "committed"), (2, "submitted")]]
    assert _journal(sql) == [
        ("call.submitted", 0), ("call.completed", 0), ("call.submitted", 1),
        ("call.completed", 1), ("call.submitted", 2), ("call.completed", 2),
        ("run.completed", None)]
    assert [(o["state"], o["receipt"]) for o in _ops(sql)] == [
        ("committed", {"n": 0}), ("committed", {"n": 1}), ("committed", {"n": 2})]
    assert sql("SELECT revision FROM orchestrator.runs")[0]["revision"] == 7


async def test_a_receipt_does_not_wait_while_the_workflow_waits_on_something_else(app, sql):
    go_on = asyncio.Event()

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        return {"charged": True}

    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        receipt = await ctx.call(charge)
        await go_on.wait()  # anything that is not a write of this run
        return receipt

    async with running(app):
        run = await app.submit_async(pay, {})
        # The workflow is blocked, and the receipt is committed all the same.
        await wait_for(lambda: [o["state"] for o in _ops(sql)] == ["committed"])
        assert sql("SELECT status FROM orchestrator.runs")[0]["status"] == "running"
        go_on.set()
        assert await run.result_async(timeout=10) == {"charged": True}
    assert _journal(sql) == [("call.submitted", 0), ("call.completed", 0),
                             ("run.completed", None)]


async def test_events_recorded_after_a_receipt_follow_it_in_the_journal(app, sql):
    @app.tool()
    async def probe(ctx):  # type: ignore[no-untyped-def]
        return {"ok": True}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.call(probe)
        ctx.now()  # buffered: rides with the next write, after the receipt
        await ctx.call(probe)
        return 1

    async with running(app):
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=10) == 1
    assert _journal(sql) == [
        ("call.submitted", 0), ("call.completed", 0), ("value", 1), ("call.submitted", 2),
        ("call.completed", 2), ("run.completed", None)]


async def test_parallel_branches_receipts_all_land(app, sql):
    returned = {n: asyncio.Event() for n in range(4)}

    @app.tool()
    async def probe(ctx, *, n):  # type: ignore[no-untyped-def]
        if 0 < n < 9:  # the branches' calls return one after the other, in order
            await returned[n - 1].wait()
        if n in returned:
            returned[n].set()
        return {"n": n}

    @app.workflow()
    async def fan(ctx, data):  # type: ignore[no-untyped-def]
        got = await asyncio.gather(*(ctx.call(probe, n=n) for n in range(4)))
        last = await ctx.call(probe, n=9)
        return [g["n"] for g in got] + [last["n"]]

    async with running(app):
        run = await app.submit_async(fan, {})
        assert await run.result_async(timeout=10) == [0, 1, 2, 3, 9]
    assert [o["state"] for o in _ops(sql)] == ["committed"] * 5
    kinds = [k for k, _ in _journal(sql)]
    assert kinds.count("call.completed") == 5 and kinds[-1] == "run.completed"
    revision = sql("SELECT revision FROM orchestrator.runs")[0]["revision"]
    assert revision == len(kinds) == 11


def _two_calls_with_a_change_behind_the_worker(app, sql, change):  # type: ignore[no-untyped-def]
    """A workflow of two calls of one tool; the tool first runs ``change`` (an UPDATE of its
    run, ``%s`` its id) on the database behind the worker's back (no NOTIFY): only the
    database knows, so the next call's write, which carries the receipt, is refused."""
    calls = []

    @app.tool()
    async def charge(ctx, *, n):  # type: ignore[no-untyped-def]
        calls.append(n)
        sql(change, (ctx.run_id,))
        return {"n": n}

    @app.workflow()
    async def two(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.call(charge, n=1)
        return await ctx.call(charge, n=2)

    return two, calls


async def test_a_cancellation_that_lands_during_a_call_keeps_its_receipt(app, sql):
    """The next call's write carries the receipt but is refused (the run was cancelled in the
    meantime, and this worker has not heard yet): the receipt is written alone, and the next
    call is recorded as cancelled, never dispatched."""
    two, calls = _two_calls_with_a_change_behind_the_worker(
        app, sql, "UPDATE orchestrator.runs SET cancel_requested_at = now() WHERE id = %s")

    async with running(app):
        run = await app.submit_async(two, {})
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs")[0]["status"]
                       == "cancelled")
    assert calls == [1]
    assert [(o["position"], o["state"], o["receipt"]) for o in _ops(sql)] == [
        (0, "committed", {"n": 1}), (1, "cancelled", None)]
    assert _journal(sql)[:3] == [("call.submitted", 0), ("call.completed", 0),
                                 ("call.pending", 1)]
    assert run.id


async def test_a_receipt_whose_lease_is_gone_is_kept_as_evidence(app, sql):
    """CONTRACT C8: the lease moved on while the receipt rode; it is not the outcome (the
    operation stays ``submitted``, for the new holder to settle), but it is kept as evidence on
    the operation's reconciliation item, and the next call is never dispatched."""
    two, calls = _two_calls_with_a_change_behind_the_worker(
        app, sql, "UPDATE orchestrator.runs SET lease_token = lease_token + 1 WHERE id = %s")

    async with running(app) as worker:
        await app.submit_async(two, {})
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.reconciliation_items"))
        await wait_for(lambda: worker.metrics.snapshot().get("lease_losses", 0) >= 1)
    assert calls == [1]
    assert [o["state"] for o in _ops(sql)] == ["submitted"]
    item = sql("SELECT reason, evidence FROM orchestrator.reconciliation_items")[0]
    assert item["reason"] == "WORKER_LOST"
    assert item["evidence"][0]["kind"] == "late_receipt"
    assert item["evidence"][0]["receipt"] == {"n": 1}


async def test_without_riding_each_receipt_is_committed_before_the_workflow_sees_it(make_app,
                                                                                   sql):
    """``Orchestrator(receipts_ride=False)``: the receipt's own transaction commits before
    ``ctx.call`` returns (one more commit per step)."""
    seen = {}
    for ride in (True, False):
        app = make_app(receipts_ride=ride)

        @app.tool(name="charge")
        async def charge(ctx):  # type: ignore[no-untyped-def]
            return {"ok": True}

        @app.workflow(name=f"pay-{ride}")
        async def pay(ctx, data):  # type: ignore[no-untyped-def]
            await ctx.call("charge")
            seen[data["ride"]] = sql(
                "SELECT o.state FROM orchestrator.operations o JOIN orchestrator.runs r "
                "ON r.id = o.run_id WHERE r.workflow_name = %s", (f"pay-{data['ride']}",))
            return 1

        async with running(app) as worker:
            run = await app.submit_async(pay, {"ride": ride})
            assert await run.result_async(timeout=10) == 1
            writes = worker.writer.writes
        assert writes == (2 if ride else 3)
    assert seen == {True: [{"state": "submitted"}], False: [{"state": "committed"}]}


async def test_a_receipt_does_not_wait_for_a_slow_sibling_after_the_workflow_failed(app, sql):
    """The workflow is done (a branch failed) but another call is still in flight, so the run's
    end is that far away: a receipt that arrives meanwhile is written at once, not at the end."""
    release = asyncio.Event()
    started = {"fast": asyncio.Event(), "slow": asyncio.Event()}

    def workflow_done(run_id):  # type: ignore[no-untyped-def]
        ex = executor_of(worker, run_id)
        return ex is not None and ex.branches.task is not None and ex.branches.task.done()

    @app.tool()
    async def fast(ctx):  # type: ignore[no-untyped-def]
        started["fast"].set()
        await wait_for(lambda: workflow_done(ctx.run_id))  # returns once the workflow failed
        return {"fast": True}

    @app.tool(effect="read")
    async def slow(ctx):  # type: ignore[no-untyped-def]
        started["slow"].set()
        await release.wait()
        return {"slow": True}

    @app.workflow()
    async def fan(ctx, data):  # type: ignore[no-untyped-def]
        async def boom():  # type: ignore[no-untyped-def]
            for call in started.values():  # both calls are in flight
                await call.wait()
            raise ValueError("a branch failed")

        return await ctx.gather(ctx.call(fast), ctx.call(slow), boom())

    async with running(app) as worker:
        run = await app.submit_async(fan, {})

        def fast_state():  # type: ignore[no-untyped-def]
            return sql("SELECT state FROM orchestrator.operations WHERE tool_name = 'fast'")

        await wait_for(lambda: fast_state() == [{"state": "committed"}], timeout=5)
        assert sql("SELECT state FROM orchestrator.operations WHERE tool_name = 'slow'") == [
            {"state": "submitted"}]  # still in flight: the end has not come
        release.set()
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs")[0]["status"]
                       == "failed")
    assert run.id


@pytest.mark.parametrize(("then", "status", "last"), [
    ("sleep", "waiting", ("timer", 1)), ("raise", "failed", ("run.failed", None))])
async def test_the_park_or_end_right_after_a_call_carries_its_receipt(app, sql, then, status,
                                                                     last):
    """Every branch waits on the database right after a call (a durable timer here), or the
    workflow fails: the park's or the end's transaction carries the receipt, one commit
    instead of two."""
    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        return {"charged": True}

    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.call(charge)
        if then == "sleep":
            await ctx.sleep(60)
        raise RuntimeError("after the charge")

    async with running(app) as worker:
        await app.submit_async(pay, {})
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs")[0]["status"]
                       == status)
        assert worker.writer.writes == 2  # the call's `submitted`; the park or end (+ receipt)
    assert [o["state"] for o in _ops(sql)] == ["committed"]
    assert _journal(sql) == [("call.submitted", 0), ("call.completed", 0), last]


async def test_a_receipt_rides_with_a_write_of_the_general_path(app, sql):
    """A call followed by something other than a call or the end (here an event that has
    already arrived: its wait and its receipt are one write) still costs one commit: the
    receipt goes first in that write's transaction."""
    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        return {"charged": True}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        charged = await ctx.call(charge)
        shipped = await ctx.wait_for_event("shipped")
        return [charged, shipped]

    run = await app.submit_async(wf, {})
    await app.send_event_async(run.id, "shipped", {"tracking": "T1"})
    async with running(app) as worker:
        assert await run.result_async(timeout=10) == [{"charged": True}, {"tracking": "T1"}]
        # The call's `submitted`; the receipt with the event's wait and take; the end.
        assert worker.writer.writes == 3
    assert _journal(sql) == [
        ("call.submitted", 0), ("call.completed", 0), ("event.wait", 1),
        ("event.received", 1), ("run.completed", None)]
    assert [o["state"] for o in _ops(sql)] == ["committed"]


async def test_a_general_write_refused_with_its_receipt_keeps_the_receipt_as_evidence(app,
                                                                                       sql):
    """The same write refused by the fence (the lease moved on behind the worker's back): the
    receipt is not the outcome but it is kept as evidence, as on the fast path, and nothing
    after it is written."""
    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        sql("UPDATE orchestrator.runs SET lease_token = lease_token + 1 WHERE id = %s",
            (ctx.run_id,))
        return {"charged": True}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.call(charge)
        return await ctx.wait_for_event("shipped")

    async with running(app) as worker:
        await app.submit_async(wf, {})
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.reconciliation_items"))
        await wait_for(lambda: worker.metrics.snapshot().get("lease_losses", 0) >= 1)
    assert [o["state"] for o in _ops(sql)] == ["submitted"]
    assert _journal(sql) == [("call.submitted", 0)]
    item = sql("SELECT evidence FROM orchestrator.reconciliation_items")[0]
    assert item["evidence"][0]["receipt"] == {"charged": True}


@pytest.mark.parametrize("error", ["RuntimeError", "LeaseLost"])
async def test_a_general_write_that_fails_with_its_receipt_writes_the_receipt_alone_first(
        app, sql, monkeypatch, error):
    """The combined transaction fails because of the write's own work (here the event's take,
    once; a guarded statement's refusal is a ``LeaseLost`` although the lease is held): the
    receipt is written alone, then the write again without it; the journal keeps its order
    and the receipt is accounted for once. The lease is not given up on the work's word."""
    from orchestrator.engine import commands
    from orchestrator.errors import LeaseLost
    from orchestrator.testing import fault_gate

    take = commands.event_take
    failures: list[int] = []

    async def flaky_take(conn, **kwargs):  # type: ignore[no-untyped-def]
        if not failures:
            failures.append(1)
            raise (LeaseLost if error == "LeaseLost" else RuntimeError)("the take failed once")
        return await take(conn, **kwargs)

    monkeypatch.setattr(commands, "event_take", flaky_take)

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        return {"charged": True}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        charged = await ctx.call(charge)
        return [charged, await ctx.wait_for_event("shipped")]

    run = await app.submit_async(wf, {})
    await app.send_event_async(run.id, "shipped", {"tracking": "T1"})
    with fault_gate("after_receipt", block=False) as receipts:  # counts the receipts written
        async with running(app):
            assert await run.result_async(timeout=10) == [{"charged": True},
                                                           {"tracking": "T1"}]
    assert failures == [1] and receipts.hits == 1
    assert _journal(sql) == [
        ("call.submitted", 0), ("call.completed", 0), ("event.wait", 1),
        ("event.received", 1), ("run.completed", None)]
    assert [o["state"] for o in _ops(sql)] == ["committed"]


async def test_an_attempt_the_engine_lost_is_not_counted_as_the_tools_failure(app, sql):
    """The lease moved on while the call was out (as when its worker dies): the next claim
    finds the attempt uncertain (``WORKER_LOST``); proven not applied, it is re-sent outside
    the budget. That is counted as a re-send, not as a failure of the tool nor as a retry's
    backoff; and the next claim's replay ends when it re-sends, not after the call."""
    calls = []

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        calls.append(ctx.attempt)
        if len(calls) == 1:  # the run's lease moves on behind the worker's back, and lapses
            sql("UPDATE orchestrator.runs SET lease_token = lease_token + 1, "
                "lease_expires_at = now() - interval '1 second' WHERE id = %s", (ctx.run_id,))
        else:
            await asyncio.sleep(0.5)  # a call that takes a while: not part of the replay
        return {"attempt": ctx.attempt}

    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    async with running(app) as worker:
        run = await app.submit_async(pay, {})
        # Parked on the unknown attempt: a run still being driven is not touched by a
        # resolution (OPERATION_IN_PROGRESS, try again in a moment).
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs "
                                   "WHERE status = 'needs_reconciliation'"))
        op = sql("SELECT id FROM orchestrator.operations")[0]["id"]
        await app.operators.resolve_not_applied(op, evidence="no such charge at the provider",
                                                operator="al")
        assert await run.result_async(timeout=10) == {"attempt": 2}
        counts = worker.metrics.snapshot()
        assert counts.get("operations_resent") == 1
        assert worker.metrics.labelled("tool_failures") == {}
        assert worker.metrics.histogram("retry_delay_seconds") == {}
        [(_, total, n)] = worker.metrics.histogram("replay_duration_seconds").values()
        assert n == 1 and total < 0.5, total
