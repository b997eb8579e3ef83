"""Failures done right (CONTRACT C7, C10): durable retries, one deadline, cancellation at every
admission boundary, and safe errors."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from orchestrator import RunFailed, ToolError, ToolFailed
from orchestrator.recovery import RetryPolicy
from tests.integration.conftest import never_answers, running, wait_for

ROOT = Path(__file__).resolve().parents[2]
FAST = RetryPolicy(max_attempts=3, base_delay_ms=1200, max_delay_ms=5000)


def _states(sql):  # type: ignore[no-untyped-def]
    return [o["state"] for o in sql("SELECT state FROM orchestrator.operations ORDER BY id")]


async def test_a_flaky_idempotent_tool_succeeds_on_the_third_attempt(app, sql):
    keys: list[str] = []

    @app.tool(effect="idempotent", retry=FAST)
    async def flaky(ctx):  # type: ignore[no-untyped-def]
        keys.append(ctx.idempotency_key)
        if len(keys) < 3:
            raise ToolError.before_send("connection", "connection refused")
        return {"ok": len(keys)}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(flaky)

    async with running(app) as worker:
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=30) == {"ok": 3}
    assert len(keys) == 3 and len(set(keys)) == 3  # each attempt is a new identity
    assert _states(sql) == ["failed", "failed", "committed"]
    backoffs = [e.payload for e in await run.journal_async() if e.kind == "call.retrying"]
    assert [b["attempt"] for b in backoffs] == [1, 2]
    assert 0 <= backoffs[0]["delay_ms"] < 1200 and 0 <= backoffs[1]["delay_ms"] < 2400
    assert worker.claimed >= 1  # backoffs longer than a moment park the run durably
    assert app.metrics.snapshot()["operations_retried"] == 2


async def test_a_rate_limit_hint_is_honoured_and_an_invalid_one_stops(app, sql):
    calls: list[str] = []

    @app.tool(effect="idempotent", retry=FAST)
    async def limited(ctx, *, hint):  # type: ignore[no-untyped-def]
        calls.append(hint)
        if len(calls) == 1 or hint == "garbage":
            raise ToolError.from_status(429, proves_not_applied=True, retry_after=hint)
        return "ok"

    @app.workflow()
    async def wf(ctx, hint):  # type: ignore[no-untyped-def]
        try:
            return await ctx.call(limited, hint=hint)
        except ToolFailed as exc:
            return [exc.cause, exc.reason]

    async with running(app):
        good = await app.submit_async(wf, "1")
        assert await good.result_async(timeout=30) == "ok"
        retrying = [e.payload for e in await good.journal_async() if e.kind == "call.retrying"]
        assert retrying[0]["delay_ms"] >= 1000
        bad = await app.submit_async(wf, "garbage")
        assert await bad.result_async(timeout=30) == ["rate_limited", "budget"]


async def test_a_rate_limit_hint_that_does_not_parse_or_is_out_of_range_stops_the_call(app, sql):
    """Digits ``int()`` refuses or reads otherwise (another script's, too many), a date out of
    range and a pause longer than any interval are a hint that does not parse or cannot be
    kept: the call fails ``budget``, and the tool's dispatch is not paused for ever."""
    hints = ["\u00b2", "\u0663", "9" * 5000, "Fri, 31 Dec 99999 23:59:59 GMT",
             "Mon, 01 Jan 2000 00:00:00 +9999999999999999999", "9" * 19]

    @app.tool(effect="idempotent", retry=FAST)
    async def limited(ctx, *, hint):  # type: ignore[no-untyped-def]
        raise ToolError.from_status(429, proves_not_applied=True, retry_after=hint)

    @app.workflow()
    async def wf(ctx, hint):  # type: ignore[no-untyped-def]
        try:
            return await ctx.call(limited, hint=hint)
        except ToolFailed as exc:
            return [exc.cause, exc.reason]

    async with running(app):
        for hint in hints:
            run = await app.submit_async(wf, hint)
            assert await run.result_async(timeout=30) == ["rate_limited", "budget"], hint
    assert sql("SELECT backoff_until FROM orchestrator.tool_limits "
               "WHERE backoff_until > now() + interval '1 day'") == []


async def test_an_uncertain_attempt_is_repeated_after_the_policys_backoff(app, sql):
    """An idempotent tool that timed out after sending is re-sent with the same key, and a
    read repeated, only after the policy's backoff, as for a retry: a provider that just
    timed out is not asked again at once. The wait is durable: the entry keeps when."""
    sent: list[tuple[str, str, float]] = []

    @app.tool(effect="idempotent", retry=FAST)
    async def reserve(ctx):  # type: ignore[no-untyped-def]
        sent.append(("reserve", ctx.idempotency_key, time.monotonic()))
        if len(sent) < 3:
            raise ToolError.after_send("timeout", "the provider did not answer")
        return "reserved"

    @app.tool(effect="read", retry=FAST)
    async def look(ctx):  # type: ignore[no-untyped-def]
        sent.append(("look", ctx.idempotency_key, time.monotonic()))
        if sum(1 for s in sent if s[0] == "look") < 2:
            raise RuntimeError("the read broke off")
        return "seen"

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return [await ctx.call(reserve), await ctx.call(look)]

    async with running(app):
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=30) == ["reserved", "seen"]
    reserves = [s for s in sent if s[0] == "reserve"]
    assert len({key for _, key, _ in reserves}) == 1  # re-sent with the same key
    unknown = [e.payload for e in await run.journal_async() if e.kind == "call.unknown"]
    assert [u["next"] for u in unknown] == ["resend", "resend", "new_attempt"]
    windows = [1200, 2400, 1200]  # the window after attempt 1, 2 of reserve; 1 of look
    for payload, window in zip(unknown, windows, strict=True):
        assert 0 <= payload.get("delay_ms", 0) < window
    delays = [u.get("delay_ms", 0) for u in unknown]
    assert delays[0] or delays[1] or delays[2], "no backoff at all (three draws of zero)"
    gaps = [reserves[1][2] - reserves[0][2], reserves[2][2] - reserves[1][2],
            sent[-1][2] - sent[-2][2]]
    for gap, delay in zip(gaps, delays, strict=True):
        assert gap >= delay / 1000 - 0.05  # the clock's resolution


