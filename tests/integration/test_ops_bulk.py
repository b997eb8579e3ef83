"""Bulk resolution (``ops resolve-many``, ``ops abandon-many``, ``Operators.resolve_many`` and
``abandon_many``) and the queue filters, against real runs parked on unknown operations: each
item resolved and audited on its own, items changed meanwhile skipped and listed, scopes and
filters applied in SQL, bad input refused with nothing changed."""

from __future__ import annotations

import asyncio
import json
import os
import pty
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest

from orchestrator import Orchestrator, RunFailed, RunHandle
from orchestrator.db.config import DatabaseTarget
from orchestrator.db.database import Database
from orchestrator.errors import DatabaseError, InvalidRequest
from orchestrator.operators import BulkSummary, Operators
from tests.integration.conftest import OTHER, OWNER, running, wait_for

ROOT = Path(__file__).resolve().parents[2]
SCOPED_APP = "tests.integration.scoped_app:app"  # opA: acme, opB: globex
Sql = Callable[..., list[dict[str, Any]]]


async def cli(url: str, *args: str, stdin: str = "") -> tuple[int, str, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "orchestrator", "--database-url", url, *args, cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
    out, err = await proc.communicate(stdin.encode())
    assert proc.returncode is not None
    return proc.returncode, out.decode(), err.decode()


def stuck_app(make_app: Callable[..., Orchestrator]) -> Orchestrator:
    """Two tools whose first call is lost after sending (its outcome unknown) and whose second
    succeeds: every run parks in needs_reconciliation until someone resolves its operation."""
    app = make_app()
    calls: dict[str, int] = {}

    def lost_once(order: str) -> None:
        calls[order] = calls.get(order, 0) + 1
        if calls[order] == 1:
            raise ConnectionResetError("lost after sending")

    @app.tool(max_attempts=2)
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        lost_once(order)
        return {"charge": f"retry-{order}"}

    @app.tool(max_attempts=2)
    async def refund(ctx, *, order):  # type: ignore[no-untyped-def]
        lost_once(order)
        return {"refund": f"retry-{order}"}

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    @app.workflow()
    async def give_back(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(refund, order=order)

    return app


@asynccontextmanager
async def parked(app: Orchestrator, sql: Sql, plan: dict[str, tuple[str, Any]]
                 ) -> AsyncIterator[tuple[dict[str, RunHandle], dict[str, int]]]:
    """Submit ``plan`` (name → (workflow, owner)) with a worker running; once every run is
    parked on its unknown operation, yield the runs and their operation ids by name."""
    async with running(app):
        runs = {name: await app.submit_async(wf, name, owner=owner,
                                             idempotency_key=f"sub-{name}")
                for name, (wf, owner) in plan.items()}
        await wait_for(lambda: len(sql("SELECT 1 FROM orchestrator.runs WHERE status = "
                                       "'needs_reconciliation'")) == len(plan), timeout=30)
        ops = {r["arguments"]["order"]: r["id"]
               for r in sql("SELECT id, arguments FROM orchestrator.operations")}
        yield runs, ops


def audit_rows(sql: Sql) -> list[tuple[str, str, str]]:
    return [(a["action"], a["target_id"], a["evidence"]) for a in sql(
        "SELECT action, target_id, evidence FROM orchestrator.operator_audit ORDER BY id")]


def unchanged(sql: Sql, n: int) -> bool:
    """Nothing resolved: every item still waits and no audit row was written."""
    waiting = sql("SELECT count(*) AS n FROM orchestrator.reconciliation_items "
                  "WHERE state <> 'resolved'")[0]["n"]
    return waiting == n and not audit_rows(sql)


async def test_resolve_many_through_the_cli(make_app, sql, migrated_database_url):
    url = migrated_database_url
    app = stuck_app(make_app)
    pay, give_back = "pay", "give_back"
    plan = {f"c{i}": (pay, None) for i in range(10)} | {"r0": (give_back, None)}
    async with parked(app, sql, plan) as (runs, ops):
        charges = sorted(ops[f"c{i}"] for i in range(10))
        base = ["ops", "resolve-many", "--not-applied", "--tool", "charge", "--evidence",
                "PSP shows none of these", "--operator", "alice"]

        code, out, err = await cli(url, *base, "--dry-run", "--json")
        assert code == 0, err
        dry = json.loads(out)
        assert dry["dry_run"] is True and dry["counts"] == {
            "matched": 10, "resolved": 0, "skipped": 0}
        assert sorted(m["operation_id"] for m in dry["matched"]) == sorted(
            str(op) for op in charges)
        assert unchanged(sql, 11)
        code, out, _ = await cli(url, *base, "--dry-run")
        assert code == 0 and out.startswith("would resolve 10 operations as not applied")
        listed = [line.split()[0] for line in out.splitlines()[3:]]  # after the header rule
        assert sorted(listed) == sorted(str(op) for op in charges)

        code, out, err = await cli(url, *base, stdin="n\n")  # the prompt shows the count
        assert code == 1 and "Resolve 10 operations as not applied" in err and "[y/N]" in err
        assert "nothing changed" in out and unchanged(sql, 11)

        # Someone resolves one of them while the prompt waits: that one is skipped, the others
        # go through, and the exit status says something was skipped.
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "orchestrator", "--database-url", url, *base, "--json",
            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE)
        assert proc.stderr is not None and proc.stdin is not None
        assert b"[y/N] " in await asyncio.wait_for(proc.stderr.readuntil(b"[y/N] "), 30)
        code, _, err = await cli(url, "ops", "resolve", str(ops["c3"]), "--committed",
                                 "--receipt", '{"charge": "by-hand"}', "--evidence",
                                 "found it", "--operator", "bob")
        assert code == 0, err
        proc.stdin.write(b"y\n")
        await proc.stdin.drain()
        out_b, _ = await proc.communicate()
        assert proc.returncode == 1
        summary = json.loads(out_b)
        assert summary["counts"] == {"matched": 10, "resolved": 9, "skipped": 1}
        assert summary["skipped"] == [{
            "operation_id": str(ops["c3"]), "code": "RESOLUTION_CONFLICT",
            "reason": f"operation {ops['c3']} was resolved as committed after it was selected"}]
        assert sorted(summary["resolved"]) == sorted(str(op) for op in charges
                                                     if op != ops["c3"])
        for i in range(10):  # not applied: each run tried its call again and went on
            expected = {"charge": "by-hand"} if i == 3 else {"charge": f"retry-c{i}"}
            assert await runs[f"c{i}"].result_async(timeout=20) == expected
        assert await runs["r0"].status_async() == "needs_reconciliation"  # another tool

        code, out, _ = await cli(url, *base)  # nothing is left to resolve
        assert code == 0 and out.strip() == "no unresolved operations match --tool charge"

        code, out, err = await cli(url, "ops", "abandon-many", "--run", str(runs["r0"].id),
                                   "--evidence", "refunded by hand", "--operator", "alice",
                                   "--yes")
        assert code == 0, err
        assert out.startswith("abandoned 1 of 1 operation; skipped 0")
        with pytest.raises(RunFailed) as failed:
            await runs["r0"].result_async(timeout=20)
        assert failed.value.code == "OPERATION_ABANDONED"

    audit = audit_rows(sql)
    assert audit[0] == ("resolve.committed", str(ops["c3"]), "found it")
    assert sorted(audit[1:10]) == sorted(
        ("resolve.not_applied", str(op), "PSP shows none of these")
        for op in charges if op != ops["c3"])  # one row per item, each with the evidence
    assert audit[10:] == [("resolve.abandoned", str(ops["r0"]), "refunded by hand")]


async def test_a_not_applied_dry_run_and_prompt_say_whether_the_calls_are_sent_again(
        make_app, sql, migrated_database_url):
    """``--not-applied`` sends every call again by default (``--then resend``): the dry run
    an operator checks first, and the question it answers, say so, and say ``--then fail``
    when it is given, as the report after the action does. Both read ``would resolve 2
    operations as not applied`` whichever was chosen, so a bulk re-send of effects looked
    the same as failing them."""
    url = migrated_database_url
    app = stuck_app(make_app)
    async with parked(app, sql, {"c0": ("pay", None), "c1": ("pay", None)}):
        base = ["ops", "resolve-many", "--not-applied", "--tool", "charge", "--evidence",
                "PSP shows none of these", "--operator", "alice"]
        said = {}
        for then in ("resend", "fail", None):
            chosen = [] if then is None else ["--then", then]
            code, dry, err = await cli(url, *base, *chosen, "--dry-run")
            assert code == 0, err
            code, out, asked = await cli(url, *base, *chosen, stdin="n\n")
            assert code == 1 and "nothing changed" in out, (out, asked)
            said[then] = (dry.splitlines()[0], asked)
        assert unchanged(sql, 2)
    resend = "then send each call again as a new attempt with a new key (--then resend)"
    fail = "then fail each call with TOOL_FAILED in its workflow (--then fail)"
    for then, (dry, asked) in said.items():
        expected = fail if then == "fail" else resend
        assert dry.startswith("would resolve 2 operations as not applied, " + expected), dry
        assert "Resolve 2 operations as not applied, " + expected in asked, asked


async def test_the_api_summary_is_typed_and_each_item_is_its_own_transaction(
        make_app, sql, migrated_database_url):
    app = stuck_app(make_app)
    pay = "pay"
    async with parked(app, sql, {f"c{i}": (pay, None) for i in range(4)}) as (runs, ops):
        operators = Operators(app.database)
        ticks: list[tuple[int, int]] = []

        def meanwhile(selection: BulkSummary) -> bool:
            # Between the selection and the first item, another operator settles c1.
            assert sorted(i.operation_id for i in selection.matched) == sorted(ops.values())
            done = subprocess.run(
                [sys.executable, "-m", "orchestrator", "--database-url", migrated_database_url,
                 "ops", "abandon", str(ops["c1"]), "--evidence", "gone", "--operator", "bob"],
                cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                check=False, timeout=60)
            assert done.returncode == 0, done.stderr
            return True

        summary = await operators.resolve_many(
            resolution="committed", receipt={"charge": "seen"}, evidence="dashboard",
            operator="alice", key=None, confirm=meanwhile,
            progress=lambda done, total: ticks.append((done, total)))
        assert isinstance(summary, BulkSummary) and not summary.dry_run and not summary.more
        assert sorted(i.operation_id for i in summary.resolved) == sorted(
            op for name, op in ops.items() if name != "c1")
        assert [(s.item.operation_id, s.code) for s in summary.skipped] == [
            (ops["c1"], "RESOLUTION_CONFLICT")]
        assert ticks == [(1, 4), (2, 4), (3, 4), (4, 4)]
        assert await runs["c0"].result_async(timeout=20) == {"charge": "seen"}
        with pytest.raises(RunFailed):
            await runs["c1"].result_async(timeout=20)
        assert operators.metrics.snapshot()["reconciliation_operator"] == 3
        again = await operators.abandon_many(evidence="late", operator="alice")
        assert again.matched == [] and again.resolved == [] and again.skipped == []

        for bad, path in (({"state": "resolved"}, "state"), ({"key": "bad key"}, "key"),
                          ({"run_id": "not-a-run"}, "run_id"), ({"tool": "a\x00b"}, "tool"),
                          ({"workflow": ""}, "workflow"), ({"older_than": -1}, "older_than"),
                          ({"limit": 0}, "limit"), ({"evidence": ""}, "evidence"),
                          ({"receipt": {"x": 1}}, "receipt"), ({"operator": "a b"}, "operator"),
                          ({"resolution": "committed", "receipt": float("nan")}, "$.receipt"),
                          ({"resolution": "abandoned"}, "resolution")):
            options: dict[str, Any] = {"resolution": "not_applied", "evidence": "e",
                                       "operator": "alice", **bad}
            with pytest.raises(InvalidRequest) as caught:
                await operators.resolve_many(**options)
            assert caught.value.path == path
    assert len(audit_rows(sql)) == 4  # 3 by the bulk call, 1 by bob; none for the skip


async def test_filters_and_scopes_are_applied_in_sql(make_app, sql, migrated_database_url):
    url = migrated_database_url
    app = stuck_app(make_app)
    pay, give_back = "pay", "give_back"
    plan = {"a0": (pay, None), "a1": (give_back, None), "g0": (pay, OTHER),
            "g1": (pay, OTHER)}
    async with parked(app, sql, plan) as (runs, ops):
        key = sql("SELECT idempotency_key FROM orchestrator.operations WHERE id = %s",
                  (ops["a0"],))[0]["idempotency_key"]

        async def listed(*args: str) -> list[str]:
            code, out, err = await cli(url, "ops", "list", "--json", *args)
            assert code == 0, err
            return sorted(i["operation_id"] for i in json.loads(out)["items"])

        assert await listed("--key", key) == [str(ops["a0"])]
        assert await listed("--run", str(runs["g1"].id)) == [str(ops["g1"])]
        assert await listed("--workflow", "give_back") == [str(ops["a1"])]
        assert await listed("--workflow", "pay", "--tool", "charge") == sorted(
            str(ops[n]) for n in ("a0", "g0", "g1"))
        assert await listed("--older-than", "1d") == []
        # opA's scope is acme: globex's items are not listed, not counted and not touched.
        assert await listed("--app", SCOPED_APP, "--operator", "opA") == sorted(
            str(ops[n]) for n in ("a0", "a1"))
        code, out, err = await cli(url, "ops", "abandon-many", "--workflow", "pay",
                                   "--evidence", "x", "--operator", "opA", "--app",
                                   SCOPED_APP, "--yes", "--json")
        assert code == 0, err
        assert json.loads(out)["resolved"] == [str(ops["a0"])]

        for args, named in ((["--key", "bad key"], "key"), (["--run", "nope"], "run_id"),
                            (["--workflow", " pay"], "workflow"),
                            (["--older-than", "soon"], "older-than")):
            for command in (["ops", "list"], ["ops", "resolve-many", "--not-applied",
                                              "--evidence", "x", "--operator", "alice",
                                              "--yes"]):
                code, out, err = await cli(url, *command, *args)
                assert code == 2 and out == "", (args, err)
                assert err.startswith("orchestrator: error: INVALID_REQUEST: ") and named in err
        code, _, err = await cli(url, "ops", "resolve-many", "--not-applied", "--evidence", "x",
                                 "--operator", "alice", "--yes", "--receipt", "{}")
        assert code == 2 and "--receipt goes only with --committed" in err
        code, _, err = await cli(url, "ops", "resolve-many", "--committed", "--receipt", "[",
                                 "--evidence", "x", "--operator", "alice", "--yes")
        assert code == 2 and "INVALID_REQUEST" in err
        code, _, err = await cli(url, "ops", "resolve-many", "--not-applied", "--evidence", "x",
                                 "--operator", "alice", "--state", "resolved")
        assert (code, err) == (2, "orchestrator: error: INVALID_REQUEST: --state must be one "
                                  "of open, operator, unresolved, not 'resolved'\n")

        code, out, err = await cli(url, "runs", "list", "--json", "--submission-key", "sub-g0")
        assert code == 0, err
        assert [r["id"] for r in json.loads(out)["runs"]] == [str(runs["g0"].id)]
        code, _, err = await cli(url, "runs", "list", "--submission-key", "bad key")
        assert code == 2 and "INVALID_REQUEST: submission_key must be" in err
    assert [a[1] for a in audit_rows(sql)] == [str(ops["a0"])]


async def test_progress_is_counted_on_a_terminal(make_app, sql, migrated_database_url):
    app = stuck_app(make_app)
    pay = "pay"
    async with parked(app, sql, {f"c{i}": (pay, None) for i in range(3)}):
        leader, follower = pty.openpty()
        proc = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "--database-url", migrated_database_url,
             "ops", "resolve-many", "--not-applied", "--evidence", "none", "--operator", "al",
             "--yes"], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.PIPE, stderr=follower, text=True)
        os.close(follower)
        out, _ = proc.communicate(timeout=60)
        seen = b""
        while True:
            try:
                chunk = os.read(leader, 4096)
            except OSError:  # the terminal's other end is closed: everything was read
                break
            if not chunk:
                break
            seen += chunk
        os.close(leader)
        assert proc.returncode == 0, seen
        assert b"\rresolved 1/3" in seen and b"\rresolved 3/3" in seen
        assert out.startswith("resolved 3 of 3 operations as not applied")


