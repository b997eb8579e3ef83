"""CONTRACT C5: every effect goes through the ledger. A call that workflow code gives up on
(cancels, times out) before or while its intent or its receipt is written is settled so that
the ledger, the journal and a replay agree on it: withdrawn if it was never sent, its receipt
kept if it returned. Bad arguments are refused before anything is written."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from orchestrator import InvalidRequest
from tests.integration.conftest import never_answers, running
from tests.integration.contract.helpers import (
    Tools,
    operations,
    slow_write,
    watch_writes,
)


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
    assert operations(sql) == []


@pytest.mark.parametrize(("ride", "gated"), [(True, False), (False, False), (True, True)])
async def test_a_call_cancelled_while_its_intent_is_written_is_withdrawn(
        make_app, sql, monkeypatch, ride, gated):
    """Workflow code cancels a call while its write-ahead ``submitted`` is in the group writer
    (the run's first write; with a policy stage, its second, after the ``pending`` intent): the
    write lands all the same, so the run must account for it (its next writes are not refused
    as if the lease were lost), the tool is never called, the operation is settled as never
    dispatched, and a replay cancels the call at the same point again."""
    app = make_app(receipts_ride=ride)
    writes = watch_writes(monkeypatch)
    tools = Tools(app)

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
    tools = Tools(app)
    hooks: list[int] = []

    @tools.charge.authorize
    async def gate(pctx):  # type: ignore[no-untyped-def]
        hooks.append(1)
        if len(hooks) == 1:
            await never_answers()  # the first time, slower than the workflow will wait
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


async def test_a_call_cancelled_while_its_receipt_is_written_keeps_the_run_in_step(
        make_app, sql, monkeypatch):
    """The same for the receipt's own write (``receipts_ride=False``): it lands, the run's
    revision follows it, and the run goes on (the call returns its receipt: see the next
    test)."""
    app = make_app(receipts_ride=False)
    writes = watch_writes(monkeypatch)

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
    assert [o["state"] for o in operations(sql)] == ["committed", "committed"]
    # One claim: the worker never lost track of the run (it used to, and the run only went on
    # once its lease had lapsed and another claim replayed it).
    assert sql("SELECT lease_token FROM orchestrator.runs")[0]["lease_token"] == 1


@pytest.mark.parametrize("how", ["receipts_ride=False", "idempotent tool"])
async def test_a_timeout_during_a_receipts_own_write_returns_the_receipt(
        make_app, sql, monkeypatch, how):
    """A timeout around ``ctx.call`` that fires while the receipt is being written (its own
    write: ``receipts_ride=False``, or an idempotent tool, whose receipts never ride): the call
    completed and its receipt is recorded, so the workflow gets the receipt, as a replay will
    (a recorded call returns at once). It used to get the timeout, go another way, and fail
    with ``NONDETERMINISM`` on the replay."""
    app = make_app(receipts_ride=how != "receipts_ride=False")
    slow_write(monkeypatch, nth=2)  # the run's second write, the receipt's own
    tools = Tools(app, effect="idempotent" if how == "idempotent tool" else "consequential")

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
    assert [o["state"] for o in operations(sql)] == ["committed"]


async def test_a_call_cancelled_while_it_waits_for_the_write_lock_is_withdrawn(
        app, sql, monkeypatch):
    """Two branches: the first one's write holds the run's write lock while workflow code
    gives up on the second call, which is still waiting for that lock. The second call's intent
    is still written and then withdrawn, so the replay waits at that call for the same
    cancellation instead of sending it. (The call used to leave nothing behind: the replay
    called the tool.)"""
    slow_write(monkeypatch, delay=0.6)  # the patient call's intent, beyond the 0.2 s timeout
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


async def test_a_call_given_up_on_during_its_retry_backoff_is_not_sent_on_replay(app, sql):
    """Workflow code gives up on a call while it waits, durably, for its next attempt (its
    first one failed without effect; another branch keeps the run in this process). The call
    is withdrawn there: the replay, which finds the backoff over, waits at that call for the
    same cancellation instead of sending the next attempt behind the workflow's back. (The
    replay sent it, and the workflow, which had given up, got its receipt.)"""
    from orchestrator import ToolError
    from orchestrator.recovery import RetryPolicy

    called: list[str] = []
    gave_up = asyncio.Event()

    @app.tool(retry=RetryPolicy(max_attempts=2, base_delay_ms=1000, max_delay_ms=1000))
    async def quote(ctx):  # type: ignore[no-untyped-def]
        called.append("quote")
        if len(called) == 1:
            raise ToolError.before_send("connection", retry_after="1")
        return {"price": 3}

    @app.tool()
    async def stock(ctx):  # type: ignore[no-untyped-def]
        await gave_up.wait()  # keeps the run in this process while the quote's backoff runs
        return {"stock": 7}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        async def impatient():  # type: ignore[no-untyped-def]
            try:
                return await asyncio.wait_for(ctx.call(quote), 0.3)
            except TimeoutError:
                gave_up.set()
                return "gave up"

        got = await ctx.gather(impatient(), ctx.call(stock))
        await ctx.sleep(1.5)  # long enough to park: the result comes from a replay
        return got

    async with running(app):
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=20) == ["gave up", {"stock": 7}]
    assert called == ["quote"]
    states = {o["tool_name"]: o["state"] for o in operations(sql)}
    assert states == {"stock": "committed", "quote": "failed"}
    failed = sql("SELECT payload FROM orchestrator.journal WHERE kind = 'call.failed'")
    assert [e["payload"]["reason"] for e in failed] == ["withdrawn"]