async def test_definitive_failures_are_not_retried(app, sql):
    calls = 0

    @app.tool(effect="idempotent", retry=FAST)
    async def conflict(ctx):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        raise ToolError.from_status(409, "duplicate order", proves_not_applied=True)

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        try:
            await ctx.call(conflict)
        except ToolFailed as exc:
            return [exc.cause, exc.reason, exc.retryable]

    async with running(app):
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=10) == ["conflict", "cause", False]
    assert calls == 1 and _states(sql) == ["failed"]


async def test_a_consequential_tool_that_times_out_after_sending_is_not_retried(app, sql):
    calls = 0

    @app.tool(timeout=timedelta(seconds=0.3), retry=RetryPolicy(max_attempts=3))
    async def charge(ctx):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        await never_answers()

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    async with running(app):
        await app.submit_async(wf, {})
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs "
                                   "WHERE status = 'needs_reconciliation'"))
    assert calls == 1 and _states(sql) == ["unknown"]
    item = sql("SELECT reason FROM orchestrator.reconciliation_items")
    assert item == [{"reason": "TOOL_OUTCOME_UNCERTAIN"}]


async def test_the_deadline_expires_during_a_backoff(make_app, sql):
    calls = 0

    def build():  # type: ignore[no-untyped-def]
        app = make_app()

        @app.tool(effect="idempotent", retry=FAST)
        async def flaky(ctx):  # type: ignore[no-untyped-def]
            nonlocal calls
            calls += 1
            raise ToolError.before_send("connection", retry_after=1)

        @app.workflow()
        async def wf(ctx, data):  # type: ignore[no-untyped-def]
            return await ctx.call(flaky)

        return app, wf

    app, wf = build()
    async with running(app):
        run = await app.submit_async(wf, {}, deadline=timedelta(seconds=2))
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs WHERE status = 'waiting'"))
    # no worker while the backoff and then the deadline pass
    await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs WHERE deadline_at < now()"))
    later, _ = build()
    async with running(later):
        with pytest.raises(RunFailed) as info:
            await (await later.get_run_async(run.id)).result_async(timeout=15)
    assert info.value.code == "DEADLINE_EXCEEDED"
    assert calls == 1  # no other attempt


