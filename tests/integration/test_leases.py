"""Claiming and fencing (CONTRACT C6): SKIP LOCKED batches, growing lease tokens, heartbeats,
expired leases claimed again, stale writers rejected, NOTIFY wake-ups, registered versions."""

from __future__ import annotations

import asyncio
import json
import logging
import time

import psycopg
import pytest

from orchestrator import admin
from orchestrator.db import journal as journal_db
from orchestrator.db import runs as runs_db
from orchestrator.db.config import DatabaseTarget
from orchestrator.db.database import Database
from orchestrator.db.writer import GroupWriter
from orchestrator.engine.control import Phase
from orchestrator.errors import LeaseLost
from orchestrator.worker import _InFlight
from tests.integration.conftest import (
    listening,
    refuse_connections_while,
    running,
    wait_for,
    watch_claims,
)


def _wf(app, version="1"):  # type: ignore[no-untyped-def]
    @app.workflow(version=version, name="job")
    async def job(ctx, data):  # type: ignore[no-untyped-def]
        return data

    return job


async def _claim(app, worker, limit=10, ttl=5.0):  # type: ignore[no-untyped-def]
    async with app.database.connection() as conn:
        return await runs_db.run_claim_ready(conn, worker=worker, workflows=["job@1"],
                                             limit=limit, ttl=ttl)


async def test_claims_are_batched_and_never_shared(app):
    job = _wf(app)
    for i in range(7):
        await app.submit_async(job, {"i": i})
    first, second = await asyncio.gather(_claim(app, "w1", 4), _claim(app, "w2", 4))
    ids = [r["id"] for r in first + second]
    assert len(ids) == 7 and len(set(ids)) == 7
    assert len(first) <= 4 and len(second) <= 4
    await app.database.close()


async def test_a_stale_lease_token_cannot_write(app, sql):
    job = _wf(app)
    run = await app.submit_async(job, {})
    (first,) = await _claim(app, "w1", ttl=0.05)
    await wait_for(lambda: sql("SELECT lease_expires_at < clock_timestamp() AS lapsed "
                               "FROM orchestrator.runs")[0]["lapsed"])
    async with app.database.connection() as conn:
        assert await runs_db.run_release_expired(conn) == 1
    (second,) = await _claim(app, "w2")
    assert second["lease_token"] == first["lease_token"] + 1
    async with app.database.connection() as conn:
        with pytest.raises(LeaseLost):
            await journal_db.journal_append(
                conn, run_id=run.id, token=first["lease_token"], expected=0,
                events=[{"kind": "value", "position": 0, "name": "now", "v": 1,
                         "payload": {"value": 1}}])
        with pytest.raises(LeaseLost):
            await runs_db.run_finish(conn, run_id=run.id, token=first["lease_token"],
                                     status="succeeded", outcome_code=None, result="1",
                                     error=None)
        # the holder of the new token can write
        await journal_db.journal_append(
            conn, run_id=run.id, token=second["lease_token"], expected=0,
            events=[{"kind": "value", "position": 0, "name": "now", "v": 1,
                     "payload": {"value": 1}}])
        with pytest.raises(LeaseLost):  # a wrong expected revision is rejected too
            await journal_db.journal_append(
                conn, run_id=run.id, token=second["lease_token"], expected=0,
                events=[{"kind": "value", "position": 1, "name": "now", "v": 1,
                         "payload": {"value": 2}}])
    rows = sql("SELECT seq, lease_token FROM orchestrator.journal")
    assert rows == [{"seq": 1, "lease_token": second["lease_token"]}]
    await app.database.close()


async def test_heartbeats_extend_only_leases_still_held(app, sql):
    job = _wf(app)
    await app.submit_async(job, {})
    await app.submit_async(job, {})
    a, b = await _claim(app, "w1", ttl=5)
    async with app.database.connection() as conn:
        kept = await runs_db.run_heartbeat(
            conn, worker="w1", leases=[(a["id"], a["lease_token"]),
                                       (b["id"], b["lease_token"] - 1)], ttl=60)
    assert kept == {a["id"]}
    rows = {r["id"]: r for r in sql(
        "SELECT id, lease_expires_at - now() > interval '30 seconds' AS long "
        "FROM orchestrator.runs")}
    assert rows[a["id"]]["long"] and not rows[b["id"]]["long"]
    await app.database.close()


