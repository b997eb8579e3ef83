"""Queues: concurrency (global, per worker, per key), rates, priorities, pauses and changes at
run time, all enforced by the claim in the database (docs/flow.md)."""

from __future__ import annotations

import asyncio
import contextlib
import getpass
import json
from collections.abc import AsyncIterator, Callable
from datetime import timedelta
from typing import Any

import httpx
import psycopg
import pytest

from orchestrator import InvalidRequest, Orchestrator, Owner, RateLimit
from orchestrator.admin import list_runs, show_run
from orchestrator.db import queues as queues_db
from orchestrator.db import runs as runs_db
from orchestrator.db.database import DEFAULT_QUEUE_NEWS, RUNS_CHANNEL
from orchestrator.testing import running_worker
from tests.clitools import run_cli
from tests.consoletools import GRANTS, Client, Served, from_header
from tests.integration.conftest import OTHER, OWNER, running, wait_for
from tests.integration.test_ops_bulk import lose_the_next_commit


class Gauge:
    """What runs are inside their body now, and the most there ever were (per key too)."""

    def __init__(self) -> None:
        self.live: dict[Any, int] = {}
        self.peak: dict[Any, int] = {}
        self.order: list[Any] = []
        self.gate = asyncio.Event()

    def enter(self, key: Any) -> None:
        for k in {None, key}:
            self.live[k] = self.live.get(k, 0) + 1
            self.peak[k] = max(self.peak.get(k, 0), self.live[k])

    def leave(self, key: Any) -> None:
        for k in {None, key}:
            self.live[k] -= 1


def _app(make_app: Callable[..., Orchestrator], gauge: Gauge, *, hold: float = 0.15,
         **queue: Any) -> tuple[Orchestrator, Any]:
    app = make_app()
    app.queue("work", **queue)

    @app.workflow(queue="work")
    async def job(ctx, data):  # type: ignore[no-untyped-def]
        gauge.order.append(data["n"])
        gauge.enter(data.get("key"))
        try:
            if data.get("gate"):
                await gauge.gate.wait()
            else:
                await asyncio.sleep(hold)
        finally:
            gauge.leave(data.get("key"))
        return data["n"]

    return app, job


class Claims:
    """The worker's claims from one queue as they happen (a spy on ``queues_db.queue_claim``,
    the statement the worker sends): how many began, and what each that ended returned (None:
    it failed). The positive evidence that a worker looked at a queue, before a test asserts
    that nothing started; a fixed sleep passes as well when the worker never looked."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, queue: str = "work") -> None:
        self.queue = queue
        self.began = 0
        self.ended: dict[int, list[dict[str, Any]] | None] = {}
        real = queues_db.queue_claim

        async def spy(conn: Any, **options: Any) -> tuple[list[dict[str, Any]], float | None]:
            if options["queue"] != queue:
                return await real(conn, **options)
            n, self.began = self.began, self.began + 1
            try:
                claims, wake = await real(conn, **options)
            except BaseException:
                self.ended[n] = None
                raise
            self.ended[n] = claims
            return claims, wake

        monkeypatch.setattr(queues_db, "queue_claim", spy)

    async def look(self, sql: Callable[..., Any]) -> list[list[dict[str, Any]]]:
        """Have the worker claim from the queue now (news of it, as a submission sends) and
        wait for a claim begun since to succeed: it reads everything committed before this
        call. What each claim begun since returned."""
        mark = self.began

        def since() -> list[list[dict[str, Any]]]:
            return [c for n, c in self.ended.items() if n >= mark and c is not None]

        sql("SELECT pg_notify(%s, %s)", (RUNS_CHANNEL, self.queue))
        await wait_for(since, what=f"the worker claimed from queue {self.queue}")
        return since()

    async def all_before(self, mark: int, what: str) -> list[list[dict[str, Any]] | None]:
        """Wait for every claim begun before ``mark`` (``began`` read earlier) to end; what
        each returned."""
        await wait_for(lambda: all(n in self.ended for n in range(mark)), what=what)
        return [self.ended[n] for n in range(mark)]


async def _stored(app: Orchestrator, name: str = "work") -> None:
    """Wait for a started worker to have written the app's queues."""
    async def stored() -> bool:
        return any(q.name == name for q in await app.queues.list_async())

    await wait_for(stored, what=f"queue {name} stored")


@contextlib.asynccontextmanager
async def _workers(apps: list[Orchestrator], **options: Any) -> AsyncIterator[list[Any]]:
    options.setdefault("poll_interval", 0.2)
    async with contextlib.AsyncExitStack() as stack:
        workers = [await stack.enter_async_context(running_worker(a, **options)) for a in apps]
        yield workers
    for a in apps:
        await a.database.close()


async def test_concurrency_holds_across_workers_and_every_run_ends(make_app, sql):
    gauge = Gauge()
    apps = [_app(make_app, gauge, concurrency=3)[0] for _ in range(2)]
    job = apps[0].registry.workflows["job@1"]
    handles = [await apps[0].submit_async(job, {"n": i}) for i in range(12)]
    async with _workers(apps, concurrency=10):
        assert sorted([await h.result_async(timeout=30) for h in handles]) == list(range(12))
    assert gauge.peak[None] == 3
    rows = sql("SELECT started_at, finished_at FROM orchestrator.runs WHERE queue = 'work'")
    assert len(rows) == 12 and all(r["started_at"] is not None for r in rows)
    # In the database's own times: never more than 3 started and not finished at once.
    for r in rows:
        overlapping = [o for o in rows if o["started_at"] <= r["started_at"] < o["finished_at"]]
        assert len(overlapping) <= 3


async def test_worker_concurrency_bounds_each_worker(make_app):
    gauge = Gauge()
    apps = [_app(make_app, gauge, worker_concurrency=1, hold=0.3)[0] for _ in range(2)]
    job = apps[0].registry.workflows["job@1"]
    handles = [await apps[0].submit_async(job, {"n": i}) for i in range(6)]
    async with _workers(apps, concurrency=5) as workers:
        peaks: list[int] = []

        async def sample() -> None:
            while True:
                peaks.append(max(w.active_runs for w in workers))
                await asyncio.sleep(0.01)

        sampler = asyncio.ensure_future(sample())
        for h in handles:
            await h.result_async(timeout=30)
        sampler.cancel()
    assert max(peaks) == 1
    assert gauge.peak[None] == 2  # one on each worker


