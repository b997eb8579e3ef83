"""Operator flows end to end through the CLI (CONTRACT C8, C9): list → show → resolve (each
kind) → the run resumes or fails; conflicts rejected; scopes enforced; everything audited."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from pathlib import Path

import pytest

from orchestrator import RetryPolicy, RunFailed, ToolFailed, canonical
from tests.integration.conftest import charge_in_flight, running, wait_for

ROOT = Path(__file__).resolve().parents[2]


async def cli(url: str, *args: str) -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "orchestrator", "--database-url", url, *args, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate()
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


async def test_operator_flows_through_the_cli(make_app, sql, migrated_database_url):
    url = migrated_database_url
    app = make_app()
    calls: dict[str, int] = {}

    @app.tool(max_attempts=2)
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        calls[order] = calls.get(order, 0) + 1
        if calls[order] == 1:
            raise ConnectionResetError("lost after sending")
        return {"charge": f"retry-{order}"}

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        try:
            return await ctx.call(charge, order=order)
        except ToolFailed:
            return "gave up"

    # operation ids of four digits, as a database in use has (a timeline's detail is longer)
    sql("SELECT setval(pg_get_serial_sequence('orchestrator.operations', 'id'), 1000)")
    async with running(app):
        runs = {name: await app.submit_async(pay, name) for name in ("one", "two", "three")}
        await wait_for(lambda: len(sql("SELECT 1 FROM orchestrator.runs "
                                       "WHERE status = 'needs_reconciliation'")) == 3)
        ops = {r["arguments"]["order"]: r["id"]
               for r in sql("SELECT id, arguments FROM orchestrator.operations")}

        code, out, _ = await cli(url, "ops", "list", "--state", "open", "--tool", "charge",
                                 "--older-than", "0s")
        assert code == 0
        assert all(str(op) in out for op in ops.values()) and "TOOL_OUTCOME_UNCERTAIN" in out
        code, out, _ = await cli(url, "ops", "list", "--tool", "refund")
        assert code == 0 and out.strip() == "no operations match --tool refund"

        code, out, _ = await cli(url, "ops", "show", str(ops["one"]))
        assert code == 0
        for text in ('"order": "one"', "acme/alice", "attempts at this position", "lookups",
                     "run timeline", "call.unknown", "intent:",
                     f"next: orchestrator ops resolve {ops['one']} --committed"):
            assert text in out, text
        # What went wrong is one command away: the incident kept for the tool's exception.
        ref = out.split("\nincidents (", 1)[1].split("\ninc_", 1)[1].split()[0]
        code, shown, err = await cli(url, "incidents", "show", f"inc_{ref}", "--operator", "al")
        assert code == 0, err
        assert "ConnectionResetError" in shown and "lost after sending" in shown
        assert "\ntraceback:\nTraceback (most recent call last):" in shown  # as text
        code, out, _ = await cli(url, "runs", "show", str(runs["one"].id))
        assert f"incident inc_{ref}" in out  # the call.unknown event names it too

        resolve_one = ["ops", "resolve", str(ops["one"]), "--committed", "--receipt",
                       '{"charge": "manual-1"}', "--evidence", "PSP dashboard shows ch_1",
                       "--operator", "alice"]
        code, out, err = await cli(url, *resolve_one)
        assert code == 0, err
        assert await runs["one"].result_async(timeout=10) == {"charge": "manual-1"}
        code, out, _ = await cli(url, *resolve_one)  # the same resolution again: a no-op
        assert code == 0 and "already resolved" in out
        code, _, err = await cli(url, "ops", "resolve", str(ops["one"]), "--not-applied",
                                 "--evidence", "changed my mind", "--operator", "alice")
        assert code == 2 and "RESOLUTION_CONFLICT" in err and "Traceback" not in err

        code, _, err = await cli(url, "ops", "resolve", str(ops["two"]), "--not-applied",
                                 "--evidence", "no charge at the PSP", "--operator", "outsider",
                                 "--app", "tests.acceptance.flows:app")
        assert code == 2 and "ACCESS_DENIED" in err

        code, _, err = await cli(url, "ops", "resolve", str(ops["two"]), "--not-applied",
                                 "--evidence", "no charge at the PSP", "--operator", "alice")
        assert code == 0, err
        assert await runs["two"].result_async(timeout=10) == {"charge": "retry-two"}

        code, _, err = await cli(url, "ops", "abandon", str(ops["three"]), "--evidence",
                                 "customer refunded by hand", "--operator", "alice")
        assert code == 0, err
        with pytest.raises(RunFailed) as info:
            await runs["three"].result_async(timeout=10)
        assert info.value.code == "OPERATION_ABANDONED"
        code, shown, err = await cli(url, "incidents", "show", info.value.incident,
                                     "--operator", "al")
        assert code == 0, err  # the failed run's reference leads to who abandoned it and why
        assert "customer refunded by hand" in shown and "alice" in shown
        failed = [e for e in await runs["three"].journal_async() if e.kind == "run.failed"]
        assert [(e.payload["incident"], e.payload["message"]) for e in failed] == [
            (info.value.incident, info.value.message)]  # the journal says what the error says
        # Its timeline in words: the abandonment in prose like its neighbours, and no detail
        # cut short (the next step after an unknown outcome is there in full).
        code, shown, err = await cli(url, "runs", "show", str(runs["three"].id))
        assert code == 0, err
        lines = shown.split("\ntimeline\n", 1)[1].splitlines()
        (abandoned,) = [line for line in lines if " call.abandoned " in line]
        assert abandoned.endswith(f"operation {ops['three']} abandoned by alice: the run fails")
        (unknown,) = [line for line in lines if " call.unknown " in line]
        assert unknown.endswith(f"operation {ops['three']}: outcome unknown "
                                "(TOOL_OUTCOME_UNCERTAIN); next: reconcile")
        assert len(unknown.split("  ")[-1]) > 100  # longer than the other columns' cap
        assert "…" not in shown.split("\ntimeline\n")[1]

        code, _, err = await cli(url, "ops", "resolve", str(ops["three"]), "--committed",
                                 "--evidence", "x", "--operator", "alice")
        assert code == 2 and "--receipt" in err

    assert calls == {"one": 1, "two": 2, "three": 1}
    audit = sql("SELECT operator, action, target_id, evidence, before, after "
                "FROM orchestrator.operator_audit ORDER BY id")
    assert [(a["action"], a["target_id"]) for a in audit] == [
        ("resolve.committed", str(ops["one"])),
        ("resolve.committed.noop", str(ops["one"])),
        ("resolve.not_applied", str(ops["two"])),
        ("resolve.abandoned", str(ops["three"])),
    ]
    assert all(a["operator"] == "alice" and a["evidence"] for a in audit)
    assert audit[0]["before"]["operation"] == "unknown"
    assert audit[0]["after"]["operation"] == "committed"
    code, out, _ = await cli(url, "ops", "list", "--state", "resolved")
    assert code == 0 and out.count("resolved") >= 3
    # By default the list is what still waits: settled items never push it past --limit.
    code, out, _ = await cli(url, "ops", "list")
    assert code == 0 and out.startswith("nothing waits in the reconciliation queue")
    code, out, _ = await cli(url, "ops", "list", "--state", "all", "--limit", "2")
    assert code == 0 and out.count("resolved") == 2 and "there may be more" in out
    code, _, err = await cli(url, "ops", "list", "--limit", "0")
    assert code == 2 and "INVALID_REQUEST" in err and "limit" in err
    assert json.loads(json.dumps(app.metrics.snapshot()))["unknown_outcomes"] == 3


async def _a_sleeping_report(make_app):  # type: ignore[no-untyped-def]
    """An app with a workflow ``report`` that sleeps an hour, and one run of it submitted."""
    app = make_app()

    @app.workflow()
    async def report(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.sleep(3600)

    return app, await app.submit_async(report, {})


async def test_the_audit_log_is_readable_from_the_cli(make_app, sql, migrated_database_url):
    """Who did what, when and why, for every kind of operator action (a resolution, a run's
    cancellation, a schedule's pause), newest first, filtered, in pages, and within the
    operator's tenants: `ops audit`, the console's audit log for the command line."""
    url = migrated_database_url
    app, run = await _a_sleeping_report(make_app)
    await app.schedules.create_async("nightly", "report", cron="0 2 * * *")
    await app.database.close()
    for args in (["runs", "cancel", str(run.id), "--operator", "alice", "--evidence",
                  "customer withdrew"],
                 ["schedules", "pause", "nightly", "--operator", "bob", "--evidence",
                  "report is wrong"]):
        done = await cli(url, *args)
        assert done[0] == 0, done

    code, out, err = await cli(url, "ops", "audit", "--json")
    assert code == 0, err
    doc = json.loads(out)
    assert [(a["action"], a["operator"], a["target_kind"], a["target_id"], a["evidence"])
            for a in doc["audit"]] == [
        ("schedule.pause", "bob", "schedule", "nightly", "report is wrong"),
        ("run.cancel", "alice", "run", str(run.id), "customer withdrew")]
    assert doc["count"] == 2 and doc["limit"] == 50 and doc["next"] is None
    assert doc["audit"][1]["tenant"] == "acme" and doc["audit"][1]["at"].endswith("Z")
    assert doc["audit"][1]["after"]["status"] == "cancelled"

    code, out, err = await cli(url, "ops", "audit", "--action", "run", "--by", "alice")
    assert code == 0, err
    assert "run.cancel" in out and "customer withdrew" in out and "schedule" not in out
    code, out, err = await cli(url, "ops", "audit", "--limit", "1", "--json")
    first = json.loads(out)
    assert first["count"] == 1 and first["next"] is not None
    code, out, err = await cli(url, "ops", "audit", "--limit", "1", "--before",
                               first["next"], "--json")
    assert [a["action"] for a in json.loads(out)["audit"]] == ["run.cancel"]
    code, out, err = await cli(url, "ops", "audit", "--target", "nightly")
    assert code == 0 and "schedule.pause" in out and "run.cancel" not in out

    # Another tenant's operator sees none of it (C9), and bad filters change nothing.
    code, out, err = await cli(url, "ops", "audit", "--app", "tests.acceptance.flows:app",
                               "--operator", "outsider", "--json")
    assert code == 0, err
    assert json.loads(out)["audit"] == []
    code, _, err = await cli(url, "ops", "audit", "--before", "x")
    assert code == 2 and "INVALID_REQUEST" in err and "--before" in err


async def test_the_audit_log_filters_a_target_by_its_kind(make_app, sql, migrated_database_url):
    """A target id names a target only with its kind: a schedule named as a run's id is
    another target. `--target` alone matches both; `--kind` keeps one kind's rows, and a kind
    that no target has is refused, changing nothing."""
    url = migrated_database_url
    app, run = await _a_sleeping_report(make_app)
    await app.schedules.create_async(str(run.id), "report", cron="0 2 * * *")
    await app.database.close()
    for args in (["runs", "cancel", str(run.id), "--operator", "alice", "--evidence",
                  "customer withdrew"],
                 ["schedules", "pause", str(run.id), "--operator", "bob", "--evidence",
                  "report is wrong"]):
        done = await cli(url, *args)
        assert done[0] == 0, done

    async def shown(*args: str) -> list[tuple[str, str]]:
        code, out, err = await cli(url, "ops", "audit", "--target", str(run.id), *args,
                                   "--json")
        assert code == 0, err
        return [(a["target_kind"], a["action"]) for a in json.loads(out)["audit"]]

    assert await shown() == [("schedule", "schedule.pause"), ("run", "run.cancel")]
    assert await shown("--kind", "run") == [("run", "run.cancel")]
    assert await shown("--kind", "schedule") == [("schedule", "schedule.pause")]
    code, out, err = await cli(url, "ops", "audit", "--kind", "run")
    assert code == 0 and "run.cancel" in out and "schedule.pause" not in out, err
    code, _, err = await cli(url, "ops", "audit", "--kind", "workflow")
    assert code == 2 and "INVALID_REQUEST" in err and "kind" in err, err

    # The next page's command keeps the filters: copied as printed, it shows the next row of
    # the same selection (it said `ops audit --before N …`, the filters left to retype).
    code, out, err = await cli(url, "ops", "audit", "--target", str(run.id), "--limit", "1")
    assert code == 0, err
    more = out.splitlines()[-1]
    assert more.startswith(f"(more: orchestrator ops audit --target {run.id} --limit 1 "
                           "--before "), more
    code, out, err = await cli(url, *more[len("(more: orchestrator "):-1].split())
    assert code == 0, err
    assert "run.cancel" in out and "schedule.pause" not in out and "(more" not in out


def _two_lost_charges(make_app):  # type: ignore[no-untyped-def]
    """An app whose workflow ``pay`` makes two calls at once of a tool that loses its answer
    after sending (both end unknown), and the orders the tool was sent."""
    app = make_app()
    sent: list[str] = []

    @app.tool()
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        sent.append(order)
        raise ConnectionResetError("lost after sending")

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.gather(ctx.call(charge, order=f"{order}-1"),
                                ctx.call(charge, order=f"{order}-2"))

    return app, sent, pay


async def test_resolving_one_of_a_runs_unknown_operations_says_it_still_waits(
        make_app, sql, migrated_database_url):
    """A run blocked on two unknown operations (two calls at once) resumes only once both are
    settled: resolving the first says the run still waits, naming the other, and the run's
    detail names only the one left, not the one settled."""
    url = migrated_database_url
    app, sent, pay = _two_lost_charges(make_app)

    async with running(app):
        run = await app.submit_async(pay, "o")
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs")[0]["status"]
                       == "needs_reconciliation")
        first, second = [r["id"] for r in sql("SELECT id FROM orchestrator.operations "
                                              "ORDER BY id")]
        code, out, err = await cli(url, "ops", "resolve", str(first), "--committed",
                                   "--receipt", '{"charge": "c1"}', "--evidence", "PSP: c1",
                                   "--operator", "alice")
        assert code == 0, err
        assert out.strip() == (f"operation {first} resolved as committed; its run still waits "
                               f"for operation {second} to be settled (`orchestrator ops show "
                               f"{second}`)")
        (row,) = sql("SELECT status, waiting_for FROM orchestrator.runs")
        assert row == {"status": "needs_reconciliation",
                       "waiting_for": f"reconciliation of operation {second}"}
        code, out, err = await cli(url, "ops", "resolve", str(second), "--committed",
                                   "--receipt", '{"charge": "c2"}', "--evidence", "PSP: c2",
                                   "--operator", "alice")
        assert code == 0, err
        assert out.strip() == f"operation {second} resolved as committed; the run was woken"
        assert await run.result_async(timeout=10) == [{"charge": "c1"}, {"charge": "c2"}]
    assert sorted(sent) == ["o-1", "o-2"]


async def test_resolving_an_operation_of_a_run_being_cancelled_says_the_run_ends_cancelled(
        make_app, sql, migrated_database_url):
    """A run whose cancellation was requested while it waited for an unknown outcome ends
    cancelled once that outcome is settled: `ops resolve --not-applied` does not say that the
    call is sent again (it is not), nor that it fails in the workflow."""
    url = migrated_database_url
    app = make_app()
    sent: list[str] = []

    @app.tool()
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        sent.append(order)
        raise ConnectionResetError("lost after sending")

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    async with running(app):
        runs = [await app.submit_async(pay, order) for order in ("a", "b")]
        await wait_for(lambda: [r["status"] for r in sql("SELECT status FROM orchestrator.runs")]
                       == ["needs_reconciliation"] * 2)
        for run in runs:
            assert await run.cancel_async() == "needs_reconciliation"
        ops = {r["arguments"]["order"]: r["id"]
               for r in sql("SELECT id, arguments FROM orchestrator.operations")}
        for order, then in (("a", "resend"), ("b", "fail")):
            code, out, err = await cli(url, "ops", "resolve", str(ops[order]), "--not-applied",
                                       "--then", then, "--evidence", "PSP shows none",
                                       "--operator", "alice")
            assert code == 0, err
            assert out.strip() == (f"operation {ops[order]} resolved as not applied; its run "
                                   "was woken and ends cancelled, as was requested (nothing "
                                   "is sent again)")
        for run in runs:
            with pytest.raises(RunFailed) as failed:
                await run.result_async(timeout=10)
            assert failed.value.code == "CANCELLED"
    assert sorted(sent) == ["a", "b"]


async def test_resolving_an_operation_of_a_run_that_has_ended_says_only_the_ledger_changed(
        make_app, sql, migrated_database_url):
    """Two calls at once, both unknown: abandoning one fails the run; resolving the other as
    not applied then settles the ledger only, and says so (the run is not woken, nothing is
    sent again)."""
    url = migrated_database_url
    app, sent, pay = _two_lost_charges(make_app)

    async with running(app):
        run = await app.submit_async(pay, "o")
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs")[0]["status"]
                       == "needs_reconciliation")
        first, second = [r["id"] for r in sql("SELECT id FROM orchestrator.operations "
                                              "ORDER BY id")]
        code, out, err = await cli(url, "ops", "abandon", str(first), "--evidence",
                                   "refunded by hand", "--operator", "alice")
        assert code == 0, err
        with pytest.raises(RunFailed):
            await run.result_async(timeout=10)
        code, out, err = await cli(url, "ops", "resolve", str(second), "--not-applied",
                                   "--evidence", "PSP shows none", "--operator", "alice")
        assert code == 0, err
        assert out.strip() == (f"operation {second} resolved as not applied; its run had "
                               "already ended (failed), so only the ledger changed (nothing "
                               "is sent again)")
        await asyncio.sleep(1)
    assert sorted(sent) == ["o-1", "o-2"]
    assert [r["state"] for r in sql("SELECT state FROM orchestrator.operations ORDER BY id")
            ] == ["abandoned", "not_applied"]


async def test_abandoning_an_operation_of_a_run_that_has_ended_says_only_the_ledger_changed(
        make_app, sql, migrated_database_url):
    """Two calls at once, both unknown: abandoning the first fails the run, and says so;
    abandoning the second does not say the run failed with ``OPERATION_ABANDONED`` again (it
    had ended already: only the ledger changed), and the run keeps its first error."""
    url = migrated_database_url
    app, sent, pay = _two_lost_charges(make_app)

    async with running(app):
        run = await app.submit_async(pay, "o")
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs")[0]["status"]
                       == "needs_reconciliation")
        first, second = [r["id"] for r in sql("SELECT id FROM orchestrator.operations "
                                              "ORDER BY id")]
        code, out, err = await cli(url, "ops", "abandon", str(first), "--evidence",
                                   "refunded by hand", "--operator", "alice")
        assert code == 0, err
        assert out.strip() == (f"operation {first} abandoned; its run failed with "
                               "OPERATION_ABANDONED")
        with pytest.raises(RunFailed):
            await run.result_async(timeout=10)
        (error,) = [r["error"] for r in sql("SELECT error FROM orchestrator.runs")]
        code, out, err = await cli(url, "ops", "abandon", str(second), "--evidence",
                                   "refunded by hand", "--operator", "alice")
        assert code == 0, err
        assert out.strip() == (f"operation {second} abandoned; its run had already ended "
                               "(failed), so only the ledger changed")
        assert [r["error"] for r in sql("SELECT error FROM orchestrator.runs")] == [error]
        code, out, err = await cli(url, "ops", "abandon", str(second), "--evidence",
                                   "refunded by hand", "--operator", "alice")
        assert (code, out.strip()) == (0, f"operation {second} was already abandoned; "
                                          "nothing changed"), err
    assert sorted(sent) == ["o-1", "o-2"]


@contextlib.asynccontextmanager
async def _a_call_in_flight(app, sql):  # type: ignore[no-untyped-def]
    """A run of :func:`charge_in_flight`'s workflow whose call is in flight (its operation
    ``submitted``) while the block runs: (the run, its operation's id and state). The call is
    let go when the block ends, and the run succeeds."""
    pay, entered, release = charge_in_flight(app)
    async with running(app):
        run = await app.submit_async(pay, "o1")
        await wait_for(entered.is_set)
        (op,) = sql("SELECT id, state FROM orchestrator.operations")
        assert op["state"] == "submitted"
        try:
            yield run, op
        finally:
            release.set()
        assert await run.result_async(timeout=10) == {"charge": "o1"}


async def test_resolving_an_operation_whose_call_is_in_flight_says_to_wait(
        make_app, sql, migrated_database_url):
    """An operation still ``submitted`` (its call under way, its outcome not unknown) is not
    the operator's to settle yet: resolving or abandoning it is ``OPERATION_IN_PROGRESS``,
    which says what it is and what to do next, and nothing is written; once its call
    answers, nothing of the operator's attempt is left behind."""
    url = migrated_database_url
    app = make_app()
    async with _a_call_in_flight(app, sql) as (run, op):
        for args in (["ops", "resolve", str(op["id"]), "--committed", "--receipt",
                      '{"charge": "o1"}'],
                     ["ops", "resolve", str(op["id"]), "--not-applied"],
                     ["ops", "abandon", str(op["id"])]):
            code, out, err = await cli(url, *args, "--evidence", "PSP shows it",
                                       "--operator", "alice")
            assert (code, out) == (2, ""), (args, err)
            assert f"OPERATION_IN_PROGRESS: operation {op['id']} is submitted" in err, err
            assert "in flight" in err and "wait" in err and "ops list" in err, err
        assert sql("SELECT 1 FROM orchestrator.operator_audit") == []
    assert sql("SELECT state FROM orchestrator.operations") == [{"state": "committed"}]
    assert sql("SELECT 1 FROM orchestrator.reconciliation_items") == []


async def test_ops_show_of_an_operation_whose_call_is_in_flight_shows_what_is_known(
        make_app, sql, migrated_database_url):
    """``ops show`` of an operation still ``submitted`` (its call in flight, not in the
    reconciliation queue) shows it like a queued one: its state, run, tool, arguments and
    attempts, that it is not queued, and what to wait for; no resolution is offered.
    ``--json`` is the same document, its queue item's fields null and ``wait`` saying why."""
    url = migrated_database_url
    app = make_app()
    async with _a_call_in_flight(app, sql) as (run, op):
        code, out, err = await cli(url, "ops", "show", str(op["id"]))
        assert code == 0, err
        fields = dict(line.split(":", 1) for line in out.split("\n\n", 1)[0].splitlines())
        assert fields["operation"].strip() == str(op["id"])
        assert fields["tool"].strip().startswith("charge version ")
        assert fields["run"].strip() == f"{run.id} (running)"
        assert fields["state"].strip() == ("operation submitted; not in the reconciliation "
                                           "queue")
        assert fields["arguments"].strip() == '{"order": "o1"}'
        assert "attempts at this position" in out and "submitted" in out.split(
            "attempts at this position", 1)[1]
        assert "ops resolve" not in out and "ops abandon" not in out, out
        wait = out.rsplit("\nwait: ", 1)[1]
        assert wait.startswith(f"operation {op['id']} is submitted: its call is in flight")
        assert f"ops list --run {run.id}" in wait, out

        code, out, err = await cli(url, "ops", "show", str(op["id"]), "--json")
        assert code == 0, err
        shown = json.loads(out)
        item = shown["item"]
        assert (item["operation_id"], item["run_id"], item["tool_name"]) == (
            str(op["id"]), str(run.id), "charge")
        assert (item["operation_state"], item["run_status"]) == ("submitted", "running")
        assert item["item_state"] is None and item["reason"] is None
        assert item["created_at"] is None and item["arguments"] == {"order": "o1"}
        assert [a["state"] for a in shown["attempts"]] == ["submitted"]
        assert shown["lookups"] == [] and shown["audit"] == [] and shown["evidence"] == []
        assert shown["wait"].startswith(f"operation {op['id']} is submitted: its call is "
                                        "in flight"), shown["wait"]
        assert sql("SELECT 1 FROM orchestrator.operator_audit") == []
    code, out, err = await cli(url, "ops", "show", str(op["id"]))  # settled: not queued
    assert code == 2 and "INVALID_REQUEST" in err and "is committed" in err, err
    assert f"there is nothing to settle; `orchestrator runs show {run.id}` shows" in err, err


async def test_ops_show_audits_only_the_operation_not_a_queue_of_the_same_id(
        make_app, sql, migrated_database_url):
    """An audit row's target is its kind and id together: ``ops show 42`` (its ``--json``,
    the console's operation, ``Operators.audit(42)``) lists operation 42's rows only, never
    those of a queue named ``42`` (whose changes are audited with target id ``42`` too)."""
    url = migrated_database_url
    app = make_app()
    app.queue("42")

    @app.tool()
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        raise ConnectionResetError("lost after sending")

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    sql("SELECT setval(pg_get_serial_sequence('orchestrator.operations', 'id'), 41)")
    async with running(app):
        await app.submit_async(pay, "o1")
        await wait_for(lambda: sql("SELECT operation_id FROM orchestrator.reconciliation_items"
                                   ) == [{"operation_id": 42}])
        await app.queues.pause_async("42", operator="qa", evidence="queue maintenance")
    code, _, err = await cli(url, "ops", "abandon", "42", "--evidence", "refunded by hand",
                             "--operator", "ann")
    assert code == 0, err
    assert {(r["target_kind"], r["action"]) for r in sql(
        "SELECT target_kind, action FROM orchestrator.operator_audit WHERE target_id = '42'")
    } == {("queue", "queue.pause"), ("operation", "resolve.abandoned")}

    code, out, err = await cli(url, "ops", "show", "42", "--json")
    assert code == 0, err
    assert [a["action"] for a in json.loads(out)["audit"]] == ["resolve.abandoned"]
    code, out, err = await cli(url, "ops", "show", "42")
    assert code == 0, err
    assert "resolve.abandoned" in out and "queue.pause" not in out, out
    assert [a["action"] for a in await app.operators.audit(42, operator="ann")] == [
        "resolve.abandoned"]


async def test_the_audit_of_a_committed_resolution_names_the_receipt_attested(
        make_app, sql, migrated_database_url):
    """The audit row of a committed resolution keeps the digest of the receipt the operator
    gave (SHA-256 of its canonical JSON, the operation's ``receipt_digest``), so that the
    audit says exactly what was attested, not only who and why: in ``ops audit --json``
    (``after.receipt_digest``), in its table and in ``ops show``'s audit. Its no-op repeat
    names the same receipt; a resolution without a receipt names none."""
    url = migrated_database_url
    app, _sent, pay = _two_lost_charges(make_app)
    async with running(app):
        await app.submit_async(pay, "o")
        await wait_for(lambda: len(sql("SELECT 1 FROM orchestrator.reconciliation_items")) == 2)
    first, second = [r["id"] for r in sql("SELECT id FROM orchestrator.operations ORDER BY id")]
    receipt = '{"id": "ch_1", "amount": 500}'
    for _ in range(2):  # the second: a no-op, audited as such
        code, _, err = await cli(url, "ops", "resolve", str(first), "--committed", "--receipt",
                                 receipt, "--evidence", "PSP shows ch_1", "--operator", "ann")
        assert code == 0, err
    code, _, err = await cli(url, "ops", "resolve", str(second), "--not-applied",
                             "--then", "fail", "--evidence", "no charge", "--operator", "ann")
    assert code == 0, err
    (stored,) = sql("SELECT receipt_digest FROM orchestrator.operations WHERE id = %s",
                    (first,))
    digest = canonical.digest({"amount": 500, "id": "ch_1"})
    assert stored["receipt_digest"] == digest

    code, out, err = await cli(url, "ops", "audit", "--json")
    assert code == 0, err
    rows = {a["action"]: a for a in json.loads(out)["audit"]}
    assert rows["resolve.committed"]["after"]["receipt_digest"] == digest
    assert rows["resolve.committed.noop"]["after"]["receipt_digest"] == digest
    assert rows["resolve.committed.noop"]["before"]["receipt_digest"] == digest
    assert "receipt_digest" not in rows["resolve.not_applied"]["after"]
    code, out, err = await cli(url, "ops", "audit")
    assert code == 0, err
    header, _rule, *lines = out.splitlines()
    assert "RECEIPT" in header.split()
    committed = [line for line in lines if " resolve.committed " in line]
    assert committed and digest[:16] in committed[0]
    code, out, err = await cli(url, "ops", "show", str(first))
    assert code == 0, err
    audit_part = out.split("\naudit\n", 1)[1].split("\n\n", 1)[0]
    assert "RECEIPT" in audit_part and audit_part.count(digest[:16]) == 2, audit_part


async def test_resolving_an_unknown_operation_its_run_sends_again_itself_says_to_wait(
        make_app, sql, migrated_database_url):
    """An idempotent tool's attempt whose outcome is unknown is sent again by its run with the
    same key, after the retry policy's backoff; it goes to the reconciliation queue only once
    those re-sends are used up. Meanwhile it is not the operator's to settle: ``ops resolve``
    and ``abandon`` answer ``OPERATION_IN_PROGRESS`` saying so and to wait, not
    ``INVALID_REQUEST``, and nothing is written; ``ops show`` shows it, with the same words in
    its ``wait``."""
    url = migrated_database_url
    app = make_app()

    @app.tool(effect="idempotent", retry=RetryPolicy(max_attempts=2, base_delay_ms=60_000,
                                                     max_delay_ms=60_000))
    async def notify(ctx, *, to):  # type: ignore[no-untyped-def]
        raise ConnectionResetError("lost after sending")

    @app.workflow()
    async def tell(ctx, to):  # type: ignore[no-untyped-def]
        return await ctx.call(notify, to=to)

    async with running(app):
        run = await app.submit_async(tell, "c1")
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs") == [
            {"status": "waiting"}])
    (op,) = sql("SELECT id, state FROM orchestrator.operations")
    assert op["state"] == "unknown" and sql("SELECT 1 FROM orchestrator.reconciliation_items") == []
    for args in (["ops", "resolve", str(op["id"]), "--not-applied", "--evidence", "none",
                  "--operator", "alice"],
                 ["ops", "abandon", str(op["id"]), "--evidence", "none", "--operator", "alice"]):
        code, out, err = await cli(url, *args)
        assert (code, out) == (2, ""), (args, err)
        assert f"OPERATION_IN_PROGRESS: operation {op['id']} is unknown" in err, err
        assert "sends the call again" in err and "wait" in err, err
        assert f"ops list --run {run.id}" in err, err
    code, out, err = await cli(url, "ops", "show", str(op["id"]), "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert shown["item"]["operation_state"] == "unknown" and shown["item"]["item_state"] is None
    assert shown["wait"].startswith(f"operation {op['id']} is unknown, and its run sends the "
                                    "call again itself"), shown["wait"]
    assert sql("SELECT state FROM orchestrator.operations") == [{"state": "unknown"}]
    assert sql("SELECT 1 FROM orchestrator.operator_audit") == []


async def test_ops_show_and_audit_say_what_a_not_applied_resolution_chose_next(
        make_app, sql, migrated_database_url):
    """An operator's not applied is followed by a re-send or by the call's failure (`--then`):
    `ops show` and `ops audit` say which in words, and their `--json` carries it (`then` on
    the item, `after.then` on the audit row); a committed resolution has none."""
    from tests.integration.test_ops_bulk import parked, stuck_app

    url = migrated_database_url
    app = stuck_app(make_app)
    plan = {name: ("pay", None) for name in ("resent", "failed", "done")}
    async with parked(app, sql, plan) as (runs, ops):
        for name, args in (("resent", ["--not-applied", "--then", "resend"]),
                           ("failed", ["--not-applied", "--then", "fail"]),
                           ("done", ["--committed", "--receipt", '{"charge": "c"}'])):
            code, _, err = await cli(url, "ops", "resolve", str(ops[name]), *args,
                                     "--evidence", f"PSP says {name}", "--operator", "alice")
            assert code == 0, err
        assert await runs["resent"].result_async(timeout=10) == {"charge": "retry-resent"}
        with pytest.raises(RunFailed):
            await runs["failed"].result_async(timeout=10)

    said = {"resent": "with --then resend (the run to send the call again as a new attempt)",
            "failed": "with --then fail (the run to fail the call with TOOL_FAILED in the "
                      "workflow)"}
    for name, then in (("resent", "resend"), ("failed", "fail"), ("done", None)):
        code, out, err = await cli(url, "ops", "show", str(ops[name]))
        assert code == 0, err
        (state,) = [line for line in out.splitlines() if line.startswith("state:")]
        if then is None:
            assert state.endswith("resolved as committed"), state
        else:
            assert state.endswith(f"resolved as not_applied {said[name]}"), state
        audit = out.split("\naudit\n", 1)[1].split("\n\n", 1)[0].splitlines()
        assert audit[0].split() == ["AT", "OPERATOR", "ACTION", "THEN", "RECEIPT", "EVIDENCE"]
        words = {"resend": "send again", "fail": "fail the call", None: "-"}[then]
        assert f"  {words}  " in audit[2], audit
        code, out, err = await cli(url, "ops", "show", str(ops[name]), "--json")
        assert code == 0, err
        shown = json.loads(out)
        assert shown["item"]["then"] == then
        assert [a["after"].get("then") for a in shown["audit"]] == [then]

    code, out, err = await cli(url, "ops", "list", "--state", "all", "--json")
    assert code == 0, err
    assert {i["operation_id"]: i["then"] for i in json.loads(out)["items"]} == {
        str(ops["resent"]): "resend", str(ops["failed"]): "fail", str(ops["done"]): None}

    code, out, err = await cli(url, "ops", "audit")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["AT", "OPERATOR", "ACTION", "THEN"]
    rows = {line.split("PSP says ")[-1]: line for line in lines[2:]}
    assert "  send again  " in rows["resent"] and "  fail the call  " in rows["failed"]
    assert rows["done"].split()[3:5] == ["resolve.committed", "-"]
    code, out, err = await cli(url, "ops", "audit", "--json")
    assert code == 0, err
    assert {a["evidence"]: a["after"].get("then") for a in json.loads(out)["audit"]} == {
        "PSP says resent": "resend", "PSP says failed": "fail", "PSP says done": None}


async def test_ops_show_says_that_the_run_of_a_queued_operation_is_being_cancelled(
        make_app, sql, migrated_database_url):
    """An operator deciding between resolutions of an operation whose run's cancellation was
    requested learns it before acting: whatever the resolution, the run ends cancelled and
    nothing is sent again (`ops resolve` only said so afterwards)."""
    from tests.integration.test_ops_bulk import parked, stuck_app

    url = migrated_database_url
    app = stuck_app(make_app)
    async with parked(app, sql, {"a": ("pay", None), "b": ("pay", None)}) as (runs, ops):
        assert await runs["a"].cancel_async() == "needs_reconciliation"
        code, out, err = await cli(url, "ops", "show", str(ops["a"]))
        assert code == 0, err
        (line,) = [line for line in out.splitlines() if line.startswith("run:")]
        assert line == (f"run:        {runs['a'].id} (needs_reconciliation; its cancellation "
                        "was requested: once this operation is resolved as committed or not "
                        "applied, and no other unknown operation of the run remains, it ends "
                        "cancelled and nothing is sent again; abandoning it fails the run with "
                        "OPERATION_ABANDONED)")
        code, out, err = await cli(url, "ops", "show", str(ops["a"]), "--json")
        assert code == 0, err
        assert json.loads(out)["item"]["run_cancel_requested"] is True
        code, out, err = await cli(url, "ops", "show", str(ops["b"]))
        assert code == 0, err
        assert f"run:        {runs['b'].id} (needs_reconciliation)\n" in out
        code, out, err = await cli(url, "ops", "show", str(ops["b"]), "--json")
        assert json.loads(out)["item"]["run_cancel_requested"] is False


async def test_ops_show_says_why_each_earlier_attempt_ended(make_app, sql, migrated_database_url):
    """`ops show` lists every attempt at the queued call's position, but said only `failed`
    of one that had failed (or `cancelled`): the WHY column and `--json`'s `error` now give
    the stored error's stable code and cause."""
    from orchestrator import ToolError

    url = migrated_database_url
    app = make_app()
    calls: list[int] = []

    @app.tool(retry=RetryPolicy(max_attempts=3, base_delay_ms=1, max_delay_ms=1))
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        calls.append(1)
        if len(calls) == 1:
            raise ToolError.before_send("connection")
        raise ConnectionResetError("lost after sending")

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    async with running(app):
        await app.submit_async(pay, "o")
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs")[0]["status"]
                       == "needs_reconciliation")
    first, second = [r["id"] for r in sql("SELECT id FROM orchestrator.operations ORDER BY id")]
    code, out, err = await cli(url, "ops", "show", str(second))
    assert code == 0, err
    table = out.split("\nattempts at this position\n", 1)[1].split("\n\n", 1)[0].splitlines()
    assert table[0].split() == ["OP", "ATTEMPT", "STATE", "WHY", "KEY", "WORKER", "SUBMITTED"]
    assert table[2].split()[:4] == [str(first), "1", "failed", "TOOL_FAILED"], table
    assert "(connection" in table[2], table
    assert table[3].split()[:4] == [str(second), "2", "unknown", "-"], table
    code, out, err = await cli(url, "ops", "show", str(second), "--json")
    assert code == 0, err
    attempts = json.loads(out)["attempts"]
    assert attempts[0]["error"]["code"] == "TOOL_FAILED" and attempts[1]["error"] is None


