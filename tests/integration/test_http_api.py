"""The submitters' HTTP API (``app.console(authenticate_owner=...)``), driven by a plain HTTP
client against a console served by uvicorn while a worker executes the runs: submission with
``Idempotency-Key`` as C1 says, the result's long poll, events, cancellation, the run's stream,
the public error as every error's body, and another owner's run answering as a missing one."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest

from orchestrator import InvalidRequest, Orchestrator, Owner, ToolError
from orchestrator.db import runs as runs_db
from orchestrator.waiting import BUSY_PAUSE, FEW
from tests.consoletools import GRANTS, OPERATOR_HEADER, SCOPES, SECRET, Served, from_header
from tests.consoletools import sse_events as events_of
from tests.integration.conftest import running, wait_for

Sql = Callable[..., list[dict[str, Any]]]

KEY_HEADER = "X-Api-Key"
OWNERS = {"key-acme-alice": Owner(tenant="acme", principal="alice"),
          "key-globex-bob": Owner(tenant="globex", principal="bob")}
PUBLIC = {"code", "message", "retryable", "incident"}


def owner_of(request: Any) -> Owner | None:
    """The host's owner hook in these tests: an API key in a header."""
    return OWNERS.get(request.headers.get(KEY_HEADER, ""))


def http_app(make_app: Callable[..., Orchestrator]) -> Orchestrator:
    app = make_app(operator_scopes=SCOPES)

    @app.workflow(version="1")
    async def approve(ctx, order):  # type: ignore[no-untyped-def]
        ctx.publish({"asked": order["customer"]})
        answer = await ctx.wait_for_event("approval")
        return {"order": order, "answer": answer, "version": "1"}

    @app.workflow(version="2", name="approve")
    async def approve_v2(ctx, order):  # type: ignore[no-untyped-def]
        return {"version": "2"}

    @app.tool()
    async def leaky(ctx):  # type: ignore[no-untyped-def]
        raise ToolError.from_status(400, f"upstream said {SECRET}")

    @app.workflow()
    async def fails(ctx, _):  # type: ignore[no-untyped-def]
        return await ctx.call(leaky)

    return app


def client(server: Served, key: str | None = "key-acme-alice") -> httpx.AsyncClient:
    headers = {KEY_HEADER: key} if key else {}
    return httpx.AsyncClient(base_url=server.base, headers=headers, timeout=60)


def run_count(sql: Sql) -> int:
    return int(sql("SELECT count(*) AS n FROM orchestrator.runs")[0]["n"])


async def test_a_submission_key_follows_c1_over_http(make_app, sql) -> None:  # type: ignore[no-untyped-def]
    app = http_app(make_app)
    console = app.console(from_header, GRANTS, authenticate_owner=owner_of)
    order = {"customer": "c1", "cents": 500}
    with Served(console) as server:
        async with client(server) as http:
            first = await http.post("/api/runs", json={"workflow": "approve", "version": "1",
                                                       "input": order},
                                    headers={"Idempotency-Key": "order-1"})
            assert first.status_code == 201, first.text
            run = first.json()
            assert run["status"] == "queued" and run["workflow"] == "approve"
            assert (run["tenant"], run["principal"], run["version"]) == ("acme", "alice", "1")
            assert first.headers["location"] == f"/api/runs/{run['id']}"
            assert "idempotent-replayed" not in first.headers

            # The same key and request (keys in another order): the same run, nothing new.
            again = await http.post("/api/runs", headers={"Idempotency-Key": "order-1"},
                                    json={"input": {"cents": 500, "customer": "c1"},
                                          "version": "1", "workflow": "approve"})
            assert again.status_code == 200, again.text
            assert again.json()["id"] == run["id"]
            assert again.headers["idempotent-replayed"] == "true"

            # The same key with another request: 409 and the public error.
            other = await http.post("/api/runs", headers={"Idempotency-Key": "order-1"},
                                    json={"workflow": "approve", "version": "1",
                                          "input": {**order, "cents": 501}})
            assert other.status_code == 409
            assert set(other.json()) == PUBLIC
            assert other.json()["code"] == "IDEMPOTENCY_CONFLICT"

            # Another owner's key is another key (C1: keys are scoped by owner).
            async with client(server, "key-globex-bob") as bob:
                theirs = await bob.post("/api/runs", headers={"Idempotency-Key": "order-1"},
                                        json={"workflow": "approve", "input": order})
                assert theirs.status_code == 201 and theirs.json()["id"] != run["id"]
                assert theirs.json()["version"] == "2"  # no version: the newest

            mine = (await http.get("/api/runs")).json()
            assert [r["id"] for r in mine["runs"]] == [run["id"]] and mine["count"] == 1
            assert (await http.get("/api/runs", params={"status": "succeeded"})).json() == {
                "runs": [], "count": 0, "next": None}
            assert (await http.get("/api/runs", params={"limit": "0"})).status_code == 400

            before = run_count(sql)
            refused = {
                "malformed key": await http.post(
                    "/api/runs", json={"workflow": "approve", "input": order},
                    headers={"Idempotency-Key": "has space"}),
                "unknown workflow": await http.post(
                    "/api/runs", json={"workflow": "nope", "input": order}),
                "unknown version": await http.post(
                    "/api/runs", json={"workflow": "approve", "version": "9", "input": 1}),
                "unknown field": await http.post(
                    "/api/runs", json={"workflow": "approve", "input": 1, "urgency": 1}),
                "bad deadline": await http.post(
                    "/api/runs", json={"workflow": "approve", "input": 1, "deadline": -1}),
                "not JSON": await http.post(
                    "/api/runs", content=b'{"workflow": "approve"}',
                    headers={"Content-Type": "text/plain"}),
                "not an object": await http.post("/api/runs", json=[1]),
            }
            for what, answer in refused.items():
                assert answer.status_code == 400, (what, answer.text)
                assert PUBLIC <= set(answer.json()) <= PUBLIC | {"path"}, what
            assert refused["unknown field"].json()["path"] == "body"
            assert refused["bad deadline"].json()["path"] == "deadline"
            assert refused["malformed key"].json()["code"] == "INVALID_REQUEST"
            assert refused["unknown workflow"].json()["code"] == "UNKNOWN_WORKFLOW"
            assert refused["unknown version"].json()["code"] == "UNKNOWN_WORKFLOW"
            assert run_count(sql) == before  # nothing was written

        async with client(server, key=None) as nobody:
            answer = await nobody.post("/api/runs", json={"workflow": "approve", "input": 1})
            assert answer.status_code == 401
            assert answer.json()["code"] == "UNAUTHENTICATED"
        async with client(server, key="not-a-key") as stranger:
            answer = await stranger.get(f"/api/runs/{run['id']}/result")
            assert answer.status_code == 401
    assert run_count(sql) == before


