"""The operation ledger and the effect gateway (CONTRACT C5, C8, C12)."""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import timedelta

import pytest

from orchestrator import (
    Committed,
    NotApplied,
    OperationInProgress,
    OperationUncertain,
    ResultTimeout,
    StillUnknown,
    ToolError,
    ToolFailed,
)
from orchestrator.db import operations as ops_db
from orchestrator.db import reconciliation as recon_db
from tests.integration.conftest import never_answers, running, wait_for


def _one(sql, query, params=None):  # type: ignore[no-untyped-def]
    rows = sql(query, params)
    assert len(rows) == 1, rows
    return rows[0]


def _parked(sql):  # type: ignore[no-untyped-def]
    return lambda: sql("SELECT 1 FROM orchestrator.runs WHERE status = 'needs_reconciliation'")


async def test_submitted_is_committed_before_the_tool_runs(app, sql):
    seen = []

    @app.tool()
    async def probe(ctx):  # type: ignore[no-untyped-def]
        seen.append(sql("SELECT state, idempotency_key FROM orchestrator.operations"))
        return {"ok": True}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(probe)

    async with running(app):
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=10) == {"ok": True}
    assert seen[0][0]["state"] == "submitted"
    op = _one(sql, "SELECT state, receipt, receipt_digest, worker_id, lease_token "
                   "FROM orchestrator.operations")
    assert op["state"] == "committed" and op["receipt"] == {"ok": True}
    assert op["receipt_digest"] and op["worker_id"] and op["lease_token"] == 1
    counts = app.metrics.snapshot()
    assert counts["operations_dispatched"] == 1 and counts["runs_succeeded"] == 1


async def test_an_uncertain_consequential_call_blocks_the_run(app, sql):
    calls = 0

    @app.tool()
    async def charge(ctx, *, cents):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        if cents > 100:
            raise ConnectionResetError("provider hung up: secret-key-xyz")
        return {"charged": cents}

    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.call(charge, cents=1)
        return await ctx.call(charge, cents=500)

    async with running(app):
        run = await app.submit_async(pay, {})
        await wait_for(_parked(sql))
        with pytest.raises(ResultTimeout) as info:
            await run.result_async(timeout=0.3)
        assert info.value.status == "needs_reconciliation"
        assert "orchestrator ops list" in str(info.value)
        with pytest.raises(OperationUncertain) as uncertain:
            await run.outcome_async()
    assert uncertain.value.known_operations == [
        {"position": 0, "tool": "charge", "receipt": {"charged": 1}}]
    assert calls == 2
    item = _one(sql, "SELECT reason, state FROM orchestrator.reconciliation_items")
    assert item == {"reason": "TOOL_OUTCOME_UNCERTAIN", "state": "open"}
    assert app.metrics.snapshot()["unknown_outcomes"] == 1
    text = json.dumps(sql("SELECT * FROM orchestrator.runs"), default=str)
    assert "secret-key-xyz" not in text
    assert "secret-key-xyz" in json.dumps(sql("SELECT detail FROM orchestrator.incidents"))


async def test_a_tool_timeout_is_uncertain_and_signals_the_tool(app, sql):
    signalled = asyncio.Event()

    @app.tool(timeout=timedelta(seconds=0.2))
    async def hang(ctx):  # type: ignore[no-untyped-def]
        try:
            await never_answers()
        finally:
            if ctx.cancelled.is_set():  # the tool is told before it is cancelled
                signalled.set()

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(hang)

    async with running(app):
        await app.submit_async(wf, {})
        await wait_for(_parked(sql))
    assert signalled.is_set()
    assert _one(sql, "SELECT state FROM orchestrator.operations")["state"] == "unknown"


