"""Bad strings and values at the owners' API: a stable code naming the field, nothing written
(C2, C10); and the cap on events a run has not consumed yet."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from orchestrator import InvalidRequest, Orchestrator, OrchestratorError, Owner, WorkflowContext
from tests.integration.conftest import running, wait_for


def _nested(levels: int) -> Any:
    value: Any = 1
    for _ in range(levels):
        value = {"a": value}
    return value


def _refused(call: Any, path: str) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        call()
    assert caught.value.code == "INVALID_REQUEST", caught.value
    assert caught.value.path == path, (caught.value.path, caught.value.message)
    return caught.value


@pytest.fixture
def flows(app: Orchestrator) -> Any:
    @app.workflow()
    async def listen(ctx: WorkflowContext, data: Any) -> Any:
        first = await ctx.wait_for_event("go", timeout=timedelta(minutes=5))
        second = await ctx.wait_for_event("go", timeout=timedelta(minutes=5))
        return [first, second]

    return listen


@pytest.mark.parametrize("name", ["a\x00b", "\ud800", "", " acme", "acme ", "ac\u200bme",
                                  "\x1b[31m", "x" * 201])
def test_owner_names_with_unstorable_or_invisible_characters_are_refused(name, app, sql):
    with pytest.raises(InvalidRequest) as caught:
        Owner(tenant=name, principal="p")
    assert caught.value.path == "owner.tenant"
    with pytest.raises(InvalidRequest) as caught:
        Owner(tenant="t", principal=name)
    assert caught.value.path == "owner.principal"


def test_bad_event_names_keys_and_filters_name_their_field(app, flows, sql):
    run = app.submit(flows, None)
    for name in ("a\x00b", "\ud800", "", "x" * 201, "go\u200b"):
        _refused(lambda name=name: app.send_event(run.id, name, 1), "name")
    error = _refused(lambda: app.send_event(run.id, "x" * 201, 1), "name")
    assert "201 characters; at most 200" in error.message
    error = _refused(lambda: app.send_event(run.id, "go", 1, event_key="bad key"), "event_key")
    assert error.message.startswith("event_key must be")
    _refused(lambda: app.list_runs(status="\x00"), "status")
    _refused(lambda: app.list_runs(status="done"), "status")
    _refused(lambda: app.list_runs(workflow="\ud800"), "workflow")
    _refused(lambda: app.list_runs(limit=0), "limit")
    assert sql("SELECT count(*) AS n FROM orchestrator.external_events") == [{"n": 0}]


def test_deep_values_and_huge_integers_are_refused_everywhere_with_their_path(app, flows, sql):
    _refused(lambda: app.submit(flows, {"x": _nested(64)}), "$.input" + ".x" + ".a" * 63)
    _refused(lambda: app.submit(flows, [10**100]), "$.input[0]")
    run = app.submit(flows, {"x": _nested(63), "n": 10**99})
    _refused(lambda: app.send_event(run.id, "go", _nested(65)), "$.payload" + ".a" * 64)
    _refused(lambda: app.send_event(run.id, "go", {"n": -(10**100)}), "$.payload.n")
    assert sql("SELECT count(*) AS n FROM orchestrator.runs") == [{"n": 1}]
    assert sql("SELECT count(*) AS n FROM orchestrator.external_events") == [{"n": 0}]


def test_the_caps_are_the_hosts_to_set(make_app):
    app = make_app(max_json_depth=3, max_int_digits=5)

    @app.workflow()
    async def noop(ctx: WorkflowContext, data: Any) -> Any:
        return data

    _refused(lambda: app.submit(noop, _nested(4)), "$.input" + ".a" * 3)
    _refused(lambda: app.submit(noop, 123456), "$.input")
    app.submit(noop, {"a": {"a": 12345}})
    for bad in ({"max_json_depth": 0}, {"max_json_depth": 1000}, {"max_int_digits": 5000},
                {"max_pending_events": 0}):
        with pytest.raises(OrchestratorError) as caught:
            make_app(**bad)
        assert caught.value.code == "CONFIGURATION_ERROR"


async def test_a_run_holds_at_most_max_pending_events_waiting_to_be_consumed(make_app, sql):  # noqa: E501
    from orchestrator.errors import EventBacklogFull

    app = make_app(max_pending_events=2)

    @app.workflow()
    async def listen(ctx: WorkflowContext, data: Any) -> Any:
        return [await ctx.wait_for_event("go", timeout=timedelta(minutes=5)) for _ in range(3)]

    run = await app.submit_async(listen, None)
    assert await app.send_event_async(run.id, "other", 1, event_key="o-1")
    assert await app.send_event_async(run.id, "other", 2)
    with pytest.raises(EventBacklogFull) as caught:
        await app.send_event_async(run.id, "go", 3)
    assert caught.value.code == "EVENT_BACKLOG_FULL" and caught.value.retryable
    # A retried send of a delivered event is still a duplicate, full or not.
    assert await app.send_event_async(run.id, "other", 1, event_key="o-1") is False
    assert sql("SELECT count(*) AS n FROM orchestrator.external_events") == [{"n": 2}]

    # Events the run consumes make room again.
    run2 = await app.submit_async(listen, None)
    async with running(app):
        for i in range(3):
            async def room(i: int = i) -> bool:
                try:
                    return await app.send_event_async(run2.id, "go", i, event_key=f"g-{i}")
                except EventBacklogFull:
                    return False
            await wait_for(room)
        assert await run2.result_async(timeout=30) == [0, 1, 2]


async def test_a_tool_message_the_database_cannot_store_still_leaves_its_incident(app, sql):
    from orchestrator import ToolContext, ToolError

    @app.tool()
    async def noisy(ctx: ToolContext) -> Any:
        raise ToolError.after_send("timeout", "upstream said a\x00b and \ud800")

    @app.workflow()
    async def calls_noisy(ctx: WorkflowContext, data: Any) -> Any:
        return await ctx.call(noisy)

    run = await app.submit_async(calls_noisy, None)
    async with running(app):
        async def blocked() -> bool:
            return await run.status_async() == "needs_reconciliation"
        await wait_for(blocked)
    rows = sql("SELECT detail FROM orchestrator.incidents WHERE run_id = %s AND phase = 'tool'",
               (run.id,))
    assert len(rows) == 1, "the incident was lost"
    assert rows[0]["detail"]["message"] == "upstream said a\\x00b and \\ud800"


async def test_an_item_whose_arguments_cannot_be_decoded_goes_to_operators_alone(app, sql):
    from orchestrator import NotApplied, ToolContext, ToolError

    @app.tool()
    async def lost(ctx: ToolContext, *, n: int) -> Any:
        raise ToolError.after_send("timeout")

    @lost.lookup
    async def find(ctx: ToolContext, *, n: int) -> Any:
        return NotApplied("nothing with this key")

    @app.workflow()
    async def calls_lost(ctx: WorkflowContext, data: Any) -> Any:
        try:
            return await ctx.call(lost, n=data)
        except Exception:  # noqa: BLE001 - not applied: the run ends either way
            return "gave up"

    runs = [await app.submit_async(calls_lost, n) for n in (1, 2)]
    async with running(app):
        async def blocked() -> bool:
            return all([await r.status_async() == "needs_reconciliation" for r in runs])
        await wait_for(blocked)
    deep = "[" * 3000 + "1" + "]" * 3000
    sql("ALTER TABLE orchestrator.operations DISABLE TRIGGER USER")
    sql("UPDATE orchestrator.operations SET arguments = jsonb_build_object('n', %s::jsonb) "
        "WHERE run_id = %s", (deep, runs[0].id))
    sql("ALTER TABLE orchestrator.operations ENABLE TRIGGER USER")
    reconciler = app.create_reconciler(base_delay=0.01)
    assert await reconciler.run_once() == 2
    items = {r["run_id"]: r for r in sql(
        "SELECT run_id, state, resolution FROM orchestrator.reconciliation_items")}
    assert items[runs[0].id]["state"] == "operator"
    assert (items[runs[1].id]["state"], items[runs[1].id]["resolution"]) == (
        "resolved", "not_applied")
    await app.database.close()


async def test_another_owners_unreadable_run_looks_missing_and_lists_stay_readable(
        make_app, sql, migrated_database_url):
    from orchestrator import AccessDenied
    from tests.integration.conftest import OTHER
    from tests.integration.test_ops_cli import cli

    app = make_app()

    @app.workflow()
    async def noop(ctx: WorkflowContext, data: Any) -> Any:
        return data

    victim = await app.submit_async(noop, None)
    sql("UPDATE orchestrator.runs SET result = %s::jsonb WHERE id = %s",
        ("[" * 3000 + "]" * 3000, victim.id))
    for call in (lambda: app.get_run_async(victim.id, owner=OTHER),
                 lambda: app.send_event_async(victim.id, "go", 1, owner=OTHER),
                 lambda: app.cancel_async(victim.id, owner=OTHER)):
        with pytest.raises(AccessDenied):
            await call()
    assert [r.id for r in await app.list_runs_async()] == [victim.id]
    assert await victim.status_async() == "queued"
    with pytest.raises(OrchestratorError) as caught:
        await victim.result_async(timeout=0)
    assert caught.value.code == "RUN_UNREADABLE"  # its owner is told what is wrong
    code, out, err = await cli(migrated_database_url, "runs", "list")
    assert code == 0 and str(victim.id) in out, err
    await app.database.close()


async def test_operator_inputs_are_checked_before_any_statement(make_app, migrated_database_url):
    from tests.integration.test_ops_cli import cli

    app = make_app(max_json_depth=3, max_record_bytes=200)
    ops = app.operators
    for call, path in (
            (lambda: ops.list_items(operator="alice", older_than=float("nan")), "older_than"),
            (lambda: ops.list_items(operator="alice", older_than=1e300), "older_than"),
            (lambda: ops.list_items(operator="alice", older_than="x"), "older_than"),
            (lambda: ops.list_items(operator="alice", limit="x"), "limit"),
            (lambda: ops.show("x", operator="alice"), "operation_id"),
            (lambda: ops.show(2**70, operator="alice"), "operation_id"),
            (lambda: ops.resolve_not_applied("1; x", evidence="e", operator="alice"),
             "operation_id"),
            (lambda: ops.resolve_committed(1, receipt=_nested(5), evidence="e",
                                           operator="alice"), "$.receipt" + ".a" * 3),
            (lambda: ops.resolve_committed(1, receipt="x" * 500, evidence="e",
                                           operator="alice"), "$.receipt")):
        with pytest.raises(InvalidRequest) as caught:
            await call()
        assert caught.value.path == path, (path, caught.value)
    code, _, err = await cli(migrated_database_url, "ops", "resolve", "1", "--committed",
                             "--receipt", "[" * 5000 + "]" * 5000, "--evidence", "e",
                             "--operator", "alice")
    assert code == 2 and "INVALID_REQUEST" in err, err
    code, _, err = await cli(migrated_database_url, "ops", "list", "--older-than",
                             "99999999999999999999999d")
    assert code == 2 and "INVALID_REQUEST" in err, err
    await app.database.close()


def test_result_timeouts_are_checked(app, flows):
    run = app.submit(flows, None)
    for timeout in (float("nan"), "x", -1, float("inf")):
        with pytest.raises(InvalidRequest) as caught:
            run.result(timeout=timeout)
        assert caught.value.path == "timeout"


async def test_a_workflow_filter_written_as_shown_name_at_version_is_refused_saying_so(
        make_app, migrated_database_url):
    """Every table shows a run's workflow as ``name@version`` (``steps@1``), and a workflow's
    name never holds an ``@``: such a filter could never match. It answered "no runs" (and
    ``replay``, "no runs to check" with exit status 0: a check that passed having checked
    nothing), so it is refused, naming the filter and saying what it takes."""
    from tests.integration.test_ops_cli import cli

    app = make_app()
    for call in (lambda: app.list_runs_async(workflow="steps@1"),
                 lambda: app.operators.list_items(operator="alice", workflow="steps@1")):
        with pytest.raises(InvalidRequest) as caught:
            await call()
        assert caught.value.path == "workflow", caught.value
        assert "not name@version" in caught.value.message, caught.value.message
    for args in (["runs", "list", "--workflow", "steps@1"],
                 ["ops", "list", "--workflow", "steps@1"],
                 ["replay", "--app", "tests.integration.versioned_apps:compatible",
                  "--workflow", "steps@1"]):
        code, out, err = await cli(migrated_database_url, *args)
        assert (code, out) == (2, ""), (args, code, out, err)
        assert err.startswith("orchestrator: error: INVALID_REQUEST: workflow") and \
            "not name@version" in err, (args, err)
    await app.database.close()
