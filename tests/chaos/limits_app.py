"""The application of the chaos suite's limits profile (:mod:`tests.chaos.limits`).

Queues ``capped`` (concurrency 3), ``keyed`` (one run per key at a time) and ``rated`` (50
starts per second); a tool ``api`` limited to 2 calls in flight and 20 dispatches per second.
Every effect goes to the sink (``CHAOS_SINK_URL``), timestamped by the sink's own clock:

- ``span`` (idempotent): one row per idempotency key, the first application only
  (``limit_effects``), so a run's ``begin`` and ``end`` mark when it first held its slot and
  when it was done, whoever sent them and however often;
- ``api`` (idempotent): one row per invocation (``limit_calls``), its start and, when it got
  that far, its end: what the provider had in flight.
"""

from __future__ import annotations

import asyncio
import os
from datetime import timedelta
from typing import Any

from orchestrator import Orchestrator, Owner, RateLimit, ToolContext, WorkflowContext
from tests.chaos import sink

CAPPED = 3
RATED = 50
API_RATE = 20
API_CONCURRENCY = 2
API_HOLD = 0.05
API_TIMEOUT = timedelta(seconds=2)

DDL = """
CREATE TABLE IF NOT EXISTS limit_effects (
    key text PRIMARY KEY, run_id uuid NOT NULL, phase text NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE IF NOT EXISTS limit_calls (
    id bigserial PRIMARY KEY, run_id uuid NOT NULL, pid int NOT NULL,
    started_at timestamptz NOT NULL DEFAULT clock_timestamp(), ended_at timestamptz);
"""

app = Orchestrator(os.environ.get("ORCHESTRATOR_DATABASE_URL"),
                   default_owner=Owner(tenant="chaos", principal="limits"),
                   lease_ttl=float(os.environ.get("CHAOS_LEASE_TTL", "3")))
app.queue("capped", concurrency=CAPPED)
app.queue("keyed", key_concurrency=1)
app.queue("rated", rate=RateLimit(RATED, per=timedelta(seconds=1)))


@app.tool(effect="idempotent")
async def span(ctx: ToolContext, *, phase: str) -> dict[str, Any]:
    pool = await sink.pool()
    async with pool.connection() as conn:
        await conn.execute(
            "INSERT INTO limit_effects (key, run_id, phase) VALUES (%s, %s, %s) "
            "ON CONFLICT (key) DO NOTHING", (ctx.idempotency_key, ctx.run_id, phase))
    return {"phase": phase}


@app.tool(effect="idempotent", rate=RateLimit(API_RATE, per=timedelta(seconds=1)),
          concurrency=API_CONCURRENCY, timeout=API_TIMEOUT)
async def api(ctx: ToolContext) -> dict[str, Any]:
    pool = await sink.pool()
    async with pool.connection() as conn:
        cur = await conn.execute(
            "INSERT INTO limit_calls (run_id, pid) VALUES (%s, %s) RETURNING id",
            (ctx.run_id, os.getpid()))
        row = await cur.fetchone()
    await asyncio.sleep(API_HOLD)
    async with pool.connection() as conn:
        await conn.execute("UPDATE limit_calls SET ended_at = clock_timestamp() WHERE id = %s",
                           (row["id"],))
    return {"ok": True}


async def _held(ctx: WorkflowContext, hold: float) -> dict[str, Any]:
    await ctx.call(span, phase="begin")
    await asyncio.sleep(hold)  # not durable: a replay holds the slot again
    await ctx.call(span, phase="end")
    return {"held": hold}


@app.workflow(queue="capped")
async def capped(ctx: WorkflowContext, data: dict[str, Any]) -> dict[str, Any]:
    return await _held(ctx, data["hold"])


@app.workflow(queue="keyed")
async def keyed(ctx: WorkflowContext, data: dict[str, Any]) -> dict[str, Any]:
    return await _held(ctx, data["hold"])


@app.workflow(queue="rated")
async def rated(ctx: WorkflowContext, data: dict[str, Any]) -> dict[str, Any]:
    await ctx.call(span, phase="begin")
    return {}


@app.workflow()
async def calls_api(ctx: WorkflowContext, data: dict[str, Any]) -> dict[str, Any]:
    return await ctx.call(api)