async def test_a_key_runs_one_at_a_time_in_submission_order(make_app):
    gauge = Gauge()
    app, job = _app(make_app, gauge, key_concurrency=1, hold=0.05)
    handles = [await app.submit_async(job, {"n": i, "key": f"customer-{i % 3}"},
                                      concurrency_key=f"customer-{i % 3}") for i in range(12)]
    async with running(app, concurrency=10):
        for h in handles:
            await h.result_async(timeout=30)
    assert all(gauge.peak[f"customer-{k}"] == 1 for k in range(3))
    assert gauge.peak[None] == 3  # three keys at once: other keys are not held back
    for k in range(3):
        started = [n for n in gauge.order if n % 3 == k]
        assert started == sorted(started)


async def test_the_rate_limits_starts_in_every_window(make_app, sql):
    gauge = Gauge()
    app, job = _app(make_app, gauge, rate=RateLimit(5, per=timedelta(seconds=1)), hold=0)
    handles = [await app.submit_async(job, {"n": i}) for i in range(12)]
    async with running(app, concurrency=10):
        for h in handles:
            await h.result_async(timeout=30)
    starts = sorted(r["started_at"] for r in sql(
        "SELECT started_at FROM orchestrator.runs WHERE queue = 'work'"))
    for i, first in enumerate(starts):
        inside = [s for s in starts[i:] if s < first + timedelta(seconds=1)]
        assert len(inside) <= 5
    # 12 starts at 5 per second: the last window opens 2 s after the first start.
    assert starts[-1] - starts[0] >= timedelta(seconds=2)
    assert starts[-1] - starts[0] < timedelta(seconds=4)  # and the worker woke for it


async def test_priority_starts_lower_numbers_first_and_fifo_within(make_app, sql):
    gauge = Gauge()
    app, job = _app(make_app, gauge, priority=True, concurrency=1, hold=0)
    async with running(app, concurrency=1):
        await _stored(app)
        await app.queues.pause_async("work")
        handles = [await app.submit_async(job, {"n": n}, priority=p)
                   for n, p in ((0, 5), (1, 1), (2, 5), (3, 0), (4, 1))]
        await app.queues.resume_async("work")
        for h in handles:
            await h.result_async(timeout=30)
    assert gauge.order == [3, 1, 4, 0, 2]


def _claim_waits(sql: Callable[..., Any], *, waits: bool = True) -> Callable[[], Any]:
    """Whether a worker's claim from a queue waits for the queue's row (another transaction
    holds it): ``waits=False``, whether none does."""
    async def seen() -> bool:
        rows = sql("SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
                   "AND wait_event_type = 'Lock' AND query LIKE '%%queue_claim(%%'")
        return bool(rows) == waits

    return seen


async def test_a_claim_that_waited_for_the_queue_ranks_the_runs_ready_when_it_has_it(
        make_app, migrated_database_url, sql):
    """A claim waits for the queue's row while another transaction holds it (an operator's
    change: here a resume). What it admits is judged when it has the row, not when its
    statement began: a run submitted meanwhile, ready before the claim could look, is ranked
    with the others (it once lost its turn to a lower priority, as the claim's clock said it
    was not ready yet)."""
    gauge = Gauge()
    app, job = _app(make_app, gauge, priority=True, concurrency=1, hold=0)
    async with running(app, concurrency=1):
        await _stored(app)
        await app.queues.pause_async("work")
        handles = [await app.submit_async(job, {"n": n}, priority=p) for n, p in ((0, 5), (1, 1))]
        holder = await psycopg.AsyncConnection.connect(migrated_database_url,
                                                       row_factory=psycopg.rows.dict_row)
        try:
            assert await queues_db.queue_lock(holder, "work")  # the resume begins
            sql("SELECT pg_notify(%s, 'work')", (RUNS_CHANNEL,))  # the worker claims: waits
            await wait_for(_claim_waits(sql), what="the worker's claim waiting for its queue")
            handles.append(await app.submit_async(job, {"n": 3}, priority=0))
            assert await queues_db.queue_pause(holder, "work", False) is not None
            await holder.commit()  # the resume: the claim goes on
        finally:
            await holder.close()
        for h in handles:
            await h.result_async(timeout=30)
    assert gauge.order == [3, 1, 0]
    # and nothing started while the queue was paused: every start after the last submission
    (last,) = sql("SELECT max(created_at) AS at FROM orchestrator.runs")
    assert all(r["started_at"] > last["at"] for r in sql(
        "SELECT started_at FROM orchestrator.runs"))


async def test_a_claim_that_waited_for_a_pause_starts_nothing(make_app, migrated_database_url,
                                                              sql, monkeypatch):
    """A claim that began before a pause committed, and waited for the queue's row the pause
    held, reads the queue as the pause left it: nothing starts until the resume."""
    gauge = Gauge()
    app, job = _app(make_app, gauge, hold=0)
    claims = Claims(monkeypatch)
    async with running(app, concurrency=1):
        await _stored(app)
        holder = await psycopg.AsyncConnection.connect(migrated_database_url,
                                                       row_factory=psycopg.rows.dict_row)
        try:
            assert await queues_db.queue_lock(holder, "work")  # the pause begins
            handle = await app.submit_async(job, {"n": 0})  # its news: the worker claims
            await wait_for(_claim_waits(sql), what="the worker's claim waiting for its queue")
            waited = claims.began  # the claim waiting is one of these
            assert waited
            assert await queues_db.queue_pause(holder, "work", True) is not None
            await holder.commit()
        finally:
            await holder.close()
        # The claim that waited has returned, and read the queue paused: it claimed nothing.
        assert await claims.all_before(waited, "the claim that waited ended") == [[]] * waited
        assert all(c == [] for c in await claims.look(sql))  # and so do the claims after it
        assert (await handle.info_async()).status == "queued" and gauge.order == []
        await app.queues.resume_async("work")
        assert await handle.result_async(timeout=10) == 0


async def test_a_long_wait_overtakes_a_higher_priority(make_app, sql):
    gauge = Gauge()
    app, job = _app(make_app, gauge, priority=True, concurrency=1, hold=0,
                    priority_aging=timedelta(seconds=10))
    async with running(app, concurrency=1):
        await _stored(app)
        await app.queues.pause_async("work")
        old = await app.submit_async(job, {"n": 0}, priority=9)
        new = [await app.submit_async(job, {"n": n}, priority=0) for n in (1, 2)]
        # The first has waited 100 s: ten levels gained, it now comes before priority 0.
        sql("UPDATE orchestrator.runs SET available_at = available_at - interval '100 s' "
            "WHERE id = %s", (old.id,))
        await app.queues.resume_async("work")
        for h in (old, *new):
            await h.result_async(timeout=30)
    assert gauge.order == [0, 1, 2]


