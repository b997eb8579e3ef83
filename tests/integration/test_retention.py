"""Retention (docs/retention.md): pruning finished runs in batches, their submission keys
answered by the tombstone, the runs never pruned, evidence kept for its own period and exported
first, the background prune of the reconciler, the runtime role's narrow right, the CLI."""

from __future__ import annotations

import asyncio
import io
import json
import re
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest

from orchestrator import Orchestrator, Retention, RunPruned, retention
from orchestrator.db import grants
from orchestrator.db.config import DatabaseTarget, validate_url
from orchestrator.db.database import Database
from orchestrator.errors import ConfigurationError, InvalidRequest
from orchestrator.operators import Operators
from orchestrator.retention import Pruner, export_evidence, parse_period
from tests.clitools import run_cli
from tests.consoletools import GRANTS, Client, from_header
from tests.integration.conftest import OWNER, running, wait_for
from tests.integration.test_ops_bulk import lose_the_next_commit

NOW = Retention(finished_runs=timedelta(0), evidence=None)


def shop(app: Orchestrator) -> Orchestrator:
    @app.tool()
    async def charge(ctx, *, cents):  # type: ignore[no-untyped-def]
        return {"charged": cents}

    @app.workflow()
    async def pay(ctx, cents):  # type: ignore[no-untyped-def]
        await ctx.call(charge, cents=cents)
        return {"paid": cents}

    @app.workflow()
    async def child(ctx, n):  # type: ignore[no-untyped-def]
        return n

    @app.workflow()
    async def parent(ctx, n):  # type: ignore[no-untyped-def]
        got = await ctx.run_child("child", n)
        await ctx.wait_for_event("go")
        return got

    return app


def count(sql: Any, query: str, *params: Any) -> int:
    return int(sql(query, params)[0]["n"])


async def test_a_pruned_run_answers_its_submission_key_and_never_runs_twice(
        make_app: Any, sql: Any) -> None:
    app = shop(make_app())
    async with running(app):
        run = await app.submit_async("pay", 500, idempotency_key="order-1")
        assert await run.result_async(timeout=20) == {"paid": 500}
    journal = count(sql, "SELECT count(*) AS n FROM orchestrator.journal WHERE run_id = %s",
                    run.id)
    assert journal == 3  # call.submitted, call.completed, run.completed
    report = await Pruner(app.database, NOW).prune()
    assert (report.runs, report.journal_rows) == (1, journal)
    assert count(sql, "SELECT count(*) AS n FROM orchestrator.journal WHERE run_id = %s",
                 run.id) == 0
    (row,) = sql("SELECT input, result, status, pruned_at FROM orchestrator.runs")
    assert row["input"] is None and row["result"] is None and row["status"] == "succeeded"
    assert count(sql, "SELECT count(*) AS n FROM orchestrator.operations "
                      "WHERE run_id = %s AND state = 'committed'", run.id) == 1  # evidence

    again = await app.submit_async("pay", 500, idempotency_key="order-1")
    assert again.id == run.id  # the same request answers with the same (pruned) run
    with pytest.raises(RunPruned) as pruned:
        await again.result_async(timeout=5)
    assert pruned.value.code == "RUN_PRUNED" and pruned.value.status == "succeeded"
    assert (await again.info_async()).pruned_at is not None
    assert count(sql, "SELECT count(*) AS n FROM orchestrator.runs") == 1  # no second run
    assert (await Pruner(app.database, NOW).prune()).runs == 0  # nothing left to prune


async def test_the_console_says_a_run_was_pruned(make_app: Any) -> None:
    """The run page of a pruned run says so, and that its operations are the evidence left,
    instead of showing an empty input, result and timeline as if the run had none."""
    app = shop(make_app())
    async with running(app):
        run = await app.submit_async("pay", 700)
        assert await run.result_async(timeout=20) == {"paid": 700}
        console = app.console(from_header, grants=GRANTS)
        async with Client(console, "alice") as alice:
            before = (await alice.get(f"/runs/{run.id}")).text
            await Pruner(app.database, NOW).prune()
            after = (await alice.get(f"/runs/{run.id}")).text
    assert 'id="run-pruned"' not in before and "700" in before
    assert 'id="run-pruned"' in after and "by retention" in after
    # the input, the result and the timeline
    assert after.count("Deleted by retention when the run was pruned") == 3
    assert "charge@1" in after  # the operation, kept as evidence


