"""A failed run names its cause to its owner, safely (CONTRACT C10, C11, C13): the public error
names the orchestrator error that stopped the workflow in controlled fields (a failed tool
call, an event that did not arrive), its one incident leads to the whole story, and what a
lookup said reaches incident readers only."""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import pytest

from orchestrator import EventTimeout, NotApplied, RunFailed, ToolError
from orchestrator.db.config import DatabaseTarget, validate_url
from orchestrator.db.database import Database
from orchestrator.db.grants import grant_runtime
from orchestrator.operators import Operators
from tests.integration.conftest import never_answers, running, wait_for
from tests.integration.contract.helpers import parked
from tests.integration.test_ops_cli import cli

SECRET = "sk_live_SECRET"
TOOL_TEXT = f"https://user:{SECRET}@psp.example/v1/charges"
SCOPED_APP = "tests.integration.scoped_app:app"  # opA: acme, reader: acme (incident reader)
ACCESS = {"operator_scopes": {"opA": ["acme"], "reader": ["acme"]},
          "incident_readers": ["reader"]}


def _row(sql: Any, run: Any) -> dict[str, Any]:
    rows = sql("SELECT status, outcome_code, error FROM orchestrator.runs WHERE id = %s",
               (run.id,))
    return dict(rows[0])


def _incidents(sql: Any) -> dict[str, dict[str, Any]]:
    return {r["ref"]: r for r in sql("SELECT * FROM orchestrator.incidents")}


async def _runs_show(url: str, run: Any) -> tuple[str, dict[str, Any]]:
    code, text, err = await cli(url, "runs", "show", str(run.id))
    assert code == 0, err
    code, out, err = await cli(url, "runs", "show", str(run.id), "--json")
    assert code == 0, err
    return text, json.loads(out)


def _timeout_app(make_app: Any, said: str,
                 timeout: timedelta | float = timedelta(seconds=0.2)) -> tuple[Any, Any]:
    """``charge`` never answers (it times out) and its lookup says it was not applied."""
    app = make_app(**ACCESS)

    @app.tool(timeout=timeout)
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        await never_answers()

    @charge.lookup
    async def find(ctx, *, order):  # type: ignore[no-untyped-def]
        return NotApplied(said)

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    return app, pay


# -- a failed tool call ----------------------------------------------------------------------

@pytest.mark.parametrize("budget", [timedelta(seconds=0.2), 0.2], ids=["timedelta", "seconds"])
async def test_a_timed_out_call_proven_not_applied_names_the_timeout(
        make_app, sql, migrated_database_url, budget):  # type: ignore[no-untyped-def]
    """The hung call is cut off after its budget, given as a timedelta or as the same number
    of seconds (``@app.tool(timeout=0.2)``), and the run's failure names the timeout."""
    app, pay = _timeout_app(make_app, f"no charge with this key; checked {TOOL_TEXT}",
                            timeout=budget)
    async with running(app):
        run = await app.submit_async(pay, "o-1")
        await wait_for(parked(sql, run))
        assert await app.create_reconciler().run_once() == 1
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=15)

    failed = info.value
    cause = {"code": "TOOL_FAILED", "tool": "charge", "cause": "timeout", "reason": "budget",
             "attempts": 1, "stage": None, "reconciled": "lookup"}
    assert failed.code == "WORKFLOW_FAILED"  # the outcome code is a promise: unchanged
    assert failed.cause == cause and failed.to_dict()["cause"] == cause
    assert failed.message == "the workflow stopped on TOOL_FAILED: tool charge, cause timeout"
    row = _row(sql, run)
    assert row["outcome_code"] == "WORKFLOW_FAILED" and row["error"]["cause"] == cause
    assert row["error"]["incident"] == failed.incident
    assert (await run.info_async()).error["cause"] == cause  # RunInfo

    # One reference leads to the whole story: the tool's incident and the lookup's.
    incidents = _incidents(sql)
    story = incidents[failed.incident]
    (op,) = [r["id"] for r in sql("SELECT id FROM orchestrator.operations")]
    assert story["code"] == "WORKFLOW_FAILED" and story["operation_id"] == op
    assert story["detail"]["cause"] == cause and story["detail"]["operations"] == [op]
    related = {i["code"]: i for i in story["detail"]["incidents"]}
    assert related["TOOL_ERROR"]["phase"] == "dispatch"
    assert related["LOOKUP"]["cause"] == "not_applied"
    assert {i["ref"] for i in story["detail"]["incidents"]} == set(incidents) - {
        failed.incident}
    kinds = [e["kind"] for e in story["detail"]["timeline"]]
    assert kinds == ["call.submitted", "call.unknown", "call.not_applied", "call.failed"]
    lookup_ref = related["LOOKUP"]["ref"]
    assert SECRET in json.dumps(incidents[lookup_ref]["detail"])  # kept, protected

    url = migrated_database_url
    code, out, err = await cli(url, "incidents", "show", failed.incident, "--app", SCOPED_APP,
                               "--operator", "reader")
    assert code == 0, err
    assert related["TOOL_ERROR"]["ref"] in out and lookup_ref in out
    assert "call.not_applied" in out and SECRET not in out  # the lookup's text is in its own

    # Nothing secret became public.
    text, shown = await _runs_show(url, run)
    assert "cause:" in text and "TOOL_FAILED (tool charge, cause timeout" in text
    assert shown["run"]["error"]["cause"] == cause
    public = [json.dumps(row["error"]), str(failed), json.dumps(failed.to_dict()), text,
              json.dumps(shown)]
    assert not [p for p in public if SECRET in p]
    await app.database.close()


