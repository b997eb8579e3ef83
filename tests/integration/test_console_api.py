"""The console's API and pages against a real PostgreSQL, through an ASGI client in the test's
event loop (a worker runs in the same loop): who may see and do what (C9, C17), CSRF, the
audit of every action, the queue's bulk actions, no upstream text without the incidents grant
(C10), and pages that render input as text."""

from __future__ import annotations

import html
import json
import logging
import re
import uuid
from collections.abc import Callable
from typing import Any

import pytest

from orchestrator import NotApplied, Orchestrator, Owner, ToolError, canonical
from orchestrator.logs import JsonFormatter
from tests.consoletools import GRANTS, SCOPES, SECRET, Client, from_header, uncertain_app
from tests.integration.conftest import OTHER, OWNER, charge_in_flight, running, wait_for

Sql = Callable[..., list[dict[str, Any]]]


def console_of(app: Orchestrator, **options: Any) -> Any:
    options.setdefault("grants", GRANTS)
    return app.console(from_header, **options)


async def park(app: Orchestrator, sql: Sql, orders: dict[str, Owner]) -> dict[str, int]:
    """Submit ``pay(order)`` per order; once each run waits on its unknown operation, the
    operation ids by order (the worker stops)."""
    async with running(app):
        for order, owner in orders.items():
            await app.submit_async("pay", order, owner=owner, idempotency_key=f"k-{order}")
        await wait_for(lambda: len(sql("SELECT 1 FROM orchestrator.runs WHERE status = "
                                       "'needs_reconciliation'")) == len(orders), timeout=60)
    return {r["arguments"]["order"]: r["id"]
            for r in sql("SELECT id, arguments FROM orchestrator.operations")}


def run_of(sql: Sql, op: int) -> dict[str, Any]:
    (row,) = sql("SELECT r.* FROM orchestrator.runs r JOIN orchestrator.operations o "
                 "ON o.run_id = r.id WHERE o.id = %s", (op,))
    return row


def audit(sql: Sql) -> list[dict[str, Any]]:
    return sql("SELECT * FROM orchestrator.operator_audit ORDER BY id")


async def test_unauthenticated_requests_get_401_and_pages_send_browsers_to_the_login(
        make_app, sql):  # type: ignore[no-untyped-def]
    app = uncertain_app(make_app)
    ops = await park(app, sql, {"a": OWNER})
    console = console_of(app)
    async with Client(console, None) as nobody:
        for path in ("/api/session", "/api/runs", "/api/operations", f"/api/operations/"
                     f"{ops['a']}", "/api/workers", "/api/audit", "/api/overview"):
            answer = await nobody.get(path)
            assert answer.status_code == 401, path
            assert answer.json() == {"code": "UNAUTHENTICATED", "message": answer.json()[
                "message"], "retryable": False, "incident": None}
        answer = await nobody.post(f"/api/operations/{ops['a']}/abandon", {"evidence": "x"},
                                   csrf=False)
        assert answer.status_code == 401
        assert (await nobody.get("/runs")).status_code == 401  # the host signs people in
    standalone = app.console(tokens={"alice": "t" * 32}, grants=GRANTS)
    async with Client(standalone, None) as browser:
        answer = await browser.get("/operations", state="operator")
        assert answer.status_code == 303
        assert answer.headers["location"] == "/login?next=%2Foperations%3Fstate%3Doperator"
        bad = await browser.http.get("/api/runs", headers={"Authorization": "Bearer " + "u" * 32})
        assert bad.status_code == 401
        good = await browser.http.get("/api/runs", headers={"Authorization": "Bearer " + "t" * 32})
        assert good.status_code == 200 and good.json()["count"] == 1
    async with Client(console, "mallory") as stranger:  # authenticated, but no grant
        answer = await stranger.get("/api/runs")
        assert answer.status_code == 403 and answer.json()["code"] == "FORBIDDEN"
    assert sql("SELECT state FROM orchestrator.operations") == [{"state": "unknown"}]
    await app.database.close()


async def test_an_object_out_of_scope_answers_exactly_as_a_missing_one(
        make_app, sql):  # type: ignore[no-untyped-def]
    app = uncertain_app(make_app)
    ops = await park(app, sql, {"a": OWNER, "g": OTHER})
    theirs = run_of(sql, ops["g"])["id"]
    (ref,) = [r["ref"] for r in sql("SELECT ref FROM orchestrator.incidents WHERE "
                                    "operation_id = %s", (ops["g"],))]
    console = console_of(app)
    async with Client(console, "alice") as alice, Client(console, "reader") as reader:
        pairs = [(f"/api/runs/{theirs}", f"/api/runs/{uuid.uuid4()}"),
                 (f"/api/operations/{ops['g']}", "/api/operations/987654")]
        for out_of_scope, missing in pairs:
            one, other = await alice.get(out_of_scope), await alice.get(missing)
            assert one.status_code == other.status_code == 404
            assert one.content == other.content and one.json()["code"] == "ACCESS_DENIED"
        one = await reader.get(f"/api/incidents/{ref}")
        other = await reader.get("/api/incidents/inc_0000000000000000")
        assert one.status_code == other.status_code == 404 and one.content == other.content
        # pages too: the same 404 page
        one, other = await alice.get(f"/runs/{theirs}"), await alice.get(f"/runs/{uuid.uuid4()}")
        assert one.status_code == other.status_code == 404 and one.text == other.text
        # actions on another tenant's objects look the same as on missing ones
        for path in (f"/api/operations/{ops['g']}/abandon", "/api/operations/987654/abandon"):
            answer = await alice.post(path, {"evidence": "gone"})
            assert answer.status_code == 404 and answer.json()["code"] == "ACCESS_DENIED"
        cancel = await alice.post(f"/api/runs/{theirs}/cancel", {"evidence": "no"})
        assert cancel.status_code == 404
        # lists keep to the scope
        listed = (await alice.get("/api/operations")).json()
        assert [i["operation_id"] for i in listed["items"]] == [str(ops["a"])]
        runs = (await alice.get("/api/runs")).json()
        assert {r["tenant"] for r in runs["runs"]} == {"acme"}
        incidents = (await reader.get("/api/incidents")).json()
        assert {x["tenant"] for x in incidents["incidents"]} == {"acme"}
    assert [r["state"] for r in sql("SELECT state FROM orchestrator.operations")] == [
        "unknown", "unknown"]
    assert audit(sql) == []
    await app.database.close()


async def test_an_action_without_its_csrf_token_is_refused_and_changes_nothing(
        make_app, sql):  # type: ignore[no-untyped-def]
    app = uncertain_app(make_app)
    ops = await park(app, sql, {"a": OWNER})
    op = ops["a"]
    console = console_of(app)
    body = {"resolution": "not_applied", "evidence": "nothing at the PSP"}
    async with Client(console, "alice") as alice, Client(console, "bob") as bob:
        answer = await alice.post(f"/api/operations/{op}/resolve", body, csrf=False)
        assert answer.status_code == 403 and answer.json()["code"] == "FORBIDDEN"
        # a token made for another operator (or another browser) is no token
        alice.csrf = await bob.token()
        answer = await alice.post(f"/api/operations/{op}/resolve", body)
        assert answer.status_code == 403
        alice.csrf = None
        # the pages' forms too
        form = await alice.form(f"/operations/{op}/resolve", body, csrf=False)
        assert form.status_code == 403 and "FORBIDDEN" in form.text
        cancel = await alice.form(f"/runs/{run_of(sql, op)['id']}/cancel",
                                  {"evidence": "stop"}, csrf=False)
        assert cancel.status_code == 403
        assert sql("SELECT state FROM orchestrator.operations") == [{"state": "unknown"}]
        assert audit(sql) == []
        # with it, the same request goes through
        answer = await alice.post(f"/api/operations/{op}/resolve", body)
        assert answer.status_code == 200, answer.text
    assert sql("SELECT state FROM orchestrator.operations WHERE id = %s", (op,)) == [
        {"state": "not_applied"}]
    await app.database.close()


