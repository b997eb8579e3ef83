"""Every journal kind is defined once (``orchestrator.journal``): an entry of each kind written
through each path that can write it reads back, through the replay index, exactly as defined.

The paths: the general fenced append (``journal_append``, which every kind can take), and the
set-based statements that build an entry in SQL (a call's write-ahead with a riding receipt, a
lone receipt, the fast success, the cancellation of an idle run), driven here by a real worker,
and an operator's resolutions."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from orchestrator import ToolError
from orchestrator.db import journal as journal_db
from orchestrator.journal import (
    PAYLOAD_FIELDS,
    SCHEMA_VERSION,
    EventKind,
    JournalIndex,
    check_payload,
    entry,
)
from tests.integration.conftest import running, wait_for

SAMPLES: dict[str, Any] = {
    "tool_version": "1", "intent": "d" * 64, "attempt": 2, "op": 7, "key": "k:1:2",
    "effect": "consequential", "result": {"id": "ch_1", "amount": 1.5, "tags": ["a"]},
    "resolved": True, "resolved_by": "alice", "cause": "timeout", "reason": "budget",
    "incident": "inc_0123456789abcdef", "stage": "approve", "why": "deadline",
    "delay_ms": 250, "not_before": "2026-12-01T00:00:00+00:00", "next": "reconcile",
    "until": "2026-12-01T00:00:01+00:00", "timeout_at": None, "payload": {"ok": True},
    "event_id": 3, "value": 0.25, "run_id": str(uuid.UUID(int=1)), "version": "2",
    "code": "WORKFLOW_FAILED", "message": "the workflow failed", "resend": "lost",
    "then": "resend", "retry_after": {"given": None, "wait_ms": 60000, "max_delay_ms": 30000},
}


def _full(kind: EventKind) -> dict[str, Any]:
    required, optional = PAYLOAD_FIELDS[kind]
    return {field: SAMPLES[field] for field in (*required, *optional)}


def test_every_kind_has_a_definition() -> None:
    assert set(PAYLOAD_FIELDS) == set(EventKind)
    for kind in EventKind:
        check_payload(kind, _full(kind))
        with pytest.raises(ValueError):
            check_payload(kind, {**_full(kind), "unexpected": 1})


async def test_every_kind_reads_back_through_the_general_append(app, sql) -> None:  # type: ignore[no-untyped-def]
    @app.workflow()
    async def holder(ctx, data):  # type: ignore[no-untyped-def]
        return None

    handle = await app.submit_async(holder, {})
    token = 99
    sql("UPDATE orchestrator.runs SET status = 'running', lease_token = %s, lease_owner = 'w', "
        "lease_expires_at = now() + interval '1 hour' WHERE id = %s", (token, handle.id))
    written = [entry(kind, None if kind.startswith("run.") else 0, "name", _full(kind))
               for kind in EventKind]
    async with app.database.connection() as conn:
        await journal_db.journal_append(conn, run_id=handle.id, token=token, expected=0,
                                     events=written)
        read = await journal_db.journal_read(conn, handle.id)
    index = JournalIndex(read)
    back = index.by_position[0] + index.run_events
    assert sorted((e["kind"], e["payload"]) for e in back) == sorted(
        (e["kind"], e["payload"]) for e in written)
    assert all(e["schema_version"] == SCHEMA_VERSION for e in read)


async def test_the_paths_that_build_entries_in_sql_write_them_as_defined(app, sql) -> None:  # type: ignore[no-untyped-def]
    @app.tool(effect="consequential")
    async def charge(ctx, *, cents):  # type: ignore[no-untyped-def]
        if cents == 0:
            raise ToolError.after_send("timeout")
        return {"charged": cents}

    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.call(charge, cents=1)  # write-ahead (fast)
        await ctx.call(charge, cents=2)  # write-ahead carrying the first receipt (fast)
        if data.get("unknown"):
            await ctx.call(charge, cents=0)  # outcome unknown: an operator resolves it
        return "paid"  # the fast success, carrying the second receipt

    @app.workflow()
    async def idle(ctx, data):  # type: ignore[no-untyped-def]
        return None

    async with running(app):
        fast = await app.submit_async(pay, {})
        unknown = await app.submit_async(pay, {"unknown": True})
        assert await fast.result_async(timeout=20) == "paid"
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.reconciliation_items"))
    cancelled = await app.submit_async(idle, {})
    await cancelled.cancel_async()  # idle: cancelled in one statement that writes its entry
    op = sql("SELECT operation_id FROM orchestrator.reconciliation_items")[0]["operation_id"]
    await app.operators.resolve_committed(op, receipt={"charged": 0},
                                          evidence="provider says charged", operator="alice")

    seen: set[str] = set()
    for run in (fast, unknown, cancelled):
        async with app.database.connection() as conn:
            read = await journal_db.journal_read(conn, run.id)
        JournalIndex(read)  # reads back through the replay index
        for e in read:
            check_payload(EventKind(e["kind"]), e["payload"])
            seen.add(e["kind"])
    assert {EventKind.CALL_SUBMITTED, EventKind.CALL_COMPLETED, EventKind.CALL_UNKNOWN,
            EventKind.RUN_COMPLETED, EventKind.RUN_CANCELLED} <= seen
    completed = [e for e in sql("SELECT kind, payload FROM orchestrator.journal "
                                "WHERE run_id = %s ORDER BY seq", (fast.id,))
                 if e["kind"] == "call.completed"]
    assert [e["payload"]["result"] for e in completed] == [{"charged": 1}, {"charged": 2}]