async def test_ids_select_those_operations_among_the_waiting_ones_of_the_scope(make_app, sql):
    app = stuck_app(make_app)
    pay = "pay"
    plan = {f"a{i}": (pay, OWNER) for i in range(3)} | {"g0": (pay, OTHER)}
    async with parked(app, sql, plan) as (runs, ops):
        operators = Operators(app.database, scopes={"opA": ["acme"]})
        missing = 2**62
        asked = [ops["a2"], ops["a0"], ops["a2"], ops["g0"], missing]
        dry = await operators.resolve_many(resolution="not_applied", evidence="none",
                                           operator="opA", ids=asked, dry_run=True)
        assert sorted(i.operation_id for i in dry.matched) == sorted([ops["a0"], ops["a2"]])
        assert dry.missing == [ops["g0"], missing]  # as asked, duplicates dropped
        summary = await operators.abandon_many(evidence="written off", operator="opA",
                                               ids=asked)
        assert sorted(i.operation_id for i in summary.resolved) == sorted(
            [ops["a0"], ops["a2"]])
        assert summary.skipped == [] and summary.missing == [ops["g0"], missing]
        with pytest.raises(RunFailed):
            await runs["a0"].result_async(timeout=20)
        again = await operators.abandon_many(evidence="again", operator="opA", ids=[ops["a0"]])
        assert again.matched == [] and again.missing == [ops["a0"]]  # resolved: not waiting

        for bad, path in (({"tool": "charge"}, "ids"), ({"state": "open"}, "ids"),
                          ({"ids": []}, "ids"), ({"ids": [0]}, "ids"),
                          ({"ids": ["1"]}, "ids"), ({"ids": [True]}, "ids"),
                          ({"ids": list(range(1, 502))}, "ids"),
                          ({"ids": [ops["a1"], ops["g0"]], "limit": 1}, "limit")):
            options: dict[str, Any] = {"evidence": "e", "operator": "opA",
                                       "ids": [ops["a1"]], **bad}
            with pytest.raises(InvalidRequest) as caught:
                await operators.abandon_many(**options)
            assert caught.value.path == path
    assert sorted(int(a[1]) for a in audit_rows(sql)) == sorted([ops["a0"], ops["a2"]])


