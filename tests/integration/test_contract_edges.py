"""Edges where a run could end, hang or go on with an effect whose outcome is not settled
(CONTRACT C4, C5, C7, C8). Each test names the path it closes."""

from __future__ import annotations

import asyncio
import contextlib
from datetime import timedelta
from typing import Any

import pytest

from orchestrator import AccessDenied, InvalidRequest, ResultTimeout, RunFailed, ToolError
from orchestrator.engine.control import Phase
from tests.integration.conftest import running, wait_for


def _status(sql, run):  # type: ignore[no-untyped-def]
    return sql("SELECT status, outcome_code FROM orchestrator.runs WHERE id = %s",
               (run.id,))[0]


def _ops(sql):  # type: ignore[no-untyped-def]
    return sql("SELECT id, attempt, tool_name, state FROM orchestrator.operations ORDER BY id")


def _parked(sql, run):  # type: ignore[no-untyped-def]
    return lambda: _status(sql, run)["status"] == "needs_reconciliation"


async def test_resolving_the_last_of_several_resent_attempts_settles_them_all(make_app, sql):
    app = make_app(operator_scopes={"bob": ["globex"], "al": ["acme"]})  # one tenant each

    @app.tool(effect="idempotent", timeout=timedelta(seconds=0.2))
    async def upsert(ctx):  # type: ignore[no-untyped-def]
        await asyncio.sleep(5)

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(upsert)

    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(_parked(sql, run))
        ops = _ops(sql)
        assert [o["state"] for o in ops] == ["unknown"] * 3
        # An earlier attempt is not in the queue: the operator is told which attempt is.
        for attempt in (app.operators.show(ops[0]["id"], operator="al"),
                        app.operators.resolve_committed(ops[0]["id"], receipt={"ok": 1},
                                                        evidence="seen", operator="al")):
            with pytest.raises(InvalidRequest) as info:
                await attempt
            assert f"the queued attempt of the same call is operation {ops[-1]['id']}" in str(
                info.value)
        with pytest.raises(AccessDenied):  # a missing one still looks like a foreign one
            await app.operators.show(ops[-1]["id"] + 100, operator="al")
        # C9: to an operator of another tenant, an attempt that is not queued looks missing
        # too (its state and the queued attempt's id are not told)
        for attempt in (app.operators.show(ops[0]["id"], operator="bob"),
                        app.operators.abandon(ops[0]["id"], evidence="x", operator="bob")):
            with pytest.raises(AccessDenied):
                await attempt
        await app.operators.resolve_committed(ops[-1]["id"], receipt={"ok": 1},
                                              evidence="seen at the provider", operator="al")
        assert await run.result_async(timeout=10) == {"ok": 1}
    assert [o["state"] for o in _ops(sql)] == ["committed"] * 3


async def test_new_work_keeps_room_in_the_journal_for_receipts(make_app, sql):
    app = make_app(max_journal_events=5)

    @app.tool()
    async def step(ctx):  # type: ignore[no-untyped-def]
        return 1

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        for _ in range(5):
            await ctx.call(step)

    async with running(app):
        run = await app.submit_async(wf, {})
        with pytest.raises(RunFailed):
            await run.result_async(timeout=15)
    assert all(o["state"] == "committed" for o in _ops(sql))


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


async def test_a_gather_branch_failing_waits_for_its_uncertain_sibling(app, sql):
    @app.tool(timeout=timedelta(seconds=0.5))
    async def slow(ctx):  # type: ignore[no-untyped-def]
        await asyncio.sleep(5)

    @app.tool()
    async def bad(ctx):  # type: ignore[no-untyped-def]
        raise ToolError.from_status(400, "nope")

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.gather(ctx.call(slow), ctx.call(bad))

    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(_parked(sql, run))  # not failed while an effect is unknown
        unknown = [o for o in _ops(sql) if o["state"] == "unknown"]
        await app.operators.resolve_not_applied(unknown[0]["id"], evidence="nothing there",
                                                operator="al")
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=10)
    assert info.value.code == "WORKFLOW_FAILED"
    assert "unknown" not in [o["state"] for o in _ops(sql)]


