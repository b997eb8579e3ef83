"""The application that acceptance tests run in real worker processes.

Every tool call writes a row to ``public.sink_calls`` (the test's own table, outside the
orchestrator's schema) as soon as it starts, and effects go to ``public.sink_effects``, which
deduplicates by idempotency key like a provider would. Tests count what happened there.
``ACCEPTANCE_TOOL_DELAY`` makes the idempotent tool slow in the worker that has it set
(``ACCEPTANCE_THINK_DELAY``, the workflow code of ``thinks_then_calls``);
``ACCEPTANCE_RECEIPTS_RIDE=0`` gives that worker ``receipts_ride=False``.
``ACCEPTANCE_SPAN_FILE`` writes the process's spans to that file (tests/acceptance/spanfile.py)
and ``ACCEPTANCE_TRACE_PARENT`` sets ``trace_parent``.
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import psycopg

from orchestrator import (
    Committed,
    NotApplied,
    Orchestrator,
    Owner,
    RetryPolicy,
    ToolContext,
    WorkflowContext,
)
from tests.acceptance import spanfile

tracer_provider = spanfile.provider()
app = Orchestrator(default_owner=Owner(tenant="acceptance", principal="tests"),
                   lease_ttl=float(os.environ.get("ACCEPTANCE_LEASE_TTL", "2")),
                   operator_scopes={"outsider": ["another-tenant"]},
                   receipts_ride=os.environ.get("ACCEPTANCE_RECEIPTS_RIDE", "1") != "0",
                   tracer_provider=tracer_provider,
                   trace_parent=os.environ.get("ACCEPTANCE_TRACE_PARENT", "link"))

SINK_DDL = """
CREATE TABLE IF NOT EXISTS public.sink_calls (
    id bigserial PRIMARY KEY, run_id text NOT NULL, step int NOT NULL, key text NOT NULL,
    pid int NOT NULL, finished boolean NOT NULL DEFAULT false, at timestamptz DEFAULT now());
CREATE TABLE IF NOT EXISTS public.sink_effects (
    key text PRIMARY KEY, run_id text NOT NULL, step int NOT NULL, pid int NOT NULL);