def lose_the_next_commit(monkeypatch: pytest.MonkeyPatch, db: Database) -> None:
    """The next transaction of ``db`` commits, then its driver loses step on the COMMIT (as
    when the connection drops while the COMMIT is under way): the storage layer cannot know
    that it applied and runs the work again on another connection. Work run in autocommit
    (each statement its own COMMIT) loses the answer of its last statement, which applied."""
    real, real_autocommit = db.run_in_transaction, db.run_autocommit
    lost: list[Any] = []

    async def run_in_transaction(work, **options):  # type: ignore[no-untyped-def]
        async def once(conn):  # type: ignore[no-untyped-def]
            result = await work(conn)
            if not lost:
                lost.append(conn)
                wait = conn.wait

                async def lose_step(gen, *args, **kwargs):  # type: ignore[no-untyped-def]
                    del conn.wait
                    await wait(gen, *args, **kwargs)
                    raise psycopg.InternalError("received 2 results from command 'COMMIT'")

                conn.wait = lose_step
            return result

        return await real(once, **options)

    async def run_autocommit(work, **options):  # type: ignore[no-untyped-def]
        async def once(conn):  # type: ignore[no-untyped-def]
            result = await work(conn)
            if not lost:
                lost.append(conn)
                await conn.close()  # the pool replaces it
                raise psycopg.InternalError("received 2 results from command 'INSERT'")
            return result

        return await real_autocommit(once, **options)

    monkeypatch.setattr(db, "run_in_transaction", run_in_transaction)
    monkeypatch.setattr(db, "run_autocommit", run_autocommit)