async def test_an_unknown_effect_left_by_the_deadline_can_still_be_resolved(app, sql):
    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        await asyncio.sleep(10)

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    async with running(app):
        run = await app.submit_async(wf, {}, deadline=timedelta(seconds=1))
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=10)
    assert info.value.code == "DEADLINE_EXCEEDED"
    (op,) = _ops(sql)
    assert op["state"] == "unknown"
    assert await app.operators.resolve_committed(
        op["id"], receipt={"x": 1}, evidence="the PSP shows it", operator="al") == "resolved"
    assert [o["state"] for o in _ops(sql)] == ["committed"]
    assert _status(sql, run)["outcome_code"] == "DEADLINE_EXCEEDED"  # its journal is closed
    await app.database.close()


async def test_no_dispatch_once_the_deadline_passed_during_approval(app, sql):
    calls: list[object] = []

    @app.tool(approve_timeout=timedelta(seconds=20))
    async def charge(ctx):  # type: ignore[no-untyped-def]
        calls.append(ctx.remaining())
        return "charged"

    @charge.approve
    async def slow_human(pctx):  # type: ignore[no-untyped-def]
        await asyncio.sleep(2.0)
        return True

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    async with running(app):
        run = await app.submit_async(wf, {}, deadline=timedelta(seconds=1))
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=10)
    assert info.value.code == "DEADLINE_EXCEEDED"
    assert calls == [] and [o["state"] for o in _ops(sql)] == ["cancelled"]


async def test_cancel_with_gather_ends_cancelled_only_once_nothing_is_unknown(app, sql):
    started, entered, release = asyncio.Event(), asyncio.Event(), asyncio.Event()

    @app.tool()
    async def slow(ctx):  # type: ignore[no-untyped-def]
        started.set()
        await asyncio.sleep(30)

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
        await wait_for(_parked(sql, run))
        states = {o["tool_name"]: o["state"] for o in _ops(sql)}
        assert states == {"slow": "unknown", "gated": "cancelled"}
        await app.operators.resolve_not_applied(
            [o for o in _ops(sql) if o["tool_name"] == "slow"][0]["id"],
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
    await asyncio.sleep(0.1)  # the "dead" worker's 50 ms lease lapses
    async with app.database.connection() as conn:
        await runs_db.run_release_expired(conn)
    assert await run.cancel_async() == "queued"  # requested, not done: an effect is unsettled
    assert _status(sql, run)["status"] == "queued"
    await app.database.close()


async def test_a_call_with_wrong_arguments_is_refused_before_any_write(app, sql):
    @app.tool()
    async def charge(ctx, *, cents):  # type: ignore[no-untyped-def]
        return cents

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        try:
            await ctx.call(charge, amount=5)
        except InvalidRequest as exc:
            return exc.code

    async with running(app):
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=10) == "INVALID_REQUEST"
    assert _ops(sql) == []


async def test_a_timeout_around_a_call_in_workflow_code_blocks_the_run(app, sql):
    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        await asyncio.sleep(5)

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        try:
            await asyncio.wait_for(ctx.call(charge), 0.3)
        except TimeoutError:
            return "gave up"

    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(_parked(sql, run))
        with pytest.raises(ResultTimeout):
            await run.result_async(timeout=0.2)
    assert [o["state"] for o in _ops(sql)] == ["unknown"]


class _Tools:
    """``charge`` (``effect`` as given) and ``notify``; ``called`` lists their calls in order."""

    def __init__(self, app, effect="consequential"):  # type: ignore[no-untyped-def]
        self.called: list[str] = []

        @app.tool(effect=effect)
        async def charge(ctx):  # type: ignore[no-untyped-def]
            self.called.append("charge")
            return {"charged": True}

        @app.tool()
        async def notify(ctx):  # type: ignore[no-untyped-def]
            self.called.append("notify")
            return {"sent": True}

        self.charge, self.notify = charge, notify


def _watch_writes(monkeypatch):  # type: ignore[no-untyped-def]
    """Events set as the worker's group writer gets the first and the second write (they stay
    set: a replay writes nothing at those points)."""
    from orchestrator.db.writer import GroupWriter

    writes: list[asyncio.Event] = [asyncio.Event(), asyncio.Event()]
    enqueue = GroupWriter.enqueue

    def spy(self, work):  # type: ignore[no-untyped-def]
        for written in writes:
            if not written.is_set():
                written.set()
                break
        return enqueue(self, work)

    monkeypatch.setattr(GroupWriter, "enqueue", spy)
    return writes


