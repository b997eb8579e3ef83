"""The queue's bulk actions on operations named one by one (``ids`` in ``POST
/api/operations/resolve-many`` and ``abandon-many``, the ticked rows of the queue page), against
real runs parked on unknown operations: only the named ones are resolved, each audited; an id
of another tenant, a missing one and one already resolved are skipped with one answer (C9); ids
with a filter, bad ids, a missing CSRF token or grant are refused with nothing changed."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from orchestrator.operators import MAX_IDS, NOT_WAITING
from tests.consoletools import Client, uncertain_app
from tests.integration.conftest import OTHER, OWNER, running, wait_for
from tests.integration.test_console_api import audit, console_of, park, run_of

Sql = Callable[..., list[dict[str, Any]]]
MISSING = 987_654_321


def waiting(sql: Sql) -> int:
    return sql("SELECT count(*) AS n FROM orchestrator.reconciliation_items "
               "WHERE state <> 'resolved'")[0]["n"]


def left_alone(answer: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """The skipped entries of a bulk document by operation id, without the id."""
    return {s["operation_id"]: {k: v for k, v in s.items() if k != "operation_id"}
            for s in answer["skipped"]}


async def test_ids_resolve_only_the_named_operations_and_the_rest_wait(
        make_app, sql):  # type: ignore[no-untyped-def]
    app = uncertain_app(make_app)
    ops = await park(app, sql, {f"o{i}": OWNER for i in range(5)} | {"g": OTHER})
    named = [ops["o3"], str(ops["o1"]), ops["o0"], ops["o1"]]  # strings, as documents give
    asked = [*named, ops["g"], MISSING]
    body = {"resolution": "not_applied", "then": "resend", "ids": asked,
            "evidence": "PSP export: these three were never charged"}
    async with Client(console_of(app), "alice") as alice:
        counted = await alice.post("/api/operations/resolve-many", body)
        assert counted.status_code == 200, counted.text
        dry = counted.json()
        assert dry["dry_run"] is True and audit(sql) == []
        assert sorted(m["operation_id"] for m in dry["matched"]) == sorted(
            str(ops[o]) for o in ("o0", "o1", "o3"))  # oldest first, the duplicate once
        assert dry["counts"] == {"matched": 3, "resolved": 0, "skipped": 2}
        # another tenant's operation and a missing one: the same answer, ids apart
        skipped = left_alone(dry)
        assert skipped[str(ops["g"])] == skipped[str(MISSING)] == {
            "code": "ACCESS_DENIED", "reason": NOT_WAITING}
        stale = await alice.post("/api/operations/resolve-many", {**body, "confirmed": 4})
        assert stale.status_code == 409 and "ids select 3 operations now" in stale.json()[
            "message"]
        async with running(app):
            done = await alice.post("/api/operations/resolve-many", {**body, "confirmed": 3})
            assert done.status_code == 200, done.text
            assert done.json()["counts"] == {"matched": 3, "resolved": 3, "skipped": 2}
            assert sorted(done.json()["resolved"]) == sorted(
                str(ops[o]) for o in ("o0", "o1", "o3"))
            await wait_for(lambda: len(sql("SELECT 1 FROM orchestrator.runs "
                                           "WHERE status = 'succeeded'")) == 3, timeout=60)
        # an operation already resolved is left alone exactly as a missing one
        again = await alice.post("/api/operations/abandon-many",
                                 {"ids": [ops["o0"], MISSING], "evidence": "again"})
        assert again.json()["counts"] == {"matched": 0, "resolved": 0, "skipped": 2}
        assert left_alone(again.json())[str(ops["o0"])] == left_alone(again.json())[
            str(MISSING)]
    rows = audit(sql)
    assert sorted(int(r["target_id"]) for r in rows) == sorted(
        ops[o] for o in ("o0", "o1", "o3"))
    assert {(r["action"], r["operator"], r["evidence"]) for r in rows} == {
        ("resolve.not_applied", "alice", "PSP export: these three were never charged")}
    for order in ("o2", "o4", "g"):
        assert run_of(sql, ops[order])["status"] == "needs_reconciliation"
    assert waiting(sql) == 3
    await app.database.close()


async def test_ids_of_another_tenant_look_missing_to_an_operator_of_all_grants(
        make_app, sql):  # type: ignore[no-untyped-def]
    app = uncertain_app(make_app)
    ops = await park(app, sql, {"a": OWNER, "g": OTHER})
    async with Client(console_of(app), "bob") as bob:  # every grant, on globex only
        answer = await bob.post("/api/operations/abandon-many",
                                {"ids": [ops["a"], MISSING], "evidence": "x", "confirmed": 1})
        assert answer.status_code == 200, answer.text
        assert answer.json()["counts"] == {"matched": 0, "resolved": 0, "skipped": 2}
        skipped = left_alone(answer.json())
        assert skipped[str(ops["a"])] == skipped[str(MISSING)]
    assert audit(sql) == [] and waiting(sql) == 2
    await app.database.close()


async def test_ids_are_refused_with_a_filter_bad_or_without_csrf_or_grant(
        make_app, sql):  # type: ignore[no-untyped-def]
    app = uncertain_app(make_app)
    ops = await park(app, sql, {"a": OWNER, "b": OWNER})
    console = console_of(app)
    base = {"resolution": "not_applied", "evidence": "x", "ids": [ops["a"]], "confirmed": 1}
    bad = [{**base, "filter": {"tool": "charge"}}, {**base, "filter": {}},
           {**base, "ids": []}, {**base, "ids": str(ops["a"])},
           {**base, "ids": list(range(1, MAX_IDS + 2))}, {**base, "ids": ["abc"]},
           {**base, "ids": [0]}, {**base, "ids": [True]}, {**base, "ids": [1.5]},
           {**base, "ids": [2**63]}, {**base, "ids": ["9" * 30]}]
    async with Client(console, "alice") as alice, Client(console, "viewer") as viewer:
        for body in bad:
            answer = await alice.post("/api/operations/resolve-many", body)
            assert answer.status_code == 400, body
            assert answer.json()["code"] == "INVALID_REQUEST", body
        both = await alice.post("/api/operations/resolve-many", bad[0])
        assert "ids or a filter, not both" in both.json()["message"]
        answer = await alice.post("/api/operations/resolve-many", base, csrf=False)
        assert answer.status_code == 403 and answer.json()["code"] == "FORBIDDEN"
        answer = await viewer.post("/api/operations/resolve-many", base)
        assert answer.status_code == 403 and answer.json()["code"] == "FORBIDDEN"
        page = await alice.form("/operations/bulk", {"selection": "ids", "evidence": "x",
                                                     "resolution": "abandoned"})
        assert page.status_code == 400 and "tick at least one operation" in page.text
        form = await viewer.form("/operations/bulk", {
            "selection": "ids", "id": str(ops["a"]), "evidence": "x",
            "resolution": "abandoned", "confirmed": "1"})
        assert form.status_code == 403
    no_bulk = console_of(app, grants={"alice": ["read", "resolve"]})
    async with Client(no_bulk, "alice") as alice:
        answer = await alice.post("/api/operations/resolve-many", base)
        assert answer.status_code == 403 and "'bulk'" in answer.json()["message"]
    assert audit(sql) == [] and waiting(sql) == 2
    await app.database.close()


async def test_the_queue_page_offers_a_box_per_waiting_row_and_acts_on_the_ticked(
        make_app, sql):  # type: ignore[no-untyped-def]
    app = uncertain_app(make_app)
    ops = await park(app, sql, {f"o{i}": OWNER for i in range(3)})
    console = console_of(app)
    async with Client(console, "alice") as alice, Client(console, "viewer") as viewer:
        queue = (await alice.get("/operations")).text
        assert queue.count('name="id"') == 3 and 'id="selected-form"' in queue
        assert 'data-select-all="selected-form"' in queue
        assert 'name="id"' not in (await viewer.get("/operations")).text
        fields = {"selection": "ids", "resolution": "abandoned", "evidence": "written off"}
        ticked = {"id": [str(ops["o0"]), str(ops["o2"]), str(MISSING)]}
        token = await alice.token()
        preview = await alice.http.post("/operations/bulk", data={
            **fields, **ticked, "csrf_token": token})
        assert preview.status_code == 200, preview.text
        assert "Of the 3 selected operations, <strong>2</strong> still wait" in preview.text
        assert 'name="confirmed" value="2"' in preview.text and audit(sql) == []
        assert preview.text.count('type="hidden" name="id"') == 3
        done = await alice.http.post("/operations/bulk", data={
            **fields, **ticked, "confirmed": "2", "csrf_token": token})
        assert done.status_code == 200 and "Abandoned 2 of 2 operations" in done.text
        assert done.text.count('class="bulk-outcome o-resolved"') == 2
        assert done.text.count('class="bulk-outcome o-skipped"') == 1
    assert [run_of(sql, ops[o])["status"] for o in ("o0", "o1", "o2")] == [
        "failed", "needs_reconciliation", "failed"]
    await app.database.close()
