"""What workers and reconcilers log (docs/logging.md): a line per run that fails or needs
reconciliation, with its ids, code and incident and never the upstream text; ``ctx.log``,
silent while a workflow replays."""

from __future__ import annotations

import asyncio
import json
import logging
from datetime import timedelta
from typing import Any

import pytest

from orchestrator import OperationUncertain, RunFailed
from orchestrator.logs import JsonFormatter
from orchestrator.testing import fault_gate
from tests.integration.conftest import held_read, refuse_connections_while, running, wait_for

SECRET = "sk_live_SECRET"


def _lines(caplog: pytest.LogCaptureFixture, logger: str, **match: Any) -> list[dict[str, Any]]:
    """The records of ``logger`` as JSON lines (what ``--log-format json`` writes) whose fields
    equal ``match``."""
    formatter = JsonFormatter()
    lines = [json.loads(formatter.format(r)) for r in caplog.records if r.name == logger]
    return [line for line in lines if all(line.get(k) == v for k, v in match.items())]


def _no_secret(caplog: pytest.LogCaptureFixture) -> None:
    formatter = JsonFormatter()
    assert SECRET not in caplog.text
    assert not [r for r in caplog.records if SECRET in formatter.format(r)]


async def _bad_result(ctx: Any, data: Any) -> Any:
    return {SECRET}  # not a JSON value: INVALID_REQUEST, the run fails


async def _key_error(ctx: Any, data: Any) -> Any:
    return {}[SECRET]  # KeyError('sk_live_SECRET')


@pytest.mark.parametrize(("body", "cause"), [
    (_key_error, "KeyError"),
    (_bad_result, "INVALID_REQUEST"),
    ("bad_arguments", "INVALID_REQUEST"),
])
async def test_a_failed_run_is_logged_with_its_code_and_incident_and_no_secret(
        app, caplog, body, cause):  # type: ignore[no-untyped-def]
    @app.tool()
    async def charge(ctx, *, amount):  # type: ignore[no-untyped-def]
        return {"charged": amount}

    async def bad_arguments(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, token=SECRET)  # no such argument: INVALID_REQUEST

    wf = app.workflow(name="pays")(bad_arguments if body == "bad_arguments" else body)
    caplog.set_level(logging.INFO, logger="orchestrator")
    async with running(app):
        run = await app.submit_async(wf, {})
        with pytest.raises(RunFailed) as failed:
            await run.result_async(timeout=10)
    assert failed.value.code == "WORKFLOW_FAILED"
    lines = _lines(caplog, "orchestrator.worker", run_id=str(run.id))
    assert lines == [{
        "ts": lines[0]["ts"], "level": "INFO", "logger": "orchestrator.worker",
        "message": f"run {run.id} (pays@1) failed: WORKFLOW_FAILED "
                   f"(incident {failed.value.incident}; cause {cause})",
        "run_id": str(run.id), "workflow": "pays@1", "code": "WORKFLOW_FAILED",
        "incident": failed.value.incident, "cause": cause}]
    _no_secret(caplog)


async def test_a_run_that_needs_reconciliation_is_logged_and_so_is_the_reconciler(
        app, sql, caplog):  # type: ignore[no-untyped-def]
    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        raise ConnectionResetError(f"upstream said {SECRET}")  # sent, outcome unknown

    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    caplog.set_level(logging.INFO, logger="orchestrator")
    async with running(app):
        run = await app.submit_async(pay, {})
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs "
                                   "WHERE status = 'needs_reconciliation'"))
        await app.create_reconciler().run_once()
        with pytest.raises(OperationUncertain):
            await run.outcome_async()
    op = sql("SELECT id FROM orchestrator.operations")[0]["id"]
    unknown = sql("SELECT payload->>'incident' AS ref FROM orchestrator.journal "
                  "WHERE kind = 'call.unknown'")[0]["ref"]
    assert unknown.startswith("inc_")
    parked = _lines(caplog, "orchestrator.worker", level="INFO", run_id=str(run.id))
    assert [(p["message"], p["operation_id"], p["tool"], p["incident"]) for p in parked] == [
        (f"run {run.id} (pay@1) needs reconciliation: it waits for the outcome of operation "
         f"{op} (charge); incident {unknown}", op, "charge", unknown)]
    handed = _lines(caplog, "orchestrator.reconciler", run_id=str(run.id))
    assert [(h["message"], h["operation_id"], h["tool"]) for h in handed] == [
        (f"run {run.id}: operation {op} handed to operators: tool charge has no lookup here",
         op, "charge")]
    _no_secret(caplog)


