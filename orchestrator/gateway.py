"""The effect gateway: every tool call is an operation in the ledger (CONTRACT C5).

The path of one attempt::

    submitted committed (write-ahead, fenced) ─► tool called ─► receipt committed (fenced)
                                                            └─► failed (proved not applied)
                                                            └─► unknown ─► reconciliation

A replayed call returns what the journal recorded and never calls the tool. A call found
``submitted`` without an outcome (its worker died) is never sent again unless its effect class
allows: ``idempotent`` tools are re-sent with the same idempotency key, ``read`` tools as a new
attempt, ``consequential`` tools go to reconciliation.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from typing import TYPE_CHECKING, Any

from orchestrator import canonical, faults
from orchestrator.context import ToolContext
from orchestrator.db import operations as ops_db
from orchestrator.db.database import Conn
from orchestrator.db.events import incident_record
from orchestrator.errors import InvalidRequest, LeaseLost, ToolError, ToolFailed, new_incident_ref
from orchestrator.registry import Tool
from orchestrator.replay import Nondeterminism

if TYPE_CHECKING:
    from orchestrator.executor import Event, RunExecutor


def next_step_after_uncertain(effect: str, attempts: int, max_attempts: int) -> str:
    """What may follow an attempt whose outcome is unknown (CONTRACT C5). Pure.

    Returns ``"resend"`` (same idempotency key), ``"new_attempt"`` or ``"reconcile"``.
    """
    if faults.UNSAFE_REDISPATCH and effect == "consequential":
        return "new_attempt"  # the guard disabled on purpose by the chaos suite's self-test
    if attempts >= max_attempts or effect == "consequential":
        return "reconcile"
    return "resend" if effect == "idempotent" else "new_attempt"


async def call_tool(ex: RunExecutor, position: int, tool: Tool, arguments: dict[str, Any]) -> Any:
    from orchestrator.executor import Wait

    args_text = canonical.canonical_bytes(
        arguments, path="$.arguments", max_bytes=ex.app.max_record_bytes).decode()
    intent = canonical.intent_digest(tool.name, tool.version, ex.owner.as_dict(), arguments)
    recorded = ex.index.expect(position, "call", tool.name)
    attempt, key = 1, None
    if recorded:
        if recorded[0]["payload"]["intent"] != intent:
            raise Nondeterminism(
                f"position {position}: tool {tool.name!r} was recorded with other arguments "
                "(intent digest differs)")
        last = recorded[-1]
        payload = last["payload"]
        if last["kind"] == "call.completed":
            return payload["result"]
        if last["kind"] == "call.failed":
            raise ToolFailed(f"tool {tool.name} failed", tool=tool.name,
                             incident=payload.get("incident"))
        submitted = ex.index.last(position, ("call.submitted",))
        assert submitted is not None
        attempt = submitted["payload"]["attempt"]
        op_id = submitted["payload"]["op"]
        if last["kind"] in ("call.not_applied", "call.retrying"):
            if attempt >= tool.max_attempts:
                raise ToolFailed(f"tool {tool.name} was not applied", tool=tool.name)
            attempt += 1
        elif last["kind"] == "call.unknown":
            step = payload.get("next", "reconcile")
            if step == "reconcile":
                await ex.park(Wait("blocked", position, operation_id=op_id))
            key = submitted["payload"]["key"] if step == "resend" else None
            attempt += 1
        else:  # call.submitted without an outcome: the worker that sent it is gone
            step = next_step_after_uncertain(tool.effect, attempt, tool.max_attempts)
            await _record_unknown(ex, position, tool, op_id, "WORKER_LOST", step)
            if step == "reconcile":
                await ex.park(Wait("blocked", position, operation_id=op_id))
            key = submitted["payload"]["key"] if step == "resend" else None
            attempt += 1
    while True:
        outcome = await _attempt(ex, position, tool, arguments, args_text, intent, attempt, key)
        kind, value, op_id = outcome
        if kind == "committed":
            return value
        if kind == "failed":
            raise value
        if kind == "retry":
            attempt, key = attempt + 1, None
            continue
        step = next_step_after_uncertain(tool.effect, attempt, tool.max_attempts)
        await _record_unknown(ex, position, tool, op_id, value, step)
        if step == "reconcile":
            await ex.park(Wait("blocked", position, operation_id=op_id))
        key = (key or _key(ex, position, attempt)) if step == "resend" else None
        attempt += 1


def _key(ex: RunExecutor, position: int, attempt: int) -> str:
    return f"{ex.run_id}:{position}:{attempt}"


async def _attempt(ex: RunExecutor, position: int, tool: Tool, arguments: dict[str, Any],
                   args_text: str, intent: str, attempt: int, key: str | None
                   ) -> tuple[str, Any, int]:
    """One dispatch. Returns (committed, receipt) | (failed, error) | (retry, None) |
    (unknown, reason), each with the operation id."""
    from orchestrator.executor import Stop, event

    ex.boundary()
    key = key or _key(ex, position, attempt)
    row = {
        "run_id": ex.run_id, "position": position, "attempt": attempt,
        "tool_name": tool.name, "tool_version": tool.version, "effect_class": tool.effect,
        "tenant": ex.owner.tenant, "principal": ex.owner.principal, "intent_digest": intent,
        "arguments": args_text, "idempotency_key": key, "worker_id": ex.worker.worker_id,
        "token": ex.token,
    }

    async def submit(conn: Conn) -> tuple[int, list[Event]]:
        try:
            op_id = await ops_db.operation_submit(conn, row)
        except ops_db.OperationIdentityReused as exc:
            raise Nondeterminism(str(exc)) from None
        return op_id, [event("call.submitted", position, tool.name, {
            "tool_version": tool.version, "intent": intent, "attempt": attempt, "op": op_id,
            "key": key, "effect": tool.effect})]

    op_id = await ex.write(submit)
    assert op_id is not None
    ex.worker.metrics.incr("operations_dispatched")
    if attempt > 1:
        ex.worker.metrics.incr("operations_retried")
    faults.reach("after_intent", tool.name)
    faults.reach("after_submitted", tool.name)

    tctx = ToolContext(idempotency_key=key, run_id=ex.run_id, position=position,
                       attempt=attempt, operation_id=op_id, owner=ex.owner,
                       deadline=ex.deadline_at)
    timeout = tool.timeout.total_seconds() if tool.timeout is not None else None
    remaining = ex.remaining()
    if remaining is not None:
        timeout = remaining if timeout is None else min(timeout, remaining)
    task = asyncio.ensure_future(tool.fn(tctx, **arguments))
    try:
        try:
            receipt = await asyncio.wait_for(asyncio.shield(task), timeout)
        except TimeoutError:
            if not task.done():  # our timeout, not one the tool raised: signal, then cancel
                tctx.cancelled.set()
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            raise
    except ToolError as exc:
        ref = await _incident(ex, op_id, "tool", exc)
        if exc.applied is False:
            if exc.retryable and attempt < tool.max_attempts:
                await _fail_op(ex, position, tool, op_id, ref, not_applied=True)
                return "retry", None, op_id
            await _fail_op(ex, position, tool, op_id, ref)
            return "failed", ToolFailed(f"tool {tool.name} failed", tool=tool.name,
                                        incident=ref), op_id
        return "unknown", "TOOL_OUTCOME_UNCERTAIN", op_id
    except TimeoutError as exc:
        await _incident(ex, op_id, "timeout", exc)
        return "unknown", "TOOL_OUTCOME_UNCERTAIN", op_id
    except Exception as exc:
        await _incident(ex, op_id, "tool", exc)
        return "unknown", "TOOL_OUTCOME_UNCERTAIN", op_id
    faults.reach("after_tool_return", tool.name)
    try:
        receipt_text = canonical.canonical_bytes(
            receipt, path="$.receipt", max_bytes=ex.app.max_record_bytes).decode()
    except InvalidRequest as exc:
        await _incident(ex, op_id, "receipt", exc)
        return "unknown", "INVALID_RECEIPT", op_id
    digest = canonical.digest(receipt)

    async def commit(conn: Conn) -> tuple[None, list[Event]]:
        await ops_db.operation_commit(conn, op_id=op_id, token=ex.token, receipt=receipt_text,
                                      receipt_digest=digest)
        await ops_db.operation_settle_resent(conn, run_id=ex.run_id, position=position,
                                             key=key, receipt=receipt_text, receipt_digest=digest)
        return None, [event("call.completed", position, tool.name,
                            {"result": receipt, "op": op_id})]

    try:
        await ex.write(commit)
    except Stop:
        # The lease is gone: this receipt is not the outcome, but it is evidence (C8).
        evidence = json.dumps({"kind": "late_receipt", "worker": ex.worker.worker_id,
                               "receipt": receipt, "receipt_digest": digest})
        async with ex.db.connection() as conn:
            await ops_db.operation_attach_evidence(conn, op_id=op_id, evidence=evidence)
        raise
    faults.reach("after_receipt", tool.name)
    return "committed", receipt, op_id


async def _fail_op(ex: RunExecutor, position: int, tool: Tool, op_id: int, ref: str,
                   *, not_applied: bool = False) -> None:
    from orchestrator.executor import event

    error = json.dumps({"code": "TOOL_FAILED", "incident": ref, "not_applied": True})

    async def fail(conn: Conn) -> tuple[None, list[Event]]:
        await ops_db.operation_fail(conn, op_id=op_id, token=ex.token, error=error)
        kind = "call.retrying" if not_applied else "call.failed"
        return None, [event(kind, position, tool.name, {"op": op_id, "incident": ref})]

    await ex.write(fail)


async def _record_unknown(ex: RunExecutor, position: int, tool: Tool, op_id: int, reason: str,
                          step: str) -> None:
    """Mark an attempt unknown; enqueue it for reconciliation unless it will be re-sent."""
    from orchestrator.executor import event

    async def mark(conn: Conn) -> tuple[None, list[Event]]:
        if step == "reconcile":
            await ops_db.operation_mark_unknown(conn, op_id=op_id, token=ex.token, reason=reason)
        else:
            await ops_db.operation_mark_unknown(conn, op_id=op_id, token=ex.token, reason=reason,
                                                enqueue=False, settle_read=step == "new_attempt")
        return None, [event("call.unknown", position, tool.name,
                            {"op": op_id, "reason": reason, "next": step})]

    await ex.write(mark)
    ex.worker.metrics.incr("unknown_outcomes")


async def _incident(ex: RunExecutor, op_id: int, phase: str, exc: BaseException) -> str:
    """Keep what went wrong in protected diagnostics; return the incident reference."""
    ref = new_incident_ref()
    detail = {"type": type(exc).__name__, "message": str(exc)[:10000]}
    status = getattr(exc, "status", None)
    try:
        async with ex.db.connection() as conn:
            await incident_record(conn, {
                "ref": ref, "code": "TOOL_ERROR", "run_id": ex.run_id, "operation_id": op_id,
                "phase": phase, "cause": type(exc).__name__,
                "upstream_status": status if isinstance(status, int) else None,
                "detail": json.dumps(detail)})
    except LeaseLost:  # pragma: no cover - incidents are not fenced
        pass
    return ref
