"""Replay (CONTRACT C3, C4): recorded results come from the journal, effects never run twice,
a mismatch stops the run with NONDETERMINISM, and a run held in memory is not replayed."""

from __future__ import annotations

import asyncio
from datetime import timedelta

import pytest

from orchestrator import RunFailed, WorkflowError
from orchestrator.errors import SchemaUnsupported
from tests.integration.conftest import running, wait_for


async def test_a_resumed_run_replays_without_calling_recorded_tools(app, sql):
    calls: list[str] = []

    @app.tool()
    async def charge(ctx, *, cents):  # type: ignore[no-untyped-def]
        calls.append(ctx.idempotency_key)
        return {"charged": cents}

    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        first = await ctx.call(charge, cents=1)
        await ctx.sleep(timedelta(seconds=1.5))  # parks the run: the next claim replays
        second = await ctx.call(charge, cents=2)
        return [first, second]

    async with running(app) as worker:
        run = await app.submit_async(pay, {})
        assert await run.result_async(timeout=20) == [{"charged": 1}, {"charged": 2}]
    assert len(calls) == 2
    assert worker.claimed == 2  # claimed, parked on the timer, claimed again and replayed
    kinds = [e.kind for e in await run.journal_async()]
    assert kinds == ["call.submitted", "call.completed", "timer", "call.submitted",
                     "call.completed", "run.completed"]


async def test_recorded_now_uuid_and_random_are_stable_across_replay(app):
    seen: list[tuple[str, str, float]] = []

    @app.workflow()
    async def values(ctx, data):  # type: ignore[no-untyped-def]
        triple = (ctx.now().isoformat(), str(ctx.uuid()), ctx.random())
        seen.append(triple)
        await ctx.sleep(1.2)
        return list(triple)

    async with running(app):
        run = await app.submit_async(values, {})
        result = await run.result_async(timeout=20)
    assert len(seen) == 2  # first execution and the replay after the timer
    assert seen[0] == seen[1]
    assert result == list(seen[0])


async def test_a_different_command_at_a_recorded_position_is_nondeterminism(app):
    calls: list[str] = []
    flip = {"changed": False}

    @app.tool()
    async def a(ctx):  # type: ignore[no-untyped-def]
        calls.append("a")
        return "a"

    @app.tool()
    async def b(ctx):  # type: ignore[no-untyped-def]
        calls.append("b")
        return "b"

    @app.workflow()
    async def drifting(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.call(b if flip["changed"] else a)
        flip["changed"] = True  # the code "changes" before the replay
        await ctx.sleep(1.2)
        return "done"

    async with running(app):
        run = await app.submit_async(drifting, {})
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=20)
    assert info.value.code == "NONDETERMINISM"
    assert calls == ["a"]  # b was never dispatched


async def test_no_branch_takes_a_new_step_once_another_differs_from_the_journal(app, sql):
    """Branches issue their first commands up front, as the README asks; after a change, one
    branch's command differs from the journal. The run fails ``NONDETERMINISM`` and the other
    branch, which goes on after its event, sends nothing new, whether ``gather`` waits for
    the branch that differs or workflow code never awaits it; and a run whose code ends
    without another step does not succeed."""
    calls: list[str] = []
    flip = {"changed": False}

    @app.tool()
    async def reserve(ctx, *, via):  # type: ignore[no-untyped-def]
        calls.append(f"reserve {via}")
        return via

    @app.tool()
    async def charge(ctx, *, via):  # type: ignore[no-untyped-def]
        calls.append(f"charge {via}")
        return via

    @app.workflow()
    async def gathered(ctx, data):  # type: ignore[no-untyped-def]
        async def first():  # type: ignore[no-untyped-def]
            return await ctx.call(reserve, via="b" if flip["changed"] else "a")

        async def second():  # type: ignore[no-untyped-def]
            await ctx.wait_for_event("go")
            return await ctx.call(charge, via=data)

        return await ctx.gather(first(), second())

    @app.workflow()
    async def unawaited(ctx, data):  # type: ignore[no-untyped-def]
        asyncio.ensure_future(ctx.call(reserve, via="b" if flip["changed"] else "a"))
        await ctx.wait_for_event("go")
        return await ctx.call(charge, via=data)

    @app.workflow()
    async def quiet(ctx, data):  # type: ignore[no-untyped-def]
        asyncio.ensure_future(ctx.call(reserve, via="b" if flip["changed"] else "a"))
        return await ctx.wait_for_event("go")  # no new step after it: it just ends

    async with running(app):
        runs = [await app.submit_async(gathered, "gathered"),
                await app.submit_async(unawaited, "unawaited"),
                await app.submit_async(quiet, "quiet")]
        await wait_for(lambda: len(sql("SELECT 1 FROM orchestrator.runs "
                                       "WHERE status = 'waiting'")) == 3,
                       timeout=20, what="the runs parked on their events")
        flip["changed"] = True  # the code changes before the replays
        for run in runs:
            await app.send_event_async(run.id, "go")
            with pytest.raises(RunFailed) as info:
                await run.result_async(timeout=20)
            assert info.value.code == "NONDETERMINISM"
    assert calls == ["reserve a"] * 3  # no charge was sent