async def test_a_heartbeat_skips_a_run_whose_write_is_in_flight(app, migrated_database_url):
    """The renewal and the worker's writer lock the same rows in no common order: if the
    renewal waited for a locked row they could deadlock (and each deadlock stalls the writer
    for deadlock_timeout). A row locked by a write in flight is skipped, counted as still
    held, and its lease is left as it is; the other runs are renewed."""
    import psycopg

    job = _wf(app)
    await app.submit_async(job, {})
    await app.submit_async(job, {})
    a, b = await _claim(app, "w1", ttl=5)
    with psycopg.connect(migrated_database_url) as writer:  # a write of b's, not committed
        writer.execute("UPDATE orchestrator.runs SET revision = revision WHERE id = %s",
                       (b["id"],))
        async with app.database.connection() as conn:
            await conn.execute("SET lock_timeout = '2s'")  # waiting would fail the test
            kept = await runs_db.run_heartbeat(
                conn, worker="w1", leases=[(a["id"], a["lease_token"]),
                                           (b["id"], b["lease_token"])], ttl=60)
            await conn.execute("RESET lock_timeout")
        writer.rollback()
    assert kept == {a["id"], b["id"]}
    async with app.database.connection() as conn:
        cur = await conn.execute(
            "SELECT id, lease_expires_at - now() > interval '30 seconds' AS long "
            "FROM orchestrator.runs")
        rows = {r["id"]: r["long"] for r in await cur.fetchall()}
    assert rows == {a["id"]: True, b["id"]: False}
    await app.database.close()


async def test_an_expired_lease_is_claimed_by_another_worker(make_app, sql):
    app = make_app(lease_ttl=0.5)
    job = _wf(app)
    run = await app.submit_async(job, {"x": 1})
    await _claim(app, "dead-worker", ttl=0.5)  # claimed, then its worker "dies"
    async with running(app, lease_ttl=0.5) as worker:
        assert await run.result_async(timeout=15) == {"x": 1}
    tokens = sql("SELECT lease_token FROM orchestrator.runs")[0]["lease_token"]
    assert tokens == 2 and worker.claimed == 1


async def test_a_run_claimed_again_with_no_history_is_counted_started_once(make_app, sql):
    """A worker claims a run and dies before its first step; another takes the run over once
    the lease lapsed. The fleet's counts (one app's metrics, shared by both workers here) say
    one run started and waited in the queue once, not twice."""
    app = make_app(lease_ttl=0.5)
    job = _wf(app)
    run = await app.submit_async(job, {"x": 1})
    dead = app.create_worker(worker_id="dead-worker", lease_ttl=0.5, schedules=False)
    assert len(await dead._claim(["job@1"], 1)) == 1  # claimed, then its worker "dies"
    async with running(app, lease_ttl=0.5) as worker:
        assert await run.result_async(timeout=15) == {"x": 1}
    assert worker.claimed == 1
    assert sql("SELECT lease_token FROM orchestrator.runs")[0]["lease_token"] == 2
    assert app.metrics.labelled("runs_started") == {("job",): 1}
    [(_, _, waits)] = app.metrics.histogram("run_queue_wait_seconds").values()
    assert waits == 1


async def _idle_on_listen(worker, claims, sql):  # type: ignore[no-untyped-def]
    """Return once ``worker`` listens and waits for a wake-up: its listener is in LISTEN, its
    last claim has returned and no wake-up is pending, so it waits for its poll interval
    unless a NOTIFY comes."""
    await wait_for(lambda: listening(sql) and claims.between_claims
                   and not worker._wake.is_set())


async def test_notify_wakes_an_idle_worker_without_polling(app, sql):
    job = _wf(app)
    async with running(app, poll_interval=60.0) as worker:
        await _idle_on_listen(worker, watch_claims(worker), sql)
        started = time.monotonic()
        run = await app.submit_async(job, {"fast": True})
        assert await run.result_async(timeout=10) == {"fast": True}
        assert time.monotonic() - started < 5  # a 60 s poll would not have made it