async def test_the_stream_of_a_pruned_run_says_it_was_pruned(make_app: Any) -> None:
    """A pruned run's journal is gone: its stream answers ``RUN_PRUNED`` (HTTP 410, which an
    ``EventSource`` does not retry) instead of an empty stream that a reconnecting client
    would ask for again and again, its cursor never moving. A client that had read to the
    end still gets 204."""
    app = shop(make_app())
    async with running(app):
        run = await app.submit_async("pay", 800)
        assert await run.result_async(timeout=20) == {"paid": 800}
    revision = (await run.info_async()).revision
    await Pruner(app.database, NOW).prune()
    with pytest.raises(RunPruned):
        [entry async for entry in run.events()]
    console = app.console(from_header, grants=GRANTS, authenticate_owner=lambda request: (
        OWNER if request.headers.get("X-Api-Key") == "acme-key" else None))
    async with Client(console, "alice") as alice:
        gone = await alice.get(f"/api/runs/{run.id}/events")
        assert gone.status_code == 410 and gone.json()["code"] == "RUN_PRUNED"
        mine = await alice.http.get(f"/api/runs/{run.id}/events",
                                    headers={"X-Api-Key": "acme-key"})  # the owner's form
        assert mine.status_code == 410 and mine.json()["code"] == "RUN_PRUNED"
        shown = await alice.http.get(f"/api/runs/{run.id}", headers={"X-Api-Key": "acme-key"})
        assert shown.status_code == 200 and shown.json()["pruned_at"] is not None
        read = await alice.http.get(f"/api/runs/{run.id}/events",
                                    headers={"Last-Event-ID": str(revision)})
        assert read.status_code == 204
    await app.database.close()


async def test_the_journal_of_a_pruned_run_says_it_was_pruned(make_app: Any) -> None:
    """``handle.journal()`` (and ``app.journal``) of a pruned run raise ``RUN_PRUNED``, as its
    stream does, instead of an empty list that says the run recorded nothing."""
    app = shop(make_app())
    async with running(app):
        run = await app.submit_async("pay", 900)
        assert await run.result_async(timeout=20) == {"paid": 900}
    assert [e.kind for e in await run.journal_async()][-1] == "run.completed"
    await Pruner(app.database, NOW).prune()
    with pytest.raises(RunPruned) as pruned:
        await run.journal_async()
    assert pruned.value.status == "succeeded" and pruned.value.pruned_at is not None
    with pytest.raises(RunPruned):
        await app.journal_async(run.id)
    await app.database.close()


async def test_runs_that_are_never_pruned(make_app: Any, sql: Any) -> None:
    app = shop(make_app())
    async with running(app):
        unknown = await app.submit_async("pay", 1)
        item = await app.submit_async("pay", 2)
        for run in (unknown, item):
            await run.result_async(timeout=20)
        family = await app.submit_async("parent", 3)
        await wait_for(lambda: count(sql, "SELECT count(*) AS n FROM orchestrator.runs "
                                          "WHERE workflow_name = 'child' AND status = "
                                          "'succeeded'") == 1, timeout=20)
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs WHERE id = %s AND "
                                   "status = 'waiting'", (family.id,)), timeout=20)
        # An operation whose outcome is unknown, and an unresolved reconciliation item, on
        # runs that finished (as an operator's tooling or a bug could leave them).
        sql("""INSERT INTO orchestrator.operations (run_id, position, attempt, tool_name,
                   tool_version, effect_class, tenant, principal, intent_digest, arguments,
                   idempotency_key, state)
               SELECT id, 9, 1, 'charge', '1', 'consequential', tenant, principal, 'd', '{}',
                      'k-unknown', 'submitted' FROM orchestrator.runs WHERE id = %s""",
            (unknown.id,))
        sql("UPDATE orchestrator.operations SET state = 'unknown' WHERE idempotency_key = "
            "'k-unknown'")
        sql("""INSERT INTO orchestrator.reconciliation_items (operation_id, run_id, reason)
               SELECT id, run_id, 'TOOL_OUTCOME_UNCERTAIN' FROM orchestrator.operations
               WHERE run_id = %s""", (item.id,))

        report = await Pruner(app.database, NOW).prune()
        assert report.runs == 0  # the child's parent has not finished; the others are held
        assert count(sql, "SELECT count(*) AS n FROM orchestrator.runs "
                          "WHERE pruned_at IS NOT NULL") == 0
        await app.send_event_async(family.id, "go")
        assert await family.result_async(timeout=20) == 3
    report = await Pruner(app.database, NOW).prune()
    assert report.runs == 2  # the parent and its child, now both finished
    kept = {r["id"] for r in sql("SELECT id FROM orchestrator.runs WHERE pruned_at IS NULL")}
    assert kept == {unknown.id, item.id}
    assert count(sql, "SELECT count(*) AS n FROM orchestrator.journal WHERE run_id = %s",
                 unknown.id) > 0