@pytest.mark.parametrize(("ride", "gated"), [(True, False), (False, False), (True, True)])
async def test_a_call_cancelled_while_its_intent_is_written_is_withdrawn(
        make_app, sql, monkeypatch, ride, gated):
    """Workflow code cancels a call while its write-ahead ``submitted`` is in the group writer
    (the run's first write; with a policy stage, its second, after the ``pending`` intent): the
    write lands all the same, so the run must account for it (its next writes are not refused
    as if the lease were lost), the tool is never called, the operation is settled as never
    dispatched, and a replay cancels the call at the same point again."""
    app = make_app(receipts_ride=ride)
    writes = _watch_writes(monkeypatch)
    tools = _Tools(app)

    if gated:
        @tools.charge.authorize
        async def gate(pctx):  # type: ignore[no-untyped-def]
            return True

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        call = asyncio.ensure_future(ctx.call(tools.charge))
        # `submitted` is on its way (events stay set: a replay writes nothing here)
        await writes[1 if gated else 0].wait()
        call.cancel()
        try:
            await call
            return "the call was not cancelled"
        except asyncio.CancelledError:
            pass
        await ctx.sleep(1.2)  # long enough to park: the rest happens after a replay
        return await ctx.call(tools.notify)

    async with running(app):
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=20) == {"sent": True}
    assert tools.called == ["notify"]
    ops = sql("SELECT tool_name, state, error FROM orchestrator.operations ORDER BY id")
    assert [(o["tool_name"], o["state"]) for o in ops] == [("charge", "failed"),
                                                            ("notify", "committed")]
    assert ops[0]["error"]["code"] == "CALL_WITHDRAWN"
    journal = sql("SELECT kind, position, payload FROM orchestrator.journal ORDER BY seq")
    kinds = [(e["kind"], e["position"]) for e in journal]
    assert kinds[:4 if gated else 3] == [
        *([("call.pending", 0)] if gated else []),
        ("call.submitted", 0), ("call.failed", 0), ("timer", 1)]
    assert journal[kinds.index(("call.failed", 0))]["payload"]["reason"] == "withdrawn"
    assert sql("SELECT count(*) AS n FROM orchestrator.reconciliation_items")[0]["n"] == 0


async def test_a_call_cancelled_during_its_policy_stage_is_withdrawn(app, sql):
    """Workflow code gives up on a call while its authorize hook runs (the intent is
    ``pending``, nothing was sent): the operation is settled at once as never dispatched, and
    a replay, where the hook would answer at once, does not dispatch the call behind the
    workflow's back: it waits at that call for the same cancellation. (The intent used to stay
    ``pending``, and the replay ran the stage again and called the tool.)"""
    tools = _Tools(app)
    hooks: list[int] = []

    @tools.charge.authorize
    async def gate(pctx):  # type: ignore[no-untyped-def]
        hooks.append(1)
        if len(hooks) == 1:
            await asyncio.sleep(5)  # the first time, slower than the workflow will wait
        return True

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        try:
            await asyncio.wait_for(ctx.call(tools.charge), 0.3)
            return "charged"
        except TimeoutError:
            pass
        await ctx.sleep(1.2)  # long enough to park: the rest happens after a replay
        return await ctx.call(tools.notify)

    async with running(app):
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=20) == {"sent": True}
    assert tools.called == ["notify"] and len(hooks) == 1
    ops = sql("SELECT tool_name, state, error FROM orchestrator.operations ORDER BY id")
    assert [(o["tool_name"], o["state"]) for o in ops] == [("charge", "cancelled"),
                                                            ("notify", "committed")]
    assert ops[0]["error"]["code"] == "CALL_WITHDRAWN"
    journal = sql("SELECT kind, position, payload FROM orchestrator.journal ORDER BY seq")
    kinds = [(e["kind"], e["position"]) for e in journal]
    assert kinds[:3] == [("call.pending", 0), ("call.failed", 0), ("timer", 1)]
    assert journal[1]["payload"]["reason"] == "withdrawn"