async def test_a_paused_queue_starts_nothing_and_says_so(make_app, sql, monkeypatch):
    gauge = Gauge()
    app, job = _app(make_app, gauge, concurrency=5)
    claims = Claims(monkeypatch)
    async with running(app, concurrency=5):
        first = await app.submit_async(job, {"n": 0, "gate": True})
        await wait_for(lambda: gauge.live.get(None) == 1)
        await _stored(app)
        paused = await app.queues.pause_async("work")
        assert paused.paused and paused.running == 1
        second = await app.submit_async(job, {"n": 1})
        # The worker, with free slots, claims from the queue after the submission: in vain.
        assert all(c == [] for c in await claims.look(sql))
        assert (await second.info_async()).status == "queued"
        note = (await show_run(app.database, second.id)).note
        assert note == "ready, not started: queue work is paused"
        listed = {r["id"]: r for r in await list_runs(app.database)}
        assert listed[second.id]["blocked"] == "queue work is paused"
        gauge.gate.set()  # the running run goes on while the queue is paused
        assert await first.result_async(timeout=10) == 0
        assert (await second.info_async()).status == "queued"
        await app.queues.resume_async("work")
        assert await second.result_async(timeout=10) == 1


@pytest.mark.parametrize("count_parked", [True, False])
async def test_parked_runs_hold_their_slot_unless_told_not_to(make_app, count_parked, sql,
                                                              monkeypatch):
    app = make_app()
    app.queue(f"q{int(count_parked)}", concurrency=1, count_parked=count_parked)
    claims = Claims(monkeypatch, f"q{int(count_parked)}")

    @app.workflow(queue=f"q{int(count_parked)}")
    async def waits(ctx, n):  # type: ignore[no-untyped-def]
        if n == 0:
            await ctx.wait_for_event("go", timeout=timedelta(minutes=1))
        return n

    async with running(app, concurrency=5):
        parked = await app.submit_async(waits, 0)
        await wait_for(lambda: _is(parked, "waiting"))
        other = await app.submit_async(waits, 1)
        if count_parked:
            # The worker, with free slots, claims from the queue after the submission: in vain.
            assert all(c == [] for c in await claims.look(sql))
            assert (await other.info_async()).status == "queued"
            note = (await show_run(app.database, other.id)).note or ""
            assert "concurrency full (1 of 1 slots held)" in note
            await app.send_event_async(parked.id, "go", {})
            assert await parked.result_async(timeout=10) == 0
            assert await other.result_async(timeout=10) == 1
        else:
            assert await other.result_async(timeout=10) == 1
            await app.send_event_async(parked.id, "go", {})
            assert await parked.result_async(timeout=10) == 0


def _declared_again(app: Orchestrator) -> Callable[[], Any]:
    async def seen() -> bool:
        rows = await app.queues.list_async()
        return bool(rows) and rows[0].declared.get("concurrency") == 2

    return seen


async def _is(handle: Any, status: str) -> bool:
    return (await handle.info_async()).status == status


async def test_limits_set_at_run_time_are_in_force_and_outlive_a_declaration(make_app):
    gauge = Gauge()
    app, job = _app(make_app, gauge, concurrency=1)
    async with running(app, concurrency=5):
        handles = [await app.submit_async(job, {"n": i, "gate": True}) for i in range(3)]
        await wait_for(lambda: gauge.live.get(None) == 1)
        changed = await app.queues.set_async("work", concurrency=3)
        assert changed.concurrency == 3 and changed.overridden == ("concurrency",)
        await wait_for(lambda: gauge.live.get(None) == 3)
        gauge.gate.set()
        for h in handles:
            await h.result_async(timeout=10)
    again, _ = _app(make_app, Gauge(), concurrency=2)  # the code now says 2
    async with running(again):
        await wait_for(_declared_again(again))
        info = await again.queues.get_async("work")
        assert info.concurrency == 3 and info.declared["concurrency"] == 2
        reset = await again.queues.reset_async("work")
        assert reset.concurrency == 2 and reset.overridden == ()


@pytest.mark.parametrize(("field", "call"), [
    ("queue", lambda app, job: app.submit(job, {"n": 0}, queue="nowhere")),
    ("queue", lambda app, job: app.submit(job, {"n": 0}, queue="bad name")),
    ("priority", lambda app, job: app.submit(job, {"n": 0}, priority=10_000)),
    ("priority", lambda app, job: app.submit(job, {"n": 0}, priority="high")),
    ("concurrency_key", lambda app, job: app.submit(job, {"n": 0}, concurrency_key="a b")),
    ("concurrency_key", lambda app, job: app.submit(job, {"n": 0}, concurrency_key="x" * 129)),
])
def test_bad_submissions_name_the_field_and_write_nothing(make_app, sql, field, call):
    app, job = _app(make_app, Gauge())
    with pytest.raises(InvalidRequest) as caught:
        call(app, job)
    assert caught.value.code == "INVALID_REQUEST" and caught.value.path == field
    assert sql("SELECT count(*) AS n FROM orchestrator.runs")[0]["n"] == 0


@pytest.mark.parametrize(("field", "options"), [
    ("concurrency", {"concurrency": 0}),
    ("worker_concurrency", {"worker_concurrency": -1}),
    ("key_concurrency", {"key_concurrency": 1.5}),
    ("rate", {"rate": "10/fortnight"}),
    ("rate", {"rate": "ten/s"}),
    ("rate", {"rate": 10}),
    ("rate", {"rate": "1/1000000000day"}),  # longer than timedelta holds
    ("rate", {"rate": "1/" + "9" * 400 + "s"}),  # an infinite float
    ("name", {"name": "-x"}),
])
def test_bad_queue_declarations_name_the_field(make_app, field, options):
    app = make_app()
    name = options.pop("name", "q")
    with pytest.raises(InvalidRequest) as caught:
        app.queue(name, **options)
    assert caught.value.path == field