async def test_the_result_is_long_polled_events_delivered_once_and_the_stream_resumes(
        make_app, sql) -> None:  # type: ignore[no-untyped-def]
    app = http_app(make_app)
    console = app.console(from_header, GRANTS, authenticate_owner=owner_of, heartbeat=0.5)
    async with running(app):
        with Served(console) as server:
            async with client(server) as http:
                answer = await http.post("/api/runs", json={
                    "workflow": "approve", "version": "1", "input": {"customer": "c7"},
                    "deadline": 3600})
                assert answer.status_code == 201
                run = answer.json()
                assert run["deadline_at"] is not None
                path = f"/api/runs/{run['id']}"

                waited = await http.get(f"{path}/result", params={"wait": "0.3"})
                assert waited.status_code == 202
                assert waited.json()["done"] is False
                assert waited.json()["status"] in ("queued", "running", "waiting")

                status = await http.get(path)
                assert status.status_code == 200 and status.json()["id"] == run["id"]
                assert "lease_owner" not in status.json()  # the owner's view, not an operator's

                # The stream from the start: the workflow's message, then the wait.
                async with http.stream("GET", f"{path}/events",
                                       params={"topics": "progress"}) as stream:
                    assert stream.status_code == 200
                    async for event in events_of(stream):
                        if "comment" in event:
                            continue
                        assert event["event"] == "message"
                        assert event["data"]["name"] == "progress"
                        assert event["data"]["payload"]["value"] == {"asked": "c7"}
                        first_seen = int(event["id"])
                        break

                sent = await http.post(f"{path}/events/approval", json={"payload": {"ok": True}},
                                       headers={"Idempotency-Key": "appr-1"})
                assert sent.status_code == 200, sent.text
                assert sent.json()["delivered"] is True
                repeat = await http.post(f"{path}/events/approval",
                                         json={"payload": {"ok": True}, "event_key": "appr-1"})
                assert repeat.status_code == 200, repeat.text
                assert repeat.json()["delivered"] is False
                reused = await http.post(f"{path}/events/approval",
                                         json={"payload": {"ok": False}, "event_key": "appr-1"})
                assert reused.status_code == 409, reused.text
                assert reused.json()["code"] == "IDEMPOTENCY_CONFLICT"

                done = await http.get(f"{path}/result", params={"wait": "30"})
                assert done.status_code == 200, done.text
                body = done.json()
                assert body["done"] is True and body["status"] == "succeeded"
                assert body["result"]["answer"] == {"ok": True}
                assert body["error"] is None

                # Resumed after the first entry seen: every later one once, in order.
                async with http.stream("GET", f"{path}/events",
                                       headers={"Last-Event-ID": str(first_seen)}) as stream:
                    ids = [int(e["id"]) async for e in events_of(stream) if "id" in e]
                recorded = [r["seq"] for r in sql(
                    "SELECT seq FROM orchestrator.journal WHERE run_id = %s AND seq > %s "
                    "ORDER BY seq", (run["id"], first_seen))]
                assert ids == recorded and ids[-1] == recorded[-1]
                ended = await http.get(f"{path}/events",
                                       headers={"Last-Event-ID": str(recorded[-1])})
                assert ended.status_code == 204

                # Reading the result again changes nothing and answers the same.
                again = await http.get(f"{path}/result")
                assert again.json() == body