async def test_a_backoff_that_cannot_fit_the_deadline_stops_at_once(app, sql):
    calls = 0

    @app.tool(effect="idempotent", retry=RetryPolicy(max_attempts=3, max_delay_ms=60_000))
    async def flaky(ctx):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        raise ToolError.before_send("connection", retry_after=30)

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(flaky)

    async with running(app):
        run = await app.submit_async(wf, {}, deadline=timedelta(seconds=5))
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=10)
    assert info.value.code == "DEADLINE_EXCEEDED" and calls == 1


def _gated_app(make_app, stage):  # type: ignore[no-untyped-def]
    app = make_app()
    entered, release = asyncio.Event(), asyncio.Event()
    calls: list[str] = []

    @app.tool(authorize_timeout=timedelta(seconds=20), approve_timeout=timedelta(seconds=20))
    async def charge(ctx):  # type: ignore[no-untyped-def]
        calls.append("charge")
        return "charged"

    async def gate(pctx):  # type: ignore[no-untyped-def]
        entered.set()
        await release.wait()
        return True

    getattr(charge, stage)(gate)

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    return app, wf, entered, release, calls


@pytest.mark.parametrize("stage", ["authorize", "approve"])
async def test_cancel_while_a_policy_stage_waits_never_calls_the_tool(make_app, sql, stage):
    app, wf, entered, release, calls = _gated_app(make_app, stage)
    async with running(app):
        run = await app.submit_async(wf, {})
        await asyncio.wait_for(entered.wait(), 10)
        await run.cancel_async()
        release.set()
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=10)
    assert info.value.code == "CANCELLED"
    assert calls == []
    assert _states(sql) == ["cancelled"]


async def test_a_hung_authorize_hook_is_bounded_by_its_budget(make_app, sql):
    app = make_app()
    calls: list[str] = []

    @app.tool(authorize_timeout=timedelta(seconds=0.3))
    async def charge(ctx):  # type: ignore[no-untyped-def]
        calls.append("charge")

    @charge.authorize
    async def hang(pctx):  # type: ignore[no-untyped-def]
        await asyncio.Event().wait()

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        try:
            await ctx.call(charge)
        except ToolFailed as exc:
            return [exc.code, exc.cause]

    async with running(app):
        run = await app.submit_async(wf, {})
        assert await run.result_async(timeout=10) == ["TOOL_DENIED", "policy_timeout"]
    assert calls == [] and _states(sql) == ["cancelled"]


async def test_a_denying_app_wide_stage_and_an_allowing_one(make_app, sql):
    async def only_small(pctx):  # type: ignore[no-untyped-def]
        return pctx.arguments["cents"] < 100

    app = make_app(authorize=only_small)
    calls: list[int] = []

    @app.tool()
    async def charge(ctx, *, cents):  # type: ignore[no-untyped-def]
        calls.append(cents)
        return cents

    @app.workflow()
    async def wf(ctx, cents):  # type: ignore[no-untyped-def]
        try:
            return await ctx.call(charge, cents=cents)
        except ToolFailed as exc:
            return exc.code

    async with running(app):
        small = await app.submit_async(wf, 5)
        big = await app.submit_async(wf, 500)
        assert await small.result_async(timeout=10) == 5
        assert await big.result_async(timeout=10) == "TOOL_DENIED"
    assert calls == [5]


async def test_a_denied_call_raises_the_same_error_when_replayed(make_app, sql):
    """Workflow code that branches on a denial's code takes the same branch on every replay:
    the error a replay raises is the one the denial raised live (TOOL_DENIED, its stage and
    cause), not a generic failure."""
    async def deny_all(pctx):  # type: ignore[no-untyped-def]
        return False

    app = make_app(authorize=deny_all)

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        raise AssertionError("a denied tool is never called")

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        try:
            await ctx.call(charge)
        except ToolFailed as exc:
            seen = [exc.code, exc.message, exc.cause, exc.reason]
        await ctx.wait_for_event("go")  # parks: the next claim replays from the top
        return seen

    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(_parked(run), what="the run parked on its event")
        assert await app.send_event_async(run.id, "go", None)
        assert await run.result_async(timeout=10) == [
            "TOOL_DENIED", "tool charge was not allowed (authorize)", "denied", "cause"]