def test_rate_text_forms() -> None:
    assert RateLimit.parse("100/s") == RateLimit(100, timedelta(seconds=1))
    assert RateLimit.parse("10/5s") == RateLimit(10, timedelta(seconds=5))
    assert RateLimit.parse("600/min") == RateLimit(600, timedelta(minutes=1))
    assert RateLimit.parse("5000 / day") == RateLimit(5000, timedelta(days=1))
    with pytest.raises(InvalidRequest):
        RateLimit(0)


def test_a_workflow_in_an_undeclared_queue_cannot_start_a_worker(make_app):
    app = make_app()

    @app.workflow(queue="later")
    async def job(ctx, n):  # type: ignore[no-untyped-def]
        return n

    with pytest.raises(Exception) as caught:
        app.create_worker()
    assert getattr(caught.value, "code", None) == "CONFIGURATION_ERROR"


async def test_the_queues_commands(make_app, migrated_database_url, sql):
    gauge = Gauge()
    app, job = _app(make_app, gauge, concurrency=2, key_concurrency=1)
    async with running(app):
        await _stored(app)
    def cli(*args: str) -> Any:
        return run_cli(["queues", *args], database_url=migrated_database_url)

    for i in range(3):
        await app.submit_async(job, {"n": i}, concurrency_key="k")
    listed = json.loads(cli("list", "--json").stdout)
    assert [(q["name"], q["concurrency"], q["ready"]) for q in listed["queues"]] == [
        ("work", 2, 3)]
    table = cli("list").stdout
    assert "QUEUE" in table and "work" in table
    who = ("--operator", "alice", "--evidence", "the PSP asked for 100/s")
    changed = json.loads(cli("set", "work", "--rate", "100/s", "--concurrency",
                                 "none", *who, "--json").stdout)
    assert changed["rate"] == {"limit": 100, "per_seconds": 1.0}
    assert changed["concurrency"] is None
    assert sorted(changed["overridden"]) == ["concurrency", "rate_limit", "rate_seconds"]
    shown = cli("show", "work").stdout
    assert "rate:" in shown and "KEY" in shown and "k" in shown
    # What was set at run time is named as `queues set` takes it (not by its columns), with
    # what the code declares, which `queues reset` gives back.
    assert shown.splitlines()[0] == (
        "queue work: active (set at run time: concurrency none, the code's 2; rate 100/s, "
        "the code's none; `orchestrator queues reset work` returns to the code's)"), shown
    paused = json.loads(cli("pause", "work", *who, "--json").stdout)
    assert paused["paused"] is True
    bad = cli("set", "work", "--rate", "10/fortnight", *who)
    assert bad.returncode == 2 and "INVALID_REQUEST" in bad.stderr
    blank = cli("resume", "work", "--operator", "alice", "--evidence", " ")
    assert blank.returncode == 2 and "INVALID_REQUEST" in blank.stderr
    assert (await app.queues.get_async("work")).paused
    # Each change wrote its audit row, as the console's do: who, why, before and after.
    audit = sql("SELECT operator, action, target_kind, target_id, tenant, evidence, "
                "before->>'paused' AS was, after->>'paused' AS paused, after->'rate' AS rate "
                "FROM orchestrator.operator_audit ORDER BY id")
    assert [(a["operator"], a["action"], a["target_kind"], a["target_id"], a["tenant"],
             a["evidence"]) for a in audit] == [
        ("alice", "queue.set", "queue", "work", None, "the PSP asked for 100/s"),
        ("alice", "queue.pause", "queue", "work", None, "the PSP asked for 100/s")]
    assert audit[0]["rate"] == {"limit": 100, "per_seconds": 1.0}
    assert (audit[1]["was"], audit[1]["paused"]) == ("false", "true")
    cli("reset", "work", *who)
    assert sql("SELECT action FROM orchestrator.operator_audit ORDER BY id DESC LIMIT 1"
               )[0]["action"] == "queue.reset"
    # The human line says each change as it is given: on/off, not Python's True/False.
    said = cli("set", "work", "--priority", "on", "--count-parked", "off", *who).stdout
    assert said.strip() == "queue work set: priority on, count parked off", said
    # A script written before the audit still works, and is audited: the row names the login
    # that ran it and says that no reason was given.
    unnamed = cli("resume", "work")
    assert unnamed.returncode == 0, unnamed.stderr
    last = sql("SELECT operator, action, evidence FROM orchestrator.operator_audit "
               "ORDER BY id DESC LIMIT 1")[0]
    assert (last["operator"], last["action"], last["evidence"]) == (
        getpass.getuser(), "queue.resume", "none given (orchestrator queues resume)")
    missing = cli("show", "nowhere")
    assert missing.returncode == 2 and "no queue nowhere" in missing.stderr


async def test_app_queues_changes_are_audited_too(make_app, sql):
    app, _ = _app(make_app, Gauge(), concurrency=2)
    async with running(app):
        await _stored(app)
    await app.queues.pause_async("work")
    await app.queues.set_async("work", concurrency=3, operator="bob", evidence="more room")
    with pytest.raises(InvalidRequest) as refused:  # checked before anything is written
        await app.queues.resume_async("work", operator="bob", evidence="")
    assert refused.value.path == "evidence"
    audit = sql("SELECT operator, action, evidence, after->>'concurrency' AS concurrency "
                "FROM orchestrator.operator_audit ORDER BY id")
    assert [(a["operator"], a["action"], a["evidence"]) for a in audit] == [
        ("app", "queue.pause", "changed by the application's code (app.queues)"),
        ("bob", "queue.set", "more room")]
    assert audit[1]["concurrency"] == "3"
    assert (await app.queues.get_async("work")).paused


async def test_the_http_api_takes_a_queue_a_priority_and_a_key(make_app, sql):
    app, _ = _app(make_app, Gauge(), key_concurrency=1)
    console = app.console(from_header, GRANTS, authenticate_owner=lambda request: OWNER)
    with Served(console) as server:
        async with httpx.AsyncClient(base_url=server.base, timeout=60) as http:
            made = await http.post("/api/runs", json={
                "workflow": "job", "input": {"n": 1}, "queue": "work", "priority": 3,
                "concurrency_key": "customer-1"})
            assert made.status_code == 201, made.text
            body = made.json()
            assert (body["queue"], body["priority"], body["concurrency_key"]) == (
                "work", 3, "customer-1")
            for extra, field in (({"queue": "nowhere"}, "queue"), ({"priority": 1.5}, "priority"),
                                 ({"concurrency_key": "a b"}, "concurrency_key")):
                bad = await http.post("/api/runs", json={"workflow": "job", "input": {"n": 2},
                                                         **extra})
                assert bad.status_code == 400, bad.text
                assert bad.json()["code"] == "INVALID_REQUEST"
                assert field in bad.json()["message"]
    assert sql("SELECT count(*) AS n FROM orchestrator.runs")[0]["n"] == 1


