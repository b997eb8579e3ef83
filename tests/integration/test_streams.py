"""A run's stream (CONTRACT C14): ``handle.events(after)`` reads the journal by cursor and
follows the run live until it ends; ``topics`` keeps the workflow's own messages
(``ctx.publish``, tests/integration/test_publish.py) and the end."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import pytest

from orchestrator import (
    AccessDenied,
    InvalidRequest,
    JournalEntry,
    RunHandle,
)
from tests.integration.conftest import OTHER, running, wait_for


def _gated(app):  # type: ignore[no-untyped-def]
    """A workflow that publishes, calls a tool, then waits for the event ``go`` between
    steps, ``data["gates"]`` times: the test decides when it moves on."""

    @app.tool(effect="idempotent")
    async def work(ctx, *, step):  # type: ignore[no-untyped-def]
        return {"step": step}

    @app.workflow()
    async def gated(ctx, data):  # type: ignore[no-untyped-def]
        done = []
        for step in range(data["gates"] + 1):
            ctx.publish({"step": step})
            done.append(await ctx.call(work, step=step))
            if step < data["gates"]:
                await ctx.wait_for_event("go")
        return done

    return gated


def _status(sql, run):  # type: ignore[no-untyped-def]
    return sql("SELECT status FROM orchestrator.runs WHERE id = %s", (run.id,))[0]["status"]


@contextlib.asynccontextmanager
async def closing(app: Any) -> AsyncIterator[None]:
    """The app's pool on this loop is closed at the end (``running`` does it for tests with a
    worker), so that none is left connected when the test's database is dropped."""
    try:
        yield
    finally:
        await app.database.close()


async def _take(events: Any, count: int) -> list[JournalEntry]:
    """The next ``count`` entries of an iterator that is left open (as a client keeps its
    connection while it reads)."""
    got = []
    async for entry in events:
        got.append(entry)
        if len(got) == count:
            break
    return got


async def test_a_client_that_reconnects_with_its_cursor_gets_every_later_entry_once(app, sql):
    gated = _gated(app)
    async with running(app):
        run = await app.submit_async(gated, {"gates": 2})
        await wait_for(lambda: _status(sql, run) == "waiting")
        first = run.events()
        seen = await _take(first, 3)  # message, call.submitted, call.completed
        await first.aclose()  # the client goes away after entry N
        cursor = seen[-1].seq
        assert [e.seq for e in seen] == [1, 2, 3]
        # Meanwhile the run moves on, and the client is away for part of it.
        assert await app.send_event_async(run.id, "go", event_key="go-1")
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs WHERE id = %s AND "
                                   "status = 'waiting' AND revision > 8", (run.id,)))
        again = run.events(after=cursor)  # reconnects live, the run still unfinished
        later = await _take(again, 2)
        await again.aclose()
        cursor = later[-1].seq
        resumed = run.events(after=cursor)
        assert await app.send_event_async(run.id, "go", event_key="go-2")
        rest = [e async for e in resumed]  # follows live to the end, then stops
        journal = await run.journal_async()
    story = seen + later + rest
    assert [e.seq for e in story] == list(range(1, len(journal) + 1))  # once each, in order
    assert [e.model_dump() for e in story] == [e.model_dump() for e in journal]
    assert story[-1].kind == "run.completed"
    assert [e.payload["value"] for e in story if e.kind == "message"] == [
        {"step": 0}, {"step": 1}, {"step": 2}]


async def test_following_ends_after_the_terminal_entry_and_follow_false_does_not_wait(
        app, sql):
    gated = _gated(app)
    async with running(app):
        run = await app.submit_async(gated, {"gates": 1})
        await wait_for(lambda: _status(sql, run) == "waiting")
        now = [e async for e in run.events(follow=False)]  # what exists, without waiting
        assert [e.kind for e in now] == ["message", "call.submitted", "call.completed",
                                         "event.wait"]
        assert [e.kind for e in await asyncio.to_thread(
            lambda: list(run.events_sync(after=2, follow=False)))] == [
            "call.completed", "event.wait"]
        following = asyncio.ensure_future(_all(run.events(after=4)))
        await asyncio.sleep(0.3)
        assert not following.done()  # it follows: waits for what comes next
        await app.send_event_async(run.id, "go")
        rest = await asyncio.wait_for(following, 15)
        end = rest[-1].seq
        assert [e async for e in run.events(after=end)] == []  # ended before it: no wait
        assert [e.seq async for e in run.events(after=end - 1)] == [end]
    assert [e.kind for e in rest] == ["event.received", "message", "call.submitted",
                                      "call.completed", "run.completed"]
    assert isinstance(rest[0].at, datetime) and rest[0].at == rest[0].created_at