async def test_a_resolution_whose_commit_was_lost_is_reported_as_made_and_audited_once(
        make_app, sql, migrated_database_url, monkeypatch):
    """The connection goes while a resolution's COMMIT is under way, and the COMMIT applied:
    run again, the resolution finds its own work done. It is reported as resolved (not as an
    item someone else resolved meanwhile, nor as a no-op) and audited once."""
    app = stuck_app(make_app)
    async with parked(app, sql, {f"c{i}": ("pay", None) for i in range(3)}) as (runs, ops):
        db = Database(DatabaseTarget(migrated_database_url, "argument"))
        try:
            operators = Operators(db)
            lose_the_next_commit(monkeypatch, db)
            summary = await operators.resolve_many(
                resolution="committed", receipt={"charge": "seen"}, evidence="dashboard",
                operator="alice", ids=[ops["c0"], ops["c1"]])
            assert [(s.item.operation_id, s.code) for s in summary.skipped] == []
            assert sorted(i.operation_id for i in summary.resolved) == sorted(
                [ops["c0"], ops["c1"]])
            assert operators.metrics.snapshot()["reconciliation_operator"] == 2

            lose_the_next_commit(monkeypatch, db)  # and one resolved on its own
            assert await operators.resolve_committed(
                ops["c2"], receipt={"charge": "seen"}, evidence="dashboard",
                operator="alice") == "resolved"
        finally:
            await db.close()
        for run in runs.values():
            assert await run.result_async(timeout=20) == {"charge": "seen"}
    assert sorted(audit_rows(sql)) == sorted(
        ("resolve.committed", str(op), "dashboard") for op in ops.values())