async def test_the_console_shows_queues_and_an_operator_changes_them_audited(make_app, sql):
    app, _ = _app(make_app, Gauge(), concurrency=2)
    async with running(app):
        await _stored(app)
    console = app.console(from_header, {"ops": ["queues"], "viewer": ["read"]})
    async with Client(console, "viewer") as viewer, Client(console, "ops") as ops:
        listed = (await viewer.get("/api/queues")).json()
        assert [(q["name"], q["concurrency"]) for q in listed["queues"]] == [("work", 2)]
        page = await viewer.get("/queues")
        assert page.status_code == 200 and "work" in page.text and "Pause" not in page.text
        refused = await viewer.post("/api/queues/work", {"action": "pause",
                                                         "evidence": "deploy in progress"})
        assert refused.status_code == 403
        assert (await ops.post("/api/queues/work", {"action": "pause"})).status_code == 400
        bad = await ops.post("/api/queues/work", {"action": "set", "rate": "10/fortnight",
                                                  "evidence": "slow the partner down"})
        assert bad.status_code == 400 and bad.json()["code"] == "INVALID_REQUEST"
        paused = await ops.post("/api/queues/work", {"action": "pause",
                                                     "evidence": "deploy in progress"})
        assert paused.status_code == 200, paused.text
        assert paused.json()["paused"] is True
        changed = await ops.form("/queues/work", {"action": "set", "concurrency": "5",
                                                  "rate": "100/s",
                                                  "evidence": "partner raised our quota"})
        assert changed.status_code == 303
        info = await app.queues.get_async("work")
        assert info.concurrency == 5 and info.rate == RateLimit(100) and info.paused
        assert "Pause" in (await ops.get("/queues")).text or "Resume" in (
            await ops.get("/queues")).text
    audit = sql("SELECT operator, action, target_kind, target_id, tenant, evidence, "
                "after->>'paused' AS paused FROM orchestrator.operator_audit ORDER BY id")
    assert [(a["operator"], a["action"], a["target_id"], a["tenant"]) for a in audit] == [
        ("ops", "queue.pause", "work", None), ("ops", "queue.set", "work", None)]
    assert audit[0]["paused"] == "true"


async def test_an_operator_limited_to_tenants_may_not_change_a_queue(make_app):
    app = make_app(operator_scopes={"scoped": ["acme"]})
    app.queue("work")
    async with running(app):
        await _stored(app)
    console = app.console(from_header, {"scoped": ["queues"]})
    async with Client(console, "scoped") as scoped:
        refused = await scoped.post("/api/queues/work", {"action": "pause",
                                                         "evidence": "not mine to pause"})
        assert refused.status_code == 403, refused.text
    assert not (await app.queues.get_async("work")).paused


async def test_a_run_holding_the_only_slot_is_claimed_again_behind_a_backlog(make_app, sql):
    """A run that started and went back to the queue (its worker lost, its lease expired)
    still holds its slot, and is ready again only from then: behind every run submitted
    before. It is claimed again all the same, however many of those wait (none of them may
    start while it holds the only slot): the queue never stands still."""
    gauge = Gauge()
    app, job = _app(make_app, gauge, concurrency=1, hold=0.01)
    handles = [await app.submit_async(job, {"n": i}) for i in range(12)]
    async with app.database.connection() as conn:
        await queues_db.queue_declare(conn, [app._declared_queues["work"].row()])
        # A worker that claims the oldest run and is never heard of again (a 0.2 s lease).
        cur = await conn.execute("SELECT id FROM orchestrator.queue_claim("
                                 "'work', ARRAY['job@1'], 'ghost', 1, 0.2)")
        (ghost,) = [row["id"] for row in await cur.fetchall()]

    async def released() -> bool:  # once its lease expired: back in the queue, holding
        async with app.database.connection() as conn:
            return await runs_db.run_release_expired(conn) == 1

    await wait_for(released, what="the ghost's lease expired and released")
    (held,) = sql("SELECT status, started_at, available_at FROM orchestrator.runs "
                  "WHERE id = %s", (ghost,))
    assert held["status"] == "queued" and held["started_at"] is not None
    behind = sql("SELECT count(*) AS n FROM orchestrator.runs WHERE queue = 'work' "
                 "AND started_at IS NULL AND available_at < %s", (held["available_at"],))
    assert behind[0]["n"] == 11  # every other run waits before it
    async with _workers([app], concurrency=2):  # claims read 2 candidates at a time
        assert sorted([await h.result_async(timeout=30) for h in handles]) == list(range(12))
    assert gauge.peak[None] == 1


def _claim(sql: Callable[..., list[dict[str, Any]]], n: int) -> list[Any]:
    """The ids of one claim of up to ``n`` runs of the queue ``work``."""
    return [row["id"] for row in sql(
        "SELECT id FROM orchestrator.queue_claim('work', ARRAY['job@1'], 'probe', %s, 30)",
        (n,))]


def _copies(sql: Callable[..., list[dict[str, Any]]], run_id: Any, count: int) -> None:
    """``count`` more ready runs like ``run_id`` (its key, its priority), submitted now."""
    sql("""INSERT INTO orchestrator.runs (id, tenant, principal, workflow_name,
               workflow_version, input, options, request_digest, available_at, queue,
               priority, concurrency_key)
           SELECT gen_random_uuid(), tenant, principal, workflow_name, workflow_version,
                  input, options, request_digest, now(), queue, priority, concurrency_key
           FROM orchestrator.runs, generate_series(1, %s) WHERE id = %s""", (count, run_id))


async def test_a_busy_keys_backlog_holds_no_other_key_back(make_app, sql):
    """One key's slots all held and more of its runs waiting than a claim reads at once (a
    customer's bulk import): another key's run, submitted after them, starts at once."""
    app, job = _app(make_app, Gauge(), key_concurrency=1)
    first = await app.submit_async(job, {"n": 0}, concurrency_key="bulk")
    async with app.database.connection() as conn:
        await queues_db.queue_declare(conn, [app._declared_queues["work"].row()])
    assert _claim(sql, 1) == [first.id]  # the key's only slot is held now
    _copies(sql, first.id, 600)
    other = await app.submit_async(job, {"n": 1}, concurrency_key="another")
    assert _claim(sql, 5) == [other.id]