async def test_long_polls_share_one_statement_per_poll_and_each_gets_its_own_answer(
        make_app, sql, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Requests waiting for their runs' results cost the database one statement per poll
    that asks about all of them (orchestrator.waiting), not a read per request per pause (20
    requests used to be about 80 statements a second); each request still reads its own run
    once when it arrives and once when it ended, and gets that run's answer."""
    app = http_app(make_app)
    console = app.console(from_header, GRANTS, authenticate_owner=owner_of)
    asked: list[int] = []  # how many runs each poll asked about
    reads: list[object] = []  # the requests' own reads of a run
    real_finished, real_row = runs_db.run_finished, Orchestrator._row

    async def finished_spy(conn, runs):  # type: ignore[no-untyped-def]
        asked.append(len(runs))
        return await real_finished(conn, runs)

    async def row_spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        reads.append(args[0])
        return await real_row(self, *args, **kwargs)

    n = 20
    loop = asyncio.get_running_loop()
    async with running(app, concurrency=n + 5):
        with Served(console) as server:
            async with client(server) as http:
                made = [(await http.post("/api/runs", json={
                    "workflow": "approve", "version": "1", "input": {"customer": f"c{i}"}}
                                         )).json()["id"] for i in range(n)]
                await wait_for(lambda: sql("SELECT count(*) AS n FROM orchestrator.runs "
                                           "WHERE status = 'waiting'")[0]["n"] == n, 30)
                monkeypatch.setattr(runs_db, "run_finished", finished_spy)
                monkeypatch.setattr(Orchestrator, "_row", row_spy)
                began = loop.time()
                waits = [asyncio.ensure_future(http.get(f"/api/runs/{run}/result",
                                                        params={"wait": "30"}))
                         for run in made]
                await wait_for(lambda: asked.count(n) >= 6, 30)  # all of them, six times over
                elapsed = loop.time() - began
                # Each request read its run twice when it arrived (the owner's check, then
                # the run's state) and not since, however many polls went by.
                assert len(reads) == 2 * n, len(reads)
                assert n > FEW  # (so many runs awaited: a poll every BUSY_PAUSE at most)
                assert len(asked) <= elapsed / BUSY_PAUSE + 1  # the pace is the poller's
                assert not any(w.done() for w in waits)
                for run in made:
                    sent = await http.post(f"/api/runs/{run}/events/approval",
                                           json={"payload": {"ok": run}})
                    assert sent.status_code == 200, sent.text
                answers = await asyncio.gather(*waits)
    for run, answer in zip(made, answers, strict=True):
        assert answer.status_code == 200, answer.text
        body = answer.json()
        assert body["run_id"] == run and body["done"] is True
        assert body["status"] == "succeeded" and body["result"]["answer"] == {"ok": run}
    assert len(reads) <= 3 * n  # and once more when it ended
    assert max(asked) == n and all(size <= n for size in asked)


def _waiting(app: Orchestrator) -> int:
    """The result waits under way in every event loop (the console's is another thread's)."""
    return sum(len(waiters) for poller in list(app._waits._pollers.values())
               for waiters in list(poller.waiting.values()))


async def test_a_long_poll_whose_client_left_stops_waiting(make_app, sql) -> None:  # type: ignore[no-untyped-def]
    """A client that gives up on a long poll (closes its connection) ends the wait there and
    then, not after ``wait`` seconds: the server neither waits nor polls for it any more.
    Nothing changes."""
    app = http_app(make_app)
    console = app.console(from_header, GRANTS, authenticate_owner=owner_of)
    with Served(console) as server:  # no worker: the run stays queued
        async with client(server) as http:
            run = (await http.post("/api/runs", json={
                "workflow": "approve", "version": "1", "input": {"customer": "c9"}})).json()
            leaving = asyncio.ensure_future(http.get(f"/api/runs/{run['id']}/result",
                                                     params={"wait": "60"}))
            await wait_for(lambda: _waiting(app) == 1, 10, "the long poll waits")
            leaving.cancel()  # the client closes the connection
            with contextlib.suppress(asyncio.CancelledError):
                await leaving
            await wait_for(lambda: _waiting(app) == 0, 10, "the wait ended with its client")
            still = await http.get(f"/api/runs/{run['id']}/result", params={"wait": "0.1"})
            assert still.status_code == 202 and still.json()["status"] == "queued"
    assert sql("SELECT status FROM orchestrator.runs") == [{"status": "queued"}]


async def test_another_owners_run_answers_as_a_missing_one(make_app, sql) -> None:  # type: ignore[no-untyped-def]
    app = http_app(make_app)
    console = app.console(from_header, GRANTS, authenticate_owner=owner_of)
    with Served(console) as server:
        async with client(server) as alice, client(server, "key-globex-bob") as bob:
            made = await alice.post("/api/runs", json={"workflow": "approve", "version": "1",
                                                       "input": {"customer": "c1"}})
            mine = made.json()["id"]
            missing = str(uuid.uuid4())
            for method, suffix, body in [("GET", "", None), ("GET", "/result", None),
                                         ("GET", "/events", None),
                                         ("POST", "/events/approval", {"payload": 1}),
                                         ("POST", "/cancel", {})]:
                answers = [await bob.request(method, f"/api/runs/{run}{suffix}", json=body)
                           for run in (mine, missing)]
                assert [a.status_code for a in answers] == [404, 404], (suffix, answers)
                assert answers[0].content == answers[1].content, suffix
                assert answers[0].json()["code"] == "ACCESS_DENIED"
            # Nothing bob did touched alice's run.
            assert sql("SELECT status, cancel_requested_at FROM orchestrator.runs WHERE id = %s",
                       (mine,)) == [{"status": "queued", "cancel_requested_at": None}]
            assert sql("SELECT count(*) AS n FROM orchestrator.external_events") == [{"n": 0}]


async def test_an_owner_cancels_and_a_failure_is_the_public_error(make_app, sql) -> None:  # type: ignore[no-untyped-def]
    app = http_app(make_app)
    console = app.console(from_header, GRANTS, authenticate_owner=owner_of)
    async with running(app):
        with Served(console) as server:
            async with client(server) as http:
                made = await http.post("/api/runs", json={"workflow": "approve", "version": "1",
                                                          "input": {"customer": "c2"}})
                path = f"/api/runs/{made.json()['id']}"
                forged = await http.post(f"{path}/cancel", content=b"",
                                         headers={"Content-Type": "text/plain"})
                assert forged.status_code == 400  # not JSON: what a cross-site form sends
                cancelled = await http.post(f"{path}/cancel", json={})
                assert cancelled.status_code == 200, cancelled.text
                assert cancelled.json()["status"] in ("cancelled", "running", "queued",
                                                      "waiting")
                outcome = (await http.get(f"{path}/result", params={"wait": "30"})).json()
                assert outcome["done"] is True and outcome["status"] == "cancelled"
                assert outcome["error"]["code"] == "CANCELLED"

                failing = await http.post("/api/runs", json={"workflow": "fails"})
                path = f"/api/runs/{failing.json()['id']}"
                outcome = (await http.get(f"{path}/result", params={"wait": "30"})).json()
                assert outcome["status"] == "failed"
                error = outcome["error"]
                assert error["code"] == "WORKFLOW_FAILED"
                assert error["cause"]["code"] == "TOOL_FAILED"
                assert error["incident"]
                shown = (await http.get(path)).text + str(outcome)
                assert SECRET not in shown


async def test_without_an_owner_the_shared_paths_are_the_operators(make_app, sql) -> None:  # type: ignore[no-untyped-def]
    app = http_app(make_app)
    console = app.console(from_header, GRANTS, authenticate_owner=owner_of)
    with Served(console) as server:
        async with client(server) as http:
            made = (await http.post("/api/runs", json={"workflow": "approve", "version": "1",
                                                       "input": {"customer": "c3"}})).json()
        async with httpx.AsyncClient(base_url=server.base, timeout=30,
                                     headers={OPERATOR_HEADER: "alice"}) as operator:
            shown = await operator.get(f"/api/runs/{made['id']}")
            assert shown.status_code == 200
            assert shown.json()["run"]["lease_owner"] is None  # the operator's document
            refused = await operator.post(f"/api/runs/{made['id']}/cancel",
                                          json={"evidence": "x"})
            assert refused.status_code == 403  # the operators' form: a CSRF token first
            nothing = await operator.get(f"/api/runs/{made['id']}/result")
            assert nothing.status_code == 401  # the submitters' alone: no owner


async def test_without_the_hook_there_is_no_submitters_api(make_app, sql) -> None:  # type: ignore[no-untyped-def]
    app = http_app(make_app)
    console = app.console(from_header, GRANTS)
    with Served(console) as server:
        async with client(server) as http:
            answer = await http.post("/api/runs", json={"workflow": "approve", "input": 1})
            assert answer.status_code == 405
            assert run_count(sql) == 0


async def test_a_full_event_backlog_is_429_and_stores_nothing(make_app, sql) -> None:  # type: ignore[no-untyped-def]
    app = http_app(make_app)
    app.max_pending_events = 1
    console = app.console(authenticate_owner=owner_of)
    with Served(console) as server:
        async with client(server) as http:
            run = (await http.post("/api/runs", json={"workflow": "approve", "version": "1",
                                                      "input": {"customer": "c4"}})).json()
            path = f"/api/runs/{run['id']}/events/approval"
            assert (await http.post(path, json={"payload": 1})).json()["delivered"] is True
            full = await http.post(path, json={"payload": 2})
            assert full.status_code == 429 and full.json()["code"] == "EVENT_BACKLOG_FULL"
            assert sql("SELECT count(*) AS n FROM orchestrator.external_events") == [{"n": 1}]
            # With no way for operators in, the operators' pages and API answer 401.
            assert (await http.get("/api/overview")).status_code == 401


async def test_a_malformed_idempotency_key_header_is_named_as_the_header(make_app, sql) -> None:  # type: ignore[no-untyped-def]
    """A refusal names what the client sent: the ``Idempotency-Key`` header, not the Python
    argument or the body field it stands for."""
    app = http_app(make_app)
    console = app.console(authenticate_owner=owner_of)
    with Served(console) as server:
        async with client(server) as http:
            run = (await http.post("/api/runs", json={"workflow": "approve", "version": "1",
                                                      "input": {"customer": "c5"}})).json()
            path = f"/api/runs/{run['id']}/events/approval"
            refused = {
                "run": await http.post("/api/runs", headers={"Idempotency-Key": "has space"},
                                       json={"workflow": "approve", "input": 1}),
                "event": await http.post(path, json={"payload": 1},
                                         headers={"Idempotency-Key": "has space"}),
                "event_key": await http.post(path, json={"payload": 1,
                                                         "event_key": "has space"}),
            }
            for what, answer in refused.items():
                assert answer.status_code == 400, what
                assert answer.json()["code"] == "INVALID_REQUEST", what
            for what in ("run", "event"):
                message = refused[what].json()["message"]
                assert message.startswith("Idempotency-Key must be"), (what, message)
            assert refused["event_key"].json()["message"].startswith("event_key must be")
            # The bad field is named in the body, not only in the message.
            assert refused["event_key"].json()["path"] == "event_key"
            assert {refused[what].json()["path"] for what in ("run", "event")} == {
                "Idempotency-Key"}
            unknown = await http.post("/api/runs", json={"workflow": "approve", "input": 1,
                                                         "colour\u0000<b>": "red"})
            assert unknown.status_code == 400
            assert unknown.json()["path"] == "body"  # never the caller's own text
    assert run_count(sql) == 1
    assert sql("SELECT count(*) AS n FROM orchestrator.external_events") == [{"n": 0}]


async def test_an_owner_hook_that_answers_something_else_is_the_hosts_error(make_app) -> None:  # type: ignore[no-untyped-def]
    app = http_app(make_app)

    async def confused(request: Any) -> Any:
        return "acme/alice"  # a name, not an Owner

    console = app.console(authenticate_owner=confused)
    transport = httpx.ASGITransport(app=console)
    async with httpx.AsyncClient(transport=transport, base_url="http://api.test") as http:
        answer = await http.post("/api/runs", json={"workflow": "approve", "input": 1})
    assert answer.status_code == 500
    assert answer.json()["code"] == "CONFIGURATION_ERROR"
    assert "acme/alice" not in answer.text
    await app.database.close()


async def test_a_body_that_names_a_field_twice_is_refused_and_stores_nothing(
        make_app, sql) -> None:  # type: ignore[no-untyped-def]
    app = http_app(make_app)
    console = app.console(authenticate_owner=owner_of)
    headers = {"Content-Type": "application/json"}
    with Served(console) as server:
        async with client(server) as http:
            twice = {
                "input key": b'{"workflow": "approve", "version": "1", '
                             b'"input": {"customer": "c1", "customer": "c2"}}',
                "body field": b'{"workflow": "approve", "workflow": "fails", "input": 1}',
            }
            for what, body in twice.items():
                answer = await http.post("/api/runs", content=body, headers=headers)
                assert answer.status_code == 400, (what, answer.text)
                assert answer.json()["code"] == "INVALID_REQUEST", what
            assert run_count(sql) == 0


async def test_a_deadline_the_database_cannot_store_is_400_and_stores_nothing(
        make_app, sql) -> None:  # type: ignore[no-untyped-def]
    app = http_app(make_app)
    console = app.console(authenticate_owner=owner_of)
    with Served(console) as server:
        async with client(server) as http:
            answer = await http.post("/api/runs", json={"workflow": "approve", "version": "1",
                                                        "input": 1, "deadline": 1e13})
            assert answer.status_code == 400, answer.text
            assert answer.json()["code"] == "INVALID_REQUEST"
            assert answer.json()["path"] == "deadline"
            assert run_count(sql) == 0


async def test_an_owner_pages_through_all_of_their_runs_by_the_next_cursor(
        make_app, sql) -> None:  # type: ignore[no-untyped-def]
    """``GET /api/runs`` answers a page and the cursor of the next (``next``, null on the
    last): an owner reaches every run of theirs, not only the newest ``limit``, each once;
    ``app.list_runs(before=...)`` takes the same cursor, ``RunInfo.cursor``."""
    app = http_app(make_app)
    alice = OWNERS["key-acme-alice"]
    for n in range(5):
        await app.submit_async("approve", {"customer": f"c{n}"}, version="1", owner=alice)
    await app.submit_async("approve", {"customer": "b"}, version="1",
                           owner=OWNERS["key-globex-bob"])
    expected = [str(r["id"]) for r in sql(
        "SELECT id FROM orchestrator.runs WHERE tenant = 'acme' "
        "ORDER BY created_at DESC, id DESC")]
    console = app.console(from_header, GRANTS, authenticate_owner=owner_of)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=console),
                                 base_url="http://console.test",
                                 headers={KEY_HEADER: "key-acme-alice"}) as http:
        pages, cursor = [], None
        while True:
            url = "/api/runs?limit=2" + (f"&before={cursor}" if cursor else "")
            answer = await http.get(url)
            assert answer.status_code == 200, answer.text
            pages.append([r["id"] for r in answer.json()["runs"]])
            assert answer.json()["count"] == len(pages[-1])
            cursor = answer.json()["next"]
            if cursor is None:
                break
        assert [len(p) for p in pages] == [2, 2, 1]
        assert [i for p in pages for i in p] == expected
        full = await http.get("/api/runs", params={"limit": "5"})
        assert full.json()["next"] is None  # exactly a page's worth: no empty page after it
        bad = await http.get("/api/runs", params={"before": "yesterday"})
        assert bad.status_code == 400 and bad.json()["code"] == "INVALID_REQUEST"
    first = await app.list_runs_async(owner=alice, limit=3)
    rest = await app.list_runs_async(owner=alice, limit=3, before=first[-1].cursor)
    assert [str(r.id) for r in first + rest] == expected
    with pytest.raises(InvalidRequest):
        await app.list_runs_async(owner=alice, before="yesterday")
    await app.database.close()


