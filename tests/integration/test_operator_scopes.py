"""Operator surfaces keep to the operator's tenants and keep tool text protected (CONTRACT C9,
C10, C17): a name that is not a configured operator sees nothing; an incident or an audit row
of another tenant looks missing, with or without incident readers; what a lookup said is kept
in an incident, never in logs or operator views."""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from orchestrator import AccessDenied, InvalidRequest, NotApplied, Orchestrator, StillUnknown
from tests.integration.conftest import OTHER, OWNER, running, wait_for
from tests.integration.test_ops_cli import cli

SECRET = "sk_live_PROBE_4242"
TOKEN = "tok_PROBE_77"
TOOL_TEXT = f"https://user:{SECRET}@psp.example/v1/charges Bearer {TOKEN}"
SCOPES = {"opA": ["acme"], "opB": ["globex"]}
SCOPED_APP = "tests.integration.scoped_app:app"  # opA: acme, opB: globex, reader: acme
MISSING_REF = "inc_0000000000000000"


def _uncertain_app(make_app: Any, **options: Any) -> tuple[Orchestrator, Any]:
    """An app whose one tool leaves its outcome unknown, with upstream text in its error."""
    app = make_app(**options)

    @app.tool()
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        raise ConnectionResetError(f"lost after sending to {TOOL_TEXT}")

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    return app, pay


async def _park_both_tenants(app: Orchestrator, pay: Any, sql: Any
                             ) -> tuple[dict[str, int], dict[str, str]]:
    """One unknown operation of acme and one of globex: their ids and incidents by tenant."""
    async with running(app):
        await app.submit_async(pay, "a", owner=OWNER)
        await app.submit_async(pay, "b", owner=OTHER)
        await wait_for(lambda: len(sql("SELECT 1 FROM orchestrator.runs "
                                       "WHERE status = 'needs_reconciliation'")) == 2)
    ops = {r["tenant"]: r["id"] for r in sql("SELECT id, tenant FROM orchestrator.operations")}
    refs = {r["tenant"]: r["ref"] for r in sql(
        "SELECT i.ref, o.tenant FROM orchestrator.incidents i "
        "JOIN orchestrator.operations o ON o.id = i.operation_id")}
    assert set(ops) == set(refs) == {"acme", "globex"}
    return ops, refs


def _text(value: Any) -> str:
    return json.dumps(value, default=str)


# -- (3) identities and scopes fail closed --------------------------------------------------

@pytest.mark.parametrize("name", ["opA ", " opA", "OPA", "opa", "opA\u200b", "op\u200dA",
                                  "opA\t", "nobody", "operator"])
async def test_a_name_that_is_not_a_configured_operator_sees_nothing_and_may_do_nothing(
        make_app, sql, name):  # type: ignore[no-untyped-def]
    app, pay = _uncertain_app(make_app, operator_scopes=SCOPES)
    ops, refs = await _park_both_tenants(app, pay, sql)
    operators = app.operators
    attempts: list[Callable[[], Awaitable[Any]]] = [
        lambda: operators.list_items(operator=name),
        *((lambda op=op: operators.show(op, operator=name)) for op in ops.values()),
        lambda: operators.resolve_not_applied(ops["acme"], evidence="x", operator=name),
        lambda: operators.abandon(ops["globex"], evidence="x", operator=name),
        *((lambda ref=ref: operators.incident(ref, operator=name)) for ref in refs.values()),
        lambda: operators.audit(operator=name)]
    for attempt in attempts:
        with pytest.raises((InvalidRequest, AccessDenied)) as info:
            await attempt()
        if name.strip() == name and name.isprintable():  # a valid name nobody configured
            assert isinstance(info.value, AccessDenied)
            assert "not configured" in str(info.value) and "opB" not in str(info.value)
        else:
            assert isinstance(info.value, InvalidRequest) and info.value.path == "operator"
    assert [r["state"] for r in sql("SELECT state FROM orchestrator.operations")] == [
        "unknown", "unknown"]
    assert sql("SELECT 1 FROM orchestrator.operator_audit") == []
    # a configured operator still sees its own tenant, and only it
    assert [i["operation_id"] for i in await operators.list_items(operator="opA")] == [
        ops["acme"]]
    await app.database.close()


