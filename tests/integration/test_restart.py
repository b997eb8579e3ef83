"""Restarting a run without repeating its effects (docs/versioning.md, "Restarting a run"):
committed charges are replayed from the old run's journal, the failed step runs anew, the runs
name each other, the restart is audited, and it is refused while an outcome is unknown."""

from __future__ import annotations

import asyncio
import json
from collections import Counter
from typing import Any

import pytest

from orchestrator import Orchestrator, RunFailed, ToolError
from orchestrator.errors import InvalidRequest, OperationInProgress, OperationUncertain
from tests.clitools import run_cli
from tests.integration import large_records_app
from tests.integration.conftest import running, wait_for
from tests.integration.test_ops_bulk import lose_the_next_commit

CHARGES: Counter[str] = Counter()
LARGE_APP = "tests.integration.large_records_app:app"


def shop(app: Orchestrator, broken: dict[str, bool]) -> Orchestrator:
    @app.tool()
    async def charge(ctx, *, card):  # type: ignore[no-untyped-def]
        CHARGES[card] += 1  # the counting sink: every real charge
        return {"charged": card}

    @app.tool()
    async def ship(ctx, *, order):  # type: ignore[no-untyped-def]
        if broken["ship"]:
            raise ToolError("the carrier refused the label", applied=False, status=422)
        return {"shipped": order}

    @app.workflow()
    async def order(ctx, n):  # type: ignore[no-untyped-def]
        first = await ctx.call(charge, card="a")
        second = await ctx.call(charge, card="b")
        label = await ctx.call(ship, order=n)
        return [first, second, label]

    @app.workflow()
    async def waits(ctx, n):  # type: ignore[no-untyped-def]
        await ctx.wait_for_event("go")
        return n

    return app


async def test_a_failed_run_restarted_from_zero_charges_nothing_again(make_app: Any,
                                                                     sql: Any) -> None:
    CHARGES.clear()
    broken = {"ship": True}
    app = shop(make_app(), broken)
    async with running(app):
        old = await app.submit_async("order", 7)
        with pytest.raises(RunFailed):
            await old.result_async(timeout=20)
        assert CHARGES == {"a": 1, "b": 1}
        broken["ship"] = False  # the carrier is back
        new = await old.restart_async(reason="the carrier is back", from_position=0)
        assert await new.result_async(timeout=20) == [
            {"charged": "a"}, {"charged": "b"}, {"shipped": 7}]
    assert CHARGES == {"a": 1, "b": 1}  # nothing charged twice
    # The restart is a new run: it started once, as the old one did (and replayed what its
    # journal carries).
    assert app.metrics.labelled("runs_started") == {("order",): 2}
    assert app.metrics.labelled("run_replays") == {("order",): 1}
    assert (await new.info_async()).restarted_from == old.id
    assert (await old.info_async()).superseded_by == new.id
    (audit,) = sql("SELECT operator, action, target_id, evidence, after "
                   "FROM orchestrator.operator_audit")
    assert (audit["operator"], audit["action"], audit["target_id"], audit["evidence"]) == (
        "alice", "run.restart", str(old.id), "the carrier is back")
    assert audit["after"]["superseded_by"] == str(new.id)
    ops = sql("SELECT run_id, position, tool_name, idempotency_key FROM orchestrator.operations "
              "WHERE run_id = %s", (new.id,))
    assert [(o["position"], o["tool_name"]) for o in ops] == [(2, "ship")]  # a new operation
    assert ops[0]["idempotency_key"].startswith(str(new.id))  # with a new key
    with pytest.raises(InvalidRequest, match="already restarted"):
        await old.restart_async(reason="again")