"""


def _sink(sql: str, params: tuple[Any, ...]) -> Any:
    with psycopg.connect(os.environ["ORCHESTRATOR_DATABASE_URL"], autocommit=True) as conn:
        cur = conn.execute(sql, params)
        return cur.fetchone() if cur.description else None


async def _record_call(ctx: ToolContext, step: int) -> int:
    row = await asyncio.to_thread(
        _sink, "INSERT INTO public.sink_calls (run_id, step, key, pid) VALUES (%s, %s, %s, %s) "
        "RETURNING id", (str(ctx.run_id), step, ctx.idempotency_key, os.getpid()))
    return int(row[0])


async def _apply(ctx: ToolContext, step: int, call_id: int) -> dict[str, Any]:
    await asyncio.to_thread(
        _sink, "INSERT INTO public.sink_effects (key, run_id, step, pid) VALUES (%s, %s, %s, %s) "
        "ON CONFLICT (key) DO NOTHING", (ctx.idempotency_key, str(ctx.run_id), step, os.getpid()))
    await asyncio.to_thread(_sink, "UPDATE public.sink_calls SET finished = true WHERE id = %s",
                            (call_id,))
    return {"step": step, "key": ctx.idempotency_key}


@app.tool()
async def record(ctx: ToolContext, *, step: int) -> dict[str, Any]:
    """A consequential effect; every call is counted in sink_calls."""
    call_id = await _record_call(ctx, step)
    return await _apply(ctx, step, call_id)


@app.tool(effect="idempotent")
async def slow_idempotent(ctx: ToolContext, *, step: int) -> dict[str, Any]:
    call_id = await _record_call(ctx, step)
    await asyncio.sleep(float(os.environ.get("ACCEPTANCE_TOOL_DELAY", "0")))
    return await _apply(ctx, step, call_id)


@app.tool()
async def record_with_lookup(ctx: ToolContext, *, step: int) -> dict[str, Any]:
    """A consequential effect whose provider can be asked what it did with a key."""
    call_id = await _record_call(ctx, step)
    return await _apply(ctx, step, call_id)


@record_with_lookup.lookup
async def find_record(ctx: ToolContext, *, step: int) -> Committed | NotApplied:
    row = await asyncio.to_thread(
        _sink, "SELECT step FROM public.sink_effects WHERE key = %s", (ctx.idempotency_key,))
    if row is None:
        return NotApplied("no effect with this key")
    return Committed({"step": step, "key": ctx.idempotency_key})


@app.tool(retry=RetryPolicy(max_attempts=1, max_engine_resends=2))
async def crashes_its_worker(ctx: ToolContext, *, step: int) -> dict[str, Any]:
    """A consequential tool whose every call kills the worker before the provider applies it
    (a poison input): counted in sink_calls, never applied."""
    await _record_call(ctx, step)
    os.kill(os.getpid(), signal.SIGKILL)
    raise AssertionError("unreachable")


@crashes_its_worker.lookup
async def find_crash(ctx: ToolContext, *, step: int) -> NotApplied:
    return NotApplied("the provider never saw this key")


@app.tool(effect="idempotent")
async def record_idempotent(ctx: ToolContext, *, step: int) -> dict[str, Any]:
    call_id = await _record_call(ctx, step)
    return await _apply(ctx, step, call_id)


@app.tool(effect="idempotent")
async def stubborn(ctx: ToolContext, *, step: int) -> dict[str, Any]:
    """Takes ``ACCEPTANCE_TOOL_DELAY`` seconds and swallows every cancellation meanwhile (a
    tool that catches ``CancelledError`` and goes on)."""
    call_id = await _record_call(ctx, step)
    loop = asyncio.get_running_loop()
    ends = loop.time() + float(os.environ.get("ACCEPTANCE_TOOL_DELAY", "0"))
    while loop.time() < ends:
        try:
            await asyncio.sleep(ends - loop.time())
        except asyncio.CancelledError:
            pass
    return await _apply(ctx, step, call_id)


@app.tool()
async def record_gated(ctx: ToolContext, *, step: int) -> dict[str, Any]:
    """A consequential effect behind an authorisation stage (its intent is ``pending`` first)."""
    call_id = await _record_call(ctx, step)
    return await _apply(ctx, step, call_id)


@record_gated.authorize
async def allow(pctx: Any) -> bool:
    return True


@app.workflow()
async def one_call(ctx: WorkflowContext, data: Any) -> Any:
    return await ctx.call(data["tool"], step=1)


@app.workflow()
async def two_steps(ctx: WorkflowContext, data: Any) -> list[Any]:
    first = await ctx.call(record, step=1)
    second = await ctx.call(slow_idempotent, step=2)
    return [first, second]


@app.workflow()
async def three_steps(ctx: WorkflowContext, data: Any) -> list[Any]:
    return [await ctx.call(record, step=1), await ctx.call(slow_idempotent, step=2),
            await ctx.call(record, step=3)]


@app.workflow()
async def thinks_then_calls(ctx: WorkflowContext, data: Any) -> Any:
    """Busy in its own code, with no call in flight, for ``ACCEPTANCE_THINK_DELAY`` seconds in
    the worker that has it set; then one call."""
    await asyncio.sleep(float(os.environ.get("ACCEPTANCE_THINK_DELAY", "0")))
    return await ctx.call(record, step=1)


@app.workflow()
async def single(ctx: WorkflowContext, data: Any) -> Any:
    return await ctx.call(record, step=1)


@app.workflow()
async def logged(ctx: WorkflowContext, data: Any) -> Any:
    """Logs before and after one call (``ctx.log``: silent while it replays)."""
    ctx.log.info("step 1 begins")
    receipt = await ctx.call(slow_idempotent, step=1)
    ctx.log.info("step 1 done")
    return receipt


@app.workflow()
async def leaks(ctx: WorkflowContext, data: Any) -> Any:
    """Fails with an exception whose text is a secret (it must reach no log)."""
    raise KeyError(data["secret"])


@app.workflow()
async def reported(ctx: WorkflowContext, data: Any) -> list[Any]:
    """Publishes its progress around two calls; the second is idempotent, so a worker killed
    while it is sent does not stop the run (another worker sends it again, same key)."""
    ctx.publish({"step": 1, "of": 2})
    first = await ctx.call(record, step=1)
    ctx.publish({"step": 2, "of": 2})
    second = await ctx.call(record_idempotent, step=2)
    ctx.publish("both steps done", topic="milestones")
    return [first, second]


@app.workflow()
async def sleeps_and_waits(ctx: WorkflowContext, data: Any) -> list[Any]:
    """A call, a durable sleep, an external event, and a call after it: every way a run parks
    and is woken again."""
    first = await ctx.call(record, step=1)
    await ctx.sleep(float(data.get("sleep", 0.3)))
    event = await ctx.wait_for_event("go", timeout=60)
    second = await ctx.call(record_idempotent, step=2)
    return [first, event, second]