async def test_an_unknown_path_is_not_found_never_a_missing_run(make_app, sql) -> None:  # type: ignore[no-untyped-def]
    """A path the API does not serve answers 404 ``NOT_FOUND`` (the console's answer too), so
    a client can tell a mistyped path from a run that is missing or another owner's (404
    ``ACCESS_DENIED``); a served path asked with another method is 405 ``INVALID_REQUEST``,
    and one whose run id is not a run id is 400 ``INVALID_REQUEST`` naming ``run_id``.
    Nothing is written."""
    app = http_app(make_app)
    console = app.console(from_header, GRANTS, authenticate_owner=owner_of)
    with Served(console) as server:
        async with client(server) as http:
            run = (await http.post("/api/runs", json={
                "workflow": "approve", "version": "1", "input": {"customer": "c1"}})).json()
            for method, path in [("GET", f"/api/runs/{run['id']}/resultt"),
                                 ("POST", f"/api/runs/{run['id']}/cancel/now"),
                                 ("GET", "/api/run")]:
                answer = await http.request(method, path, json={} if method == "POST" else None)
                assert answer.status_code == 404, (path, answer.text)
                assert answer.json()["code"] == "NOT_FOUND", path
                assert set(answer.json()) == PUBLIC and answer.json()["incident"] is None
            wrong = await http.delete(f"/api/runs/{run['id']}")
            assert wrong.status_code == 405 and wrong.json()["code"] == "INVALID_REQUEST"
            missing = await http.get(f"/api/runs/{uuid.uuid4()}")
            assert missing.status_code == 404 and missing.json()["code"] == "ACCESS_DENIED"
            # a run id that is not one is bad input, named, as in the operators' API
            for method, path in [("GET", "/api/runs/abc"), ("GET", "/api/runs/abc/result"),
                                 ("GET", "/api/runs/abc/events"),
                                 ("POST", "/api/runs/abc/cancel"),
                                 ("POST", "/api/runs/abc/events/approval")]:
                answer = await http.request(method, path, json={} if method == "POST" else None)
                assert answer.status_code == 400, (path, answer.text)
                assert (answer.json()["code"], answer.json()["path"]) == (
                    "INVALID_REQUEST", "run_id"), path
    assert sql("SELECT status, cancel_requested_at FROM orchestrator.runs") == [
        {"status": "queued", "cancel_requested_at": None}]