async def test_an_idempotent_tool_is_resent_with_the_same_key(app, sql):
    keys: list[str] = []

    @app.tool(effect="idempotent")
    async def upsert(ctx):  # type: ignore[no-untyped-def]
        keys.append(ctx.idempotency_key)
        if len(keys) < 3:
            raise TimeoutError("read timed out after sending")
        return {"saved": True}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(upsert)

    async with running(app):
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=10) == {"saved": True}
    assert len(keys) == 3 and len(set(keys)) == 1
    ops = sql("SELECT attempt, state FROM orchestrator.operations ORDER BY attempt")
    assert [o["state"] for o in ops] == ["committed"] * 3
    assert sql("SELECT count(*) AS n FROM orchestrator.reconciliation_items")[0]["n"] == 0


async def test_an_uncertain_read_is_repeated_as_a_new_attempt(app, sql):
    keys: list[str] = []

    @app.tool(effect="read")
    async def lookup_price(ctx):  # type: ignore[no-untyped-def]
        keys.append(ctx.idempotency_key)
        if len(keys) == 1:
            raise OSError("connection dropped")
        return {"cents": 5}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(lookup_price)

    async with running(app) as worker:
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=10) == {"cents": 5}
    assert len(set(keys)) == 2
    ops = sql("SELECT attempt, state FROM orchestrator.operations ORDER BY attempt")
    assert [o["state"] for o in ops] == ["not_applied", "committed"]
    kinds = [e.kind for e in await run.journal_async()]
    assert "call.unknown" in kinds  # the journal says the read was repeated
    assert worker.metrics.snapshot()["operations_retried"] == 1


async def test_a_definitive_tool_failure_is_failed_not_unknown(app, sql):
    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        raise ToolError("card declined for token tok_secret", applied=False, status=402)

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        try:
            await ctx.call(charge)
        except ToolFailed as exc:
            return {"failed": exc.code, "message": exc.message}
        return {"failed": None}

    async with running(app):
        run = await app.submit_async(wf, {})
        result = await run.result_async(timeout=10)
    assert result["failed"] == "TOOL_FAILED" and "tok_secret" not in result["message"]
    assert _one(sql, "SELECT state FROM orchestrator.operations")["state"] == "failed"


async def test_a_reused_identity_with_another_intent_is_rejected(app, sql):
    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return 1

    run = await app.submit_async(wf, {})
    async with app.database.connection() as conn:
        from orchestrator.db import runs as runs_db

        (claim,) = await runs_db.run_claim_ready(conn, worker="w", workflows=["wf@1"],
                                                 limit=1, ttl=30)
        row = {"run_id": run.id, "position": 0, "attempt": 1, "tool_name": "t",
               "tool_version": "1", "effect_class": "consequential", "tenant": "acme",
               "principal": "alice", "intent_digest": "a" * 64, "arguments": "{}",
               "idempotency_key": "k", "worker_id": "w", "token": claim["lease_token"]}
        await ops_db.operation_begin(conn, row, pending=False)
        with pytest.raises(ops_db.OperationIdentityReused):
            await ops_db.operation_begin(conn, {**row, "intent_digest": "b" * 64},
                                          pending=False)
    assert sql("SELECT count(*) AS n FROM orchestrator.operations")[0]["n"] == 1
    await app.database.close()


async def test_a_late_receipt_after_a_lost_lease_is_evidence_not_outcome(app, sql):
    release = asyncio.Event()

    @app.tool()
    async def slow(ctx):  # type: ignore[no-untyped-def]
        await release.wait()
        return {"late": True}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(slow)

    async with running(app) as worker:
        await app.submit_async(wf, {})
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.operations"))
        sql("UPDATE orchestrator.runs SET lease_token = lease_token + 1")  # another worker
        release.set()
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.reconciliation_items"))
        assert worker.metrics.snapshot()["lease_losses"] >= 1
    op = _one(sql, "SELECT state, receipt FROM orchestrator.operations")
    assert op == {"state": "submitted", "receipt": None}
    item = _one(sql, "SELECT evidence FROM orchestrator.reconciliation_items")
    assert item["evidence"][0]["receipt"] == {"late": True}