async def test_a_read_only_operator_sees_no_action_and_a_forged_post_is_refused(
        make_app, sql):  # type: ignore[no-untyped-def]
    app = uncertain_app(make_app)
    ops = await park(app, sql, {"a": OWNER})
    op, run_id = ops["a"], run_of(sql, ops["a"])["id"]
    console = console_of(app)
    async with Client(console, "viewer") as viewer, Client(console, "alice") as alice:
        pages = [await viewer.get(path) for path in (
            "/", "/runs", f"/runs/{run_id}", "/operations", f"/operations/{op}", "/audit")]
        assert all(p.status_code == 200 for p in pages)
        for page in pages:
            assert 'method="post"' not in page.text.replace("/logout", ""), page.url
            assert "Mark committed" not in page.text and "Cancel this run" not in page.text
        acting = await alice.get(f"/operations/{op}")
        assert "Mark committed" in acting.text and 'id="resolve-abandon"' in acting.text
        assert "Cancel this run" in (await alice.get(f"/runs/{run_id}")).text
        # a forged POST (the viewer's own, valid CSRF token) is refused for want of a grant
        for path, body in ((f"/api/operations/{op}/resolve",
                            {"resolution": "committed", "receipt": {}, "evidence": "x"}),
                           (f"/api/operations/{op}/abandon", {"evidence": "x"}),
                           (f"/api/runs/{run_id}/cancel", {"evidence": "x"}),
                           ("/api/operations/abandon-many", {"evidence": "x", "confirmed": 1})):
            answer = await viewer.post(path, body)
            assert answer.status_code == 403, path
            assert answer.json()["code"] == "FORBIDDEN" and "grant" in answer.json()["message"]
        form = await viewer.form(f"/operations/{op}/resolve",
                                 {"resolution": "abandoned", "evidence": "x"})
        assert form.status_code == 403
    assert sql("SELECT state FROM orchestrator.operations") == [{"state": "unknown"}]
    assert audit(sql) == []
    await app.database.close()


async def test_a_resolution_needs_evidence_is_audited_and_wakes_the_run(
        make_app, sql):  # type: ignore[no-untyped-def]
    app = uncertain_app(make_app)
    ops = await park(app, sql, {"a": OWNER})
    op = ops["a"]
    console = console_of(app)
    async with Client(console, "alice") as alice, running(app):
        path = f"/api/operations/{op}/resolve"
        missing = await alice.post(path, {"resolution": "committed", "receipt": {"ch": 1}})
        assert missing.status_code == 400 and missing.json()["code"] == "INVALID_REQUEST"
        blank = await alice.post(path, {"resolution": "committed", "receipt": {"ch": 1},
                                        "evidence": "  "})
        assert blank.status_code == 400
        assert audit(sql) == []
        done = await alice.post(path, {"resolution": "committed",
                                       "receipt": {"charge": "ch_by_hand"},
                                       "evidence": "PSP dashboard shows ch_by_hand"})
        assert done.status_code == 200 and done.json() == {
            "operation_id": str(op), "resolution": "committed", "outcome": "resolved",
            "then": "resume", "waits_for": []}
        handle = await app.get_run_async(run_of(sql, op)["id"])
        assert await handle.result_async(timeout=30) == {"charge": "ch_by_hand"}
        again = await alice.post(path, {"resolution": "committed",
                                        "receipt": {"charge": "ch_by_hand"},
                                        "evidence": "same again"})
        assert again.json()["outcome"] == "noop" and again.json()["then"] is None
        conflict = await alice.post(path, {"resolution": "not_applied", "evidence": "no"})
        assert conflict.status_code == 409 and conflict.json()["code"] == "RESOLUTION_CONFLICT"
        shown = (await alice.get("/api/audit", target=str(op))).json()["audit"]
        assert [(a["operator"], a["action"], a["evidence"]) for a in shown] == [
            ("alice", "resolve.committed.noop", "same again"),
            ("alice", "resolve.committed", "PSP dashboard shows ch_by_hand")]
        assert shown[1]["before"]["operation"] == "unknown"
        assert shown[1]["after"]["operation"] == "committed"
        # what was attested: the digest of the receipt given, on the API and the pages
        attested = canonical.digest({"charge": "ch_by_hand"})
        assert [a["after"]["receipt_digest"] for a in shown] == [attested] * 2
        for page in (f"/operations/{op}", "/audit"):
            assert attested in (await alice.get(page)).text, page
        # the page refuses the conflicting resolution and shows the existing one
        page = await alice.form(f"/operations/{op}/resolve",
                                {"resolution": "abandoned", "evidence": "give up"})
        assert page.status_code == 409 and "RESOLUTION_CONFLICT" in page.text
        assert 'id="resolution">committed<' in page.text
    await app.database.close()


async def test_a_receipt_typed_into_the_form_must_be_valid_json(
        make_app, sql):  # type: ignore[no-untyped-def]
    app = uncertain_app(make_app)
    ops = await park(app, sql, {"a": OWNER})
    async with Client(console_of(app), "alice") as alice:
        page = await alice.form(f"/operations/{ops['a']}/resolve", {
            "resolution": "committed", "receipt": "{charge: ch_1", "evidence": "seen"})
        assert page.status_code == 400 and "the receipt is not valid JSON" in page.text
        assert "{charge: ch_1" in page.text  # what was typed is kept in the form
        ok = await alice.form(f"/operations/{ops['a']}/resolve", {
            "resolution": "committed", "receipt": '{"charge": "ch_1"}', "evidence": "seen"})
        assert ok.status_code == 303
        assert ok.headers["location"] == f"/operations/{ops['a']}?done=committed"
    assert sql("SELECT receipt FROM orchestrator.operations") == [{"receipt": {"charge": "ch_1"}}]
    await app.database.close()


