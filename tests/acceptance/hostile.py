"""The application of the hostile-input tests: workflows that hand values through tools and
across a restart, so that a value that changed type or order on its way through the database
shows as ``NONDETERMINISM``.

``echo`` returns ``json.loads(text)``: the test passes the value it wants a tool to return as
JSON text (a string, which survives any storage), so the tool returns exactly the Python value
the test made, floats and key order included. ``fingerprint`` renders a value with every type
and every key order visible; the workflow passes it to ``note``, whose intent digest then
covers it: if a replay saw a different value, its ``note`` call would not match the journal.
"""

from __future__ import annotations

import asyncio
import json
import math
from datetime import timedelta
from typing import Any

from orchestrator import (
    Orchestrator,
    Owner,
    ToolContext,
    ToolError,
    WorkflowContext,
    WorkflowError,
)

OWNER = Owner(tenant="hostile", principal="probe")
app = Orchestrator(default_owner=OWNER, lease_ttl=2.0)


def fingerprint(value: Any) -> str:
    """A text that differs whenever two values differ in type, value, sign or key order."""
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(k)}:{fingerprint(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list):
        return "[" + ",".join(fingerprint(v) for v in value) + "]"
    if type(value) is float:
        return f"f{value!r}{'-' if math.copysign(1.0, value) < 0 else ''}"
    return f"{type(value).__name__}:{value!r}"


@app.tool()
async def echo(ctx: ToolContext, *, text: str) -> Any:
    return json.loads(text)


@app.tool()
async def note(ctx: ToolContext, *, seen: str, again: Any) -> dict[str, Any]:
    return {"seen": seen}


@app.tool()
async def uncertain(ctx: ToolContext) -> Any:
    """Sent, outcome unknown: every call goes to the reconciliation queue."""
    raise ToolError.after_send("timeout")


@app.tool()
async def hangs(ctx: ToolContext) -> Any:
    """Sent, and no answer for a minute: the test kills the worker meanwhile."""
    await asyncio.sleep(60)
    return None


@app.workflow()
async def hanging(ctx: WorkflowContext, data: Any) -> Any:
    return await ctx.call(hangs)


@app.workflow()
async def stuck(ctx: WorkflowContext, data: Any) -> Any:
    """Waits on an unknown operation until an operator settles it."""
    return await ctx.call(uncertain)


@app.workflow()
async def round_trip(ctx: WorkflowContext, data: dict[str, Any]) -> dict[str, Any]:
    """Each value through a tool; its fingerprint and the value itself into the next call; a
    durable wait (the test restarts the worker there); then the same again on replay."""
    seen = []
    for text in data["texts"]:
        value = await ctx.call(echo, text=text)
        seen.append(fingerprint(value))
        await ctx.call(note, seen=seen[-1], again=value)
    await ctx.wait_for_event("go", timeout=timedelta(minutes=5))
    for index, text in enumerate(data["texts"]):
        value = await ctx.call(echo, text=text)  # live again, after the restart
        if fingerprint(value) != seen[index]:
            raise WorkflowError(f"value {index} differs between a replay and a live call")
        await ctx.call(note, seen=seen[index], again=value)
    return {"seen": seen}


@app.workflow()
async def plain(ctx: WorkflowContext, data: Any) -> Any:
    """Accepted input goes through a tool and back; ends at once."""
    return await ctx.call(echo, text=json.dumps(data))


@app.workflow()
async def waits(ctx: WorkflowContext, data: Any) -> Any:
    """Waits a little for an event (hostile senders may deliver one), then ends either way."""
    try:
        return await ctx.wait_for_event("poke", timeout=timedelta(seconds=1))
    except Exception:  # noqa: BLE001 - a timeout ends the run too
        return None
