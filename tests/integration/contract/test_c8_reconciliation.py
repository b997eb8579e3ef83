"""CONTRACT C8: an unknown operation blocks its run and is listed for reconciliation; an
attempt re-sent after an uncertain one keeps its key; resolving settles every attempt."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from orchestrator import (
    AccessDenied,
    InvalidRequest,
    NotApplied,
    ResolutionConflict,
    ResultTimeout,
    RunFailed,
    ToolError,
)
from tests.integration.conftest import never_answers, running, wait_for
from tests.integration.contract.helpers import operations, parked


async def test_resolving_the_last_of_several_resent_attempts_settles_them_all(make_app, sql):
    app = make_app(operator_scopes={"bob": ["globex"], "al": ["acme"]})  # one tenant each

    @app.tool(effect="idempotent", timeout=timedelta(seconds=0.2))
    async def upsert(ctx):  # type: ignore[no-untyped-def]
        await never_answers()

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(upsert)

    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(parked(sql, run))
        ops = operations(sql)
        assert [o["state"] for o in ops] == ["unknown"] * 3
        # An earlier attempt is not in the queue: the operator is told which attempt is.
        for attempt in (app.operators.show(ops[0]["id"], operator="al"),
                        app.operators.resolve_committed(ops[0]["id"], receipt={"ok": 1},
                                                        evidence="seen", operator="al")):
            with pytest.raises(InvalidRequest) as info:
                await attempt
            assert f"the queued attempt of the same call is operation {ops[-1]['id']}" in str(
                info.value)
        with pytest.raises(AccessDenied):  # a missing one still looks like a foreign one
            await app.operators.show(ops[-1]["id"] + 100, operator="al")
        # C9: to an operator of another tenant, an attempt that is not queued looks missing
        # too (its state and the queued attempt's id are not told)
        for attempt in (app.operators.show(ops[0]["id"], operator="bob"),
                        app.operators.abandon(ops[0]["id"], evidence="x", operator="bob")):
            with pytest.raises(AccessDenied):
                await attempt
        await app.operators.resolve_committed(ops[-1]["id"], receipt={"ok": 1},
                                              evidence="seen at the provider", operator="al")
        assert await run.result_async(timeout=10) == {"ok": 1}
    assert [o["state"] for o in operations(sql)] == ["committed"] * 3


async def test_a_gather_branch_failing_waits_for_its_uncertain_sibling(app, sql):
    @app.tool(timeout=timedelta(seconds=0.5))
    async def slow(ctx):  # type: ignore[no-untyped-def]
        await never_answers()

    @app.tool()
    async def bad(ctx):  # type: ignore[no-untyped-def]
        raise ToolError.from_status(400, "nope")

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.gather(ctx.call(slow), ctx.call(bad))

    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(parked(sql, run))  # not failed while an effect is unknown
        unknown = [o for o in operations(sql) if o["state"] == "unknown"]
        await app.operators.resolve_not_applied(unknown[0]["id"], evidence="nothing there",
                                                operator="al", then="fail")
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=10)
    assert info.value.code == "WORKFLOW_FAILED"
    assert "unknown" not in [o["state"] for o in operations(sql)]


async def test_a_timeout_around_a_call_in_workflow_code_blocks_the_run(app, sql):
    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        await never_answers()

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        try:
            await asyncio.wait_for(ctx.call(charge), 0.3)
        except TimeoutError:
            return "gave up"

    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(parked(sql, run))
        with pytest.raises(ResultTimeout):
            await run.result_async(timeout=0.2)
    assert [o["state"] for o in operations(sql)] == ["unknown"]


@pytest.mark.parametrize("slow", ["its incident", "its unknown outcome"])
async def test_a_timeout_while_an_unknown_outcome_is_recorded_blocks_the_run(
        app, sql, monkeypatch, slow):
    """The tool failed without proving anything (its effect is unknown) and workflow code's
    timeout around the call fires while the engine keeps the failure's incident or records
    the unknown outcome: the run waits for the reconciliation of that call, as for a timeout
    while the tool runs; the workflow does not go on past an effect whose outcome is unknown.
    (It got the timeout there and charged the other card.)"""
    from orchestrator.engine import site
    from tests.integration.contract.helpers import slow_write

    if slow == "its incident":
        async def stuck(conn, row):  # type: ignore[no-untyped-def]
            await never_answers()  # until the workflow's timeout cancels the call

        monkeypatch.setattr(site, "incident_record", stuck)
    else:
        slow_write(monkeypatch, nth=2)  # the run's second write: the call's unknown outcome
    called: list[str] = []

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        called.append("charge")
        raise ConnectionResetError("sent, then the connection dropped")

    @app.tool()
    async def charge_other_card(ctx):  # type: ignore[no-untyped-def]
        called.append("charge_other_card")
        return {"charged": True}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        try:
            return await asyncio.wait_for(ctx.call(charge), 0.3)
        except TimeoutError:
            return await ctx.call(charge_other_card)

    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(parked(sql, run))
    assert called == ["charge"]
    assert [(o["tool_name"], o["state"]) for o in operations(sql)] == [("charge", "unknown")]


@pytest.mark.parametrize("attempts", [3, 2])
async def test_a_resend_answered_not_applied_keeps_the_uncertain_key(make_app, sql, attempts):
    from orchestrator.recovery import RetryPolicy

    app = make_app()
    keys: list[str] = []

    @app.tool(effect="idempotent", retry=RetryPolicy(max_attempts=attempts, base_delay_ms=0))
    async def upsert(ctx):  # type: ignore[no-untyped-def]
        keys.append(ctx.idempotency_key)
        if len(keys) == 1:
            raise ConnectionResetError("sent, then the connection dropped")
        if len(keys) == 2:
            raise ToolError.before_send("busy")  # says nothing about the first attempt
        return {"ok": True}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(upsert)

    async with running(app):
        run = await app.submit_async(wf, {})
        if attempts == 3:
            assert await run.result_async(timeout=15) == {"ok": True}
        else:  # out of attempts: the first one may have applied, so it is reconciled
            await wait_for(parked(sql, run))
    assert len(set(keys)) == 1  # never a new key while an attempt with the old one is unknown
    if attempts == 2:
        item = sql("SELECT i.reason, o.attempt FROM orchestrator.reconciliation_items i "
                   "JOIN orchestrator.operations o ON o.id = i.operation_id")
        assert item == [{"reason": "RESEND_NOT_APPLIED", "attempt": 1}]


@pytest.mark.parametrize("attempts", [3, 2])
async def test_a_resend_answered_not_applied_after_a_lookup_committed_the_first_keeps_its_key(
        make_app, sql, attempts):
    """A re-send of an uncertain attempt answered "not applied" says nothing about the first
    attempt; when a lookup has meanwhile proved the first one committed, the call's outcome is
    that receipt. The next attempt must not take a new key: under it the effect would be
    applied a second time (the chaos suite's "idempotent re-sends with a different key")."""
    from orchestrator.recovery import RetryPolicy

    app = make_app()
    keys: list[str] = []

    @app.tool(effect="idempotent", retry=RetryPolicy(max_attempts=attempts, base_delay_ms=0))
    async def upsert(ctx):  # type: ignore[no-untyped-def]
        keys.append(ctx.idempotency_key)
        if len(keys) == 1:
            raise ConnectionResetError("sent, then the connection dropped")
        if len(keys) == 2:  # the first attempt's lookup lands while this re-send is out
            (first,) = [o for o in operations(sql) if o["attempt"] == 1]
            sql("UPDATE orchestrator.operations SET state = 'committed', "
                "receipt = '{\"ok\": \"first\"}', receipt_digest = 'd', finished_at = now() "
                "WHERE id = %s AND state = 'unknown'", (first["id"],))
            raise ToolError.before_send("busy")  # says nothing about the first attempt
        return {"ok": "again"}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(upsert)

    async with running(app):
        run = await app.submit_async(wf, {})
        result = await run.result_async(timeout=15)
        entries = [e for e in await run.journal_async() if e.kind.startswith("call.")]
        from orchestrator.testing import replay_async

        (verdict,) = await replay_async(app, [run.id])  # the journal replays as it ran
    assert verdict.ok, verdict
    assert len(set(keys)) == 1, keys  # never a new key: the first attempt applied
    assert result == {"ok": "first"}
    states = {o["attempt"]: o["state"] for o in operations(sql)}
    assert states == {1: "committed", 2: "failed"}
    first = next(o["id"] for o in operations(sql) if o["attempt"] == 1)
    assert entries[-1].kind == "call.completed"
    assert entries[-1].payload["op"] == first and entries[-1].payload["resolved"] is True


async def test_a_cancel_between_an_uncertain_attempt_and_its_resend_lists_it(app, sql):
    @app.tool(effect="idempotent")
    async def upsert(ctx):  # type: ignore[no-untyped-def]
        await app.cancel_async(ctx.run_id)  # the cancel lands while this attempt is out
        raise ConnectionResetError("sent, then the connection dropped")

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(upsert)

    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(parked(sql, run))  # not cancelled while the effect is unknown
        (op,) = [o for o in operations(sql) if o["state"] == "unknown"]
        listed = sql("SELECT operation_id FROM orchestrator.reconciliation_items")
        assert listed == [{"operation_id": op["id"]}]  # no run blocked on an unlisted op
        await app.operators.resolve_not_applied(op["id"], evidence="nothing", operator="al")
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=10)
    assert info.value.code == "CANCELLED"