async def test_a_workflow_keeps_its_own_period(make_app: Any, sql: Any) -> None:
    app = shop(make_app())
    async with running(app):
        paid = await app.submit_async("pay", 1)
        await paid.result_async(timeout=20)
        other = await app.submit_async("child", 2)
        await other.result_async(timeout=20)
    rules = Retention(finished_runs=timedelta(days=1), evidence=None,
                      workflows={"pay": timedelta(0)})
    assert (await Pruner(app.database, rules).prune(dry_run=True)).runs == 1
    assert (await Pruner(app.database, rules).prune()).runs == 1
    pruned = [r["id"] for r in sql("SELECT id FROM orchestrator.runs "
                                   "WHERE pruned_at IS NOT NULL")]
    assert pruned == [paid.id]  # "child" keeps the default day


async def test_evidence_outlives_the_journal_is_exported_then_expires(
        make_app: Any, sql: Any, tmp_path: Path) -> None:
    app = shop(make_app())
    async with running(app):
        run = await app.submit_async("pay", 7, idempotency_key="order-7")
        await run.result_async(timeout=20)
    await Pruner(app.database, Retention(finished_runs=timedelta(0),
                                         evidence=timedelta(days=1))).prune()
    assert count(sql, "SELECT count(*) AS n FROM orchestrator.runs") == 1  # within evidence
    with open(tmp_path / "evidence.jsonl", "w", encoding="utf-8") as out:
        counts = (await export_evidence(app.database, out,
                                        since=datetime.now(UTC) - timedelta(hours=1))).counts
    lines = [json.loads(x) for x in (tmp_path / "evidence.jsonl").read_text().splitlines()]
    (op,) = [x for x in lines if x["type"] == "operation"]
    assert counts["operation"] == 1 and op["run_id"] == str(run.id)
    assert op["submission_key"] == "order-7" and op["state"] == "committed"
    assert op["receipt"] == {"charged": 7} and op["intent_digest"]
    assert op["created_at"].endswith("Z")

    report = await Pruner(app.database, Retention(finished_runs=timedelta(0),
                                                  evidence=timedelta(0))).prune()
    assert report.evidence_checked and (report.evidence_runs, report.evidence_operations) == (
        1, 1)
    assert count(sql, "SELECT count(*) AS n FROM orchestrator.runs") == 0
    assert count(sql, "SELECT count(*) AS n FROM orchestrator.operations") == 0
    # Past the evidence period the key is forgotten: the same request is a new run.
    async with running(app):
        fresh = await app.submit_async("pay", 7, idempotency_key="order-7")
        assert fresh.id != run.id and await fresh.result_async(timeout=20) == {"paid": 7}


async def test_the_reconciler_prunes_in_the_background(make_app: Any, sql: Any) -> None:
    app = shop(make_app(retention=Retention(finished_runs=timedelta(seconds=1),
                                            evidence=None)))
    async with running(app):
        runs = [await app.submit_async("pay", n) for n in range(3)]
        for run in runs:
            await run.result_async(timeout=20)
    reconciler = app.create_reconciler(prune_interval=0.2)
    task = asyncio.ensure_future(reconciler.run())
    try:
        await wait_for(lambda: count(sql, "SELECT count(*) AS n FROM orchestrator.runs "
                                          "WHERE pruned_at IS NOT NULL") == 3, timeout=20,
                       what="the reconciler pruned the three runs")
        assert count(sql, "SELECT count(*) AS n FROM orchestrator.journal") == 0
    finally:
        reconciler.request_stop()
        await task


