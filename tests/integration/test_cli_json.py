"""``--json`` on every list and show command (docs/cli-json.md), what ``runs show`` says about
the worker holding a run, and the ``incidents show`` message without ``--operator``."""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from datetime import datetime
from typing import Any

from orchestrator import Orchestrator, ToolError
from tests.integration.conftest import running, wait_for
from tests.integration.test_ops_bulk import cli, stuck_app

ISO_UTC = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z")


def times_and_ids(record: dict[str, Any], times: list[str], ids: list[str]) -> None:
    """Times are ISO 8601 UTC (or null), ids strings (or null)."""
    for name in times:
        value = record[name]
        assert value is None or ISO_UTC.fullmatch(value), (name, value)
        if value is not None:
            assert datetime.fromisoformat(value).utcoffset().total_seconds() == 0
    for name in ids:
        assert record[name] is None or isinstance(record[name], str), (name, record[name])


async def test_every_list_and_show_prints_one_json_document(make_app, sql,
                                                            migrated_database_url):
    url = migrated_database_url
    app = stuck_app(make_app)
    async with running(app):
        run = await app.submit_async("pay", "one", idempotency_key="order-1")
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs")[0]["status"]
                       == "needs_reconciliation", timeout=30)
    op = sql("SELECT id FROM orchestrator.operations")[0]["id"]

    code, out, err = await cli(url, "runs", "list", "--json")
    assert code == 0, err
    listed = json.loads(out)
    assert (listed["count"], listed["limit"]) == (1, 50)
    summary = listed["runs"][0]
    assert summary["id"] == str(run.id) and summary["submission_key"] == "order-1"
    assert summary["status"] == "needs_reconciliation" and summary["finished_at"] is None
    assert (summary["workflow_name"], summary["tenant"], summary["principal"]) == (
        "pay", "acme", "alice")
    times_and_ids(summary, ["created_at", "updated_at", "finished_at", "deadline_at",
                            "available_at", "lease_expires_at", "cancel_requested_at"],
                  ["id", "parent_run_id"])

    code, out, err = await cli(url, "runs", "show", str(run.id), "--json")
    assert code == 0, err
    shown = json.loads(out)
    assert set(shown) == {"run", "note", "lease", "operations", "journal"}
    assert shown["run"]["submission_key"] == "order-1" and shown["run"]["result"] is None
    assert shown["lease"] is None and shown["note"].startswith("blocked:")
    assert [(o["id"], o["state"]) for o in shown["operations"]] == [(str(op), "unknown")]
    kinds = [e["kind"] for e in shown["journal"]]
    assert kinds[0] == "call.submitted" and "call.unknown" in kinds
    assert all(ISO_UTC.fullmatch(e["at"]) for e in shown["journal"])
    code, out, _ = await cli(url, "runs", "show", str(run.id))
    assert code == 0 and "\nsubmission key: order-1\n" in out  # the table says it too

    code, out, err = await cli(url, "ops", "list", "--json")
    assert code == 0, err
    items = json.loads(out)
    assert (items["count"], items["limit"]) == (1, 100)
    item = items["items"][0]
    assert (item["operation_id"], item["run_id"], item["item_state"], item["resolution"]) == (
        str(op), str(run.id), "open", None)
    assert item["arguments"] == {"order": "one"} and item["resolved_at"] is None
    times_and_ids(item, ["created_at", "resolved_at", "submitted_at", "next_attempt_at"],
                  ["operation_id", "run_id"])

    code, out, err = await cli(url, "ops", "show", str(op), "--json")
    assert code == 0, err
    detail = json.loads(out)
    assert set(detail) == {"item", "evidence", "attempts", "incidents", "lookups", "reasons",
                           "audit", "journal", "wait"}
    assert detail["item"]["operation_id"] == str(op) and detail["item"]["receipt"] is None
    assert detail["wait"] is None  # a queued operation: the operator's to settle
    assert [a["operation_id"] for a in detail["attempts"]] == [str(op)]
    ref = detail["incidents"][0]["ref"]

    code, out, err = await cli(url, "incidents", "show", ref, "--operator", "al", "--json")
    assert code == 0, err
    incident = json.loads(out)
    assert (incident["ref"], incident["run_id"], incident["operation_id"]) == (
        ref, str(run.id), str(op))
    assert incident["tenant"] == "acme" and "lost after sending" in json.dumps(
        incident["detail"])
    times_and_ids(incident, ["created_at"], ["run_id", "operation_id"])

    code, out, _ = await cli(url, "ops", "list", "--json", "--tool", "refund")
    assert code == 0 and json.loads(out) == {"items": [], "count": 0, "limit": 100}


