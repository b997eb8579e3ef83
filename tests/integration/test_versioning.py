"""Changing workflow code safely (docs/versioning.md): patches, versions side by side, and
the offline replay check, library and CLI, which dispatches nothing."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest

from orchestrator import Orchestrator, Retention, RunFailed, RunPruned
from orchestrator.errors import InvalidRequest
from orchestrator.retention import Pruner
from orchestrator.testing import replay, replay_async
from tests.clitools import run_cli
from tests.integration.conftest import running, wait_for
from tests.integration.versioned_apps import CALLS, build

APP = "tests.integration.versioned_apps"


def kinds_at(journal: list[Any], position: int) -> list[str]:
    return [e.kind for e in journal if e.position == position]


async def test_a_parked_run_keeps_the_old_branch_and_a_new_run_takes_the_patch(
        make_app: Any, sql: Any) -> None:
    CALLS.clear()
    old = build("old", make_app())
    async with running(old):
        first = await old.submit_async("order", 1)
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs WHERE status = 'waiting'"),
                       timeout=20, what="the run parked on its event")
    assert CALLS == {"charge_old": 1}

    new = build("patched", make_app())
    async with running(new):
        second = await new.submit_async("order", 2)
        await wait_for(lambda: len(sql("SELECT 1 FROM orchestrator.runs "
                                       "WHERE status = 'waiting'")) == 2,
                       timeout=20, what="the new run parked on its event")
        for run in (first, second):
            await new.send_event_async(run.id, "go")
        assert await first.result_async(timeout=20) == "old"  # resumed on new code
        assert await second.result_async(timeout=20) == "new"
    assert CALLS == {"charge_old": 1, "charge_new": 1, "ship": 2}
    journal = await second.journal_async()
    assert [(e.kind, e.position, e.name) for e in journal if e.kind == "patch"] == [
        ("patch", 0, "new-charge")]
    assert kinds_at(journal, 0) == ["patch", "call.submitted", "call.completed"]
    assert not [e for e in await first.journal_async() if e.kind == "patch"]

    # The replay check: the patched code and the deprecated one replay the run that took
    # the new path; removing the patch too early is caught on the run that took the old one.
    CALLS.clear()
    verdicts = {}
    for variant in ("patched", "deprecated", "early"):
        code = build(variant, make_app())
        verdicts[variant] = await replay_async(code, [first, second])
    assert [v.verdict for v in verdicts["patched"]] == ["ok", "ok"]
    assert [v.verdict for v in verdicts["deprecated"]] == ["nondeterminism", "ok"]
    early_old, early_new = verdicts["early"]
    assert (early_old.verdict, early_old.position, early_old.recorded, early_old.issued) == (
        "nondeterminism", 0, "call 'charge_old'", "call 'charge_new'")
    assert early_new.ok  # a marker is not a command: code without the patch replays it
    assert CALLS == {}  # nothing dispatched


async def test_the_replay_check_finds_changed_commands_and_passes_compatible_code(
        make_app: Any) -> None:
    CALLS.clear()
    app = build("old", make_app())
    async with running(app):
        run = await app.submit_async("steps", 3)
        assert await run.result_async(timeout=20) == 3
    assert CALLS == {"a": 1, "b": 1, "c": 1}
    CALLS.clear()
    found = {}
    for variant in ("old", "reordered", "renamed", "no_sleep", "compatible"):
        code = build(variant, make_app())
        (found[variant],) = await replay_async(code, [run.id])
    assert CALLS == {}  # no tool was called by any check
    assert found["old"].ok and found["old"].commands == 4
    assert found["compatible"].ok
    assert (found["reordered"].position, found["reordered"].recorded,
            found["reordered"].issued) == (0, "call 'a'", "call 'b'")
    assert (found["renamed"].position, found["renamed"].recorded,
            found["renamed"].issued) == (0, "call 'a'", "call 'a2'")
    assert (found["no_sleep"].position, found["no_sleep"].recorded,
            found["no_sleep"].issued) == (2, "sleep", "call 'c'")
    for variant in ("reordered", "renamed", "no_sleep"):
        assert found[variant].verdict == "nondeterminism"
        assert found[variant].message.startswith("NONDETERMINISM: position ")


async def test_other_arguments_a_dropped_command_and_a_run_in_flight(make_app: Any) -> None:
    app = build("old", make_app())
    async with running(app):
        done = await app.submit_async("steps", 5)
        await done.result_async(timeout=20)
        parked = await app.submit_async("order", 7)
        await wait_for(lambda: _status(app, parked.id), timeout=20, what="the run parked")
    export = await _export(app, done.id)
    export["journal"] = [e for e in export["journal"]
                         if not (e["position"] == 3 and e["kind"].startswith("call."))]
    export["run"]["input"] = 6  # the code now calls a with n=6: another intent
    (changed,) = await replay_async(app, [export])
    assert (changed.verdict, changed.position) == ("nondeterminism", 0)
    assert "other arguments" in changed.message

    (in_flight,) = await replay_async(app, [parked.id])
    assert in_flight.ok and in_flight.position == 1  # waits for its event there
    assert "history ends at position 1" in in_flight.message


async def test_a_check_that_finds_a_difference_leaves_no_task_error_behind(
        make_app: Any, caplog: pytest.LogCaptureFixture) -> None:
    """The check reports the first difference in its verdict, and that is all it says:
    the code's failure is taken, not left for the event loop to complain about (`Task
    exception was never retrieved` on stderr after the report of `orchestrator replay`)."""
    app = build("old", make_app())
    async with running(app):
        run = await app.submit_async("steps", 3)
        assert await run.result_async(timeout=20) == 3
    caplog.set_level(logging.ERROR, logger="asyncio")
    (found,) = await replay_async(build("reordered", make_app()), [run.id])
    assert found.verdict == "nondeterminism"
    gc.collect()
    assert [r.getMessage() for r in caplog.records if r.name == "asyncio"] == []


async def _status(app: Orchestrator, run_id: Any) -> bool:
    return await (await app.get_run_async(run_id)).status_async() == "waiting"


async def _export(app: Orchestrator, run_id: Any) -> dict[str, Any]:
    from orchestrator import replay

    async with app.database.connection() as conn:
        (run,) = await replay.load_runs(conn, run_id=run_id, last=1)
    return json.loads(json.dumps(replay.export_document(run), default=str))


def test_versions_nine_and_ten_and_the_default(make_app: Any) -> None:
    app = make_app()
    for version in ("9", "10", "2"):
        @app.workflow(name="report", version=version)
        async def report(ctx, n):  # type: ignore[no-untyped-def]
            return n

    assert app.submit("report", 1).info().version == "10"  # numeric: "10" after "9"
    pinned = make_app()
    for version, default in (("9", True), ("10", False)):
        @pinned.workflow(name="report", version=version, default=default)
        async def report2(ctx, n):  # type: ignore[no-untyped-def]
            return n

    assert pinned.submit("report", 2).info().version == "9"
    assert pinned.submit("report", 3, version="10").info().version == "10"
    with pytest.raises(InvalidRequest) as caught:
        @pinned.workflow(name="report", version="11", default=True)
        async def report3(ctx, n):  # type: ignore[no-untyped-def]
            return n
    assert caught.value.path == "default" and "both marked default=True" in str(caught.value)


def test_the_replay_command_with_the_database_and_with_an_exported_file(
        migrated_database_url: str, make_app: Any, tmp_path: Path) -> None:
    url = migrated_database_url
    app = build("old", make_app())

    async def drive() -> Any:
        async with running(app):
            run = await app.submit_async("steps", 4)
            await run.result_async(timeout=20)
            return run

    run = asyncio.run(drive())
    exported = run_cli(["runs", "export", str(run.id), "-o", str(tmp_path / "run.json")],
                       database_url=url)
    assert exported.returncode == 0, exported.stderr
    doc = json.loads((tmp_path / "run.json").read_text())
    assert doc["format"] == "orchestrator.run" and doc["run"]["workflow"] == "steps"

    ok = run_cli(["replay", "--app", f"{APP}:compatible", "--workflow", "steps"],
                 database_url=url)
    assert ok.returncode == 0, ok.stderr
    assert "1 run(s) checked: 1 ok, 0 differ" in ok.stdout

    bad = run_cli(["replay", "--app", f"{APP}:reordered", "--run", str(run.id), "--json"],
                  database_url=url)
    assert bad.returncode == 1, bad.stderr
    (verdict,) = json.loads(bad.stdout)["runs"]
    assert (verdict["verdict"], verdict["position"], verdict["recorded"],
            verdict["issued"]) == ("nondeterminism", 0, "call 'a'", "call 'b'")

    # No database at all: the file alone (an unreachable URL proves nothing is read).
    offline = run_cli(["replay", "--app", f"{APP}:no_sleep", "--from-file",
                       str(tmp_path / "run.json")],
                      database_url="postgresql://nobody@127.0.0.1:9/none")
    assert offline.returncode == 1, offline.stderr
    assert "NONDETERMINISM: position 2: the journal recorded sleep, the code issued call 'c'" \
        in offline.stdout
    assert "1 run(s) checked: 0 ok, 1 differ" in offline.stdout

    bad_file = tmp_path / "junk.json"
    bad_file.write_text('{"format": "something else"}')
    refused = run_cli(["replay", "--app", f"{APP}:old", "--from-file", str(bad_file)],
                      database_url=url)
    assert refused.returncode == 2
    assert "INVALID_REQUEST" in refused.stderr and "not a run export" in refused.stderr


async def test_a_run_whose_version_no_live_worker_has_waits_and_says_so(make_app: Any) -> None:
    from orchestrator import admin

    def register(app: Orchestrator, *versions: str) -> None:
        for version in versions:
            one(app, version)

    def one(app: Orchestrator, version: str) -> None:
        @app.workflow(name="report", version=version)
        async def report(ctx, n):  # type: ignore[no-untyped-def]
            return version

    submitter = make_app()
    register(submitter, "1", "2")
    old = await submitter.submit_async("report", 1, version="1")
    newer = make_app()
    register(newer, "2")
    async with running(newer):
        fresh = await newer.submit_async("report", 2)
        assert await fresh.result_async(timeout=20) == "2"
        rows = {r["id"]: r for r in await admin.list_runs(newer.database)}
        assert rows[old.id]["status"] == "queued"  # never claimed, never failed
        assert rows[old.id]["blocked"] == "no worker has report@1"
        detail = await admin.show_run(newer.database, old.id)
        assert detail.run["blocked"] == "no worker has report@1"
        assert (detail.note or "").startswith("no worker has report@1")
    both = make_app()
    register(both, "1", "2")
    async with running(both):
        assert await old.result_async(timeout=20) == "1"


async def test_the_check_finds_a_changed_command_inside_a_task_group_as_a_worker_does(
        make_app: Any) -> None:
    """Workflow code that issues its commands in an ``asyncio.TaskGroup`` gets a
    ``NONDETERMINISM`` wrapped in the group's exception: a worker takes it out of the group
    and fails the run; the check reports the same difference at the same position (not
    ``ok``, nor the end of the code where the journal holds more)."""

    def build_code(tool: str) -> Orchestrator:
        app = make_app()

        @app.tool(name="reserve")
        async def reserve(ctx):  # type: ignore[no-untyped-def]
            return "reserved"

        @app.tool(name="hold")
        async def hold(ctx):  # type: ignore[no-untyped-def]
            return "held"

        @app.workflow(name="grouped")
        async def grouped(ctx, _):  # type: ignore[no-untyped-def]
            async with asyncio.TaskGroup() as group:
                first = group.create_task(ctx.call(tool))
            return [first.result(), await ctx.wait_for_event("go")]

        return app

    old, new = build_code("reserve"), build_code("hold")
    async with running(old):
        run = await old.submit_async("grouped", None)
        await wait_for(lambda: _status(old, run.id), timeout=20, what="the run parked")

    (verdict,) = await replay_async(new, [run.id])
    assert (verdict.verdict, verdict.position, verdict.recorded, verdict.issued) == (
        "nondeterminism", 0, "call 'reserve'", "call 'hold'")
    assert (await replay_async(old, [run.id]))[0].ok  # the code that wrote it replays it

    await new.send_event_async(run.id, "go", "now")
    async with running(new):  # a worker with the new code agrees
        with pytest.raises(RunFailed) as failed:
            await run.result_async(timeout=20)
    assert failed.value.code == "NONDETERMINISM"



def test_the_check_leaves_out_pruned_runs_and_refuses_one_named(
        migrated_database_url: str, make_app: Any, tmp_path: Path) -> None:
    """A pruned run's journal and input are gone: there is no history to check. The replay
    check selects only runs whose history is kept, instead of running the code on no input
    against an empty journal and calling that ``ok``; a pruned run named (``--run``, a handle,
    ``runs export``) is ``RUN_PRUNED``, with nothing checked or written."""
    url = migrated_database_url
    app = build("old", make_app())

    async def drive() -> Any:
        async with running(app):
            pruned = await app.submit_async("steps", 5)
            await pruned.result_async(timeout=20)
            report = await Pruner(app.database, Retention(finished_runs=timedelta(0),
                                                          evidence=None)).prune()
            assert report.runs == 1
            kept = await app.submit_async("steps", 4)
            await kept.result_async(timeout=20)
        return kept, pruned

    kept, pruned = asyncio.run(drive())
    checked = run_cli(["replay", "--app", f"{APP}:reordered", "--workflow", "steps", "--json"],
                      database_url=url)
    assert checked.returncode == 1, checked.stderr
    assert [v["run_id"] for v in json.loads(checked.stdout)["runs"]] == [str(kept.id)]

    named = run_cli(["replay", "--app", f"{APP}:old", "--run", str(pruned.id)], database_url=url)
    assert named.returncode == 2 and "RUN_PRUNED" in named.stderr, named
    exported = run_cli(["runs", "export", str(pruned.id), "-o", str(tmp_path / "p.json")],
                       database_url=url)
    assert exported.returncode == 2 and "RUN_PRUNED" in exported.stderr, exported
    assert not (tmp_path / "p.json").exists()
    with pytest.raises(RunPruned):
        replay(app, [pruned])
    assert [v.ok for v in replay(app, [kept])] == [True]
