"""orchestrator.testing against a real database: running a worker until idle, and fault gates
that hold the engine at a named point."""

from __future__ import annotations

import uuid

import pytest

from orchestrator.errors import AccessDenied, InvalidRequest
from orchestrator.testing import (
    fault_gate,
    replay,
    replay_async,
    run_until_idle,
    run_until_idle_sync,
)
from tests.integration.conftest import never_answers, one_turn, running, wait_for


def _ops(sql):  # type: ignore[no-untyped-def]
    return [(o["tool_name"], o["state"]) for o in sql(
        "SELECT tool_name, state FROM orchestrator.operations ORDER BY id")]


async def test_run_until_idle_runs_everything_ready_then_stops(app, sql):
    @app.workflow()
    async def double(ctx, data):  # type: ignore[no-untyped-def]
        return data * 2

    runs = [await app.submit_async(double, n) for n in range(3)]
    worker = await run_until_idle(app, poll_interval=0.05)
    assert worker.claimed == 3 and worker.active_runs == 0
    assert [await r.result_async(timeout=1) for r in runs] == [0, 2, 4]
    assert sql("SELECT count(*) AS n FROM orchestrator.workers")[0]["n"] == 0  # it stopped
    await app.database.close()


async def test_run_until_idle_for_given_runs_stops_at_a_wait(app, sql):
    @app.workflow()
    async def approval(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.wait_for_event("approved")

    run = await app.submit_async(approval, {})
    await run_until_idle(app, runs=[run], poll_interval=0.05)
    assert await run.status_async() == "waiting"
    await app.send_event_async(run.id, "approved", {"by": "carol"})
    await run_until_idle(app, runs=[run.id], poll_interval=0.05)
    assert await run.result_async(timeout=1) == {"by": "carol"}
    await app.database.close()


async def test_run_until_idle_says_what_it_waited_for(app, sql):
    @app.tool(effect="read")
    async def forever(ctx):  # type: ignore[no-untyped-def]
        await never_answers()

    @app.workflow()
    async def stuck(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(forever)

    run = await app.submit_async(stuck, {})
    with pytest.raises(AssertionError, match=f"runs {run.id} ended or waiting"):
        await run_until_idle(app, runs=[run], timeout=0.5, poll_interval=0.05,
                             drain_timeout=0.1)
    await app.database.close()


async def test_run_until_idle_for_given_runs_drives_their_children_and_successors(app):
    """A run that waits for a child is not idle while the child (or its own child) has work:
    ``runs=[parent]`` means the parent and every run started under it, and the run it
    continued as, as ``result()`` follows it."""
    @app.workflow()
    async def grandkid(ctx, n):  # type: ignore[no-untyped-def]
        await ctx.sleep(0.3)  # slept in memory: the run stays running meanwhile
        return n + 1

    @app.workflow()
    async def kid(ctx, n):  # type: ignore[no-untyped-def]
        return await ctx.run_child(grandkid, n) * 10

    @app.workflow()
    async def parent(ctx, n):  # type: ignore[no-untyped-def]
        if n == 0:
            ctx.continue_as_new(1)
        return await ctx.run_child(kid, n)

    run = await app.submit_async(parent, 0)
    await run_until_idle(app, runs=[run], poll_interval=0.05)
    assert await run.result_async(timeout=0.1) == 20
    await app.database.close()


async def test_run_until_idle_waits_for_timers_within_the_horizon_given(app):
    """A durable timer (a sleep over 1 s) leaves its run ``waiting``, which is idle; with
    ``timers_within=S`` a timer due within S seconds of the call is waited for and driven."""
    @app.workflow()
    async def naps(ctx, seconds):  # type: ignore[no-untyped-def]
        await ctx.sleep(seconds)
        return "rested"

    run = await app.submit_async(naps, 1.5)
    await run_until_idle(app, runs=[run], poll_interval=0.05)
    assert await run.status_async() == "waiting"  # the default: a timer is something to wait for
    await run_until_idle(app, runs=[run], timers_within=3, poll_interval=0.05)
    assert await run.result_async(timeout=0.1) == "rested"

    later, soon = await app.submit_async(naps, 60), await app.submit_async(naps, 1.5)
    await run_until_idle(app, timers_within=3, poll_interval=0.05)  # every run of the app
    assert await soon.result_async(timeout=0.1) == "rested"
    assert await later.status_async() == "waiting"  # beyond the horizon
    for bad in (-1, float("nan"), "3", True):
        with pytest.raises(InvalidRequest, match="timers_within") as refused:
            await run_until_idle(app, timers_within=bad)  # type: ignore[arg-type]
        assert refused.value.code == "INVALID_REQUEST" and refused.value.path == "timers_within"
    await app.database.close()


async def test_run_until_idle_for_a_held_back_run_waits_for_its_start_only_within_the_horizon(
        app):
    """A run held back (``delay=``, ``start_at=``) is queued but not due: idle, as without
    ``runs``, instead of an ``AssertionError`` after ``timeout`` although nothing could
    happen; one whose start falls within ``timers_within`` is driven."""
    from datetime import timedelta

    @app.workflow()
    async def later(ctx, n):  # type: ignore[no-untyped-def]
        return n

    held = await app.submit_async(later, 1, delay=timedelta(hours=1))
    await run_until_idle(app, runs=[held], timeout=5, poll_interval=0.05)
    assert await held.status_async() == "queued"
    soon = await app.submit_async(later, 2, delay=timedelta(seconds=1.5))
    await run_until_idle(app, runs=[held, soon], timers_within=3, timeout=10,
                         poll_interval=0.05)
    assert await soon.result_async(timeout=0.1) == 2
    assert await held.status_async() == "queued"
    await app.database.close()


async def test_run_until_idle_counts_a_run_its_queue_holds_back_as_idle(app):
    """A run that its queue keeps from starting until something outside the worker happens
    (the queue paused, or its slots held by runs that wait for an event) is idle, as a
    held-back start is, instead of an ``AssertionError`` after ``timeout`` although nothing
    could happen; once the slot is free or the queue resumed, it is driven."""
    app.queue("exports", concurrency=1)

    @app.workflow(queue="exports")
    async def export(ctx, n):  # type: ignore[no-untyped-def]
        return await ctx.wait_for_event("go")

    first = await app.submit_async(export, 1)
    second = await app.submit_async(export, 2)  # behind the slot that first holds, parked
    await run_until_idle(app, runs=[first, second], timeout=8, poll_interval=0.05)
    assert [await first.status_async(), await second.status_async()] == ["waiting", "queued"]
    await run_until_idle(app, timeout=8, poll_interval=0.05)  # the app-wide form too
    await app.send_event_async(first.id, "go", "a")
    await run_until_idle(app, runs=[first, second], timeout=8, poll_interval=0.05)
    assert await first.result_async(timeout=0.1) == "a"
    assert await second.status_async() == "waiting"
    await app.send_event_async(second.id, "go", "b")
    await run_until_idle(app, runs=[second], timeout=8, poll_interval=0.05)
    await app.queues.pause_async("exports")
    third = await app.submit_async(export, 3)
    await run_until_idle(app, runs=[third], timeout=8, poll_interval=0.05)
    await run_until_idle(app, timeout=8, poll_interval=0.05)
    assert await third.status_async() == "queued"
    await app.queues.resume_async("exports")
    await run_until_idle(app, runs=[third], timeout=8, poll_interval=0.05)
    assert await third.status_async() == "waiting"
    await app.database.close()


async def test_run_until_idle_judges_a_family_of_runs_from_one_snapshot(app, sql, monkeypatch):
    """Idle is judged from one snapshot of the runs: a child that ends and wakes its parent
    between the reads of the parent and of the child must not look like a parent still
    waiting beside a finished child (idle: the worker stopped with the parent due, and
    ``result()`` timed out). Fabricated: the child is made ``running``, and it ends, waking
    its parent, right after the parent was read."""
    from orchestrator import testing
    from orchestrator.db import runs as runs_db

    @app.workflow()
    async def kid(ctx, n):  # type: ignore[no-untyped-def]
        return await ctx.wait_for_event("go")

    @app.workflow()
    async def parent(ctx, n):  # type: ignore[no-untyped-def]
        return await ctx.run_child(kid, n)

    run = await app.submit_async(parent, 1)
    await run_until_idle(app, runs=[run], poll_interval=0.05)
    (child,) = sql("SELECT id FROM orchestrator.runs WHERE parent_run_id = %s", (run.id,))
    sql("UPDATE orchestrator.runs SET status = 'running', lease_owner = 'elsewhere', "
        "lease_expires_at = now() + interval '1 minute', available_at = NULL WHERE id = %s",
        (child["id"],))
    reads = runs_db.run_list

    async def the_child_ends_meanwhile(*args, **kwargs):  # type: ignore[no-untyped-def]
        sql("UPDATE orchestrator.runs SET status = 'succeeded', finished_at = now(), "
            "lease_owner = NULL, lease_expires_at = NULL WHERE id = %s", (child["id"],))
        sql("UPDATE orchestrator.runs SET available_at = now() WHERE id = %s", (run.id,))
        monkeypatch.setattr(runs_db, "run_list", reads)
        return await reads(*args, **kwargs)

    monkeypatch.setattr(runs_db, "run_list", the_child_ends_meanwhile)
    horizon = testing._horizon(0)
    assert await testing._settled(app, [run.id], horizon, 100) is False  # as first read
    assert await testing._settled(app, [run.id], horizon, 100) is False  # the parent is due
    await app.database.close()


def test_run_until_idle_sync_serves_the_sync_api(app):
    @app.workflow()
    async def hello(ctx, data):  # type: ignore[no-untyped-def]
        return f"hello {data}"

    run = app.submit(hello, "world")
    worker = run_until_idle_sync(app, poll_interval=0.05)
    assert worker.claimed == 1 and run.result(timeout=1) == "hello world"


async def test_a_run_the_database_does_not_hold_is_access_denied_as_in_the_app(app):
    """An unknown run id given to run_until_idle or replay is refused as ``app.get_run``
    refuses it (``ACCESS_DENIED``), and text that is not one as ``app.get_run`` refuses that
    (``INVALID_REQUEST``, ``path`` ``run_id``), not with a bare ValueError."""
    @app.workflow()
    async def hello(ctx, data):  # type: ignore[no-untyped-def]
        return data

    for missing, refusal in ((uuid.uuid4(), AccessDenied), ("not-a-run-id", InvalidRequest)):
        with pytest.raises(refusal) as refused:
            await run_until_idle(app, runs=[missing], poll_interval=0.05)
        assert refused.value.code == refusal.code
        with pytest.raises(refusal):
            await replay_async(app, [missing])


def test_replay_sync_refuses_an_unknown_run_as_the_app_does(app):
    with pytest.raises(AccessDenied):
        replay(app, [uuid.uuid4()])


async def test_one_run_given_where_a_list_is_taken_is_refused_saying_so(app, sql):
    """``replay`` and ``run_until_idle`` take a list of journals or runs. One given bare was
    iterated: an export document by its keys, a run id by its characters (each then refused
    as a run that does not exist: ``ACCESS_DENIED``, which sent the reader looking for a
    missing run), a handle or a UUID with a ``TypeError``. A type checker passes the first
    two (a ``str`` and a ``dict`` are iterables of ``str``). It is ``INVALID_REQUEST`` naming
    the argument and saying to wrap it in a list; nothing is run or read."""
    @app.workflow()
    async def hello(ctx, data):  # type: ignore[no-untyped-def]
        return data

    run = await app.submit_async(hello, 1)
    document = {"format": "orchestrator.run/1", "run": {"id": str(run.id)}, "journal": []}
    for one in (str(run.id), run.id, run, document):
        with pytest.raises(InvalidRequest, match="wrap it in a list") as refused:
            await replay_async(app, one)  # type: ignore[arg-type]
        assert refused.value.code == "INVALID_REQUEST" and refused.value.path == "journals"
        with pytest.raises(InvalidRequest, match="wrap it in a list"):
            replay(app, one)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest, match="wrap it in a list") as idle:
            await run_until_idle(app, runs=one, poll_interval=0.05)  # type: ignore[arg-type]
        assert idle.value.path == "runs"
    assert (await run.info_async()).status == "queued"  # no worker ran
    await run_until_idle(app, runs=[run], poll_interval=0.05)
    (verdict,) = await replay_async(app, [run])
    assert verdict.ok


async def test_a_gate_holds_a_call_after_its_submitted_row_is_committed(app, sql):
    """At ``after_submitted`` the write-ahead ``submitted`` is committed and the tool is not
    called yet; the engine waits there until the test releases it."""
    called: list[str] = []

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        called.append("charge")
        return {"charged": True}

    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    with fault_gate("after_submitted", tool="charge") as gate:
        async with running(app):
            run = await app.submit_async(pay, {})
            await gate.arrived()
            await one_turn()
            assert called == [] and _ops(sql) == [("charge", "submitted")]
            gate.release()
            assert await run.result_async(timeout=10) == {"charged": True}
    assert called == ["charge"] and gate.hits == 1


@pytest.mark.parametrize("ride", [True, False])
async def test_a_gate_after_the_receipt_holds_the_run_with_it_committed(make_app, sql, ride):
    """``after_receipt`` is reached once the receipt is committed, whether it rode with the
    run's next write (the next call's ``submitted``) or had a write of its own; held there,
    the run goes no further."""
    app = make_app(receipts_ride=ride)
    called: list[str] = []

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        called.append("charge")
        return {"charged": True}

    @app.tool()
    async def notify(ctx):  # type: ignore[no-untyped-def]
        called.append("notify")
        return {"sent": True}

    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.call(charge)
        return await ctx.call(notify)

    with fault_gate("after_receipt", tool="charge") as gate:
        async with running(app):
            run = await app.submit_async(pay, {})
            await gate.arrived()
            for _ in range(3):
                await one_turn()
            assert called == ["charge"]
            assert _ops(sql) == [("charge", "committed")] + (
                [("notify", "submitted")] if ride else [])
            gate.release()
            assert await run.result_async(timeout=10) == {"sent": True}
    assert gate.hits == 1 and called == ["charge", "notify"]


async def test_a_gate_for_one_tool_lets_the_others_pass(app, sql):
    @app.tool()
    async def first(ctx):  # type: ignore[no-untyped-def]
        return 1

    @app.tool()
    async def second(ctx):  # type: ignore[no-untyped-def]
        return 2

    @app.workflow()
    async def both(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.gather(ctx.call(first), ctx.call(second))

    with fault_gate("after_tool_return", tool="second") as gate:
        async with running(app):
            run = await app.submit_async(both, {})
            await gate.arrived()
            await wait_for(lambda: dict(_ops(sql)).get("first") == "committed")
            assert dict(_ops(sql))["second"] == "submitted"  # returned, not yet recorded
            gate.release()
            assert await run.result_async(timeout=10) == [1, 2]