async def test_the_runtime_role_prunes_journals_and_may_not_expire_evidence(
        make_app: Any, make_role: Any, migrated_database_url: str, sql: Any) -> None:
    app = shop(make_app())
    async with running(app):
        await (await app.submit_async("pay", 1)).result_async(timeout=20)
    role = make_role()
    grants.grant_runtime(DatabaseTarget(validate_url(migrated_database_url), "argument"),
                         role.name)
    db = Database(DatabaseTarget(validate_url(role.url), "argument"), max_pool_size=1)
    try:
        report = await Pruner(db, Retention(finished_runs=timedelta(0),
                                            evidence=timedelta(0))).prune()
        assert report.runs == 1 and not report.evidence_checked
        assert count(sql, "SELECT count(*) AS n FROM orchestrator.operations") == 1  # kept
        with pytest.raises(ConfigurationError, match="permission denied for table journal"):
            async with db.connection() as conn:  # and no DELETE on the journal by grant
                await conn.execute("DELETE FROM orchestrator.journal_entries")
    finally:
        await db.close()


def test_the_prune_and_evidence_commands(make_app: Any, migrated_database_url: str,
                                         tmp_path: Path) -> None:
    url = migrated_database_url
    app = shop(make_app())

    async def drive() -> None:
        async with running(app):
            for n in range(5):
                await (await app.submit_async("pay", n)).result_async(timeout=20)

    asyncio.run(drive())
    dry = run_cli(["prune", "--older-than", "0s", "--dry-run", "--json"], database_url=url)
    assert dry.returncode == 0, dry.stderr
    assert json.loads(dry.stdout)["runs"] == 5
    exported = run_cli(["evidence", "export", "--since", "2000-01-01T00:00:00Z", "-o",
                        str(tmp_path / "e.jsonl")], database_url=url)
    assert exported.returncode == 0, exported.stderr
    kinds = [json.loads(x)["type"] for x in (tmp_path / "e.jsonl").read_text().splitlines()]
    assert kinds.count("operation") == 5
    done = run_cli(["prune", "--older-than", "0s", "--batch", "2"], database_url=url)
    assert done.returncode == 0, done.stderr
    assert "pruned 5 finished run(s)" in done.stdout and "3 batch(es)" in done.stdout
    assert "prune: 5 runs pruned" in done.stderr  # progress, batch by batch
    assert "evidence: kept (no evidence period given)" in done.stdout
    refused = run_cli(["prune"], database_url=url)
    assert refused.returncode == 2 and "INVALID_REQUEST" in refused.stderr
    assert "--older-than" in refused.stderr
    bad = run_cli(["prune", "--older-than", "10 fortnights"], database_url=url)
    assert bad.returncode == 2 and "must be a period" in bad.stderr