async def test_an_operators_not_applied_sends_a_timed_out_call_again_outside_its_budget(
        app, sql):
    """The tool timed out (its own doing, not the engine's): a lookup's `not applied` would
    count against the one attempt a consequential tool has; an operator's (re-send by
    default) sends it again all the same, as attempt 2 with a new key."""
    sent: list[str] = []

    @app.tool(timeout=timedelta(seconds=0.3))
    async def charge(ctx):  # type: ignore[no-untyped-def]
        sent.append(ctx.idempotency_key)
        if len(sent) == 1:
            await never_answers()
        return {"id": "ch_1"}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(parked(sql, run))
        [op] = operations(sql)
        await app.operators.resolve_not_applied(op["id"], evidence="not in the ledger",
                                                operator="al")
        assert await run.result_async(timeout=10) == {"id": "ch_1"}
    assert len(sent) == 2 and sent[0] != sent[1]
    assert [(o["attempt"], o["state"]) for o in operations(sql)] == [
        (1, "not_applied"), (2, "committed")]
    retrying = sql("SELECT payload FROM orchestrator.journal WHERE kind = 'call.retrying'")
    assert retrying[0]["payload"]["resend"] == "operator"


async def test_a_lookups_not_applied_for_a_timed_out_call_counts_against_the_budget(app, sql):
    """Not the engine's loss: the retry policy decides (one attempt: the call fails)."""
    calls = 0

    @app.tool(timeout=timedelta(seconds=0.3))
    async def charge(ctx):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        await never_answers()

    @charge.lookup
    async def find(ctx):  # type: ignore[no-untyped-def]
        return NotApplied("no such charge")

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(parked(sql, run))
        assert await app.create_reconciler().run_once() == 1
        with pytest.raises(RunFailed):
            await run.result_async(timeout=10)
    assert calls == 1
    failed = sql("SELECT payload FROM orchestrator.journal WHERE kind = 'call.failed'")
    assert [(f["payload"]["cause"], f["payload"]["reason"]) for f in failed] == [
        ("not_applied", "budget")]


