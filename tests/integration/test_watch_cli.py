"""``orchestrator runs watch`` (CONTRACT C14): a line per journal entry as it is committed, in
the words of ``runs show``, then the outcome; the exit status says how the run ended;
``--json`` prints JSON lines; ``--after`` resumes after an entry."""

from __future__ import annotations

import asyncio
import json
import uuid
from datetime import timedelta

from orchestrator import Retention, WorkflowError
from orchestrator.cli.records import iso
from orchestrator.retention import Pruner
from tests.integration.conftest import running, wait_for
from tests.integration.test_ops_bulk import cli


def _app(make_app):  # type: ignore[no-untyped-def]
    app = make_app()

    @app.tool()
    async def charge(ctx, *, cents):  # type: ignore[no-untyped-def]
        return {"charged": cents}

    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        ctx.publish({"stage": "charging"})
        receipt = await ctx.call(charge, cents=data["cents"])
        await ctx.wait_for_event("go")
        if data.get("fail"):
            raise WorkflowError("the card was declined")
        return receipt

    return app, pay


async def test_watch_follows_live_and_exits_by_the_outcome(make_app, sql, migrated_database_url):
    url = migrated_database_url
    app, pay = _app(make_app)
    async with running(app):
        good = await app.submit_async(pay, {"cents": 5})
        bad = await app.submit_async(pay, {"cents": 7, "fail": True})
        gone = await app.submit_async(pay, {"cents": 9})
        await wait_for(lambda: len(sql("SELECT 1 FROM orchestrator.runs "
                                       "WHERE status = 'waiting'")) == 3)
        watches = [asyncio.ensure_future(cli(url, "runs", "watch", str(r.id)))
                   for r in (good, bad, gone)]
        as_json = asyncio.ensure_future(cli(url, "runs", "watch", str(good.id), "--json"))
        await wait_for(lambda: len(sql(
            "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() AND query "
            "LIKE '%WITH asked AS%moved AS%' "  # each one's poll (journal_poll), not this one
            "AND pid <> pg_backend_pid()")) >= 4)
        await asyncio.sleep(0.2)
        assert not any(w.done() for w in watches)  # they follow: the runs are not finished
        for run in (good, bad):
            await app.send_event_async(run.id, "go")
        await gone.cancel_async()
        (ok, out, err), (failed, bad_out, _), (cancelled, gone_out, _) = await asyncio.wait_for(
            asyncio.gather(*watches), 30)
        json_code, json_out, _ = await as_json
        journal = await good.journal_async()

    assert (ok, failed, cancelled, json_code) == (0, 1, 1, 0), err
    header, *lines = out.splitlines()
    # the columns are labelled as in `runs show`'s timeline, each label over its column
    assert header.split() == ["SEQ", "AT", "POS", "EVENT", "NAME", "DETAIL"]
    assert header.index("AT") == lines[0].index(str(journal[0].at.year))
    assert header.index("EVENT") == lines[0].index("message")
    assert header.index("DETAIL") == lines[0].index('{"stage"')
    assert [line.split()[0] for line in lines[:-1]] == ["1", "2", "3", "4", "5", "6"]
    assert '{"stage": "charging"}' in lines[0] and "message" in lines[0]
    assert "attempt 1 sent (operation" in lines[1]
    # the names ("-", "charge", "go", …) are padded: every detail starts in one column
    starts = {lines[0].index('{"stage"'), lines[1].index("attempt 1 sent"),
              lines[2].index("operation "), lines[5].index("the run succeeded")}
    assert len(starts) == 1, lines
    assert "committed" in lines[2] and "event.wait" in lines[3]
    assert "run.completed" in lines[5] and "the run succeeded" in lines[5]
    assert lines[-1] == f'run {good.id} succeeded; result {{"charged": 5}}'
    assert "the run failed: WORKFLOW_FAILED: the card was declined" in bad_out.splitlines()[-2]
    assert "the run was cancelled" in gone_out.splitlines()[-2]
    last = bad_out.splitlines()[-1]
    assert last.startswith(f"run {bad.id} failed: WORKFLOW_FAILED: the card was declined "
                           "(incident ")
    assert gone_out.splitlines()[-1] == f"run {gone.id} cancelled"

    records = [json.loads(line) for line in json_out.splitlines()]
    assert records[:-1] == [{"type": "entry", "seq": e.seq, "kind": e.kind,
                             "at": iso(e.at),
                             "position": e.position, "name": e.name, "payload": e.payload}
                            for e in journal]
    assert records[-1]["type"] == "outcome"
    assert {k: records[-1][k] for k in ("run_id", "status", "outcome_code", "result",
                                        "error")} == {
        "run_id": str(good.id), "status": "succeeded", "outcome_code": None,
        "result": {"charged": 5}, "error": None}

    code, out, _ = await cli(url, "runs", "watch", str(good.id), "--after", "4")
    assert code == 0
    assert [line.split()[0] for line in out.splitlines()[:-1]] == ["SEQ", "5", "6"]
    code, out, _ = await cli(url, "runs", "watch", str(good.id), "--after", "6")
    assert (code, out) == (0, f'run {good.id} succeeded; result {{"charged": 5}}\n')