async def test_a_restart_is_refused_while_an_outcome_is_unknown_or_the_run_goes_on(
        make_app: Any, sql: Any) -> None:
    broken = {"ship": True}
    app = shop(make_app(), broken)
    async with running(app):
        failed = await app.submit_async("order", 1)
        with pytest.raises(RunFailed):
            await failed.result_async(timeout=20)
        going = await app.submit_async("waits", 2)
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs WHERE id = %s AND "
                                   "status = 'waiting'", (going.id,)), timeout=20)
        with pytest.raises(OperationInProgress):
            await going.restart_async(reason="too early")
    # An operation whose outcome is unknown on a finished run (as a cancelled run leaves one).
    sql("""INSERT INTO orchestrator.operations (run_id, position, attempt, tool_name,
               tool_version, effect_class, tenant, principal, intent_digest, arguments,
               idempotency_key, state)
           SELECT id, 9, 1, 'ship', '1', 'consequential', tenant, principal, 'd', '{}',
                  'k-unknown', 'submitted' FROM orchestrator.runs WHERE id = %s""",
        (failed.id,))
    sql("UPDATE orchestrator.operations SET state = 'unknown' WHERE idempotency_key = "
        "'k-unknown'")
    with pytest.raises(OperationUncertain, match="reconcile them first") as refused:
        await failed.restart_async(reason="not yet")
    assert refused.value.code == "OPERATION_UNCERTAIN"
    assert len(refused.value.known_operations) == 2  # the two charges, committed
    assert sql("SELECT count(*) AS n FROM orchestrator.runs")[0]["n"] == 2  # nothing started


async def test_a_restart_names_the_argument_it_refuses(make_app: Any, sql: Any) -> None:
    """``restart(reason=...)`` is the Python API's word for the audit's evidence: a blank or
    unstorable one is refused naming ``reason`` (it said ``evidence``, which the call has no
    parameter for), and an ``operator`` given blank is refused, not replaced by the owner's
    principal; nothing is written either way."""
    broken = {"ship": True}
    app = shop(make_app(), broken)
    async with running(app):
        failed = await app.submit_async("order", 3)
        with pytest.raises(RunFailed):
            await failed.result_async(timeout=20)
    for reason in ("", "   ", None, 7, "a\x00b"):
        with pytest.raises(InvalidRequest, match="^INVALID_REQUEST: reason ") as refused:
            await failed.restart_async(reason=reason)  # type: ignore[arg-type]
        assert refused.value.path == "reason"
    with pytest.raises(InvalidRequest, match="operator") as blank:
        await failed.restart_async(reason="the carrier is back", operator="")
    assert blank.value.path == "operator"
    assert sql("SELECT count(*) AS n FROM orchestrator.runs")[0]["n"] == 1  # nothing started
    assert sql("SELECT count(*) AS n FROM orchestrator.operator_audit")[0]["n"] == 0


def test_the_restart_command(make_app: Any, migrated_database_url: str) -> None:
    CHARGES.clear()
    broken = {"ship": True}
    app = shop(make_app(), broken)

    async def fail() -> Any:
        async with running(app):
            run = await app.submit_async("order", 3)
            with pytest.raises(RunFailed):
                await run.result_async(timeout=20)
            return run

    old = asyncio.run(fail())
    done = run_cli(["runs", "restart", str(old.id), "--operator", "bob", "--evidence",
                    "label fixed", "--json"], database_url=migrated_database_url)
    assert done.returncode == 0, done.stderr
    restarted = json.loads(done.stdout)
    assert restarted["from_position"] == 2  # the default: where the old run went wrong
    assert restarted["restarted_from"] == str(old.id)
    broken["ship"] = False

    async def finish() -> Any:
        async with running(app):
            new = await app.get_run_async(restarted["run_id"])
            return new, await new.result_async(timeout=20)

    new, result = asyncio.run(finish())
    assert result == [{"charged": "a"}, {"charged": "b"}, {"shipped": 3}]
    assert CHARGES == {"a": 1, "b": 1}
    shown = run_cli(["runs", "show", str(old.id)], database_url=migrated_database_url)
    assert f"superseded by:  {new.id}" in shown.stdout
    missing = run_cli(["runs", "restart", str(old.id), "--operator", "bob"],
                      database_url=migrated_database_url)
    assert missing.returncode == 2  # --evidence is required