async def test_runs_show_says_each_operations_stored_error(make_app, sql,
                                                           migrated_database_url):
    """``runs show`` listed a run's operations without the error the engine stored on them
    (its code and cause): ``--json`` has it as ``error``, the table in a WHY column."""
    url = migrated_database_url
    app = make_app()

    @app.tool()
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        raise ToolError("declined: card tok_hidden_1", applied=False, status=402)

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    async with running(app):
        run = await app.submit_async("pay", "one")
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs")[0]["status"]
                       == "failed", timeout=30)
    (stored,) = [r["error"] for r in sql("SELECT error FROM orchestrator.operations")]
    assert stored["code"] == "TOOL_FAILED" and isinstance(stored["cause"], str), stored

    code, out, err = await cli(url, "runs", "show", str(run.id), "--json")
    assert code == 0, err
    (operation,) = json.loads(out)["operations"]
    assert operation["error"] == stored
    code, out, err = await cli(url, "runs", "show", str(run.id))
    assert code == 0, err
    table = out.split("\noperations\n", 1)[1].split("\ntimeline\n", 1)[0]
    header, _, row = table.strip().splitlines()[:3]
    assert "WHY" in header.split(), table
    assert f"TOOL_FAILED ({stored['cause']})" in row, table
    assert "tok_hidden_1" not in out  # the tool's text is in the incident, not here


async def test_incidents_show_without_operator_says_why_and_what_to_run(
        migrated_database_url):
    code, out, err = await cli(migrated_database_url, "incidents", "show", "inc_0123")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("orchestrator: error: INVALID_REQUEST: incidents show needs "
                          "--operator NAME")
    assert "protected diagnostics" in err and "operator_scopes and incident_readers" in err
    assert "Run: orchestrator incidents show inc_0123 --operator NAME" in err
    assert "usage:" not in err


def _hold(sql: Any, run_id: uuid.UUID, worker: str, *, lease: str = "5 minutes") -> None:
    sql(f"""UPDATE orchestrator.runs SET status = 'running', lease_owner = %s,
            lease_token = lease_token + 1, lease_expires_at = now() + interval '{lease}',
            available_at = NULL WHERE id = %s""", (worker, run_id))


def _register(sql: Any, worker: str, *, silent_for: str, lock_key: int | None) -> None:
    sql(f"""INSERT INTO orchestrator.workers (id, hostname, pid, workflows, concurrency,
                                              lock_key, heartbeat_at)
            VALUES (%s, 'h', 1, ARRAY['pay@1'], 1, %s, now() - interval '{silent_for}')""",
        (worker, lock_key))


