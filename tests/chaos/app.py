"""The application the chaos harness runs in real worker and reconciler processes.

Tools (every call lands in the harness's sink, see :mod:`tests.chaos.sink`):

========  =============  ======  ============  =========================================
tool      effect         lookup  max attempts  models
========  =============  ======  ============  =========================================
pay       consequential  yes     3             a charge at a provider you can ask
ship      consequential  no      2             a shipment only a human can check
notify    idempotent     yes     3             a provider that deduplicates by key
index     idempotent     no      4             the same, without a way to ask
fetch     read           no      3             a read: changes nothing
========  =============  ======  ============  =========================================

Each call carries a ``fault`` the harness planned (from its seed) for the first ``n``
attempts: ``transient`` (raise a not-applied, retryable error), ``hang`` (never answer: the
gateway's timeout fires, nothing applied), ``late`` (apply, then hang past the timeout),
``error_after`` (apply, then raise as a dropped connection would), ``error_before`` (raise
without applying; the gateway cannot know), ``resend_busy`` (attempt 1 goes through, attempts 2
to ``n`` get a not-applied "busy" answer: what a re-send after a crash may meet). Workflows are
one small interpreter over a list of steps chosen by the harness: calls, durable sleeps, events,
child runs and concurrent calls.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable
from datetime import timedelta
from typing import Any

from orchestrator import (
    Committed,
    NotApplied,
    Orchestrator,
    Owner,
    RunFailed,
    StillUnknown,
    ToolContext,
    ToolError,
    ToolFailed,
    WorkflowContext,
    faults,
)
from tests.chaos import sink

# The self-test's guard switch: only this test application turns it on, from the variable the
# harness sets for the workers it starts with the switch.
if os.environ.get("ORCHESTRATOR_TEST_UNSAFE_REDISPATCH") == "1":
    faults.UNSAFE_REDISPATCH = True

OWNER = Owner(tenant="chaos", principal="harness")
TOOL_TIMEOUT = timedelta(seconds=float(os.environ.get("CHAOS_TOOL_TIMEOUT", "2")))
HANG_SECONDS = TOOL_TIMEOUT.total_seconds() * 3
FAULTS = ("none", "transient", "hang", "late", "error_after", "error_before", "resend_busy")
UNCERTAIN_FAULTS = ("hang", "late", "error_after", "error_before")

app = Orchestrator(default_owner=OWNER,
                   lease_ttl=float(os.environ.get("CHAOS_LEASE_TTL", "3")))


async def _provider(ctx: ToolContext, tool: str, effect: str, step: str, fault: str,
                    n: int) -> dict[str, Any]:
    if fault == "resend_busy":  # the first attempt goes through; re-sends meet a busy provider
        planned = "transient" if 2 <= ctx.attempt <= n else "none"
    else:
        planned = fault if ctx.attempt <= n else "none"
    call_id = await sink.record_call(tool=tool, effect=effect, run_id=ctx.run_id,
                                     position=ctx.position, attempt=ctx.attempt,
                                     op_id=ctx.operation_id, key=ctx.idempotency_key,
                                     fault=planned)
    if planned == "transient":
        await sink.finish_call(call_id, "not_applied")
        raise ToolError("the provider is busy; nothing was applied", applied=False,
                        retryable=True)
    if planned == "error_before":
        await sink.finish_call(call_id, "error_before")
        raise ConnectionResetError("connection reset before the request was sent")
    if planned == "hang":
        await sink.finish_call(call_id, "hang")
        await asyncio.sleep(HANG_SECONDS)
    if effect == "read":
        await sink.finish_call(call_id, "ok")
        return {"tool": tool, "key": ctx.idempotency_key, "read": step}
    try:
        result, deduplicated = await sink.apply(
            call_id=call_id, tool=tool, effect=effect, run_id=ctx.run_id,
            position=ctx.position, attempt=ctx.attempt, op_id=ctx.operation_id,
            key=ctx.idempotency_key)
    except sink.Refused:
        await sink.finish_call(call_id, "refused")
        raise ToolError("the provider refused a voided key", applied=False,
                        retryable=False) from None
    if planned == "late":
        await sink.finish_call(call_id, "late")
        await asyncio.sleep(HANG_SECONDS)
    if planned == "error_after":
        await sink.finish_call(call_id, "error_after")
        raise ConnectionResetError("connection reset after the request was applied")
    await sink.finish_call(call_id, "deduplicated" if deduplicated else "ok")
    return result


async def _lookup(ctx: ToolContext, tool: str) -> Committed | NotApplied | StillUnknown:
    answer, found = await sink.lookup(tool=tool, key=ctx.idempotency_key,
                                      op_id=ctx.operation_id)
    if answer == "committed":
        return Committed(found)
    if answer == "not_applied":
        return NotApplied(f"no effect with key {ctx.idempotency_key}; the key is voided")
    return StillUnknown("a request with this key may still be in flight")


@app.tool(effect="consequential", timeout=TOOL_TIMEOUT, max_attempts=3)
async def pay(ctx: ToolContext, *, step: str, fault: str = "none", n: int = 1) -> Any:
    return await _provider(ctx, "pay", "consequential", step, fault, n)


@pay.lookup
async def find_payment(ctx: ToolContext, *, step: str, fault: str = "none", n: int = 1) -> Any:
    return await _lookup(ctx, "pay")


@app.tool(effect="consequential", timeout=TOOL_TIMEOUT, max_attempts=2)
async def ship(ctx: ToolContext, *, step: str, fault: str = "none", n: int = 1) -> Any:
    return await _provider(ctx, "ship", "consequential", step, fault, n)


@app.tool(effect="idempotent", timeout=TOOL_TIMEOUT, max_attempts=3)
async def notify(ctx: ToolContext, *, step: str, fault: str = "none", n: int = 1) -> Any:
    return await _provider(ctx, "notify", "idempotent", step, fault, n)


@notify.lookup
async def find_notification(ctx: ToolContext, *, step: str, fault: str = "none",
                            n: int = 1) -> Any:
    return await _lookup(ctx, "notify")


@app.tool(effect="idempotent", timeout=TOOL_TIMEOUT, max_attempts=4)
async def index(ctx: ToolContext, *, step: str, fault: str = "none", n: int = 1) -> Any:
    return await _provider(ctx, "index", "idempotent", step, fault, n)


@app.tool(effect="read", timeout=TOOL_TIMEOUT, max_attempts=3)
async def fetch(ctx: ToolContext, *, step: str, fault: str = "none", n: int = 1) -> Any:
    return await _provider(ctx, "fetch", "read", step, fault, n)


TOOLS = {"pay": pay, "ship": ship, "notify": notify, "index": index, "fetch": fetch}


# -- workflows --------------------------------------------------------------------------------


async def _guard(command: Awaitable[Any], label: str) -> Any:
    try:
        return await command
    except ToolFailed:
        return {"failed": label}
    except RunFailed as exc:
        return {"child_failed": exc.code}


def _command(ctx: WorkflowContext, step: dict[str, Any]) -> Awaitable[Any]:
    """The step's command, issued now (its journal position is taken here)."""
    if "call" in step:
        tool = TOOLS[step["call"]]
        return _guard(ctx.call(tool, step=step["id"], fault=step.get("fault", "none"),
                               n=step.get("n", 1)), step["id"])
    if "child" in step:
        return _guard(ctx.run_child(child, {"steps": step["child"]}), step["id"])
    raise ValueError(f"not a concurrent step: {step}")


