"""Durable time, events, child runs, cancellation, deadlines and ownership (C7, C9, C11, C13)."""

from __future__ import annotations

import asyncio
import json
import re
from datetime import timedelta

import pytest

from orchestrator import AccessDenied, ResultTimeout, RunFailed, admin, records
from orchestrator.db import journal as journal_db
from orchestrator.errors import IdempotencyConflict, InvalidRequest
from orchestrator.journal import EventKind, entry
from orchestrator.replay import export_document, load_runs, read_documents
from tests.integration.conftest import OTHER, running, wait_for
from tests.integration.test_ops_bulk import lose_the_next_commit


def _status(sql):  # type: ignore[no-untyped-def]
    return lambda: sql("SELECT status FROM orchestrator.runs WHERE parent_run_id IS NULL")[0][
        "status"]


async def test_sleep_parks_the_run_in_the_database(app, sql):
    @app.workflow()
    async def nap(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.sleep(timedelta(seconds=2))
        return "awake"

    async with running(app):
        run = await app.submit_async(nap, {})
        await wait_for(lambda: _status(sql)() == "waiting")
        row = sql("SELECT available_at - now() AS left, lease_owner, waiting_for "
                  "FROM orchestrator.runs")[0]
        assert row["lease_owner"] is None and row["waiting_for"] == "timer"
        assert timedelta(0) < row["left"] <= timedelta(seconds=2)
        note = (await admin.show_run(app.database, run.id)).note or ""
        # what `runs show` says, in UTC like every other time it prints
        assert re.fullmatch(r"waiting for timer \(wakes at \d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ\)",
                            note), note
        assert await run.result_async(timeout=15) == "awake"


async def test_sleep_survives_a_worker_restart(make_app, sql):
    def build():  # type: ignore[no-untyped-def]
        app = make_app()

        @app.workflow()
        async def nap(ctx, data):  # type: ignore[no-untyped-def]
            await ctx.sleep(timedelta(seconds=1.5))
            return "awake"

        return app, nap

    first, nap = build()
    async with running(first):
        run = await first.submit_async(nap, {})
        await wait_for(lambda: _status(sql)() == "waiting")
    second, _ = build()  # a new process, as far as the run can tell
    async with running(second):
        assert await second.get_run_async(run.id) is not None
        assert await (await second.get_run_async(run.id)).result_async(timeout=15) == "awake"


async def test_events_are_delivered_once_per_key(app, sql):
    @app.workflow()
    async def approve(ctx, data):  # type: ignore[no-untyped-def]
        first = await ctx.wait_for_event("approval", timeout=timedelta(seconds=30))
        try:
            second = await ctx.wait_for_event("approval", timeout=timedelta(seconds=1.5))
        except TimeoutError:
            second = "timed out"
        return [first, second]

    async with running(app):
        run = await app.submit_async(approve, {})
        await wait_for(lambda: _status(sql)() == "waiting")
        assert await app.send_event_async(run.id, "approval", {"ok": 1}, event_key="appr-1")
        assert not await app.send_event_async(run.id, "approval", {"ok": 1}, event_key="appr-1")
        # The key names one event: reused for another payload or name, it is a conflict
        # that stores nothing, not a silent "already delivered".
        with pytest.raises(IdempotencyConflict) as conflict:
            await app.send_event_async(run.id, "approval", {"ok": 2}, event_key="appr-1")
        assert "new event_key" in conflict.value.message
        with pytest.raises(IdempotencyConflict):
            await app.send_event_async(run.id, "rejection", {"ok": 1}, event_key="appr-1")
        assert await run.result_async(timeout=15) == [{"ok": 1}, "timed out"]
    # A retry of the same keyed send after the run has finished is still a duplicate, not an
    # error; a new event to a finished run is refused.
    assert not await app.send_event_async(run.id, "approval", {"ok": 1}, event_key="appr-1")
    with pytest.raises(IdempotencyConflict):  # not INVALID_REQUEST: the key decides first
        await app.send_event_async(run.id, "approval", {"ok": 2}, event_key="appr-1")
    with pytest.raises(InvalidRequest):
        await app.send_event_async(run.id, "approval", {"ok": 3}, event_key="appr-2")
    assert sql("SELECT count(*) AS n FROM orchestrator.external_events")[0]["n"] == 1


async def test_an_event_sent_before_the_wait_is_not_lost(app, sql):
    @app.workflow()
    async def late(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.sleep(1.2)
        return await ctx.wait_for_event("go")

    run = await app.submit_async(late, {})
    await app.send_event_async(run.id, "go", "now")
    async with running(app):
        assert await run.result_async(timeout=15) == "now"


async def test_a_received_event_tells_its_owner_nothing_of_other_tenants_events(app, sql):
    """An ``event.received`` entry holds the event's payload and nothing of the numbering that
    every tenant's events share (C9): the engine no longer writes that number, and an entry
    written before it stopped keeps it stored, but no reader of the run's journal sees it."""
    @app.workflow()
    async def approve(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.wait_for_event("approval")

    theirs = await app.submit_async(approve, {}, owner=OTHER)
    for n in range(3):  # another tenant's events, before ours
        await app.send_event_async(theirs.id, "approval", n, owner=OTHER)
    run = await app.submit_async(approve, {})
    await app.send_event_async(run.id, "approval", {"ok": True})
    async with running(app):
        assert await run.result_async(timeout=15) == {"ok": True}
    stored = sql("SELECT payload FROM orchestrator.journal WHERE run_id = %s "
                 "AND kind = 'event.received'", (run.id,))
    assert stored == [{"payload": {"payload": {"ok": True}}}]

    # An entry written by the earlier code, with the shared number: kept, never shown.
    old, token = await app.submit_async(approve, {}), 77
    sql("UPDATE orchestrator.runs SET status = 'running', lease_token = %s, lease_owner = 'w', "
        "lease_expires_at = now() + interval '1 hour' WHERE id = %s", (token, old.id))
    async with app.database.connection() as conn:
        await journal_db.journal_append(conn, run_id=old.id, token=token, expected=0, events=[
            entry(EventKind.EVENT_RECEIVED, 0, "approval", {"payload": 0, "event_id": 41})])
    assert sql("SELECT payload FROM orchestrator.journal WHERE run_id = %s",
               (old.id,)) == [{"payload": {"payload": 0, "event_id": 41}}]
    async with app.database.connection() as conn:  # what `orchestrator runs export` writes
        (recorded,) = await load_runs(conn, run_id=old.id)
    exported = export_document(recorded)
    shown = [(await old.journal_async())[0].payload,
             [e.payload async for e in old.events(follow=False)][0],
             records.run_detail(await admin.show_run(app.database, old.id))["journal"][0][
                 "payload"],
             exported["journal"][0]["payload"]]
    assert shown == [{"payload": 0}] * 4
    assert recorded.journal[0]["payload"] == {"payload": 0, "event_id": 41}  # only in storage
    (again,) = read_documents(json.dumps(exported, default=str), source="run.json")
    assert again.journal[0]["payload"] == {"payload": 0}  # replay --from-file reads it


async def test_events_check_ownership_and_payloads(app, sql):
    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.wait_for_event("x")

    run = await app.submit_async(wf, {})
    with pytest.raises(AccessDenied):
        await app.send_event_async(run.id, "x", 1, owner=OTHER)
    with pytest.raises(InvalidRequest) as info:
        await app.send_event_async(run.id, "x", {"bad": float("inf")})
    assert info.value.path == "$.payload.bad"
    assert sql("SELECT count(*) AS n FROM orchestrator.external_events")[0]["n"] == 0
    await app.database.close()


async def test_missing_and_foreign_runs_look_the_same(app):
    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return 1

    run = await app.submit_async(wf, {})
    answers = []
    for run_id, owner in [(run.id, OTHER), ("00000000-0000-0000-0000-000000000000", None)]:
        with pytest.raises(AccessDenied) as info:
            await app.get_run_async(run_id, owner=owner)
        answers.append((info.value.code, info.value.message))
    assert len(set(answers)) == 1 and answers[0][0] == "ACCESS_DENIED"
    # text that is not a run id names no run at all: bad input, as the CLI and HTTP say
    with pytest.raises(InvalidRequest) as malformed:
        await app.get_run_async("not-a-uuid")
    assert (malformed.value.code, malformed.value.path) == ("INVALID_REQUEST", "run_id")
    assert [r.id for r in await app.list_runs_async(owner=OTHER)] == []
    assert [r.id for r in await app.list_runs_async()] == [run.id]
    await app.database.close()


async def test_child_runs_return_results_and_failures(app, sql):
    @app.workflow()
    async def child(ctx, n):  # type: ignore[no-untyped-def]
        if n < 0:
            from orchestrator import WorkflowError

            raise WorkflowError("negative")
        return n * 2

    @app.workflow()
    async def parent(ctx, data):  # type: ignore[no-untyped-def]
        good = await ctx.run_child(child, 21)
        try:
            await ctx.run_child(child, -1)
        except RunFailed as exc:
            return [good, exc.code]
        return [good, None]

    async with running(app):
        run = await app.submit_async(parent, {})
        assert await run.result_async(timeout=20) == [42, "WORKFLOW_FAILED"]
    children = sql("SELECT tenant, principal, status FROM orchestrator.runs "
                   "WHERE parent_run_id IS NOT NULL ORDER BY parent_position")
    assert [c["status"] for c in children] == ["succeeded", "failed"]
    assert {(c["tenant"], c["principal"]) for c in children} == {("acme", "alice")}


async def test_a_childs_failure_names_the_childs_incident_live_and_on_replay(app, sql):
    """The ``RunFailed`` a parent gets for a failed child names the child's incident, where
    its diagnostics are, and names the same one on every replay: a parent that records the
    reference (here, in a call's arguments) replays its history instead of meeting another
    reference (another intent digest: ``NONDETERMINISM``)."""
    noted = []

    @app.tool()
    async def note(ctx, *, ref):  # type: ignore[no-untyped-def]
        noted.append(ref)
        return ref

    @app.workflow()
    async def child(ctx, n):  # type: ignore[no-untyped-def]
        raise RuntimeError("the child's own words stay in its incident")

    @app.workflow()
    async def parent(ctx, data):  # type: ignore[no-untyped-def]
        try:
            await ctx.run_child(child, 1)
        except RunFailed as exc:
            ref = await ctx.call(note, ref=exc.incident)
        await ctx.sleep(1.2)  # parks: the next claim replays the child's failure
        return ref

    async with running(app):
        run = await app.submit_async(parent, {})
        ref = await run.result_async(timeout=20)
    (kid,) = sql("SELECT error FROM orchestrator.runs WHERE parent_run_id = %s", (run.id,))
    assert ref == kid["error"]["incident"] and noted == [ref]
    assert sql("SELECT code FROM orchestrator.incidents WHERE ref = %s",
               (ref,)) == [{"code": "WORKFLOW_FAILED"}]


async def test_a_cancelled_childs_failure_names_one_reference_on_every_replay(app, sql):
    """A child cancelled by its owner has no incident of its own; the ``RunFailed`` its
    parent gets still names one reference, the same on every replay."""
    noted = []

    @app.tool()
    async def note(ctx, *, ref):  # type: ignore[no-untyped-def]
        noted.append(ref)
        return ref

    @app.workflow()
    async def child(ctx, n):  # type: ignore[no-untyped-def]
        await ctx.wait_for_event("never")

    @app.workflow()
    async def parent(ctx, data):  # type: ignore[no-untyped-def]
        try:
            await ctx.run_child(child, 1)
        except RunFailed as exc:
            ref = await ctx.call(note, ref=exc.incident)
        await ctx.sleep(1.2)  # parks: the next claim replays the child's failure
        return ref

    def child_waiting():  # type: ignore[no-untyped-def]
        return sql("SELECT id FROM orchestrator.runs WHERE parent_run_id IS NOT NULL "
                   "AND status = 'waiting'")

    async with running(app):
        run = await app.submit_async(parent, {})
        await wait_for(child_waiting)
        await app.cancel_async(child_waiting()[0]["id"])
        ref = await run.result_async(timeout=20)
    assert noted == [ref] and ref.startswith("inc_")


async def test_result_timeout_reports_the_status_and_changes_nothing(app, sql):
    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return 1

    run = await app.submit_async(wf, {})
    with pytest.raises(ResultTimeout) as info:
        await run.result_async(timeout=0.2)
    assert info.value.code == "RESULT_TIMEOUT" and info.value.status == "queued"
    assert f"orchestrator runs show {run.id}" in str(info.value)  # says what to look at
    assert _status(sql)() == "queued"
    await app.database.close()


async def test_cancel_a_waiting_run_and_a_running_one(app, sql):
    release = asyncio.Event()
    calls: list[str] = []

    @app.tool(effect="read")  # interrupted or not, a read leaves nothing uncertain
    async def slow(ctx):  # type: ignore[no-untyped-def]
        calls.append("slow")
        await release.wait()
        return "done"

    @app.tool()
    async def after(ctx):  # type: ignore[no-untyped-def]
        calls.append("after")
        return "never"

    @app.workflow()
    async def sleeper(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.sleep(60)

    @app.workflow()
    async def busy(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.call(slow)
        await ctx.call(after)

    async with running(app):
        waiting = await app.submit_async(sleeper, {})
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs WHERE id = %s",
                                   (waiting.id,))[0]["status"] == "waiting")
        assert await waiting.cancel_async() == "cancelled"
        with pytest.raises(RunFailed) as info:
            await waiting.result_async(timeout=5)
        assert info.value.code == "CANCELLED"

        active = await app.submit_async(busy, {})
        await wait_for(lambda: calls == ["slow"])
        assert await active.cancel_async() == "running"
        release.set()
        with pytest.raises(RunFailed) as info:
            await active.result_async(timeout=10)
        assert info.value.code == "CANCELLED"
    assert calls == ["slow"]  # the second tool was never dispatched
    kinds = [e.kind for e in await active.journal_async()]
    assert kinds[-1] == "run.cancelled"
    # A cancellation has no diagnostics, so its stored error names no incident that isn't there.
    assert [r["incident"] for r in sql("SELECT error->>'incident' AS incident "
                                       "FROM orchestrator.runs WHERE status = 'cancelled'")] == [
        None, None]


async def test_cancelling_a_run_cancels_its_unfinished_children_recursively(app, sql):
    """A cancellation reaches the run's unfinished child runs, and theirs, in the same
    transaction and by the same rules: one that waits is cancelled at once, one that is
    running is asked to stop at its next step. A child that finished, and another run's
    child, are left as they are."""
    release = asyncio.Event()
    calls: list[str] = []

    @app.tool(effect="read")  # interrupted or not, a read leaves nothing uncertain
    async def slow(ctx):  # type: ignore[no-untyped-def]
        calls.append("slow")
        await release.wait()
        return "done"

    @app.tool()
    async def after(ctx):  # type: ignore[no-untyped-def]
        calls.append("after")

    @app.workflow()
    async def quick(ctx, data):  # type: ignore[no-untyped-def]
        return "quick"

    @app.workflow()
    async def idle(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.wait_for_event("never")

    @app.workflow()
    async def middle(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.run_child(idle, "grandchild")

    @app.workflow()
    async def busy(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.call(slow)
        await ctx.call(after)

    @app.workflow()
    async def parent(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.run_child(quick, None)
        await ctx.gather(ctx.run_child(middle, None), ctx.run_child(busy, None))

    def statuses() -> dict[str, str]:
        return {r["workflow_name"]: r["status"] for r in sql(
            "SELECT workflow_name, status FROM orchestrator.runs WHERE id <> %s", (other.id,))}

    async with running(app):
        other = await app.submit_async(idle, "someone else's")  # not in the tree
        run = await app.submit_async(parent, {})
        await wait_for(lambda: calls == ["slow"] and statuses() == {
            "parent": "waiting", "quick": "succeeded", "middle": "waiting",
            "idle": "waiting", "busy": "running"})
        assert await run.cancel_async() == "cancelled"
        assert statuses() == {"parent": "cancelled", "quick": "succeeded",
                              "middle": "cancelled", "idle": "cancelled", "busy": "running"}
        assert sql("SELECT count(*) AS n FROM orchestrator.runs WHERE workflow_name = 'busy' "
                   "AND cancel_requested_at IS NOT NULL") == [{"n": 1}]
        release.set()
        await wait_for(lambda: statuses()["busy"] == "cancelled")
        assert await other.status_async() == "waiting"
    assert calls == ["slow"]  # the running child's next call was never sent
    ended = sql("SELECT r.workflow_name, j.kind FROM orchestrator.runs r "
                "JOIN orchestrator.journal j ON j.run_id = r.id "
                "WHERE j.kind = 'run.cancelled' ORDER BY r.workflow_name")
    assert [e["workflow_name"] for e in ended] == ["busy", "idle", "middle", "parent"]
    errors = sql("SELECT error FROM orchestrator.runs WHERE status = 'cancelled'")
    assert {e["error"]["code"] for e in errors} == {"CANCELLED"}


async def test_the_deadline_fails_a_sleeping_run(app):
    @app.workflow()
    async def slow(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.sleep(timedelta(seconds=30))
        return "late"

    async with running(app):
        run = await app.submit_async(slow, {}, deadline=timedelta(seconds=1.5))
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=15)
    assert info.value.code == "DEADLINE_EXCEEDED"
    assert app.metrics.snapshot()["deadline_exhausted"] == 1


@pytest.mark.parametrize("gated", [False, True])
async def test_a_full_journal_rejects_new_work(make_app, sql, gated):
    """With ``gated``, each call's intent is written by the general path (a ``pending``
    intent, then its policy stage), carrying the previous call's riding receipt: the room
    check counts that receipt too."""
    app = make_app(max_journal_events=6)

    @app.tool()
    async def step(ctx):  # type: ignore[no-untyped-def]
        return 1

    if gated:
        @step.authorize
        async def gate(pctx):  # type: ignore[no-untyped-def]
            return True

    @app.workflow()
    async def chatty(ctx, data):  # type: ignore[no-untyped-def]
        for _ in range(10):
            await ctx.call(step)

    async with running(app):
        run = await app.submit_async(chatty, {})
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=15)
    assert info.value.code == "WORKFLOW_FAILED"
    assert "JOURNAL_FULL" in info.value.message
    count = sql("SELECT count(*) AS n FROM orchestrator.journal")[0]["n"]
    # New work stops while the journal still has room for every outcome: the calls that
    # began (two; one when each also records its `pending` intent) have their receipts, and
    # the run's end is recorded; nothing was evicted.
    assert count == (4 if gated else 5) and count <= 6


async def test_an_event_name_that_no_sender_may_use_is_refused_where_the_run_waits(app, sql):
    """A wait for an event that ``send_event`` would refuse to deliver could only end by its
    timeout: it is refused as ``send_event`` refuses the name, and nothing is journaled."""
    @app.workflow()
    async def picky(ctx, data):  # type: ignore[no-untyped-def]
        refused = []
        for name in (" go", "go\n", "a\x00b", "x" * 201, 7):
            try:
                await ctx.wait_for_event(name, timeout=timedelta(seconds=0.2))
            except Exception as exc:  # noqa: BLE001 - the test records what each one raised
                refused.append([getattr(exc, "code", type(exc).__name__),
                                getattr(exc, "path", None)])
        return [refused, await ctx.wait_for_event("go")]

    async with running(app):
        run = await app.submit_async(picky, {})
        with pytest.raises(InvalidRequest):
            await app.send_event_async(run.id, " go", "never")
        await app.send_event_async(run.id, "go", "yes")
        refused, got = await run.result_async(timeout=15)
        waits = [e.name for e in await run.journal_async() if e.kind == "event.wait"]
    assert refused == [["INVALID_REQUEST", "name"]] * 5
    assert got == "yes" and waits == ["go"]


async def test_a_duration_that_is_not_a_time_is_refused_where_the_run_sleeps_or_waits(app, sql):
    """A sleep or an event's timeout that is not a number of seconds (a string of digits, a
    bool), is not finite or ends past any time a timer can hold is ``INVALID_REQUEST`` (its
    ``path`` the argument) where workflow code asks for it (the code may catch it), as a
    negative one is, and nothing is journaled for it."""
    durations = (float("inf"), float("nan"), timedelta.max, 1e15, "soon", -1, "5", True, False,
                 b"5")

    @app.workflow()
    async def careless(ctx, data):  # type: ignore[no-untyped-def]
        refused = []
        for duration in durations:
            for wait in (lambda d: ctx.sleep(d),
                         lambda d: ctx.wait_for_event("go", timeout=d)):
                try:
                    await wait(duration)
                except Exception as exc:  # noqa: BLE001 - the test records what each raised
                    refused.append([getattr(exc, "code", type(exc).__name__),
                                    getattr(exc, "path", None)])
        return refused

    async with running(app):
        run = await app.submit_async(careless, {})
        assert await run.result_async(timeout=15) == [
            ["INVALID_REQUEST", "duration"], ["INVALID_REQUEST", "timeout"]] * len(durations)
        kinds = [e.kind for e in await run.journal_async()]
    assert kinds == ["run.completed"]


async def test_an_event_whose_commit_was_lost_is_reported_delivered_once(app, sql, monkeypatch):
    """The connection goes while an event's COMMIT is under way, and it applied: run again by
    the storage layer, the event is found stored, by this call. Keyed, it is reported
    delivered (not a repeat of an earlier send); unkeyed, too (not an outcome unknown), and
    stored once either way."""
    @app.workflow()
    async def approve(ctx, _):  # type: ignore[no-untyped-def]
        return await ctx.wait_for_event("approval")

    run = await app.submit_async(approve, None)
    lose_the_next_commit(monkeypatch, app.database)
    assert await app.send_event_async(run.id, "approval", {"ok": 1}, event_key="appr-1")
    assert not await app.send_event_async(run.id, "approval", {"ok": 1}, event_key="appr-1")
    lose_the_next_commit(monkeypatch, app.database)
    assert await app.send_event_async(run.id, "approval", {"ok": 2})
    assert len(sql("SELECT 1 FROM orchestrator.external_events WHERE run_id = %s", (run.id,))) == 2


async def test_a_wait_that_parks_is_timed_out_by_a_durable_sleep_not_by_an_asyncio_timer(
        app, sql):
    """README: an asyncio timer lives in the worker's memory and is gone when the run parks;
    a race with ``ctx.sleep`` times the same wait out, on time and again on replay."""
    @app.workflow()
    async def raced(ctx, data):  # type: ignore[no-untyped-def]
        event = asyncio.ensure_future(ctx.wait_for_event("slow"))
        timer = asyncio.ensure_future(ctx.sleep(1.5))
        done, _ = await asyncio.wait([event, timer], return_when=asyncio.FIRST_COMPLETED)
        (event if timer in done else timer).cancel()
        return "event" if event in done else "timer"

    @app.workflow()
    async def bounded(ctx, data):  # type: ignore[no-untyped-def]
        try:
            async with asyncio.timeout(1.5):
                await ctx.wait_for_event("slow")
        except TimeoutError:
            return "timed out"
        return "event"

    async with running(app):
        first = await app.submit_async(raced, {})
        second = await app.submit_async(bounded, {})
        assert await first.result_async(timeout=15) == "timer"
        await asyncio.sleep(1.5)  # past the asyncio timer: the parked run did not see it
        assert await second.status_async() == "waiting"
        assert await app.send_event_async(second.id, "slow", 1)
        assert await second.result_async(timeout=15) == "event"
