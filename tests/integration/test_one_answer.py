"""One rule, one answer on every surface (CONTRACT C10): the same bad input gets the same code and
the same words from the Python API, the CLI and the HTTP API."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from orchestrator import Orchestrator, RunFailed, ToolError, ToolFailed
from orchestrator.errors import InvalidRequest, SchemaUnsupported
from orchestrator.recovery import RetryPolicy
from orchestrator.testing import replay, replay_async, run_until_idle, run_until_idle_sync
from tests.clitools import run_cli
from tests.consoletools import GRANTS, SCOPES, Client, from_header
from tests.integration.conftest import running

NOT_A_RUN = "not-a-run"
SAID = f"run_id must be a run id (a UUID), not {NOT_A_RUN!r}"


def _python_entry_points(app: Orchestrator) -> dict[str, Callable[[], Awaitable[Any]]]:
    """Every call of the Python API that takes a run id, given one that is not."""
    return {
        "get_run_async": lambda: app.get_run_async(NOT_A_RUN),
        "cancel_async": lambda: app.cancel_async(NOT_A_RUN),
        "send_event_async": lambda: app.send_event_async(NOT_A_RUN, "approval", {}),
        "journal_async": lambda: app.journal_async(NOT_A_RUN),
        "restart_async": lambda: app.restart_async(NOT_A_RUN, reason="try again"),
        "run_until_idle": lambda: run_until_idle(app, runs=[NOT_A_RUN], poll_interval=0.05),
        "replay_async": lambda: replay_async(app, [NOT_A_RUN]),
    }


async def test_a_malformed_run_id_is_invalid_request_in_the_python_api(app, sql):
    """Text that is not a run id is bad input, as the CLI and the HTTP API say it (400
    ``INVALID_REQUEST``, ``path`` ``run_id``): not ``ACCESS_DENIED``, the answer for a run that
    is missing or another owner's (C9), which told a caller to look for a permission it lacks
    instead of at the id it typed. Nothing is written."""

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return data

    for name, call in _python_entry_points(app).items():
        with pytest.raises(InvalidRequest) as refused:
            await call()
        assert (refused.value.code, refused.value.path, refused.value.message) == (
            "INVALID_REQUEST", "run_id", SAID), name
    assert sql("SELECT count(*) AS n FROM orchestrator.runs")[0]["n"] == 0
    await app.database.close()


def test_a_malformed_run_id_is_invalid_request_in_the_sync_api(app):
    """The sync twins answer as the async calls do."""
    calls: dict[str, Callable[[], Any]] = {
        "get_run": lambda: app.get_run(NOT_A_RUN),
        "cancel": lambda: app.cancel(NOT_A_RUN),
        "send_event": lambda: app.send_event(NOT_A_RUN, "approval"),
        "journal": lambda: app.journal(NOT_A_RUN),
        "restart": lambda: app.restart(NOT_A_RUN, reason="try again"),
        "replay": lambda: replay(app, [NOT_A_RUN]),
        "run_until_idle_sync": lambda: run_until_idle_sync(app, runs=[NOT_A_RUN]),
    }
    for name, call in calls.items():
        with pytest.raises(InvalidRequest) as refused:
            call()
        assert (refused.value.code, refused.value.path, refused.value.message) == (
            "INVALID_REQUEST", "run_id", SAID), name
    app.close()


def test_the_cli_says_what_the_python_api_says_of_a_malformed_run_id(migrated_database_url):
    """The CLI's refusal is the Python API's, word for word (exit status 2)."""
    for command in (["runs", "show"], ["runs", "export"], ["runs", "cancel"]):
        done = run_cli([*command, NOT_A_RUN], database_url=migrated_database_url)
        assert done.returncode == 2 and f"INVALID_REQUEST: {SAID}" in done.stderr, (
            command, done.stderr)


async def test_a_retry_after_that_stops_a_call_is_named_with_what_is_accepted(
        app, migrated_database_url):
    """A tool's Retry-After that does not parse, or that asks for longer than the retry
    policy's ``max_delay_ms``, stops the call (reason ``budget``). The error said only that:
    now the call's error, the run's error and ``runs show`` name the hint and what is
    accepted, the same words live and on every replay (they come from the journal)."""
    policy = RetryPolicy(max_attempts=3, base_delay_ms=10, max_delay_ms=30_000)

    @app.tool(effect="idempotent", retry=policy)
    async def limited(ctx, *, hint):  # type: ignore[no-untyped-def]
        raise ToolError.before_send("connection", retry_after=hint)

    @app.workflow()
    async def caught(ctx, hint):  # type: ignore[no-untyped-def]
        try:
            return await ctx.call(limited, hint=hint)
        except ToolFailed as exc:
            return [exc.reason, exc.message]

    @app.workflow()
    async def uncaught(ctx, hint):  # type: ignore[no-untyped-def]
        return await ctx.call(limited, hint=hint)

    unparsed = ("the tool's Retry-After hint was not accepted: it takes whole seconds (ASCII "
                "digits, or a number of seconds of 0 or more) or an HTTP-date, at most 36600 "
                "days away")
    too_long = ("the tool's Retry-After hint asks for a wait of 60000 ms, longer than the retry "
                "policy's max_delay_ms (30000): give the tool a RetryPolicy whose "
                "max_delay_ms covers the waits its provider asks for")
    async with running(app):
        for hint, said in (("soon", unparsed), ("60", too_long)):
            run = await app.submit_async(caught, hint)
            assert await run.result_async(timeout=30) == [
                "budget", f"tool limited failed and was not retried: {said}"]
        run = await app.submit_async(uncaught, "soon")
        with pytest.raises(RunFailed) as failed:
            await run.result_async(timeout=30)
    assert failed.value.message == (
        f"the workflow stopped on TOOL_FAILED: tool limited, cause connection_before_send; "
        f"{unparsed}")
    shown = run_cli(["runs", "show", str(run.id)], database_url=migrated_database_url)
    assert shown.returncode == 0 and unparsed in shown.stdout, shown.stdout


def _changed_code(make_app, ending):  # type: ignore[no-untyped-def]
    """An app whose ``flow`` (version 1) no longer issues the call its runs recorded:
    ``ending`` ``call`` issues another call there, ``return`` ends, ``continue`` continues
    as new."""
    app = make_app()

    @app.tool()
    async def b(ctx):  # type: ignore[no-untyped-def]
        return "b"

    @app.workflow(name="flow", version="1")
    async def flow(ctx, data):  # type: ignore[no-untyped-def]
        if data == "again":
            return "continued"
        if ending == "call":
            await ctx.call(b)
        elif ending == "continue":
            ctx.continue_as_new("again")
        return "changed"

    return app


@pytest.mark.parametrize(("ending", "said"), [
    ("call", "position 0: the journal recorded call 'a', the code issued call 'b'"),
    ("return", "position 0: the journal recorded call 'a', the code ended"),
    ("continue", "position 0: the journal recorded call 'a', the code continued as new"),
])
async def test_the_worker_and_the_replay_check_say_the_same_of_a_mismatch(
        make_app, ending, said):
    """A worker that meets changed code (at run time) and the offline check (``orchestrator
    replay``, ``orchestrator.testing.replay``) name one mismatch in one sentence: the
    position, what the journal recorded there and what the code did instead."""
    old = make_app()

    @old.tool()
    async def a(ctx):  # type: ignore[no-untyped-def]
        return "a"

    @old.workflow(name="flow", version="1")
    async def flow(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.call(a)
        return await ctx.wait_for_event("go")

    run = await old.submit_async(flow, "first")
    await run_until_idle(old, runs=[run], poll_interval=0.05)
    new = _changed_code(make_app, ending)
    (verdict,) = await replay_async(new, [run.id])
    assert (verdict.verdict, verdict.message) == ("nondeterminism", f"NONDETERMINISM: {said}")
    await old.send_event_async(run.id, "go", "now")
    await run_until_idle(new, runs=[run.id], poll_interval=0.05)
    with pytest.raises(RunFailed) as failed:
        await (await new.get_run_async(run.id)).result_async(timeout=10)
    assert (failed.value.code, failed.value.message) == ("NONDETERMINISM", said)


async def test_a_malformed_operation_id_gets_one_answer_everywhere(
        make_app, migrated_database_url):
    """An operation id that is not one is ``INVALID_REQUEST`` naming ``operation_id``, in the
    same words from the operators' Python API, the console's HTTP API and the CLI. The CLI
    answered with argparse's usage error (``invalid int value``), not the ``orchestrator:
    error: CODE: message`` line every other refusal prints (docs/cli-json.md), and the
    Python API with other words than the HTTP API."""
    app = make_app(operator_scopes=SCOPES)
    said = "operation_id must be an operation id (a positive integer), not 'abc'"
    with pytest.raises(InvalidRequest) as refused:
        await app.operators.show("abc", operator="alice")  # type: ignore[arg-type]
    assert (refused.value.path, refused.value.message) == ("operation_id", said)
    with pytest.raises(InvalidRequest) as refused:
        await app.operators.abandon(0, evidence="x", operator="alice")
    assert refused.value.message == (
        "operation_id must be an operation id (a positive integer), not 0")
    async with Client(app.console(from_header, grants=GRANTS), "alice") as alice:
        answer = await alice.get("/api/operations/abc")
        assert (answer.status_code, answer.json()["message"]) == (400, said)
        answer = await alice.get("/api/operations/0")
        assert answer.json()["message"] == refused.value.message
    for command in (["ops", "show", "abc"],
                    ["ops", "abandon", "abc", "--evidence", "x", "--operator", "alice"],
                    ["ops", "resolve", "abc", "--not-applied", "--evidence", "x",
                     "--operator", "alice"]):
        done = run_cli(command, database_url=migrated_database_url)
        assert (done.returncode, done.stderr) == (
            2, f"orchestrator: error: INVALID_REQUEST: {said}\n"), command
    await app.database.close()


async def test_an_entry_from_newer_code_is_refused_by_every_reader(
        app, sql, migrated_database_url, tmp_path):
    """An entry whose schema version this code does not know is ``SCHEMA_UNSUPPORTED``
    (C3), read by its owner (``app.journal``), followed (``runs watch``), shown to an
    operator (``runs show``, ``ops show``, the console's run) or exported (``runs export``):
    one refusal, in one message that names the entry and says what reads it. ``runs show``
    and ``ops show`` printed it, interpreted as an entry of this code, where ``runs watch`` of
    the same run refused it; ``runs export`` wrote it out, its payload read as this code's,
    for a replay to trip over later, and exit status 0."""
    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        raise ToolError.after_send("timeout")

    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    run = await app.submit_async(pay, {})
    await run_until_idle(app, runs=[run], poll_interval=0.05)
    op = sql("SELECT id FROM orchestrator.operations")[0]["id"]
    sql("""INSERT INTO orchestrator.journal_entries (run_id, seq, kind, position, name,
                                                     schema_version, payload, lease_token)
           SELECT id, revision + 1, 'call.unknown', 0, 'charge', 99, '{"op": 1}', lease_token
           FROM orchestrator.runs WHERE id = %s""", (run.id,))
    sql("UPDATE orchestrator.runs SET revision = revision + 1 WHERE id = %s", (run.id,))
    seq = sql("SELECT revision FROM orchestrator.runs")[0]["revision"]
    said = (f"journal event {seq} has schema version 99; this code understands up to 1: read "
            "it with the orchestrator version that wrote it, or a later one")
    with pytest.raises(SchemaUnsupported) as refused:
        await app.journal_async(run.id)
    assert refused.value.message == said
    async with Client(app.console(from_header, grants=GRANTS), "alice") as alice:
        answer = await alice.get(f"/api/runs/{run.id}")
        assert (answer.status_code, answer.json()["code"], answer.json()["message"]) == (
            500, "SCHEMA_UNSUPPORTED", said), answer.text
    exported = tmp_path / "run.json"
    for command in (["runs", "watch", str(run.id)], ["runs", "show", str(run.id)],
                    ["ops", "show", str(op)], ["runs", "export", str(run.id)],
                    ["runs", "export", str(run.id), "-o", str(exported)]):
        done = run_cli(command, database_url=migrated_database_url)
        assert (done.returncode, done.stderr) == (
            2, f"orchestrator: error: SCHEMA_UNSUPPORTED: {said}\n"), command
        if command[1] == "export":
            assert done.stdout == "", command  # no document, not even a part of one
    assert not exported.exists()  # nothing written, not even an empty file
    await app.database.close()