async def test_a_start_at_outside_the_calendar_in_utc_is_400_and_stores_nothing(
        make_app, sql) -> None:  # type: ignore[no-untyped-def]
    """A ``start_at`` whose offset moves it out of the years a time can have (the first
    instant of year 1 east of UTC, the last of year 9999 west of it) is refused naming the
    field, like any other out-of-range time, not an ``INTERNAL`` error."""
    app = http_app(make_app)
    console = app.console(authenticate_owner=owner_of)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=console),
                                 base_url="http://console.test",
                                 headers={KEY_HEADER: "key-acme-alice"}) as http:
        for when in ("0001-01-01T00:00:00+14:00", "9999-12-31T23:59:59-14:00"):
            answer = await http.post("/api/runs", json={"workflow": "approve", "version": "1",
                                                        "input": 1, "start_at": when})
            assert answer.status_code == 400, (when, answer.text)
            assert answer.json()["code"] == "INVALID_REQUEST", when
            assert answer.json()["path"] == "start_at", when
    assert run_count(sql) == 0
    await app.database.close()


async def test_a_cancelled_runs_result_has_the_runs_own_incident_reference(
        make_app, sql) -> None:  # type: ignore[no-untyped-def]
    """The error of ``/result`` is the run's own public error: a cancelled run has no incident
    reference, so its answer has none either, the same each time it is asked (a reference
    made up per request would lead an operator nowhere)."""
    app = http_app(make_app)
    console = app.console(authenticate_owner=owner_of)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=console),
                                 base_url="http://console.test",
                                 headers={KEY_HEADER: "key-acme-alice"}) as http:
        run = (await http.post("/api/runs", json={"workflow": "approve", "version": "1",
                                                  "input": 1})).json()
        path = f"/api/runs/{run['id']}"
        assert (await http.post(f"{path}/cancel", json={})).json()["status"] == "cancelled"
        answers = [(await http.get(f"{path}/result")).json() for _ in range(2)]
        shown = (await http.get(path)).json()
    assert answers[0] == answers[1]
    assert answers[0]["error"]["code"] == "CANCELLED"
    assert answers[0]["error"]["incident"] == shown["error"]["incident"]
    await app.database.close()


