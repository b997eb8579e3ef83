"""A resolution (``reconcile.resolve``: ``ops resolve``, ``ops resolve-many``, the reconciler)
takes its locks in an order that agrees with every other writer of a run and its operations:
the run's row first, then the operation and its queue item, and those only when no worker
holds the run. Each test forces the interleaving that would deadlock if the orders disagreed
(a third connection holds a row until both sides wait on it) and then checks that PostgreSQL
found no deadlock: the storage layer retries one silently, so a retry counted by the
database's ``database_retries`` is one found."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import psycopg
import pytest

from orchestrator import reconcile
from orchestrator.db import journal as journal_db
from orchestrator.db import operations as ops_db
from orchestrator.db import runs as runs_db
from orchestrator.errors import OrchestratorError, ResolutionConflict
from orchestrator.recovery import RetryPolicy
from tests.integration.conftest import running, wait_for

LATE = json.dumps({"kind": "late_receipt", "worker": "w0", "receipt": {"ok": 1},
                   "receipt_digest": "d"})
"""The evidence a worker that lost its lease keeps of a receipt that came too late."""


def _waiting(sql):  # type: ignore[no-untyped-def]
    """How many of the test database's sessions wait for a lock."""
    return int(sql("SELECT count(*) AS n FROM pg_stat_activity WHERE datname = "
                   "current_database() AND wait_event_type = 'Lock'")[0]["n"])


def _retries(app) -> int:  # type: ignore[no-untyped-def]
    return app.database.metrics.snapshot()["database_retries"]


async def _answer(work: Any) -> str:
    try:
        return str(await work)
    except OrchestratorError as exc:
        return exc.code


async def _parked(app, sql, runs=1):  # type: ignore[no-untyped-def]
    """``runs`` runs of ``app``, each parked on one unknown ``charge``: their operations'
    ids, oldest first, and the runs' ids in the same order."""
    @app.tool()
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        raise ConnectionResetError("lost after sending")

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    async with running(app):
        for n in range(runs):
            await app.submit_async(pay, f"o{n}")
        await wait_for(lambda: sql("SELECT DISTINCT status FROM orchestrator.runs")
                       == [{"status": "needs_reconciliation"}]
                       and len(sql("SELECT id FROM orchestrator.reconciliation_items")) == runs)
    rows = sql("SELECT operation_id, run_id FROM orchestrator.reconciliation_items ORDER BY id")
    return [r["operation_id"] for r in rows], [r["run_id"] for r in rows]


async def test_a_resolution_while_a_worker_marks_the_operation_unknown_does_not_deadlock(
        app, sql, migrated_database_url):  # type: ignore[no-untyped-def]
    """A worker that lost its lease kept a late receipt as evidence (the operation is queued
    while still ``submitted``); the run's next holder marks it unknown, in the general path's
    order: the operation, its queue item, then the run's fence. An operator resolving it at
    that moment waits for neither: the run is running, so the answer is
    ``OPERATION_IN_PROGRESS`` and the worker's write lands."""
    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return 1

    run = await app.submit_async(wf, {})
    async with app.database.connection() as conn:
        (claim,) = await runs_db.run_claim_ready(conn, worker="w1", workflows=["wf@1"],
                                                 limit=1, ttl=60)
        token = claim["lease_token"]
        op, _ = await ops_db.operation_begin(conn, {
            "run_id": run.id, "position": 0, "attempt": 1, "tool_name": "charge",
            "tool_version": "1", "effect_class": "consequential", "tenant": "acme",
            "principal": "alice", "intent_digest": "a" * 64, "arguments": "{}",
            "idempotency_key": "k", "worker_id": "w1", "token": token}, pending=False)
        await ops_db.operation_attach_evidence(conn, op_id=op, evidence=LATE)

    async def worker_write() -> None:
        async with app.database.connection() as conn, conn.transaction():
            await ops_db.operation_mark_unknown(conn, run_id=run.id, op_id=op, token=token,
                                                reason="WORKER_LOST")
            await journal_db.journal_append(conn, run_id=run.id, token=token,
                                            expected=claim["revision"], events=[])

    with psycopg.connect(migrated_database_url) as holder:
        holder.execute("SELECT 1 FROM orchestrator.operations WHERE id = %s FOR UPDATE", (op,))
        worker = asyncio.create_task(worker_write())
        await wait_for(lambda: _waiting(sql) == 1)  # the worker waits for the operation
        operator = asyncio.create_task(_answer(app.operators.resolve_committed(
            op, receipt={"ok": 1}, evidence="the provider shows it", operator="alice")))
        await wait_for(lambda: operator.done() or _waiting(sql) == 2)
        holder.rollback()
        answer, _ = await asyncio.gather(operator, worker)
    assert answer == "OPERATION_IN_PROGRESS"
    assert _retries(app) == 0, "PostgreSQL found a deadlock"
    assert sql("SELECT o.state, i.state AS item FROM orchestrator.operations o "
               "JOIN orchestrator.reconciliation_items i ON i.operation_id = o.id") == [
        {"state": "unknown", "item": "open"}]