@pytest.mark.parametrize(("raised", "kept", "public"), [
    (ToolError.after_send("timeout", f"no answer from {TOOL_TEXT}"), "timeout_after_send",
     "timeout_after_send"),
    (ToolError.after_send("connection"), "connection_after_send", "connection_after_send"),
    (ToolError(f"lost: {TOOL_TEXT}"), "outcome_unknown", "outcome_unknown"),
    # A word the tool chose is tool text: in its incident's details, not in the public error.
    (ToolError("lost", cause=SECRET), "tool_defined", "tool_defined"),
    (ConnectionResetError(f"reset by {TOOL_TEXT}"), "ConnectionResetError", "outcome_unknown"),
])
async def test_an_unknown_outcome_proven_not_applied_keeps_the_tools_cause(
        make_app, sql, raised, kept, public):  # type: ignore[no-untyped-def]
    """The tool said why its outcome is unknown (``ToolError.after_send("timeout")``): its
    incident keeps that word as its ``cause`` (a word the tool chose: ``tool_defined``, the
    word itself in the details; a plain exception: its type), and once a lookup proves the
    attempt not applied, the run's error names it, not a generic ``outcome_unknown``."""
    app = make_app()

    @app.tool()
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        raise raised

    @charge.lookup
    async def find(ctx, *, order):  # type: ignore[no-untyped-def]
        return NotApplied("no charge with this key")

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    async with running(app):
        run = await app.submit_async(pay, "o-1")
        await wait_for(parked(sql, run))
        (tool_incident,) = sql("SELECT * FROM orchestrator.incidents WHERE code = 'TOOL_ERROR'")
        assert (tool_incident["phase"], tool_incident["cause"]) == ("tool", kept)
        assert tool_incident["detail"].get("cause") == (SECRET if kept == "tool_defined"
                                                        else None)
        assert await app.create_reconciler().run_once() == 1
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=15)
    assert info.value.cause == {"code": "TOOL_FAILED", "tool": "charge", "cause": public,
                                "reason": "budget", "attempts": 1, "stage": None,
                                "reconciled": "lookup"}
    assert SECRET not in json.dumps(_row(sql, run)["error"])
    await app.database.close()