async def test_the_cli_with_an_app_needs_an_operator_and_applies_its_scopes(
        make_app, sql, migrated_database_url):  # type: ignore[no-untyped-def]
    url = migrated_database_url
    app, pay = _uncertain_app(make_app)
    ops, refs = await _park_both_tenants(app, pay, sql)
    b = str(ops["globex"])
    for args in (["ops", "show", b], ["ops", "list"], ["ops", "list", "--state", "all"]):
        code, out, err = await cli(url, *args, "--app", SCOPED_APP)
        assert code == 2 and "pass --operator NAME" in err, (args, err)
        assert out == "" and SECRET not in err
    code, _, err = await cli(url, "ops", "resolve", b, "--not-applied", "--evidence", "x",
                             "--app", SCOPED_APP)
    assert code == 2 and "--operator" in err
    for name in ("opA ", "opA\u200b", "op A"):
        code, out, err = await cli(url, "ops", "show", b, "--app", SCOPED_APP,
                                   "--operator", name)
        assert code == 2 and "INVALID_REQUEST" in err and out == "", name
    code, out, err = await cli(url, "ops", "show", b, "--app", SCOPED_APP, "--operator", "OPA")
    assert code == 2 and "ACCESS_DENIED" in err and "not configured" in err and out == ""
    code, out, err = await cli(url, "ops", "list", "--app", SCOPED_APP, "--operator", "opA")
    assert code == 0 and str(ops["acme"]) in out and "globex" not in out
    code, _, err = await cli(url, "ops", "show", b, "--app", SCOPED_APP, "--operator", "opA")
    assert code == 2 and "ACCESS_DENIED" in err
    # without --app nothing restricts the operator (the documented default), but the name
    # must still be one
    code, out, err = await cli(url, "ops", "show", b)
    assert code == 0 and "globex/bob" in out, err
    code, _, err = await cli(url, "ops", "list", "--operator", "al ice")
    assert code == 2 and "INVALID_REQUEST" in err
    # incidents: an incident of another tenant looks exactly like a missing one
    code, shown, err = await cli(url, "incidents", "show", refs["acme"], "--app", SCOPED_APP,
                                 "--operator", "reader")
    assert code == 0 and SECRET in shown, err
    denied = [await cli(url, "incidents", "show", ref, "--app", SCOPED_APP, "--operator",
                        "reader") for ref in (refs["globex"], MISSING_REF)]
    assert denied[0] == denied[1] and denied[0][0] == 2 and "ACCESS_DENIED" in denied[0][2]
    code, out, err = await cli(url, "incidents", "show", refs["acme"], "--app", SCOPED_APP,
                               "--operator", "opA")  # in scope, not a reader
    assert code == 2 and "ACCESS_DENIED" in err and SECRET not in out + err
    await app.database.close()


# -- (4) incidents and the audit log, by tenant --------------------------------------------

@pytest.mark.parametrize("readers", [None, ["opA", "opB"]])
async def test_an_operator_reads_only_its_own_tenants_incidents(
        make_app, sql, readers):  # type: ignore[no-untyped-def]
    app, pay = _uncertain_app(make_app, operator_scopes=SCOPES, incident_readers=readers)
    ops, refs = await _park_both_tenants(app, pay, sql)
    operators = app.operators
    own = await operators.incident(refs["acme"], operator="opA")
    assert SECRET in own["detail"]["message"] and own["operation_id"] == ops["acme"]
    assert SECRET in (await operators.incident(refs["globex"], operator="opB"))["detail"][
        "message"]
    answers = []
    for ref in (refs["globex"], MISSING_REF, "inc_\x00", "inc_\ud800"):
        with pytest.raises(AccessDenied) as info:
            await operators.incident(ref, operator="opA")
        answers.append((info.value.code, str(info.value), info.value.retryable))
    assert len(set(answers)) == 1, answers  # out of scope looks exactly like missing
    # an incident without a run belongs to no tenant: only an unscoped operator reads it
    sql("INSERT INTO orchestrator.incidents (ref, code, detail) VALUES "
        "('inc_norun', 'INTERNAL', '{\"message\": \"no run\"}')")
    with pytest.raises(AccessDenied):
        await operators.incident("inc_norun", operator="opA")
    unscoped = make_app(incident_readers=readers)
    assert (await unscoped.operators.incident("inc_norun", operator="opA"))["ref"] == (
        "inc_norun")
    await app.database.close()
    await unscoped.database.close()