async def test_a_tool_pause_the_worker_cannot_read_does_not_end_its_wake_ups(app, sql):
    """Anyone connected may NOTIFY: a tool pause whose end is no time a date can hold
    (infinite, or far past year 9999) is skipped as an unreadable one is, and the worker goes
    on hearing NOTIFY. Before, it ended the worker's listener, and the worker woke only at its
    poll interval from then on, until it restarted."""
    job = _wf(app)
    async with running(app, poll_interval=60.0) as worker:
        await _idle_on_listen(worker, watch_claims(worker), sql)
        await wait_for(lambda: sql(  # the last of the listener's channels is listened to
            "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
            "AND state = 'idle' AND query = 'LISTEN orchestrator_tools'"))
        for until in ("inf", "1e300", "-1e300", "nan", "soon"):
            sql("SELECT pg_notify('orchestrator_tools', %s)", (f"charge\t{until}",))
        started = time.monotonic()
        run = await app.submit_async(job, {"fast": True})
        assert await run.result_async(timeout=10) == {"fast": True}
        assert time.monotonic() - started < 5  # a 60 s poll would not have made it
        assert "charge" not in worker.config.back_offs


async def test_notify_wakes_a_busy_worker_with_free_slots_without_polling(app, sql):
    """A worker that holds a run still claims new work on NOTIFY (its claims are spaced by
    ``CLAIM_GAP``, milliseconds), not at its poll interval."""
    release = asyncio.Event()

    @app.tool(effect="read")
    async def wait(ctx):  # type: ignore[no-untyped-def]
        await release.wait()
        return "released"

    @app.workflow()
    async def holder(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(wait)

    job = _wf(app)
    async with running(app, poll_interval=60.0, concurrency=4) as worker:
        claims = watch_claims(worker)
        try:
            held = await app.submit_async(holder, {})
            await wait_for(lambda: worker.active_runs == 1)
            await _idle_on_listen(worker, claims, sql)  # it holds a run, waits on LISTEN
            started = time.monotonic()
            run = await app.submit_async(job, {"fast": True})
            assert await run.result_async(timeout=10) == {"fast": True}
            assert time.monotonic() - started < 5  # a 60 s poll would not have made it
            # The fast run's task lets go of it just after its success has landed.
            await wait_for(lambda: worker.active_runs == 1)
            assert held.id in worker._running  # the first run was still held all along
        finally:
            release.set()  # also when an assertion failed: the worker's drain waits for it
        assert await held.result_async(timeout=10) == "released"


async def test_workers_only_claim_workflow_versions_they_registered(make_app, sql):
    submitter = make_app()
    _wf(submitter, "1")
    v2 = _wf(make_app(), "2")  # noqa: F841 - a second app that only knows version 2
    run = await submitter.submit_async("job", {"v": 1})
    only_v2 = make_app()
    _wf(only_v2, "2")
    async with running(only_v2) as worker:
        claims = watch_claims(worker)
        await wait_for(lambda: claims.sizes)  # it looked for work, with the v1 run queued
        assert claims.sizes[0] == 0 and worker.claimed == 0
        detail = await admin.show_run(only_v2.database, run.id)
        assert detail.run["status"] == "queued"
        assert "no live worker registers it" in (detail.note or "")
    async with running(submitter):
        assert await run.result_async(timeout=10) == {"v": 1}
    await submitter.database.close()


async def test_a_run_ending_while_leases_are_renewed_is_not_reported_lost(app, sql):
    """A renewal that meets a run whose final write already landed must not flag it lost;
    one that meets a run taken away while it was working must."""
    job = _wf(app)
    for i in range(2):
        await app.submit_async(job, {"i": i})
    worker = app.create_worker(concurrency=2)
    claims = await _claim(app, worker.worker_id, limit=2)
    executors = []
    for claim in claims:
        ex = worker.new_executor(claim, [])
        worker._running[claim["id"]] = _InFlight(asyncio.get_running_loop().create_future(),
                                                 ex.run.lease, ex)
        executors.append(ex)
    ending, working = executors
    ending.run.enter(Phase.ENDING)  # its success was just committed; its task has not returned yet
    for ex in executors:  # both runs are no longer running under these leases
        sql("UPDATE orchestrator.runs SET status = 'succeeded', finished_at = now(), "
            "lease_owner = NULL, lease_expires_at = NULL WHERE id = %s", (ex.run.run_id,))
    assert await worker._renew_leases()
    assert not ending.run.lost
    assert working.run.lost and worker.metrics.snapshot()["lease_losses"] == 1
    await app.database.close()


def _cut_off(worker):  # type: ignore[no-untyped-def]
    """Point ``worker`` at an address where nothing listens: its connections are refused (a
    real failure, not a stand-in)."""
    worker.database = Database(DatabaseTarget("postgresql://127.0.0.1:1/nothing", "argument"),
                               connect_timeout=1.0)
    worker.writer = GroupWriter(worker.database)


async def _napping_claimed_then_cut_off(app):  # type: ignore[no-untyped-def]
    """A worker holding the claim of one run that sleeps durably, then cut off from its
    database (:func:`_cut_off`): ``(worker, claim)``."""
    @app.workflow(version="1", name="nap")
    async def nap(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.sleep(3600)

    await app.submit_async(nap, {})
    worker = app.create_worker()
    async with app.database.connection() as conn:
        (claim,) = await runs_db.run_claim_ready(conn, worker=worker.worker_id,
                                                 workflows=["nap@1"], limit=1, ttl=5.0)
    _cut_off(worker)
    return worker, claim


async def _said_lost(caplog, app, worker, claim, why):  # type: ignore[no-untyped-def]
    """The worker logged the run's lease lost for ``why`` and counted one lease loss."""
    assert f"run {claim['id']}: lease {claim['lease_token']} lost ({why})" in caplog.text
    assert worker.metrics.snapshot()["lease_losses"] == 1
    await worker.database.close()
    await app.database.close()


async def test_a_run_whose_journal_cannot_be_read_is_let_go_as_lost(app, caplog):
    """The database stops answering between a run's claim and the read of its journal (a host
    cut off just after its claim landed): the worker lets the run go as lost, as it would a
    run whose writes stopped landing (a warning naming the run and its lease, the lease-loss
    count), instead of failing the task; the lease lapses and another claim replays it."""
    job = _wf(app)
    await app.submit_async(job, {})
    worker = app.create_worker()
    (claim,) = await _claim(app, worker.worker_id)
    claim = {**claim, "revision": 1}  # as if it had history to replay
    _cut_off(worker)
    caplog.set_level(logging.WARNING, logger="orchestrator")
    assert await worker._executor_for(claim) is None
    await _said_lost(caplog, app, worker, claim, "DATABASE_UNAVAILABLE before it started")


async def test_a_run_whose_parking_the_database_does_not_take_is_let_go_as_lost(app, caplog):
    """A run that parks (a durable sleep) while its database is unreachable: the worker lets
    it go as lost, as for any other write the database keeps failing, instead of failing the
    run's task (the lease renewals skip a parking run: this is the one place it is said)."""
    worker, claim = await _napping_claimed_then_cut_off(app)
    caplog.set_level(logging.WARNING, logger="orchestrator")
    ex = worker.new_executor(claim, [])
    await ex.drive(app.registry.workflows["nap@1"])
    assert ex.run.lost
    await _said_lost(caplog, app, worker, claim, "database unavailable")


async def test_a_claim_takes_the_oldest_ready_runs_reading_only_the_claimable_index(app, sql):
    """Oldest first, and without reading (or sorting) the backlog: the claim's ready runs come
    off ix_runs_claimable in its order whatever the table's statistics say (none, as after a
    burst of submissions with autovacuum behind, then fresh ones), and the claimed rows are
    then found by primary key, so a claim does not grow with a backlog of its own workflows.
    (A plain SELECT in the claim sorted all 3,000 here for 3 of them.) The plans are the
    claim statement's own, its nested selection included, as auto_explain reports them."""
    from psycopg.rows import dict_row

    _wf(app)
    # A backlog written directly (only the claim reads it); run i has been ready for i s.
    sql("""INSERT INTO orchestrator.runs (id, tenant, principal, workflow_name,
                                          workflow_version, input, request_digest, available_at)
           SELECT gen_random_uuid(), 't', 'p', 'job', '1', jsonb_build_object('i', g), 'd',
                  now() - make_interval(secs => g)
           FROM generate_series(1, 3000) AS g""")

    async def claim_with_plans(n: int) -> tuple[list[dict], list[str]]:  # type: ignore[type-arg]
        conn = await psycopg.AsyncConnection.connect(app.database.target.url, autocommit=True,
                                                     row_factory=dict_row)
        plans: list[str] = []
        conn.add_notice_handler(lambda diag: plans.append(diag.message_primary or ""))
        await conn.execute("LOAD 'auto_explain'")
        for name, value in (("log_min_duration", "0"), ("log_nested_statements", "on"),
                            ("log_level", "notice")):
            await conn.execute(f"SET auto_explain.{name} = '{value}'")
        claimed = await runs_db.run_claim_ready(conn, worker="w1", workflows=["job@1"],
                                                limit=n, ttl=5.0)
        await conn.close()
        return claimed, [p for p in plans if "Query Text" in p or "plan" in p]

    claimed: list[dict] = []  # type: ignore[type-arg]
    for _statistics in ("none", "fresh"):
        got, plans = await claim_with_plans(3)
        claimed += got
        selection = [p for p in plans if "SELECT id FROM orchestrator.runs" in p]
        assert selection, plans
        assert "Index Scan using ix_runs_claimable" in selection[0], selection[0]
        for plan in plans:
            assert "Sort" not in plan, plan
            assert "Seq Scan on runs" not in plan, plan
        sql("ANALYZE orchestrator.runs")

    assert sorted(json.loads(r["input_text"])["i"] for r in claimed) == [
        2995, 2996, 2997, 2998, 2999, 3000]
    # Planned once per session, not at every claim (migration 0021): a SQL function with a
    # SET clause is planned at every call, ~130 µs of the server's time per claim.
    (lang,) = sql("SELECT l.lanname FROM pg_proc p JOIN pg_language l ON l.oid = p.prolang "
                  "WHERE p.oid = 'orchestrator.runs_ready'::regproc")
    assert lang["lanname"] == "plpgsql"
    await app.database.close()


async def test_a_run_whose_final_write_is_slow_keeps_its_lease(make_app, sql, monkeypatch):
    """The run's success is written late (the database is slow: the write reaches it only
    after twice the lease TTL). The worker keeps renewing that run's lease meanwhile, so the
    run is not released and claimed again for a replay while its outcome is on its way."""
    from orchestrator.db.writer import GroupWriter, Landing, Statement

    enqueue = GroupWriter.enqueue

    def late(self, work):  # type: ignore[no-untyped-def]
        if not (isinstance(work, Statement) and "'run.completed'" in work.sql):
            return enqueue(self, work)
        loop = asyncio.get_running_loop()
        landing = Landing(loop=loop)

        def send() -> None:
            sent = enqueue(self, work)
            sent.add_done_callback(lambda _: landing.set_exception(sent.exception())
                                   if sent.exception() else landing.set_result(sent.result()))

        loop.call_later(2.0, send)
        return landing

    monkeypatch.setattr(GroupWriter, "enqueue", late)
    app = make_app(lease_ttl=0.9)
    job = _wf(app)
    run = await app.submit_async(job, {"slow": True})
    async with running(app, lease_ttl=0.9) as worker:
        assert await run.result_async(timeout=15) == {"slow": True}
    assert worker.claimed == 1
    assert sql("SELECT lease_token FROM orchestrator.runs")[0]["lease_token"] == 1


async def test_a_run_released_for_a_drain_while_the_database_is_down_is_let_go_as_lost(
        app, caplog):  # type: ignore[no-untyped-def]
    """A worker draining lets go of a run by releasing it; with its database unreachable that
    release fails: the run is said lost like any other run let go in an outage (its lease
    lapses and another worker takes it), not logged as a failure of the worker. The chaos
    suite saw this when a PostgreSQL restart met a worker's drain."""
    worker, claim = await _napping_claimed_then_cut_off(app)
    worker._stop.set()  # draining: the run is released at its first boundary
    caplog.set_level(logging.WARNING, logger="orchestrator")
    worker._start(claim)
    await worker._running[claim["id"]].task
    assert "the worker failed while driving it" not in caplog.text
    await _said_lost(caplog, app, worker, claim, "database unavailable")


async def test_a_run_claimed_again_while_its_journal_was_read_is_driven_by_the_newer_claim(
        make_app, sql, caplog, monkeypatch):
    """A worker reading a run's journal slowly (a database in trouble) whose renewals of that
    run's lease do not get through either can see the lease lapse meanwhile and claim the run
    again itself. The newer claim drives the run; the older one, once its read returns, lets
    go as a lease lost (its token is superseded), and neither takes the other's place in the
    worker's book of running runs."""
    app = make_app(lease_ttl=1.0)

    @app.workflow()
    async def nap(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.wait_for_event("go")

    read, slowed = journal_db.journal_read, []
    renew = runs_db.run_leases_renew

    async def no_renewal_while_slow(conn, *, worker, leases, ttl):  # type: ignore[no-untyped-def]
        if len(slowed) == 1:
            leases = [(rid, token) for rid, token in leases if rid != slowed[0]]
        return await renew(conn, worker=worker, leases=leases, ttl=ttl)

    monkeypatch.setattr(runs_db, "run_leases_renew", no_renewal_while_slow)

    async def slow_read(conn, run_id):  # type: ignore[no-untyped-def]
        if not slowed:  # the first read after the event: longer than the lease
            slowed.append(run_id)
            await asyncio.sleep(2.5)
            slowed.append("read")
        return await read(conn, run_id)

    monkeypatch.setattr(journal_db, "journal_read", slow_read)
    caplog.set_level(logging.WARNING, logger="orchestrator")
    async with running(app) as worker:
        run = await app.submit_async(nap, {})
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs WHERE id = %s AND "
                                   "status = 'waiting'", (run.id,)), timeout=10)
        await app.send_event_async(run.id, "go", "rested")
        assert await run.result_async(timeout=15) == "rested"
        await wait_for(lambda: len(slowed) == 2, timeout=5)  # the older read returned
        await wait_for(lambda: not worker._running, timeout=5)
    assert "failed while driving" not in caplog.text
    assert f"run {run.id}: lease 2 lost (claimed again)" in caplog.text


async def test_a_run_whose_journal_is_read_slowly_keeps_its_lease(make_app, sql, caplog,
                                                                  monkeypatch):
    """Reading a long journal from a slow database can take longer than the lease: the worker
    renews the lease of a run it claimed while it reads the run's journal, as it does once the
    run is driven, so the run is not released, claimed again and replayed from the top (a
    replay that could never finish while every read outlasts the lease)."""
    app = make_app(lease_ttl=1.0)

    @app.workflow()
    async def nap(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.wait_for_event("go")

    read, slowed = journal_db.journal_read, []

    async def slow_read(conn, run_id):  # type: ignore[no-untyped-def]
        if not slowed:  # the first read after the event: longer than the lease
            slowed.append(run_id)
            await asyncio.sleep(2.5)
        return await read(conn, run_id)

    monkeypatch.setattr(journal_db, "journal_read", slow_read)
    caplog.set_level(logging.WARNING, logger="orchestrator")
    async with running(app) as worker:
        run = await app.submit_async(nap, {})
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs WHERE id = %s AND "
                                   "status = 'waiting'", (run.id,)), timeout=10)
        await app.send_event_async(run.id, "go", "rested")
        assert await run.result_async(timeout=15) == "rested"
    assert slowed == [run.id]
    assert worker.claimed == 2  # the first start, then once after the event
    assert "lost" not in caplog.text
    assert sql("SELECT lease_token FROM orchestrator.runs")[0]["lease_token"] == 2