async def test_a_run_blocked_by_one_branch_wakes_while_another_waits_to_resend_its_own(
        app, sql):
    """One branch's call is unknown and queued; the other's idempotent call is unknown too,
    but the engine re-sends that one itself (same key) and was waiting out the re-send's
    retry delay when the run parked. Settling the queued one wakes the run: it must not wait
    for an operation that no queue item lists."""
    from orchestrator.recovery import RetryPolicy

    sent: list[str] = []

    @app.tool(effect="idempotent", retry=RetryPolicy(max_attempts=3, base_delay_ms=0))
    async def upsert(ctx):  # type: ignore[no-untyped-def]
        sent.append(ctx.idempotency_key)
        if len(sent) == 1:
            raise ConnectionResetError("sent, then the connection dropped")  # unknown
        if len(sent) == 2:  # the re-send: refused, nothing applied, come back in 2 s
            raise ToolError.before_send("busy", retry_after=2)
        return {"upserted": True}

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        raise ConnectionResetError("sent, then the connection dropped")  # unknown: queued

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.gather(ctx.call(upsert), ctx.call(charge))

    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(parked(sql, run))
        unknown = {o["tool_name"]: o for o in operations(sql) if o["state"] == "unknown"}
        assert set(unknown) == {"upsert", "charge"}
        listed = sql("SELECT operation_id FROM orchestrator.reconciliation_items")
        assert listed == [{"operation_id": unknown["charge"]["id"]}]
        await app.operators.resolve_committed(unknown["charge"]["id"], receipt={"charged": 1},
                                              evidence="the provider shows it", operator="al")
        assert await run.result_async(timeout=15) == [{"upserted": True}, {"charged": 1}]
    assert len(set(sent)) == 1  # every attempt of upsert with the key of the unknown one
    assert "unknown" not in [o["state"] for o in operations(sql)]