async def test_changed_arguments_at_a_recorded_position_are_nondeterminism(app):
    calls: list[int] = []
    state = {"n": 1}

    @app.tool()
    async def send(ctx, *, n):  # type: ignore[no-untyped-def]
        calls.append(n)
        return n

    @app.workflow()
    async def drifting(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.call(send, n=state["n"])
        state["n"] = 2
        await ctx.sleep(1.2)
        return "done"

    async with running(app):
        run = await app.submit_async(drifting, {})
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=20)
    assert info.value.code == "NONDETERMINISM"
    assert calls == [1]


async def test_a_run_in_memory_is_not_replayed_on_every_step(app, sql):
    calls = 0

    @app.tool()
    async def step(ctx, *, i):  # type: ignore[no-untyped-def]
        nonlocal calls
        calls += 1
        return i

    executions = 0

    @app.workflow()
    async def long(ctx, data):  # type: ignore[no-untyped-def]
        nonlocal executions
        executions += 1
        total = 0
        for i in range(60):
            total += await ctx.call(step, i=i)
        return total

    async with running(app) as worker:
        run = await app.submit_async(long, {})
        assert await run.result_async(timeout=30) == sum(range(60))
    assert executions == 1 and worker.claimed == 1 and calls == 60
    assert len(await run.journal_async()) == 121


async def test_public_failures_show_their_message_and_others_only_an_incident(app, sql):
    @app.workflow()
    async def deliberate(ctx, data):  # type: ignore[no-untyped-def]
        raise WorkflowError("the order was empty")

    @app.workflow()
    async def buggy(ctx, data):  # type: ignore[no-untyped-def]
        raise RuntimeError("secret-token-123 leaked")

    async with running(app):
        ok = await app.submit_async(deliberate, {})
        bad = await app.submit_async(buggy, {})
        with pytest.raises(RunFailed) as first:
            await ok.result_async(timeout=10)
        with pytest.raises(RunFailed) as second:
            await bad.result_async(timeout=10)
    assert first.value.code == "WORKFLOW_FAILED"
    assert "the order was empty" in first.value.message
    assert second.value.code == "WORKFLOW_FAILED"
    assert "secret-token-123" not in str(second.value)
    incident = sql("SELECT detail FROM orchestrator.incidents WHERE ref = %s",
                   (second.value.incident,))
    assert "secret-token-123" in incident[0]["detail"]["message"]
    # A deliberate failure's reference leads to a record too (its code and message).
    record = sql("SELECT code, detail FROM orchestrator.incidents WHERE ref = %s",
                 (first.value.incident,))
    assert record == [{"code": "WORKFLOW_FAILED", "detail": {"message": "the order was empty"}}]


async def test_a_call_entry_of_a_newer_schema_on_its_operation_row_is_refused(app, sql):
    """A call's entries are its operation row (migration 0019); their schema version is the
    row's ``entry_version``, refused like a stored entry's when newer than the code (C3)."""
    @app.tool()
    async def t(ctx):  # type: ignore[no-untyped-def]
        return {"ok": True}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.call(t)
        await ctx.sleep(30)

    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs")[0]["status"]
                       == "waiting")
    assert [e.kind for e in await run.journal_async()][:2] == [
        "call.submitted", "call.completed"]
    sql("ALTER TABLE orchestrator.operations DISABLE TRIGGER USER")
    assert sql("UPDATE orchestrator.operations SET entry_version = 99 "
               "WHERE seq IS NOT NULL RETURNING id")
    sql("ALTER TABLE orchestrator.operations ENABLE TRIGGER USER")
    sql("UPDATE orchestrator.runs SET available_at = now()")
    with pytest.raises(SchemaUnsupported) as info:
        await run.journal_async()
    assert info.value.code == "SCHEMA_UNSUPPORTED"
    async with running(app) as worker:
        await wait_for(lambda: worker.claimed >= 1)
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs")[0]["status"]
                       == "queued")
    assert sql("SELECT state FROM orchestrator.operations") == [{"state": "committed"}]


async def test_journal_events_from_a_newer_schema_are_refused(app, sql):
    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.sleep(30)

    async with running(app):
        run = await app.submit_async(wf, {})
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs")[0]["status"]
                       == "waiting")
    sql("""INSERT INTO orchestrator.journal_entries (run_id, seq, kind, position, name,
                                                     schema_version, payload, lease_token)
           SELECT id, revision + 1, 'from.the.future', 1, 'x', 99, '{}', lease_token
           FROM orchestrator.runs""")
    sql("UPDATE orchestrator.runs SET revision = revision + 1, available_at = now()")
    with pytest.raises(SchemaUnsupported) as info:
        await run.journal_async()
    assert info.value.code == "SCHEMA_UNSUPPORTED"
    async with running(app) as worker:
        await wait_for(lambda: worker.claimed >= 1)
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs")[0]["status"]
                       == "queued")
    # The run was released untouched: not failed, not interpreted.
    row = sql("SELECT status, revision FROM orchestrator.runs")[0]
    assert row["status"] == "queued" and row["revision"] == 2
