"""Held-back starts: ``submit(start_at=…)`` and ``submit(delay=…)`` (docs/flow.md)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from orchestrator import IdempotencyConflict, InvalidRequest
from orchestrator.admin import list_runs, show_run
from orchestrator.records import iso
from tests.consoletools import GRANTS, Served, from_header
from tests.integration.conftest import OWNER, running


def _app(make_app, started: dict[str, float]):  # type: ignore[no-untyped-def]
    app = make_app()

    @app.workflow()
    async def remind(ctx, data):  # type: ignore[no-untyped-def]
        started.setdefault(data["name"], time.monotonic())
        return data

    return app, remind


def _count(sql) -> int:  # type: ignore[no-untyped-def]
    return int(sql("SELECT count(*) AS n FROM orchestrator.runs")[0]["n"])


async def test_a_delayed_run_is_not_claimed_before_its_start_and_runs_after_it(make_app):
    started: dict[str, float] = {}
    app, remind = _app(make_app, started)
    async with running(app):
        submitted = time.monotonic()
        later = await app.submit_async(remind, {"name": "later"}, delay=timedelta(seconds=2))
        now = await app.submit_async(remind, {"name": "now"})
        assert await now.result_async(timeout=10) == {"name": "now"}
        info = await later.info_async()
        assert info.status == "queued" and info.start_at is not None
        assert info.start_at == info.created_at + timedelta(seconds=2)
        note = (await show_run(app.database, later.id)).note or ""
        assert note.startswith("not before ") and "held-back start" in note
        listed = {r["id"]: r for r in await list_runs(app.database)}
        assert listed[later.id]["blocked"].startswith("not before ")
        assert listed[now.id]["blocked"] is None
        assert await later.result_async(timeout=10) == {"name": "later"}
    assert started["later"] - submitted >= 2.0
    assert (await later.info_async()).start_at == info.start_at  # still says when it could


async def test_start_at_holds_the_run_until_then_and_its_deadline_counts_from_it(make_app, sql):
    started: dict[str, float] = {}
    app, remind = _app(make_app, started)
    at = datetime.now(UTC) + timedelta(seconds=1.5)
    run = await app.submit_async(remind, {"name": "at"}, start_at=at,
                                 deadline=timedelta(minutes=1))
    row = sql("SELECT available_at, deadline_at FROM orchestrator.runs WHERE id = %s",
              (run.id,))[0]
    assert row["available_at"] == at
    assert row["deadline_at"] == at + timedelta(minutes=1)
    assert (await run.info_async()).start_at == at
    async with running(app):
        assert await run.result_async(timeout=10) == {"name": "at"}
    assert datetime.now(UTC) >= at


async def test_a_start_at_a_moment_ago_starts_at_once(make_app, sql):
    app, remind = _app(make_app, {})
    run = await app.submit_async(remind, {"name": "x"},
                                 start_at=datetime.now(UTC) - timedelta(minutes=2))
    row = sql("SELECT available_at <= now() AS due, created_at = available_at AS same "
              "FROM orchestrator.runs WHERE id = %s", (run.id,))[0]
    assert row == {"due": True, "same": True}
    info = await run.info_async()
    assert info.start_at == info.created_at
    async with running(app):
        assert await run.result_async(timeout=10) == {"name": "x"}


async def test_the_same_key_and_delay_is_the_same_request_another_delay_a_conflict(make_app):
    app, remind = _app(make_app, {})
    first = await app.submit_async(remind, {"name": "k"}, idempotency_key="remind-1",
                                   delay=timedelta(hours=1))
    time.sleep(0.01)  # a retry comes later: still the same request
    again = await app.submit_async(remind, {"name": "k"}, idempotency_key="remind-1",
                                   delay=timedelta(hours=1))
    assert again.id == first.id
    with pytest.raises(IdempotencyConflict):
        await app.submit_async(remind, {"name": "k"}, idempotency_key="remind-1",
                               delay=timedelta(hours=2))
    with pytest.raises(IdempotencyConflict):
        await app.submit_async(remind, {"name": "k"}, idempotency_key="remind-1")


def _past(minutes: float) -> datetime:
    return datetime.now(UTC) - timedelta(minutes=minutes)


@pytest.mark.parametrize(("options", "path"), [
    ({"start_at": datetime.now(UTC) + timedelta(hours=1), "delay": timedelta(hours=1)},
     "start_at"),
    ({"start_at": datetime(2030, 1, 1, 9, 0)}, "start_at"),  # naive
    ({"start_at": "2030-01-01T09:00:00Z"}, "start_at"),  # not a datetime
    ({"start_at": _past(6)}, "start_at"),
    ({"start_at": datetime.now(UTC) + timedelta(days=3661)}, "start_at"),
    ({"delay": timedelta(seconds=-1)}, "delay"),
    ({"delay": timedelta(days=3661)}, "delay"),
    ({"delay": 60}, "delay"),  # seconds, not a timedelta
])
async def test_bad_starts_are_rejected_naming_the_field_and_nothing_is_written(
        make_app, sql, options: dict[str, Any], path: str):
    app, remind = _app(make_app, {})
    with pytest.raises(InvalidRequest) as info:
        await app.submit_async(remind, {"name": "bad"}, **options)
    assert info.value.code == "INVALID_REQUEST"
    assert info.value.path == path
    assert _count(sql) == 0


async def test_the_http_api_takes_start_at_and_delay(make_app, sql):
    app, _ = _app(make_app, {})
    console = app.console(from_header, GRANTS, authenticate_owner=lambda request: OWNER)
    at = (datetime.now(UTC) + timedelta(hours=2)).replace(microsecond=0)
    with Served(console) as server:
        async with httpx.AsyncClient(base_url=server.base, timeout=60) as http:
            made = await http.post("/api/runs", json={"workflow": "remind", "input": {},
                                                      "start_at": at.isoformat()})
            assert made.status_code == 201, made.text
            assert made.json()["start_at"] == iso(at)
            delayed = await http.post("/api/runs", json={"workflow": "remind", "input": {},
                                                         "delay": 30})
            assert delayed.status_code == 201, delayed.text
            assert delayed.json()["start_at"] is not None
            before = _count(sql)
            for body, field in (({"start_at": "tomorrow"}, "start_at"),
                                ({"start_at": "2030-01-01T09:00:00"}, "start_at"),
                                ({"start_at": 1767258000}, "start_at"),
                                ({"delay": -5}, "delay"), ({"delay": "5"}, "delay")):
                bad = await http.post("/api/runs", json={"workflow": "remind", "input": {},
                                                         **body})
                assert bad.status_code == 400, bad.text
                assert bad.json()["code"] == "INVALID_REQUEST"
                assert field in bad.json()["message"]
            assert _count(sql) == before