async def test_two_resolutions_of_attempts_of_one_call_do_not_deadlock(
        make_app, sql, migrated_database_url):  # type: ignore[no-untyped-def]
    """An idempotent call's two attempts share a key and are both queued (the first by a late
    receipt kept as evidence): resolving one settles the other too. Two operators resolving
    one each at the same moment both wait for the run (held by a third transaction); the
    first settles both attempts, the second finds its own settled the same way: a no-op."""
    app = make_app()

    @app.tool(effect="idempotent", retry=RetryPolicy(max_attempts=2, base_delay_ms=0))
    async def upsert(ctx):  # type: ignore[no-untyped-def]
        raise ConnectionResetError("sent, then the connection dropped")

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(upsert)

    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs")
                       == [{"status": "needs_reconciliation"}])
    first, second = [o["id"] for o in sql(
        "SELECT id FROM orchestrator.operations WHERE state = 'unknown' ORDER BY attempt")]
    async with app.database.connection() as conn:
        await ops_db.operation_attach_evidence(conn, op_id=first, evidence=LATE)
    assert len(sql("SELECT 1 FROM orchestrator.reconciliation_items WHERE state = 'open'")) == 2

    def resolve(op: int, operator: str) -> asyncio.Task[str]:
        return asyncio.create_task(_answer(app.operators.resolve_committed(
            op, receipt={"upserted": True}, evidence="the provider shows it",
            operator=operator)))

    with psycopg.connect(migrated_database_url) as holder:
        holder.execute("SELECT 1 FROM orchestrator.runs WHERE id = %s FOR UPDATE", (run.id,))
        tasks = [resolve(first, "alice"), resolve(second, "bob")]
        await wait_for(lambda: _waiting(sql) == 2)
        holder.rollback()
        answers = await asyncio.gather(*tasks)
    assert sorted(answers) == ["noop", "resolved"]
    assert _retries(app) == 0, "PostgreSQL found a deadlock"
    assert sql("SELECT DISTINCT state FROM orchestrator.operations") == [{"state": "committed"}]
    assert sql("SELECT DISTINCT state FROM orchestrator.reconciliation_items") == [
        {"state": "resolved"}]
    assert len(sql("SELECT 1 FROM orchestrator.journal WHERE kind = 'call.completed'")) == 1


