"""The sample application that ``orchestrator demo`` runs: a small shop.

Its tools stand in for providers. They write every effect to a *sink*, a folder of JSON lines
outside the database (``ORCHESTRATOR_DEMO_SINK``), and, like a payment provider, deduplicate by
the idempotency key they are given: a re-sent request with a known key returns the saved receipt
and applies nothing. The demo counts effects in the sink, not in the orchestrator's own tables.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
from datetime import timedelta
from pathlib import Path
from typing import Any

from orchestrator import (
    Committed,
    NotApplied,
    Orchestrator,
    Owner,
    ToolContext,
    WorkflowContext,
)

OWNER = Owner(tenant="demo", principal="shop")
app = Orchestrator(default_owner=OWNER, lease_ttl=3.0)


def _sink() -> Path:
    return Path(os.environ.get("ORCHESTRATOR_DEMO_SINK", "."))


def apply_effect(key: str, tool: str, arguments: dict[str, Any], *, dedup: bool = True
                 ) -> dict[str, Any]:
    """Apply an effect (across processes: a file lock). With ``dedup``, like a provider that
    honours idempotency keys, a known key returns the saved receipt and applies nothing;
    without it every call applies again (a consequential provider)."""
    sink = _sink()
    with open(sink / "effects.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        effects = read_effects(sink)
        for effect in effects if dedup else ():
            if effect["key"] == key:
                with open(sink / "dedup.jsonl", "a") as dup:
                    dup.write(json.dumps({"key": key, "tool": tool}) + "\n")
                return dict(effect["receipt"])
        receipt = {"id": f"{tool}-{len(effects) + 1}", "tool": tool}
        with open(sink / "effects.jsonl", "a") as out:
            out.write(json.dumps({"key": key, "tool": tool, "arguments": arguments,
                                  "receipt": receipt}) + "\n")
            out.flush()
            os.fsync(out.fileno())
        return receipt


def read_effects(sink: Path) -> list[dict[str, Any]]:
    path = sink / "effects.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def _provider(ctx: ToolContext, tool: str, delay: float, **arguments: Any) -> Any:
    await asyncio.sleep(delay)  # the provider's latency
    return await asyncio.to_thread(apply_effect, ctx.idempotency_key, tool, arguments)


@app.tool(effect="read")
async def fetch_price(ctx: ToolContext, *, sku: str) -> dict[str, Any]:
    await asyncio.sleep(0.1)
    return {"sku": sku, "cents": 1000 + sum(map(ord, sku)) % 500}


@app.tool(effect="idempotent")
async def reserve_stock(ctx: ToolContext, *, sku: str, quantity: int) -> Any:
    return await _provider(ctx, "reserve_stock", 0.3, sku=sku, quantity=quantity)


@app.tool(effect="idempotent")
async def charge_card(ctx: ToolContext, *, customer: str, cents: int) -> Any:
    return await _provider(ctx, "charge_card", 0.4, customer=customer, cents=cents)


@app.tool(effect="idempotent")
async def send_email(ctx: ToolContext, *, to: str, subject: str) -> Any:
    return await _provider(ctx, "send_email", 0.2, to=to, subject=subject)


@app.tool()  # consequential: an uncertain shipment is never sent again automatically
async def ship_parcel(ctx: ToolContext, *, customer: str, sku: str) -> Any:
    await asyncio.sleep(0.3)
    return await asyncio.to_thread(apply_effect, ctx.idempotency_key, "ship_parcel",
                                   {"customer": customer, "sku": sku}, dedup=False)


@ship_parcel.lookup
async def find_parcel(ctx: ToolContext, *, customer: str, sku: str) -> Committed | NotApplied:
    """Ask the carrier whether a parcel with this key exists: read-only."""
    for effect in read_effects(_sink()):
        if effect["key"] == ctx.idempotency_key:
            return Committed(effect["receipt"])
    return NotApplied("the carrier has no parcel with this key")


@app.workflow(version="1")
async def order(ctx: WorkflowContext, data: dict[str, Any]) -> dict[str, Any]:
    price = await ctx.call(fetch_price, sku=data["sku"])
    await ctx.call(reserve_stock, sku=data["sku"], quantity=data["quantity"])
    await ctx.sleep(timedelta(seconds=2))  # a durable timer: the run is parked meanwhile
    charge = await ctx.call(charge_card, customer=data["customer"],
                            cents=price["cents"] * data["quantity"])
    await ctx.call(send_email, to=data["customer"], subject="your order")
    parcel = await ctx.call(ship_parcel, customer=data["customer"], sku=data["sku"])
    return {"charge": charge["id"], "parcel": parcel["id"], "at": ctx.now().isoformat()}


@app.workflow(version="1")
async def refund_with_approval(ctx: WorkflowContext, data: dict[str, Any]) -> dict[str, Any]:
    await ctx.call(send_email, to="manager@example.com", subject=f"approve {data['customer']}")
    answer = await ctx.wait_for_event("approval", timeout=timedelta(minutes=5))
    if not answer.get("ok"):
        return {"refunded": False}
    refund = await ctx.call(charge_card, customer=data["customer"], cents=-data["cents"])
    return {"refunded": True, "refund": refund["id"]}


@app.workflow(version="1")
async def bundle(ctx: WorkflowContext, data: dict[str, Any]) -> dict[str, Any]:
    first, second = await ctx.gather(
        ctx.call(reserve_stock, sku="pen", quantity=1),
        ctx.call(reserve_stock, sku="ink", quantity=2),
    )
    child = await ctx.run_child(order, {"sku": "pad", "quantity": 1,
                                        "customer": data["customer"]})
    return {"reserved": [first["id"], second["id"]], "child": child}