async def test_a_denials_incident_reference_is_the_same_on_replay(make_app, sql):
    """A denial that kept no diagnostics (the hook said no) still names one incident
    reference, the same on every replay: a workflow that passes it to a later call replays
    that call instead of failing with ``NONDETERMINISM``."""
    async def deny_all(pctx):  # type: ignore[no-untyped-def]
        return pctx.tool != "charge"

    app = make_app(authorize=deny_all)
    noted: list[str] = []

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        raise AssertionError("a denied tool is never called")

    @app.tool()
    async def note(ctx, *, ref):  # type: ignore[no-untyped-def]
        noted.append(ref)
        return ref

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        try:
            await ctx.call(charge)
        except ToolFailed as exc:
            ref = await ctx.call(note, ref=exc.incident)
        await ctx.wait_for_event("go")  # parks: the next claim replays from the top
        return ref

    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(_parked(run), what="the run parked on its event")
        assert await app.send_event_async(run.id, "go", None)
        ref = await run.result_async(timeout=10)
    assert noted == [ref] and ref.startswith("inc_")


def _parked(run):  # type: ignore[no-untyped-def]
    async def check() -> bool:
        return await run.status_async() == "waiting"
    return check


async def test_cancel_after_dispatch_leaves_the_operation_unknown(app, sql):
    signalled = asyncio.Event()
    started = asyncio.Event()

    @app.tool()
    async def slow(ctx):  # type: ignore[no-untyped-def]
        started.set()
        try:
            await never_answers()
        finally:
            if ctx.cancelled.is_set():
                signalled.set()

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(slow)

    async with running(app):
        run = await app.submit_async(wf, {})
        await asyncio.wait_for(started.wait(), 10)
        await run.cancel_async()
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs "
                                   "WHERE status = 'needs_reconciliation'"))
        assert signalled.is_set()
        assert _states(sql) == ["unknown"]  # interrupts waiting, not history
        (op,) = sql("SELECT id FROM orchestrator.operations")
        await app.operators.resolve_not_applied(op["id"], evidence="nothing at the provider",
                                                operator="alice")
        with pytest.raises(RunFailed) as info:  # only now, with nothing uncertain
            await run.result_async(timeout=10)
    assert info.value.code == "CANCELLED"


async def test_a_sensitive_string_stays_in_the_incident(make_app, sql, migrated_database_url,
                                                        caplog):
    secret = "sk_live_TOPSECRET_42"
    app = make_app(incident_readers=["alice"])

    @app.tool(effect="idempotent", retry=RetryPolicy(max_attempts=1))
    async def charge(ctx):  # type: ignore[no-untyped-def]
        raise ToolError.from_status(401, f"bad key {secret}", proves_not_applied=True)

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.call(charge)

    caplog.set_level(logging.DEBUG)
    async with running(app):
        run = await app.submit_async(wf, {})
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=10)
    public = [str(info.value), json.dumps(info.value.to_dict()), caplog.text,
              json.dumps(sql("SELECT * FROM orchestrator.runs"), default=str),
              json.dumps(sql("SELECT * FROM orchestrator.journal"), default=str)]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for args in (["runs", "show", str(run.id)], ["runs", "list"]):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "orchestrator", "--database-url", migrated_database_url,
            *args, env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
        out, err = await proc.communicate()
        public += [out.decode(), err.decode()]
    assert not [text for text in public if secret in text]
    refs = [r["ref"] for r in sql("SELECT ref FROM orchestrator.incidents "
                                  "WHERE detail::text LIKE %s", (f"%{secret}%",))]
    assert refs, "the incident record keeps the detail"
    shown = [text for text in public if "timeline" in text]
    assert shown and f"incident {refs[0]}" in shown[0]  # `runs show` names it in full
    row = await app.operators.incident(refs[0], operator="alice")
    assert secret in row["detail"]["message"]
    assert "in charge" in row["detail"]["traceback"]  # the stack, down to the tool's own frame
    from orchestrator import AccessDenied

    with pytest.raises(AccessDenied):
        await app.operators.incident(refs[0], operator="mallory")
    await app.database.close()