async def test_a_key_is_its_tenants_own(make_app, sql):
    """Concurrency keys are scoped by tenant: another tenant naming the same key neither
    waits for this tenant's runs nor holds them back; within a tenant the key binds, from
    whichever of its principals the runs come."""
    app, job = _app(make_app, Gauge(), key_concurrency=1)
    async with app.database.connection() as conn:
        await queues_db.queue_declare(conn, [app._declared_queues["work"].row()])
    acme = [await app.submit_async(job, {"n": i}, owner=owner, concurrency_key="customer-42")
            for i, owner in enumerate([OWNER, Owner(tenant="acme", principal="carol")])]
    globex = [await app.submit_async(job, {"n": i}, owner=OTHER,
                                     concurrency_key="customer-42") for i in range(2)]
    assert sorted(map(str, _claim(sql, 10))) == sorted([str(acme[0].id), str(globex[0].id)])
    assert _claim(sql, 10) == []  # each tenant's key holds its one slot
    async with app.database.connection() as conn:
        blocked = await queues_db.run_blockers(conn, [acme[1].id, globex[1].id])
    assert blocked == {acme[1].id: "queue work: key customer-42 busy (1 of 1)",
                       globex[1].id: "queue work: key customer-42 busy (1 of 1)"}
    sql("UPDATE orchestrator.runs SET status = 'succeeded', finished_at = now(), "
        "lease_owner = NULL, lease_expires_at = NULL WHERE id = %s", (acme[0].id,))
    assert _claim(sql, 10) == [acme[1].id]
    keys = (await app.queues.get_async("work")).keys
    assert sorted((k["tenant"], k["key"], k["held"], k["waiting"]) for k in keys) == [
        ("acme", "customer-42", 1, 0), ("globex", "customer-42", 1, 1)]


async def test_a_run_past_its_aging_bound_starts_before_newer_better_priorities(make_app,
                                                                                 sql):
    """A run of priority 1 is at most one ``priority_aging`` behind runs of priority 0
    submitted after it, also when an older run of a far worse priority heads the line (it is
    then neither the longest waiting run nor the best by its stored priority)."""
    app, job = _app(make_app, Gauge(), priority=True, priority_aging=timedelta(seconds=1))
    await app.submit_async(job, {"n": 0}, priority=1000)
    aged = await app.submit_async(job, {"n": 1}, priority=1)
    async with app.database.connection() as conn:
        await queues_db.queue_declare(conn, [app._declared_queues["work"].row()])
    # Both have waited ten seconds (ten agings): the one of priority 1 now ranks as -9.
    sql("UPDATE orchestrator.runs SET available_at = available_at - interval '10 seconds'")
    await app.submit_async(job, {"n": 2}, priority=0)
    assert _claim(sql, 1) == [aged.id]


def _claim_one(url: str, worker: str = "probe") -> list[Any]:
    """One claim of the queue ``work`` by ``worker``, giving up on a lock after 0.3 s."""
    with psycopg.connect(url) as conn:  # one transaction, committed on leaving
        conn.execute("SET LOCAL lock_timeout = '300ms'")
        return conn.execute("SELECT id FROM orchestrator.queue_claim("
                            "'work', ARRAY['job@1'], %s, 1, 30)", (worker,)).fetchall()


async def test_a_claim_of_a_queue_with_nothing_ready_takes_no_lock(make_app,
                                                                   migrated_database_url):
    """Workers claim from every queue on news of any run; a queue with no run ready answers
    at once instead of queueing the claim behind the queue's lock (migration 0020). A claim
    that may admit a run still takes the lock: the queue's counts are read under it."""
    app, job = _app(make_app, Gauge())
    async with app.database.connection() as conn:
        await queues_db.queue_declare(conn, [app._declared_queues["work"].row()])
    url = migrated_database_url
    holder = psycopg.connect(url)  # an open transaction holding the queue's row lock
    try:
        holder.execute("SELECT 1 FROM orchestrator.queues WHERE name = 'work' FOR UPDATE")
        assert _claim_one(url) == []  # nothing ready: no wait for the lock
        handle = await app.submit_async(job, {"n": 1})
        with pytest.raises(psycopg.errors.LockNotAvailable):
            _claim_one(url)  # a run is ready: the claim waits for the lock
    finally:
        holder.rollback()
        holder.close()
    assert [row[0] for row in _claim_one(url)] == [handle.id]


async def test_news_of_a_run_outside_every_queue_sends_workers_to_the_default_queue_alone(
        make_app, migrated_database_url):
    """A submission outside every queue notifies with the default queue's payload ('.', never a
    queue's name), one in a queue with the queue's name; a worker looks in the default queue
    alone on the first, in that queue alone on the second, and everywhere on news of any run
    (an empty payload, which only an older sender sends). Before, a submission outside
    every queue sent every worker to claim from every queue it knew, one locked claim each."""
    app, job = _app(make_app, Gauge())

    @app.workflow()
    async def plain(ctx, data):  # type: ignore[no-untyped-def]
        return data

    async def submit_both() -> None:
        await app.submit_async(plain, {"n": 1})
        await app.submit_async(job, {"n": 2})

    assert await _news_after(migrated_database_url, submit_both) == [DEFAULT_QUEUE_NEWS, "work"]

    worker = app.create_worker()
    worker._queues = {"work", "other"}
    worker._dirty.clear()
    worker._on_notify(RUNS_CHANNEL, DEFAULT_QUEUE_NEWS)
    assert worker._dirty == {None}
    worker._dirty.clear()
    worker._on_notify(RUNS_CHANNEL, "work")
    assert worker._dirty == {"work"}
    worker._dirty.clear()
    worker._on_notify(RUNS_CHANNEL, "")
    assert worker._dirty == {None, "work", "other"}


async def _news_after(url: str, act: Callable[[], Any]) -> list[str]:
    """The payloads on RUNS_CHANNEL while ``act`` runs (and a moment after)."""
    listener = await psycopg.AsyncConnection.connect(url, autocommit=True)
    try:
        await listener.execute(f"LISTEN {RUNS_CHANNEL}")
        await act()
        return [note.payload async for note in listener.notifies(timeout=0.5)]
    finally:
        await listener.close()


