"""The Runs page's filters (owner, created range, a condition on the input) and the event
stream's ``topics``, through the console's API and pages against a real PostgreSQL."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from orchestrator import Orchestrator, Owner
from orchestrator.console.service import input_condition
from orchestrator.errors import InvalidRequest
from tests.consoletools import GRANTS, SCOPES, Client, from_header
from tests.consoletools import sse_events as events_of
from tests.integration.conftest import running, wait_for

Sql = Callable[..., list[dict[str, Any]]]

ACME_ALICE = Owner(tenant="acme", principal="alice")
ACME_CAROL = Owner(tenant="acme", principal="carol")
GLOBEX_BOB = Owner(tenant="globex", principal="bob")


async def seeded(make_app: Callable[..., Orchestrator], sql: Sql
                 ) -> tuple[Orchestrator, dict[str, str]]:
    """Five queued runs with known owners, inputs and creation times (1 to 5 December)."""
    app = make_app(operator_scopes={**SCOPES, "root": ["acme", "globex"]})

    @app.workflow()
    async def order(ctx, data):  # type: ignore[no-untyped-def]
        return data

    made: dict[str, str] = {}
    for name, owner, data in [
            ("a", ACME_ALICE, {"customer": "c1", "cents": 500, "ship": {"country": "FR"}}),
            ("b", ACME_ALICE, {"customer": "c2", "cents": 500, "ship": {"country": "DE"}}),
            ("c", ACME_CAROL, {"customer": "c1", "cents": 700, "vip": True}),
            ("d", GLOBEX_BOB, {"customer": "c1", "cents": 500}),
            ("e", ACME_CAROL, {"customer": "500"})]:
        made[name] = str((await app.submit_async(order, data, owner=owner)).id)
    for day, name in enumerate("abcde", start=1):
        sql("UPDATE orchestrator.runs SET created_at = %s WHERE id = %s",
            (f"2026-12-0{day}T12:00:00Z", made[name]))
    return app, made


async def listed(client: Client, **filters: Any) -> list[str]:
    answer = await client.get("/api/runs", **filters)
    assert answer.status_code == 200, answer.text
    return [r["id"] for r in answer.json()["runs"]]


async def test_runs_are_filtered_by_owner_created_range_and_input(make_app, sql) -> None:  # type: ignore[no-untyped-def]
    app, made = await seeded(make_app, sql)
    console = app.console(from_header, {**GRANTS, "root": ["read"]})

    def ids(*names: str) -> list[str]:
        return [made[n] for n in names]

    async with Client(console, "root") as root, Client(console, "alice") as alice:
        assert await listed(root) == ids("e", "d", "c", "b", "a")
        assert await listed(root, tenant="acme") == ids("e", "c", "b", "a")
        assert await listed(root, tenant="acme", principal="carol") == ids("e", "c")
        assert await listed(root, principal="bob") == ids("d")
        assert await listed(root, created_from="2026-12-02",
                            created_to="2026-12-04") == ids("c", "b")
        assert await listed(root, created_from="2026-12-03T12:00:00+00:00") == ids("e", "d", "c")
        assert await listed(root, created_to="2026-12-03T13:00:00+01:00") == ids("b", "a")
        assert await listed(root, input="customer = c1") == ids("d", "c", "a")
        assert await listed(root, input="cents = 500") == ids("d", "b", "a")
        assert await listed(root, input='customer = "500"') == ids("e")
        assert await listed(root, input="customer = 500") == []  # the number, not the text
        assert await listed(root, input="ship.country = FR") == ids("a")
        assert await listed(root, input="vip = true") == ids("c")
        assert await listed(root, input="customer = c1", tenant="acme",
                            created_from="2026-12-02") == ids("c")

        # The operator's scope still holds: another tenant named in a filter is nothing.
        assert await listed(alice, tenant="globex") == []
        assert await listed(alice, input="customer = c1") == ids("c", "a")

        # Keyset pages under a filter.
        first = (await root.get("/api/runs", input="cents = 500", limit=2)).json()
        assert [r["id"] for r in first["runs"]] == ids("d", "b")
        rest = await listed(root, input="cents = 500", limit=2, before=first["next"])
        assert rest == ids("a")

        for name, value in [("input", "customer"), ("input", "= c1"), ("input", "a..b = 1"),
                            ("input", "x = {\"y\": 1}"), ("input", "x = [1]"),
                            ("input", "x = "), ("input", "x\u200b = 1"),
                            ("created_from", "yesterday"), ("created_to", "2026-13-01"),
                            ("tenant", " acme"), ("principal", "a\x00b")]:
            answer = await root.get("/api/runs", **{name: value})
            assert answer.status_code == 400, (name, value, answer.text)
            assert answer.json()["code"] == "INVALID_REQUEST"
            assert answer.json()["message"]

        # The page keeps what was typed and says why inside the list it would replace.
        page = await root.get("/runs", input="customer c1", tenant="acme")
        assert page.status_code == 400
        assert "Refused: INVALID_REQUEST" in page.text and "path = value" in page.text
        assert 'value="customer c1"' in page.text and 'value="acme"' in page.text
        page = await root.get("/runs", input="customer = c1", principal="carol")
        assert page.status_code == 200 and made["c"] in page.text and made["a"] not in page.text
    await app.database.close()


def test_an_input_condition_is_a_containment_document() -> None:
    assert input_condition(None) is None
    assert input_condition("customer = c1") == '{"customer": "c1"}'
    assert input_condition(" order.cents=500 ") == '{"order": {"cents": 500}}'
    assert input_condition("a = null") == '{"a": null}'
    assert input_condition("a = 1.5") == '{"a": 1.5}'
    assert input_condition('name = "two words"') == '{"name": "two words"}'
    assert input_condition("name = two words") == '{"name": "two words"}'
    assert input_condition("città = Zürich") == '{"città": "Zürich"}'
    for bad in ["", "x", "x == 1", "x = NaN", "x = Infinity", "x = " + "9" * 5000, "x" * 1001]:
        with pytest.raises(InvalidRequest):
            input_condition(bad)


async def test_the_event_stream_keeps_only_the_topics_asked(make_app, sql) -> None:  # type: ignore[no-untyped-def]
    app = make_app(operator_scopes=SCOPES)

    @app.workflow()
    async def chatty(ctx, _):  # type: ignore[no-untyped-def]
        ctx.publish({"n": 1})
        ctx.publish({"n": 2}, topic="audit")
        ctx.publish({"n": 3}, topic="other")
        ctx.now()  # an entry that is no message
        return "ok"

    console = app.console(from_header, GRANTS)
    async with running(app):
        handle = await app.submit_async(chatty, None)
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs WHERE id = %s",
                                   (handle.id,)) == [{"status": "succeeded"}], timeout=60)
    async with Client(console, "alice") as client:
        async def kinds(**params: Any) -> list[tuple[str, Any]]:
            async with client.http.stream("GET", f"/api/runs/{handle.id}/events",
                                          params=params) as answer:
                assert answer.status_code == 200
                return [(e["event"], e["data"]["name"]) async for e in events_of(answer)
                        if "event" in e]

        assert await kinds(topics="progress,audit") == [
            ("message", "progress"), ("message", "audit"), ("run.completed", None)]
        assert await kinds(topics=["other"]) == [("message", "other"), ("run.completed", None)]
        everything = await kinds()
        assert [kind for kind, _ in everything] == ["message", "message", "message", "value",
                                                    "run.completed"]
        bad = await client.get(f"/api/runs/{handle.id}/events", topics="a\x00")
        assert bad.status_code == 400 and bad.json()["code"] == "INVALID_REQUEST"
    await app.database.close()


async def test_the_overview_charts_the_runs_finished_each_minute_of_the_last_hour(
        make_app, sql) -> None:  # type: ignore[no-untyped-def]
    app, made = await seeded(make_app, sql)
    console = app.console(from_header, {**GRANTS, "root": ["read"]})
    for name, status, ago in [("a", "succeeded", "0 minutes"), ("b", "succeeded", "2 minutes"),
                              ("c", "failed", "2 minutes"), ("d", "succeeded", "2 minutes"),
                              ("e", "cancelled", "2 hours")]:
        sql(f"UPDATE orchestrator.runs SET status = %s, finished_at = now() - interval '{ago}' "
            "WHERE id = %s", (status, made[name]))
    async with Client(console, "root") as root, Client(console, "alice") as alice:
        chart = (await root.get("/api/overview")).json()["throughput"]
        assert len(chart) == 60
        assert chart[-1]["minute"] > chart[0]["minute"]
        counted = [(i, m["succeeded"], m["failed"], m["cancelled"])
                   for i, m in enumerate(chart) if m["succeeded"] + m["failed"] + m["cancelled"]]
        # now - 0 min is in the last minute (the one before, if a minute began since the
        # update); now - 2 min two minutes before it (three, if the update's minute was late).
        (last, *rest), (first, *counts) = counted[-1], counted[0]
        assert last in (58, 59) and rest == [1, 0, 0]
        assert len(counted) == 2 and counts == [2, 1, 0]  # b and d succeeded, c failed
        assert last - first in (2, 3)
        # alice's scope is acme: globex's run d is not counted.
        scoped = (await alice.get("/api/overview")).json()["throughput"]
        assert sum(m["succeeded"] for m in scoped) == 2
        page = await root.get("/")
        assert page.status_code == 200
        assert "4 runs finished, 1 failed" in page.text
        assert page.text.count('<rect class="succeeded"') == 2  # two minutes with successes
        assert page.text.count('<rect class="failed"') == 1
    await app.database.close()