async def test_a_stopping_worker_does_not_withdraw_a_call_it_cancels(make_app, sql, monkeypatch):
    """A worker whose drain runs out of time cancels its runs' workflows itself; a call whose
    intent was being written at that moment was not given up by workflow code, so it must not
    be recorded as withdrawn (a replay would wait forever for a cancellation that workflow code
    never makes). The journal is left to decide, as for a worker that died: the operation stays
    ``submitted`` and the next claim treats it as an uncertain attempt."""
    from orchestrator.db.writer import GroupWriter, Landing

    app = make_app()
    stopping: list[Any] = []
    enqueue = GroupWriter.enqueue

    def late(self, work):  # type: ignore[no-untyped-def]
        """The run's first write lands only once the stop has cancelled the workflow."""
        landing = enqueue(self, work)
        if stopping:
            return landing
        worker = app_worker[0]
        stopping.append(True)
        worker.request_stop()
        delayed = Landing(loop=asyncio.get_running_loop())

        def hand_over() -> None:
            executors = [ex for _, ex in worker._running.values() if ex is not None]
            if landing.done() and all(ex.run.phase in (Phase.PARKING, Phase.GONE)
                                      for ex in executors):
                if landing.exception() is not None:
                    delayed.set_exception(landing.exception())  # type: ignore[arg-type]
                else:
                    delayed.set_result(landing.result())
            else:
                asyncio.get_running_loop().call_later(0.01, hand_over)

        hand_over()
        return delayed

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        return {"charged": True}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    run = await app.submit_async(wf, {})
    monkeypatch.setattr(GroupWriter, "enqueue", late)
    worker = app.create_worker(drain_timeout=0.05, poll_interval=0.2)
    app_worker = [worker]
    await asyncio.wait_for(worker.run(), 20)
    journal = sql("SELECT kind, payload FROM orchestrator.journal ORDER BY seq")
    assert [e["kind"] for e in journal] == ["call.submitted"]
    assert [o["state"] for o in _ops(sql)] == ["submitted"]
    assert _status(sql, run)["status"] == "running"  # until its lease lapses


async def test_a_drain_that_runs_out_of_time_still_writes_the_receipts_it_holds(
        make_app, sql, monkeypatch):
    """A worker whose drain runs out of time cancels a run that is busy in memory. A receipt
    the run still holds (riding, not yet written) records what already happened: the run
    writes it as it lets go (the backstop in ``drive``), so the operation is ``committed`` and
    the next worker's replay returns it without calling the tool again. Normally a receipt is
    written as soon as the workflow yields; that write is held back here so that only the
    backstop is left to do it (without the backstop the operation stays ``submitted`` and
    the next worker finds it uncertain)."""
    from orchestrator.engine.session import Rider

    monkeypatch.setattr(Rider, "_settle_soon", lambda self: setattr(self, "_scheduled", False))
    app = make_app(lease_ttl=1.0)
    called: list[str] = []
    returned = asyncio.Event()
    go_on = asyncio.Event()

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        called.append("charge")
        return {"charged": True}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        receipt = await ctx.call(charge)
        returned.set()
        await go_on.wait()  # busy in memory: no durable step, so no write carries the receipt
        return receipt

    run = await app.submit_async(wf, {})
    worker = app.create_worker(poll_interval=0.2, drain_timeout=0.1)
    working = asyncio.ensure_future(worker.run())
    await asyncio.wait_for(returned.wait(), 10)
    worker.request_stop()
    await asyncio.wait_for(working, 20)
    assert [o["state"] for o in _ops(sql)] == ["committed"]
    assert [e["kind"] for e in sql("SELECT kind FROM orchestrator.journal ORDER BY seq")] == [
        "call.submitted", "call.completed"]
    go_on.set()
    async with running(app):
        assert await run.result_async(timeout=20) == {"charged": True}
    assert called == ["charge"]


async def test_a_call_cancelled_while_its_receipt_is_written_keeps_the_run_in_step(
        make_app, sql, monkeypatch):
    """The same for the receipt's own write (``receipts_ride=False``): it lands, the run's
    revision follows it, and the run goes on (the call returns its receipt: see the next
    test)."""
    app = make_app(receipts_ride=False)
    writes = _watch_writes(monkeypatch)

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        return {"charged": True}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        call = asyncio.ensure_future(ctx.call(charge))
        await writes[1].wait()  # the second write of the run: the receipt, on its way
        call.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await call
        return await ctx.call(charge)

    async with running(app):
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=20) == {"charged": True}
    assert [o["state"] for o in _ops(sql)] == ["committed", "committed"]
    # One claim: the worker never lost track of the run (it used to, and the run only went on
    # once its lease had lapsed and another claim replayed it).
    assert sql("SELECT lease_token FROM orchestrator.runs")[0]["lease_token"] == 1