async def test_runs_show_says_when_the_lease_holder_is_dead_and_when_it_is_reclaimed(
        app: Orchestrator, sql, migrated_database_url):
    url = migrated_database_url
    entered, release = asyncio.Event(), asyncio.Event()

    @app.tool(effect="read")
    async def wait(ctx):  # type: ignore[no-untyped-def]
        entered.set()
        await release.wait()
        return 1

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(wait) if order == "live" else order

    runs = {name: await app.submit_async(pay, name) for name in
            ("dead", "gone", "silent", "expired")}
    _hold(sql, runs["dead"].id, "w-dead")
    _register(sql, "w-dead", silent_for="30 seconds", lock_key=7_000_001)  # lock not held
    _hold(sql, runs["gone"].id, "w-gone")  # never registered (or already forgotten)
    _hold(sql, runs["silent"].id, "w-silent")
    _register(sql, "w-silent", silent_for="30 seconds", lock_key=None)
    _hold(sql, runs["expired"].id, "w-gone", lease="-1 second")

    async def show(name: str) -> tuple[str, dict[str, Any]]:
        code, out, err = await cli(url, "runs", "show", str(runs[name].id))
        assert code == 0, err
        code, doc, err = await cli(url, "runs", "show", str(runs[name].id), "--json")
        assert code == 0, err
        return out.split("note:", 1)[1].split("\n", 1)[0].strip(), json.loads(doc)

    note, doc = await show("dead")
    assert re.fullmatch(r"held by w-dead, which is dead \(last heartbeat \d+ s ago, its "
                        r"liveness lock released\): the next sweep of a live worker re-queues "
                        r"the run, at the latest when the lease expires at .*Z; no other live "
                        r"worker is registered now, so it happens once one runs", note), note
    assert doc["lease"]["holder_state"] == "dead" and doc["lease"]["reclaim"] == "sweep"
    assert doc["lease"]["worker_id"] == "w-dead" and doc["lease"]["heartbeat_age_seconds"] > 29
    assert doc["lease"]["expires_at"] == doc["run"]["lease_expires_at"]

    note, doc = await show("gone")
    assert note.startswith("held by w-gone, which is gone (no longer registered): the run is "
                           "re-queued when its lease expires at ")
    assert (doc["lease"]["holder_state"], doc["lease"]["reclaim"],
            doc["lease"]["heartbeat_at"]) == ("gone", "expiry", None)

    note, doc = await show("silent")
    assert re.match(r"held by w-silent, which is silent \(last heartbeat \d+ s ago", note)
    # w-silent took no liveness lock (a worker behind a transaction pooler without a
    # listen_url): killed, it looks just the same, so the note must not call it only paused.
    assert "paused or dead, which the database cannot tell" in note, note
    assert "re-queued when its lease expires at" in note
    assert (doc["lease"]["holder_state"], doc["lease"]["reclaim"]) == ("silent", "expiry")

    note, doc = await show("expired")
    assert note.startswith("held by w-gone, whose lease expired at ")
    assert (doc["lease"]["holder_state"], doc["lease"]["reclaim"]) == ("expired", "sweep")

    sql("DELETE FROM orchestrator.runs WHERE id <> ALL(%s)",  # no sweep re-queues the others
        ([r.id for r in runs.values()],))
    async with running(app) as worker:
        runs["live"] = await app.submit_async(pay, "live")
        await asyncio.wait_for(entered.wait(), 30)
        note, doc = await show("live")
        release.set()
        assert re.fullmatch(rf"held by {re.escape(worker.worker_id)} until .*Z \(last "
                            r"heartbeat \d+ s ago\)", note), note
        assert (doc["lease"]["holder_state"], doc["lease"]["reclaim"]) == ("live", None)
        assert await runs["live"].result_async(timeout=20) == 1


async def test_runs_list_says_when_a_running_runs_worker_stopped_heartbeating(
        app: Orchestrator, sql, migrated_database_url):
    """A worker killed while no other runs leaves its runs ``running``: the table's DETAIL
    says that nothing is running them, and where to read when they will be re-queued, instead
    of ``-`` (``--json`` is unchanged: its ``lease`` is in ``runs show --json``)."""
    url = migrated_database_url

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return order

    runs = {name: await app.submit_async(pay, name) for name in ("dead", "silent")}
    _hold(sql, runs["dead"].id, "w-dead")
    _register(sql, "w-dead", silent_for="30 seconds", lock_key=7_000_004)  # lock not held
    _hold(sql, runs["silent"].id, "w-silent")
    _register(sql, "w-silent", silent_for="5 seconds", lock_key=None)

    code, out, err = await cli(url, "runs", "list")
    assert (code, err) == (0, "")
    detail = out.splitlines()[0].index("DETAIL")
    rows = {line.split()[0]: line[detail:] for line in out.splitlines()[2:]}
    for name in ("dead", "silent"):
        assert rows[str(runs[name].id)].startswith(
            f"held by w-{name}, silent or dead (see runs show)  "), rows
    code, doc, err = await cli(url, "runs", "list", "--json")
    assert code == 0, err
    assert {r["blocked"] for r in json.loads(doc)["runs"]} == {None}