async def test_a_slow_journal_read_does_not_shift_the_runs_clock(make_app, sql, monkeypatch):
    """A run's "now" is this host's wall clock plus its offset to the server's, measured at
    the claim (docs/operations.md, Clocks). The offset is taken against the wall clock of the
    claim itself, not of the moment the run's journal had been read: a read that took seconds
    must not make the run's clock (its deadline checks, ``ctx.now``) late by as much."""
    app = make_app(lease_ttl=5.0)
    seen: list[float] = []

    @app.workflow()
    async def nap(ctx, data):  # type: ignore[no-untyped-def]
        got = await ctx.wait_for_event("go")
        seen.append(sql("SELECT EXTRACT(EPOCH FROM clock_timestamp())::float8 AS t")[0]["t"]
                    - ctx.now().timestamp())
        return got

    read, slowed = journal_db.journal_read, []

    async def slow_read(conn, run_id):  # type: ignore[no-untyped-def]
        if not slowed:
            slowed.append(run_id)
            await asyncio.sleep(2.0)
        return await read(conn, run_id)

    monkeypatch.setattr(journal_db, "journal_read", slow_read)
    async with running(app) as worker:
        run = await app.submit_async(nap, {})
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs WHERE id = %s AND "
                                   "status = 'waiting'", (run.id,)), timeout=10)
        await app.send_event_async(run.id, "go", "rested")
        assert await run.result_async(timeout=15) == "rested"
    assert worker.claimed == 2 and len(seen) == 1
    assert abs(seen[0]) < 0.5, f"the run's clock is {seen[0]:.2f} s behind the server's"