def _slow_write(monkeypatch, nth=1, delay=0.6):  # type: ignore[no-untyped-def]
    """The ``nth`` write through the group writer lands ``delay`` seconds late (it commits at
    once; only the caller hears late), holding the run's write lock that long."""
    from orchestrator.db.writer import GroupWriter, Landing

    enqueue = GroupWriter.enqueue
    count: list[int] = []

    def slow(self, work):  # type: ignore[no-untyped-def]
        landing = enqueue(self, work)
        count.append(1)
        if len(count) != nth:
            return landing
        loop = asyncio.get_running_loop()
        late = Landing(loop=loop)

        def hand_over(_: object) -> None:
            exc = landing.exception()
            loop.call_later(delay, late.set_exception if exc else late.set_result,
                            exc if exc else landing.result())

        landing.add_done_callback(hand_over)
        return late

    monkeypatch.setattr(GroupWriter, "enqueue", slow)


@pytest.mark.parametrize("how", ["receipts_ride=False", "idempotent tool"])
async def test_a_timeout_during_a_receipts_own_write_returns_the_receipt(
        make_app, sql, monkeypatch, how):
    """A timeout around ``ctx.call`` that fires while the receipt is being written (its own
    write: ``receipts_ride=False``, or an idempotent tool, whose receipts never ride): the call
    completed and its receipt is recorded, so the workflow gets the receipt, as a replay will
    (a recorded call returns at once). It used to get the timeout, go another way, and fail
    with ``NONDETERMINISM`` on the replay."""
    app = make_app(receipts_ride=how != "receipts_ride=False")
    _slow_write(monkeypatch, nth=2)  # the run's second write, the receipt's own
    tools = _Tools(app, effect="idempotent" if how == "idempotent tool" else "consequential")

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        try:
            got = await asyncio.wait_for(ctx.call(tools.charge), 0.3)
        except TimeoutError:
            got = await ctx.call(tools.notify)  # the path a replay would not take
        await ctx.sleep(1.2)  # long enough to park: the result comes from a replay
        return got

    async with running(app):
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=20) == {"charged": True}
    assert tools.called == ["charge"]
    assert [o["state"] for o in _ops(sql)] == ["committed"]


async def test_a_call_cancelled_while_it_waits_for_the_write_lock_is_withdrawn(
        app, sql, monkeypatch):
    """Two branches: the first one's write holds the run's write lock while workflow code
    gives up on the second call, which is still waiting for that lock. The second call's intent
    is still written and then withdrawn, so the replay waits at that call for the same
    cancellation instead of sending it. (The call used to leave nothing behind: the replay
    called the tool.)"""
    _slow_write(monkeypatch)
    called: list[str] = []

    @app.tool()
    async def charge(ctx, *, n):  # type: ignore[no-untyped-def]
        called.append(f"charge {n}")
        return {"n": n}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        async def patient():  # type: ignore[no-untyped-def]
            return await ctx.call(charge, n=1)

        async def impatient():  # type: ignore[no-untyped-def]
            try:
                return await asyncio.wait_for(ctx.call(charge, n=2), 0.2)
            except TimeoutError:
                return "gave up"

        got = await ctx.gather(patient(), impatient())
        await ctx.sleep(1.2)  # long enough to park: the result comes from a replay
        return got

    async with running(app):
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=20) == [{"n": 1}, "gave up"]
    assert called == ["charge 1"]
    ops = sql("SELECT position, state, error FROM orchestrator.operations ORDER BY position")
    assert [(o["position"], o["state"]) for o in ops] == [(0, "committed"), (1, "failed")]
    assert ops[1]["error"]["code"] == "CALL_WITHDRAWN"