async def test_a_second_not_applied_that_chose_otherwise_is_a_conflict(app, sql):
    """One operator fails the call; a second one's `not applied` that would re-send it is
    not the same resolution: a conflict, not a no-op, and nothing changes."""
    @app.tool(timeout=timedelta(seconds=0.3))
    async def charge(ctx):  # type: ignore[no-untyped-def]
        await never_answers()

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(parked(sql, run))
    [op] = operations(sql)
    assert await app.operators.resolve_not_applied(
        op["id"], evidence="the customer cancelled", operator="al", then="fail") == "resolved"
    with pytest.raises(ResolutionConflict) as refused:  # then="resend", the default
        await app.operators.resolve_not_applied(op["id"], evidence="not in the ledger",
                                                operator="bo")
    assert refused.value.message == (f"operation {op['id']} was already resolved as not_applied "
                                  "then fail, not then resend; a resolution is kept as first "
                                  f"given (`orchestrator ops show {op['id']}` shows it and who "
                                  "made it)")
    assert await app.operators.resolve_not_applied(
        op["id"], evidence="same again", operator="bo", then="fail") == "noop"
    audit = sql("SELECT operator, action FROM orchestrator.operator_audit ORDER BY id")
    assert [(a["operator"], a["action"]) for a in audit] == [
        ("al", "resolve.not_applied"), ("bo", "resolve.not_applied.noop")]
    journal = sql("SELECT payload FROM orchestrator.journal WHERE kind = 'call.not_applied'")
    assert [j["payload"]["then"] for j in journal] == ["fail"]


async def test_committed_again_with_another_receipt_is_a_conflict_that_says_so(app, sql):
    """The same resolution with the same receipt is a no-op; with another receipt it is a
    conflict whose message says the receipt differs, gives the stored one's digest and how
    to see it, and nothing changes."""
    from orchestrator.canonical import digest

    @app.tool(timeout=timedelta(seconds=0.3))
    async def charge(ctx):  # type: ignore[no-untyped-def]
        await never_answers()

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(parked(sql, run))
        [op] = operations(sql)
        assert await app.operators.resolve_committed(
            op["id"], receipt={"charge": "ch_1"}, evidence="PSP shows ch_1",
            operator="al") == "resolved"
        assert await run.result_async(timeout=10) == {"charge": "ch_1"}
    assert await app.operators.resolve_committed(
        op["id"], receipt={"charge": "ch_1"}, evidence="same again", operator="bo") == "noop"
    with pytest.raises(ResolutionConflict) as refused:
        await app.operators.resolve_committed(op["id"], receipt={"charge": "ch_2"},
                                              evidence="PSP shows ch_2", operator="bo")
    assert refused.value.code == "RESOLUTION_CONFLICT"
    assert refused.value.message == (
        f"operation {op['id']} was already resolved as committed with a different receipt "
        f"(the stored one's digest is {digest({'charge': 'ch_1'})}; `orchestrator ops show "
        f"{op['id']}` shows it); a resolution is kept as first given")
    with pytest.raises(ResolutionConflict, match="already resolved as committed, not "
                                                 r"not_applied; a resolution is kept as first "
                                                 r"given \(`orchestrator ops show \d+` shows "
                                                 r"it and who made it\)$"):
        await app.operators.resolve_not_applied(op["id"], evidence="x", operator="bo")
    [stored] = sql("SELECT receipt FROM orchestrator.operations")
    assert stored["receipt"] == {"charge": "ch_1"}


async def test_a_late_receipt_item_is_settled_with_the_resend_that_commits(app, sql):
    """A worker that lost its lease keeps its late receipt as evidence, which queues the
    attempt; the idempotent re-send with the same key then commits and settles that attempt:
    its queue item is resolved with it, not left waiting for an operator."""
    from orchestrator.db import operations as ops_db

    sent: list[str] = []

    @app.tool(effect="idempotent")
    async def upsert(ctx):  # type: ignore[no-untyped-def]
        sent.append(ctx.idempotency_key)
        if len(sent) == 1:  # as a worker that lost its lease would keep its late receipt
            async with app.database.connection() as conn:
                await ops_db.operation_attach_evidence(
                    conn, op_id=ctx.operation_id,
                    evidence='{"kind": "late_receipt", "receipt": {"upserted": true}}')
            raise ConnectionResetError("sent, then the connection dropped")
        return {"upserted": True}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(upsert)

    async with running(app):
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=15) == {"upserted": True}
    assert len(sent) == 2 and len(set(sent)) == 1
    assert [o["state"] for o in operations(sql)] == ["committed", "committed"]
    items = sql("SELECT state, resolution FROM orchestrator.reconciliation_items")
    assert items == [{"state": "resolved", "resolution": "committed"}]
    assert await app.operators.list_items(operator="al", state="unresolved") == []


