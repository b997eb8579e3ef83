"""CONTRACT C7 and C3: a call that a cancellation stops before it is sent is journaled
``call.cancelled`` with ``why`` (``cancelled``, ``deadline`` or ``ended``), whichever path
noticed the cancellation: the engine before its write, or the database in the write itself
(the request landed after the engine last looked). Readers (``runs show``, the console, a
replay) say from it why the call was never sent."""

from __future__ import annotations

import pytest

from orchestrator import RunFailed
from tests.integration.conftest import running
from tests.integration.contract.helpers import Tools

CANCELLED_ERROR = {"code": "CALL_CANCELLED", "cause": "cancelled",
                   "message": "the run was cancelled before the call was sent"}


@pytest.mark.parametrize("gated", [False, True], ids=["begin", "policy-stage"])
async def test_a_cancellation_the_database_notices_is_journaled_with_why(app, sql, gated):
    """The cancellation is requested behind the worker's back (no NOTIFY), so the engine
    still thinks the run goes on, and the write that would send the call (its ``submitted``,
    or with a policy stage the ``pending → submitted`` step) finds it in the database. The
    operation it cancelled keeps the same error as one the engine cancelled
    (``cancel_unsent``): a stable code, the ``why`` and words, so that a reader of the ledger
    (``ops show``'s attempts, the console) says why it was never sent."""
    tools = Tools(app)

    def cancel_behind_the_workers_back(run_id: object) -> None:
        sql("UPDATE orchestrator.runs SET cancel_requested_at = now() WHERE id = %s",
            (run_id,))

    @app.tool()
    async def first(ctx):  # type: ignore[no-untyped-def]
        if not gated:
            cancel_behind_the_workers_back(ctx.run_id)
        return {"first": True}

    if gated:
        @tools.charge.authorize
        async def gate(pctx):  # type: ignore[no-untyped-def]
            cancel_behind_the_workers_back(pctx.run_id)
            return True

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.call(first)
        return await ctx.call(tools.charge)

    async with running(app):
        run = await app.submit_async(wf, {})
        with pytest.raises(Exception) as stopped:
            await run.result_async(timeout=20)
    assert getattr(stopped.value, "code", None) == "CANCELLED"
    assert tools.called == []
    cancelled = sql("SELECT payload FROM orchestrator.journal "
                    "WHERE kind = 'call.cancelled' ORDER BY seq")
    assert [e["payload"].get("why") for e in cancelled] == ["cancelled"], cancelled
    (op,) = sql("SELECT state, error FROM orchestrator.operations WHERE tool_name = 'charge'")
    assert (op["state"], op["error"]) == ("cancelled", CANCELLED_ERROR)




@pytest.mark.parametrize("stop", ["cancelled", "deadline"])
async def test_a_cancellation_the_engine_notices_at_a_policy_stage_stores_why(app, sql, stop):
    """A cancellation (or the run's deadline) that reaches the run while a policy stage is
    deciding: the pending intent is cancelled by the engine, its error says why."""
    import asyncio
    from datetime import timedelta

    tools = Tools(app)
    deciding = asyncio.Event()

    @tools.charge.authorize
    async def gate(pctx):  # type: ignore[no-untyped-def]
        deciding.set()
        await asyncio.sleep(60)  # until the cancellation or the deadline stops it
        return True

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(tools.charge)

    async with running(app):
        run = await app.submit_async(
            wf, {}, deadline=timedelta(seconds=3) if stop == "deadline" else None)
        await asyncio.wait_for(deciding.wait(), 20)
        if stop == "cancelled":
            await app.cancel_async(run.id)
        with pytest.raises(RunFailed) as stopped:
            await run.result_async(timeout=20)
    assert stopped.value.code == ("DEADLINE_EXCEEDED" if stop == "deadline" else "CANCELLED")
    assert tools.called == []
    (op,) = sql("SELECT state, error FROM orchestrator.operations WHERE tool_name = 'charge'")
    message = ("the run's deadline passed" if stop == "deadline"
               else "the run was cancelled") + " before the call was sent"
    assert (op["state"], op["error"]) == ("cancelled", {
        "code": "CALL_CANCELLED", "cause": stop, "message": message})
    cancelled = sql("SELECT payload FROM orchestrator.journal WHERE kind = 'call.cancelled'")
    assert [e["payload"]["why"] for e in cancelled] == [stop]
