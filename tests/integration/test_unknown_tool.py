"""``ctx.call`` with a tool this application does not register: ``UNKNOWN_TOOL`` raised into
the workflow before anything is written, whether the tool is named or given as an object that
another ``Orchestrator`` registers (even under a name this one registers too: calling this
application's tool of that name would run other code than the one the workflow names)."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator import Orchestrator, RunFailed
from orchestrator.errors import InvalidRequest, UnknownTool, UnknownWorkflow
from tests.integration.conftest import running


async def test_a_call_of_a_tool_this_app_does_not_register_is_unknown_tool(
        make_app: Any, sql: Any) -> None:
    app: Orchestrator = make_app()
    other: Orchestrator = make_app()
    called: list[str] = []

    @app.tool(name="charge")
    async def charge_here(ctx, *, cents):  # type: ignore[no-untyped-def]
        called.append("here")
        return {"cents": cents}

    @other.tool(name="charge")
    async def charge_there(ctx, *, cents):  # type: ignore[no-untyped-def]
        called.append("there")
        return {"cents": cents}

    @other.tool()
    async def refund(ctx, *, cents):  # type: ignore[no-untyped-def]
        return {"cents": cents}

    @app.workflow()
    async def pays(ctx, tool):  # type: ignore[no-untyped-def]
        chosen = {"name": "nope", "foreign same name": charge_there,
                  "foreign": refund}[tool]
        try:
            await ctx.call(chosen, cents=5)
        except UnknownTool as exc:
            assert isinstance(exc, UnknownWorkflow)  # caught as it was before UNKNOWN_TOOL
            assert isinstance(exc, InvalidRequest)
            return [exc.code, exc.message]
        return "called"

    async with running(app):
        said = {tool: await (await app.submit_async(pays, tool)).result_async(timeout=30)
                for tool in ("name", "foreign same name", "foreign")}
    assert said == {
        "name": ["UNKNOWN_TOOL", "tool 'nope' is not registered with this orchestrator"],
        "foreign same name": ["UNKNOWN_TOOL", "tool 'charge' is given as an object this "
                              "orchestrator does not register (it registers another tool "
                              "of that name)"],
        "foreign": ["UNKNOWN_TOOL", "tool 'refund' is given as an object this orchestrator "
                    "does not register"],
    }
    assert called == []
    assert not sql("SELECT 1 FROM orchestrator.operations")


async def test_an_uncaught_unknown_tool_fails_the_run_naming_it(make_app: Any) -> None:
    app: Orchestrator = make_app()

    @app.workflow()
    async def pays(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call("nope")

    async with running(app):
        run = await app.submit_async(pays, {})
        with pytest.raises(RunFailed) as failed:
            await run.result_async(timeout=30)
    assert failed.value.code == "WORKFLOW_FAILED"
    assert failed.value.cause == {"code": "UNKNOWN_TOOL"}