async def test_a_lookup_that_raises_cancelled_error_is_an_inconclusive_answer(app, sql):
    """A lookup's own CancelledError (not a cancellation of the reconciler) is recorded as
    still unknown like any other exception; the reconciler goes on with the next item."""
    @app.tool(timeout=timedelta(seconds=0.3))
    async def charge(ctx):  # type: ignore[no-untyped-def]
        await never_answers()

    @charge.lookup
    async def find(ctx):  # type: ignore[no-untyped-def]
        raise asyncio.CancelledError

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    async with running(app):
        runs = [await app.submit_async(wf, {}) for _ in range(2)]
        for run in runs:
            await wait_for(parked(sql, run))
    reconciler = app.create_reconciler(max_lookups=1)
    assert await reconciler.run_once() == 2
    lookups = sql("SELECT answer FROM orchestrator.reconciliation_lookups")
    assert [x["answer"] for x in lookups] == ["still_unknown"] * 2
    items = sql("SELECT state, claimed_by FROM orchestrator.reconciliation_items")
    assert items == [{"state": "operator", "claimed_by": None}] * 2


async def test_a_late_receipt_item_of_a_read_is_settled_with_the_read(app, sql):
    """A read whose worker lost its lease keeps its late receipt as evidence, which queues the
    attempt; the read is then settled as not applied and read again as a new attempt: its
    queue item is resolved with it, not left open for ever (nothing would look it up, no
    operator could resolve it, and its run could never be pruned)."""
    from orchestrator.db import operations as ops_db
    from orchestrator.retention import Pruner, Retention

    sent: list[str] = []

    @app.tool(effect="read")
    async def balance(ctx):  # type: ignore[no-untyped-def]
        sent.append(ctx.idempotency_key)
        if len(sent) == 1:  # as a worker that lost its lease would keep its late receipt
            async with app.database.connection() as conn:
                await ops_db.operation_attach_evidence(
                    conn, op_id=ctx.operation_id,
                    evidence='{"kind": "late_receipt", "receipt": {"cents": 5}}')
            raise ConnectionResetError("sent, then the connection dropped")
        return {"cents": 5}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(balance)

    async with running(app):
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=15) == {"cents": 5}
    assert len(sent) == 2 and sent[0] != sent[1]  # a new attempt, with its own key
    assert [o["state"] for o in operations(sql)] == ["not_applied", "committed"]
    items = sql("SELECT state, resolution FROM orchestrator.reconciliation_items")
    assert items == [{"state": "resolved", "resolution": "not_applied"}]
    assert await app.operators.list_items(operator="al", state="unresolved") == []
    pruned = await Pruner(app.database, Retention(finished_runs=timedelta(0),
                                                  evidence=None)).prune()
    assert pruned.runs == 1  # a finished run with nothing unsettled