async def _all(events: Any) -> list[Any]:
    return [e async for e in events]


async def test_a_failed_or_cancelled_run_ends_its_stream_too(app, sql):
    @app.workflow()
    async def fails(ctx, data):  # type: ignore[no-untyped-def]
        ctx.publish("about to fail")
        await ctx.wait_for_event("go")
        raise RuntimeError("boom")

    async with running(app):
        failing = await app.submit_async(fails, {})
        cancelled = await app.submit_async(fails, {})
        await wait_for(lambda: _status(sql, failing) == _status(sql, cancelled) == "waiting")
        streams = [asyncio.ensure_future(_all(r.events())) for r in (failing, cancelled)]
        await app.send_event_async(failing.id, "go")
        await cancelled.cancel_async()
        told = await asyncio.wait_for(asyncio.gather(*streams), 15)
    assert [e.kind for e in told[0]][-1] == "run.failed"
    assert [e.kind for e in told[1]] == ["message", "event.wait", "run.cancelled"]


async def test_a_cursor_that_is_not_a_seq_is_refused_before_anything_is_read(app):
    @app.workflow()
    async def noop(ctx, data):  # type: ignore[no-untyped-def]
        return None

    async with closing(app):
        run = await app.submit_async(noop, {})
    for bad in (-1, "3", 1.5, True, None):
        with pytest.raises(InvalidRequest) as refused:
            run.events(bad)  # type: ignore[arg-type]
        assert refused.value.code == "INVALID_REQUEST" and refused.value.path == "after"
        with pytest.raises(InvalidRequest):
            run.events_sync(bad)  # type: ignore[arg-type]
    for topics in ("progress", [], [""], ["a\x00b"], [" padded"]):
        with pytest.raises(InvalidRequest):
            run.events(topics=topics)  # type: ignore[arg-type]


async def test_another_owners_run_is_denied_like_a_missing_one(app):
    @app.workflow()
    async def noop(ctx, data):  # type: ignore[no-untyped-def]
        return None

    async with closing(app):
        run = await app.submit_async(noop, {})
        theirs = RunHandle(app, run.id, OTHER)
        missing = RunHandle(app, uuid.uuid4(), run.owner)
        answers = []
        for handle in (theirs, missing):
            for follow in (True, False):
                with pytest.raises(AccessDenied) as denied:
                    await _all(handle.events(follow=follow))
                answers.append(str(denied.value))
            with pytest.raises(AccessDenied):
                await asyncio.to_thread(lambda h=handle: list(h.events_sync()))
    assert len(set(answers)) == 1  # the same answer for both


async def test_topics_keep_only_those_messages_and_the_end(app, sql):
    @app.tool()
    async def work(ctx):  # type: ignore[no-untyped-def]
        return "ok"

    @app.workflow()
    async def chatty(ctx, data):  # type: ignore[no-untyped-def]
        ctx.publish(1)
        ctx.publish("noise", topic="debug")
        await ctx.call(work)
        await ctx.wait_for_event("go")
        ctx.publish(2)
        ctx.publish(3, topic="milestones")
        return "done"

    async with running(app):
        run = await app.submit_async(chatty, {})
        await wait_for(lambda: _status(sql, run) == "waiting")
        following = asyncio.ensure_future(_all(run.events(topics=["progress", "milestones"])))
        await app.send_event_async(run.id, "go")
        live = await asyncio.wait_for(following, 15)
        # The cursor stays the seq: resuming after a message skips only what is before it.
        after_first = [e.payload.get("value") async for e in run.events(
            after=live[0].seq, topics=["progress"], follow=False)]
    assert [(e.kind, e.name, e.payload.get("value")) for e in live] == [
        ("message", "progress", 1), ("message", "progress", 2),
        ("message", "milestones", 3), ("run.completed", None, None)]
    assert after_first == [2, None]