def test_runs_show_gives_the_time_a_run_was_pruned_as_it_gives_its_other_times(
        make_app: Any, migrated_database_url: str) -> None:
    """`runs show` of a pruned run says `pruned: <time>` in UTC with `Z`, as `created:` and
    `finished:` are, not as Python's isoformat (`+00:00`, microseconds)."""
    url = migrated_database_url
    app = shop(make_app())

    async def drive() -> Any:
        async with running(app):
            run = await app.submit_async("pay", 1)
            await run.result_async(timeout=20)
        await Pruner(app.database, NOW).prune()
        return await run.info_async()

    info = asyncio.run(drive())
    shown = run_cli(["runs", "show", str(info.id)], database_url=url)
    assert shown.returncode == 0, shown.stderr
    fields = dict(re.findall(r"^([a-z ]+):\s+(.*)$", shown.stdout, re.MULTILINE))
    assert info.pruned_at is not None
    stamp = info.pruned_at.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%SZ")
    assert fields["pruned"] == f"{stamp} (journal, input and result deleted by retention)"
    assert re.fullmatch(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ", fields["finished"])


def test_retention_settings_are_checked() -> None:
    assert parse_period("30d", "p") == timedelta(days=30)
    assert parse_period("90m", "p") == timedelta(minutes=90)
    for bad in ("30", "-1d", "1y", ""):
        with pytest.raises(InvalidRequest):
            parse_period(bad, "p")
    with pytest.raises(InvalidRequest) as short:
        Retention(finished_runs=timedelta(days=30), evidence=timedelta(days=7))
    assert short.value.path == "evidence"
    with pytest.raises(InvalidRequest):
        Retention(finished_runs=timedelta(days=1), evidence=timedelta(days=2),
                  workflows={"report": timedelta(days=3)})
    with pytest.raises(InvalidRequest):
        Retention(finished_runs=timedelta(days=-1))
    with pytest.raises(ConfigurationError):
        Orchestrator(retention="30d")  # type: ignore[arg-type]


@pytest.mark.parametrize(("argument", "value"), [
    ("batch", 0), ("batch", -1), ("batch", float("nan")), ("batch", 2.5), ("batch", "10"),
    ("batch", True), ("batch", 100_001),
    ("duty", 0), ("duty", -0.5), ("duty", 1.5), ("duty", float("nan")), ("duty", float("inf")),
    ("duty", "0.5"), ("duty", True),
    ("dry_run", "no"), ("dry_run", 0), ("evidence", "no"), ("evidence", 1),
])
async def test_a_prune_with_a_bad_argument_is_refused_before_anything_is_pruned(
        make_app: Any, sql: Any, argument: str, value: Any) -> None:
    """``app.prune(batch=, duty=, dry_run=, evidence=)`` refuses what is not one of them
    (``INVALID_REQUEST`` naming it, as ``orchestrator prune --batch 0`` does) before it
    prunes anything. ``batch=True`` was taken for a batch of 1 and ``duty=True`` for 1, and
    ``dry_run="no"`` for a dry run: a flag is True or False, never a value's truth."""
    app = shop(make_app(retention=NOW))
    async with running(app):
        run = await app.submit_async("pay", 500)
        assert await run.result_async(timeout=20) == {"paid": 500}
    with pytest.raises(InvalidRequest) as refused:
        await app.prune_async(**{argument: value})
    assert refused.value.path == argument
    assert argument in refused.value.message
    assert count(sql, "SELECT count(*) AS n FROM orchestrator.journal WHERE run_id = %s",
                 run.id) == 3
    assert count(sql, "SELECT count(*) AS n FROM orchestrator.runs "
                      "WHERE pruned_at IS NOT NULL") == 0


async def test_a_dry_run_counts_the_evidence_that_a_prune_expires(
        make_app: Any, sql: Any) -> None:
    """A parent's evidence goes only once its child's is gone: the dry run counts what the
    prune would expire now, not the parent held back by its child."""
    app = shop(make_app())
    async with running(app):
        family = await app.submit_async("parent", 3)
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs WHERE id = %s AND "
                                   "status = 'waiting'", (family.id,)), timeout=20)
        await app.send_event_async(family.id, "go")
        assert await family.result_async(timeout=20) == 3
    rules = Retention(finished_runs=timedelta(0), evidence=timedelta(0))
    assert (await Pruner(app.database, rules).prune(evidence=False)).runs == 2
    dry = await Pruner(app.database, rules).prune(dry_run=True)
    report = await Pruner(app.database, rules).prune()
    assert report.evidence_runs == 1  # the child; its parent at the next prune
    assert (dry.evidence_runs, dry.evidence_incidents) == (
        report.evidence_runs, report.evidence_incidents)
    assert (await Pruner(app.database, rules).prune()).evidence_runs == 1
    assert count(sql, "SELECT count(*) AS n FROM orchestrator.runs") == 0


