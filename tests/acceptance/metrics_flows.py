"""A small application for the metrics acceptance test: runs that succeed, one that fails,
and one whose tool call ends with an unknown outcome (a consequential tool that raises)."""

from __future__ import annotations

from typing import Any

from orchestrator import Orchestrator, Owner, ToolContext, WorkflowContext, WorkflowError

app = Orchestrator(default_owner=Owner(tenant="acceptance", principal="metrics"))


@app.tool(effect="idempotent")
async def echo(ctx: ToolContext, *, n: int) -> dict[str, int]:
    return {"n": n}


@app.tool()
async def charge(ctx: ToolContext, *, n: int) -> dict[str, int]:
    """Consequential, and it raises something that proves nothing: the outcome is unknown."""
    raise ConnectionResetError("the provider hung up")


@app.workflow()
async def succeeds(ctx: WorkflowContext, data: Any) -> Any:
    return await ctx.call(echo, n=int(data["n"]))


@app.workflow()
async def fails(ctx: WorkflowContext, data: Any) -> Any:
    raise WorkflowError("refused on purpose")


@app.workflow()
async def uncertain(ctx: WorkflowContext, data: Any) -> Any:
    return await ctx.call(charge, n=1)