async def test_events_sync_follows_a_run_live_from_a_thread(app, sql):
    gated = _gated(app)
    async with running(app):
        run = await app.submit_async(gated, {"gates": 1})
        await wait_for(lambda: _status(sql, run) == "waiting")
        reading = asyncio.ensure_future(asyncio.to_thread(lambda: list(run.events_sync())))
        await asyncio.sleep(0.3)
        assert not reading.done()
        await app.send_event_async(run.id, "go")
        got = await asyncio.wait_for(reading, 15)

        def first_then_close() -> int:  # a sync reader that stops early
            stopped = run.events_sync(after=1)
            first = next(stopped).seq
            stopped.close()  # type: ignore[attr-defined]
            return first

        assert await asyncio.to_thread(first_then_close) == 2
        journal = await run.journal_async()
    assert [e.seq for e in got] == list(range(1, len(journal) + 1))
    assert got[-1].kind == "run.completed"


async def test_many_followers_of_many_runs_each_get_their_own_story(app, sql):
    gated = _gated(app)
    async with running(app):
        runs = [await app.submit_async(gated, {"gates": 1}) for _ in range(5)]
        await wait_for(lambda: all(_status(sql, r) == "waiting" for r in runs))
        followers = [asyncio.ensure_future(_all(r.events())) for r in runs for _ in range(4)]
        await asyncio.sleep(0.2)
        for r in runs:
            await app.send_event_async(r.id, "go")
        told = await asyncio.wait_for(asyncio.gather(*followers), 30)
        journals = [[e.model_dump() for e in await r.journal_async()] for r in runs]
    for index, story in enumerate(told):
        assert [e.model_dump() for e in story] == journals[index // 4]


async def test_followers_in_one_loop_share_the_polls_and_the_reads(app, sql, monkeypatch):
    """Twenty followers of five waiting runs cost one poll statement per pause, not one per
    follower; when a run moves, its eight followers read each new page once; and the poller
    stops when nobody follows."""
    from orchestrator import stream

    counted = {"polls": 0, "pages": 0}
    poll, page = stream.journal_db.journal_poll, stream.journal_db.journal_read_after

    async def counting_poll(conn, afters, **options):  # type: ignore[no-untyped-def]
        counted["polls"] += len(afters) > 0
        return await poll(conn, afters, **options)

    async def counting_page(conn, run_id, **options):  # type: ignore[no-untyped-def]
        counted["pages"] += 1
        return await page(conn, run_id, **options)

    gated = _gated(app)
    async with running(app):
        runs = [await app.submit_async(gated, {"gates": 1}) for _ in range(5)]
        await wait_for(lambda: all(_status(sql, r) == "waiting" for r in runs))
        monkeypatch.setattr(stream.journal_db, "journal_poll", counting_poll)
        monkeypatch.setattr(stream.journal_db, "journal_read_after", counting_page)
        followers = [asyncio.ensure_future(_all(r.events(after=4)))
                     for r in runs for _ in range(8 if r is runs[0] else 3)]
        poller = app._streams._poller()
        await wait_for(lambda: sum(len(w) for w in poller.waiting.values()) == 20)
        counted.update(polls=0, pages=0)
        await asyncio.sleep(1.0)
        assert counted["pages"] == 0  # nothing moved: nobody read
        assert counted["polls"] <= 1.0 / stream.POLL_INTERVAL + 2  # one statement per pause
        await app.send_event_async(runs[0].id, "go")
        told = await asyncio.wait_for(asyncio.gather(*followers[:8]), 15)
        assert all(story == told[0] for story in told) and len(told[0]) == 5
        # Five entries, so at most five rounds; in each the eight followers read once.
        assert counted["pages"] <= 5
        for r in runs[1:]:
            await app.send_event_async(r.id, "go")
        await asyncio.wait_for(asyncio.gather(*followers[8:]), 15)
        await wait_for(lambda: poller._task is None, what="the poller to stop")


async def test_woken_followers_take_the_entries_the_poll_read_once_each_and_in_order(
        app, sql, monkeypatch):
    """Followers at different cursors, some with topics, of runs that move several times:
    once they wait, the poll reads the new entries of the runs that moved (one statement for
    all of them) and hands each follower those after its own cursor, so no follower reads a
    page of its own; and each still gets exactly its story, once, in order."""
    from orchestrator import stream

    counted = {"pages": 0, "many": 0}
    page, poll = stream.journal_db.journal_read_after, stream.journal_db.journal_poll

    async def counting_page(conn, run_id, **options):  # type: ignore[no-untyped-def]
        counted["pages"] += 1
        return await page(conn, run_id, **options)

    async def counting_poll(conn, afters, **options):  # type: ignore[no-untyped-def]
        found = await poll(conn, afters, **options)
        counted["many"] += bool(found[1])  # a poll that read entries for its followers
        return found

    gated = _gated(app)
    cursors = [(0, None), (2, None), (3, ("progress",)), (0, ("progress",))]
    async with running(app):
        runs = [await app.submit_async(gated, {"gates": 3}) for _ in range(3)]
        await wait_for(lambda: all(_status(sql, r) == "waiting" for r in runs))
        monkeypatch.setattr(stream.journal_db, "journal_read_after", counting_page)
        monkeypatch.setattr(stream.journal_db, "journal_poll", counting_poll)
        followers = [asyncio.ensure_future(_all(r.events(after=after, topics=topics)))
                     for r in runs for after, topics in cursors]
        poller = app._streams._poller()
        await wait_for(lambda: sum(len(w) for w in poller.waiting.values()) == len(followers))
        counted.update(pages=0, many=0)
        for _ in range(3):
            for r in runs:
                await app.send_event_async(r.id, "go")
            await wait_for(lambda: sum(len(w) for w in poller.waiting.values()) in (
                0, len(followers)))
        told = await asyncio.wait_for(asyncio.gather(*followers), 30)
        journals = [[e.model_dump() for e in await r.journal_async()] for r in runs]
    assert counted["many"] >= 1 and counted["pages"] == 0
    for index, story in enumerate(told):
        after, topics = cursors[index % len(cursors)]
        expected = [e for e in journals[index // len(cursors)] if e["seq"] > after
                    and (topics is None or e["kind"] in ("run.completed", "run.failed",
                                                         "run.cancelled")
                         or (e["kind"] == "message" and e["name"] in topics))]
        assert [e.model_dump() for e in story] == expected
        assert expected[-1]["kind"] == "run.completed"


async def test_the_poll_answers_only_the_runs_that_moved_and_those_that_are_gone(app, sql):
    """One statement for every followed run: a run at its cursor is absent from the answer,
    a run past it comes with its revision, status and the entries after the cursor (at most
    the limit), and a run that does not exist comes as None."""
    from orchestrator.db import journal as journal_db

    gated = _gated(app)
    async with running(app):
        runs = [await app.submit_async(gated, {"gates": 1}) for _ in range(2)]
        await wait_for(lambda: all(_status(sql, r) == "waiting" for r in runs))
        quiet, moved = runs
        last = {r.id: sql("SELECT revision FROM orchestrator.runs WHERE id = %s",
                          (r.id,))[0]["revision"] for r in runs}
        gone = uuid.uuid4()
        afters = {quiet.id: last[quiet.id], moved.id: last[moved.id] - 3, gone: 0}
        revisions, entries = await app.database.read(
            lambda conn: journal_db.journal_poll(conn, afters, limit=2))
    assert revisions == {moved.id: {"revision": last[moved.id], "status": "waiting"},
                         gone: None}
    assert [e["seq"] for e in entries[moved.id]] == [last[moved.id] - 2, last[moved.id] - 1]
    assert set(entries) == {moved.id}
