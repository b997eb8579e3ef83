"""``ops show`` (``Operators.show``, the console's operation page and
``GET /api/operations/{id}``) reads an operation, its attempts, incidents, lookups, journal and
audit as of one moment: an operator who resolves it between those reads does not leave a
document that says both that it waits and that it was resolved. Two operators resolving one
operation at the same moment settle it once."""

from __future__ import annotations

import asyncio
from typing import Any

import psycopg
import pytest

from orchestrator.db import reconciliation as recon_db
from orchestrator.errors import ResolutionConflict
from tests.integration.conftest import running, wait_for


async def _parked(app, sql):  # type: ignore[no-untyped-def]
    """A run of ``app`` parked on one unknown ``charge``: its operation's id."""
    @app.tool()
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        raise ConnectionResetError("lost after sending")

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    async with running(app):
        await app.submit_async(pay, "o1")
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs")
                       == [{"status": "needs_reconciliation"}])
    (op,) = [r["operation_id"] for r in sql(
        "SELECT operation_id FROM orchestrator.reconciliation_items")]
    return op


async def test_ops_show_reads_the_operation_and_its_audit_in_one_snapshot(
        make_app, sql, monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    app = make_app()
    op = await _parked(app, sql)

    attempts = recon_db.operation_attempts
    resolved: list[str] = []

    async def attempts_then_resolved(conn: Any, *args: Any) -> Any:
        # another operator's resolution commits after the item was read, before the rest is
        rows = await attempts(conn, *args)
        if not resolved:
            resolved.append(await app.operators.abandon(
                op, evidence="refunded by hand", operator="bob"))
        return rows

    monkeypatch.setattr(recon_db, "operation_attempts", attempts_then_resolved)
    shown = await app.operators.show(op, operator="alice")
    assert resolved == ["resolved"]
    assert sql("SELECT state FROM orchestrator.reconciliation_items") == [
        {"state": "resolved"}]
    # as of the first read: waiting, and nothing after it
    assert (shown["item_state"], shown["resolution"]) == ("open", None)
    assert [a["state"] for a in shown["attempts"]] == ["unknown"]
    assert shown["audit"] == []
    assert [e["kind"] for e in shown["journal"]] == ["call.submitted", "call.unknown"]

    monkeypatch.setattr(recon_db, "operation_attempts", attempts)
    again = await app.operators.show(op, operator="alice")  # the next look sees it all
    assert (again["item_state"], again["resolution"]) == ("resolved", "abandoned")
    assert [a["action"] for a in again["audit"]] == ["resolve.abandoned"]
    assert [a["state"] for a in again["attempts"]] == ["abandoned"]
    await app.database.close()


@pytest.mark.parametrize(("theirs", "expected"), [
    ("abandon", ["resolved", "RESOLUTION_CONFLICT"]),
    ("not_applied", ["resolved", "noop"]),
])
async def test_two_operators_resolving_one_operation_at_once_settle_it_once(
        make_app, sql, migrated_database_url, theirs, expected):  # type: ignore[no-untyped-def]
    """Two operators send a resolution of the same operation at the same moment (both wait on
    its row, held by a third transaction, and go on together): one settles it, the other gets
    ``RESOLUTION_CONFLICT`` (another resolution) or ``noop`` (the same one, audited as such);
    the run's journal records one resolution."""
    app = make_app()
    op = await _parked(app, sql)

    async def resolve(operator: str, how: str) -> str:
        try:
            if how == "abandon":
                return await app.operators.abandon(op, evidence="gave up", operator=operator)
            return await app.operators.resolve_not_applied(op, evidence="PSP shows none",
                                                           operator=operator, then="fail")
        except ResolutionConflict as exc:
            return exc.code

    def blocked() -> int:
        return int(sql("SELECT count(*) AS n FROM pg_stat_activity WHERE datname = "
                       "current_database() AND wait_event_type = 'Lock'")[0]["n"])

    with psycopg.connect(migrated_database_url) as holder:
        holder.execute("SELECT 1 FROM orchestrator.reconciliation_items WHERE operation_id = %s "
                       "FOR UPDATE", (op,))
        tasks = [asyncio.create_task(resolve("alice", "not_applied")),
                 asyncio.create_task(resolve("bob", theirs))]
        await wait_for(lambda: blocked() == 2)
        holder.rollback()
        answers = await asyncio.gather(*tasks)
    assert sorted(answers, key=expected.index) == expected
    journal = [e["kind"] for e in sql("SELECT kind FROM orchestrator.journal ORDER BY seq")]
    assert journal.count("call.not_applied") + journal.count("call.abandoned") == 1, journal
    actions = sorted(a["action"] for a in sql("SELECT action FROM orchestrator.operator_audit"))
    if theirs == "abandon":  # the loser wrote nothing
        assert actions in (["resolve.abandoned"], ["resolve.not_applied"]), actions
    else:  # the second one found it so already: audited as a no-op
        assert actions == ["resolve.not_applied", "resolve.not_applied.noop"], actions
    await app.database.close()
