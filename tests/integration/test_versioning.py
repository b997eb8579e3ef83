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


def staged(stage: str, app: Orchestrator, calls: Any) -> Orchestrator:
    """``flow`` at one step of a patch's life (docs/versioning.md, "Patches"): ``old`` charges
    with ``charge_old``; ``patched`` puts ``charge_new`` behind ``ctx.patched("p")``;
    ``deprecated`` keeps ``charge_new`` after ``ctx.deprecate_patch("p")``; ``removed`` calls
    it alone. A run parks on the event ``one`` before the patch and on ``two`` after it."""
    for name in ("charge_old", "charge_new", "ship"):
        def tool(name: str = name) -> None:
            @app.tool(name=name)
            async def counted(ctx, *, n):  # type: ignore[no-untyped-def]
                calls[name] += 1
                return n
        tool()

    @app.workflow()
    async def flow(ctx, n):  # type: ignore[no-untyped-def]
        await ctx.wait_for_event("one")  # position 0
        new = (stage == "patched" and ctx.patched("p")) or stage in ("deprecated", "removed")
        if stage == "deprecated":
            ctx.deprecate_patch("p")
        await ctx.call("charge_new" if new else "charge_old", n=n)  # position 1
        await ctx.wait_for_event("two")  # position 2
        await ctx.call("ship", n=n)
        return "new" if new else "old"

    return app


async def test_a_patch_answers_alike_on_every_step_of_its_life_on_live_workers(
        make_app: Any) -> None:
    """Each run keeps the path it took, whichever step's code replays it: a run that took the
    old path replays down it on the patched code (and meets ``NONDETERMINISM`` on the
    deprecated one, as documented); one that parked before the patch takes the new path; one
    that recorded the marker (under the patched or the deprecated code) replays down the new
    path on the patched, deprecated and removed code alike. Each charge is sent once."""
    from collections import Counter

    calls: Counter[str] = Counter()

    async def parked(app: Orchestrator, run: Any, charged: bool) -> bool:
        journal = await run.journal_async()
        return (await run.status_async() == "waiting"
                and any(e.kind == "call.completed" for e in journal) == charged)

    async def start(app: Orchestrator, n: int, *, charge: bool = True) -> Any:
        run = await app.submit_async("flow", n)
        if charge:
            await app.send_event_async(run.id, "one")
        await wait_for(lambda: parked(app, run, charge), timeout=20, what=f"run {n} parked")
        return run

    async def finish(app: Orchestrator, *runs: Any) -> list[Any]:
        for run in runs:
            await app.send_event_async(run.id, "two")
        answers = []
        for run in runs:
            try:
                answers.append(await run.result_async(timeout=20))
            except RunFailed as exc:
                answers.append(exc.code)
        return answers

    old = staged("old", make_app(), calls)
    async with running(old):
        old_path, before_patch, old_then_deprecated = (
            await start(old, 1), await start(old, 2, charge=False), await start(old, 3))
    patched = staged("patched", make_app(), calls)
    async with running(patched):
        await patched.send_event_async(before_patch.id, "one")
        to_deprecated, to_removed = await start(patched, 4), await start(patched, 5)
        assert await finish(patched, old_path, before_patch) == ["old", "new"]
    deprecated = staged("deprecated", make_app(), calls)
    async with running(deprecated):
        to_patched, deprecated_to_removed = await start(deprecated, 6), await start(deprecated, 7)
        assert await finish(deprecated, to_deprecated, old_then_deprecated) == [
            "new", "NONDETERMINISM"]
    async with running(patched := staged("patched", make_app(), calls)):
        assert await finish(patched, to_patched) == ["new"]
    removed = staged("removed", make_app(), calls)
    async with running(removed):
        assert await finish(removed, to_removed, deprecated_to_removed) == ["new", "new"]
    assert calls == {"charge_old": 2, "charge_new": 5, "ship": 6}
    markers = {r.id: [e.position for e in await r.journal_async() if e.kind == "patch"]
               for r in (old_path, before_patch, to_deprecated, to_patched)}
    assert markers == {old_path.id: [], before_patch.id: [1], to_deprecated.id: [1],
                       to_patched.id: [1]}


async def test_a_patch_asked_in_a_loop_answers_for_each_point(make_app: Any) -> None:
    """Each ``ctx.patched`` answers for its own point (docs/versioning.md): a run that started
    on the old code takes the old path in the iterations its journal holds and the new one
    after them; a check made once, before the loop, keeps the whole run on one path."""
    from collections import Counter

    calls: Counter[str] = Counter()

    def code(stage: str) -> Orchestrator:
        app = make_app()
        for name in ("old", "new"):
            def tool(name: str = name) -> None:
                @app.tool(name=name)
                async def counted(ctx, *, i):  # type: ignore[no-untyped-def]
                    calls[name] += 1
                    return name
            tool()

        @app.workflow()
        async def each(ctx, _):  # type: ignore[no-untyped-def]
            took = []
            for i in range(2):
                await ctx.wait_for_event(f"go{i}")
                new = stage == "patched" and ctx.patched("p")
                took.append(await ctx.call("new" if new else "old", i=i))
            return took

        @app.workflow()
        async def once(ctx, _):  # type: ignore[no-untyped-def]
            new = stage == "patched" and ctx.patched("p")
            took = []
            for i in range(2):
                await ctx.wait_for_event(f"go{i}")
                took.append(await ctx.call("new" if new else "old", i=i))
            return took

        return app

    async def halfway(app: Orchestrator, workflow: str) -> Any:
        run = await app.submit_async(workflow, None)
        await app.send_event_async(run.id, "go0")
        await wait_for(lambda: _charged_once(run), timeout=20, what="the first iteration")
        return run

    old = code("old")
    async with running(old):
        each, once = await halfway(old, "each"), await halfway(old, "once")
    patched = code("patched")
    async with running(patched):
        for run in (each, once):
            await patched.send_event_async(run.id, "go1")
        assert await each.result_async(timeout=20) == ["old", "new"]
        assert await once.result_async(timeout=20) == ["old", "old"]
    assert calls == {"old": 3, "new": 1}


async def _charged_once(run: Any) -> bool:
    journal = await run.journal_async()
    return (await run.status_async() == "waiting"
            and [e.kind for e in journal].count("call.completed") == 1)