@pytest.mark.parametrize(("raised", "public"), [
    (ToolError.from_status(401, f"denied for {TOOL_TEXT}"), "authentication"),
    # A cause word the tool chose is tool text too: the public error does not repeat it.
    (ToolError(f"refused: {TOOL_TEXT}", applied=False, cause=SECRET), "tool_defined"),
])
async def test_a_tool_error_not_retried_fails_the_run_without_its_text(
        make_app, sql, migrated_database_url, raised, public):  # type: ignore[no-untyped-def]
    app = make_app()

    @app.tool()
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        raise raised

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    async with running(app):
        run = await app.submit_async(pay, "o-1")
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=15)

    failed = info.value
    cause = {"code": "TOOL_FAILED", "tool": "charge", "cause": public, "reason": "cause",
             "attempts": 1, "stage": None, "reconciled": None}
    assert (failed.code, failed.cause) == ("WORKFLOW_FAILED", cause)
    assert failed.message == f"the workflow stopped on TOOL_FAILED: tool charge, cause {public}"
    row = _row(sql, run)
    assert row["error"]["cause"] == cause
    incidents = _incidents(sql)
    story = incidents[failed.incident]
    (tool_ref,) = [i["ref"] for i in story["detail"]["incidents"]]
    assert incidents[tool_ref]["code"] == "TOOL_ERROR" and incidents[tool_ref]["phase"] == "tool"
    assert TOOL_TEXT in incidents[tool_ref]["detail"]["message"]  # where the text belongs

    text, shown = await _runs_show(migrated_database_url, run)
    public_parts = [json.dumps(row["error"]), str(failed), json.dumps(failed.to_dict()),
                    json.dumps(shown["run"]["error"]),
                    next(line for line in text.splitlines() if line.startswith("error:")),
                    next(line for line in text.splitlines() if line.startswith("cause:"))]
    assert not [p for p in public_parts if SECRET in p]
    if public == "authentication":  # the tool chose no word: nothing of it anywhere public
        assert SECRET not in text + json.dumps(shown)
    await app.database.close()


async def test_attempts_that_failed_before_sending_are_not_said_to_be_sent(
        make_app, sql, migrated_database_url):  # type: ignore[no-untyped-def]
    """``ToolError.before_send`` proves the request never left: ``runs show`` says so on the
    attempt's own line, on its retry and on the call's failure, not "attempt 1 sent"."""
    from orchestrator.recovery import RetryPolicy

    app = make_app()

    @app.tool(retry=RetryPolicy(max_attempts=2, base_delay_ms=0))
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        raise ToolError.before_send("connection", "no route to the PSP")

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    async with running(app):
        run = await app.submit_async(pay, "o-1")
        with pytest.raises(RunFailed):
            await run.result_async(timeout=15)

    text, shown = await _runs_show(migrated_database_url, run)
    ops = {o["attempt"]: o["id"] for o in shown["operations"]}
    timeline = text.split("\ntimeline\n", 1)[1]
    assert " sent (operation" not in timeline
    for attempt in (1, 2):
        assert (f"attempt {attempt} handed to the tool, which failed before sending it "
                f"(operation {ops[attempt]}, key ") in timeline
    assert "attempt 1 was never sent (connection_before_send); attempt 2 after 0 ms" in timeline
    assert (f"operation {ops[2]} failed before it was sent: connection_before_send (budget)"
            in timeline)
    await app.database.close()


async def test_a_call_failed_and_caught_leaves_no_cause(app, sql):
    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        raise ToolError.from_status(409, "duplicate")

    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        from orchestrator import ToolFailed, WorkflowError
        try:
            await ctx.call(charge)
        except ToolFailed as exc:
            raise WorkflowError(f"could not charge ({exc.cause})") from None

    async with running(app):
        run = await app.submit_async(pay, {})
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=15)
    assert info.value.message == "could not charge (conflict)" and info.value.cause is None
    assert _row(sql, run)["error"]["cause"] is None


# -- a wait for an event that timed out ------------------------------------------------------

async def test_an_event_timeout_is_catchable_and_raised_again_on_replay(app, sql):
    seen: list[tuple[str, str, bool, bool]] = []

    @app.workflow()
    async def approve(ctx, data):  # type: ignore[no-untyped-def]
        try:
            await ctx.wait_for_event("approval", timeout=timedelta(seconds=0.3))
        except EventTimeout as exc:
            seen.append((exc.code, exc.event, isinstance(exc, TimeoutError),
                         exc.timeout_at is not None))
        await ctx.wait_for_event("go")  # parks: the next claim replays from the top
        return "went on"

    async with running(app):
        run = await app.submit_async(approve, {})
        await wait_for(lambda: seen and _row(sql, run)["status"] == "waiting")
        assert await app.send_event_async(run.id, "go", None)
        assert await run.result_async(timeout=15) == "went on"
    # Live, then from the journal at the replay: the same typed error both times.
    assert seen == [("EVENT_TIMEOUT", "approval", True, True)] * 2
    kinds = [r["kind"] for r in sql("SELECT kind FROM orchestrator.journal WHERE run_id = %s "
                                    "ORDER BY seq", (run.id,))]
    assert kinds.count("event.timeout") == 1