async def test_ops_resolve_and_abandon_print_one_json_document_with_json(
        make_app, sql, migrated_database_url):
    """A script that settles operations one at a time reads what came of each as it reads
    ``resolve-many --json``'s items: the resolution, whether it changed anything, what the run
    does next and what it still waits for (docs/cli-json.md)."""
    url = migrated_database_url
    app = make_app()

    @app.tool(max_attempts=1)
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        raise ConnectionResetError("lost after sending")

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        try:
            return await ctx.call(charge, order=order)
        except ToolFailed:
            return "gave up"

    async with running(app):
        runs = {name: await app.submit_async(pay, name) for name in ("one", "two", "three")}
        await wait_for(lambda: len(sql("SELECT 1 FROM orchestrator.runs "
                                       "WHERE status = 'needs_reconciliation'")) == 3)
        ops = {r["arguments"]["order"]: r["id"]
               for r in sql("SELECT id, arguments FROM orchestrator.operations")}
        who = ["--evidence", "PSP dashboard", "--operator", "alice", "--json"]

        committed = ["ops", "resolve", str(ops["one"]), "--committed", "--receipt",
                     '{"charge": "manual-1"}', *who]
        code, out, err = await cli(url, *committed)
        assert (code, err) == (0, "")
        assert json.loads(out) == {"operation_id": str(ops["one"]), "resolution": "committed",
                                   "outcome": "resolved", "then": "resume", "waits_for": []}
        assert await runs["one"].result_async(timeout=10) == {"charge": "manual-1"}
        code, out, err = await cli(url, *committed)  # again: nothing changes
        assert (code, err) == (0, "")
        assert json.loads(out) == {"operation_id": str(ops["one"]), "resolution": "committed",
                                   "outcome": "noop", "then": None, "waits_for": []}

        code, out, err = await cli(url, "ops", "resolve", str(ops["two"]), "--not-applied",
                                   "--then", "fail", *who)
        assert (code, err) == (0, "")
        assert json.loads(out) == {"operation_id": str(ops["two"]),
                                   "resolution": "not_applied", "outcome": "resolved",
                                   "then": "fail", "waits_for": []}
        assert await runs["two"].result_async(timeout=10) == "gave up"

        code, out, err = await cli(url, "ops", "abandon", str(ops["three"]), *who)
        assert (code, err) == (0, "")
        assert json.loads(out) == {"operation_id": str(ops["three"]),
                                   "resolution": "abandoned", "outcome": "resolved",
                                   "then": "run_failed", "waits_for": []}
        with pytest.raises(RunFailed):
            await runs["three"].result_async(timeout=10)

        # an error is still one line on stderr, with nothing on stdout
        code, out, err = await cli(url, "ops", "resolve", str(ops["one"]), "--not-applied",
                                   *who)
        assert (code, out) == (2, "") and err.startswith(
            "orchestrator: error: RESOLUTION_CONFLICT: ")