async def test_ctx_log_is_silent_while_the_workflow_replays(app, sql, caplog):
    """Parked on an event, then on a timer: each execution replays the earlier ones' code.
    Each line is written once, by the execution that first got past it."""
    seen: list[tuple[str, bool]] = []

    @app.workflow()
    async def chatty(ctx, data):  # type: ignore[no-untyped-def]
        seen.append(("start", ctx.log.replaying))
        ctx.log.info("waiting for approval of order %s", data["order"])
        got = await ctx.wait_for_event("approved")  # position 0: parks
        seen.append(("approved", ctx.log.replaying))
        ctx.log.info("approved by %s", got["by"], extra={"step": "approval"})
        await ctx.sleep(timedelta(seconds=1.2))  # position 1: parks (not slept in memory)
        seen.append(("awake", ctx.log.replaying))
        ctx.log.warning("done")
        return "ok"

    caplog.set_level(logging.INFO, logger="orchestrator.workflow")
    async with running(app) as worker:
        run = await app.submit_async(chatty, {"order": 7})
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs WHERE status = 'waiting' "
                                   "AND waiting_for LIKE 'event%'"))
        await app.send_event_async(run.id, "approved", {"by": "carol"})
        assert await run.result_async(timeout=15) == "ok"
    assert worker.claimed == 3  # run, replayed after the event, replayed after the timer
    assert seen == [("start", False),
                    ("start", True), ("approved", False),
                    ("start", True), ("approved", True), ("awake", False)]
    records = [r for r in caplog.records if r.name == "orchestrator.workflow.chatty"]
    assert [(r.levelname, r.getMessage()) for r in records] == [
        ("INFO", "waiting for approval of order 7"), ("INFO", "approved by carol"),
        ("WARNING", "done")]
    for record in records:
        assert (record.run_id, record.workflow) == (str(run.id), "chatty@1")  # type: ignore[attr-defined]
    assert records[1].step == "approval"  # type: ignore[attr-defined]
    assert all(r.funcName == "chatty" for r in records)  # the caller's line, not the adapter's


async def test_a_run_that_cannot_end_for_an_unrecorded_outcome_is_logged(app, sql, caplog):
    """The guard that keeps a run from ending with an operation dispatched without an outcome
    (here a row fabricated while the run waited) parks it for reconciliation, and says so."""
    @app.workflow()
    async def waits(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.wait_for_event("go")
        return "done"

    caplog.set_level(logging.INFO, logger="orchestrator")
    async with running(app):
        run = await app.submit_async(waits, {})
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs WHERE status = 'waiting'"))
        op = sql("""INSERT INTO orchestrator.operations (run_id, position, attempt, tool_name,
                        tool_version, effect_class, tenant, principal, intent_digest, arguments,
                        idempotency_key, state)
                    SELECT id, 9, 1, 'ghost', '1', 'consequential', tenant, principal, 'x',
                           '{}', 'k', 'submitted' FROM orchestrator.runs
                    RETURNING id""")[0]["id"]
        await app.send_event_async(run.id, "go")
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs "
                                   "WHERE status = 'needs_reconciliation'"))
    parked = _lines(caplog, "orchestrator.worker", level="INFO", run_id=str(run.id))
    assert [(p["message"], p["operation_id"], p["tool"]) for p in parked] == [
        (f"run {run.id} (waits@1) needs reconciliation: it waits for the outcome of operation "
         f"{op} (ghost)", op, "ghost")]


