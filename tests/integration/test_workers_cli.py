"""``orchestrator workers list``: the fleet as the database sees it, a table and ``--json``,
from the rows workers write when they start (the console's Workers page reads the same)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import socket
from collections.abc import AsyncIterator
from typing import Any

import psycopg

from orchestrator import Orchestrator, admin
from orchestrator.db import workers as workers_db
from tests.consoletools import GRANTS, Client, from_header
from tests.integration.conftest import held_read, running, wait_for
from tests.integration.test_cli_json import ISO_UTC
from tests.integration.test_ops_bulk import cli


async def test_workers_list_shows_each_worker_its_state_and_the_runs_it_holds(
        app: Orchestrator, sql, migrated_database_url):
    url = migrated_database_url
    code, out, err = await cli(url, "workers", "list")
    assert (code, err) == (0, "")
    assert out.startswith("no workers registered")

    pay, entered, release = held_read(app)

    # A worker that died 30 s ago: registered as every worker registers, with a liveness lock
    # nobody holds any more, and a heartbeat that stopped.
    async with app.database.connection() as conn:
        await workers_db.worker_register(conn, worker_id="w-dead", hostname="gone-host",
                                         pid=4242, workflows=["pay@1"], concurrency=3,
                                         lock_key=7_000_002)
    sql("UPDATE orchestrator.workers SET heartbeat_at = now() - interval '30 seconds', "
        "started_at = now() - interval '1 hour' WHERE id = 'w-dead'")

    async with running(app, concurrency=4) as worker:
        run = await app.submit_async(pay, "one")
        await asyncio.wait_for(entered.wait(), 10)
        await wait_for(lambda: sql("SELECT lock_key FROM orchestrator.workers WHERE id = %s",
                                   (worker.worker_id,)))
        code, out, err = await cli(url, "workers", "list")
        assert code == 0, err
        code, doc, err = await cli(url, "workers", "list", "--json")
        assert code == 0, err
        release.set()
        assert await run.result_async(timeout=10) == 1

    lines = out.splitlines()
    assert lines[0].split() == ["WORKER", "STATE", "HOST", "PID", "RUNS", "HELD", "SLOTS",
                                "LAST", "HEARTBEAT", "STARTED", "WORKFLOWS"]
    live = next(line for line in lines if line.startswith(worker.worker_id))
    dead = next(line for line in lines if line.startswith("w-dead"))
    # newest first, each column where its header is
    assert lines.index(live) < lines.index(dead)
    assert live.split()[:6] == [worker.worker_id, "live", socket.gethostname(),
                                str(os.getpid()), "1", "4"]
    assert dead.split()[:6] == ["w-dead", "dead", "gone-host", "4242", "0", "3"]
    held = lines[0].index("RUNS HELD")
    assert live[held] == "1" and dead[held] == "0"
    assert " s ago" in live and dead.rstrip().endswith("pay@1")
    assert lines[lines.index(live) - 1].startswith("------")  # the header's rule
    assert "\ndead: no heartbeat" in out  # the states shown are explained when one is not live

    listed = json.loads(doc)
    assert listed["count"] == 2
    by_id = {w["id"]: w for w in listed["workers"]}
    mine = by_id[worker.worker_id]
    assert set(mine) == {"id", "state", "hostname", "pid", "workflows", "concurrency",
                         "runs_held", "started_at", "heartbeat_at", "heartbeat_age_seconds",
                         "liveness_lock", "draining_since"}
    assert mine["draining_since"] is None
    assert (mine["state"], mine["hostname"], mine["pid"], mine["runs_held"],
            mine["concurrency"], mine["liveness_lock"]) == (
        "live", socket.gethostname(), os.getpid(), 1, 4, True)
    assert mine["workflows"] == sorted(app.registry.workflows)
    assert ISO_UTC.fullmatch(mine["started_at"]) and ISO_UTC.fullmatch(mine["heartbeat_at"])
    gone = by_id["w-dead"]
    assert (gone["state"], gone["runs_held"], gone["liveness_lock"]) == ("dead", 0, False)
    assert gone["heartbeat_age_seconds"] > 29

    # the worker unregistered when it stopped: only the dead one is left
    code, out, _ = await cli(url, "workers", "list")
    assert code == 0 and worker.worker_id not in out and "w-dead" in out


async def test_a_draining_worker_is_draining_on_the_console_until_it_unregisters(
        app: Orchestrator, sql, migrated_database_url):
    """Told to stop, a worker claims nothing more while its runs go on to a durable point: the
    console's Workers page, ``GET /api/workers``, the overview (alive, of which draining) and
    what ``runs show`` and the Run page say of the lease holder say so from its row (the
    ``workers list`` test runs a worker process: tests/acceptance/test_workers.py)."""
    pay, entered, release = held_read(app)

    console = app.console(from_header, grants=GRANTS)
    async with running(app, drain_timeout=30) as worker:
        run = await app.submit_async(pay, "one")
        await asyncio.wait_for(entered.wait(), 10)
        assert sql("SELECT draining_since FROM orchestrator.workers WHERE id = %s",
                   (worker.worker_id,)) == [{"draining_since": None}]
        worker.request_stop()
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.workers WHERE id = %s AND "
                                   "draining_since IS NOT NULL", (worker.worker_id,)))
        async with Client(console, "alice") as client:
            listed = (await client.get("/api/workers")).json()["workers"]
            page = (await client.get("/workers")).text
            overview = (await client.get("/api/overview")).json()
            overview_page = (await client.get("/")).text
            shown = (await client.get(f"/api/runs/{run.id}")).json()
            run_page = (await client.get(f"/runs/{run.id}")).text
        code, out, err = await cli(migrated_database_url, "runs", "show", str(run.id))
        assert code == 0, err
        code, doc, err = await cli(migrated_database_url, "runs", "show", str(run.id),
                                   "--json")
        assert code == 0, err
        (mine,) = [w for w in listed if w["id"] == worker.worker_id]
        assert mine["state"] == "draining" and ISO_UTC.fullmatch(mine["draining_since"])
        assert 'class="holder h-draining">draining</strong> since' in page
        # alive (it heartbeats and holds its leases), and shown apart as draining
        assert overview["workers"] == {"alive": 1, "draining": 1, "waiting": 0, "registered": 1}
        assert "of which 1 draining" in overview_page
        # the lease holder: live (it keeps the run), draining since when
        since = mine["draining_since"]
        for lease in (shown["lease"], json.loads(doc)["lease"]):
            assert (lease["holder_state"], lease["reclaim"], lease["draining_since"]) == (
                "live", None, since)
        note = out.split("note:", 1)[1].split("\n", 1)[0].strip()
        assert re.fullmatch(rf"held by {re.escape(worker.worker_id)}, which is draining since "
                            r"\d\d:\d\d:\d\dZ \(told to stop: it releases the run for another "
                            r"worker at its next durable point\), until .*Z \(last "
                            r"heartbeat \d+ s ago\)", note), note
        assert 'class="holder h-draining">draining</strong> since' in run_page
        release.set()
        assert await run.result_async(timeout=10) == 1
    assert not sql("SELECT 1 FROM orchestrator.workers WHERE id = %s", (worker.worker_id,))


async def test_a_lease_holder_that_lost_its_liveness_lock_is_waiting_as_in_workers_list(
        app: Orchestrator, sql, migrated_database_url):
    """A worker whose liveness lock's session ends (killed, or its listen_url's pooler
    restarted) while another session holds the lock meanwhile keeps heartbeating and keeps its
    runs, but holds no lock: ``workers list`` says ``waiting``, and so must ``runs show`` of a
    run it holds (were its process to die now, its runs would wait for their leases to expire,
    not be re-queued by the next sweep)."""
    pay, entered, release = held_read(app)
    async with running(app) as worker:
        run = await app.submit_async(pay, "one")
        await asyncio.wait_for(entered.wait(), 10)
        key = worker._liveness.key
        assert key is not None
        await wait_for(lambda: sql("SELECT lock_key FROM orchestrator.workers WHERE id = %s",
                                   (worker.worker_id,)) == [{"lock_key": key}])
        async with _lock_taken_away(worker, sql, migrated_database_url):
            await wait_for(lambda: sql("SELECT 1 FROM orchestrator.workers WHERE id = %s "
                                       "AND lock_key IS NULL", (worker.worker_id,)))
            code, doc, err = await cli(migrated_database_url, "workers", "list", "--json")
            assert code == 0, err
            (mine,) = [w for w in json.loads(doc)["workers"] if w["id"] == worker.worker_id]
            assert mine["state"] == "waiting"
            code, shown, err = await cli(migrated_database_url, "runs", "show", str(run.id),
                                         "--json")
            assert code == 0, err
            lease = json.loads(shown)["lease"]
            assert (lease["holder_state"], lease["reclaim"]) == ("waiting", None)
            code, out, err = await cli(migrated_database_url, "runs", "show", str(run.id))
            assert code == 0, err
            note = out.split("note:", 1)[1].split("\n", 1)[0].strip()
            assert note.startswith(f"held by {worker.worker_id}, which is waiting"), note
            assert "liveness lock" in note
        release.set()
        assert await run.result_async(timeout=20) == 1


@contextlib.asynccontextmanager
async def _lock_taken_away(worker: Any, sql: Any, url: str) -> AsyncIterator[None]:
    """``worker``'s liveness lock's session ends, and another session holds the lock for the
    body of the ``async with`` (it was queued behind the worker's: granted the moment that
    session ended, before the worker could take it again)."""
    key = worker._liveness.key
    assert key is not None
    await wait_for(lambda: sql("SELECT lock_key FROM orchestrator.workers WHERE id = %s",
                               (worker.worker_id,)) == [{"lock_key": key}])
    (holder,) = sql("SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
                    "AND classid::bigint = ((%s::bigint >> 32) & 4294967295) "
                    "AND objid::bigint = (%s::bigint & 4294967295)", (key, key))
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as other:
        taking = asyncio.ensure_future(other.execute("SELECT pg_advisory_lock(%s)", (key,)))
        await wait_for(lambda: sql("SELECT 1 FROM pg_stat_activity WHERE wait_event_type = "
                                   "'Lock' AND query LIKE 'SELECT pg_advisory_lock%%'"))
        sql("SELECT pg_terminate_backend(%s)", (holder["pid"],))
        await asyncio.wait_for(taking, 10)
        yield


async def test_a_worker_says_when_it_loses_its_liveness_lock_and_when_it_has_it_again(
        app: Orchestrator, sql, migrated_database_url, caplog):
    """A worker whose liveness lock's session ended claims nothing until it takes the lock
    again: that is said once, with what it means and what to look at, not left to be found
    in ``workers list``; and once more when it holds the lock again and claims again."""
    caplog.set_level("INFO", logger="orchestrator.worker")
    async with running(app) as worker:
        async with _lock_taken_away(worker, sql, migrated_database_url):
            await wait_for(lambda: sql("SELECT 1 FROM orchestrator.workers WHERE id = %s "
                                       "AND lock_key IS NULL", (worker.worker_id,)))
            await asyncio.sleep(1.0)  # several heartbeats: said once, not at each
            lost = [r for r in caplog.records if r.name == "orchestrator.worker"
                    and "liveness lock" in r.getMessage() and r.levelname == "WARNING"]
            assert len(lost) == 1, [r.getMessage() for r in caplog.records]
            assert "claims nothing" in lost[0].getMessage()
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.workers WHERE id = %s "
                                   "AND lock_key IS NOT NULL", (worker.worker_id,)))
        await wait_for(lambda: [r for r in caplog.records if r.name == "orchestrator.worker"
                                and r.levelname == "INFO"
                                and "holds its liveness lock now" in r.getMessage()])


async def test_runs_show_counts_as_live_only_the_workers_that_heartbeat(
        app: Orchestrator, sql, migrated_database_url):
    """A queued run's note counted every worker that heartbeat within the last minute as
    live: right after a worker was killed (``dead`` in ``workers list``) or paused
    (``silent``), ``runs show`` said "ready; 3 live worker(s) can run job@1" of a fleet of one
    live worker. It counts the live ones, and says how many more are silent or dead."""
    @app.workflow()
    async def job(ctx, data):  # type: ignore[no-untyped-def]
        return 1

    async with app.database.connection() as conn:
        for name in ("w-live", "w-dead", "w-silent"):
            await workers_db.worker_register(conn, worker_id=name, hostname="h", pid=1,
                                             workflows=["job@1"], concurrency=1,
                                             lock_key=None)
    sql("UPDATE orchestrator.workers SET heartbeat_at = now() - interval '20 seconds' "
        "WHERE id <> 'w-live'")
    run = await app.submit_async(job, {})
    sql("UPDATE orchestrator.workers SET heartbeat_at = now() WHERE id = 'w-live'")
    note = (await admin.show_run(app.database, run.id)).note  # what runs show prints
    assert note is not None
    assert note.startswith("ready; 1 live worker(s) can run job@1"), note
    assert "2 more" in note and "workers list" in note, note


async def test_a_silent_worker_without_a_liveness_lock_may_be_dead_and_the_list_says_so(
        app: Orchestrator, sql, migrated_database_url):
    """Behind a transaction pooler without a listen_url a worker takes no liveness lock, so a
    SIGKILLed one looks ``silent`` exactly as a paused one does: the explanation under the
    table must not call it merely paused or overloaded."""
    async with app.database.connection() as conn:
        await workers_db.worker_register(conn, worker_id="w-pooled", hostname="web-9",
                                         pid=4243, workflows=["pay@1"], concurrency=3)
    sql("UPDATE orchestrator.workers SET heartbeat_at = now() - interval '30 seconds' "
        "WHERE id = 'w-pooled'")
    code, out, err = await cli(migrated_database_url, "workers", "list")
    assert (code, err) == (0, "")
    row = next(line for line in out.splitlines() if line.startswith("w-pooled"))
    assert row.split()[1] == "silent"
    assert "never taken (behind a transaction pooler without a listen_url: paused or dead" in (
        " ".join(out.split()))


async def test_workers_list_explains_the_states_it_shows_a_line_each_and_when_none_is_live(
        app: Orchestrator, sql, migrated_database_url):
    """After a SIGKILL the table's note explains ``dead`` (and what happens to its runs) in a
    line of its own, not every state there is in one long paragraph; with no live worker left
    it says that nothing claims runs until one starts, and how to start one."""
    url = migrated_database_url
    async with app.database.connection() as conn:
        await workers_db.worker_register(conn, worker_id="w-dead", hostname="gone-host",
                                         pid=4242, workflows=["pay@1"], concurrency=3,
                                         lock_key=7_000_003)
    sql("UPDATE orchestrator.workers SET heartbeat_at = now() - interval '30 seconds' "
        "WHERE id = 'w-dead'")

    def note(out: str) -> list[str]:
        lines = out.split("\n\n", 1)[1].splitlines()
        assert all(len(line) <= 100 for line in lines), lines
        return lines

    code, out, err = await cli(url, "workers", "list")
    assert (code, err) == (0, "")
    alone = note(out)
    assert alone[0].startswith("dead: ") and "re-queues its runs" in " ".join(alone)
    assert not [line for line in alone
                if line.startswith(("live:", "draining:", "waiting:", "silent:"))]
    assert alone[-1] == ("no worker is live: nothing claims runs until one starts "
                         "(`orchestrator worker --app MODULE:ATTR`)")

    async with running(app) as worker:
        await wait_for(lambda: sql("SELECT lock_key FROM orchestrator.workers WHERE id = %s",
                                   (worker.worker_id,)))
        code, out, err = await cli(url, "workers", "list")
        assert (code, err) == (0, "")
    beside = note(out)
    assert [line.split(":", 1)[0] for line in beside if not line.startswith(" ")] == [
        "live", "dead"]
    assert "no worker is live" not in out