async def test_a_cancelled_runs_run_failed_in_python_names_the_same_incident_as_http(
        make_app, sql) -> None:  # type: ignore[no-untyped-def]
    """``RunHandle.result`` raises the run's own public error, as ``/result`` answers it: a
    cancelled run has no incident reference, so its ``RunFailed.incident`` is None, not one
    made up at each call (which would lead an operator nowhere), and ``to_dict()`` is the
    error of the HTTP answer."""
    from orchestrator import RunFailed

    app = http_app(make_app)
    console = app.console(authenticate_owner=owner_of)
    owner = OWNERS["key-acme-alice"]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=console),
                                 base_url="http://console.test",
                                 headers={KEY_HEADER: "key-acme-alice"}) as http:
        run = (await http.post("/api/runs", json={"workflow": "approve", "version": "1",
                                                  "input": 1})).json()
        path = f"/api/runs/{run['id']}"
        assert (await http.post(f"{path}/cancel", json={})).json()["status"] == "cancelled"
        answer = (await http.get(f"{path}/result")).json()
    handle = await app.get_run_async(uuid.UUID(run["id"]), owner=owner)
    raised = []
    for _ in range(2):
        with pytest.raises(RunFailed) as failed:
            await handle.result_async(timeout=5)
        raised.append(failed.value)
    assert raised[0].code == "CANCELLED"
    assert raised[0].incident is None and raised[1].incident is None
    assert (await handle.info_async()).error["incident"] is None
    assert raised[0].to_dict() == answer["error"]
    await app.database.close()