async def test_an_event_timeouts_incident_reference_is_the_same_on_replay(app, sql):
    """A caught ``EventTimeout`` names the same incident reference live and on every replay:
    a workflow that records it (here, in a call's arguments) replays its history instead of
    meeting another reference (another intent digest: ``NONDETERMINISM``)."""
    noted: list[str] = []

    @app.tool()
    async def note(ctx, *, ref):  # type: ignore[no-untyped-def]
        noted.append(ref)
        return ref

    @app.workflow()
    async def approve(ctx, data):  # type: ignore[no-untyped-def]
        try:
            await ctx.wait_for_event("approval", timeout=timedelta(seconds=0.3))
        except EventTimeout as exc:
            ref = await ctx.call(note, ref=exc.incident)
        await ctx.sleep(1.2)  # parks: the next claim replays the timeout and the call
        return ref

    async with running(app):
        run = await app.submit_async(approve, {})
        ref = await run.result_async(timeout=15)
    assert noted == [ref] and ref.startswith("inc_")


async def test_an_uncaught_event_timeout_fails_the_run_naming_it(app, sql):
    @app.workflow()
    async def approve(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.wait_for_event("approval", timeout=timedelta(seconds=0.3))

    async with running(app):
        run = await app.submit_async(approve, {})
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=15)
    failed = info.value
    cause = {"code": "EVENT_TIMEOUT", "event": "approval"}
    assert (failed.code, failed.cause) == ("WORKFLOW_FAILED", cause)
    assert failed.message == "the workflow stopped on EVENT_TIMEOUT: event 'approval'"
    row = _row(sql, run)
    assert row["error"]["cause"] == cause
    ended = sql("SELECT payload FROM orchestrator.journal WHERE run_id = %s "
                "AND kind = 'run.failed'", (run.id,))
    assert ended[0]["payload"]["cause"] == cause
    assert _incidents(sql)[failed.incident]["detail"]["cause"] == cause


async def test_a_result_over_the_cap_or_not_json_names_its_code(make_app, sql):
    """A result the run cannot keep fails it ``WORKFLOW_FAILED``, as an orchestrator error the
    workflow did not catch does, with the code in ``cause``: ``PAYLOAD_TOO_LARGE`` for one over
    ``max_record_bytes``, ``INVALID_REQUEST`` for one that is not JSON, so that the owner
    can tell why without the incident; nothing is truncated."""
    app = make_app(max_record_bytes=1000)

    @app.workflow()
    async def big(ctx, n):  # type: ignore[no-untyped-def]
        return "x" * n

    @app.workflow()
    async def odd(ctx, data):  # type: ignore[no-untyped-def]
        return {"at": {1, 2}}

    async with running(app):
        too_big, not_json = await app.submit_async(big, 2000), await app.submit_async(odd, {})
        failures = []
        for run in (too_big, not_json):
            with pytest.raises(RunFailed) as info:
                await run.result_async(timeout=15)
            failures.append(info.value)
    assert [(f.code, f.cause) for f in failures] == [
        ("WORKFLOW_FAILED", {"code": "PAYLOAD_TOO_LARGE"}),
        ("WORKFLOW_FAILED", {"code": "INVALID_REQUEST"})]
    assert [_row(sql, run)["error"]["cause"] for run in (too_big, not_json)] == [
        {"code": "PAYLOAD_TOO_LARGE"}, {"code": "INVALID_REQUEST"}]
    assert sql("SELECT count(*) AS n FROM orchestrator.runs WHERE result IS NOT NULL"
               )[0]["n"] == 0


