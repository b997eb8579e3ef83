"""CONTRACT C7 and C3: a call that a cancellation stops before it is sent is journaled
``call.cancelled`` with ``why`` (``cancelled``, ``deadline`` or ``ended``), whichever path
noticed the cancellation: the engine before its write, or the database in the write itself
(the request landed after the engine last looked). Readers (``runs show``, the console, a
replay) say from it why the call was never sent."""

from __future__ import annotations

import pytest

from tests.integration.conftest import running
from tests.integration.contract.helpers import Tools


@pytest.mark.parametrize("gated", [False, True], ids=["begin", "policy-stage"])
async def test_a_cancellation_the_database_notices_is_journaled_with_why(app, sql, gated):
    """The cancellation is requested behind the worker's back (no NOTIFY), so the engine
    still thinks the run goes on, and the write that would send the call (its ``submitted``,
    or with a policy stage the ``pending → submitted`` step) finds it in the database."""
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