async def test_a_method_a_path_does_not_take_is_405_with_the_methods_it_takes(
        make_app, sql) -> None:  # type: ignore[no-untyped-def]
    """405 names the methods the path takes, in ``Allow`` (as HTTP requires) and in the
    message, counting both APIs' routes of a path they share."""
    app = http_app(make_app)
    console = app.console(from_header, GRANTS, authenticate_owner=owner_of)
    run = uuid.uuid4()
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=console),
                                 base_url="http://console.test",
                                 headers={KEY_HEADER: "key-acme-alice"}) as http:
        for method, path, allowed in [("DELETE", f"/api/runs/{run}", "GET, HEAD"),
                                      ("PUT", "/api/runs", "GET, HEAD, POST"),
                                      ("GET", f"/api/runs/{run}/cancel", "POST"),
                                      ("GET", f"/api/runs/{run}/events/approval", "POST")]:
            answer = await http.request(method, path)
            assert answer.status_code == 405, (path, answer.text)
            assert answer.headers["allow"] == allowed, path
            assert answer.json()["code"] == "INVALID_REQUEST"
            assert allowed in answer.json()["message"], path
    assert run_count(sql) == 0
    await app.database.close()


async def test_optional_fields_given_as_null_are_absent_and_refusals_say_what_to_send(
        make_app, sql) -> None:  # type: ignore[no-untyped-def]
    """``"priority": null`` is no priority, as null is for every other optional field; a
    deadline shorter than the clock counts is refused in the API's words (seconds, not a
    Python type); a body given to an action that takes no fields is told to send ``{}``."""
    app = http_app(make_app)
    console = app.console(authenticate_owner=owner_of)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=console),
                                 base_url="http://console.test",
                                 headers={KEY_HEADER: "key-acme-alice"}) as http:
        made = await http.post("/api/runs", json={"workflow": "approve", "version": "1",
                                                  "input": 1, "priority": None,
                                                  "queue": None, "deadline": None},
                               headers={"Idempotency-Key": "nulls-1"})
        assert made.status_code == 201, made.text
        assert made.json()["priority"] == 0
        again = await http.post("/api/runs", json={"workflow": "approve", "version": "1",
                                                   "input": 1},
                                headers={"Idempotency-Key": "nulls-1"})
        assert again.status_code == 200, again.text  # the same request
        tiny = await http.post("/api/runs", json={"workflow": "approve", "input": 1,
                                                  "deadline": 1e-9})
        assert tiny.status_code == 400 and tiny.json()["path"] == "deadline"
        assert "timedelta" not in tiny.json()["message"]
        assert "seconds" in tiny.json()["message"]
        extra = await http.post(f"/api/runs/{made.json()['id']}/cancel",
                                json={"evidence": "x"})
        assert extra.status_code == 400 and extra.json()["path"] == "body"
        assert "{}" in extra.json()["message"] and "fields: )" not in extra.json()["message"]
    assert run_count(sql) == 1
    await app.database.close()