async def test_a_stopping_worker_says_once_that_it_drains_and_what_is_in_flight(
        app, caplog):  # type: ignore[no-untyped-def]
    pay, entered, release = held_read(app)

    def said(text: str) -> list[str]:
        return [r.getMessage() for r in caplog.records
                if r.name == "orchestrator.worker" and text in r.getMessage()]

    caplog.set_level(logging.INFO, logger="orchestrator")
    async with running(app, drain_timeout=7) as worker:
        await app.submit_async(pay, {})
        await asyncio.wait_for(entered.wait(), 10)
        worker.request_stop()  # what SIGTERM does
        await wait_for(lambda: said(" draining: "))  # said at once, before the run lets go
        assert said(" stopped") == []
        release.set()
    assert said(" draining: ") == [f"worker {worker.worker_id} draining: 1 run in flight, up "
                                   "to 7 s to reach a durable point"]
    assert said(" stopped") == [f"worker {worker.worker_id} stopped"]


async def test_a_drain_that_runs_out_says_which_runs_it_abandoned(
        app, caplog):  # type: ignore[no-untyped-def]
    """Runs still busy when the drain timeout passes are abandoned: the worker says how many,
    how many it gave back at once, and which ones keep their leases (a call in flight),
    instead of only ``stopped``."""
    entered = asyncio.Event()

    @app.tool(effect="read")
    async def stuck(ctx):  # type: ignore[no-untyped-def]
        entered.set()
        await asyncio.Event().wait()

    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(stuck)

    caplog.set_level(logging.INFO, logger="orchestrator")
    async with running(app, drain_timeout=0.3) as worker:
        run = await app.submit_async(pay, {})
        await asyncio.wait_for(entered.wait(), 10)
    said = [r for r in caplog.records if r.name == "orchestrator.worker"
            and "abandoned" in r.getMessage()]
    assert [(r.levelname, r.getMessage()) for r in said] == [
        ("WARNING", f"worker {worker.worker_id}: 1 run did not reach a durable point within "
                    "the drain (0.3 s) and is abandoned: it is given back at once unless it "
                    "has a call in flight"),
        ("INFO", f"worker {worker.worker_id}: released 0 of the 1 run it abandoned, for "
                 "another worker at once; 1 kept (a call in flight: taken over when the lease "
                 "lapses)"),
        ("WARNING", f"run {run.id}: abandoned by the drain with a call in flight: it keeps its "
                    "lease until it lapses, and the call becomes unknown for the next holder")]


async def test_a_call_withheld_for_its_lease_is_logged_with_its_ids(
        make_app, sql, caplog):  # type: ignore[no-untyped-def]
    """A call not sent because the run's lease might end first: its line names the run, the
    operation, the tool and the workflow as fields, as every line about one call does."""
    app = make_app(lease_ttl=1.5)

    @app.tool()
    async def charge(ctx, *, amount):  # type: ignore[no-untyped-def]
        return {"charged": amount}

    @app.workflow(name="pays")
    async def pays(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, amount=1)

    caplog.set_level(logging.INFO, logger="orchestrator")
    with fault_gate("after_submitted", tool="charge") as gate:
        async with running(app):
            run = await app.submit_async(pays, {})
            await gate.arrived()
            # Another worker took the run: this one's renewals are refused from now on.
            sql("UPDATE orchestrator.runs SET lease_token = lease_token + 1 WHERE id = %s",
                (run.id,))
            await wait_for(lambda: _lines(caplog, "orchestrator.worker", run_id=str(run.id)),
                           what="the lease loss")
            gate.release()
            withheld = await wait_for(
                lambda: [line for line in _lines(caplog, "orchestrator.worker")
                         if "not sent" in line["message"]], what="the withheld call")
    (op,) = sql("SELECT id FROM orchestrator.operations WHERE run_id = %s", (run.id,))
    assert {k: withheld[0].get(k) for k in ("run_id", "operation_id", "tool", "workflow")} == {
        "run_id": str(run.id), "operation_id": op["id"], "tool": "charge",
        "workflow": "pays@1"}