class _DrainTools:
    """Tools for the drain tests: ``slow`` (0.5 s; sets ``slow_started``), ``fast``, and the
    idempotent ``ship``, ``label`` and ``pack`` (1 s); ``called`` lists the calls in order."""

    def __init__(self, app):  # type: ignore[no-untyped-def]
        self.called: list[str] = []
        self.slow_started = asyncio.Event()

        @app.tool()
        async def slow(ctx):  # type: ignore[no-untyped-def]
            self.called.append("slow")
            self.slow_started.set()
            await asyncio.sleep(0.5)
            return "slow"

        @app.tool()
        async def fast(ctx):  # type: ignore[no-untyped-def]
            self.called.append("fast")
            return "fast"

        def idempotent(name, result):  # type: ignore[no-untyped-def]
            @app.tool(name=name, effect="idempotent")
            async def tool(ctx):  # type: ignore[no-untyped-def]
                self.called.append(name)
                return result

            return tool

        ship, label = idempotent("ship", "shipped"), idempotent("label", "labelled")

        @app.tool(effect="idempotent")
        async def pack(ctx):  # type: ignore[no-untyped-def]
            self.called.append("pack")
            await asyncio.sleep(1.0)  # still running when a sibling stops for the drain
            return "packed"

        self.slow, self.fast, self.ship, self.label = slow, fast, ship, label
        self.pack = pack

    def branches(self, app, *others):  # type: ignore[no-untyped-def]
        """A workflow whose task group runs ``a`` (``slow``, then ``fast``: the drain stops it
        there) and one branch per tool of ``others``, in that order; it returns their results
        in the same order."""
        @app.workflow()
        async def wf(ctx, data):  # type: ignore[no-untyped-def]
            # Commands take their positions when called: these in program order, every time.
            slow_call, *calls = ctx.call(self.slow), *(ctx.call(tool) for tool in others)

            async def a():  # type: ignore[no-untyped-def]
                return [await slow_call, await ctx.call(self.fast)]

            async def one(call):  # type: ignore[no-untyped-def]
                return await call

            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(a()), *(group.create_task(one(c)) for c in calls)]
            return [task.result() for task in tasks]

        return wf

    async def drain_during_slow(self, app, wf):  # type: ignore[no-untyped-def]
        """Submit ``wf`` and drain a worker once ``slow`` runs (:func:`_drain_once`)."""
        return await _drain_once(app, wf, self.slow_started)


async def _drain_once(app, wf, started):  # type: ignore[no-untyped-def]
    """Submit ``wf``, start a worker, and stop it (a drain) once ``started`` is set; returns
    the run once the worker has stopped."""
    run = await app.submit_async(wf, {})
    worker = app.create_worker(poll_interval=0.2)
    working = asyncio.ensure_future(worker.run())
    await asyncio.wait_for(started.wait(), 10)
    worker.request_stop()
    await asyncio.wait_for(working, 20)
    return run


async def test_a_drain_stops_a_run_whose_workflow_uses_a_task_group(app, sql):
    """A draining worker stops a run at its next new step with ``Stop``; in a branch of an
    ``asyncio.TaskGroup`` that arrives wrapped in an exception group. The run is released for
    another worker, as without the group. (It used to fail with ``WORKFLOW_FAILED``.)"""
    tools = _DrainTools(app)

    async def steps(ctx):  # type: ignore[no-untyped-def]
        return [await ctx.call(tools.slow), await ctx.call(tools.fast)]

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        async with asyncio.TaskGroup() as group:
            task = group.create_task(steps(ctx))
        return task.result()

    run = await tools.drain_during_slow(app, wf)
    assert _status(sql, run) == {"status": "queued", "outcome_code": None}
    async with running(app):
        assert await run.result_async(timeout=20) == ["slow", "fast"]


async def test_a_cancelled_run_replaying_a_withdrawn_call_ends_cancelled(app, sql):
    """The replay of a withdrawn call waits there for workflow code to cancel it again; if
    the run is cancelled meanwhile, it ends ``cancelled`` instead of waiting for ever."""
    hooks: list[int] = []

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        return {"charged": True}

    @charge.authorize
    async def gate(pctx):  # type: ignore[no-untyped-def]
        hooks.append(1)
        await asyncio.sleep(5)
        return True

    executions: list[int] = []

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        executions.append(1)
        call = asyncio.ensure_future(ctx.call(charge))
        if len(executions) == 1:
            await asyncio.sleep(0.3)
            call.cancel()  # withdrawn during its policy stage, the first time only
        with contextlib.suppress(asyncio.CancelledError):
            await call
        await ctx.sleep(1.2)  # long enough to park: what follows is a replay
        return "done"

    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.journal WHERE kind = 'timer'"))
        await wait_for(lambda: _status(sql, run)["status"] == "running", timeout=15)
        await asyncio.sleep(0.5)  # the replay now waits at the withdrawn call
        await run.cancel_async()
        await wait_for(lambda: _status(sql, run)["status"] == "cancelled", timeout=15)
    assert len(hooks) == 1 and len(executions) == 2