async def test_the_database_failing_midway_stops_the_action_and_the_report_says_what_was_done(
        make_app, sql, migrated_database_url, monkeypatch):
    """The database fails at the second of three items: the first stays resolved and is
    reported so, the second and third are listed as skipped with the database's code (the
    third not tried), and the same action again resolves the two still waiting."""
    app = stuck_app(make_app)
    async with parked(app, sql, {f"c{i}": ("pay", None) for i in range(3)}) as (runs, ops):
        db = Database(DatabaseTarget(migrated_database_url, "argument"))
        try:
            operators = Operators(db)
            real = db.run_in_transaction
            calls = {"n": 0}

            async def failing_second(work, **options):  # type: ignore[no-untyped-def]
                calls["n"] += 1
                if calls["n"] == 2:
                    raise DatabaseError("the database at test is unavailable (OperationalError)")
                return await real(work, **options)

            monkeypatch.setattr(db, "run_in_transaction", failing_second)
            summary = await operators.abandon_many(evidence="written off", operator="alice")
            order = [i.operation_id for i in summary.matched]  # oldest first
            assert sorted(order) == sorted(ops.values())
            assert [i.operation_id for i in summary.resolved] == order[:1]
            assert [(s.item.operation_id, s.code) for s in summary.skipped] == [
                (op, "DATABASE_UNAVAILABLE") for op in order[1:]]
            assert "not tried" in summary.skipped[1].reason

            again = await operators.abandon_many(evidence="written off", operator="alice")
            assert [i.operation_id for i in again.resolved] == order[1:]
        finally:
            await db.close()
    assert [a[1] for a in audit_rows(sql)] == [str(op) for op in order]