async def test_a_reconciler_whose_claims_lapsed_in_a_slow_lookup_leaves_them_alone(app, sql):
    """A lookup that outlasts its claim (the items claimed after it in the same batch wait
    for it too) lets a second reconciler claim those items, look them up and settle them. The
    first then leaves them be: it looks up no item it no longer holds, and its late answer is
    kept in the item's history under a number of its own but not acted on (no second
    settlement, audit row, journal entry or count)."""
    from orchestrator import Committed

    started, release = asyncio.Event(), asyncio.Event()
    looked: list[int] = []

    @app.tool(timeout=timedelta(seconds=0.3))
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        await never_answers()

    @charge.lookup
    async def find(ctx, *, order):  # type: ignore[no-untyped-def]
        looked.append(ctx.operation_id)
        if len(looked) == 1:  # the first lookup is slow
            started.set()
            await release.wait()
        return Committed({"order": order})

    @app.workflow()
    async def wf(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    async with running(app):
        runs = [await app.submit_async(wf, order) for order in ("o-1", "o-2")]
        for run in runs:
            await wait_for(parked(sql, run))
        slow = asyncio.ensure_future(app.create_reconciler(batch=2).run_once())
        await asyncio.wait_for(started.wait(), 10)
        # Both claims lapse while the first lookup runs, as they would in a longer one.
        sql("UPDATE orchestrator.reconciliation_items "
            "SET claimed_until = now() - interval '1 second'")
        assert await app.create_reconciler().run_once() == 2  # taken over, both settled
        release.set()
        await asyncio.wait_for(slow, 10)
        assert [await run.result_async(timeout=10) for run in runs] == [
            {"order": "o-1"}, {"order": "o-2"}]
    assert len(looked) == 3 and len(set(looked)) == 2  # the held-up item alone twice
    history: dict[int, list[int]] = {}
    for row in sql("SELECT i.operation_id, l.attempt FROM orchestrator.reconciliation_lookups l "
                   "JOIN orchestrator.reconciliation_items i ON i.id = l.item_id ORDER BY l.id"):
        history.setdefault(row["operation_id"], []).append(row["attempt"])
    assert sorted(history.values()) == [[1], [1, 2]]  # every lookup kept, numbered in turn
    audit = sql("SELECT operator, action FROM orchestrator.operator_audit ORDER BY id")
    assert [(a["operator"], a["action"]) for a in audit] == [
        ("reconciler", "resolve.committed")] * 2
    completed = sql("SELECT count(*) AS n FROM orchestrator.journal "
                    "WHERE kind = 'call.completed'")
    assert completed == [{"n": 2}]
    assert app.metrics.snapshot()["reconciliation_auto_committed"] == 2


async def test_a_lookup_answer_come_after_an_operators_other_resolution_is_a_conflict(
        app, sql, caplog):
    """An operator settles an item while its lookup is out: the lookup's answer is kept in the
    history but not acted on, and as it contradicts the settlement it is logged as a
    conflict."""
    from orchestrator import Committed

    started, release = asyncio.Event(), asyncio.Event()

    @app.tool(timeout=timedelta(seconds=0.3))
    async def charge(ctx):  # type: ignore[no-untyped-def]
        await never_answers()

    @charge.lookup
    async def find(ctx):  # type: ignore[no-untyped-def]
        started.set()
        await release.wait()
        return Committed({"id": "ch_1"})

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(parked(sql, run))
    [op] = operations(sql)
    looking = asyncio.ensure_future(app.create_reconciler().run_once())
    await asyncio.wait_for(started.wait(), 10)
    await app.operators.resolve_not_applied(op["id"], evidence="not in the ledger",
                                            operator="al", then="fail")
    release.set()
    assert await asyncio.wait_for(looking, 10) == 1
    assert sql("SELECT attempt, answer FROM orchestrator.reconciliation_lookups") == [
        {"attempt": 1, "answer": "committed"}]
    audit = sql("SELECT operator, action FROM orchestrator.operator_audit")
    assert [(a["operator"], a["action"]) for a in audit] == [("al", "resolve.not_applied")]
    conflicts = [r for r in caplog.records if getattr(r, "code", None) == "RESOLUTION_CONFLICT"]
    assert [r.levelname for r in conflicts] == ["WARNING"]


def _parked_with_a_held_lookup(app, answer):  # type: ignore[no-untyped-def]
    """``charge`` times out (its outcome unknown); its lookup waits for ``release``, then
    answers ``answer``. Returns (wf, started, release)."""
    started, release = asyncio.Event(), asyncio.Event()

    @app.tool(timeout=timedelta(seconds=0.3))
    async def charge(ctx):  # type: ignore[no-untyped-def]
        await never_answers()

    @charge.lookup
    async def find(ctx):  # type: ignore[no-untyped-def]
        started.set()
        await release.wait()
        return answer

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    return wf, started, release


def _conflict_kept(sql, app, op_id):  # type: ignore[no-untyped-def]
    """The incident that keeps a lookup's answer contradicting the operation's settlement,
    read as an incident reader: (its summary row, its detail)."""
    [row] = sql("SELECT ref, code, phase, cause FROM orchestrator.incidents "
                "WHERE operation_id = %s AND cause = 'resolution_conflict'", (op_id,))
    return row, app.operators.incident(row["ref"], operator="al")


async def test_a_lookup_that_contradicts_an_operators_resolution_keeps_its_receipt(
        app, sql, caplog):
    """A lookup that answers committed after an operator settled the item otherwise is not
    acted on, but its receipt is the provider's word that the effect was applied: it is kept
    in an incident of the operation (which ``ops show`` lists), beside the resolution it
    contradicts, and the warning names that incident."""
    from orchestrator import Committed
    from orchestrator.canonical import canonical_json, text_digest

    wf, started, release = _parked_with_a_held_lookup(app, Committed({"id": "ch_1"}))
    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(parked(sql, run))
    [op] = operations(sql)
    reconciler = app.create_reconciler()
    looking = asyncio.ensure_future(reconciler.run_once())
    await asyncio.wait_for(started.wait(), 10)
    await app.operators.resolve_not_applied(op["id"], evidence="not in the ledger",
                                            operator="al", then="fail")
    release.set()
    assert await asyncio.wait_for(looking, 10) == 1
    shown = await app.operators.show(op["id"], operator="al")
    assert shown["resolution"] == "not_applied"  # the resolution stands
    row, kept = _conflict_kept(sql, app, op["id"])
    assert (row["code"], row["phase"]) == ("LOOKUP", "lookup")
    assert row["ref"] in [x["ref"] for x in shown["incidents"]]
    assert (await kept)["detail"] == {
        "tool": "charge", "reconciler": reconciler.id, "answer": "committed",
        "receipt": {"id": "ch_1"},
        "receipt_digest": text_digest(canonical_json({"id": "ch_1"})),
        "resolution": "not_applied", "lookup_incident": None}
    [warning] = [r for r in caplog.records if getattr(r, "code", None) == "RESOLUTION_CONFLICT"]
    assert warning.incident == row["ref"] and row["ref"] in warning.getMessage()


async def test_a_lookup_answer_contradicted_just_after_it_was_recorded_is_kept_too(
        app, sql, monkeypatch, caplog):
    """An operator who settles the item otherwise between the recording of a lookup's
    committed answer and the resolution it leads to: the reconciler's resolution is refused,
    the operator's stands, and the lookup's receipt is kept and logged as the conflict it is
    (not as a failed reconciliation step)."""
    from orchestrator import Committed
    from orchestrator.reconcile import Reconciler

    wf, started, release = _parked_with_a_held_lookup(app, Committed({"id": "ch_2"}))
    release.set()
    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(parked(sql, run))
    [op] = operations(sql)
    record = Reconciler._record

    async def then_an_operator(self, item, *args, **kwargs):  # type: ignore[no-untyped-def]
        recorded = await record(self, item, *args, **kwargs)
        await app.operators.abandon(op["id"], evidence="written off", operator="al")
        return recorded

    monkeypatch.setattr(Reconciler, "_record", then_an_operator)
    assert await app.create_reconciler().run_once() == 1
    shown = await app.operators.show(op["id"], operator="al")
    assert shown["resolution"] == "abandoned"
    _, kept = _conflict_kept(sql, app, op["id"])
    detail = (await kept)["detail"]
    assert (detail["answer"], detail["receipt"], detail["resolution"]) == (
        "committed", {"id": "ch_2"}, "abandoned")
    conflicts = [r for r in caplog.records if getattr(r, "code", None) == "RESOLUTION_CONFLICT"]
    assert [r.levelname for r in conflicts] == ["WARNING"]
    assert "reconciliation step failed" not in caplog.text


def _two_parked_with_a_held_lookup(app):  # type: ignore[no-untyped-def]
    """``charge`` times out (its outcome unknown); the first lookup waits for ``release``,
    the others answer committed at once. Returns (wf, started, release, looked)."""
    from orchestrator import Committed

    started, release = asyncio.Event(), asyncio.Event()
    looked: list[int] = []

    @app.tool(timeout=timedelta(seconds=0.3))
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        await never_answers()

    @charge.lookup
    async def find(ctx, *, order):  # type: ignore[no-untyped-def]
        looked.append(ctx.operation_id)
        if len(looked) == 1:
            started.set()
            await release.wait()
        return Committed({"order": order})

    @app.workflow()
    async def wf(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    return wf, started, release, looked


async def test_a_lookup_that_swallows_its_cancellation_holds_the_reconciler_no_longer(
        app, sql, caplog):  # type: ignore[no-untyped-def]
    """A lookup that catches ``CancelledError`` and goes on (here for 8 s) held the reconciler
    past ``lookup_timeout``: the timeout cancelled it and then waited for it, and no other item
    was looked up meanwhile (a stop waited for it the same way). It is given a moment once
    cancelled, then left behind, its answer recorded as a timeout."""
    import logging

    from orchestrator import Committed

    @app.tool(timeout=timedelta(seconds=0.3))
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        await never_answers()

    @charge.lookup
    async def find(ctx, *, order):  # type: ignore[no-untyped-def]
        loop = asyncio.get_running_loop()
        ends = loop.time() + 8
        while loop.time() < ends:
            try:
                await asyncio.sleep(ends - loop.time())
            except asyncio.CancelledError:
                pass
        return Committed({"order": order})

    @app.workflow()
    async def wf(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    async with running(app):
        run = await app.submit_async(wf, "o-1")
        await wait_for(parked(sql, run))
    caplog.set_level(logging.WARNING, logger="orchestrator")
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert await asyncio.wait_for(app.create_reconciler(lookup_timeout=0.5).run_once(), 30) == 1
    assert loop.time() - started < 4, "the reconciler waited for the lookup"
    assert sql("SELECT answer FROM orchestrator.reconciliation_lookups") == [
        {"answer": "still_unknown"}]
    assert "did not end when it was cancelled" in caplog.text


async def test_a_stopping_reconciler_records_the_lookup_under_way_and_starts_no_other(
        app, sql):  # type: ignore[no-untyped-def]
    """SIGTERM (``request_stop``) lets the lookup under way answer and its answer be recorded,
    then the reconciler stops: it does not go on through the rest of its batch (each lookup
    may take up to ``lookup_timeout``, and a container's stop grace period is short)."""
    wf, started, release, looked = _two_parked_with_a_held_lookup(app)
    async with running(app):
        runs = [await app.submit_async(wf, order) for order in ("o-1", "o-2")]
        for run in runs:
            await wait_for(parked(sql, run))
    reconciler = app.create_reconciler(batch=2)
    task = asyncio.ensure_future(reconciler.run())
    await asyncio.wait_for(started.wait(), 10)
    reconciler.request_stop()
    release.set()
    await asyncio.wait_for(task, 10)
    assert len(looked) == 1
    states = sql("SELECT state FROM orchestrator.reconciliation_items ORDER BY id")
    assert sorted(s["state"] for s in states) == ["open", "resolved"]


async def test_a_stopping_reconciler_gives_back_the_items_it_did_not_look_up(
        app, sql):  # type: ignore[no-untyped-def]
    """A graceful stop releases the claims on the items of its batch that it did not begin to
    look up, so another reconciler takes them at once instead of after the claims lapse
    (``lookup_timeout`` + 30 s); another reconciler's claim is not touched."""
    from orchestrator.db import reconciliation as recon_db

    wf, started, release, looked = _two_parked_with_a_held_lookup(app)
    async with running(app):
        runs = [await app.submit_async(wf, order) for order in ("o-1", "o-2", "o-3")]
        for run in runs:
            await wait_for(parked(sql, run))
    sql("""UPDATE orchestrator.reconciliation_items SET claimed_by = 'reconciler:other',
           claimed_until = now() + interval '1 hour' WHERE run_id = %s""", (runs[2].id,))
    reconciler = app.create_reconciler(batch=3)
    task = asyncio.ensure_future(reconciler.run())
    await asyncio.wait_for(started.wait(), 10)
    reconciler.request_stop()
    release.set()
    await asyncio.wait_for(task, 10)
    assert len(looked) == 1
    items = {i["run_id"]: i for i in sql(
        "SELECT run_id, state, claimed_by, claimed_until FROM orchestrator.reconciliation_items")}
    (left,) = [run.id for run in runs[:2] if items[run.id]["state"] == "open"]
    assert (items[left]["claimed_by"], items[left]["claimed_until"]) == (None, None)
    assert items[runs[2].id]["claimed_by"] == "reconciler:other"
    async with app.database.connection() as conn:  # only its own claims: the guard in SQL
        foreign = sql("SELECT id FROM orchestrator.reconciliation_items WHERE run_id = %s",
                      (runs[2].id,))[0]["id"]
        assert await recon_db.recon_claim_release(conn, item_ids=[foreign],
                                                  claimer=reconciler.id) == 0
    assert sql("SELECT claimed_by FROM orchestrator.reconciliation_items WHERE run_id = %s",
               (runs[2].id,)) == [{"claimed_by": "reconciler:other"}]
    # another reconciler takes the released item now, not once its claim would have lapsed
    assert await app.create_reconciler(batch=3).run_once() == 1
    assert len(looked) == 2
    assert sql("SELECT state FROM orchestrator.reconciliation_items WHERE run_id = %s",
               (left,)) == [{"state": "resolved"}]


async def test_a_second_stop_ends_the_reconciler_without_waiting_for_its_lookup(
        app, sql, caplog):  # type: ignore[no-untyped-def]
    """Asked again to stop (Ctrl-C twice, a second SIGTERM), the reconciler stops at once: the
    lookup under way, which may take up to ``lookup_timeout``, is cancelled and nothing of it
    is recorded; the item is looked up again once its claim lapses."""
    import logging

    wf, started, release, looked = _two_parked_with_a_held_lookup(app)
    async with running(app):
        run = await app.submit_async(wf, "o-1")
        await wait_for(parked(sql, run))
    caplog.set_level(logging.WARNING, logger="orchestrator")
    reconciler = app.create_reconciler(lookup_timeout=60)
    task = asyncio.ensure_future(reconciler.run())
    await asyncio.wait_for(started.wait(), 10)
    reconciler.request_stop()
    assert not task.done()
    reconciler.request_stop()
    await asyncio.wait_for(task, 5)
    assert "stopping now" in caplog.text
    assert sql("SELECT count(*) AS n FROM orchestrator.reconciliation_lookups") == [{"n": 0}]
    assert sql("SELECT state FROM orchestrator.reconciliation_items") == [{"state": "open"}]