async def test_a_heartbeat_stuck_on_the_workers_table_does_not_hold_back_lease_renewals(
        make_app, sql, migrated_database_url, caplog):  # type: ignore[no-untyped-def]
    """The worker's heartbeat updates its row in ``workers``; a lock on that row (a DDL, a
    ``VACUUM FULL``, an operator's transaction) makes it wait. Its runs' leases are renewed
    meanwhile all the same: a renewal that waited behind the heartbeat would let them lapse,
    and another worker (or this one's own sweep) would take the runs while they are driven."""
    app = make_app(lease_ttl=1.0)
    going, release = asyncio.Event(), asyncio.Event()

    @app.tool()
    async def work(ctx):  # type: ignore[no-untyped-def]
        going.set()
        await release.wait()
        return "done"

    @app.workflow()
    async def busy(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(work)

    def expires() -> float:  # 0 once the run is not leased any more
        return sql("SELECT EXTRACT(EPOCH FROM lease_expires_at)::float8 AS t "
                   "FROM orchestrator.runs WHERE id = %s", (run.id,))[0]["t"] or 0.0

    caplog.set_level(logging.WARNING, logger="orchestrator")
    async with running(app, lease_ttl=1.0) as worker:
        run = await app.submit_async(busy, {})
        await wait_for(going.is_set)
        with psycopg.connect(migrated_database_url) as holder:
            holder.execute("SELECT 1 FROM orchestrator.workers WHERE id = %s FOR UPDATE",
                           (worker.worker_id,))
            await wait_for(lambda: sql(
                "SELECT 1 FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE 'UPDATE orchestrator.workers SET heartbeat_at%%'"))
            stuck = expires()
            # Renewed again and again while the heartbeat waits: three TTLs past the stall.
            await wait_for(lambda: expires() > stuck + 3.0, timeout=10,
                           what="the leases to be renewed while the heartbeat waits")
            holder.rollback()
        release.set()
        assert await run.result_async(timeout=10) == "done"
    assert worker.claimed == 1
    assert sql("SELECT lease_token FROM orchestrator.runs")[0]["lease_token"] == 1
    assert "lost" not in caplog.text


async def test_a_run_whose_writes_meet_a_short_outage_keeps_its_lease_and_finishes(
        make_app, sql, monkeypatch):
    """The database cannot be reached for a second and a half (every connection refused at
    once, as behind a pooler that is down) while a run's consequential call returns; its
    lease has seconds left. Its receipt and its success are written once the database is
    back, by the same worker under the same lease: no lease lost, nothing to reconcile. (The
    writer's three attempts failed within milliseconds and the run let go of its lease at
    once, "database unavailable": it was claimed again once the lease lapsed, its call
    without a receipt became unknown and went to an operator.)"""

    app = make_app(lease_ttl=6.0)
    entered, release = asyncio.Event(), asyncio.Event()

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        entered.set()
        await release.wait()
        return "charged"

    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    run = await app.submit_async(pay, {})
    down = False

    refuse_connections_while(monkeypatch, lambda: down)
    async with running(app, lease_ttl=6.0) as worker:
        await asyncio.wait_for(entered.wait(), 10)
        down = True
        release.set()  # the receipt and the success are written while it is down
        await asyncio.sleep(1.5)
        down = False
        assert await run.result_async(timeout=5) == "charged"
        assert worker.claimed == 1
        assert worker.metrics.snapshot().get("lease_losses", 0) == 0
    assert sql("SELECT lease_token FROM orchestrator.runs") == [{"lease_token": 1}]
    assert sql("SELECT state FROM orchestrator.operations") == [{"state": "committed"}]
    assert sql("SELECT count(*) AS n FROM orchestrator.reconciliation_items") == [{"n": 0}]


async def test_a_run_whose_read_meets_a_short_outage_keeps_its_lease_and_finishes(
        make_app, sql, monkeypatch, caplog):
    """A run's read (here a parent's look at its child's status, right after starting it)
    loses its connection and then finds every connection refused for a second and a half (a
    pooler that is down); its lease has seconds left. The read is tried again, as patiently
    as a write, and the run goes on once the database is back, on the same worker under the
    same lease. (The read was tried four times within a fraction of a second and the run let
    go of its lease at once, "database unavailable", to be claimed again once it lapsed.)"""
    import time

    import psycopg

    app = make_app(lease_ttl=6.0)

    @app.workflow()
    async def child(ctx, data):  # type: ignore[no-untyped-def]
        return data * 2

    @app.workflow()
    async def parent(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.run_child(child, data)

    down_until = 0.0

    status, cut = runs_db.run_children_status, []

    async def cut_under_the_read(conn, parent_id, positions):  # type: ignore[no-untyped-def]
        nonlocal down_until
        if not cut:  # the parent's first look at its child: the outage begins under it
            cut.append(parent_id)
            down_until = time.monotonic() + 1.5
            raise psycopg.OperationalError("server closed the connection unexpectedly")
        return await status(conn, parent_id, positions)

    refuse_connections_while(monkeypatch, lambda: time.monotonic() < down_until)
    monkeypatch.setattr(runs_db, "run_children_status", cut_under_the_read)
    caplog.set_level(logging.WARNING, logger="orchestrator")
    async with running(app, lease_ttl=6.0) as worker:
        run = await app.submit_async(parent, 21)
        await wait_for(lambda: cut and time.monotonic() > down_until + 0.1, timeout=10)
        assert await run.result_async(timeout=30) == 42
        assert cut == [run.id]
        assert worker.metrics.snapshot().get("lease_losses", 0) == 0
    assert "lost" not in caplog.text


async def test_a_run_whose_claim_time_read_meets_a_short_outage_keeps_its_lease_and_finishes(
        make_app, sql, monkeypatch, caplog):
    """A run claimed again (after its event) loses the connection reading its journal, right
    after the claim: the server ends the session under the read, and every connection is then
    refused for a second and a half (a pooler that is down); its lease has seconds left. The
    read is tried again as patiently as the run's other reads, and the run goes on once the
    database is back, on the same worker under the same lease. (The read failed once and the
    worker let go of the run at once, "DATABASE_UNAVAILABLE before it started", to be claimed
    again only once its lease lapsed.)"""
    app = make_app(lease_ttl=6.0)

    @app.workflow()
    async def nap(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.wait_for_event("go")

    down_until = 0.0

    read, cut = journal_db.journal_read, []

    async def cut_under_the_read(conn, run_id):  # type: ignore[no-untyped-def]
        nonlocal down_until
        if not cut:  # the read right after the claim: the outage begins under it
            cut.append(run_id)
            down_until = time.monotonic() + 1.5
            await conn.execute("SELECT pg_terminate_backend(pg_backend_pid())")
        return await read(conn, run_id)

    refuse_connections_while(monkeypatch, lambda: time.monotonic() < down_until)
    monkeypatch.setattr(journal_db, "journal_read", cut_under_the_read)
    caplog.set_level(logging.WARNING, logger="orchestrator")
    async with running(app, lease_ttl=6.0) as worker:
        run = await app.submit_async(nap, {})
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs WHERE id = %s AND "
                                   "status = 'waiting'", (run.id,)), timeout=10)
        await app.send_event_async(run.id, "go", "rested")
        await wait_for(lambda: cut and time.monotonic() > down_until + 0.1, timeout=10)
        assert await run.result_async(timeout=3) == "rested"
        assert cut == [run.id]
        assert worker.claimed == 2  # the first start, then once after the event
        assert worker.metrics.snapshot().get("lease_losses", 0) == 0
    assert "lost" not in caplog.text
    assert sql("SELECT lease_token FROM orchestrator.runs")[0]["lease_token"] == 2


async def test_a_drain_is_not_held_by_a_claim_time_read_waiting_out_an_outage(
        make_app, sql, monkeypatch):
    """A worker with a minute's lease (half a minute of patience) whose claim-time read of a
    run's journal waits for a database that refuses every connection stops within its drain
    timeout and the write grace: the drain that ran out of time ends the wait, and the run is
    let go (abandoned: its lease lapses)."""
    app = make_app(lease_ttl=60.0)

    @app.workflow()
    async def nap(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.wait_for_event("go")

    down = False

    reads: list[object] = []

    async def cut_under_the_read(conn, run_id):  # type: ignore[no-untyped-def]
        nonlocal down
        reads.append(run_id)
        down = True
        raise psycopg.OperationalError("server closed the connection unexpectedly")

    refuse_connections_while(monkeypatch, lambda: down)
    async with running(app, lease_ttl=60.0, drain_timeout=0.5) as worker:
        run = await app.submit_async(nap, {})
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs WHERE id = %s AND "
                                   "status = 'waiting'", (run.id,)), timeout=10)
        monkeypatch.setattr(journal_db, "journal_read", cut_under_the_read)
        await app.send_event_async(run.id, "go", "rested")
        await wait_for(lambda: reads)
        await asyncio.sleep(0.5)  # the read is waiting to be tried again
        assert worker._running
        started = time.monotonic()
    assert time.monotonic() - started < 8  # the drain and the grace, not the 30 s patience
    assert worker.metrics.snapshot().get("runs_succeeded", 0) == 0  # let go, not driven