async def test_resolve_many_json_says_what_follows_for_each_resolved_item(
        make_app, sql, migrated_database_url):
    """Each matched item of `resolve-many --json` carries `then`, what its run does next
    (`resend`, `fail` or `resume`; `cancelled` for a run whose cancellation was requested,
    `waits` with `waits_for` for one still blocked on another operation), as `ops resolve`
    says it of one; null for an item not resolved (a dry run, a skipped one)."""
    url = migrated_database_url
    app = stuck_app(make_app)
    plan = {name: ("pay", None) for name in ("a", "b", "c")}
    async with parked(app, sql, plan) as (runs, ops):
        assert await runs["b"].cancel_async() == "needs_reconciliation"
        base = ["ops", "resolve-many", "--not-applied", "--tool", "charge", "--evidence",
                "PSP shows none", "--operator", "alice", "--json"]
        code, out, err = await cli(url, *base, "--then", "fail", "--dry-run")
        assert code == 0, err
        assert [(m["then"], m["waits_for"]) for m in json.loads(out)["matched"]] == [
            (None, [])] * 3
        code, out, err = await cli(url, *base, "--then", "fail", "--yes")
        assert code == 0, err
        done = json.loads(out)
        assert {m["operation_id"]: (m["then"], m["waits_for"]) for m in done["matched"]} == {
            str(ops["a"]): ("fail", []), str(ops["b"]): ("cancelled", []),
            str(ops["c"]): ("fail", [])}
        assert sorted(done["resolved"]) == sorted(str(op) for op in ops.values())