async def test_a_child_runs_cause_reaches_its_parent(app, sql):
    @app.workflow()
    async def approve(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.wait_for_event("approval", timeout=timedelta(seconds=0.3))

    @app.workflow()
    async def parent(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.run_child(approve, {})

    async with running(app):
        run = await app.submit_async(parent, {})
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=15)
    (child,) = sql("SELECT id FROM orchestrator.runs WHERE parent_run_id IS NOT NULL")
    assert info.value.cause == {"code": "WORKFLOW_FAILED", "run_id": str(child["id"]),
                                "cause": {"code": "EVENT_TIMEOUT", "event": "approval"}}
    assert info.value.message == f"the workflow stopped on WORKFLOW_FAILED: child run {child['id']}"


# -- what a lookup said: evidence for incident readers ---------------------------------------

async def test_a_lookups_reason_is_shown_to_incident_readers_only(
        make_app, sql, migrated_database_url):  # type: ignore[no-untyped-def]
    said = f"no charge with this key; checked {TOOL_TEXT}"
    app, pay = _timeout_app(make_app, said)
    async with running(app):
        run = await app.submit_async(pay, "o-1")
        await wait_for(parked(sql, run))
        assert await app.create_reconciler().run_once() == 1
        with pytest.raises(RunFailed):
            await run.result_async(timeout=15)
    (op,) = [r["id"] for r in sql("SELECT id FROM orchestrator.operations")]

    read = await app.operators.show(op, operator="reader")
    (lookup,) = read["lookups"]
    assert (lookup["attempt"], lookup["answer"], lookup["has_reason"]) == (1, "not_applied", True)
    assert lookup["reason"] == said and read["reasons"] == "shown"
    other = await app.operators.show(op, operator="opA")  # in scope, not an incident reader
    (hidden,) = other["lookups"]
    assert (hidden["answer"], hidden["has_reason"], hidden["reason"]) == (
        "not_applied", True, None)
    assert hidden["incident"] == lookup["incident"] and hidden["created_at"] is not None
    assert other["reasons"] == "withheld" and SECRET not in json.dumps(other, default=str)

    url = migrated_database_url
    for operator, shows in (("reader", True), ("opA", False)):
        base = ["ops", "show", str(op), "--app", SCOPED_APP, "--operator", operator]
        code, out, err = await cli(url, *base)
        assert code == 0, err
        assert (said in out) is shows and lookup["incident"] in out and "not_applied" in out
        if not shows:
            assert SECRET not in out and "needs the incident-reader grant" in out
        code, out, err = await cli(url, *base, "--json")
        assert code == 0, err
        (record,) = json.loads(out)["lookups"]
        assert record["has_reason"] is True and record["incident"] == lookup["incident"]
        assert record["reason"] == (said if shows else None)
        assert json.loads(out)["reasons"] == ("shown" if shows else "withheld")
    await app.database.close()


async def test_a_role_without_incident_details_still_shows_the_lookups(
        make_app, sql, make_role, migrated_database_url):  # type: ignore[no-untyped-def]
    app, pay = _timeout_app(make_app, f"not found; {TOOL_TEXT}")
    async with running(app):
        run = await app.submit_async(pay, "o-1")
        await wait_for(parked(sql, run))
        assert await app.create_reconciler().run_once() == 1
    (op,) = [r["id"] for r in sql("SELECT id FROM orchestrator.operations")]
    role = make_role()
    grant_runtime(DatabaseTarget(validate_url(migrated_database_url), "argument"), role.name,
                  incident_details=False)
    db = Database(DatabaseTarget(validate_url(role.url), "argument"), max_pool_size=1)
    try:
        shown = await Operators(db).show(op, operator="al")  # a reader, by the app's rules
        (lookup,) = shown["lookups"]
        assert shown["reasons"] == "unreadable"
        assert (lookup["has_reason"], lookup["reason"]) == (True, None)
    finally:
        await db.close()
        await app.database.close()


async def test_a_cancellation_escaping_workflow_code_fails_the_run_once(app, sql):
    """Workflow code that cancels a task of its own and awaits it lets ``CancelledError``
    escape: the workflow raised, so the run fails ``WORKFLOW_FAILED`` with an incident naming
    the exception, on its first claim (it is not left running, to be claimed again and again
    as its lease lapses)."""
    import asyncio

    @app.workflow()
    async def impatient(ctx, data):  # type: ignore[no-untyped-def]
        helper = asyncio.ensure_future(asyncio.sleep(3600))
        await asyncio.sleep(0)
        helper.cancel()
        await helper
        return "done"

    async with running(app, lease_ttl=0.5) as worker:
        run = await app.submit_async(impatient, {})
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=10)
    assert info.value.code == "WORKFLOW_FAILED" and worker.claimed == 1
    row = _row(sql, run)
    assert row["status"] == "failed"
    assert _incidents(sql)[row["error"]["incident"]]["cause"] == "CancelledError"