async def test_watch_refuses_a_missing_run_and_a_bad_cursor(migrated_database_url):
    url = migrated_database_url
    code, out, err = await cli(url, "runs", "watch", str(uuid.uuid4()))
    assert (code, out) == (2, "") and "ACCESS_DENIED" in err
    code, out, err = await cli(url, "runs", "watch", str(uuid.uuid4()), "--after", "-1")
    assert (code, out) == (2, "") and "INVALID_REQUEST" in err and "after" in err
    code, out, err = await cli(url, "runs", "watch", "not-a-run")
    assert (code, out) == (2, "") and "INVALID_REQUEST" in err


async def test_watch_of_a_pruned_run_says_so_instead_of_an_empty_stream(
        make_app, sql, migrated_database_url):
    """A run that retention pruned has no journal to follow: `runs watch` answers
    `RUN_PRUNED` (exit 2, nothing on stdout) as its stream does everywhere else
    (docs/retention.md), not an empty timeline and a `result null` the run never had; a
    cursor already at its end has nothing to miss."""
    url = migrated_database_url
    app, pay = _app(make_app)
    async with running(app):
        run = await app.submit_async(pay, {"cents": 5})
        await wait_for(lambda: len(sql("SELECT 1 FROM orchestrator.runs "
                                       "WHERE status = 'waiting'")) == 1)
        await app.send_event_async(run.id, "go")
        await run.result_async(timeout=20)
    revision = (await run.info_async()).revision
    report = await Pruner(app.database, Retention(finished_runs=timedelta(0),
                                                  evidence=None)).prune()
    assert report.runs == 1
    code, out, err = await cli(url, "runs", "watch", str(run.id))
    assert (code, out) == (2, ""), (out, err)
    assert "RUN_PRUNED" in err
    code, out, err = await cli(url, "runs", "watch", str(run.id), "--json")
    assert (code, out) == (2, "") and "RUN_PRUNED" in err
    code, out, err = await cli(url, "runs", "watch", str(run.id), "--after", str(revision))
    assert code == 0 and out.startswith(f"run {run.id} succeeded"), (out, err)


async def test_a_child_run_and_an_event_are_told_in_words(make_app, migrated_database_url):
    """``runs show`` and ``runs watch`` say what a child run and an event did, as they do for
    a call: a timeline whose child and event entries read ``{}`` (their payload is left out of
    the table) tells a reader nothing."""
    app = make_app()

    @app.workflow()
    async def kid(ctx, data):  # type: ignore[no-untyped-def]
        if data == "fail":
            raise WorkflowError("no stock")
        return data

    @app.workflow()
    async def parent(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.run_child(kid, "ok")
        await ctx.wait_for_event("go")
        try:
            await ctx.run_child(kid, "fail")
        except Exception:  # noqa: BLE001 - the child's failure is the point
            pass
        return "done"

    async with running(app):
        run = await app.submit_async(parent, {})
        async def waits_for_go() -> bool:
            return any(e.kind == "event.wait" for e in await run.journal_async())

        await wait_for(waits_for_go, what="the parent waits for its event")
        await app.send_event_async(run.id, "go", {"secret": "s3"})
        assert await run.result_async(timeout=30) == "done"
        journal = await run.journal_async()
    children = [e.payload["run_id"] for e in journal if e.kind == "child.started"]
    code, out, err = await cli(migrated_database_url, "runs", "show", str(run.id))
    assert code == 0, err
    watched, watch_out, _ = await cli(migrated_database_url, "runs", "watch", str(run.id))
    assert watched == 0
    for text in (out, watch_out):
        lines: dict[str, list[str]] = {}
        for line in text.splitlines():
            if line.split() and line.split()[0].isdigit():
                lines.setdefault(line.split()[4], []).append(line)
        assert [f"child run {child} started (version 1)" in line
                for child, line in zip(children, lines["child.started"], strict=True)] == [
            True, True]
        assert "the child run succeeded" in lines["child.completed"][0]
        assert "the child run failed: WORKFLOW_FAILED: no stock" in lines["child.failed"][0]
        assert "the event was received" in lines["event.received"][0]
        assert "{}" not in text and "s3" not in text
