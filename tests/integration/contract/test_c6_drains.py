"""CONTRACT C6: a worker that stops (drains) or whose liveness lock blips lets go of its runs
without losing or repeating an effect: what it leaves is for the journal and the next
claim to decide, never recorded as workflow code's doing."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from orchestrator.engine.control import Phase
from tests.integration.conftest import running, wait_for
from tests.integration.contract.helpers import (
    DrainTools,
    Tools,
    drain_once,
    operations,
    run_status,
    slow_write,
)


async def test_a_stopping_worker_does_not_withdraw_a_call_it_cancels(make_app, sql, monkeypatch):
    """A worker whose drain runs out of time cancels its runs' workflows itself; a call whose
    intent was being written at that moment was not given up by workflow code, so it must not
    be recorded as withdrawn (a replay would wait forever for a cancellation that workflow code
    never makes). The journal is left to decide, as for a worker that died: the operation stays
    ``submitted`` and the next claim treats it as an uncertain attempt."""
    from orchestrator.db.writer import GroupWriter, Landing

    app = make_app()
    stopping: list[Any] = []
    enqueue = GroupWriter.enqueue

    def late(self, work):  # type: ignore[no-untyped-def]
        """The run's first write lands only once the stop has cancelled the workflow."""
        landing = enqueue(self, work)
        if stopping:
            return landing
        worker = app_worker[0]
        stopping.append(True)
        worker.request_stop()
        delayed = Landing(loop=asyncio.get_running_loop())

        def hand_over() -> None:
            executors = [h.executor for h in worker._running.values() if h.executor is not None]
            if landing.done() and all(ex.run.phase in (Phase.PARKING, Phase.GONE)
                                      for ex in executors):
                if landing.exception() is not None:
                    delayed.set_exception(landing.exception())  # type: ignore[arg-type]
                else:
                    delayed.set_result(landing.result())
            else:
                asyncio.get_running_loop().call_later(0.01, hand_over)

        hand_over()
        return delayed

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        return {"charged": True}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    run = await app.submit_async(wf, {})
    monkeypatch.setattr(GroupWriter, "enqueue", late)
    worker = app.create_worker(drain_timeout=0.05, poll_interval=0.2)
    app_worker = [worker]
    await asyncio.wait_for(worker.run(), 20)
    journal = sql("SELECT kind, payload FROM orchestrator.journal ORDER BY seq")
    assert [e["kind"] for e in journal] == ["call.submitted"]
    assert [o["state"] for o in operations(sql)] == ["submitted"]
    assert run_status(sql, run)["status"] == "running"  # until its lease lapses


async def test_a_drain_that_runs_out_of_time_still_writes_the_receipts_it_holds(
        make_app, sql, monkeypatch):
    """A worker whose drain runs out of time cancels a run that is busy in memory. A receipt
    the run still holds (riding, not yet written) records what already happened: the run
    writes it as it lets go (the backstop in ``drive``), so the operation is ``committed`` and
    the next worker's replay returns it without calling the tool again. Normally a receipt is
    written as soon as the workflow yields; that write is held back here so that only the
    backstop is left to do it (without the backstop the operation stays ``submitted`` and
    the next worker finds it uncertain)."""
    from orchestrator.engine.session import Rider

    monkeypatch.setattr(Rider, "_settle_soon", lambda self: setattr(self, "_scheduled", False))
    app = make_app(lease_ttl=1.0)
    called: list[str] = []
    returned = asyncio.Event()
    go_on = asyncio.Event()

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        called.append("charge")
        return {"charged": True}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        receipt = await ctx.call(charge)
        returned.set()
        await go_on.wait()  # busy in memory: no durable step, so no write carries the receipt
        return receipt

    run = await app.submit_async(wf, {})
    worker = app.create_worker(poll_interval=0.2, drain_timeout=0.1)
    working = asyncio.ensure_future(worker.run())
    await asyncio.wait_for(returned.wait(), 10)
    worker.request_stop()
    await asyncio.wait_for(working, 20)
    assert [o["state"] for o in operations(sql)] == ["committed"]
    assert [e["kind"] for e in sql("SELECT kind FROM orchestrator.journal ORDER BY seq")] == [
        "call.submitted", "call.completed"]
    go_on.set()
    async with running(app):
        assert await run.result_async(timeout=20) == {"charged": True}
    assert called == ["charge"]