async def test_a_bulk_resolution_of_50_matching_items_counts_first(
        make_app, sql):  # type: ignore[no-untyped-def]
    app = uncertain_app(make_app)
    orders = {f"o{i:02}": OWNER for i in range(50)} | {"g1": OTHER}
    ops = await park(app, sql, orders)
    console = console_of(app)
    body = {"resolution": "not_applied", "then": "resend", "filter": {"tool": "charge"},
            "evidence": "PSP export shows none of these"}
    async with Client(console, "alice") as alice:
        counted = await alice.post("/api/operations/resolve-many", body)
        assert counted.status_code == 200, counted.text
        assert counted.json()["dry_run"] is True
        assert counted.json()["counts"] == {"matched": 50, "resolved": 0, "skipped": 0}
        assert audit(sql) == []
        stale = await alice.post("/api/operations/resolve-many", {**body, "confirmed": 49})
        assert stale.status_code == 409 and "selects 50 operations now" in stale.json()[
            "message"]
        assert audit(sql) == []
        async with running(app):
            done = await alice.post("/api/operations/resolve-many", {**body, "confirmed": 50})
            assert done.status_code == 200, done.text
            assert done.json()["counts"] == {"matched": 50, "resolved": 50, "skipped": 0}
            await wait_for(lambda: len(sql("SELECT 1 FROM orchestrator.runs "
                                           "WHERE status = 'succeeded'")) == 50, timeout=60)
    rows = audit(sql)
    assert len(rows) == 50 and {r["action"] for r in rows} == {"resolve.not_applied"}
    assert {int(r["target_id"]) for r in rows} == {ops[o] for o in orders if o != "g1"}
    assert run_of(sql, ops["g1"])["status"] == "needs_reconciliation"  # another tenant's
    await app.database.close()


async def test_the_bulk_pages_show_the_count_and_ask_before_acting(
        make_app, sql):  # type: ignore[no-untyped-def]
    app = uncertain_app(make_app)
    await park(app, sql, {f"o{i}": OWNER for i in range(3)})
    fields = {"state": "", "tool": "charge", "older_than": "", "key": "", "run": "",
              "workflow": "", "resolution": "abandoned", "evidence": "written off"}
    async with Client(console_of(app), "alice") as alice:
        preview = await alice.form("/operations/bulk", fields)
        assert preview.status_code == 200
        assert "This filter selects <strong>3</strong> unresolved operations" in preview.text
        assert 'name="confirmed" value="3"' in preview.text and audit(sql) == []
        done = await alice.form("/operations/bulk", {**fields, "confirmed": "3"})
        assert done.status_code == 200 and "Abandoned 3 of 3 operations" in done.text
    assert [r["status"] for r in sql("SELECT status FROM orchestrator.runs")] == ["failed"] * 3
    await app.database.close()


async def test_a_bulk_confirmation_acts_only_on_the_operations_it_listed(
        make_app, sql):  # type: ignore[no-untyped-def]
    """Between the count and the confirmation one of the listed operations is settled by hand
    and a new one starts to match the filter: the count is the same, the operations are not.
    Nothing is done and the page says so; the new operation, never listed, still waits."""
    app = uncertain_app(make_app)
    ops = await park(app, sql, {"o0": OWNER, "o1": OWNER})
    fields = {"state": "", "tool": "charge", "older_than": "", "key": "", "run": "",
              "workflow": "", "resolution": "abandoned", "evidence": "written off"}
    async with Client(console_of(app), "alice") as alice:
        preview = await alice.form("/operations/bulk", fields)
        assert "This filter selects <strong>2</strong> unresolved operations" in preview.text
        form = preview.text[preview.text.index('id="bulk-confirm"'):]
        confirm = {name: html.unescape(value) for name, value in re.findall(
            r'<input type="hidden" name="([^"]+)" value="([^"]*)">', form[:form.index(
                "</form>")]) if name != "csrf_token"}
        assert confirm["confirmed"] == "2"
        by_hand = await alice.post(f"/api/operations/{ops['o0']}/abandon",
                                   {"evidence": "refunded"})
        assert by_hand.status_code == 200, by_hand.text
        async with running(app):
            await app.submit_async("pay", "o2", owner=OWNER, idempotency_key="k-o2")
            await wait_for(lambda: len(sql("SELECT 1 FROM orchestrator.runs WHERE status = "
                                           "'needs_reconciliation'")) == 2, timeout=60)
        done = await alice.form("/operations/bulk", confirm)
        assert done.status_code == 409, done.text
        assert "the filter selects other operations now" in html.unescape(done.text)
    assert [(r["target_id"], r["evidence"]) for r in audit(sql)] == [(str(ops["o0"]),
                                                                      "refunded")]
    assert len(sql("SELECT 1 FROM orchestrator.runs WHERE status = "
                   "'needs_reconciliation'")) == 2  # o1, and o2 that was never listed
    await app.database.close()


async def test_no_upstream_text_reaches_an_operator_without_the_incidents_grant(
        make_app, sql):  # type: ignore[no-untyped-def]
    app = uncertain_app(make_app)
    tool = app.registry.tools["charge"]

    @tool.lookup
    async def find(ctx, *, order):  # type: ignore[no-untyped-def]
        return NotApplied(f"no such charge; the PSP echoed {SECRET}")

    ops = await park(app, sql, {"a": OWNER})
    op = ops["a"]
    assert await app.create_reconciler().run_once() == 1  # not applied, with its text
    async with running(app):
        await wait_for(lambda: run_of(sql, op)["status"] == "succeeded", timeout=30)
    run_id = run_of(sql, op)["id"]
    assert sql("SELECT 1 FROM orchestrator.incidents WHERE detail::text LIKE %s",
               (f"%{SECRET}%",)), "the diagnostics keep it"
    console = console_of(app)
    paths = ["/api/overview", "/api/runs", f"/api/runs/{run_id}", "/api/operations?state=all",
             f"/api/operations/{op}", "/api/audit", "/api/workers", "/", "/runs",
             f"/runs/{run_id}", "/operations?state=all", f"/operations/{op}", "/audit",
             "/workers", "/api/incidents", "/incidents"]
    for operator in ("alice", "viewer"):  # in scope, no incidents grant
        async with Client(console, operator) as client:
            for path in paths:
                answer = await client.get(path)
                assert SECRET not in answer.text, (operator, path)
                assert answer.status_code == (403 if "incidents" in path else 200), path
            shown = (await client.get(f"/api/operations/{op}")).json()
            assert shown["reasons"] == "withheld"
            assert [(x["answer"], x["has_reason"], x["reason"]) for x in shown["lookups"]] == [
                ("not_applied", True, None)]
    async with Client(console, "reader") as reader:
        shown = (await reader.get(f"/api/operations/{op}")).json()
        assert shown["lookups"][0]["reason"] == f"no such charge; the PSP echoed {SECRET}"
        refs = [x["ref"] for x in (await reader.get("/api/incidents")).json()["incidents"]]
        details = [(await reader.get(f"/api/incidents/{ref}")).text for ref in refs]
        assert any(SECRET in d for d in details)
        assert SECRET in (await reader.get(f"/operations/{op}")).text
    await app.database.close()


async def test_an_input_holding_a_script_renders_as_text(
        make_app, sql):  # type: ignore[no-untyped-def]
    app = uncertain_app(make_app)
    hostile = "<script>alert('x')</script>"
    async with running(app):
        await app.submit_async("pay", {"note": hostile}, owner=OWNER)
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs "
                                   "WHERE status = 'needs_reconciliation'"))
    (op,) = [r["id"] for r in sql("SELECT id FROM orchestrator.operations")]
    run_id = run_of(sql, op)["id"]
    async with Client(console_of(app), "alice") as alice:
        for path in (f"/runs/{run_id}", f"/operations/{op}", "/operations"):
            page = await alice.get(path)
            assert page.status_code == 200
            assert "<script>alert" not in page.text, path
        assert "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;" in (
            await alice.get(f"/runs/{run_id}")).text
        assert (await alice.get(f"/api/runs/{run_id}")).json()["run"]["input"] == {
            "note": hostile}
        page = await alice.get(f"/runs/{run_id}")
        assert "script-src 'self'" in page.headers["content-security-policy"]
    await app.database.close()