async def test_incident_readers_read_within_their_scope_not_across_it(
        make_app, sql):  # type: ignore[no-untyped-def]
    app, pay = _uncertain_app(make_app, operator_scopes={**SCOPES, "reader": ["acme"]},
                              incident_readers=["reader"])
    ops, refs = await _park_both_tenants(app, pay, sql)
    assert SECRET in (await app.operators.incident(refs["acme"], operator="reader"))[
        "detail"]["message"]
    for ref, operator in ((refs["globex"], "reader"), (refs["acme"], "opA"),
                          (refs["globex"], "opB")):
        with pytest.raises(AccessDenied) as info:
            await app.operators.incident(ref, operator=operator)
        assert info.value.message == "the incident does not exist or is not accessible"
    await app.database.close()


async def test_the_audit_log_is_limited_to_the_operators_tenants(
        make_app, sql):  # type: ignore[no-untyped-def]
    app, pay = _uncertain_app(make_app, operator_scopes=SCOPES)
    ops, _ = await _park_both_tenants(app, pay, sql)
    operators = app.operators
    await operators.abandon(ops["acme"], evidence="refunded A by hand", operator="opA")
    await operators.abandon(ops["globex"], evidence=f"refunded B, see {TOOL_TEXT}",
                            operator="opB")
    seen_by_a = await operators.audit(operator="opA")
    assert [(r["target_id"], r["tenant"]) for r in seen_by_a] == [(str(ops["acme"]), "acme")]
    assert SECRET not in _text(seen_by_a)
    assert await operators.audit(ops["globex"], operator="opA") == []  # looks missing
    assert [r["target_id"] for r in await operators.audit(operator="opB")] == [
        str(ops["globex"])]
    assert [r["target_id"] for r in (await operators.show(ops["acme"], operator="opA"))[
        "audit"]] == [str(ops["acme"])]
    everyone = make_app()  # no scopes: every tenant's rows
    assert len(await everyone.operators.audit(operator="anyone")) == 2
    await app.database.close()
    await everyone.database.close()


# -- (5) what a lookup said is protected ---------------------------------------------------

def _lookup_app(make_app: Any, answers: list[Any]) -> tuple[Orchestrator, Any]:
    app = make_app(operator_scopes={**SCOPES, "reader": ["acme"]},
                   incident_readers=["reader", "opB"])

    @app.tool()
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        raise ConnectionResetError("lost after sending")

    @charge.lookup
    async def find(ctx, *, order):  # type: ignore[no-untyped-def]
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    return app, pay