async def test_a_drain_stops_a_run_whose_workflow_uses_a_task_group(app, sql):
    """A draining worker stops a run at its next new step with ``Stop``; in a branch of an
    ``asyncio.TaskGroup`` that arrives wrapped in an exception group. The run is released for
    another worker, as without the group. (It used to fail with ``WORKFLOW_FAILED``.)"""
    tools = DrainTools(app)

    async def steps(ctx):  # type: ignore[no-untyped-def]
        return [await ctx.call(tools.slow), await ctx.call(tools.fast)]

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        async with asyncio.TaskGroup() as group:
            task = group.create_task(steps(ctx))
        return task.result()

    run = await tools.drain_during_slow(app, wf)
    assert run_status(sql, run) == {"status": "queued", "outcome_code": None}
    async with running(app):
        assert await run.result_async(timeout=20) == ["slow", "fast"]


async def test_a_draining_worker_still_withdraws_a_call_that_workflow_code_gave_up(
        app, sql, monkeypatch):
    """A worker that drains lets its runs go on to their next new step; a timeout of workflow
    code in the meantime is still the workflow's: the call is withdrawn, and on the next worker
    the replay gives up on it in the same way (it is not sent to reconciliation as if a worker
    had died holding it)."""
    slow_write(monkeypatch)
    tools = Tools(app)
    intent_sent = asyncio.Event()

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        call = asyncio.ensure_future(ctx.call(tools.charge))
        intent_sent.set()
        try:
            await asyncio.wait_for(call, 0.3)
            return "charged"
        except TimeoutError:
            pass
        await ctx.sleep(1.2)  # the drain stops the run here: the rest is a replay elsewhere
        return "gave up"

    run = await drain_once(app, wf, intent_sent)  # the intent's write is in flight
    ops = sql("SELECT state, error FROM orchestrator.operations")
    assert [o["state"] for o in ops] == ["failed"]
    assert ops[0]["error"]["code"] == "CALL_WITHDRAWN"
    async with running(app):
        assert await run.result_async(timeout=20) == "gave up"
    assert tools.called == []


async def test_a_branch_cancelled_by_its_task_group_for_a_drain_is_not_withdrawn(
        app, sql, monkeypatch):
    """A draining worker stops one branch of a task group at its next new step; the group then
    cancels the other branch, whose intent is being written. That cancellation is the
    engine's, not workflow code's: nothing is withdrawn, and on the next worker the replay
    re-sends the (idempotent) call with its key and the run completes. (Recorded as withdrawn,
    the replay would wait at that call for a cancellation that never comes.)"""
    slow_write(monkeypatch, nth=2)  # the second write: branch b's intent
    tools = DrainTools(app)
    wf = tools.branches(app, tools.ship)  # b's intent is the run's second write

    run = await tools.drain_during_slow(app, wf)  # `a` stops at its next call; `b` cancelled
    assert run_status(sql, run)["status"] == "queued"
    assert sql("SELECT count(*) AS n FROM orchestrator.journal WHERE kind = 'call.failed'"
               )[0]["n"] == 0
    async with running(app):
        assert await run.result_async(timeout=20) == [["slow", "fast"], "shipped"]
    assert tools.called.count("slow") == 1


async def test_a_receipt_waiting_for_the_write_lock_is_written_when_a_sibling_stops(
        app, sql, monkeypatch):
    """Three branches of a task group. ``b``'s (idempotent) call has returned and its receipt
    waits for the run's write lock, which ``c``'s slow intent write holds, when the draining
    worker stops ``a`` at its next call and the group cancels the others. The receipt records
    what already happened: it is written all the same (``finish``), so the next worker's
    replay returns it instead of calling the tool again. (Dropped with the cancellation, the
    operation stayed ``submitted`` and the replay re-sent the call.)"""
    slow_write(monkeypatch, nth=3)  # the third write: branch c's intent
    tools = DrainTools(app)
    # b (ship): its receipt waits for the lock that c's (label's) intent write holds
    wf = tools.branches(app, tools.ship, tools.label)

    run = await tools.drain_during_slow(app, wf)
    assert run_status(sql, run)["status"] == "queued"
    ops = {o["tool_name"]: o["state"] for o in sql(
        "SELECT tool_name, state FROM orchestrator.operations")}
    assert ops["ship"] == "committed"
    assert tools.called == ["slow", "ship"]
    async with running(app):
        assert await run.result_async(timeout=20) == [["slow", "fast"], "shipped", "labelled"]
    assert tools.called.count("ship") == 1
    assert tools.called.count("slow") == 1


async def test_a_tool_running_when_a_sibling_stops_for_the_drain_is_left_to_the_journal(
        app, sql):
    """Branch ``b``'s idempotent tool is running when the draining worker stops ``a`` at its
    next call and the task group cancels ``b``. That cancellation is the engine's: the call
    is not recorded as uncertain (no reconciliation, the run is not blocked); the next worker
    re-sends it with its key and the run completes."""
    tools = DrainTools(app)
    wf = tools.branches(app, tools.pack)  # b's tool runs until it is cancelled

    run = await tools.drain_during_slow(app, wf)
    assert run_status(sql, run)["status"] == "queued"
    assert sql("SELECT count(*) AS n FROM orchestrator.reconciliation_items")[0]["n"] == 0
    async with running(app):
        assert await run.result_async(timeout=20) == [["slow", "fast"], "packed"]
    assert tools.called.count("pack") == 2 and tools.called.count("slow") == 1
    assert sql("SELECT count(*) AS n FROM orchestrator.reconciliation_items")[0]["n"] == 0