async def test_every_wake_names_the_queues_of_the_runs_it_made_claimable(
        make_app, migrated_database_url, sql):
    """A run released, swept back from an expired lease or from a dead worker, woken
    (``run_wake``: an event, a finished child; a cancellation; a tool's turn) is news of its
    own queue alone: the payload names the queue, or '.' for a run outside every queue. An
    empty payload used to send every idle worker to claim from every queue it knew."""
    app, job = _app(make_app, Gauge())

    @app.workflow()
    async def plain(ctx, data):  # type: ignore[no-untyped-def]
        return data

    url = migrated_database_url
    in_queue = await app.submit_async(job, {"n": 1})
    outside = await app.submit_async(plain, {"n": 2})

    async def put(run_id: Any, sets: str) -> None:
        sql(f"UPDATE orchestrator.runs SET {sets} WHERE id = %s", (run_id,))

    async def each(fn: Callable[..., Any], **kw: Any) -> Callable[[], Any]:
        async def act() -> None:
            async with await psycopg.AsyncConnection.connect(
                    url, autocommit=True, row_factory=psycopg.rows.dict_row) as conn:
                await fn(conn, **kw)
        return act

    # A waiting run woken (an event arrived, a child finished, an operator acted).
    for handle, news in ((in_queue, "work"), (outside, DEFAULT_QUEUE_NEWS)):
        await put(handle.id, "status = 'waiting', available_at = now() + interval '1 hour'")
        assert await _news_after(url, await each(runs_db.run_wake, run_id=handle.id)) == [news]
        assert await _news_after(
            url, await each(runs_db.run_request_cancel, run_id=handle.id)) == [news]
        await put(handle.id, "cancel_requested_at = NULL")
    # Runs held under a lease that expired, swept back together: one payload per queue.
    await put(in_queue.id, "status = 'running', lease_owner = 'gone', "
                           "lease_expires_at = now() - interval '1 second'")
    await put(outside.id, "status = 'running', lease_owner = 'gone', "
                          "lease_expires_at = now() - interval '1 second'")
    moved: list[int] = []

    async def sweep(conn: Any) -> None:
        moved.append(await runs_db.run_release_expired(conn))

    assert sorted(await _news_after(url, await each(sweep))) == [DEFAULT_QUEUE_NEWS, "work"]
    assert moved == [2]
    # Runs held by a worker that died (its liveness lock gone, its heartbeat stale).
    sql("INSERT INTO orchestrator.workers (id, hostname, pid, workflows, concurrency, lock_key,"
        " heartbeat_at) VALUES ('dead', 'h', 1, '{}', 1, 987654321, now() - interval '1 hour')")
    for handle in (in_queue, outside):
        await put(handle.id, "status = 'running', lease_owner = 'dead', "
                             "lease_expires_at = now() + interval '1 hour'")

    async def orphans(conn: Any) -> None:
        moved.append(await runs_db.run_release_orphaned(conn, stale=1.0))

    assert sorted(await _news_after(url, await each(orphans))) == [DEFAULT_QUEUE_NEWS, "work"]
    assert moved == [2, 2]
    # A run given back by its worker (draining, or a provider's back-off).
    token = sql("UPDATE orchestrator.runs SET status = 'running', lease_owner = 'w', "
                "lease_expires_at = now() + interval '1 minute', lease_token = lease_token + 1 "
                "WHERE id = %s RETURNING lease_token",
                (in_queue.id,))[0]["lease_token"]
    assert await _news_after(url, await each(runs_db.run_release, run_id=in_queue.id,
                                             token=token)) == ["work"]
    # The runs parked for a tool's turn.
    await put(in_queue.id, "status = 'waiting', waiting_tool = 'slow', "
                           "available_at = now() + interval '1 hour'")
    await put(outside.id, "status = 'waiting', waiting_tool = 'slow', "
                          "available_at = now() + interval '1 hour'")
    assert sorted(await _news_after(url, await each(
        runs_db.run_wake_turn, tool="slow", count=5))) == [DEFAULT_QUEUE_NEWS, "work"]