def test_the_restart_command_takes_the_applications_limits_and_scopes(
        make_app: Any, sql: Any, migrated_database_url: str) -> None:
    """A run whose input the application accepted under larger JSON limits than the default is
    restarted with ``--app`` (its limits, and its operator scopes, apply); without it the
    command says what to pass, and writes nothing."""
    CHARGES.clear()
    app = shop(make_app(max_record_bytes=large_records_app.MAX_RECORD_BYTES), {"ship": True})
    big = "x" * (2 * 1024 * 1024)  # over the default 1 MiB cap, under the application's

    async def fail() -> Any:
        async with running(app):
            run = await app.submit_async("order", big)
            with pytest.raises(RunFailed):
                await run.result_async(timeout=20)
            return run

    old = asyncio.run(fail())
    base = ["runs", "restart", str(old.id), "--evidence", "label fixed", "--json"]
    refused = run_cli([*base, "--operator", "bob"], database_url=migrated_database_url)
    assert refused.returncode != 0
    assert "PAYLOAD_TOO_LARGE" in refused.stderr and "--app MODULE:ATTR" in refused.stderr
    outside = run_cli([*base, "--operator", "opB", "--app", LARGE_APP],
                      database_url=migrated_database_url)
    assert outside.returncode != 0 and "ACCESS_DENIED" in outside.stderr  # not in its scopes
    assert sql("SELECT count(*) AS n FROM orchestrator.runs")[0]["n"] == 1  # nothing written
    done = run_cli([*base, "--operator", "opA", "--app", LARGE_APP],
                   database_url=migrated_database_url)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["restarted_from"] == str(old.id)


async def test_a_restarted_parent_gets_the_result_of_the_child_its_journal_carries(
        make_app: Any, sql: Any) -> None:
    """A parent that failed while its child runs, restarted: the new run's journal carries
    the child's start, so it waits for that child (not a new one) and gets its result, whether
    the child ended before the restart or after it."""
    app = make_app()
    child_running = asyncio.Event()
    broken = {"check": True}

    @app.workflow()
    async def gate(ctx, n):  # type: ignore[no-untyped-def]
        child_running.set()
        return [n, await ctx.wait_for_event("go")]

    @app.tool()
    async def check(ctx):  # type: ignore[no-untyped-def]
        if broken["check"]:
            await child_running.wait()  # the parent fails while its child runs
            raise ToolError("refused", applied=False, status=422)
        return "checked"

    @app.workflow()
    async def delegating(ctx, n):  # type: ignore[no-untyped-def]
        return (await ctx.gather(ctx.run_child(gate, n), ctx.call(check)))[0]

    def child_of(parent: Any) -> Any:
        rows = sql("SELECT id FROM orchestrator.runs WHERE parent_run_id = %s", (parent.id,))
        return rows[0]["id"] if rows else None

    async with running(app):
        for n, ends_first in ((1, True), (2, False)):
            broken["check"] = True
            child_running.clear()
            old = await app.submit_async("delegating", n)
            with pytest.raises(RunFailed):
                await old.result_async(timeout=20)
            child = child_of(old)
            # A finished run's cancellation changes nothing, its child's status included.
            assert await old.cancel_async() == "failed"
            assert sql("SELECT status FROM orchestrator.runs WHERE id = %s",
                       (child,)) == [{"status": "waiting"}]
            if ends_first:
                await app.send_event_async(child, "go", "open")
                await wait_for(lambda child=child: sql(
                    "SELECT 1 FROM orchestrator.runs WHERE id = %s AND status = 'succeeded'",
                    (child,)), timeout=20)
            broken["check"] = False
            new = await old.restart_async(reason="the child is still wanted")
            if not ends_first:
                await app.send_event_async(child, "go", "open")
            assert await new.result_async(timeout=20) == [n, "open"]
            assert sql("SELECT count(*) AS n FROM orchestrator.runs WHERE workflow_name = "
                       "'gate' AND input = %s::jsonb", (json.dumps(n),))[0]["n"] == 1