async def test_a_body_json_cannot_read_says_why_and_two_keys_are_refused(
        make_app, sql) -> None:  # type: ignore[no-untyped-def]
    """A body that is not JSON is told where it goes wrong; one that is JSON but nested deeper
    or with a longer integer than can be read is told so, not that it is not JSON; bytes that
    are not UTF-8 are told so. Two ``Idempotency-Key`` headers are refused naming the header
    (which one would be the key?). Nothing is stored."""
    app = http_app(make_app)
    console = app.console(authenticate_owner=owner_of)
    headers = {"Content-Type": "application/json"}
    deep = b'{"workflow": "approve", "input": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    long = b'{"workflow": "approve", "input": ' + b"9" * 5000 + b"}"
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=console),
                                 base_url="http://console.test",
                                 headers={KEY_HEADER: "key-acme-alice"}) as http:
        broken = await http.post("/api/runs", content=b'{"workflow": "approve",\n "input": }',
                                 headers=headers)
        assert broken.status_code == 400, broken.text
        assert "line 2, column 11" in broken.json()["message"], broken.text
        for what, body, said in [("deep", deep, "nested"), ("long", long, "digits"),
                                 ("latin-1", b'{"workflow": "\xe9"}', "UTF-8")]:
            answer = await http.post("/api/runs", content=body, headers=headers)
            assert answer.status_code == 400, (what, answer.text)
            assert answer.json()["code"] == "INVALID_REQUEST", what
            assert said in answer.json()["message"], (what, answer.text)
            assert "not valid JSON" not in answer.json()["message"], what
        twice = await http.post("/api/runs", json={"workflow": "approve", "input": 1},
                                headers=[("Idempotency-Key", "k-1"),
                                         ("Idempotency-Key", "k-2")])
        assert twice.status_code == 400, twice.text
        assert twice.json()["path"] == "Idempotency-Key"
    assert run_count(sql) == 0
    await app.database.close()


async def test_an_unknown_workflow_or_version_names_what_was_refused(make_app, sql) -> None:  # type: ignore[no-untyped-def]
    """``UNKNOWN_WORKFLOW`` carries its ``path`` as every refused input that can name it:
    ``workflow`` for a name nothing registers, ``version`` for a version of one that is."""
    app = http_app(make_app)
    console = app.console(authenticate_owner=owner_of)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=console),
                                 base_url="http://console.test",
                                 headers={KEY_HEADER: "key-acme-alice"}) as http:
        for body, path in [({"workflow": "nope", "input": 1}, "workflow"),
                           ({"workflow": "nope", "version": "1", "input": 1}, "workflow"),
                           ({"workflow": "approve", "version": "9", "input": 1}, "version")]:
            answer = await http.post("/api/runs", json=body)
            assert answer.status_code == 400, answer.text
            assert answer.json()["code"] == "UNKNOWN_WORKFLOW"
            assert answer.json()["path"] == path, body
    assert run_count(sql) == 0
    await app.database.close()