async def test_a_child_finishing_wakes_its_parent_with_news_of_the_parents_queue(
        make_app, migrated_database_url):
    """The hot run success wakes the parent in the same statement: its news names the
    parent's queue ('work'), not every queue; nothing on the channel is an empty payload."""
    app, _ = _app(make_app, Gauge())

    @app.workflow()
    async def child(ctx, data):  # type: ignore[no-untyped-def]
        return data * 2

    @app.workflow(queue="work")
    async def parent(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.run_child(child, data)

    payloads: list[str] = []
    listener = await psycopg.AsyncConnection.connect(migrated_database_url, autocommit=True)
    try:
        await listener.execute(f"LISTEN {RUNS_CHANNEL}")
        async with running_worker(app, poll_interval=0.2):
            handle = await app.submit_async(parent, 21)
            assert await handle.result_async(timeout=30) == 42
        payloads = [note.payload async for note in listener.notifies(timeout=0.5)]
    finally:
        await listener.close()
    assert "" not in payloads
    # Submitted in 'work', the child outside it, the child's end wakes the parent ('work'),
    # the parent's end frees its slot ('work').
    assert payloads.count(DEFAULT_QUEUE_NEWS) >= 1 and payloads.count("work") >= 3


async def test_a_resolution_names_the_queue_of_the_run_it_settles(make_app,
                                                                  migrated_database_url, sql):
    """An operator settling an unknown operation resumes its run with news of the run's own
    queue: the queue's name, or '.' for a run outside every queue."""
    app = make_app()
    app.queue("work")

    @app.tool(max_attempts=1)
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        raise ConnectionResetError("lost after sending")  # the outcome is unknown

    @app.workflow(queue="work")
    async def queued(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    @app.workflow()
    async def plain(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    async with running(app):
        runs = {"work": await app.submit_async(queued, "a"),
                DEFAULT_QUEUE_NEWS: await app.submit_async(plain, "b")}
        await wait_for(lambda: len(sql("SELECT 1 FROM orchestrator.runs WHERE status = "
                                       "'needs_reconciliation'")) == 2, timeout=30)
    for news, handle in runs.items():
        (op,) = sql("SELECT id FROM orchestrator.operations WHERE run_id = %s", (handle.id,))

        async def resolve(op_id: int = op["id"]) -> None:
            await app.operators.resolve_committed(op_id, receipt={"charged": True},
                                                  evidence="the provider's dashboard shows it",
                                                  operator="ops")

        assert await _news_after(migrated_database_url, resolve) == [news]
        assert sql("SELECT status FROM orchestrator.runs WHERE id = %s",
                   (handle.id,))[0]["status"] == "queued"
    await app.database.close()


def test_the_default_queue_is_explained_not_reported_missing(migrated_database_url):
    """Runs submitted to no queue are in "the default queue", which has no row: asking for
    it by that name says what it is and how to bound such runs, not just "no queue"."""
    for args in (["show", "default"], ["set", "default", "--concurrency", "3"],
                 ["pause", "default"]):
        answer = run_cli(["queues", *args], database_url=migrated_database_url)
        assert answer.returncode == 2 and answer.stdout == ""
        assert answer.stderr.startswith(
            "orchestrator: error: INVALID_REQUEST: no queue is named default: runs submitted "
            "to no queue are in the default queue, which has no stored settings and no limits")
        assert "declare a queue with limits (app.queue(NAME, concurrency=...)" in answer.stderr
    other = run_cli(["queues", "show", "nowhere"], database_url=migrated_database_url)
    assert other.returncode == 2 and "no queue nowhere: a queue is stored once" in other.stderr


async def test_a_queue_change_whose_commit_was_lost_answers_with_the_queue_and_audits_once(
        make_app, sql, monkeypatch):
    """The connection goes while a pause's (or a limit's) COMMIT is under way, and it applied:
    run again by the storage layer, the change answers with the queue as it left it (not an
    outcome unknown), and is audited once, with what the queue was before it."""
    app = make_app()
    sql("INSERT INTO orchestrator.queues (name) VALUES ('work')")
    lose_the_next_commit(monkeypatch, app.database)
    paused = await app.queues.pause_async("work", operator="ann", evidence="the bank is down")
    assert paused.paused
    lose_the_next_commit(monkeypatch, app.database)
    limited = await app.queues.set_async("work", operator="ann", evidence="slowly",
                                         concurrency=2)
    assert limited.concurrency == 2 and limited.paused
    audit = sql("SELECT action, before, after FROM orchestrator.operator_audit ORDER BY id")
    assert [(a["action"], a["before"]["paused"], a["after"]["paused"]) for a in audit] == [
        ("queue.pause", False, True), ("queue.set", True, True)]
    assert (audit[1]["before"]["concurrency"], audit[1]["after"]["concurrency"]) == (None, 2)


async def test_a_run_whose_deadline_passes_while_its_queue_holds_it_fails_at_its_deadline(
        make_app, sql):
    """A deadline is one wall-clock expiry, also for a run that its queue keeps from starting
    (its slot held by a run that waits, the queue paused): the run fails ``DEADLINE_EXCEEDED``
    when its deadline passes, and its owner's ``result()`` says so then, not once the queue
    lets it start; it never takes the slot, and a parent waiting for it is woken."""
    from orchestrator.errors import RunFailed

    app = make_app()
    app.queue("work", concurrency=1)

    @app.workflow(queue="work")
    async def job(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.wait_for_event("go")

    @app.workflow()
    async def parent(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.run_child(job, data)

    async with running(app):
        holder = await app.submit_async(job, {"n": 0})
        await wait_for(lambda: holder.status_async(), what="the holder started")
        await wait_for(lambda: _is(holder, "waiting"), what="the holder parked in its slot")
        late = await app.submit_async(job, {"n": 1}, deadline=timedelta(seconds=1))
        with pytest.raises(RunFailed) as failed:
            await late.result_async(timeout=8)
        assert failed.value.code == "DEADLINE_EXCEEDED"
        row = sql("SELECT status, started_at, outcome_code FROM orchestrator.runs "
                  "WHERE id = %s", (late.id,))[0]
        assert row == {"status": "failed", "started_at": None,
                       "outcome_code": "DEADLINE_EXCEEDED"}
        assert [(e.kind, e.payload["code"]) for e in await late.journal_async()] == [
            ("run.failed", "DEADLINE_EXCEEDED")]
        assert app.metrics.snapshot()["deadline_exhausted"] >= 1
        # the queue paused: a child held there (with its parent's deadline) ends with it
        await app.queues.pause_async("work")
        waiting = await app.submit_async(parent, {"n": 2}, deadline=timedelta(seconds=1))
        with pytest.raises(RunFailed) as failed:
            await waiting.result_async(timeout=8)
        # its own deadline, or its child's (the same instant) raised into it: either way
        assert "DEADLINE_EXCEEDED" in (failed.value.code, (failed.value.cause or {}).get("code"))
        child = await wait_for(lambda: sql(
            "SELECT status, started_at FROM orchestrator.runs WHERE parent_run_id = %s "
            "AND status = 'failed'", (waiting.id,)), what="the child ended")
        assert child == [{"status": "failed", "started_at": None}]
        await app.queues.resume_async("work")
        assert await holder.status_async() == "waiting"  # its slot was never taken
        await app.send_event_async(holder.id, "go", "done")
        assert await holder.result_async(timeout=8) == "done"


async def _is(run: Any, status: str) -> bool:
    return await run.status_async() == status


@pytest.mark.parametrize(("field", "options"), [
    ("priority", {"priority": 5}),
    ("concurrency_key", {"concurrency_key": "customer-42"}),
])
async def test_a_priority_or_a_key_for_a_run_of_the_default_queue_is_refused(
        make_app, sql, field, options):
    """The default queue takes no limits, so a priority or a concurrency key given for a run
    that waits there would be stored and never used: refused, naming the field, nothing
    written (a declared queue keeps them, since its limits may be set at run time)."""
    app = make_app()
    app.queue("work")

    @app.workflow()
    async def plain(ctx, data):  # type: ignore[no-untyped-def]
        return data

    with pytest.raises(InvalidRequest) as caught:
        await app.submit_async(plain, 1, **options)
    assert caught.value.code == "INVALID_REQUEST" and caught.value.path == field
    assert sql("SELECT count(*) AS n FROM orchestrator.runs")[0]["n"] == 0
    await app.submit_async(plain, 1, queue="work", **options)  # in a queue: kept
    await app.submit_async(plain, 1, priority=0)  # the default: nothing asked
    assert sql("SELECT count(*) AS n FROM orchestrator.runs")[0]["n"] == 2
    await app.database.close()
