"""The application the failover tests run in real worker and reconciler processes.

Every tool call lands in the effect sink of the chaos suite (:mod:`tests.chaos.sink`), a
database on the ordinary test server, outside the replicated pair: what the provider applied is
counted where no failover can lose or repeat it.

=======  =============  ======  ===================================================
tool     effect         lookup  the provider
=======  =============  ======  ===================================================
pay      consequential  yes     applies every request (a repeated key shows twice)
ship     consequential  yes     the same
charge   consequential  yes     deduplicates by idempotency key (answers a repeated
                                key with the first receipt, applies nothing)
notify   idempotent     no      deduplicates by key
=======  =============  ======  ===================================================

``charge`` can be held at a gate after it applied its effect (``gate=True``): it waits until
the test opens the gate for its step (:func:`open_gate`), so that a test can kill the primary
while a call is known to be applied and not yet answered.
"""

from __future__ import annotations

import asyncio
import os
from datetime import timedelta
from typing import Any

import psycopg

from orchestrator import (
    Committed,
    NotApplied,
    Orchestrator,
    Owner,
    StillUnknown,
    ToolContext,
    WorkflowContext,
)
from tests.chaos import sink

OWNER = Owner(tenant="failover", principal="tests")
LEASE_TTL = float(os.environ.get("FAILOVER_LEASE_TTL", "3"))

app = Orchestrator(default_owner=OWNER, lease_ttl=LEASE_TTL)

GATES = "CREATE TABLE IF NOT EXISTS failover_gates (step text PRIMARY KEY)"


async def _provider(ctx: ToolContext, tool: str, *, dedup: bool, step: str) -> dict[str, Any]:
    call_id = await sink.record_call(tool=tool, effect="idempotent" if dedup else "consequential",
                                     run_id=ctx.run_id, position=ctx.position,
                                     attempt=ctx.attempt, op_id=ctx.operation_id,
                                     key=ctx.idempotency_key, fault="none")
    receipt, deduplicated = await sink.apply(
        call_id=call_id, tool=tool, effect="idempotent" if dedup else "consequential",
        run_id=ctx.run_id, position=ctx.position, attempt=ctx.attempt,
        op_id=ctx.operation_id, key=ctx.idempotency_key)
    await sink.finish_call(call_id, "deduplicated" if deduplicated else "ok")
    return {**receipt, "step": step}


async def _lookup(ctx: ToolContext, tool: str, step: str) -> Committed | NotApplied | StillUnknown:
    answer, found = await sink.lookup(tool=tool, key=ctx.idempotency_key, op_id=ctx.operation_id)
    if answer == "committed":
        assert found is not None
        return Committed({**found, "step": step})
    if answer == "not_applied":
        return NotApplied(f"no effect with key {ctx.idempotency_key}; the key is voided")
    return StillUnknown("a request with this key may still be in flight")


@app.tool(effect="consequential", timeout=timedelta(seconds=10))
async def pay(ctx: ToolContext, *, step: str) -> Any:
    return await _provider(ctx, "pay", dedup=False, step=step)


@pay.lookup
async def find_payment(ctx: ToolContext, *, step: str) -> Any:
    return await _lookup(ctx, "pay", step)


@app.tool(effect="consequential", timeout=timedelta(seconds=10))
async def ship(ctx: ToolContext, *, step: str) -> Any:
    return await _provider(ctx, "ship", dedup=False, step=step)


@ship.lookup
async def find_shipment(ctx: ToolContext, *, step: str) -> Any:
    return await _lookup(ctx, "ship", step)


@app.tool(effect="consequential", timeout=timedelta(seconds=60))
async def charge(ctx: ToolContext, *, step: str, gate: bool = False) -> Any:
    receipt = await _provider(ctx, "charge", dedup=True, step=step)
    while gate and not await _gate_open(step):
        await asyncio.sleep(0.05)
    return receipt


@charge.lookup
async def find_charge(ctx: ToolContext, *, step: str, gate: bool = False) -> Any:
    return await _lookup(ctx, "charge", step)


@app.tool(effect="idempotent", timeout=timedelta(seconds=10))
async def notify(ctx: ToolContext, *, step: str) -> Any:
    return await _provider(ctx, "notify", dedup=True, step=step)


async def _gate_open(step: str) -> bool:
    async with (await sink.pool()).connection() as conn:
        cur = await conn.execute("SELECT 1 FROM failover_gates WHERE step = %s", (step,))
        return await cur.fetchone() is not None


def create_gates(sink_url: str) -> None:
    with psycopg.connect(sink_url, autocommit=True) as conn:
        conn.execute(GATES)


def open_gate(sink_url: str, step: str) -> None:
    with psycopg.connect(sink_url, autocommit=True) as conn:
        conn.execute("INSERT INTO failover_gates (step) VALUES (%s) ON CONFLICT DO NOTHING",
                     (step,))


# -- workflows --------------------------------------------------------------------------------


@app.workflow()
async def order(ctx: WorkflowContext, data: dict[str, Any]) -> list[Any]:
    """Three consequential or idempotent calls with a short durable sleep between: a run that
    is in the middle of something most of the time."""
    n = data["n"]
    paid = await ctx.call(pay, step=f"{n}.pay")
    await ctx.sleep(timedelta(seconds=data.get("pause", 0.3)))
    shipped = await ctx.call(ship, step=f"{n}.ship")
    told = await ctx.call(notify, step=f"{n}.notify")
    return [paid, shipped, told]


@app.workflow()
async def billing(ctx: WorkflowContext, data: dict[str, Any]) -> Any:
    """One ``charge``, after an optional durable sleep, optionally held at its gate."""
    if data.get("sleep"):
        await ctx.sleep(timedelta(seconds=data["sleep"]))
    return await ctx.call(charge, step=data["step"], gate=data.get("gate", False))