async def test_the_audit_of_a_run_that_waits_for_a_resolution_is_not_expired(
        make_app: Any, sql: Any) -> None:
    """An operator settled a call's first attempt (not applied: sent again) and the second was
    lost as well: the run waits for a resolution again, so it is kept, and so is the audit of
    what was done to it, however old. Once the run has finished, been pruned and its evidence
    period has passed, the audit goes with it."""
    app = make_app()
    sent = {"n": 0}

    @app.tool()
    async def charge(ctx, *, cents):  # type: ignore[no-untyped-def]
        sent["n"] += 1
        if sent["n"] <= 2:
            raise ConnectionResetError("lost after sending")
        return {"charged": cents}

    @app.workflow()
    async def pay(ctx, cents):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, cents=cents)

    def waiting(attempts: int) -> bool:
        parked = sql("SELECT 1 FROM orchestrator.runs WHERE status = 'needs_reconciliation'")
        return bool(parked) and count(sql, "SELECT count(*) AS n FROM orchestrator."
                                           "reconciliation_items") == attempts

    rules = Retention(finished_runs=timedelta(0), evidence=timedelta(0))
    operators = Operators(app.database)
    async with running(app):
        run = await app.submit_async("pay", 5)
        await wait_for(lambda: waiting(1), timeout=20, what="the first attempt is queued")
        (first,) = sql("SELECT id FROM orchestrator.operations")
        await operators.resolve_not_applied(first["id"], evidence="the PSP has none",
                                            operator="alice")
        await wait_for(lambda: waiting(2), timeout=20, what="the second attempt is queued")
        dry = await Pruner(app.database, rules).prune(dry_run=True)
        report = await Pruner(app.database, rules).prune()
        assert (report.runs, report.evidence_audit, dry.evidence_audit) == (0, 0, 0)
        assert [(a["action"], a["target_id"]) for a in sql(
            "SELECT action, target_id FROM orchestrator.operator_audit")] == [
            ("resolve.not_applied", str(first["id"]))]

        (second,) = sql("SELECT id FROM orchestrator.operations WHERE state = 'unknown'")
        await operators.resolve_committed(second["id"], receipt={"charged": 5},
                                          evidence="found it", operator="alice")
        assert await run.result_async(timeout=20) == {"charged": 5}
    report = await Pruner(app.database, rules).prune()
    assert (report.runs, report.evidence_runs, report.evidence_audit) == (1, 1, 2)
    assert count(sql, "SELECT count(*) AS n FROM orchestrator.operator_audit") == 0


async def test_the_exports_of_consecutive_periods_hold_each_operation_as_it_ended(
        make_app: Any, sql: Any) -> None:
    """A call's outcome is unknown when one period is exported, and an operator settles it in
    the next: the next period's export holds the operation with its receipt and its item
    resolved, so the archive has what the evidence period will delete."""
    app = make_app()

    @app.tool()
    async def charge(ctx, *, cents):  # type: ignore[no-untyped-def]
        raise ConnectionResetError("lost after sending")

    @app.workflow()
    async def pay(ctx, cents):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, cents=cents)

    async def export(since: datetime, until: datetime) -> list[dict[str, Any]]:
        out = io.StringIO()
        await export_evidence(app.database, out, since=since, until=until)
        return [json.loads(line) for line in out.getvalue().splitlines()]

    start = datetime.now(UTC)
    async with running(app):
        run = await app.submit_async("pay", 9)
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs "
                                   "WHERE status = 'needs_reconciliation'"), timeout=20)
        middle = datetime.now(UTC)
        first = await export(start, middle)
        (op,) = [x for x in first if x["type"] == "operation"]
        assert op["state"] == "unknown" and op["receipt"] is None
        await Operators(app.database).resolve_committed(
            op["id"], receipt={"charged": 9}, evidence="the PSP shows it", operator="alice")
        assert await run.result_async(timeout=20) == {"charged": 9}
        second = await export(middle, datetime.now(UTC))
    archive = first + second
    last = {(x["type"], x["id"]): x for x in archive}  # the last line of each row
    assert last[("operation", op["id"])]["state"] == "committed"
    assert last[("operation", op["id"])]["receipt"] == {"charged": 9}
    (item,) = [x for key, x in last.items() if key[0] == "reconciliation_item"]
    assert (item["state"], item["resolution"]) == ("resolved", "committed")
    assert [x["action"] for x in archive if x["type"] == "audit"] == ["resolve.committed"]


async def test_a_period_too_long_to_count_back_from_now_is_refused(
        make_app: Any, migrated_database_url: str) -> None:
    """A period that reaches back before any time the database holds (or past what Python
    counts) is refused as bad input naming the longest one, not failed as an internal error."""
    app = shop(make_app())
    async with running(app):
        await (await app.submit_async("pay", 1)).result_async(timeout=20)
    for option in ("--older-than", "--evidence-older-than"):
        for period in ("100000000d", "99999999999999w"):
            args = ["prune", "--dry-run"] + (["--older-than", "30d"]
                                             if option != "--older-than" else [])
            done = run_cli([*args, option, period], database_url=migrated_database_url)
            assert done.returncode == 2, (option, period, done.returncode, done.stderr)
            assert f"INVALID_REQUEST: {option} must be at most 36600 days" in done.stderr
    with pytest.raises(InvalidRequest) as long:
        Retention(finished_runs=timedelta(days=1), evidence=timedelta(days=36601))
    assert long.value.path == "evidence"


