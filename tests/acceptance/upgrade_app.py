"""The application of tests/acceptance/test_upgrade_in_flight.py.

Two engines run it: workers of an older commit (exported with ``git archive``, see
tests/chaos/engine.py) start its runs, and workers of the work tree finish them after the
database is upgraded. So it uses only the public API that both have.

Every tool call writes a row to ``public.upgrade_calls`` as soon as it starts (its tool, step,
attempt, idempotency key and process), and the effect goes to ``public.upgrade_effects``,
which deduplicates by idempotency key like a provider would. The test counts both.
``UPGRADE_TOOL_DELAY`` makes ``slow`` wait that many seconds first in the worker that has it.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

import psycopg

from orchestrator import (
    Orchestrator,
    Owner,
    RetryPolicy,
    ToolContext,
    ToolError,
    WorkflowContext,
)

app = Orchestrator(default_owner=Owner(tenant="upgrade", principal="tests"), lease_ttl=2)

SINK_DDL = """
CREATE TABLE IF NOT EXISTS public.upgrade_calls (
    id bigserial PRIMARY KEY, run_id text NOT NULL, tool text NOT NULL, step int NOT NULL,
    attempt int NOT NULL, key text NOT NULL, pid int NOT NULL);
CREATE TABLE IF NOT EXISTS public.upgrade_effects (
    key text PRIMARY KEY, run_id text NOT NULL, tool text NOT NULL, step int NOT NULL,
    pid int NOT NULL);
"""


def _sink(sql: str, params: tuple[Any, ...]) -> None:
    with psycopg.connect(os.environ["ORCHESTRATOR_DATABASE_URL"], autocommit=True) as conn:
        conn.execute(sql, params)


async def _called(ctx: ToolContext, tool: str, step: int) -> None:
    await asyncio.to_thread(
        _sink, "INSERT INTO public.upgrade_calls (run_id, tool, step, attempt, key, pid) "
        "VALUES (%s, %s, %s, %s, %s, %s)",
        (str(ctx.run_id), tool, step, ctx.attempt, ctx.idempotency_key, os.getpid()))


async def _apply(ctx: ToolContext, tool: str, step: int) -> dict[str, Any]:
    await asyncio.to_thread(
        _sink, "INSERT INTO public.upgrade_effects (key, run_id, tool, step, pid) "
        "VALUES (%s, %s, %s, %s, %s) ON CONFLICT (key) DO NOTHING",
        (ctx.idempotency_key, str(ctx.run_id), tool, step, os.getpid()))
    return receipt(tool, step, ctx.idempotency_key)


def receipt(tool: str, step: int, key: str) -> dict[str, Any]:
    """What a tool of this app returns for an effect applied under ``key``."""
    return {"tool": tool, "step": step, "key": key}


@app.tool()
async def record(ctx: ToolContext, *, step: int) -> dict[str, Any]:
    """A consequential effect."""
    await _called(ctx, "record", step)
    return await _apply(ctx, "record", step)


@app.tool(effect="idempotent")
async def slow(ctx: ToolContext, *, step: int) -> dict[str, Any]:
    """An idempotent effect that takes ``UPGRADE_TOOL_DELAY`` seconds to answer."""
    await _called(ctx, "slow", step)
    await asyncio.sleep(float(os.environ.get("UPGRADE_TOOL_DELAY", "0")))
    return await _apply(ctx, "slow", step)


@app.tool()
async def charge(ctx: ToolContext, *, step: int) -> dict[str, Any]:
    """A consequential effect the provider applies, whose answer is lost on the way back:
    the outcome is unknown (no lookup, so it waits for an operator)."""
    await _called(ctx, "charge", step)
    await _apply(ctx, "charge", step)
    raise ToolError.after_send("timeout")


@app.tool(retry=RetryPolicy(max_attempts=2, base_delay_ms=1, max_delay_ms=60_000))
async def flaky(ctx: ToolContext, *, step: int, backoff: float) -> dict[str, Any]:
    """Its first attempt never leaves (retryable), and the provider asks to come back in
    ``backoff`` seconds; the second one applies."""
    await _called(ctx, "flaky", step)
    if ctx.attempt == 1:
        raise ToolError.before_send("connection", retry_after=backoff)
    return await _apply(ctx, "flaky", step)


@app.workflow()
async def parked(ctx: WorkflowContext, data: Any) -> list[Any]:
    """Two calls, then it waits for the event ``go``, then one more call."""
    first = await ctx.call(record, step=1)
    second = await ctx.call(record, step=2)
    event = await ctx.wait_for_event("go", timeout=600)
    third = await ctx.call(record, step=3)
    return [first, second, event, third]


@app.workflow()
async def sleeper(ctx: WorkflowContext, data: Any) -> list[Any]:
    """A call, a durable sleep of ``data["sleep"]`` seconds, a call."""
    first = await ctx.call(record, step=1)
    await ctx.sleep(float(data["sleep"]))
    second = await ctx.call(record, step=2)
    return [first, second]


@app.workflow()
async def uncertain(ctx: WorkflowContext, data: Any) -> list[Any]:
    """A call, a call whose outcome is unknown (the run parks for reconciliation), a call."""
    first = await ctx.call(record, step=1)
    charged = await ctx.call(charge, step=2)
    third = await ctx.call(record, step=3)
    return [first, charged, third]


@app.workflow()
async def retried(ctx: WorkflowContext, data: Any) -> list[Any]:
    """A call, then a call retried after a durable back-off of ``data["backoff"]`` seconds."""
    first = await ctx.call(record, step=1)
    second = await ctx.call(flaky, step=2, backoff=float(data["backoff"]))
    return [first, second]


@app.workflow()
async def several_steps(ctx: WorkflowContext, data: Any) -> list[Any]:
    """Three calls; the second is idempotent and slow where ``UPGRADE_TOOL_DELAY`` is set."""
    return [await ctx.call(record, step=1), await ctx.call(slow, step=2),
            await ctx.call(record, step=3)]