async def _interpret(ctx: WorkflowContext, steps: list[dict[str, Any]]) -> list[Any]:
    results: list[Any] = []
    # Progress into the run's stream after each step: replayed, never published twice (a
    # changed value would fail the run with NONDETERMINISM, which the checks count). An
    # older engine pinned with --engine has no publish.
    publish = getattr(ctx, "publish", None)
    for number, step in enumerate(steps):
        if publish is not None and number:
            publish({"done": number, "of": len(steps)}, topic="progress")
        if "sleep" in step:
            await ctx.sleep(timedelta(seconds=step["sleep"]))
            results.append("slept")
        elif "event" in step:
            try:
                got = await ctx.wait_for_event(step["event"],
                                               timeout=timedelta(seconds=step["timeout"]))
                results.append({"event": got})
            except TimeoutError:
                results.append({"timeout": step["event"]})
        elif "gather" in step:
            results.append(await ctx.gather(*[_command(ctx, s) for s in step["gather"]]))
        else:
            results.append(await _command(ctx, step))
    return results


@app.workflow()
async def checkout(ctx: WorkflowContext, data: dict[str, Any]) -> list[Any]:
    return await _interpret(ctx, data["steps"])


@app.workflow()
async def approval(ctx: WorkflowContext, data: dict[str, Any]) -> list[Any]:
    return await _interpret(ctx, data["steps"])


@app.workflow()
async def fanout(ctx: WorkflowContext, data: dict[str, Any]) -> list[Any]:
    return await _interpret(ctx, data["steps"])


@app.workflow()
async def parent(ctx: WorkflowContext, data: dict[str, Any]) -> list[Any]:
    return await _interpret(ctx, data["steps"])


@app.workflow()
async def retrying(ctx: WorkflowContext, data: dict[str, Any]) -> list[Any]:
    return await _interpret(ctx, data["steps"])


@app.workflow()
async def child(ctx: WorkflowContext, data: dict[str, Any]) -> list[Any]:
    return await _interpret(ctx, data["steps"])


@app.workflow()
async def looping(ctx: WorkflowContext, data: dict[str, Any]) -> list[Any]:
    """Its first step says how many generations it runs: each runs the other steps, then the
    run continues as a new one (``ctx.continue_as_new``; an older engine pinned with --engine
    has none: one generation)."""
    plan, *steps = data["steps"]
    results = await _interpret(ctx, steps)
    generation = data.get("generation", 0) + 1
    go_on = getattr(ctx, "continue_as_new", None)
    if go_on is not None and generation < plan["generations"]:
        go_on({**data, "generation": generation})
    return results


WORKFLOWS = {"checkout": checkout, "approval": approval, "fanout": fanout, "parent": parent,
             "retrying": retrying, "looping": looping}
