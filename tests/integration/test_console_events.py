"""``GET /api/runs/{id}/events``: a run's journal as Server-Sent Events from a console served by
uvicorn, while a worker in the test's event loop executes the run: a client that leaves after
entry N and comes back with ``Last-Event-ID: N`` gets N+1 … exactly once, in order; ``?after=``;
the stream ends at the run's terminal entry; heartbeats while nothing happens; 401 and 404
(out of scope exactly as missing) before any stream starts."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any

import httpx

from orchestrator import Orchestrator, records
from tests.consoletools import GRANTS, OPERATOR_HEADER, READERS, SCOPES, Served, from_header
from tests.consoletools import sse_events as events_of
from tests.integration.conftest import running, wait_for

Sql = Callable[..., list[dict[str, Any]]]


def story_app(make_app: Callable[..., Orchestrator]) -> Orchestrator:
    """``story(steps)`` publishes ``steps`` messages, waits for the event ``go`` and ends."""
    app = make_app(operator_scopes=SCOPES, incident_readers=READERS)

    @app.workflow()
    async def story(ctx, steps):  # type: ignore[no-untyped-def]
        for step in range(steps):
            ctx.publish({"step": step})
        told = await ctx.wait_for_event("go")
        ctx.publish({"told": told})
        return "told"

    return app


def client(server: Served, operator: str | None = "alice") -> httpx.AsyncClient:
    headers = {OPERATOR_HEADER: operator} if operator else {}
    return httpx.AsyncClient(base_url=server.base, headers=headers, timeout=30)


async def waiting(app: Orchestrator, sql: Sql, steps: int = 3) -> uuid.UUID:
    handle = await app.submit_async("story", steps, idempotency_key=f"story-{steps}")
    await wait_for(lambda: sql("SELECT status FROM orchestrator.runs WHERE id = %s",
                               (handle.id,)) == [{"status": "waiting"}], timeout=60)
    return handle.id


def recorded(sql: Sql, run_id: uuid.UUID) -> list[dict[str, Any]]:
    """The run's journal as the stream's records (``journal_entry``)."""
    rows = sql("SELECT * FROM orchestrator.journal WHERE run_id = %s ORDER BY seq", (run_id,))
    return [records.journal_entry(row) for row in rows]


async def test_a_client_that_leaves_after_entry_n_resumes_with_n_plus_one_exactly_once(
        make_app, sql) -> None:  # type: ignore[no-untyped-def]
    app = story_app(make_app)
    console = app.console(from_header, grants=GRANTS)
    async with running(app):
        run_id = await waiting(app, sql)
        with Served(console) as server:
            async with client(server) as http:
                url = f"/api/runs/{run_id}/events"
                seen: list[dict[str, Any]] = []
                async with http.stream("GET", url) as answer:
                    assert answer.status_code == 200
                    assert answer.headers["content-type"].startswith("text/event-stream")
                    async for event in events_of(answer):
                        seen.append(event)
                        if event["id"] == "2":
                            break  # the client leaves after entry 2
                assert [e["id"] for e in seen] == ["1", "2"]
                await app.send_event_async(run_id, "go", {"by": "test"})
                # ?after=0 is overridden by the header an EventSource sends on reconnecting.
                async with http.stream("GET", url, params={"after": 0},
                                       headers={"Last-Event-ID": "2"}) as answer:
                    assert answer.status_code == 200
                    resumed = [e async for e in events_of(answer) if "comment" not in e]
                # The stream ended by itself after the run's terminal entry.
                journal = recorded(sql, run_id)
                assert journal[-1]["kind"] == "run.completed"
                assert [e["id"] for e in resumed] == [str(e["seq"]) for e in journal[2:]]
                assert [e["event"] for e in resumed] == [e["kind"] for e in journal[2:]]
                assert [e["data"] for e in seen + resumed] == journal
                told = [e["data"]["payload"] for e in resumed if e["event"] == "message"]
                assert told[-1] == {"value": {"told": {"by": "test"}}}


async def test_after_resumes_a_finished_run_and_ends_and_past_the_end_answers_204(
        make_app, sql) -> None:  # type: ignore[no-untyped-def]
    app = story_app(make_app)
    console = app.console(from_header, grants=GRANTS)
    async with running(app):
        run_id = await waiting(app, sql, steps=2)
        await app.send_event_async(run_id, "go", 1)
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs WHERE id = %s",
                                   (run_id,)) == [{"status": "succeeded"}], timeout=60)
    journal = recorded(sql, run_id)
    with Served(console) as server:
        async with client(server) as http:
            url = f"/api/runs/{run_id}/events"
            async with http.stream("GET", url, params={"after": 3}) as answer:
                got = [e async for e in events_of(answer)]
            assert [e["data"] for e in got] == journal[3:]
            assert got[-1]["event"] == "run.completed"
            last = journal[-1]["seq"]
            for past in ({"params": {"after": last}}, {"headers": {"Last-Event-ID": str(last)}}):
                answer = await http.get(url, **past)
                assert answer.status_code == 204 and answer.content == b""
            page = await http.get(f"/runs/{run_id}")  # a finished run's timeline follows nothing
            assert page.status_code == 200 and "timeline.js" in page.text
            assert 'id="timeline"' in page.text and "data-events" not in page.text
            for bad in ({"params": {"after": "-1"}}, {"headers": {"Last-Event-ID": "x"}}):
                answer = await http.get(url, **bad)
                assert answer.status_code == 400
                assert answer.json()["code"] == "INVALID_REQUEST"


async def test_an_empty_topics_value_is_no_filter_and_empty_items_are_ignored(
        make_app, sql) -> None:  # type: ignore[no-untyped-def]
    """``?topics=`` is no filter, as every other empty filter of the API; an empty item of a
    list (``topics=progress,``) is skipped; only a name that cannot be a topic is refused."""
    app = story_app(make_app)
    console = app.console(from_header, grants=GRANTS)
    async with running(app):
        run_id = await waiting(app, sql, steps=2)
        await app.send_event_async(run_id, "go", 1)
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs WHERE id = %s",
                                   (run_id,)) == [{"status": "succeeded"}], timeout=60)
    journal = recorded(sql, run_id)
    messages = [e for e in journal if e["kind"] in ("message", "run.completed")]
    with Served(console) as server:
        async with client(server) as http:
            url = f"/api/runs/{run_id}/events"

            async def read(query: str) -> list[dict[str, Any]]:
                async with http.stream("GET", f"{url}?{query}") as answer:
                    assert answer.status_code == 200, (query, await answer.aread())
                    return [e["data"] async for e in events_of(answer)]

            for every in ("topics=", "topics=,", "topics=%20", "topics=&topics="):
                assert await read(every) == journal, every
            for some in ("topics=progress,", "topics=,progress", "topics=progress&topics=",
                         "topics=progress,,nothing"):
                assert await read(some) == messages, some
            refused = await http.get(url, params={"topics": "progress,a\tb"})
            assert refused.status_code == 400
            assert refused.json()["code"] == "INVALID_REQUEST"


async def test_heartbeats_keep_a_quiet_stream_open(make_app, sql) -> None:  # type: ignore[no-untyped-def]
    app = story_app(make_app)
    console = app.console(from_header, grants=GRANTS, heartbeat=0.2)
    async with running(app):
        run_id = await waiting(app, sql, steps=1)
        last = recorded(sql, run_id)[-1]["seq"]
        with Served(console) as server:
            async with client(server) as http:
                async with http.stream("GET", f"/api/runs/{run_id}/events",
                                       params={"after": last}) as answer:
                    assert answer.status_code == 200
                    stream = events_of(answer)
                    beats = [await asyncio.wait_for(anext(stream), 10) for _ in range(2)]
                    assert beats == [{"comment": "heartbeat"}] * 2
                    await app.send_event_async(run_id, "go", None)
                    rest = [e async for e in stream if "comment" not in e]
                assert rest[-1]["event"] == "run.completed"
                assert int(rest[0]["id"]) == last + 1


async def test_unauthenticated_is_401_and_out_of_scope_is_404_as_missing(
        make_app, sql) -> None:  # type: ignore[no-untyped-def]
    app = story_app(make_app)
    console = app.console(from_header, grants=GRANTS)
    async with running(app):
        run_id = await waiting(app, sql, steps=1)
        with Served(console) as server:
            async with client(server, None) as nobody:
                answer = await nobody.get(f"/api/runs/{run_id}/events")
                assert answer.status_code == 401
                assert answer.json()["code"] == "UNAUTHENTICATED"
            async with client(server, "bob") as bob:  # globex's operator; the run is acme's
                theirs = await bob.get(f"/api/runs/{run_id}/events")
                missing = await bob.get(f"/api/runs/{uuid.uuid4()}/events")
            assert theirs.status_code == missing.status_code == 404
            assert theirs.content == missing.content
            assert theirs.json()["code"] == "ACCESS_DENIED"
            assert theirs.headers["content-type"] == "application/json"
            async with client(server, "mallory") as stranger:  # no grant
                answer = await stranger.get(f"/api/runs/{run_id}/events")
                assert answer.status_code == 403


async def test_an_entry_newer_than_this_code_ends_the_stream_with_a_public_error(
        make_app, sql) -> None:  # type: ignore[no-untyped-def]
    app = story_app(make_app)
    console = app.console(from_header, grants=GRANTS)
    async with running(app):
        run_id = await waiting(app, sql, steps=1)
    known = recorded(sql, run_id)
    with Served(console) as server:
        async with client(server) as http:
            async with http.stream("GET", f"/api/runs/{run_id}/events") as answer:
                stream = events_of(answer)
                got = [await asyncio.wait_for(anext(stream), 10) for _ in known]
                sql("""INSERT INTO orchestrator.journal_entries (run_id, seq, kind, position, name,
                                                         schema_version, payload, lease_token)
                       SELECT id, revision + 1, 'from.the.future', 9, 'x', 99, '{}',
                              lease_token FROM orchestrator.runs WHERE id = %s""", (run_id,))
                sql("UPDATE orchestrator.runs SET revision = revision + 1 WHERE id = %s",
                    (run_id,))
                rest = [e async for e in stream]  # and the stream ends
    assert [e["data"] for e in got] == known
    assert len(rest) == 1 and rest[0]["event"] == "stream.error" and "id" not in rest[0]
    assert rest[0]["data"]["code"] == "SCHEMA_UNSUPPORTED"
    assert set(rest[0]["data"]) == {"code", "message", "retryable", "incident"}


async def test_a_cursor_past_a_running_runs_last_entry_is_a_bad_request(
        make_app, sql) -> None:  # type: ignore[no-untyped-def]
    app = story_app(make_app)
    console = app.console(from_header, grants=GRANTS, heartbeat=0.2)
    async with running(app):
        run_id = await waiting(app, sql, steps=1)
        last = recorded(sql, run_id)[-1]["seq"]
        with Served(console) as server:
            async with client(server) as http:
                url = f"/api/runs/{run_id}/events"
                for past in ({"params": {"after": last + 5}},
                             {"headers": {"Last-Event-ID": str(last + 5)}}):
                    answer = await asyncio.wait_for(http.get(url, **past), 10)
                    assert answer.status_code == 400
                    assert answer.json()["code"] == "INVALID_REQUEST"
                await app.send_event_async(run_id, "go", None)
                await wait_for(lambda: sql("SELECT status FROM orchestrator.runs WHERE id = "
                                           "%s", (run_id,)) == [{"status": "succeeded"}],
                               timeout=60)
                ended = await asyncio.wait_for(http.get(url, params={"after": last + 50}), 10)
                assert ended.status_code == 204


async def test_a_cursor_past_the_end_is_refused_naming_how_it_was_sent(
        make_app, sql) -> None:  # type: ignore[no-untyped-def]
    """The refusal of a cursor past a running run's last entry names what the client sent:
    the ``Last-Event-ID`` header (an ``EventSource``'s), or ``after``."""
    app = story_app(make_app)
    console = app.console(from_header, grants=GRANTS, heartbeat=0.2)
    async with running(app):
        run_id = await waiting(app, sql, steps=1)
        last = recorded(sql, run_id)[-1]["seq"]
        with Served(console) as server:
            async with client(server) as http:
                url = f"/api/runs/{run_id}/events"
                by_header = await asyncio.wait_for(
                    http.get(url, headers={"Last-Event-ID": str(last + 5)}), 10)
                by_query = await asyncio.wait_for(http.get(url, params={"after": last + 5}), 10)
    for answer, named in ((by_header, "Last-Event-ID"), (by_query, "after")):
        assert answer.status_code == 400
        message = answer.json()["message"]
        assert message.startswith(f"{named} {last + 5} is past the run's last entry"), message