async def test_resolve_many_json_names_the_operations_a_run_still_waits_for(
        make_app, sql, migrated_database_url):
    from tests.integration.test_ops_cli import _two_lost_charges

    url = migrated_database_url
    app, _, pay = _two_lost_charges(make_app)
    async with running(app):
        run = await app.submit_async(pay, "o")
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs")[0]["status"]
                       == "needs_reconciliation")
        first, second = [str(r["id"]) for r in sql("SELECT id FROM orchestrator.operations "
                                                   "ORDER BY id")]
        base = ["ops", "resolve-many", "--committed", "--receipt", '{"charge": "c"}',
                "--evidence", "PSP: both", "--operator", "alice", "--json", "--yes"]
        code, out, err = await cli(url, *base, "--limit", "1")
        assert code == 0, err
        assert [(m["operation_id"], m["then"], m["waits_for"])
                for m in json.loads(out)["matched"]] == [(first, "waits", [second])]
        code, out, err = await cli(url, *base)
        assert code == 0, err
        assert [(m["operation_id"], m["then"], m["waits_for"])
                for m in json.loads(out)["matched"]] == [(second, "resume", [])]
        assert await run.result_async(timeout=10) == [{"charge": "c"}, {"charge": "c"}]


async def test_resolve_many_says_what_followed_for_each_run_not_only_what_usually_does(
        make_app, sql, migrated_database_url):
    """The report after a bulk not applied named the usual consequence for every run ("their
    runs send the calls again") with a caveat about runs being cancelled, without saying which
    those were: it now lists the operations by what their runs do next."""
    url = migrated_database_url
    app = stuck_app(make_app)
    plan = {name: ("pay", None) for name in ("a", "b", "c")}
    async with parked(app, sql, plan) as (runs, ops):
        assert await runs["b"].cancel_async() == "needs_reconciliation"
        code, out, err = await cli(url, "ops", "resolve-many", "--not-applied", "--tool",
                                   "charge", "--evidence", "PSP shows none", "--operator",
                                   "alice", "--yes")
        assert code == 0, err
        a, c = sorted((ops["a"], ops["c"]))
        assert out.splitlines() == [
            "resolved 3 of 3 operations as not applied; skipped 0; what follows:",
            f"  its call is sent again as a new attempt: operations {a}, {c}",
            f"  its run ends cancelled, as was requested (nothing is sent again): operation "
            f"{ops['b']}"]
        assert await runs["a"].result_async(timeout=10) == {"charge": "retry-a"}
