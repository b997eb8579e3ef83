"""Schedules against a real database, the ticker on an injected clock (docs/schedules.md):
each slot fires once whoever ticks, catch-up after downtime, every overlap policy, triggers,
backfills, pause and resume, daylight saving, schedules declared in code, bad input, the CLI,
and a real worker firing a schedule on the database's clock."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg
import pytest

from orchestrator import InvalidRequest, Orchestrator
from orchestrator.errors import DatabaseError, IdempotencyConflict
from orchestrator.retention import Pruner, Retention
from orchestrator.scheduler import ScheduleInfo, Scheduler
from tests.clitools import run_cli
from tests.integration import large_records_app
from tests.integration.conftest import running, wait_for
from tests.integration.test_ops_bulk import lose_the_next_commit

Sql = Callable[..., list[dict[str, Any]]]
T0 = datetime(2026, 12, 3, 10, 0, 0, tzinfo=UTC)


def minute(n: int, second: float = 0.0) -> datetime:
    return T0 + timedelta(minutes=n, seconds=second)


def _app(make_app: Callable[..., Orchestrator], clock: list[datetime]) -> Orchestrator:
    app = make_app()

    @app.workflow()
    async def report(ctx, data):  # type: ignore[no-untyped-def]
        return data

    app.schedules.admin.ticker.clock = lambda: clock[0]
    return app


def _ticker(app: Orchestrator, clock: list[datetime]) -> Scheduler:
    return Scheduler(app.database, app.json_limits, app.metrics, clock=lambda: clock[0])


def slots(sql: Sql, schedule: str = "s") -> list[tuple[datetime, str, str | None]]:
    return [(r["slot"], r["state"], r["reason"]) for r in sql(
        "SELECT slot, state, reason FROM orchestrator.schedule_slots WHERE schedule_id = %s "
        "ORDER BY slot, kind", (schedule,))]


def runs_of(sql: Sql, schedule: str = "s") -> list[dict[str, Any]]:
    return sql("SELECT id, status, idempotency_key FROM orchestrator.runs "
               "WHERE idempotency_key LIKE %s ORDER BY idempotency_key",
               (f"schedule:{schedule}:%",))


async def test_each_slot_fires_once_however_many_tickers_tick(make_app, sql):
    clock = [T0]
    app = _app(make_app, clock)
    await app.schedules.create_async("s", "report", cron="* * * * *", overlap="allow_all",
                                     input={"n": 1})
    clock[0] = minute(5, 0.5)
    tickers = [_ticker(app, clock) for _ in range(4)]
    handled = await asyncio.gather(*(t.tick() for t in tickers))
    assert sum(handled) == 5
    assert [s[:2] for s in slots(sql)] == [(minute(n), "fired") for n in range(1, 6)]
    made = runs_of(sql)
    assert [r["idempotency_key"] for r in made] == [
        f"schedule:s:{minute(n):%Y%m%dT%H%M%S}Z" for n in range(1, 6)]
    assert await tickers[0].tick() == 0  # nothing is due twice
    info = await app.schedules.get_async("s")
    assert info.next_slot == minute(6) and info.last_slot == minute(5)
    await app.database.close()


async def test_after_downtime_only_the_slots_inside_the_catch_up_window_fire(make_app, sql):
    clock = [T0]
    app = _app(make_app, clock)
    await app.schedules.create_async("s", "report", cron="* * * * *", overlap="allow_all",
                                     catchup_window=timedelta(minutes=5))
    clock[0] = minute(10, 30)  # the fleet was away for ten minutes
    await _ticker(app, clock).tick()
    assert [s[0] for s in slots(sql)] == [minute(n) for n in range(6, 11)]
    assert len(runs_of(sql)) == 5
    gaps = sql("SELECT first_slot, last_slot, reason FROM orchestrator.schedule_gaps")
    assert gaps == [{"first_slot": minute(1), "last_slot": minute(5), "reason": "missed"}]
    detail = await app.schedules.show_async("s")
    assert detail.gaps[0]["reason"] == "missed" and detail.upcoming[0] == minute(11)
    await app.database.close()


async def test_the_upcoming_slots_are_in_one_time_zone_as_the_schedules_times(make_app):
    """``show().upcoming`` mixed the stored next slot (in the session's zone, as every time
    the database gives) with the computed ones (``datetime.UTC``)."""
    app = _app(make_app, [T0])
    await app.schedules.create_async("s", "report", cron="*/5 * * * *",
                                     timezone="Europe/Paris")
    detail = await app.schedules.show_async("s")
    assert detail.info.next_slot is not None and len(detail.upcoming) == 5
    assert detail.upcoming[0] == detail.info.next_slot
    assert {t.tzinfo for t in detail.upcoming} == {detail.info.next_slot.tzinfo}, [
        repr(t) for t in detail.upcoming]
    assert [b - a for a, b in zip(detail.upcoming, detail.upcoming[1:], strict=False)] == [
        timedelta(minutes=5)] * 4
    await app.database.close()


async def _policy(make_app, sql, overlap: str):  # type: ignore[no-untyped-def]
    clock = [T0]
    app = _app(make_app, clock)
    await app.schedules.create_async("s", "report", cron="* * * * *", overlap=overlap)
    ticker = _ticker(app, clock)

    async def tick(n: int) -> None:
        clock[0] = minute(n, 0.5)
        await ticker.tick()

    return app, tick


async def test_skip_drops_a_slot_while_the_previous_run_is_unfinished(make_app, sql):
    app, tick = await _policy(make_app, sql, "skip")
    await tick(1)
    await tick(2)  # run 1 is still queued: no worker here
    (first,) = runs_of(sql)
    await app.cancel_async(first["id"])
    await tick(3)
    assert slots(sql) == [(minute(1), "fired", None), (minute(2), "skipped", "overlap"),
                          (minute(3), "fired", None)]
    await app.database.close()


async def test_allow_all_fires_every_slot(make_app, sql):
    app, tick = await _policy(make_app, sql, "allow_all")
    for n in (1, 2, 3):
        await tick(n)
    assert [s[1] for s in slots(sql)] == ["fired"] * 3
    assert len(runs_of(sql)) == 3
    await app.database.close()


async def test_cancel_other_cancels_the_previous_run_and_fires(make_app, sql):
    app, tick = await _policy(make_app, sql, "cancel_other")
    await tick(1)
    await tick(2)
    first, second = runs_of(sql)
    assert first["status"] == "cancelled" and second["status"] == "queued"
    assert [s[1] for s in slots(sql)] == ["fired", "fired"]
    await app.database.close()


async def test_buffer_one_keeps_one_slot_until_the_previous_run_ends(make_app, sql):
    app, tick = await _policy(make_app, sql, "buffer_one")
    await tick(1)
    await tick(2)
    await tick(3)
    assert slots(sql) == [(minute(1), "fired", None), (minute(2), "buffered", None),
                          (minute(3), "skipped", "buffer_full")]
    assert (await app.schedules.get_async("s")).buffered == 1
    (first,) = runs_of(sql)
    await app.cancel_async(first["id"])
    clock_tick = minute(3, 40)
    await _ticker(app, [clock_tick]).tick()  # the previous run ended: the kept slot fires
    assert slots(sql)[1] == (minute(2), "fired", None)
    assert [r["idempotency_key"] for r in runs_of(sql)] == [
        f"schedule:s:{minute(n):%Y%m%dT%H%M%S}Z" for n in (1, 2)]
    assert (await app.schedules.get_async("s")).buffered == 0
    await app.database.close()


async def test_a_trigger_kept_by_a_buffer_fires_while_the_schedule_is_paused(make_app, sql):
    """Paused, a schedule fires no slot of its cron, but a trigger (asked for by name) still
    fires: kept by the buffer because the previous run is unfinished, it fires once that run
    has ended, pause or not, while the cron's slots kept before the pause wait for the
    resume."""
    app, tick = await _policy(make_app, sql, "buffer_all")
    await tick(1)
    await tick(2)  # run 1 is still queued (no worker here): the cron's slot is kept
    await app.schedules.pause_async("s")
    kept = await app.schedules.trigger_async("s")
    assert kept["state"] == "buffered"
    (first,) = runs_of(sql)
    await app.cancel_async(first["id"])
    await tick(4)  # paused: the cron's slots neither fire nor are kept; the trigger fires
    assert slots(sql) == [(minute(1), "fired", None), (minute(2), "buffered", None),
                          (minute(2, 0.5), "fired", None)]
    assert (await app.schedules.get_async("s")).buffered == 1
    fired = sql("SELECT run_id FROM orchestrator.schedule_slots WHERE kind = 'trigger'")
    assert fired[0]["run_id"] is not None
    await tick(5)  # the trigger's run is unfinished, and the schedule paused: nothing more
    assert len(runs_of(sql)) == 2
    await app.cancel_async(fired[0]["run_id"])
    await tick(6)
    assert len(runs_of(sql)) == 2  # the cron's kept slot waits for the resume
    await app.schedules.resume_async("s")
    await tick(6)
    assert slots(sql)[1] == (minute(2), "fired", None)
    await app.database.close()


async def test_buffer_all_fires_every_kept_slot_in_order_one_run_at_a_time(make_app, sql):
    app, tick = await _policy(make_app, sql, "buffer_all")
    for n in (1, 2, 3):
        await tick(n)
    assert [s[1] for s in slots(sql)] == ["fired", "buffered", "buffered"]
    for expected in (2, 3):
        running_run = [r for r in runs_of(sql) if r["status"] == "queued"]
        assert len(running_run) == 1
        await app.cancel_async(running_run[0]["id"])
        await tick(3)  # no new slot due: only the kept one fires
        assert [s[1] for s in slots(sql)][expected - 1] == "fired"
    assert len(runs_of(sql)) == 3
    assert (await app.schedules.get_async("s")).buffered == 0
    await app.database.close()


async def test_trigger_backfill_pause_and_resume(make_app, sql):
    clock = [T0]
    app = _app(make_app, clock)
    await app.schedules.create_async("s", "report", cron="0 * * * *", overlap="skip")
    clock[0] = T0 + timedelta(minutes=5)
    fired = await app.schedules.trigger_async("s")
    assert fired["state"] == "fired" and fired["run_id"] is not None
    clock[0] += timedelta(seconds=1)
    again = await app.schedules.trigger_async("s")  # the first is unfinished: skip
    assert again["state"] == "skipped" and again["run_id"] is None
    clock[0] += timedelta(seconds=1)
    forced = await app.schedules.trigger_async("s", overlap="allow_all")
    assert forced["state"] == "fired"
    # Backfill the three hours before: each slot fires (allow_all), once.
    said = await app.schedules.backfill_async("s", T0 - timedelta(hours=3), T0)
    assert [s["state"] for s in said] == ["fired"] * 4
    again_said = await app.schedules.backfill_async("s", T0 - timedelta(hours=3), T0)
    assert [s["state"] for s in again_said] == ["known"] * 4
    assert len(runs_of(sql)) == 2 + 4
    with pytest.raises(InvalidRequest) as info:
        await app.schedules.backfill_async("s", T0, T0 + timedelta(days=1))
    assert info.value.path == "end"
    # Paused, nothing fires; resumed, what passed is one gap and the next slot is ahead.
    await app.schedules.pause_async("s")
    clock[0] = T0 + timedelta(hours=3, minutes=30)
    assert await _ticker(app, clock).tick() == 0
    resumed = await app.schedules.resume_async("s")
    assert resumed.next_slot == T0 + timedelta(hours=4) and not resumed.paused
    gaps = sql("SELECT first_slot, last_slot, reason FROM orchestrator.schedule_gaps")
    assert gaps == [{"first_slot": T0 + timedelta(hours=1),
                     "last_slot": T0 + timedelta(hours=3), "reason": "paused"}]
    await app.database.close()


async def test_a_daily_slot_in_the_spring_gap_fires_when_the_clocks_have_jumped(make_app, sql):
    clock = [datetime(2026, 3, 28, 12, 0, tzinfo=UTC)]
    app = _app(make_app, clock)
    info = await app.schedules.create_async("s", "report", cron="30 2 * * *",
                                            timezone="Europe/Berlin")
    jump = datetime(2026, 3, 29, 1, 0, tzinfo=UTC)  # 02:00 CET -> 03:00 CEST
    assert info.next_slot == jump
    clock[0] = jump - timedelta(seconds=1)
    assert await _ticker(app, clock).tick() == 0
    clock[0] = jump + timedelta(seconds=1)
    assert await _ticker(app, clock).tick() == 1
    assert slots(sql) == [(jump, "fired", None)]
    assert (await app.schedules.get_async("s")).next_slot == datetime(
        2026, 3, 30, 0, 30, tzinfo=UTC)
    await app.database.close()


async def test_a_schedule_declared_in_code_is_written_by_the_ticker_and_changed_only_there(
        make_app, sql):
    app = make_app()

    @app.schedule("nightly", cron="0 3 * * *", timezone="Europe/Berlin", input={"kind": "all"})
    @app.workflow()
    async def report(ctx, data):  # type: ignore[no-untyped-def]
        return data

    await app.create_scheduler().declare()
    info = await app.schedules.get_async("nightly")
    assert info.declared and info.workflow == "report" and info.input == {"kind": "all"}
    await app.schedules.pause_async("nightly")
    await app.create_scheduler().declare()  # a restart keeps the pause
    assert (await app.schedules.get_async("nightly")).paused
    with pytest.raises(InvalidRequest) as info_update:
        await app.schedules.update_async("nightly", cron="0 4 * * *")
    assert info_update.value.path == "id"
    with pytest.raises(InvalidRequest):
        await app.schedules.delete_async("nightly")
    with pytest.raises(InvalidRequest) as twice:
        app.schedule("nightly", cron="0 3 * * *")(report)
    assert twice.value.path == "id"
    await app.database.close()


async def test_a_schedule_declared_over_another_apps_workflow_is_refused(make_app, sql):
    """``@app.schedule`` over a workflow that another ``Orchestrator`` registers (another
    module's app) declared a schedule whose runs no worker of this app runs: they would
    wait, queued, for ever. It is ``UNKNOWN_WORKFLOW`` at once, as ``app.schedules.create``,
    ``submit`` and ``ctx.run_child`` already refused that workflow, and nothing is declared."""
    from orchestrator.errors import UnknownWorkflow

    app, other = make_app(), make_app()

    @other.workflow(name="report")
    async def foreign(ctx, data):  # type: ignore[no-untyped-def]
        return data

    with pytest.raises(UnknownWorkflow, match="not registered with this orchestrator"
                       ) as refused:
        app.schedule("nightly", cron="0 3 * * *")(foreign)
    assert refused.value.code == "UNKNOWN_WORKFLOW"
    with pytest.raises(UnknownWorkflow):
        await app.schedules.create_async("nightly", foreign, cron="0 3 * * *")
    assert not app._declared_schedules
    await app.create_scheduler().declare()
    assert sql("SELECT count(*) AS n FROM orchestrator.schedules")[0]["n"] == 0

    @app.schedule("nightly", cron="0 3 * * *")
    @app.workflow(name="report")
    async def report(ctx, data):  # type: ignore[no-untyped-def]
        return data

    assert list(app._declared_schedules) == ["nightly"]
    await app.database.close()


async def test_the_runs_a_schedule_fires_wait_in_their_workflows_queue(make_app, sql):
    """A workflow's queue is the default for its runs, those its schedule fires too: they
    are bound by the queue's limits, whether the ticker, a trigger or a backfill fires them."""
    clock = [T0]
    app = make_app()
    app.queue("reports", concurrency=1)

    @app.schedule("nightly", cron="* * * * *", overlap="allow_all")
    @app.workflow(queue="reports")
    async def report(ctx, data):  # type: ignore[no-untyped-def]
        return data

    app.schedules.admin.ticker.clock = lambda: clock[0]
    ticker = app.create_scheduler()
    ticker.clock = lambda: clock[0]
    await ticker.declare()
    clock[0] = minute(2, 0.5)
    assert await ticker.tick() == 2
    await app.schedules.trigger_async("nightly")
    await app.schedules.backfill_async("nightly", T0 - timedelta(minutes=1), T0)
    made = sql("SELECT queue FROM orchestrator.runs")
    assert [r["queue"] for r in made] == ["reports"] * 5
    await app.database.close()


@pytest.mark.parametrize(("options", "path"), [
    ({"cron": "0 25 * * *"}, "cron"),
    ({"cron": "0 0 30 2 *"}, "cron"),  # never fires
    ({"cron": "0 3 * * *", "timezone": "Europe/Atlantis"}, "timezone"),
    ({"cron": "0 3 * * *", "timezone": "Europe"}, "timezone"),  # a region, not a zone
    ({"cron": "R 3 * * *"}, "cron"),  # croniter's random minute, drawn again at every tick
    ({"cron": "0 R(0-5) * * *"}, "cron"),
    ({"cron": "0 3 * * *", "overlap": "queue_them"}, "overlap"),
    ({"cron": "0 3 * * *", "catchup_window": timedelta(seconds=-5)}, "catchup_window"),
    ({"cron": "0 3 * * *", "input": {"x": float("nan")}}, "$.input.x"),
    ({"cron": "0 3 * * *", "paused": "no"}, "paused"),  # not taken for its truth value
    ({"cron": "0 3 * * *", "paused": 1}, "paused"),
    ({"cron": "0 3 * * *", "version": ""}, "version"),  # not "workflow 'report' is not
    ({"cron": "0 3 * * *", "version": 1}, "version"),   # registered"
    ({"cron": "0 3 * * *", "owner": "acme"}, "owner"),
])
async def test_bad_schedules_are_rejected_naming_the_field_and_nothing_is_written(
        make_app, sql, options: dict[str, Any], path: str):
    app = _app(make_app, [T0])
    with pytest.raises(InvalidRequest) as info:
        await app.schedules.create_async("s", "report", **options)
    assert info.value.code == "INVALID_REQUEST" and info.value.path == path
    with pytest.raises(InvalidRequest) as bad_id:
        await app.schedules.create_async("no spaces", "report", cron="0 3 * * *")
    assert bad_id.value.path == "id"
    assert sql("SELECT count(*) AS n FROM orchestrator.schedules")[0]["n"] == 0
    await app.database.close()


@pytest.mark.parametrize(("options", "path"), [
    ({"cron": ""}, "cron"),
    ({"timezone": ""}, "timezone"),
    ({"overlap": ""}, "overlap"),
    ({"catchup_window": timedelta(0)}, "catchup_window"),
    ({"version": ""}, "version"),
    ({"owner": "acme"}, "owner"),  # an AttributeError, not an error naming the field
    ({"owner": ("acme", "alice")}, "owner"),
])
async def test_a_bad_update_is_rejected_naming_the_field_and_changes_nothing(
        make_app, sql, options: dict[str, Any], path: str):
    """A value given to ``update`` is checked as ``create`` checks it: an empty or zero one
    is bad input, not a value left out."""
    app = _app(make_app, [T0])
    await app.schedules.create_async("s", "report", cron="0 3 * * *")
    before = sql("SELECT * FROM orchestrator.schedules")
    with pytest.raises(InvalidRequest) as info:
        await app.schedules.update_async("s", **options)
    assert info.value.code == "INVALID_REQUEST" and info.value.path == path
    assert sql("SELECT * FROM orchestrator.schedules") == before
    await app.database.close()


async def test_the_cli_lists_shows_triggers_and_pauses(make_app, sql, migrated_database_url):
    app = _app(make_app, [T0])
    await app.schedules.create_async("s", "report", cron="*/5 * * * *", input={"x": 1})
    await app.database.close()
    listed = run_cli(["schedules", "list", "--json"], database_url=migrated_database_url)
    assert listed.returncode == 0, listed.stderr
    (only,) = json.loads(listed.stdout)["schedules"]
    assert only["id"] == "s" and only["cron"] == "*/5 * * * *" and not only["paused"]
    fired = run_cli(["schedules", "trigger", "s", "--json"], database_url=migrated_database_url)
    assert fired.returncode == 0, fired.stderr
    assert json.loads(fired.stdout)["state"] == "fired"
    paused = run_cli(["schedules", "pause", "s"], database_url=migrated_database_url)
    assert paused.returncode == 0 and "paused" in paused.stdout
    shown = run_cli(["schedules", "show", "s"], database_url=migrated_database_url)
    assert shown.returncode == 0, shown.stderr
    assert "paused" in shown.stdout and "trigger" in shown.stdout
    missing = run_cli(["schedules", "show", "nope"], database_url=migrated_database_url)
    assert missing.returncode != 0 and "INVALID_REQUEST" in missing.stderr
    bad = run_cli(["schedules", "backfill", "s", "--from", "yesterday", "--to", "now"],
                  database_url=migrated_database_url)
    assert bad.returncode != 0 and "--from" in bad.stderr
    backwards = run_cli(["schedules", "backfill", "s", "--from", "2026-12-02T00:00:00Z",
                         "--to", "2026-12-01T00:00:00Z"], database_url=migrated_database_url)
    assert backwards.returncode == 2
    assert "INVALID_REQUEST: backfill needs --from before --to" in backwards.stderr
    ahead = run_cli(["schedules", "backfill", "s", "--from", "2026-12-01T00:00:00Z",
                     "--to", "2999-01-01T00:00:00Z"], database_url=migrated_database_url)
    assert ahead.returncode == 2 and "--to must not be later than now" in ahead.stderr


async def test_the_cli_says_when_no_worker_has_a_schedules_workflow(make_app, sql,
                                                                      migrated_database_url):
    """A schedule whose workflow version no live worker registers (removed from the code,
    or its version retired) fires runs that wait, queued, until a worker that has it starts
    (docs/versioning.md). ``runs list`` said so of each run; ``schedules list`` and ``show``
    showed the schedule as plainly active, and its later slots as skipped for overlap. They
    now say it too: ``blocked`` ``no worker has report@1``, null once a live worker has it."""
    app = _app(make_app, [T0])
    await app.schedules.create_async("s", "report", cron="*/5 * * * *")
    await app.database.close()
    fired = run_cli(["schedules", "trigger", "s"], database_url=migrated_database_url)
    assert fired.returncode == 0, fired.stderr
    listed = run_cli(["schedules", "list", "--json"], database_url=migrated_database_url)
    assert listed.returncode == 0, listed.stderr
    assert json.loads(listed.stdout)["schedules"][0]["blocked"] == "no worker has report@1"
    table = run_cli(["schedules", "list"], database_url=migrated_database_url)
    assert "no worker has report@1" in table.stdout
    shown = run_cli(["schedules", "show", "s"], database_url=migrated_database_url)
    assert shown.returncode == 0, shown.stderr
    assert "no worker has report@1" in shown.stdout
    assert "its runs wait, queued" in shown.stdout
    as_json = run_cli(["schedules", "show", "s", "--json"], database_url=migrated_database_url)
    assert json.loads(as_json.stdout)["blocked"] == "no worker has report@1"
    # A live worker with another version does not serve it; one with report@1 does.
    sql("""INSERT INTO orchestrator.workers (id, hostname, pid, workflows, concurrency,
                                             heartbeat_at)
           VALUES ('w-2', 'h', 1, ARRAY['report@2'], 1, now())""")
    listed = run_cli(["schedules", "list", "--json"], database_url=migrated_database_url)
    assert json.loads(listed.stdout)["schedules"][0]["blocked"] == "no worker has report@1"
    sql("""INSERT INTO orchestrator.workers (id, hostname, pid, workflows, concurrency,
                                             heartbeat_at)
           VALUES ('w-1', 'h', 2, ARRAY['report@1'], 1, now())""")
    listed = run_cli(["schedules", "list", "--json"], database_url=migrated_database_url)
    assert json.loads(listed.stdout)["schedules"][0]["blocked"] is None
    shown = run_cli(["schedules", "show", "s"], database_url=migrated_database_url)
    assert "no worker has" not in shown.stdout


async def test_the_cli_fires_under_the_applications_limits_with_app(make_app, sql,
                                                                    migrated_database_url):
    """A schedule whose input the application accepted under larger JSON limits than the
    default is fired from the CLI with ``--app``; without it the command says to pass it and
    fires nothing."""
    app = make_app(max_record_bytes=large_records_app.MAX_RECORD_BYTES)

    @app.workflow()
    async def report(ctx, data):  # type: ignore[no-untyped-def]
        return len(data)

    big = "x" * (2 * 1024 * 1024)  # over the default 1 MiB cap, under the application's
    await app.schedules.create_async("big", "report", cron="0 3 * * *", input=big)
    await app.database.close()
    refused = run_cli(["schedules", "trigger", "big"], database_url=migrated_database_url)
    assert refused.returncode != 0
    assert "PAYLOAD_TOO_LARGE" in refused.stderr and "--app MODULE:ATTR" in refused.stderr
    assert runs_of(sql, "big") == []
    fired = run_cli(["schedules", "trigger", "big", "--json", "--app",
                     "tests.integration.large_records_app:app"],
                    database_url=migrated_database_url)
    assert fired.returncode == 0, fired.stderr
    assert json.loads(fired.stdout)["state"] == "fired" and len(runs_of(sql, "big")) == 1


async def test_a_worker_fires_a_schedule_on_the_database_clock(make_app, sql):
    app = make_app()

    @app.workflow()
    async def report(ctx, data):  # type: ignore[no-untyped-def]
        return data

    await app.schedules.create_async("every-second", "report", cron="* * * * * *",
                                     overlap="allow_all", input={"ok": True})
    async with running(app):
        await wait_for(lambda: len([r for r in runs_of(sql, "every-second")
                                    if r["status"] == "succeeded"]) >= 3, timeout=15)
    handled = slots(sql, "every-second")
    times = [s[0] for s in handled]
    assert all(b - a == timedelta(seconds=1) for a, b in zip(times, times[1:], strict=False))


async def test_a_ticker_that_cannot_declare_at_first_tries_again(make_app, sql, monkeypatch):
    app = make_app()

    @app.schedule("nightly", cron="0 3 * * *")
    @app.workflow()
    async def report(ctx, data):  # type: ignore[no-untyped-def]
        return data

    ticker = app.create_scheduler(interval=0.05)
    real = ticker.declare
    failures = []

    async def flaky_declare() -> None:
        if not failures:
            failures.append(1)
            raise DatabaseError("the database is restarting")
        await real()

    monkeypatch.setattr(ticker, "declare", flaky_declare)
    stop = asyncio.Event()
    task = asyncio.ensure_future(ticker.run(stop))
    await wait_for(lambda: sql("SELECT 1 FROM orchestrator.schedules WHERE id = 'nightly'"))
    stop.set()
    await task
    assert failures == [1]
    await app.database.close()


async def test_a_backfill_over_its_bound_is_refused_and_fires_nothing(make_app, sql):
    clock = [T0]
    app = _app(make_app, clock)
    await app.schedules.create_async("s", "report", cron="* * * * * *", overlap="allow_all")
    with pytest.raises(InvalidRequest) as info:  # 10,001 slots of one second
        await app.schedules.backfill_async("s", T0 - timedelta(seconds=10_000), T0)
    assert info.value.path == "end"
    assert slots(sql) == [] and runs_of(sql) == []
    said = await app.schedules.backfill_async("s", T0 - timedelta(seconds=2), T0)
    assert [s["state"] for s in said] == ["fired"] * 3
    assert [s["run_id"] for s in said] == [r["id"] for r in runs_of(sql)]
    await app.database.close()


async def test_retention_prunes_slot_records_with_their_runs(make_app, sql):
    """A slot record past the finished runs' period goes once it fired no run or its run is
    pruned; a buffered slot and the record of a run not pruned stay; a backfill over the
    pruned range answers with the pruned runs (their submission keys), never a second run."""
    app, tick = await _policy(make_app, sql, "buffer_one")
    for n in (1, 2, 3):
        await tick(n)  # minute 1 fires (its run waits: no worker), 2 is kept, 3 skipped
    now = Retention(finished_runs=timedelta(0), evidence=None)
    report = await Pruner(app.database, now).prune()
    assert (report.runs, report.schedule_slots) == (0, 1)  # the skipped slot's record
    assert slots(sql) == [(minute(1), "fired", None), (minute(2), "buffered", None)]

    (first,) = runs_of(sql)
    await app.cancel_async(first["id"])
    await tick(4)  # the kept slot fires; minute 4 is kept behind it
    second = [r for r in runs_of(sql) if r["status"] == "queued"]
    await app.cancel_async(second[0]["id"])
    await tick(4)  # minute 4 fires too
    third = [r for r in runs_of(sql) if r["status"] == "queued"]
    await app.cancel_async(third[0]["id"])
    dry = await Pruner(app.database, now).prune(dry_run=True)
    assert (dry.runs, dry.schedule_slots) == (3, 0)  # their runs are not pruned yet
    report = await Pruner(app.database, now).prune()
    assert (report.runs, report.schedule_slots) == (3, 3)
    assert slots(sql) == []
    assert report.as_dict()["schedule_slots"] == 3

    said = await app.schedules.backfill_async("s", minute(1), minute(4))
    assert [s["state"] for s in said] == ["fired"] * 4
    made = runs_of(sql)
    assert len(made) == 4  # minutes 1, 2 and 4 answered with their pruned runs; 3 fired now
    pruned = {r["id"] for r in made if r["id"] in {first["id"], second[0]["id"],
                                                   third[0]["id"]}}
    assert len(pruned) == 3
    assert {s["run_id"] for s in said} == {r["id"] for r in made}
    await app.database.close()


async def test_a_backfill_from_before_the_calendar_is_refused_and_fires_nothing(make_app, sql):
    clock = [T0]
    app = _app(make_app, clock)
    await app.schedules.create_async("s", "report", cron="0 * * * *",
                                     timezone="America/New_York", overlap="allow_all")
    start = datetime(1, 1, 1, 5, tzinfo=UTC)
    with pytest.raises(InvalidRequest) as info:
        await app.schedules.backfill_async("s", start, start + timedelta(days=1))
    assert info.value.code == "INVALID_REQUEST" and info.value.path == "start"
    assert slots(sql) == [] and runs_of(sql) == []
    await app.database.close()


async def test_a_backfill_refused_in_python_names_its_parameters(make_app, sql):
    """``backfill(schedule_id, start, end)`` refuses a bad range naming ``start`` and
    ``end``, the parameters given, not the command line's ``--from`` and ``--to`` (nor
    ``time``, which is no parameter's name); the command line keeps its flags."""
    clock = [T0]
    app = _app(make_app, clock)
    await app.schedules.create_async("s", "report", cron="0 * * * *", overlap="allow_all")
    naive = T0.replace(tzinfo=None)
    hour = timedelta(hours=1)
    refusals = [(naive - hour, T0, "start"), (T0 - hour, naive, "end"),
                (T0, T0 - hour, "start"), (T0, T0 + hour, "end")]
    for start, end, path in refusals:
        with pytest.raises(InvalidRequest) as info:
            await app.schedules.backfill_async("s", start, end)
        assert info.value.path == path
        assert path in info.value.message and "--" not in info.value.message
    assert slots(sql) == [] and runs_of(sql) == []
    await app.database.close()


async def test_expiring_evidence_keeps_the_chain_a_schedule_follows(make_app, sql):
    """The run a schedule fired continued as new and its newest generation is unfinished: the
    first generation, finished, is pruned and its evidence period ends, but its row and those
    of the chain stay while the chain runs (the overlap policy follows them to the running
    generation), so the next slot is still skipped, never fired beside the running one. Once
    the chain ends they go with the rest."""
    clock = [T0]
    app = make_app()

    @app.workflow()
    async def poll(ctx, state):  # type: ignore[no-untyped-def]
        if state["generation"] < 2:
            ctx.continue_as_new({"generation": state["generation"] + 1})
        await ctx.wait_for_event("stop")
        return state

    app.schedules.admin.ticker.clock = lambda: clock[0]
    await app.schedules.create_async("s", "poll", cron="* * * * *", overlap="skip",
                                     input={"generation": 0})
    ticker = _ticker(app, clock)
    clock[0] = minute(1, 0.5)
    await ticker.tick()
    (first,) = runs_of(sql)
    chain = "SELECT id, status FROM orchestrator.runs WHERE workflow_name = 'poll'"
    async with running(app, schedules=False):  # ticked here alone
        await wait_for(lambda: [r["status"] for r in sql(chain)].count("waiting") == 1,
                       timeout=20)
    rules = Retention(finished_runs=timedelta(0), evidence=timedelta(0))
    report = await Pruner(app.database, rules).prune()
    clock[0] = minute(2, 0.5)
    await ticker.tick()
    assert len(runs_of(sql)) == 1  # nothing fired beside the running generation
    assert slots(sql) == [(minute(2), "skipped", "overlap")]  # minute 1's went with its run
    assert (report.runs, report.evidence_runs) == (2, 0)  # pruned, their rows kept
    assert first["id"] in {r["id"] for r in sql(chain)}

    (last,) = [r for r in sql(chain) if r["status"] == "waiting"]
    async with running(app, schedules=False):  # ticked here alone
        await app.send_event_async(last["id"], "stop")
        await wait_for(lambda: sql(chain + " AND status = 'waiting'") == [], timeout=20)
    report = await Pruner(app.database, rules).prune()
    assert (report.runs, report.evidence_runs) == (1, 3)  # the chain ended: its rows go
    await app.database.close()


def _waiting_on_locks(sql: Sql) -> int:
    """How many sessions of this database wait for a lock (a test signal, not a sleep)."""
    return int(sql("SELECT count(*) AS n FROM pg_stat_activity WHERE datname = "
                   "current_database() AND wait_event_type = 'Lock'")[0]["n"])


async def test_two_updates_of_one_schedule_both_land(make_app, sql, migrated_database_url):
    """Two updates of one schedule at once, each changing one field (as a firing holds the
    row): each reads the schedule under its lock and changes what it was given, so neither
    writes back the other's field as it was before."""
    clock = [T0]
    app = _app(make_app, clock)
    await app.schedules.create_async("s", "report", cron="0 * * * *", input={"x": 1})
    async with await psycopg.AsyncConnection.connect(migrated_database_url) as firing:
        async with firing.transaction():
            await firing.execute("SELECT 1 FROM orchestrator.schedules WHERE id = 's' "
                                 "FOR UPDATE")
            first = asyncio.ensure_future(app.schedules.update_async("s", input={"x": 2}))
            await wait_for(lambda: _waiting_on_locks(sql) == 1)
            second = asyncio.ensure_future(app.schedules.update_async("s", cron="*/5 * * * *"))
            await wait_for(lambda: _waiting_on_locks(sql) == 2)
        await asyncio.gather(first, second)
    info = await app.schedules.get_async("s")
    assert (info.cron, info.input) == ("*/5 * * * *", {"x": 2})
    assert info.next_slot == T0 + timedelta(minutes=5)
    await app.database.close()



async def test_a_trigger_with_a_key_fires_once_however_often_it_is_sent(make_app, sql):
    """A trigger sent again with its idempotency key (a retry after a lost answer, two
    operators at once) answers with what became of the first: its slot and its run, never a
    second run; even when the first was skipped, or its run has since finished."""
    clock = [T0]
    app = _app(make_app, clock)
    await app.schedules.create_async("s", "report", cron="0 * * * *", overlap="skip")
    clock[0] = minute(5)
    first = await app.schedules.trigger_async("s", idempotency_key="deploy-42")
    assert first["state"] == "fired"
    clock[0] = minute(6)
    (made,) = runs_of(sql)
    await app.cancel_async(made["id"])  # finished: a new trigger would fire
    again = await app.schedules.trigger_async("s", idempotency_key="deploy-42")
    assert again == {**first, "repeated": True}
    moments = iter([minute(7, n) for n in range(10)])  # each call reads its own moment
    app.schedules.admin.ticker.clock = lambda: next(moments)
    both = await asyncio.gather(*(app.schedules.trigger_async("s", idempotency_key="k2")
                                  for _ in range(2)))
    assert sorted(answer["repeated"] for answer in both) == [False, True]
    assert {**both[0], "repeated": None} == {**both[1], "repeated": None}
    assert both[0]["state"] == "fired"
    assert len(runs_of(sql)) == 2
    skipped = await app.schedules.trigger_async("s", idempotency_key="k3")  # k2's runs
    assert skipped["state"] == "skipped"
    await app.cancel_async(both[0]["run_id"])
    assert await app.schedules.trigger_async("s", idempotency_key="k3") == {
        **skipped, "repeated": True}
    with pytest.raises(IdempotencyConflict):  # the same key, another policy
        await app.schedules.trigger_async("s", idempotency_key="k3", overlap="allow_all")
    with pytest.raises(InvalidRequest) as bad:
        await app.schedules.trigger_async("s", idempotency_key="no spaces")
    assert bad.value.path == "idempotency_key"
    assert len(runs_of(sql)) == 2 and len(slots(sql)) == 3
    await app.database.close()


async def test_the_cli_fires_into_the_workflows_queue_without_the_app(make_app, sql,
                                                                     migrated_database_url):
    """The queue a schedule's runs wait in is stored with the schedule: the CLI, which has no
    application code without ``--app``, fires a trigger and a backfill into it too (and a
    trigger sent again with its key fires nothing)."""
    app = make_app()
    app.queue("reports", concurrency=1)

    @app.workflow(queue="reports")
    async def report(ctx, data):  # type: ignore[no-untyped-def]
        return data

    await app.schedules.create_async("s", "report", cron="0 3 * * *", overlap="allow_all")
    await app.database.close()
    answers = []
    for _ in range(2):  # sent again with its key: the same run, nothing fired
        fired = run_cli(["schedules", "trigger", "s", "--idempotency-key", "release-7",
                         "--json"], database_url=migrated_database_url)
        assert fired.returncode == 0, fired.stderr
        answers.append(json.loads(fired.stdout))
    assert answers[1] == {**answers[0], "repeated": True}
    assert answers[0]["state"] == "fired" and not answers[0]["repeated"]
    now = datetime.now(UTC)
    filled = run_cli(["schedules", "backfill", "s", "--from",
                      f"{now - timedelta(days=2):%Y-%m-%dT%H:%M:%SZ}", "--to",
                      f"{now:%Y-%m-%dT%H:%M:%SZ}"], database_url=migrated_database_url)
    assert filled.returncode == 0, filled.stderr
    made = sql("SELECT queue FROM orchestrator.runs")
    assert len(made) == 3 and {r["queue"] for r in made} == {"reports"}


async def test_a_ticker_that_knows_the_workflow_keeps_the_stored_queue_true(make_app, sql):
    """A schedule stored before its queue was (or whose workflow's queue the code changed)
    fires into the queue the firing worker's code names, and the schedule stores it for
    whoever fires it next without the code."""
    clock = [T0]
    app = make_app()
    app.queue("reports", concurrency=1)

    @app.workflow(queue="reports")
    async def report(ctx, data):  # type: ignore[no-untyped-def]
        return data

    app.schedules.admin.ticker.clock = lambda: clock[0]
    await app.schedules.create_async("s", "report", cron="* * * * *", overlap="allow_all")
    sql("UPDATE orchestrator.schedules SET queue = NULL")  # as stored before 0027
    ticker = app.create_scheduler()
    ticker.clock = lambda: clock[0]
    clock[0] = minute(1, 0.5)
    assert await ticker.tick() == 1
    assert sql("SELECT queue FROM orchestrator.runs") == [{"queue": "reports"}]
    assert sql("SELECT queue FROM orchestrator.schedules") == [{"queue": "reports"}]
    await app.database.close()


async def test_a_schedule_removed_from_the_code_can_be_deleted(make_app, sql):
    """A schedule declared in code stays stored, and fires, when the code no longer declares
    it: the code that declares it still refuses to delete it, the code that does not deletes
    it (before, nothing could, and it fired for ever)."""
    old = make_app()

    @old.schedule("nightly", cron="0 3 * * *")
    @old.workflow()
    async def report(ctx, data):  # type: ignore[no-untyped-def]
        return data

    await old.create_scheduler().declare()
    new = make_app()  # the next deploy: the workflow without its schedule
    new.workflow(name="report")(report.fn)
    with pytest.raises(InvalidRequest) as refused:
        await old.schedules.delete_async("nightly")
    assert refused.value.path == "id"
    await new.schedules.delete_async("nightly")
    assert sql("SELECT id FROM orchestrator.schedules") == []
    await old.database.close()
    await new.database.close()


async def test_a_keyed_trigger_kept_by_a_buffer_answers_with_its_run_once_it_fired(make_app,
                                                                                   sql):
    clock = [T0]
    app = _app(make_app, clock)
    await app.schedules.create_async("s", "report", cron="0 * * * *", overlap="buffer_one")
    clock[0] = minute(5)
    first = await app.schedules.trigger_async("s")
    clock[0] = minute(6)
    kept = await app.schedules.trigger_async("s", idempotency_key="kept-1")
    assert kept["state"] == "buffered" and kept["run_id"] is None
    await app.cancel_async(first["run_id"])
    clock[0] = minute(7)
    await _ticker(app, clock).tick()  # the previous run ended: the kept trigger fires
    again = await app.schedules.trigger_async("s", idempotency_key="kept-1")
    assert again["state"] == "fired" and again["slot"] == minute(6)
    assert again["run_id"] in {r["id"] for r in runs_of(sql)} and len(runs_of(sql)) == 2
    await app.database.close()


async def test_the_cli_deletes_a_schedule_under_the_rules_of_app_schedules_delete(
        make_app, sql, migrated_database_url):
    """``schedules delete ID``: a schedule made at run time goes (``--json``: the schedule as
    it stood); one declared in code goes only with ``--app`` naming code that no longer
    declares it (without the code the command cannot tell, and refuses); a missing id is
    ``INVALID_REQUEST`` naming it. A refusal deletes nothing."""
    app = make_app()

    @app.schedule("nightly", cron="0 3 * * *")
    @app.workflow()
    async def report(ctx, data):  # type: ignore[no-untyped-def]
        return data

    await app.create_scheduler().declare()
    await app.schedules.create_async("s", "report", cron="*/5 * * * *", input={"x": 1})
    await app.database.close()

    def delete(*args: str) -> Any:
        return run_cli(["schedules", "delete", *args], database_url=migrated_database_url)

    def stored() -> list[str]:
        return [r["id"] for r in sql("SELECT id FROM orchestrator.schedules ORDER BY id")]

    gone = delete("s", "--json")
    assert gone.returncode == 0, gone.stderr
    said = json.loads(gone.stdout)
    assert (said["id"], said["cron"], said["input"], said["declared"]) == (
        "s", "*/5 * * * *", {"x": 1}, False)
    assert stored() == ["nightly"]
    missing = delete("s")
    assert missing.returncode != 0 and missing.stdout == ""
    assert "INVALID_REQUEST" in missing.stderr and "no schedule s" in missing.stderr
    unknown_code = delete("nightly")
    assert unknown_code.returncode != 0 and unknown_code.stdout == ""
    assert "INVALID_REQUEST" in unknown_code.stderr and "--app" in unknown_code.stderr
    still_declared = delete("nightly", "--app", "tests.integration.schedule_apps:declaring")
    assert still_declared.returncode != 0 and "INVALID_REQUEST" in still_declared.stderr
    assert "declared in code" in still_declared.stderr
    assert stored() == ["nightly"]
    removed = delete("nightly", "--app", "tests.integration.schedule_apps:removed")
    assert removed.returncode == 0, removed.stderr
    assert removed.stdout.strip().startswith("schedule nightly deleted")
    assert stored() == []


async def test_a_trigger_sent_again_with_its_key_says_it_is_a_repeat(
        make_app, sql, migrated_database_url):
    """The answer to a keyed trigger says whether this call fired (``repeated`` false) or
    answers with what an earlier one with the key did (true); the CLI says so in words."""
    app = make_app()

    @app.workflow()
    async def report(ctx, data):  # type: ignore[no-untyped-def]
        return data

    await app.schedules.create_async("s", "report", cron="0 3 * * *", overlap="allow_all")
    first = await app.schedules.trigger_async("s", idempotency_key="k1")
    again = await app.schedules.trigger_async("s", idempotency_key="k1")
    unkeyed = await app.schedules.trigger_async("s")
    assert (first["repeated"], again["repeated"], unkeyed["repeated"]) == (False, True, False)
    assert {**again, "repeated": False} == first
    await app.database.close()

    def trigger(*args: str) -> Any:
        said = run_cli(["schedules", "trigger", "s", *args], database_url=migrated_database_url)
        assert said.returncode == 0, said.stderr
        return said.stdout.strip()

    fired = trigger("--idempotency-key", "k2")
    (run,) = [r["id"] for r in runs_of(sql) if r["id"] not in (first["run_id"],
                                                                 unkeyed["run_id"])]
    assert fired == f"schedule s fired: run {run}"
    assert trigger("--idempotency-key", "k2") == (
        f"schedule s: already triggered with this key: run {run}; nothing fired again")
    shown = json.loads(trigger("--idempotency-key", "k2", "--json"))
    assert (shown["repeated"], shown["run_id"], shown["state"]) == (True, str(run), "fired")
    assert json.loads(trigger("--json"))["repeated"] is False
    assert len(runs_of(sql)) == 4


async def test_a_delete_whose_commit_was_lost_reports_the_schedule_it_deleted(
        make_app, sql, monkeypatch):
    """The connection goes while a delete's COMMIT is under way, and the COMMIT applied: run
    again by the storage layer, the delete finds no schedule, and that is its own work. It
    answers with the schedule as it stood, as when nothing was lost; a delete sent again
    later (not a retry) is still told there is no such schedule."""
    clock = [T0]
    app = _app(make_app, clock)
    made = await app.schedules.create_async("s", "report", cron="0 * * * *")
    lose_the_next_commit(monkeypatch, app.database)
    deleted = await app.schedules.admin.delete("s")  # what `schedules delete --json` prints
    assert deleted == made
    assert sql("SELECT id FROM orchestrator.schedules") == []
    with pytest.raises(InvalidRequest) as again:
        await app.schedules.delete_async("s")
    assert again.value.path == "id" and "no schedule s" in str(again.value)
    await app.database.close()


def test_delete_answers_the_schedule_it_deleted_as_pause_and_resume_answer_theirs(
        make_app, sql):
    """``app.schedules.delete`` (and its twin) returns the schedule as it stood, as ``pause``,
    ``resume`` and ``update`` return the schedule they wrote; an unknown id is refused as
    they refuse it (``INVALID_REQUEST``, ``path`` ``id``)."""
    app = _app(make_app, [T0])
    app.schedules.create("s", "report", cron="0 * * * *")
    made = app.schedules.create("t", "report", cron="0 * * * *")
    paused = app.schedules.pause("s")
    assert paused.paused
    deleted = app.schedules.delete("s")
    assert isinstance(deleted, ScheduleInfo)
    assert deleted == paused
    assert app.schedules.delete("t") == made
    assert sql("SELECT id FROM orchestrator.schedules") == []
    for method in (app.schedules.delete, app.schedules.pause, app.schedules.resume):
        with pytest.raises(InvalidRequest) as missing:
            method("s")
        assert missing.value.path == "id" and "no schedule s" in missing.value.message


async def test_what_an_operator_does_to_a_schedule_is_audited(make_app, sql,
                                                              migrated_database_url):
    """Pausing, resuming, triggering, backfilling and deleting a schedule are operator
    actions (CONTRACT C17): each writes an audit row, in its own transaction, with who, why
    and the schedule's tenant (its runs' owner), and the before and after; without
    --operator the row names the login that ran the command and says no reason was given."""
    app = _app(make_app, [T0])
    await app.schedules.create_async("s", "report", cron="*/5 * * * *", input={"x": 1})
    await app.database.close()
    url = migrated_database_url
    for args in (["pause", "s", "--operator", "alice", "--evidence", "the report is wrong"],
                 ["resume", "s", "--operator", "alice", "--evidence", "fixed in 1.2"],
                 ["trigger", "s", "--operator", "bob", "--evidence", "sent by hand"],
                 ["backfill", "s", "--from", "2026-12-03T10:00:00Z",
                  "--to", "2026-12-03T10:05:00Z", "--operator", "bob",
                  "--evidence", "missed in the outage"],
                 ["delete", "s"]):
        done = run_cli(["schedules", *args], database_url=url)
        assert done.returncode == 0, (args, done.stderr)
    audit = sql("SELECT operator, action, target_kind, target_id, tenant, evidence, before, "
                "after FROM orchestrator.operator_audit ORDER BY id")
    assert [(a["action"], a["operator"], a["evidence"]) for a in audit[:4]] == [
        ("schedule.pause", "alice", "the report is wrong"),
        ("schedule.resume", "alice", "fixed in 1.2"),
        ("schedule.trigger", "bob", "sent by hand"),
        ("schedule.backfill", "bob", "missed in the outage")]
    assert audit[4]["action"] == "schedule.delete"
    assert audit[4]["evidence"] == "none given (orchestrator schedules delete)"
    assert all(a["target_kind"] == "schedule" and a["target_id"] == "s" and a["tenant"]
               for a in audit)
    assert (audit[0]["before"]["paused"], audit[0]["after"]["paused"]) == (False, True)
    assert (audit[1]["before"]["paused"], audit[1]["after"]["paused"]) == (True, False)
    assert audit[2]["after"]["state"] == "fired" and audit[2]["after"]["run_id"]
    assert audit[3]["after"] == {"from": "2026-12-03T10:00:00+00:00",
                                 "to": "2026-12-03T10:05:00+00:00", "slots": 2,
                                 "states": {"fired": 2}}
    assert audit[4]["before"]["cron"] == "*/5 * * * *" and audit[4]["after"] is None

    blank = run_cli(["schedules", "pause", "nope", "--operator", "alice", "--evidence", " "],
                    database_url=url)
    assert blank.returncode == 2 and "evidence" in blank.stderr


async def test_a_create_whose_commit_was_lost_reports_the_schedule_it_created(
        make_app, sql, monkeypatch):
    """The connection goes while a create's COMMIT is under way, and it applied: run again by
    the storage layer, the create finds the id taken, by its own hand. It answers with the
    schedule it made, as when nothing was lost; a create sent again later (not a retry) is
    still told that the schedule exists."""
    clock = [T0]
    app = _app(make_app, clock)
    lose_the_next_commit(monkeypatch, app.database)
    made = await app.schedules.create_async("s", "report", cron="0 * * * *", input={"n": 1})
    assert (made.id, made.input, made.next_slot) == ("s", {"n": 1}, T0 + timedelta(hours=1))
    assert made == await app.schedules.get_async("s")
    with pytest.raises(InvalidRequest) as again:
        await app.schedules.create_async("s", "report", cron="0 * * * *")
    assert again.value.path == "id" and "a schedule s exists" in str(again.value)
    await app.database.close()


async def test_a_trigger_whose_commit_was_lost_reports_the_run_it_fired(
        make_app, sql, monkeypatch):
    """The connection goes while a trigger's COMMIT is under way, and it applied: the trigger
    answers with the run it fired and fires no second one. Unkeyed, it is not told that the
    outcome is unknown; keyed, it is not told that it repeats an earlier trigger's key."""
    clock = [T0]
    app = _app(make_app, clock)
    await app.schedules.create_async("s", "report", cron="0 * * * *", overlap="allow_all")
    lose_the_next_commit(monkeypatch, app.database)
    fired = await app.schedules.trigger_async("s")
    assert (fired["state"], fired["repeated"]) == ("fired", False)
    assert [r["id"] for r in runs_of(sql)] == [fired["run_id"]]

    clock[0] = minute(1)
    lose_the_next_commit(monkeypatch, app.database)
    keyed = await app.schedules.trigger_async("s", idempotency_key="deploy-1")
    assert (keyed["state"], keyed["repeated"]) == ("fired", False)
    assert len(runs_of(sql)) == 2 and keyed["run_id"] != fired["run_id"]
    again = await app.schedules.trigger_async("s", idempotency_key="deploy-1")
    assert (again["run_id"], again["repeated"]) == (keyed["run_id"], True)
    assert [s[1] for s in slots(sql)] == ["fired", "fired"] and len(runs_of(sql)) == 2
    await app.database.close()


async def test_an_update_whose_commit_was_lost_answers_with_the_schedule_it_wrote(
        make_app, sql, monkeypatch):
    """An update run again after its COMMIT applied and was lost writes the same definition
    over itself: it answers with the schedule as it left it, next slot included."""
    clock = [T0]
    app = _app(make_app, clock)
    await app.schedules.create_async("s", "report", cron="0 * * * *")
    clock[0] = minute(10)
    lose_the_next_commit(monkeypatch, app.database)
    changed = await app.schedules.update_async("s", cron="30 * * * *", input={"n": 2})
    assert (changed.cron, changed.input, changed.next_slot) == (
        "30 * * * *", {"n": 2}, minute(30))
    assert changed == await app.schedules.get_async("s")
    await app.database.close()