async def test_a_cancelled_parent_restarted_starts_the_child_cancelled_with_it_anew(
        make_app: Any, sql: Any) -> None:
    """A cancellation reaches the parent's child too; restarted, the parent does not wait for
    the cancelled child (which would fail it with ``CANCELLED``) but runs that step anew: the
    default restart position is the child's."""
    app = make_app()

    @app.workflow()
    async def gate(ctx, n):  # type: ignore[no-untyped-def]
        return [n, await ctx.wait_for_event("go")]

    @app.workflow()
    async def delegating(ctx, n):  # type: ignore[no-untyped-def]
        return await ctx.run_child(gate, n)

    def children(parent: Any) -> list[dict[str, Any]]:
        return sql("SELECT id, status FROM orchestrator.runs WHERE parent_run_id = %s",
                   (parent.id,))

    async with running(app):
        old = await app.submit_async("delegating", 1)
        await wait_for(lambda: [c["status"] for c in children(old)] == ["waiting"]
                       and sql("SELECT 1 FROM orchestrator.runs WHERE id = %s "
                               "AND status = 'waiting'", (old.id,)), timeout=20)
        assert await old.cancel_async() == "cancelled"
        assert [c["status"] for c in children(old)] == ["cancelled"]
        new = await old.restart_async(reason="wanted after all")
        await wait_for(lambda: [c["status"] for c in children(new)] == ["waiting"], timeout=20)
        assert await app.send_event_async(children(new)[0]["id"], "go", "open")
        assert await new.result_async(timeout=20) == [1, "open"]
    (audit,) = sql("SELECT after FROM orchestrator.operator_audit WHERE action = 'run.restart'")
    assert audit["after"]["from_position"] == 0


async def test_a_restart_from_before_a_patch_takes_the_path_the_old_run_took(
        make_app: Any, sql: Any) -> None:
    """The old run took a patch's new code, whose first command (a recorded value) is taken
    again after a restart from position 0; a charge that committed comes after it. The new
    run takes the same path, so its charge is the carried one, replayed from its receipt, not
    a new operation at the position the old path would give it."""
    CHARGES.clear()
    broken = {"ship": True}
    app = shop(make_app(), broken)

    @app.workflow()
    async def stamped(ctx, n):  # type: ignore[no-untyped-def]
        stamp = ctx.now().isoformat() if ctx.patched("stamp-first") else None
        charged = await ctx.call("charge", card="c")
        label = await ctx.call("ship", order=n)
        return [stamp is not None, charged, label]

    async with running(app):
        old = await app.submit_async("stamped", 3)
        with pytest.raises(RunFailed):
            await old.result_async(timeout=20)
        assert CHARGES == {"c": 1}
        broken["ship"] = False
        new = await old.restart_async(reason="the carrier is back", from_position=0)
        assert await new.result_async(timeout=20) == [True, {"charged": "c"}, {"shipped": 3}]
    assert CHARGES == {"c": 1}  # not charged again
    assert [(e.kind, e.position) for e in await new.journal_async()
            if e.position == 0] == [("patch", 0), ("value", 0)]


def _gated(app: Any) -> None:
    """A workflow ``gated`` that waits for ``open``, ships, then waits for ``close``."""
    @app.workflow()
    async def gated(ctx, n):  # type: ignore[no-untyped-def]
        opened = await ctx.wait_for_event("open")
        await ctx.call("ship", order=n)
        return [opened, await ctx.wait_for_event("close")]


