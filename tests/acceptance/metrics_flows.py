"""A small application for the metrics acceptance tests: runs that succeed, one that fails,
one whose tool call ends with an unknown outcome (a consequential tool that raises); and for
the known workload, a call retried once, an unknown outcome a lookup settles, a call that
cancellation interrupts and a sleep that outlasts the run's deadline."""

from __future__ import annotations

import asyncio
from typing import Any

from orchestrator import (
    Committed,
    Orchestrator,
    Owner,
    RetryPolicy,
    ToolContext,
    ToolError,
    WorkflowContext,
    WorkflowError,
)

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


# No delay before the retry: a delay (jittered) would park the run or not depending on how long
# the failure's write took, and the test counts parks exactly.
@app.tool(retry=RetryPolicy(max_attempts=3, base_delay_ms=0, max_delay_ms=0))
async def flaky(ctx: ToolContext, *, n: int) -> dict[str, int]:
    """Refused before it was sent the first time (nothing applied, retryable), then fine."""
    if ctx.attempt == 1:
        raise ToolError.before_send("connection", "refused")
    return {"n": n}


@app.tool()
async def ship(ctx: ToolContext, *, n: int) -> dict[str, int]:
    """Consequential and uncertain, like charge; but the provider can be asked."""
    raise ConnectionResetError("the provider hung up")


@ship.lookup
async def find_shipment(ctx: ToolContext, *, n: int) -> Committed:
    return Committed({"shipped": n})


@app.tool(effect="read")
async def slow_read(ctx: ToolContext) -> dict[str, str]:
    await asyncio.sleep(300)
    return {"read": "late"}


@app.workflow()
async def retried(ctx: WorkflowContext, data: Any) -> Any:
    return await ctx.call(flaky, n=1)


@app.workflow()
async def looked_up(ctx: WorkflowContext, data: Any) -> Any:
    return await ctx.call(ship, n=2)


@app.workflow()
async def stalled(ctx: WorkflowContext, data: Any) -> Any:
    return await ctx.call(slow_read)


@app.workflow()
async def late(ctx: WorkflowContext, data: Any) -> Any:
    await ctx.sleep(300)
