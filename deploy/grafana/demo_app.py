"""The application behind the dashboard's preview (``preview.py --demo``): a little of
everything the dashboard shows. Most runs succeed in three steps; some calls are refused once
and retried; some consequential calls end with an unknown outcome, which the reconciler's
lookup settles (``ship``) or which waits for an operator (``refund``, no lookup); some runs
sleep (they park and resume); a slow read is there to be cancelled; a few runs fail; a
schedule fires every 5 seconds and skips a slot while its last run is still going.

The tools only pretend: they sleep a few milliseconds and draw their answer at random."""

from __future__ import annotations

import asyncio
import random
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

app = Orchestrator(default_owner=Owner(tenant="demo", principal="dashboard"))


async def _work(low_ms: float, high_ms: float) -> None:
    await asyncio.sleep(random.uniform(low_ms, high_ms) / 1000)


@app.tool(effect="idempotent")
async def reserve(ctx: ToolContext, *, sku: str) -> dict[str, str]:
    await _work(2, 20)
    return {"reserved": sku}


@app.tool(effect="read")
async def price(ctx: ToolContext, *, sku: str) -> dict[str, int]:
    await _work(1, 10)
    return {"cents": 1999}


@app.tool(retry=RetryPolicy(max_attempts=4, base_delay_ms=200, max_delay_ms=2000))
async def charge(ctx: ToolContext, *, cents: int) -> dict[str, int]:
    """Refused before it was sent, now and then (nothing applied: retried), or slowed down
    with a Retry-After."""
    await _work(5, 40)
    draw = random.random()
    if draw < 0.15:
        raise ToolError.before_send("connection", "refused")
    if draw < 0.2:
        raise ToolError.from_status(429, "slow down", proves_not_applied=True, retry_after="1")
    return {"charged": cents}


@app.tool()
async def ship(ctx: ToolContext, *, order: int) -> dict[str, int]:
    """Consequential; sometimes the carrier hangs up after the request went out."""
    await _work(5, 30)
    if random.random() < 0.05:
        raise ConnectionResetError("the carrier hung up")
    return {"shipment": order}


@ship.lookup
async def find_shipment(ctx: ToolContext, *, order: int) -> Committed:
    await _work(5, 20)
    return Committed({"shipment": order})


@app.tool()
async def refund(ctx: ToolContext, *, order: int) -> dict[str, int]:
    """Consequential, without a lookup: an uncertain refund waits for an operator."""
    await _work(5, 30)
    if random.random() < 0.2:
        raise ConnectionResetError("the bank hung up")
    return {"refunded": order}


@app.tool(effect="read")
async def report(ctx: ToolContext, *, seconds: float) -> dict[str, float]:
    await asyncio.sleep(seconds)
    return {"took": seconds}


@app.workflow()
async def checkout(ctx: WorkflowContext, data: Any) -> Any:
    sku = str(data["sku"])
    await ctx.call(reserve, sku=sku)
    quote = await ctx.call(price, sku=sku)
    if data.get("declined"):
        raise WorkflowError("the card was declined")
    return await ctx.call(charge, cents=int(quote["cents"]))


@app.workflow()
async def fulfil(ctx: WorkflowContext, data: Any) -> Any:
    await ctx.sleep(float(data.get("pause", 2)))
    return await ctx.call(ship, order=int(data["order"]))


@app.workflow()
async def give_back(ctx: WorkflowContext, data: Any) -> Any:
    return await ctx.call(refund, order=int(data["order"]))


@app.tool(effect="read")
async def pulse(ctx: ToolContext) -> dict[str, float]:
    """Sometimes slower than the schedule's period, so that some slots are skipped."""
    took = random.choice([0.5, 1.0, 7.0])
    await asyncio.sleep(took)
    return {"took": took}


@app.schedule("pulse", cron="*/5 * * * * *", overlap="skip")
@app.workflow()
async def heartbeat(ctx: WorkflowContext, data: Any) -> Any:
    return await ctx.call(pulse)


@app.workflow()
async def nightly_report(ctx: WorkflowContext, data: Any) -> Any:
    return await ctx.call(report, seconds=float(data["seconds"]))