async def test_events_the_old_run_accepted_and_never_took_are_the_new_runs(
        make_app: Any, sql: Any) -> None:
    """An event delivered to a run (``send_event`` answered True) that the run failed before
    waiting for goes to the run that restarts it, as it would go to the next run of a
    continuation: the new run waits for it and gets it; nothing accepted is left behind."""
    broken = {"ship": True}
    app = shop(make_app(), broken)
    _gated(app)

    async with running(app):
        old = await app.submit_async("gated", 5)
        assert await app.send_event_async(old.id, "close", "late", event_key="close-5")
        assert await app.send_event_async(old.id, "open", "early")
        with pytest.raises(RunFailed):
            await old.result_async(timeout=20)
        broken["ship"] = False
        new = await old.restart_async(reason="the carrier is back")
        assert await new.result_async(timeout=20) == ["early", "late"]
        # A sender's retry of the keyed event is recognised on the run it went to.
        assert not await app.send_event_async(new.id, "close", "late", event_key="close-5")
    events = sql("SELECT name, run_id, consumed_position FROM orchestrator.external_events "
                 "ORDER BY id")
    assert [(e["name"], e["run_id"]) for e in events] == [("close", new.id), ("open", old.id)]
    assert all(e["consumed_position"] is not None for e in events)


async def test_a_restart_whose_commit_was_lost_answers_with_its_new_run(
        app: Orchestrator, sql, monkeypatch):
    """The connection goes while a restart's COMMIT is under way, and it applied: run again
    by the storage layer, the restart finds the run restarted, by its own hand. It answers with
    the new run (not an outcome unknown, nor "already restarted"), and is audited once."""
    @app.workflow()
    async def idle(ctx, n):  # type: ignore[no-untyped-def]
        return n

    old = await app.submit_async(idle, 1)
    await app.cancel_async(old.id)
    lose_the_next_commit(monkeypatch, app.database)
    new = await old.restart_async(reason="wanted after all")
    rows = sql("SELECT id, superseded_by, restarted_from FROM orchestrator.runs")
    assert {(r["id"], r["superseded_by"], r["restarted_from"]) for r in rows} == {
        (old.id, new.id, None), (new.id, None, old.id)}
    assert [a["action"] for a in sql("SELECT action FROM orchestrator.operator_audit")] == [
        "run.restart"]


async def test_a_restarted_run_keeps_its_submissions_identity(make_app: Any, sql: Any) -> None:
    """The restart is the authoritative run, so the submission answers with it: a client that
    submits again with its key gets the new run (the same request, no conflict), and the old
    run's handle (``result``, ``outcome``, ``latest``, ``wait``) follows it there, as it follows
    a continuation; ``info()`` still describes the old run."""
    broken = {"ship": True}
    app = shop(make_app(), broken)
    async with running(app):
        old = await app.submit_async("order", 7, idempotency_key="order-7")
        with pytest.raises(RunFailed):
            await old.result_async(timeout=20)
        broken["ship"] = False
        new = await old.restart_async(reason="the carrier is back")
        done = [{"charged": "a"}, {"charged": "b"}, {"shipped": 7}]
        assert await new.result_async(timeout=20) == done
        again = await app.submit_async("order", 7, idempotency_key="order-7")
        assert again.id == new.id
        assert await old.result_async(timeout=5) == done
        assert await old.outcome_async() == done
        assert (await old.latest_async()).id == new.id
        assert (await old.info_async()).status == "failed"
        assert await app.wait_async([old], timeout=5) == [old]
        # Restarted again (from the end), the chain's last run answers.
        newest = await new.restart_async(reason="once more", from_position=3)
        assert (await old.latest_async()).id == newest.id
        assert await old.result_async(timeout=20) == done
    keys = sql("SELECT id, idempotency_key FROM orchestrator.runs ORDER BY created_at")
    assert [k["idempotency_key"] for k in keys] == [None, None, "order-7"]