async def test_a_draining_worker_still_withdraws_a_call_that_workflow_code_gave_up(
        app, sql, monkeypatch):
    """A worker that drains lets its runs go on to their next new step; a timeout of workflow
    code in the meantime is still the workflow's: the call is withdrawn, and on the next worker
    the replay gives up on it in the same way (it is not sent to reconciliation as if a worker
    had died holding it)."""
    _slow_write(monkeypatch)
    tools = _Tools(app)
    intent_sent = asyncio.Event()

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        call = asyncio.ensure_future(ctx.call(tools.charge))
        intent_sent.set()
        try:
            await asyncio.wait_for(call, 0.3)
            return "charged"
        except TimeoutError:
            pass
        await ctx.sleep(1.2)  # the drain stops the run here: the rest is a replay elsewhere
        return "gave up"

    run = await _drain_once(app, wf, intent_sent)  # the intent's write is in flight (0.6 s)
    ops = sql("SELECT state, error FROM orchestrator.operations")
    assert [o["state"] for o in ops] == ["failed"]
    assert ops[0]["error"]["code"] == "CALL_WITHDRAWN"
    async with running(app):
        assert await run.result_async(timeout=20) == "gave up"
    assert tools.called == []


async def test_a_branch_cancelled_by_its_task_group_for_a_drain_is_not_withdrawn(
        app, sql, monkeypatch):
    """A draining worker stops one branch of a task group at its next new step; the group then
    cancels the other branch, whose intent is being written. That cancellation is the
    engine's, not workflow code's: nothing is withdrawn, and on the next worker the replay
    re-sends the (idempotent) call with its key and the run completes. (Recorded as withdrawn,
    the replay would wait at that call for a cancellation that never comes.)"""
    _slow_write(monkeypatch, nth=2, delay=1.5)  # the second write: branch b's intent
    tools = _DrainTools(app)
    wf = tools.branches(app, tools.ship)  # b's intent is the run's second write

    run = await tools.drain_during_slow(app, wf)  # `a` stops at its next call; `b` cancelled
    assert _status(sql, run)["status"] == "queued"
    assert sql("SELECT count(*) AS n FROM orchestrator.journal WHERE kind = 'call.failed'"
               )[0]["n"] == 0
    async with running(app):
        assert await run.result_async(timeout=20) == [["slow", "fast"], "shipped"]
    assert tools.called.count("slow") == 1


async def test_a_receipt_waiting_for_the_write_lock_is_written_when_a_sibling_stops(
        app, sql, monkeypatch):
    """Three branches of a task group. ``b``'s (idempotent) call has returned and its receipt
    waits for the run's write lock, which ``c``'s slow intent write holds, when the draining
    worker stops ``a`` at its next call and the group cancels the others. The receipt records
    what already happened: it is written all the same (``finish``), so the next worker's
    replay returns it instead of calling the tool again. (Dropped with the cancellation, the
    operation stayed ``submitted`` and the replay re-sent the call.)"""
    _slow_write(monkeypatch, nth=3, delay=1.5)  # the third write: branch c's intent
    tools = _DrainTools(app)
    # b (ship): its receipt waits for the lock that c's (label's) intent write holds
    wf = tools.branches(app, tools.ship, tools.label)

    run = await tools.drain_during_slow(app, wf)
    assert _status(sql, run)["status"] == "queued"
    ops = {o["tool_name"]: o["state"] for o in sql(
        "SELECT tool_name, state FROM orchestrator.operations")}
    assert ops["ship"] == "committed"
    assert tools.called == ["slow", "ship"]
    async with running(app):
        assert await run.result_async(timeout=20) == [["slow", "fast"], "shipped", "labelled"]
    assert tools.called.count("ship") == 1
    assert tools.called.count("slow") == 1


async def test_a_tool_running_when_a_sibling_stops_for_the_drain_is_left_to_the_journal(
        app, sql):
    """Branch ``b``'s idempotent tool is running when the draining worker stops ``a`` at its
    next call and the task group cancels ``b``. That cancellation is the engine's: the call
    is not recorded as uncertain (no reconciliation, the run is not blocked); the next worker
    re-sends it with its key and the run completes."""
    tools = _DrainTools(app)
    wf = tools.branches(app, tools.pack)  # b's tool runs for 1 s

    run = await tools.drain_during_slow(app, wf)
    assert _status(sql, run)["status"] == "queued"
    assert sql("SELECT count(*) AS n FROM orchestrator.reconciliation_items")[0]["n"] == 0
    async with running(app):
        assert await run.result_async(timeout=20) == [["slow", "fast"], "packed"]
    assert tools.called.count("pack") == 2 and tools.called.count("slow") == 1
    assert sql("SELECT count(*) AS n FROM orchestrator.reconciliation_items")[0]["n"] == 0