async def test_an_intent_waiting_for_the_write_lock_when_a_sibling_stops_is_not_written(
        app, sql, monkeypatch):
    """Branch ``b``'s (consequential) call waits for the run's write lock, held by ``c``'s
    slow intent write, when the draining worker stops ``a`` and the task group cancels the
    others. The engine lets go of the run: ``b`` writes no intent (one written and never sent
    would be an uncertain operation on the next worker, for reconciliation); the next worker
    calls it once and the run completes."""
    slow_write(monkeypatch, nth=2)  # the second write: branch c's intent
    tools = DrainTools(app)
    # c (label): its intent write holds the lock until c is cancelled; b (fast) waits for it
    wf = tools.branches(app, tools.label, tools.fast)

    run = await tools.drain_during_slow(app, wf)
    assert run_status(sql, run)["status"] == "queued"
    assert [o["tool_name"] for o in sql(
        "SELECT tool_name FROM orchestrator.operations ORDER BY id")] == ["slow", "label"]
    async with running(app):
        assert await run.result_async(timeout=20) == [["slow", "fast"], "labelled", "fast"]
    assert tools.called.count("fast") == 2 and tools.called.count("slow") == 1
    assert sql("SELECT count(*) AS n FROM orchestrator.reconciliation_items")[0]["n"] == 0


def _watch_sweeps(worker):  # type: ignore[no-untyped-def]
    """The start times (monotonic) of the worker's finished sweeps for dead workers' runs."""
    sweeps: list[float] = []
    sweep = worker._sweep

    async def watched():  # type: ignore[no-untyped-def]
        began = time.monotonic()
        await sweep()
        sweeps.append(began)

    worker._sweep = watched
    return sweeps


async def test_a_lock_connection_blip_does_not_take_runs_from_a_live_worker(make_app, sql):
    """Worker A's liveness lock connection is killed while A runs a call: A is alive (it
    beats), so worker B, sweeping for dead workers' runs meanwhile, must leave A's run alone.
    The call returns once B has swept after A would have been judged dead had it stopped
    beating (``DEAD_AFTER``), and A holds its lock again."""
    from orchestrator.worker import DEAD_AFTER

    app = make_app(lease_ttl=30.0)
    wf, started, release = _held_call(app)

    def lock_holders(key):  # type: ignore[no-untyped-def]
        return _lock_holders(sql, key)

    async with running(app, worker_id="A") as a:
        run = await app.submit_async(wf, {})
        await asyncio.wait_for(started.wait(), 10)
        async with running(app, worker_id="B") as b:
            sweeps = _watch_sweeps(b)
            key = a._liveness.key
            (killed,) = lock_holders(key)
            sql("SELECT pg_terminate_backend(%s)", (killed,))
            blipped = time.monotonic()
            await wait_for(lambda: lock_holders(key) not in ([], [killed])
                           and any(t - blipped > DEAD_AFTER for t in sweeps), timeout=15)
            release.set()
            assert await run.result_async(timeout=15) == {"ok": True}
    assert [o["state"] for o in operations(sql)] == ["committed"]


async def test_a_lock_still_held_by_the_lost_session_does_not_stop_the_heartbeat(
        make_app, sql, migrated_database_url):
    """The liveness lock's connection can fail on the worker's side while the server keeps its
    session, and the lock, a while longer (a dropped network path: the server notices only
    when its keepalives give up). Taking the lock again must not wait for that session: the
    worker goes on beating and renewing its runs' leases meanwhile, and holds its lock again
    once the old session is gone."""
    import psycopg

    app = make_app(lease_ttl=2.0)
    wf, started, release = _held_call(app)

    def lock_holders(key):  # type: ignore[no-untyped-def]
        return _lock_holders(sql, key)

    def beat() -> Any:
        return _heartbeat_at(sql, "A")

    async with running(app, worker_id="A") as a:
        run = await app.submit_async(wf, {})
        await asyncio.wait_for(started.wait(), 10)
        key = a._liveness.key
        (lost,) = lock_holders(key)
        # The session left behind: it waits for the lock first, so it has it as soon as the
        # worker's connection to it is gone.
        async with await psycopg.AsyncConnection.connect(migrated_database_url,
                                                         autocommit=True) as behind:
            waiting = asyncio.ensure_future(
                behind.execute("SELECT pg_advisory_lock(%s)", (key,)))
            await wait_for(lambda: sql("SELECT 1 FROM pg_stat_activity WHERE wait_event_type "
                                       "= 'Lock' AND query LIKE '%%pg_advisory_lock%%'"))
            sql("SELECT pg_terminate_backend(%s)", (lost,))
            await asyncio.wait_for(waiting, 10)
            since, (lease,) = beat(), sql("SELECT lease_expires_at + interval '2 s' AS t "
                                          "FROM orchestrator.runs WHERE id = %s", (run.id,))
            await wait_for(lambda: beat() > since, timeout=5, what="a heartbeat")
            await wait_for(lambda: sql(  # renewed past the lease it had then
                "SELECT 1 FROM orchestrator.runs WHERE id = %s AND lease_owner = 'A' "
                "AND lease_expires_at > %s", (run.id, lease["t"])), timeout=5)
        await wait_for(lambda: lock_holders(key) not in ([], [lost]), timeout=10)
        release.set()
        assert await run.result_async(timeout=15) == {"ok": True}
    assert [o["state"] for o in operations(sql)] == ["committed"]