async def test_an_event_sent_again_to_a_restarted_run_is_recognised(make_app: Any,
                                                                    sql: Any) -> None:
    """A keyed event the old run took, sent again to the old run's id once it was restarted,
    reaches the new run (the chain's last) and is recognised there as delivered: no second
    event; an event for a later wait reaches the new run."""
    broken = {"ship": True}
    app = shop(make_app(), broken)
    _gated(app)

    async with running(app):
        old = await app.submit_async("gated", 5)
        assert await app.send_event_async(old.id, "open", "yes", event_key="open-5")
        with pytest.raises(RunFailed):
            await old.result_async(timeout=20)
        broken["ship"] = False
        new = await old.restart_async(reason="the carrier is back")
        assert not await app.send_event_async(old.id, "open", "yes", event_key="open-5")
        assert await app.send_event_async(old.id, "close", "bye", event_key="close-5")
        assert await new.result_async(timeout=20) == ["yes", "bye"]
    events = sql("SELECT name, run_id FROM orchestrator.external_events ORDER BY id")
    assert [(e["name"], e["run_id"]) for e in events] == [("open", old.id), ("close", new.id)]


async def test_a_chain_whose_last_run_failed_and_was_restarted_answers_with_the_restart(
        make_app: Any) -> None:
    """A loop that continued as new and failed in its last generation, restarted: the first
    run's handle and its submission key reach the restart through both links."""
    broken = {"ship": True}
    app = shop(make_app(), broken)

    @app.workflow()
    async def looped(ctx, gen):  # type: ignore[no-untyped-def]
        if gen < 2:
            ctx.continue_as_new(gen + 1)
        return await ctx.call("ship", order=gen)

    async with running(app):
        first = await app.submit_async("looped", 0, idempotency_key="loop-1")
        with pytest.raises(RunFailed):
            await first.result_async(timeout=20)
        failed = await first.latest_async()
        assert failed.id != first.id and failed.status == "failed"
        broken["ship"] = False
        new = await app.restart_async(failed.id, reason="the carrier is back")
        assert await first.result_async(timeout=20) == {"shipped": 2}
        assert (await first.latest_async()).id == new.id
        assert (await app.submit_async("looped", 0, idempotency_key="loop-1")).id == new.id


async def test_a_restart_on_patched_code_takes_the_new_path_where_the_old_run_failed(
        make_app: Any, sql: Any) -> None:
    """The fix of the step a run failed at, deployed behind ``ctx.patched``: the restart
    replays the committed charge (before the patch: its path is kept) and, where the old run
    failed and nothing was kept, takes the new path, as a run reaching that point for the
    first time does (docs/versioning.md)."""
    CHARGES.clear()
    old_code = shop(make_app(), {"ship": True})
    async with running(old_code):
        old = await old_code.submit_async("order", 4)
        with pytest.raises(RunFailed):
            await old.result_async(timeout=20)
    assert CHARGES == {"a": 1, "b": 1}

    fixed = make_app()

    @fixed.tool()
    async def charge(ctx, *, card):  # type: ignore[no-untyped-def]
        CHARGES[card] += 1
        return {"charged": card}

    @fixed.tool()
    async def ship_by_post(ctx, *, order):  # type: ignore[no-untyped-def]
        return {"posted": order}

    @fixed.tool()
    async def ship(ctx, *, order):  # type: ignore[no-untyped-def]
        raise ToolError("the carrier refused the label", applied=False, status=422)

    @fixed.workflow()
    async def order(ctx, n):  # type: ignore[no-untyped-def]
        first = await ctx.call(charge, card="a")
        second = await ctx.call(charge, card="b")
        label = await ctx.call(ship_by_post if ctx.patched("post") else ship, order=n)
        return [first, second, label]

    async with running(fixed):
        new = await old.restart_async(reason="shipping by post now")
        assert await new.result_async(timeout=20) == [
            {"charged": "a"}, {"charged": "b"}, {"posted": 4}]
    assert CHARGES == {"a": 1, "b": 1}  # replayed, not charged again
    assert [(e.kind, e.position) for e in await new.journal_async() if e.kind == "patch"] == [
        ("patch", 2)]