async def test_a_lookup_reason_reaches_incident_readers_only(
        make_app, sql, migrated_database_url, caplog):  # type: ignore[no-untyped-def]
    url = migrated_database_url
    app, pay = _lookup_app(make_app, [RuntimeError(f"lookup failed: {TOOL_TEXT}"),
                                      StillUnknown(f"pending at {TOOL_TEXT}")])
    caplog.set_level(logging.DEBUG)
    async with running(app):
        await app.submit_async(pay, "a")
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs "
                                   "WHERE status = 'needs_reconciliation'"))
        reconciler = app.create_reconciler(max_lookups=2, base_delay=0.01)
        assert await reconciler.run_once() == 1
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.reconciliation_items "
                                   "WHERE next_attempt_at <= now() AND state = 'open'"))
        assert await reconciler.run_once() == 1
    (op,) = [r["id"] for r in sql("SELECT id FROM orchestrator.operations")]
    assert f"operation {op} handed to operators after 2 lookups" in caplog.text
    assert SECRET not in caplog.text and TOKEN not in caplog.text

    shown = await app.operators.show(op, operator="opA")  # in scope, not a reader
    assert [(x["attempt"], x["answer"]) for x in shown["lookups"]] == [
        (1, "still_unknown"), (2, "still_unknown")]
    assert all(x["created_at"] is not None and x["incident"] for x in shown["lookups"])
    listed = await app.operators.list_items(operator="opA")
    assert SECRET not in _text(shown) + _text(listed) and TOKEN not in _text(shown)
    for args in (["ops", "list"],
                 ["ops", "show", str(op), "--app", SCOPED_APP, "--operator", "opA"]):
        code, out, err = await cli(url, *args)
        assert code == 0, err
        assert SECRET not in out + err and TOKEN not in out + err, args
    code, out, _ = await cli(url, "ops", "show", str(op))
    assert shown["lookups"][0]["incident"] in out  # the reference, to be opened by readers
    # Without --app nothing restricts the operator, who may read incidents (as with
    # `incidents show`): `ops show` then gives what the lookup said as well.
    assert f"pending at {TOOL_TEXT}" in out

    first, second = (x["incident"] for x in shown["lookups"])
    said = await app.operators.incident(second, operator="reader")
    assert said["operation_id"] == op and said["phase"] == "lookup"
    assert said["detail"]["reason"] == f"pending at {TOOL_TEXT}"
    raised = await app.operators.incident(first, operator="reader")
    assert TOOL_TEXT in raised["detail"]["message"] and "RuntimeError" in raised["detail"][
        "traceback"]
    for operator in ("opA", "opB"):  # not a reader; a reader of another tenant
        with pytest.raises(AccessDenied):
            await app.operators.incident(first, operator=operator)
    code, out, err = await cli(url, "incidents", "show", second, "--app", SCOPED_APP,
                               "--operator", "reader")
    assert code == 0 and TOOL_TEXT in out, err
    await app.database.close()


async def test_a_not_applied_lookups_evidence_is_kept_in_an_incident(
        make_app, sql, caplog):  # type: ignore[no-untyped-def]
    app, pay = _lookup_app(make_app, [NotApplied(f"no charge; checked {TOOL_TEXT}")])
    caplog.set_level(logging.DEBUG)
    async with running(app):
        await app.submit_async(pay, "a")
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs "
                                   "WHERE status = 'needs_reconciliation'"))
        assert await app.create_reconciler().run_once() == 1
    op = min(r["id"] for r in sql("SELECT id FROM orchestrator.operations"))
    assert sql("SELECT state FROM orchestrator.operations WHERE id = %s", (op,)) == [
        {"state": "not_applied"}]
    assert SECRET not in caplog.text
    shown = await app.operators.show(op, operator="opA")
    assert [x["answer"] for x in shown["lookups"]] == ["not_applied"]
    assert SECRET not in _text(shown)
    said = await app.operators.incident(shown["lookups"][0]["incident"], operator="reader")
    assert said["detail"]["reason"] == f"no charge; checked {TOOL_TEXT}"
    await app.database.close()


async def test_evidence_that_cannot_be_stored_is_an_invalid_request(
        make_app, sql):  # type: ignore[no-untyped-def]
    app, pay = _uncertain_app(make_app)
    ops, _ = await _park_both_tenants(app, pay, sql)
    for evidence, operator, path in (("seen\x00", "alice", "evidence"),
                                     ("seen \ud800", "alice", "evidence"),
                                     ("seen", "al\x00ice", "operator")):
        with pytest.raises(InvalidRequest) as info:
            await app.operators.resolve_not_applied(ops["acme"], evidence=evidence,
                                                    operator=operator)
        assert info.value.path == path
    assert sql("SELECT 1 FROM orchestrator.operator_audit") == []
    await app.database.close()