class _Relay:
    """A TCP relay to the test's PostgreSQL that can stop relaying while keeping every socket
    open: a dropped network path as both ends see it (what is sent is never answered, and
    nothing says the connection is gone)."""

    def __init__(self, host: str, port: int) -> None:
        self.target = (host, port)
        self.flowing = asyncio.Event()
        self.flowing.set()
        self._pumps: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> _Relay:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._server.close()
        for pump in self._pumps:
            pump.cancel()
        await asyncio.gather(*self._pumps, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection(*self.target)
        for source, sink in ((reader, up_writer), (up_reader, writer)):
            self._pumps.add(asyncio.ensure_future(self._pump(source, sink)))

    async def _pump(self, source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
        try:
            while data := await source.read(65536):
                await self.flowing.wait()
                sink.write(data)
                await sink.drain()
        finally:
            sink.close()


async def test_a_liveness_lock_whose_path_dropped_does_not_stop_the_heartbeat(
        make_app, sql, migrated_database_url):
    """The liveness lock lives on a connection of its own (``listen_url`` behind a pooler). When
    that connection's network path drops, its check waits for an answer that never comes
    (until the kernel gives up, minutes later): the worker's heartbeat and its runs' lease
    renewals, which go through the pool, must not wait with it."""
    from urllib.parse import urlsplit, urlunsplit

    parts = urlsplit(migrated_database_url)
    async with _Relay(parts.hostname or "127.0.0.1", parts.port or 5432) as relay:
        netloc = parts.netloc.rsplit("@", 1)
        host = f"127.0.0.1:{relay.port}"
        relayed = urlunsplit(parts._replace(
            netloc=f"{netloc[0]}@{host}" if len(netloc) == 2 else host))
        app = make_app(pooler="transaction", listen_url=relayed, lease_ttl=3.0)
        wf, started, release = _held_call(app)

        def beat() -> Any:
            return _heartbeat_at(sql, "A")

        def lease(run_id: Any) -> Any:
            return sql("SELECT lease_expires_at FROM orchestrator.runs WHERE id = %s",
                       (run_id,))[0]["lease_expires_at"]

        async with running(app, worker_id="A"):
            run = await app.submit_async(wf, {})
            await asyncio.wait_for(started.wait(), 10)
            relay.flowing.clear()  # the path to the lock's (and the listener's) session drops
            dropped, until = beat(), lease(run.id)
            await wait_for(lambda: beat() > dropped, timeout=5, what="a heartbeat")
            await wait_for(lambda: lease(run.id) > until, timeout=5, what="a lease renewal")
            release.set()
            assert await run.result_async(timeout=15) == {"ok": True}
    assert [o["state"] for o in operations(sql)] == ["committed"]


def _held_call(app):  # type: ignore[no-untyped-def]
    """A workflow whose one call runs until released: ``(workflow, started, release)``."""
    started, release = asyncio.Event(), asyncio.Event()

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        started.set()
        await release.wait()
        return {"ok": True}

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    return wf, started, release


def _lock_holders(sql, key):  # type: ignore[no-untyped-def]
    """The server processes holding advisory lock ``key``."""
    return [r["pid"] for r in sql(
        "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
        "AND classid::bigint = %s AND objid::bigint = %s",
        ((key >> 32) & 0xFFFFFFFF, key & 0xFFFFFFFF))]


def _heartbeat_at(sql, worker_id):  # type: ignore[no-untyped-def]
    return sql("SELECT heartbeat_at FROM orchestrator.workers WHERE id = %s",
               (worker_id,))[0]["heartbeat_at"]