def _lookup_app(make_app, answers, *, max_attempts=1):  # type: ignore[no-untyped-def]
    app = make_app()
    calls: list[str] = []

    @app.tool(max_attempts=max_attempts)
    async def charge(ctx, *, cents):  # type: ignore[no-untyped-def]
        calls.append(ctx.idempotency_key)
        if len(calls) == 1:
            raise ConnectionResetError("lost after sending")
        return {"charge": "second"}

    @charge.lookup
    async def find(ctx, *, cents):  # type: ignore[no-untyped-def]
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        try:
            return await ctx.call(charge, cents=7)
        except ToolFailed:
            return "not applied"

    return app, pay, calls


async def test_lookup_committed_resumes_the_run_with_the_original_receipt(make_app, sql):
    app, pay, calls = _lookup_app(make_app, [Committed({"charge": "original"})])
    async with running(app):
        run = await app.submit_async(pay, {})
        await wait_for(_parked(sql))
        assert await app.create_reconciler().run_once() == 1
        assert await run.result_async(timeout=10) == {"charge": "original"}
    assert len(calls) == 1
    assert app.metrics.snapshot()["reconciliation_auto_committed"] == 1
    op = _one(sql, "SELECT state, receipt FROM orchestrator.operations")
    assert op == {"state": "committed", "receipt": {"charge": "original"}}
    audit = _one(sql, "SELECT operator, action FROM orchestrator.operator_audit")
    assert audit == {"operator": "reconciler", "action": "resolve.committed"}


@pytest.mark.parametrize(("max_attempts", "expected"), [(1, "not applied"),
                                                       (2, {"charge": "second"})])
async def test_lookup_not_applied_continues_under_the_retry_budget(
        make_app, sql, max_attempts, expected):
    app, pay, calls = _lookup_app(make_app, [NotApplied("no such charge")],
                                  max_attempts=max_attempts)
    async with running(app):
        run = await app.submit_async(pay, {})
        await wait_for(_parked(sql))
        await app.create_reconciler().run_once()
        assert await run.result_async(timeout=10) == expected
    assert len(calls) == max_attempts and len(set(calls)) == max_attempts
    assert app.metrics.snapshot()["reconciliation_auto_not_applied"] == 1
    states = [o["state"] for o in sql("SELECT state FROM orchestrator.operations ORDER BY id")]
    assert states[0] == "not_applied"


async def test_inconclusive_lookups_hand_the_item_to_operators(make_app, sql):
    app, pay, _ = _lookup_app(make_app, [StillUnknown("pending"), RuntimeError("down")])
    async with running(app):
        await app.submit_async(pay, {})
        await wait_for(_parked(sql))
        reconciler = app.create_reconciler(max_lookups=2, base_delay=0.01)
        await reconciler.run_once()
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.reconciliation_items "
                                   "WHERE next_attempt_at <= now()"))
        await reconciler.run_once()
    item = _one(sql, "SELECT id, state, lookup_attempts FROM orchestrator.reconciliation_items")
    assert item["state"] == "operator" and item["lookup_attempts"] == 2
    history = sql("SELECT attempt, answer FROM orchestrator.reconciliation_lookups "
                  "ORDER BY attempt")
    assert history == [{"attempt": 1, "answer": "still_unknown"},
                       {"attempt": 2, "answer": "still_unknown"}]


async def test_a_tool_without_lookup_goes_straight_to_operators(app, sql, caplog):
    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        raise ConnectionResetError("lost")

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(_parked(sql))
        caplog.set_level(logging.INFO, logger="orchestrator.reconciler")
        await app.create_reconciler().run_once()
        with pytest.raises(OperationUncertain):
            await run.outcome_async()
    assert _one(sql, "SELECT state FROM orchestrator.reconciliation_items")["state"] == "operator"
    assert "handed to operators: tool charge has no lookup here" in caplog.text  # said, not silent
    # and the worker said what it knew when the outcome became unknown
    assert "(charge) is unknown (TOOL_OUTCOME_UNCERTAIN); next: reconcile; incident inc_" in (
        caplog.text)