async def test_an_export_reads_one_snapshot_and_reports_where_the_next_period_starts(
        make_app: Any, sql: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """An export pages through every kind of evidence in one snapshot: what changes while it
    pages (here, after its first page of operations, an audit row deleted as an evidence
    expiry would, and another written) does not change what it writes, and the export reports
    the cutoff it used, from which the next period holds the row written meanwhile. So
    consecutive periods miss nothing."""
    app = shop(make_app())
    start = datetime.now(UTC)
    audit = ("INSERT INTO orchestrator.operator_audit (operator, action, target_kind, "
             "target_id, evidence) VALUES ('alice', 'note', 'run', 'r-1', %s)")
    sql(audit, ("written before the export",))
    async with running(app):
        for n in range(3):
            await (await app.submit_async("pay", n)).result_async(timeout=20)
    monkeypatch.setattr(retention, "EXPORT_PAGE", 1)

    def meanwhile(kind: str, written: int) -> None:
        if (kind, written) == ("operation", 1):
            sql("DELETE FROM orchestrator.operator_audit")
            sql(audit, ("written during the export",))

    out = io.StringIO()
    first = await export_evidence(app.database, out, since=start, progress=meanwhile)
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [x["type"] for x in rows].count("operation") == 3
    assert [x["evidence"] for x in rows if x["type"] == "audit"] == ["written before the export"]
    assert first.counts["operation"] == 3 and first.since == start
    assert start < first.until <= datetime.now(UTC)
    out = io.StringIO()
    second = await export_evidence(app.database, out, since=first.until)
    rows = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [x["evidence"] for x in rows if x["type"] == "audit"] == ["written during the export"]
    assert second.counts["operation"] == 0


def test_the_export_command_prints_the_cutoff_it_used(make_app: Any, migrated_database_url: str,
                                                     tmp_path: Path) -> None:
    """Without --until the export stops at the time it read the evidence, and says so, in its
    summary and in --json, so that the next period starts there."""
    url = migrated_database_url
    before = datetime.now(UTC)
    done = run_cli(["evidence", "export", "--since", "2000-01-01T00:00:00Z", "-o",
                    str(tmp_path / "e.jsonl"), "--json"], database_url=url)
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    until = datetime.fromisoformat(summary["until"])
    assert before <= until <= datetime.now(UTC)
    # docs/cli-json.md: every time in UTC with microseconds and Z, the one given too
    assert summary["since"] == "2000-01-01T00:00:00.000000Z"
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{6}Z", summary["until"])
    assert summary["output"] == str(tmp_path / "e.jsonl")
    assert set(summary["counts"]) == {"operation", "reconciliation_item", "lookup", "audit",
                                      "incident"}
    text = run_cli(["evidence", "export", "--since", "2000-01-01T00:00:00Z"], database_url=url)
    assert text.returncode == 0, text.stderr
    assert text.stdout == ""  # no evidence yet: stdout holds the evidence only
    assert "next period: --since " in text.stderr
    refused = run_cli(["evidence", "export", "--since", "2000-01-01T00:00:00Z", "--json"],
                      database_url=url)
    assert refused.returncode == 2 and "INVALID_REQUEST" in refused.stderr


async def test_a_batch_whose_commit_was_lost_is_counted_in_the_report(
        make_app: Any, sql: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The connection goes while a batch's COMMIT is under way, and it applied: run again by
    the storage layer, the batch finds its runs pruned, by its own hand. The report counts
    them (not only the runs of the batch after it)."""
    app = shop(make_app())
    runs = [await app.submit_async("child", n) for n in range(3)]
    for run in runs:
        await app.cancel_async(run.id)
    lose_the_next_commit(monkeypatch, app.database)
    report = await Pruner(app.database, NOW, batch=2).prune()
    assert (report.runs, report.batches) == (3, 2)
    assert count(sql, "SELECT count(*) AS n FROM orchestrator.runs "
                      "WHERE pruned_at IS NOT NULL") == 3