async def test_a_short_outage_is_said_once_by_each_background_loop_and_once_when_it_ends(
        make_app, caplog, monkeypatch):  # type: ignore[no-untyped-def]
    """Every connection refused for two and a half seconds (a pooler that is down) while a run
    is in flight: the heartbeat, the claims, the lease renewals and the lease sweep each fail
    again and again (every quarter to half second). Each says it once, a WARNING starting with
    its usual words (``heartbeat failed: DATABASE_UNAVAILABLE (said once …``), and once at
    INFO that it succeeds again and after how long; then the run finishes on its lease. (Each
    failure was a WARNING: a dozen heartbeat lines and as many claim lines for this outage,
    hundreds on every worker for a failover of a minute.)"""
    import time

    app = make_app(lease_ttl=6.0)
    pay, entered, release = held_read(app)
    back_at = 0.0

    steps = {"heartbeat": "heartbeats", "claim": "claims", "lease renewal": "lease renewals",
             "lease sweep": "lease sweeps"}

    def said() -> dict[str, list[str]]:
        lines = [r for r in caplog.records if r.name == "orchestrator.worker"
                 and r.levelno >= logging.INFO]
        return {step: [r.levelname for r in lines
                       if r.getMessage().startswith((f"{step} failed: ",
                                                     f"{steps[step]} succeed again, "))]
                for step in steps}

    refuse_connections_while(monkeypatch, lambda: time.monotonic() < back_at)
    caplog.set_level(logging.INFO, logger="orchestrator")
    async with running(app, lease_ttl=6.0) as worker:
        run = await app.submit_async(pay, {})
        await asyncio.wait_for(entered.wait(), 10)
        back_at = time.monotonic() + 2.5
        await wait_for(lambda: time.monotonic() > back_at and all(
            "INFO" in levels for levels in said().values()) or time.monotonic() > back_at + 4,
            timeout=15)
        assert said() == {step: ["WARNING", "INFO"] for step in steps}, said()
        release.set()
        assert await run.result_async(timeout=10) == 1
        assert worker.metrics.snapshot().get("lease_losses", 0) == 0
    lines = {r.getMessage() for r in caplog.records if r.name == "orchestrator.worker"}
    assert "heartbeat failed: DATABASE_UNAVAILABLE (said once: a line says when heartbeats " \
           "succeed again)" in lines, lines
    assert any(line.startswith("lease renewals succeed again, ") and
               line.endswith(" s after the first that failed") for line in lines), lines


async def test_a_queue_whose_claim_keeps_failing_is_said_once_while_other_claims_succeed(
        make_app, caplog, monkeypatch):  # type: ignore[no-untyped-def]
    """The claims of one queue fail again and again (a statement timeout on that queue's
    claim, say) while the default queue's claims succeed in between: the queue's failure is
    said once, naming the queue, and no line says that claims succeed again. (With one streak
    for every source, each poll said the failure again and then, after the default queue's
    claim, that claims succeeded again: two lines a poll, the second false.)"""
    from orchestrator.db import queues as queues_db
    from orchestrator.errors import DatabaseError

    app = make_app()
    app.queue("slow", concurrency=10)

    @app.workflow(queue="slow")
    async def queued(ctx, data):  # type: ignore[no-untyped-def]
        return data

    @app.workflow()
    async def plain(ctx, data):  # type: ignore[no-untyped-def]
        return data

    tried: list[str] = []

    async def failing_claim(conn, *, queue, **kw):  # type: ignore[no-untyped-def]
        tried.append(queue)
        raise DatabaseError("canceling statement due to statement timeout")

    monkeypatch.setattr(queues_db, "queue_claim", failing_claim)
    caplog.set_level(logging.INFO, logger="orchestrator")
    async with running(app):
        await app.submit_async(queued, 0)
        for n in range(6):  # the default queue's claims succeed meanwhile
            run = await app.submit_async(plain, n)
            assert await run.result_async(timeout=10) == n
            await asyncio.sleep(0.1)
        await wait_for(lambda: len(tried) >= 3, timeout=10)
    lines = [r.getMessage() for r in caplog.records if r.name == "orchestrator.worker"
             and r.getMessage().startswith(("claim failed", "claims"))]
    assert lines == ["claim failed: DATABASE_UNAVAILABLE (queue slow) (said once: a line says "
                     "when claims from queue slow succeed again)"], lines