async def test_show_says_that_resolving_an_operation_of_an_ended_run_only_records_it(
        make_app, sql, migrated_database_url):
    """A run that ended (its deadline passed) while its call's outcome was unknown leaves the
    operation in the queue. `ops show` offered `--then resend|fail` and abandoning, as if the
    run were waiting: it says that the run has ended and that a resolution only records the
    call's outcome (nothing is sent again or failed), before the operator chooses."""
    from datetime import timedelta

    from tests.integration.conftest import never_answers

    app = make_app()

    @app.tool()
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        await never_answers()

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    async with running(app):
        run = await app.submit_async(pay, "late", deadline=timedelta(seconds=0.5))
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.reconciliation_items"))
        with pytest.raises(RunFailed):
            await run.result_async(timeout=10)
    [op] = sql("SELECT id FROM orchestrator.operations")
    code, out, err = await cli(migrated_database_url, "ops", "show", str(op["id"]))
    assert code == 0, err
    [line] = [x for x in out.splitlines() if x.startswith("run:")]
    assert "(failed; it has ended: resolving this operation only records what became of its " \
           "call (nothing is sent again or failed, the run stays as it ended))" in line
    assert "next: orchestrator ops resolve" in out  # the ledger may still be settled
    await app.database.close()


async def test_show_says_when_it_cut_an_evidence_line_and_where_it_is_whole(
        make_app, sql, migrated_database_url):
    """`ops show` cut each piece of evidence the engine kept (a late receipt, a note) to 200
    characters without a mark, so that a receipt copied from it for `--committed --receipt`
    was silently incomplete: a cut line says so and that `--json` gives it whole."""
    from datetime import timedelta

    from tests.integration.conftest import never_answers

    app = make_app()

    @app.tool(timeout=timedelta(seconds=0.3))
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        await never_answers()

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    async with running(app):
        await app.submit_async(pay, "big")
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.reconciliation_items"))
    receipt = {"id": "ch_1", "lines": ["x" * 40] * 10}
    sql("UPDATE orchestrator.reconciliation_items SET evidence = jsonb_build_array("
        "jsonb_build_object('kind', 'late_receipt', 'receipt', %s::jsonb), "
        "jsonb_build_object('note', 'short'))", (json.dumps(receipt),))
    [op] = sql("SELECT id FROM orchestrator.operations")
    code, out, err = await cli(migrated_database_url, "ops", "show", str(op["id"]))
    assert code == 0, err
    lines = out.split("\nevidence\n")[1].split("\n\n")[0].splitlines()
    assert lines[0].endswith("… (cut: `ops show --json` gives it whole)")
    assert lines[1] == '  {"note": "short"}'
    code, out, err = await cli(migrated_database_url, "ops", "show", str(op["id"]), "--json")
    assert json.loads(out)["evidence"][0]["receipt"] == receipt
    await app.database.close()