async def test_the_run_page_shows_each_operations_stored_error(
        make_app, sql):  # type: ignore[no-untyped-def]
    """The run page listed the operations without the error the engine stored on them: it
    shows its code and cause, never the tool's text."""
    app = uncertain_app(make_app)

    @app.tool()
    async def decline(ctx, *, order):  # type: ignore[no-untyped-def]
        raise ToolError(f"declined: {SECRET}", applied=False, status=402)

    @app.workflow()
    async def refuse(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(decline, order=order)

    async with running(app):
        run = await app.submit_async("refuse", "one", owner=OWNER)
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs WHERE status = 'failed'"))
    (stored,) = [r["error"] for r in sql("SELECT error FROM orchestrator.operations")]
    assert stored["code"] == "TOOL_FAILED" and isinstance(stored["cause"], str), stored
    async with Client(console_of(app), "alice") as alice:
        page = (await alice.get(f"/runs/{run.id}")).text
    operations = page.split("<h2>Operations</h2>", 1)[1].split("</section>", 1)[0]
    assert "<th>why</th>" in operations, operations
    assert f"<td>TOOL_FAILED ({stored['cause']})</td>" in operations, operations
    assert SECRET not in page
    await app.database.close()


async def test_cancel_needs_its_grant_and_evidence_and_is_audited(
        make_app, sql):  # type: ignore[no-untyped-def]
    app = make_app(operator_scopes={"alice": ["acme"], "viewer": ["acme"]})

    @app.workflow()
    async def waits(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.wait_for_event("go")

    handle = await app.submit_async(waits, {})
    async with running(app):
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs WHERE status = 'waiting'"))
    console = app.console(from_header, {"alice": ["cancel"], "viewer": ["read"]})
    path = f"/api/runs/{handle.id}/cancel"
    async with Client(console, "alice") as alice:
        assert (await alice.post(path, {})).status_code == 400
        answer = await alice.post(path, {"evidence": "customer withdrew"})
        assert answer.status_code == 200 and answer.json() == {
            "run_id": str(handle.id), "before": "waiting", "status": "cancelled"}
        (row,) = (await alice.get("/api/audit", action="run")).json()["audit"]
        by_kind = [(await alice.get("/api/audit", target=str(handle.id), kind=kind)).json()
                   for kind in ("run", "schedule")]
        assert [len(doc["audit"]) for doc in by_kind] == [1, 0]
        unknown = await alice.get("/api/audit", kind="workflow")
        assert unknown.status_code == 400 and unknown.json()["code"] == "INVALID_REQUEST"
        assert "kind" in unknown.json()["message"] and unknown.json()["path"] == "kind"
        page = (await alice.get("/audit", kind="schedule")).text
        assert '<option value="schedule" selected>' in page and "customer withdrew" not in page
        assert "customer withdrew" in (await alice.get("/audit", kind="run")).text
    assert (row["operator"], row["action"], row["target_kind"], row["target_id"]) == (
        "alice", "run.cancel", "run", str(handle.id))
    assert row["before"]["status"] == "waiting" and row["after"]["status"] == "cancelled"
    assert row["evidence"] == "customer withdrew" and row["tenant"] == "acme"
    await app.database.close()


async def test_runs_are_paged_newest_first_by_keyset_and_filtered(
        make_app, sql):  # type: ignore[no-untyped-def]
    app = make_app()

    @app.workflow()
    async def noop(ctx, data):  # type: ignore[no-untyped-def]
        return data

    made = [(await app.submit_async(noop, i, idempotency_key=f"sub-{i}")).id for i in range(5)]
    await app.submit_async(noop, 9, owner=OTHER)
    console = app.console(from_header)  # no scopes, no grants: everyone reads
    async with Client(console, "anyone") as client:
        seen, cursor = [], None
        while True:
            page = (await client.get("/api/runs", limit=2, before=cursor,
                                     status="queued")).json()
            seen.append([r["id"] for r in page["runs"]])
            cursor = page["next"]
            if cursor is None:
                break
        assert [len(p) for p in seen] == [2, 2, 2]
        ids = [i for p in seen for i in p]
        assert ids == [str(r["id"]) for r in sql(
            "SELECT id FROM orchestrator.runs ORDER BY created_at DESC, id DESC")]
        keyed = (await client.get("/api/runs", submission_key="sub-3")).json()
        assert [r["id"] for r in keyed["runs"]] == [str(made[3])]
        bad = await client.get("/api/runs", before="yesterday")
        assert bad.status_code == 400 and bad.json()["code"] == "INVALID_REQUEST"
        assert bad.json()["path"] == "before"
        page = await client.get("/runs", limit=2)
        assert page.status_code == 200 and "Older runs" in page.text
        forbidden = await client.post(f"/api/runs/{made[0]}/cancel", {"evidence": "x"})
        assert forbidden.status_code == 403  # read only
    await app.database.close()


async def test_a_browser_signs_in_with_the_token_and_gets_a_session(
        make_app, sql):  # type: ignore[no-untyped-def]
    app = uncertain_app(make_app)
    await park(app, sql, {"a": OWNER})
    token = "tok_" + "x" * 28
    console = app.console(tokens={"alice": token}, grants=GRANTS)
    async with Client(console, None) as browser:
        form = await browser.get("/login")
        assert form.status_code == 200 and 'name="token"' in form.text
        login_csrf = form.text.split('name="csrf_token" value="')[1].split('"')[0]
        wrong = await browser.http.post("/login", data={"token": "nope", "csrf_token":
                                                         login_csrf})
        assert wrong.status_code == 401
        no_csrf = await browser.http.post("/login", data={"token": token})
        assert no_csrf.status_code == 403
        good = await browser.http.post("/login?next=/operations",
                                       data={"token": token, "csrf_token": login_csrf})
        assert good.status_code == 303 and good.headers["location"] == "/operations"
        cookie = good.headers["set-cookie"]
        assert "HttpOnly" in cookie and "SameSite=Strict" in cookie
        page = await browser.get("/operations")
        assert page.status_code == 200 and "alice" in page.text
        session = (await browser.get("/api/session")).json()
        assert session["operator"] == "alice" and session["via"] == "session"
        # a script with the bearer token needs no cookie; its CSRF token is bound to it
        bearer = {"Authorization": f"Bearer {token}"}
        mine = (await browser.http.get("/api/session", headers=bearer)).json()
        assert mine["via"] == "bearer"
        ops = json.loads((await browser.http.get("/api/operations", headers=bearer)).text)
        op = ops["items"][0]["operation_id"]
        refused = await browser.http.post(f"/api/operations/{op}/abandon",
                                          json={"evidence": "x"}, headers=bearer)
        assert refused.status_code == 403
        accepted = await browser.http.post(
            f"/api/operations/{op}/abandon", json={"evidence": "x"},
            headers={**bearer, "X-CSRF-Token": mine["csrf_token"]})
        assert accepted.status_code == 200, accepted.text
    await app.database.close()


@pytest.mark.parametrize("grants", [{"alice": ["read", "root"]}, {"alice": "read"},
                                    {"al ice": ["read"]}])
def test_grants_are_checked_when_the_console_is_built(
        make_app, grants):  # type: ignore[no-untyped-def]
    from orchestrator import ConfigurationError

    app = make_app()
    with pytest.raises(ConfigurationError):
        app.console(from_header, grants)


async def test_mounted_under_a_path_its_links_forms_and_cookies_stay_under_it(
        make_app, sql):  # type: ignore[no-untyped-def]
    from starlette.applications import Starlette
    from starlette.routing import Mount

    app = uncertain_app(make_app)
    ops = await park(app, sql, {"a": OWNER})
    host = Starlette(routes=[Mount("/ops-console", app=console_of(app))])
    async with Client(host, "alice") as alice:
        page = await alice.get("/ops-console/operations")
        assert page.status_code == 200
        assert f'href="/ops-console/operations/{ops["a"]}"' in page.text
        assert 'src="/ops-console/static/htmx.min.js"' in page.text
        assert "Path=/ops-console/" in page.headers["set-cookie"]
        run_id = run_of(sql, ops["a"])["id"]
        shown = await alice.get(f"/ops-console/runs/{run_id}")  # its live timeline's stream
        assert f'data-events="/ops-console/api/runs/{run_id}/events"' in shown.text
        session = await alice.http.get("/ops-console/api/session")
        alice.csrf = session.json()["csrf_token"]
        done = await alice.form(f"/ops-console/operations/{ops['a']}/resolve",
                                {"resolution": "abandoned", "evidence": "written off"})
        assert done.status_code == 303
        assert done.headers["location"] == f"/ops-console/operations/{ops['a']}?done=abandoned"
        assert (await alice.get("/ops-console/static/htmx.min.js")).status_code == 200
    await app.database.close()


async def test_an_unexpected_failure_answers_internal_without_its_text(
        make_app, caplog):  # type: ignore[no-untyped-def]
    app = make_app()

    def broken(request: Any) -> str:
        raise RuntimeError(f"the session store said {SECRET}")

    async with Client(app.console(broken), "alice") as client:
        answer = await client.get("/api/runs")
    assert answer.status_code == 500 and answer.json()["code"] == "INTERNAL"
    assert answer.json()["incident"] in caplog.text and "RuntimeError" in caplog.text
    assert SECRET not in answer.text and SECRET not in caplog.text


async def test_an_unexpected_failure_logs_its_traceback_under_its_reference(
        make_app, caplog):  # type: ignore[no-untyped-def]
    """The answer names only the incident reference; the log line with that reference keeps
    the traceback (where it failed, through what, and the types of the exception and of what
    caused it), so that an operator can find the fault, without the exceptions' text."""
    app = make_app()

    def session_store(request: Any) -> str:
        try:
            raise KeyError(f"token {SECRET}")
        except KeyError as exc:
            raise RuntimeError(f"the session store said {SECRET}") from exc

    caplog.set_level(logging.ERROR, logger="orchestrator.console")
    async with Client(app.console(session_store), "alice") as client:
        answer = await client.get("/api/runs")
    assert answer.status_code == 500 and set(answer.json()) == {
        "code", "message", "retryable", "incident"}
    ref = answer.json()["incident"]
    [line] = [r for r in caplog.records if ref in r.getMessage()]
    assert line.levelno == logging.ERROR and line.name == "orchestrator.console"
    as_text = logging.Formatter("%(message)s").format(line)
    assert "Traceback (most recent call last)" in as_text
    assert "in session_store" in as_text and "test_console_api.py" in as_text
    assert "KeyError" in as_text and "RuntimeError" in as_text
    as_json = json.loads(JsonFormatter().format(line))
    assert as_json["incident"] == ref and as_json["cause"] == "RuntimeError"
    assert "in session_store" in json.dumps(as_json)
    assert SECRET not in caplog.text and SECRET not in as_text + json.dumps(as_json)
    assert SECRET not in answer.text


async def test_incidents_are_paged_by_the_next_cursor_each_once(
        make_app, sql):  # type: ignore[no-untyped-def]
    app = uncertain_app(make_app)
    await park(app, sql, {"a": OWNER, "b": OWNER, "c": OWNER, "g": OTHER})
    expected = [r["ref"] for r in sql(
        "SELECT i.ref FROM orchestrator.incidents i JOIN orchestrator.runs r "
        "ON r.id = i.run_id WHERE r.tenant = 'acme' ORDER BY i.created_at DESC, i.ref DESC")]
    assert len(expected) >= 3
    async with Client(console_of(app), "reader") as reader:
        seen, cursor = [], None
        while True:
            answer = await reader.get("/api/incidents", limit=1, before=cursor)
            assert answer.status_code == 200, answer.text
            seen += [x["ref"] for x in answer.json()["incidents"]]
            cursor = answer.json()["next"]
            if cursor is None:
                break
        assert seen == expected
        page = await reader.get("/incidents", limit=1, before=cursor or "")
        assert page.status_code == 200
    await app.database.close()


async def test_a_committed_resolution_without_a_receipt_is_refused(
        make_app, sql):  # type: ignore[no-untyped-def]
    app = uncertain_app(make_app)
    ops = await park(app, sql, {"a": OWNER})
    op = ops["a"]
    async with Client(console_of(app), "alice") as alice:
        one = await alice.post(f"/api/operations/{op}/resolve",
                               {"resolution": "committed", "evidence": "PSP shows it"})
        assert one.status_code == 400 and one.json()["code"] == "INVALID_REQUEST"
        assert "receipt" in one.json()["message"]
        many = await alice.post("/api/operations/resolve-many", {
            "resolution": "committed", "ids": [str(op)], "evidence": "PSP shows it",
            "confirmed": 1})
        assert many.status_code == 400 and many.json()["code"] == "INVALID_REQUEST"
    assert sql("SELECT state FROM orchestrator.operations") == [{"state": "unknown"}]
    assert audit(sql) == []
    await app.database.close()


async def test_an_action_body_with_a_field_it_does_not_take_is_refused_and_changes_nothing(
        make_app, sql):  # type: ignore[no-untyped-def]
    """A misspelt field is not dropped: `thn: fail` read as no `then` would send a
    consequential call again that the operator meant to fail, and a misspelt `ids` would
    leave a bulk action with no filter, every waiting item."""
    app = uncertain_app(make_app)
    ops = await park(app, sql, {"a": OWNER})
    op = ops["a"]
    run = run_of(sql, op)["id"]
    async with Client(console_of(app), "alice") as alice:
        for path, body in (
                (f"/api/operations/{op}/resolve",
                 {"resolution": "not_applied", "thn": "fail", "evidence": "PSP shows none"}),
                (f"/api/operations/{op}/abandon", {"evidence": "gave up", "note": "x"}),
                ("/api/operations/resolve-many",
                 {"resolution": "not_applied", "operation_ids": [str(op)],
                  "evidence": "PSP shows none", "confirmed": 1}),
                ("/api/operations/abandon-many",
                 {"operation_ids": [str(op)], "evidence": "gave up", "confirmed": 1}),
                (f"/api/runs/{run}/cancel", {"evidence": "stop", "force": True})):
            answer = await alice.post(path, body)
            assert answer.status_code == 400, (path, answer.text)
            refused = answer.json()
            assert refused["code"] == "INVALID_REQUEST" and refused["path"] == "body", path
            assert "the body has no field" in refused["message"], refused
    assert sql("SELECT state FROM orchestrator.operations") == [{"state": "unknown"}]
    assert run_of(sql, op)["status"] == "needs_reconciliation"
    assert audit(sql) == []
    await app.database.close()


async def test_a_number_in_other_digits_is_a_bad_request_not_a_failure(
        make_app, sql):  # type: ignore[no-untyped-def]
    app = uncertain_app(make_app)
    ops = await park(app, sql, {"a": OWNER})
    run_id = run_of(sql, ops["a"])["id"]
    async with Client(console_of(app), "alice") as alice:
        for path, params in (("/api/runs", {"limit": "²"}), ("/api/operations", {"limit": "²"}),
                             ("/api/audit", {"before": "²"}),
                             ("/api/audit", {"before": "9" * 5000}),
                             (f"/api/runs/{run_id}/events", {"after": "²"}),
                             ("/audit", {"limit": "²"})):
            answer = await alice.get(path, **params)
            assert answer.status_code == 400, (path, answer.text)
            if path.startswith("/api/"):
                assert answer.json()["code"] == "INVALID_REQUEST"
        bulk = await alice.form("/operations/bulk", {
            "resolution": "abandoned", "evidence": "written off", "tool": "charge",
            "confirmed": "¹"})
        assert bulk.status_code == 200, bulk.text  # not a count: nothing confirmed, nothing done
    assert sql("SELECT state FROM orchestrator.operations") == [{"state": "unknown"}]
    assert audit(sql) == []
    await app.database.close()


async def test_a_bad_state_filter_names_every_state_the_queue_takes(
        make_app, sql):  # type: ignore[no-untyped-def]
    """``state=all`` is accepted (and documented), so the error for a bad state names it."""
    app = uncertain_app(make_app)
    ops = await park(app, sql, {"a": OWNER})
    async with Client(console_of(app), "alice") as alice:
        bad = await alice.get("/api/operations", state="everything")
        assert bad.status_code == 400 and bad.json()["code"] == "INVALID_REQUEST"
        assert bad.json()["message"] == ("state must be one of open, operator, resolved, "
                                         "unresolved, all")
        every = await alice.get("/api/operations", state="all")
        assert every.status_code == 200, every.text
        assert [i["operation_id"] for i in every.json()["items"]] == [str(ops["a"])]
    listed = await app.operators.list_items(operator="alice", state="all")  # Python, alike
    assert [i["operation_id"] for i in listed] == [ops["a"]]
    await app.database.close()


async def test_a_next_cursor_pasted_into_a_url_as_it_is_reads_the_next_page(
        make_app, sql):  # type: ignore[no-untyped-def]
    """``next`` is used as the next ``before`` as it is (``curl "…?before=$NEXT"``): it holds
    nothing that a query string reads otherwise (a ``+`` would arrive as a space)."""
    app = uncertain_app(make_app)
    await park(app, sql, {"a": OWNER, "b": OWNER, "c": OWNER})
    async with Client(console_of(app), "reader") as reader:
        for path, key, expected in (
                ("/api/runs", "runs", [str(r["id"]) for r in sql(
                    "SELECT id FROM orchestrator.runs ORDER BY created_at DESC, id DESC")]),
                ("/api/incidents", "incidents", [r["ref"] for r in sql(
                    "SELECT ref FROM orchestrator.incidents "
                    "ORDER BY created_at DESC, ref DESC")])):
            assert len(expected) == 3
            seen, cursor = [], None
            while True:
                url = f"{path}?limit=1" + (f"&before={cursor}" if cursor else "")
                answer = await reader.http.get(url)  # the cursor pasted, not encoded
                assert answer.status_code == 200, answer.text
                seen += [x["id" if key == "runs" else "ref"] for x in answer.json()[key]]
                cursor = answer.json()["next"]
                if cursor is None:
                    break
            assert seen == expected
    await app.database.close()


async def test_the_reconciliation_queue_is_paged_by_the_next_cursor_each_item_once(
        make_app, sql):  # type: ignore[no-untyped-def]
    """``GET /api/operations`` answers ``next``, the ``after`` of the page that follows
    (oldest first, as the queue is listed), usable as it is in a URL; the queue page links to
    the next page with its filter kept. More items than a page holds are all reachable."""
    app = uncertain_app(make_app)
    await park(app, sql, {"a": OWNER, "b": OWNER, "c": OWNER})
    expected = [str(r["operation_id"]) for r in sql(
        "SELECT operation_id FROM orchestrator.reconciliation_items ORDER BY created_at, id")]
    assert len(expected) == 3
    async with Client(console_of(app), "reader") as reader:
        seen, cursor, pages = [], None, 0
        while True:
            url = "/api/operations?state=all&limit=2" + (f"&after={cursor}" if cursor else "")
            answer = await reader.http.get(url)  # the cursor pasted, not encoded
            assert answer.status_code == 200, answer.text
            body = answer.json()
            assert body["count"] == len(body["items"])
            seen += [i["operation_id"] for i in body["items"]]
            cursor, pages = body["next"], pages + 1
            if cursor is None:
                break
        assert seen == expected and pages == 2

        first = await reader.get("/operations", limit="2", tool="charge")
        assert first.status_code == 200
        [link] = re.findall(r'href="([^"]*)" rel="next"', first.text)
        assert "tool=charge" in html.unescape(link) and "after=" in link
        rest = await reader.http.get(html.unescape(link))
        assert rest.status_code == 200 and f'/operations/{expected[2]}"' in rest.text
        assert f'/operations/{expected[0]}"' not in rest.text
        assert 'rel="next"' not in rest.text

        for bad in ("yesterday", "2026-12-01T00:00:00Z_x", str(expected[0]),
                    "2026-12-01T00:00:00Z_9999999999999999999"):
            refused = await reader.get("/api/operations", after=bad)
            assert refused.status_code == 400, bad
            assert refused.json()["code"] == "INVALID_REQUEST"
            assert refused.json()["message"].startswith("after must be the next cursor"), bad
    await app.database.close()


async def test_resolving_an_operation_whose_call_is_in_flight_answers_409_in_progress(
        make_app, sql):  # type: ignore[no-untyped-def]
    """An operation still ``submitted`` is not unknown: the API's resolve and abandon, and
    the page's resolve forms, answer 409 ``OPERATION_IN_PROGRESS`` saying to wait, and write
    nothing (a form gets the operation's page back, the refusal a notice on it); the API and
    the page show it, with what to wait for and no resolve form."""
    app = make_app(operator_scopes=SCOPES)
    pay, entered, release = charge_in_flight(app)

    console = console_of(app)
    async with Client(console, "alice") as alice, running(app):
        run = await app.submit_async(pay, "o1")
        await wait_for(entered.is_set)
        (op,) = sql("SELECT id FROM orchestrator.operations WHERE state = 'submitted'")
        try:
            answers = [
                await alice.post(f"/api/operations/{op['id']}/resolve", {
                    "resolution": "committed", "receipt": {"charge": "o1"},
                    "evidence": "PSP shows it"}),
                await alice.post(f"/api/operations/{op['id']}/abandon", {"evidence": "no"})]
            for answer in answers:
                assert answer.status_code == 409, answer.text
                said = answer.json()
                assert said["code"] == "OPERATION_IN_PROGRESS" and said["retryable"] is True
                assert said["message"].startswith(f"operation {op['id']} is submitted: its "
                                                  "call is in flight"), said
                assert "wait" in said["message"]
            forms = {"committed": "resolve-committed", "not_applied": "resolve-not-applied",
                     "abandoned": "resolve-abandon"}
            for resolution in ("not_applied", "abandoned"):
                # the form refused: the operation's page again, the refusal a notice on it,
                # and only the form sent, as it was filled in (to send again later)
                page = await alice.form(f"/operations/{op['id']}/resolve", {
                    "resolution": resolution, "evidence": "no charge <at> the PSP"})
                assert page.status_code == 409 and "OPERATION_IN_PROGRESS" in page.text
                text = html.unescape(page.text)
                assert f"<h1>Operation {op['id']} " in text, resolution
                assert 'class="notice failure" role="alert"' in page.text
                assert (f"Refused: OPERATION_IN_PROGRESS</strong> operation {op['id']} is "
                        "submitted: its call is in flight") in text
                assert 'id="wait"' in page.text and 'id="kept"' in page.text
                assert [f for f in forms.values() if f'id="{f}"' in page.text] == [
                    forms[resolution]]
                assert "no charge &lt;at&gt; the PSP</textarea>" in page.text
            shown = await alice.get(f"/api/operations/{op['id']}")
            assert shown.status_code == 200, shown.text
            d = shown.json()
            assert (d["item"]["operation_id"], d["item"]["run_id"]) == (str(op["id"]),
                                                                        str(run.id))
            assert (d["item"]["operation_state"], d["item"]["item_state"]) == ("submitted", None)
            assert d["item"]["tool_name"] == "charge" and d["lookups"] == []
            assert [a["state"] for a in d["attempts"]] == ["submitted"]
            assert d["wait"].startswith(f"operation {op['id']} is submitted: its call is in "
                                        "flight") and "wait" in d["wait"], d
            page = await alice.get(f"/operations/{op['id']}")
            assert page.status_code == 200, page.text
            text = html.unescape(page.text)
            assert d["wait"] in text and 'id="wait"' in page.text
            assert 'id="resolve-committed"' not in page.text
            async with Client(console, "bob") as bob:  # another tenant's: as a missing one
                hidden = await bob.get(f"/api/operations/{op['id']}")
                assert hidden.status_code == 404 and hidden.json()["code"] == "ACCESS_DENIED"
            assert audit(sql) == []
        finally:
            release.set()
        assert await run.result_async(timeout=10) == {"charge": "o1"}
    await app.database.close()


async def test_a_malformed_id_in_a_path_is_400_invalid_request_naming_it(
        make_app):  # type: ignore[no-untyped-def]
    """An id in a path that is not an id is bad input: 400 ``INVALID_REQUEST`` naming the
    field, for an operation (not a positive integer) as for a run (not a UUID), in the API
    and among the pages; never 404, which says a path is not served (``NOT_FOUND``) or an
    object is missing (``ACCESS_DENIED``)."""
    app = make_app(operator_scopes=SCOPES)
    async with Client(console_of(app), "alice") as alice:
        answers = {
            "run_id": [await alice.get("/api/runs/abc"),
                       await alice.get("/api/runs/abc/events"),
                       await alice.post("/api/runs/abc/cancel", {"evidence": "x"})],
            "operation_id": [await alice.get(f"/api/operations/{bad}")
                             for bad in ("abc", "-1", "0", "1e3", "99999999999999999999")] + [
                await alice.post("/api/operations/abc/resolve", {
                    "resolution": "not_applied", "evidence": "x"}),
                await alice.post("/api/operations/abc/abandon", {"evidence": "x"})],
        }
        for field, refused in answers.items():
            for answer in refused:
                assert answer.status_code == 400, (answer.url, answer.text)
                said = answer.json()
                assert (said["code"], said["path"]) == ("INVALID_REQUEST", field), said
        for page in ("/runs/abc", "/operations/abc"):
            answer = await alice.get(page)
            assert answer.status_code == 400 and "INVALID_REQUEST" in answer.text, page
        posted = await alice.form("/operations/abc/resolve", {"resolution": "not_applied",
                                                              "evidence": "x"})
        assert posted.status_code == 400 and "INVALID_REQUEST" in posted.text
        for path in ("/api/operations/resolve-many", "/api/operations/abandon-many"):
            wrong = await alice.get(path)  # served for POST only
            assert wrong.status_code == 405 and wrong.json()["code"] == "INVALID_REQUEST"
        assert (await alice.get("/operations/bulk")).status_code == 405
    await app.database.close()


async def test_a_malformed_run_filter_of_the_queue_is_named_as_its_parameter(
        make_app):  # type: ignore[no-untyped-def]
    """The queue's filter ``run`` (of ``GET /api/operations`` and of a bulk action's
    ``filter``) that is not a run id is 400 ``INVALID_REQUEST`` whose ``path`` is ``run``, the
    parameter the client gave, as for every other filter; never ``run_id``, which the API does
    not take."""
    app = make_app(operator_scopes=SCOPES)
    async with Client(console_of(app), "alice") as alice:
        answers = [await alice.get("/api/operations", run="abc"),
                   await alice.post("/api/operations/abandon-many", {
                       "evidence": "x", "filter": {"run": "abc"}})]
        for answer in answers:
            assert answer.status_code == 400, answer.text
            said = answer.json()
            assert (said["code"], said["path"]) == ("INVALID_REQUEST", "run"), said
            assert said["message"] == "run must be a run id (a UUID), not 'abc'", said
    await app.database.close()


async def test_an_unknown_path_answers_404_not_found_and_a_wrong_method_405(
        make_app):  # type: ignore[no-untyped-def]
    """A path the console does not serve is ``NOT_FOUND`` (404), under the API and among the
    pages, never ``ACCESS_DENIED`` (which says a run or operation is missing or out of scope)
    nor ``INVALID_REQUEST`` (whose status is 400); a path served for another method is 405
    ``INVALID_REQUEST``."""
    app = make_app(operator_scopes=SCOPES)
    async with Client(console_of(app), "alice") as alice:
        for path in ("/api/nothing", "/api/operations/12/resolv", "/api/runs/x/y/z"):
            answer = await alice.get(path)
            assert answer.status_code == 404, path
            assert answer.json() == {"code": "NOT_FOUND", "message": answer.json()["message"],
                                     "retryable": False, "incident": None}
            assert answer.json()["message"] == f"no such API path: GET {path!r}"
        posted = await alice.post("/api/nothing", {"evidence": "x"})
        assert posted.status_code == 404 and posted.json()["code"] == "NOT_FOUND"
        page = await alice.get("/nothing")
        assert page.status_code == 404 and "NOT_FOUND" in page.text
        wrong = await alice.http.delete("/api/runs")
        assert wrong.status_code == 405 and wrong.json()["code"] == "INVALID_REQUEST"
    await app.database.close()


async def test_what_a_form_resolution_led_to_is_said_as_it_is(
        make_app, sql):  # type: ignore[no-untyped-def]
    """The page a resolve form leads to says what became of the run, as ``ops resolve``
    does: a run with another unknown operation still waits (it was not woken); abandoning
    that one fails the run; settling an operation of a run that has ended changes only the
    ledger. Never "its run was woken" for a run that was not."""
    app = make_app(operator_scopes=SCOPES)

    @app.tool()
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        raise ConnectionResetError("lost after sending")

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.gather(*(ctx.call(charge, order=f"{order}-{i}") for i in (1, 2, 3)))

    async with running(app):
        await app.submit_async(pay, "o")
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs")[0]["status"]
                       == "needs_reconciliation")
    first, second, third = [r["id"] for r in sql("SELECT id FROM orchestrator.operations "
                                                 "ORDER BY id")]

    async def said(alice: Client, op: int, resolution: str) -> str:
        sent = await alice.form(f"/operations/{op}/resolve", {
            "resolution": resolution, "receipt": '{"charge": "ch_1"}', "evidence": "PSP"})
        assert sent.status_code == 303, sent.text
        page = await alice.http.get(sent.headers["location"])
        assert page.status_code == 200, page.text
        (notice,) = re.findall(r'<p class="notice done"[^>]*>(.*?)</p>', page.text, re.S)
        return html.unescape(notice)

    async with Client(console_of(app), "alice") as alice:
        notice = await said(alice, first, "committed")
        assert "was woken" not in notice and "still waits" in notice, notice
        assert sql("SELECT status FROM orchestrator.runs")[0]["status"] == (
            "needs_reconciliation")
        notice = await said(alice, second, "abandoned")
        assert "failed with OPERATION_ABANDONED" in notice, notice
        notice = await said(alice, third, "not_applied")
        assert "was woken" not in notice and "already ended" in notice, notice
    await app.database.close()


async def test_the_operation_page_shows_the_evidence_the_engine_kept(
        make_app, sql):  # type: ignore[no-untyped-def]
    """What the engine kept on a queue item (a receipt that came after its worker lost the
    lease, the reconciler's notes) is on the operation's page, as ``ops show`` prints it and
    the API gives it: an operator deciding whether the call committed sees the receipt the
    tool answered."""
    app = uncertain_app(make_app)
    ops = await park(app, sql, {"a": OWNER})
    late = {"kind": "late_receipt", "worker": "w-lost", "receipt": {"charge": "ch_late_7"},
            "receipt_digest": "d" * 64}
    sql("UPDATE orchestrator.reconciliation_items SET evidence = evidence || %s::jsonb "
        "|| '[{\"note\": \"tool charge has no lookup here; an operator decides\"}]'::jsonb "
        "WHERE operation_id = %s", (json.dumps([late]), ops["a"]))
    async with Client(console_of(app), "alice") as alice:
        shown = await alice.get(f"/api/operations/{ops['a']}")
        assert shown.status_code == 200 and late in shown.json()["evidence"], shown.text
        page = await alice.get(f"/operations/{ops['a']}")
        assert page.status_code == 200, page.text
        text = html.unescape(page.text)
        assert 'id="kept-evidence"' in page.text
        assert "ch_late_7" in text and "w-lost" in text and "late_receipt" in text
        assert "tool charge has no lookup here; an operator decides" in text
    await app.database.close()


async def test_the_operation_page_says_what_a_not_applied_resolution_chose_and_a_cancel(
        make_app, sql):  # type: ignore[no-untyped-def]
    """The operation page says, beside "resolved as not_applied", whether the call was to be
    sent again or to fail, and, before anyone resolves it, that the run's cancellation was
    requested (it then ends cancelled: nothing is sent again)."""
    app = uncertain_app(make_app)
    ops = await park(app, sql, {"a": OWNER, "b": OWNER})
    async with Client(console_of(app), "alice") as alice:
        handle = await app.get_run_async(run_of(sql, ops["b"])["id"])
        await handle.cancel_async()
        page = (await alice.get(f"/operations/{ops['b']}")).text
        assert 'id="cancel-requested"' in page and "nothing is sent again" in page
        assert 'id="cancel-requested"' not in (await alice.get(f"/operations/{ops['a']}")).text
        done = await alice.post(f"/api/operations/{ops['a']}/resolve", {
            "resolution": "not_applied", "then": "fail", "evidence": "PSP shows none"})
        assert done.status_code == 200, done.text
        page = (await alice.get(f"/operations/{ops['a']}")).text
        assert 'id="resolution">not_applied</strong>, then <strong id="then">fail the call' \
            in page
    await app.database.close()


async def test_a_withheld_lookup_reason_says_what_reading_it_takes(
        make_app, sql):  # type: ignore[no-untyped-def]
    """What a lookup said is withheld from an operator without the ``incidents`` grant, and
    from one with it whom the application's ``incident_readers`` do not list. The page told
    both that the incidents grant reads it, which the second has already: it says what each
    lacks."""
    app = uncertain_app(make_app)
    tool = app.registry.tools["charge"]

    @tool.lookup
    async def find(ctx, *, order):  # type: ignore[no-untyped-def]
        return NotApplied(f"no such charge; the PSP echoed {SECRET}")

    op = (await park(app, sql, {"a": OWNER}))["a"]
    assert await app.create_reconciler().run_once() == 1
    console = console_of(app, grants={**GRANTS, "viewer": ["read", "incidents"]})
    async with Client(console, "alice") as alice:  # a reader, without the grant
        page = html.unescape((await alice.get(f"/operations/{op}")).text)
        assert "kept in the incident (the incidents grant reads it)" in page
    async with Client(console, "viewer") as viewer:  # the grant, not a reader
        page = html.unescape((await viewer.get(f"/operations/{op}")).text)
        assert SECRET not in page
        assert "the incidents grant reads it" not in page
        assert "kept in the incident (reading it needs the application's incident_readers " \
               "to list you)" in page
    await app.database.close()


async def test_the_operation_page_says_a_resolution_of_an_ended_runs_operation_only_records(
        make_app, sql):  # type: ignore[no-untyped-def]
    """An operation left unknown by a run that ended meanwhile (its deadline passed) is still
    settled in the ledger, but nothing follows for its run: the page said nothing of it and
    offered "resend", "fail the call" and "Abandon (the run fails)". It says that the run has
    ended and that a resolution only records what became of the call."""
    from datetime import timedelta

    from tests.integration.conftest import never_answers

    app = make_app(operator_scopes=SCOPES, incident_readers=["alice"])

    @app.tool()
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        await never_answers()

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    async with running(app):
        await app.submit_async(pay, "late", owner=OWNER, deadline=timedelta(seconds=0.5))
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.reconciliation_items"))
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs WHERE status = 'failed'"))
    [op] = sql("SELECT id FROM orchestrator.operations")
    async with Client(console_of(app), "alice") as alice:
        page = html.unescape((await alice.get(f"/operations/{op['id']}")).text)
        assert ("it has ended: resolving this operation only records what became of its call "
                "(nothing is sent again or failed, the run stays as it ended)") in page
        assert "Abandon (the run fails)" not in page
        assert 'id="resolve-not-applied"' in page  # the ledger may still be settled
    await app.database.close()