async def test_an_item_whose_arguments_cannot_be_decoded_goes_to_operators(make_app, sql,
                                                                         caplog):
    """Arguments this process cannot decode (an integer longer than the interpreter parses,
    stored by a writer that could) are never guessed at: no lookup is asked, the item goes to
    operators with the reason kept on it, and the reconciler says so and goes on."""
    app, pay, _ = _lookup_app(make_app, [Committed({"charge": "original"})])
    async with running(app):
        await app.submit_async(pay, {})
        await wait_for(_parked(sql))
    sql("SET session_replication_role = replica; "  # the ledger's guards keep arguments as sent
        "UPDATE orchestrator.operations SET arguments = "
        "('{\"cents\": ' || repeat('9', 5000) || '}')::jsonb; "
        "SET session_replication_role = origin")
    caplog.set_level(logging.INFO, logger="orchestrator.reconciler")
    await app.create_reconciler().run_once()
    item = _one(sql, "SELECT state, lookup_attempts FROM orchestrator.reconciliation_items")
    assert item == {"state": "operator", "lookup_attempts": 0}
    assert "handed to operators: its stored arguments cannot be decoded (RUN_UNREADABLE)" in (
        caplog.text)


async def test_an_item_whose_claim_lapsed_is_not_handed_to_operators_by_its_old_claimer(
        app, sql, caplog):
    """A reconciler works through its batch one item after another; by the time it reaches an
    item of a tool it has no lookup for, its claim may have lapsed and another reconciler (one
    of a newer release, with the lookup) hold it. The first one must not take the item from it
    and hand it to operators, and says it did not."""
    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        raise ConnectionResetError("lost")

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    async with running(app):
        await app.submit_async(wf, {})
        await wait_for(_parked(sql))
    reconciler = app.create_reconciler()
    async with app.database.connection() as conn:
        (item,) = await recon_db.recon_claim_due(conn, claimer=reconciler.id, limit=10,
                                                 ttl=60)
    # its claim lapsed meanwhile, and another reconciler claimed the item
    sql("UPDATE orchestrator.reconciliation_items SET claimed_by = 'reconciler:other', "
        "claimed_until = now() + interval '1 minute'")
    caplog.set_level(logging.INFO, logger="orchestrator.reconciler")
    await reconciler._handle(item)
    after = _one(sql, "SELECT state, claimed_by, evidence FROM orchestrator.reconciliation_items")
    assert after == {"state": "open", "claimed_by": "reconciler:other", "evidence": []}
    assert "handed to operators: tool charge has no lookup here" not in caplog.text
    assert "not handed to operators: its claim lapsed" in caplog.text


async def test_outcome_now_says_in_progress_then_replays_the_stored_result(app):
    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return {"done": data}

    run = await app.submit_async(wf, 1, idempotency_key="once")
    with pytest.raises(OperationInProgress) as info:
        await run.outcome_async()
    assert info.value.code == "OPERATION_IN_PROGRESS" and info.value.status == "queued"
    async with running(app):
        await run.result_async(timeout=10)
    again = await app.submit_async(wf, 1, idempotency_key="once")
    assert again.id == run.id and await again.outcome_async() == {"done": 1}


async def test_a_lookup_that_finds_the_item_settled_by_an_operator_counts_nothing(
        make_app, sql):
    app = make_app()

    @app.tool(max_attempts=1)
    async def charge(ctx, *, cents):  # type: ignore[no-untyped-def]
        raise ConnectionResetError("lost after sending")

    @charge.lookup
    async def find(ctx, *, cents):  # type: ignore[no-untyped-def]
        # An operator settles the item the same way while the lookup is under way.
        op = sql("SELECT id FROM orchestrator.operations")[0]["id"]
        await app.operators.resolve_committed(op, receipt={"charge": "original"},
                                              evidence="PSP dashboard", operator="alice")
        return Committed({"charge": "original"})

    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, cents=7)

    async with running(app):
        run = await app.submit_async(pay, {})
        await wait_for(_parked(sql))
        await app.create_reconciler().run_once()
        assert await run.result_async(timeout=10) == {"charge": "original"}
    counts = app.metrics.snapshot()
    assert counts["reconciliation_operator"] == 1
    assert counts["reconciliation_auto_committed"] == 0
