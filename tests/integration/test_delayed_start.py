"""Held-back starts: ``submit(start_at=…)`` and ``submit(delay=…)`` (docs/flow.md)."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest

from orchestrator import IdempotencyConflict, InvalidRequest
from orchestrator.admin import list_runs, show_run
from orchestrator.db import chains as chains_db
from orchestrator.db import queues as queues_db
from orchestrator.db import runs as runs_db
from orchestrator.ids import new_run_id
from orchestrator.records import iso
from tests.consoletools import GRANTS, Served, from_header
from tests.integration.conftest import OWNER, running, wait_for


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


def _wait_and_duration(app) -> tuple[tuple[int, float], tuple[int, float]]:  # type: ignore[no-untyped-def]
    """The count and the sum of the queue waits and of the durations the app observed."""
    [(_, wait_sum, waits)] = app.metrics.histogram("run_queue_wait_seconds").values()
    [(_, took_sum, took)] = app.metrics.histogram("run_duration_seconds").values()
    return (waits, wait_sum), (took, took_sum)


@pytest.mark.parametrize("queue", [None, "later"])
async def test_a_held_runs_queue_wait_and_duration_count_from_its_start(make_app, sql, queue):
    """A run submitted an hour ago to start an hour later, and run now: it waited in no queue
    and ran for a moment; its hour of hold is neither its queue wait nor its duration (in the
    default queue and in a declared one, whose claim is the database function's)."""
    app, remind = _app(make_app, {})
    if queue is not None:
        app.queue(queue)
    run = await app.submit_async(remind, {"name": "held"}, delay=timedelta(hours=1),
                                 queue=queue)
    sql("UPDATE orchestrator.runs SET created_at = created_at - interval '1 hour', "
        "available_at = available_at - interval '1 hour', due_at = due_at - interval '1 hour' "
        "WHERE id = %s", (run.id,))
    async with running(app):
        assert await run.result_async(timeout=10) == {"name": "held"}
    (waits, wait_sum), (took, took_sum) = _wait_and_duration(app)
    assert (waits, took) == (1, 1)
    assert wait_sum < 60 and took_sum < 60


@pytest.mark.parametrize("queue", [None, "later"])
async def test_a_claim_says_when_the_run_was_due(make_app, sql, queue):
    """``due_at``: the start a ``start_at`` held the run back to, exactly; a ``delay`` counts
    from the submission; a run submitted to start at once was due when it was submitted."""
    app, remind = _app(make_app, {})
    if queue is not None:
        app.queue(queue)
        async with app.database.connection() as conn:
            await queues_db.queue_declare(conn, [app._declared_queues[queue].row()])
    at = datetime.now(UTC) + timedelta(seconds=1)
    held = await app.submit_async(remind, {"name": "at"}, start_at=at, queue=queue)
    delayed = await app.submit_async(remind, {"name": "d"}, delay=timedelta(seconds=1),
                                     queue=queue)
    now = await app.submit_async(remind, {"name": "now"}, queue=queue)
    created = {r["id"]: r["created_at"] for r in sql(
        "SELECT id, created_at FROM orchestrator.runs")}
    claimed: dict[Any, Any] = {}

    async def claim() -> bool:
        async with app.database.connection() as conn:
            if queue is None:
                rows = await runs_db.run_claim_ready(conn, worker="w", workflows=["remind@1"],
                                                     limit=10, ttl=30)
            else:
                rows, _ = await queues_db.queue_claim(conn, queue=queue, worker="w",
                                                      workflows=["remind@1"], limit=10, ttl=30)
        claimed.update({r["id"]: r for r in rows})
        return len(claimed) == 3

    await wait_for(claim, what="the held runs to be claimed")
    assert claimed[held.id]["due_at"] == at
    assert claimed[delayed.id]["due_at"] == created[delayed.id] + timedelta(seconds=1)
    assert claimed[now.id]["due_at"] == created[now.id]


@pytest.mark.parametrize("queue", [None, "later"])
async def test_a_continuation_of_a_held_run_was_due_when_it_was_made(make_app, sql, queue):
    """A continuation carries its first generation's options, ``delay`` among them, but it
    is ready at once: it was due when it was made, not a delay after."""
    app, remind = _app(make_app, {})
    if queue is not None:
        app.queue(queue)
        async with app.database.connection() as conn:
            await queues_db.queue_declare(conn, [app._declared_queues[queue].row()])
    run = await app.submit_async(remind, {"name": "first"}, delay=timedelta(hours=1),
                                 queue=queue)
    sql("UPDATE orchestrator.runs SET created_at = created_at - interval '1 hour', "
        "available_at = available_at - interval '1 hour' WHERE id = %s", (run.id,))

    async def claim() -> list[dict[str, Any]]:
        async with app.database.connection() as conn:
            if queue is None:
                return await runs_db.run_claim_ready(
                    conn, worker="w", workflows=["remind@1"], limit=10, ttl=30)
            return (await queues_db.queue_claim(conn, queue=queue, worker="w",
                                                workflows=["remind@1"], limit=10, ttl=30))[0]

    (first,) = await claim()
    next_id = new_run_id()
    async with app.database.connection() as conn, conn.transaction():
        await chains_db.run_continue(conn, run_id=run.id, token=first["lease_token"],
                                     new_id=next_id, version="1", input_text="{}")
    info = await (await app.get_run_async(next_id)).info_async()
    assert info.status == "queued" and info.start_at is None  # not held back
    note = (await show_run(app.database, next_id)).note or ""
    assert not note.startswith("not before ")
    listed = {r["id"]: r for r in await list_runs(app.database)}
    assert not (listed[next_id]["blocked"] or "").startswith("not before ")
    (second,) = await claim()
    [made] = sql("SELECT created_at FROM orchestrator.runs WHERE id = %s", (next_id,))
    assert second["id"] == next_id and second["due_at"] == made["created_at"]


@pytest.mark.parametrize("queue", [None, "later"])
async def test_a_hold_edited_into_no_time_fails_no_claim(make_app, sql, queue):
    """When a run became due is written when it is inserted (``due_at``), not worked out
    again at every claim from its ``options``: a ``start_at`` or ``delay_seconds`` there edited
    by hand into something that is no time made every claim that picked the run fail, and the
    runs claimed with it did not start either."""
    app, remind = _app(make_app, {})
    if queue is not None:
        app.queue(queue)
        async with app.database.connection() as conn:
            await queues_db.queue_declare(conn, [app._declared_queues[queue].row()])
    at = datetime.now(UTC) + timedelta(seconds=1)
    held = await app.submit_async(remind, {"name": "at"}, start_at=at, queue=queue)
    delayed = await app.submit_async(remind, {"name": "d"}, delay=timedelta(seconds=1),
                                     queue=queue)
    other = await app.submit_async(remind, {"name": "other"}, queue=queue)
    sql("UPDATE orchestrator.runs SET options = options || '{\"start_at\": \"soon\"}' "
        "WHERE id = %s", (held.id,))
    sql("UPDATE orchestrator.runs SET options = options || '{\"delay_seconds\": \"1e999\"}' "
        "WHERE id = %s", (delayed.id,))
    created = {r["id"]: r["created_at"] for r in sql(
        "SELECT id, created_at FROM orchestrator.runs")}
    claimed: dict[Any, Any] = {}

    async def claim() -> bool:
        async with app.database.connection() as conn:
            if queue is None:
                rows = await runs_db.run_claim_ready(conn, worker="w", workflows=["remind@1"],
                                                     limit=10, ttl=30)
            else:
                rows, _ = await queues_db.queue_claim(conn, queue=queue, worker="w",
                                                      workflows=["remind@1"], limit=10, ttl=30)
        claimed.update({r["id"]: r for r in rows})
        return len(claimed) == 3

    await wait_for(claim, what="the held runs to be claimed")
    assert claimed[held.id]["due_at"] == at
    assert claimed[delayed.id]["due_at"] == created[delayed.id] + timedelta(seconds=1)
    assert claimed[other.id]["due_at"] == created[other.id]