async def test_a_short_outage_is_said_once_by_the_schedules_ticker_and_once_when_it_ends(
        make_app, caplog, monkeypatch):  # type: ignore[no-untyped-def]
    """Every connection refused for a second while the schedules' ticker ticks every 50 ms:
    its ticks fail again and again. It says so once, a WARNING starting with its usual words
    (``schedules: a tick failed: DATABASE_UNAVAILABLE (said once …``), and once at INFO that
    ticks succeed again. (Each failed tick was a WARNING: twenty lines for this outage, one a
    second on every worker for a longer one.)"""
    import time

    app = make_app()
    back_at = time.monotonic() + 1.0
    refuse_connections_while(monkeypatch, lambda: time.monotonic() < back_at)
    caplog.set_level(logging.INFO, logger="orchestrator")

    def said() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "orchestrator.scheduler"
                and r.getMessage().startswith(("schedules: a tick failed",
                                               "schedules: ticks succeed again, "))]

    ticker = app.create_scheduler(interval=0.05)
    stop = asyncio.Event()
    task = asyncio.ensure_future(ticker.run(stop))
    try:
        await wait_for(lambda: time.monotonic() > back_at and any(
            r.levelno == logging.INFO for r in said()) or time.monotonic() > back_at + 3,
            timeout=10)
    finally:
        stop.set()
        await task
        await app.database.close()
    assert [r.levelname for r in said()] == ["WARNING", "INFO"], [r.getMessage() for r in said()]
    warning, info = said()
    assert warning.getMessage() == ("schedules: a tick failed: DATABASE_UNAVAILABLE (said once: "
                                    "a line says when ticks succeed again)")
    assert _lines(caplog, "orchestrator.scheduler", level="WARNING")[0]["code"] == \
        "DATABASE_UNAVAILABLE"
    assert info.getMessage().endswith(" s after the first that failed"), info.getMessage()


async def test_a_liveness_lock_that_cannot_be_checked_is_said_once_and_once_when_it_can(
        make_app, sql, caplog, monkeypatch):  # type: ignore[no-untyped-def]
    """The liveness lock's session ends during an outage of the pool's connections: the lock
    is taken again at once (its own connection), but checking it in ``pg_locks`` needs the
    pool, and fails at every heartbeat until the outage ends. That is said once, a WARNING
    starting as before (``worker …: could not check its liveness lock: DATABASE_UNAVAILABLE
    (said once …``), and once at INFO when the check succeeds again. (Each beat's failure was
    a WARNING, four a second.)"""
    import time

    app = make_app()
    back_at = 0.0
    refuse_connections_while(monkeypatch, lambda: time.monotonic() < back_at)
    caplog.set_level(logging.INFO, logger="orchestrator")
    async with running(app) as worker:
        await wait_for(lambda: worker._lock_held, timeout=10)
        prefix = f"worker {worker.worker_id}: "

        def said() -> list[logging.LogRecord]:
            return [r for r in caplog.records if r.name == "orchestrator.worker"
                    and r.getMessage().startswith(
                        (f"{prefix}could not check its liveness lock",
                         f"{prefix}liveness lock checks succeed again, "))]

        assert worker._liveness._conn is not None
        pid = worker._liveness._conn.pgconn.backend_pid
        back_at = time.monotonic() + 1.5
        sql("SELECT pg_terminate_backend(%s, 10000)", (pid,))
        await wait_for(lambda: time.monotonic() > back_at and any(
            r.levelno == logging.INFO for r in said()) or time.monotonic() > back_at + 3,
            timeout=10)
        assert worker._liveness.taken == 2
        await wait_for(lambda: worker._lock_held, timeout=10)
    assert [r.levelname for r in said()] == ["WARNING", "INFO"], [r.getMessage() for r in said()]
    warning, info = said()
    assert warning.getMessage() == (f"{prefix}could not check its liveness lock: "
                                    "DATABASE_UNAVAILABLE (said once: a line says when "
                                    "liveness lock checks succeed again)")
    assert info.getMessage().endswith(" s after the first that failed"), info.getMessage()