async def test_an_intent_waiting_for_the_write_lock_when_a_sibling_stops_is_not_written(
        app, sql, monkeypatch):
    """Branch ``b``'s (consequential) call waits for the run's write lock, held by ``c``'s
    slow intent write, when the draining worker stops ``a`` and the task group cancels the
    others. The engine lets go of the run: ``b`` writes no intent (one written and never sent
    would be an uncertain operation on the next worker, for reconciliation); the next worker
    calls it once and the run completes."""
    _slow_write(monkeypatch, nth=2, delay=1.5)  # the second write: branch c's intent
    tools = _DrainTools(app)
    # c (label): its intent write holds the lock for 1.5 s; b (fast) waits for it meanwhile
    wf = tools.branches(app, tools.label, tools.fast)

    run = await tools.drain_during_slow(app, wf)
    assert _status(sql, run)["status"] == "queued"
    assert [o["tool_name"] for o in sql(
        "SELECT tool_name FROM orchestrator.operations ORDER BY id")] == ["slow", "label"]
    async with running(app):
        assert await run.result_async(timeout=20) == [["slow", "fast"], "labelled", "fast"]
    assert tools.called.count("fast") == 2 and tools.called.count("slow") == 1
    assert sql("SELECT count(*) AS n FROM orchestrator.reconciliation_items")[0]["n"] == 0


async def test_a_lock_connection_blip_does_not_take_runs_from_a_live_worker(make_app, sql):
    app = make_app(lease_ttl=30.0)
    started = asyncio.Event()

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        started.set()
        await asyncio.sleep(3)
        return {"ok": True}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    async with running(app, worker_id="A") as a:
        run = await app.submit_async(wf, {})
        await asyncio.wait_for(started.wait(), 10)
        async with running(app, worker_id="B"):
            key = a._liveness.key
            sql("SELECT pg_terminate_backend(pid) FROM pg_locks WHERE locktype = 'advisory' "
                "AND classid::bigint = %s AND objid::bigint = %s",
                ((key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF))
            assert await run.result_async(timeout=15) == {"ok": True}
    assert [o["state"] for o in _ops(sql)] == ["committed"]


@pytest.mark.parametrize("attempts", [3, 2])
async def test_a_resend_answered_not_applied_keeps_the_uncertain_key(make_app, sql, attempts):
    from orchestrator.recovery import RetryPolicy

    app = make_app()
    keys: list[str] = []

    @app.tool(effect="idempotent", retry=RetryPolicy(max_attempts=attempts, base_delay_ms=0))
    async def upsert(ctx):  # type: ignore[no-untyped-def]
        keys.append(ctx.idempotency_key)
        if len(keys) == 1:
            raise ConnectionResetError("sent, then the connection dropped")
        if len(keys) == 2:
            raise ToolError.before_send("busy")  # says nothing about the first attempt
        return {"ok": True}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(upsert)

    async with running(app):
        run = await app.submit_async(wf, {})
        if attempts == 3:
            assert await run.result_async(timeout=15) == {"ok": True}
        else:  # out of attempts: the first one may have applied, so it is reconciled
            await wait_for(_parked(sql, run))
    assert len(set(keys)) == 1  # never a new key while an attempt with the old one is unknown
    if attempts == 2:
        item = sql("SELECT i.reason, o.attempt FROM orchestrator.reconciliation_items i "
                   "JOIN orchestrator.operations o ON o.id = i.operation_id")
        assert item == [{"reason": "RESEND_NOT_APPLIED", "attempt": 1}]


async def test_a_cancel_between_an_uncertain_attempt_and_its_resend_lists_it(app, sql):
    @app.tool(effect="idempotent")
    async def upsert(ctx):  # type: ignore[no-untyped-def]
        await app.cancel_async(ctx.run_id)  # the cancel lands while this attempt is out
        raise ConnectionResetError("sent, then the connection dropped")

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(upsert)

    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(_parked(sql, run))  # not cancelled while the effect is unknown
        (op,) = [o for o in _ops(sql) if o["state"] == "unknown"]
        listed = sql("SELECT operation_id FROM orchestrator.reconciliation_items")
        assert listed == [{"operation_id": op["id"]}]  # no run blocked on an unlisted op
        await app.operators.resolve_not_applied(op["id"], evidence="nothing", operator="al")
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=10)
    assert info.value.code == "CANCELLED"