@pytest.mark.parametrize("other", ["cancel", "resolve"])
async def test_a_resolution_and_a_cancellation_or_another_resolution_of_the_run(
        make_app, sql, migrated_database_url, other):  # type: ignore[no-untyped-def]
    """While one operation of a run parked on two is resolved, the run is cancelled, or its
    other operation resolved, at the same moment (both wait for the run, held by a third
    transaction): both land, without a deadlock."""
    app = make_app()

    @app.tool()
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        raise ConnectionResetError("lost after sending")

    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        async def one(order: str) -> Any:
            try:
                return await ctx.call(charge, order=order)
            except Exception as exc:  # noqa: BLE001 - a not applied one fails here
                return str(exc)
        return await asyncio.gather(one("a"), one("b"))

    async with running(app):
        run = await app.submit_async(pay, {})
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs")
                       == [{"status": "needs_reconciliation"}]
                       and len(sql("SELECT 1 FROM orchestrator.reconciliation_items")) == 2)
    a, b = [r["operation_id"] for r in sql(
        "SELECT operation_id FROM orchestrator.reconciliation_items ORDER BY operation_id")]

    with psycopg.connect(migrated_database_url) as holder:
        holder.execute("SELECT 1 FROM orchestrator.runs WHERE id = %s FOR UPDATE", (run.id,))
        tasks = [asyncio.create_task(_answer(app.operators.resolve_committed(
            a, receipt={"charged": "a"}, evidence="the provider shows it", operator="alice")))]
        if other == "cancel":
            tasks.append(asyncio.create_task(_answer(app.cancel_async(run.id))))
        else:
            tasks.append(asyncio.create_task(_answer(app.operators.abandon(
                b, evidence="refunded by hand", operator="bob"))))
        await wait_for(lambda: _waiting(sql) == 2)
        holder.rollback()
        answers = await asyncio.gather(*tasks)
    assert answers[0] == "resolved", answers
    assert answers[1] in ("needs_reconciliation", "resolved"), answers
    assert _retries(app) == 0, "PostgreSQL found a deadlock"


async def test_two_bulk_resolutions_of_several_runs_in_opposite_orders(
        make_app, sql, migrated_database_url):  # type: ignore[no-untyped-def]
    """``resolve-many`` settles each item in a transaction of its own, so it never holds two
    runs at once: two of them over the operations of two runs, named in opposite orders,
    meeting on a run a third transaction holds, both end, each operation resolved once."""
    app = make_app()
    ops, runs = await _parked(app, sql, runs=2)

    def many(ids: list[int], operator: str) -> asyncio.Task[Any]:
        return asyncio.create_task(app.operators.resolve_many(
            resolution="not_applied", then="fail", evidence="none at the PSP",
            operator=operator, ids=ids))

    with psycopg.connect(migrated_database_url) as holder:
        holder.execute("SELECT 1 FROM orchestrator.runs WHERE id = %s FOR UPDATE", (runs[1],))
        tasks = [many(ops, "alice"), many(ops[::-1], "bob")]
        await wait_for(lambda: _waiting(sql) == 2)
        holder.rollback()
        summaries = await asyncio.gather(*tasks)
    resolved = sorted(i.operation_id for s in summaries for i in s.resolved)
    assert resolved == sorted(ops)
    assert {k.code for s in summaries for k in s.skipped} == {"RESOLUTION_CONFLICT"}
    assert _retries(app) == 0, "PostgreSQL found a deadlock"
    assert sql("SELECT DISTINCT status FROM orchestrator.runs") == [{"status": "queued"}]


async def test_a_lookups_not_applied_differs_from_an_operators_choice(make_app, sql):
    """A lookup's ``not_applied`` leaves what follows to the retry policy (no ``then``); an
    operator's ``not_applied`` then ``resend`` after it is another resolution (a conflict that
    says so), the lookup's own answer again a no-op: what a resolution compares with the
    choice already made is read with its queue item."""
    app = make_app()
    (op,), _ = await _parked(app, sql)
    done = await reconcile.resolve(app.database, operation_id=op, resolution="not_applied",
                                   evidence="lookup: none", operator="reconciler")
    assert done.outcome == "resolved"
    with pytest.raises(ResolutionConflict) as refused:
        await app.operators.resolve_not_applied(op, evidence="none", operator="al",
                                                then="resend")
    assert refused.value.message == (
        f"operation {op} was already resolved as not_applied with what follows left to the "
        f"retry policy, not then resend; a resolution is kept as first given (`orchestrator "
        f"ops show {op}` shows it and who made it)")
    again = await reconcile.resolve(app.database, operation_id=op, resolution="not_applied",
                                    evidence="lookup: none", operator="reconciler")
    assert again.outcome == "noop"
