"""The schedules' ticker: fires their slots, in every worker process, with no leader.

Each tick locks the schedules that have something to do (``FOR UPDATE SKIP LOCKED``: another
process's ticker takes the others) and, for each, in one transaction with the runs it
submits: fires a buffered slot whose previous run has ended; records the slots missed beyond
the catch-up window as one gap; handles each due slot under the overlap policy (fire, skip,
buffer, or cancel the previous run and fire); and moves the schedule to its next slot. A run's
idempotency key is the schedule id and the slot (:func:`~orchestrator.schedules.slot_key`), so
a slot fires once however many processes tick and whichever of them crash
(docs/schedules.md).
"""

from __future__ import annotations

import asyncio
import builtins
import contextlib
import hashlib
import json
import logging
import uuid
from collections import Counter
from collections.abc import Callable, Container, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from orchestrator import admin
from orchestrator.admission import new_run
from orchestrator.canonical import JsonLimits
from orchestrator.db import runs as runs_db
from orchestrator.db import schedules as sched_db
from orchestrator.db import workers as workers_db
from orchestrator.db.database import Conn, Database
from orchestrator.db.reconciliation import audit_record
from orchestrator.db.xact import answered_once
from orchestrator.errors import IdempotencyConflict, InvalidRequest, OrchestratorError
from orchestrator.logs import FailureStreak, fields
from orchestrator.metrics import Metrics
from orchestrator.models import Owner, validate_idempotency_key
from orchestrator.reconcile import check_evidence
from orchestrator.registry import Workflow
from orchestrator.schedules import (
    DEFAULT_CATCHUP,
    Cron,
    check_catchup,
    check_overlap,
    check_schedule_id,
    slot_key,
    utc,
)

log = logging.getLogger("orchestrator.scheduler")

TERMINAL = ("succeeded", "failed", "cancelled")
SLOTS_PER_TICK = 1000
"""The most slots one schedule handles in one tick (a long catch-up goes on at the next)."""
SCHEDULES_PER_TICK = 100
"""The most schedules one ticker handles in one tick; the others are next."""


@dataclass(frozen=True)
class Declared:
    """A schedule declared in code (``@app.schedule``), as the database keeps it."""

    row: dict[str, Any]  # the definition columns of orchestrator.schedules, with "id"
    cron: Cron


class Scheduler:
    """Fires the slots of every schedule in the database; one per worker process."""

    def __init__(self, database: Database, json_limits: JsonLimits, metrics: Metrics, *,
                 declared: Sequence[Declared] = (), interval: float = 1.0,
                 clock: Callable[[], datetime] | None = None,
                 workflows: Mapping[str, Workflow[Any, Any]] | None = None) -> None:
        self.database = database
        self.json_limits = json_limits
        self.metrics = metrics
        self.declared = declared
        # The application's workflows by ``name@version`` (empty: not known here, as for the
        # CLI without --app): a run fired waits in its workflow's queue, as its other runs do;
        # where the workflow is not known, in the queue stored with the schedule.
        self.workflows = workflows if workflows is not None else {}
        self.interval = interval
        self.clock = clock  # None: the database's clock (one clock for every ticker)
        # Failed ticks, said once per streak (an outage would be a line per tick).
        self._ticks = FailureStreak(log, "a tick", "ticks", prefix="schedules: ")

    async def declare(self) -> None:
        """Write the schedules this process's code declares (their definitions are the
        code's; their pause and their place are kept)."""
        if not self.declared:
            return
        now = await self._now()
        async with self.database.connection() as conn, conn.transaction():
            for item in self.declared:
                said = await sched_db.schedule_declare(
                    conn, {**item.row, "next_slot": item.cron.after(now)})
                if said != "same":
                    log.info("schedule %s %s from code", item.row["id"], said,
                             extra=fields(code=said))

    async def run(self, stop: asyncio.Event) -> None:
        """Declare, then tick every ``interval`` seconds until ``stop`` is set. A declaration
        or a tick that fails (the database away) is logged, once per streak of failures, and
        tried again a tick later; the first tick that succeeds after them is said too."""
        declared = False
        while not stop.is_set():
            try:
                if not declared:  # until it succeeds: the database may be away at first
                    await self.declare()
                    declared = True
                await self.tick()
            except OrchestratorError as exc:
                self._ticks.failed(exc.code)
            except Exception:
                log.exception("schedules: a tick failed; the next one tries again")
            else:
                self._ticks.succeeded()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval)

    async def tick(self, now: datetime | None = None) -> int:
        """Handle what is due at ``now`` (default: the database's clock); the number of slots
        handled (fired, skipped, buffered, or in a gap)."""
        handled = 0
        async with self.database.connection() as conn, conn.transaction():
            when = now or (self.clock() if self.clock is not None
                           else await sched_db.schedule_clock(conn))
            for row in await sched_db.schedule_lock_due(conn, now=when,
                                                        limit=SCHEDULES_PER_TICK):
                try:
                    async with conn.transaction():  # a savepoint: one schedule at a time
                        handled += await _Tick(self, conn, row, when).handle()
                except OrchestratorError as exc:
                    # Its slots stay due: the next tick tries again; the others go on now.
                    log.error("schedule %s: its slots could not be handled (%s); the next "
                              "tick tries again", row["id"], exc.code,
                              extra=fields(code=exc.code))
        return handled

    async def _now(self) -> datetime:
        if self.clock is not None:
            return self.clock()
        return await self.database.read(sched_db.schedule_clock)

    async def now_in(self, conn: Conn) -> datetime:
        """The time in ``conn``'s transaction (the database's clock unless one is injected)."""
        if self.clock is not None:
            return self.clock()
        return await sched_db.schedule_clock(conn)

    def queue_of(self, name: str, version: str, stored: str | None) -> str | None:
        """The queue the runs of a schedule of workflow ``name@version`` wait in: the
        workflow's (docs/flow.md: a workflow's queue is the default for its runs) when it is
        registered here, else ``stored``, the queue stored with the schedule where it was."""
        workflow = self.workflows.get(f"{name}@{version}")
        return workflow.queue if workflow is not None else stored


class _Tick:
    """One schedule, locked, at one moment."""

    def __init__(self, scheduler: Scheduler, conn: Conn, row: dict[str, Any],
                 now: datetime) -> None:
        self.s = scheduler
        self.conn = conn
        self.row = row
        self.now = now
        self.id: str = row["id"]
        self.last_run: uuid.UUID | None = row["last_run_id"]
        self.last_slot: datetime | None = row["last_slot"]
        self.buffered: int = row["buffered"]
        self.running = False
        self.handled = 0
        self.queue = scheduler.queue_of(row["workflow_name"], row["workflow_version"],
                                        row["queue"])

    async def handle(self) -> int:
        try:
            cron = Cron(self.row["cron"], self.row["timezone"])
        except OrchestratorError as exc:  # stored under other rules (a time zone gone)
            log.error("schedule %s cannot be read here (%s); it is not ticked", self.id,
                      exc, extra=fields(code=exc.code))
            return 0
        if self.last_run is not None:
            status = await sched_db.run_status(self.conn, self.last_run)
            self.running = status is not None and status not in TERMINAL
        paused = bool(self.row["paused"])  # fires what a trigger or a backfill kept only
        if self.buffered and not self.running:
            await self._fire_buffered(cron=not paused)
        next_slot: datetime | None = self.row["next_slot"]
        if next_slot is not None and next_slot <= self.now and not paused:
            next_slot = await self._due(cron, next_slot)
        if self.handled or next_slot != self.row["next_slot"] \
                or self.buffered != self.row["buffered"] \
                or self.queue != self.row["queue"]:  # else nothing moved: no write
            await sched_db.schedule_set_place(
                self.conn, self.id, next_slot=next_slot, last_slot=self.last_slot,
                last_run_id=self.last_run, buffered=self.buffered, queue=self.queue)
        return self.handled

    async def _due(self, cron: Cron, first: datetime) -> datetime | None:
        """Handle the slots from ``first`` to now; the next slot not handled."""
        window = self.now - timedelta(seconds=self.row["catchup_seconds"])
        if first < window:  # the fleet was away: what is older than the window is missed
            missed = cron.before(window)
            if missed is not None and missed >= first:
                await sched_db.gap_record(self.conn, self.id, first, missed, "missed")
                self.s.metrics.incr("schedule_gaps")
                log.warning("schedule %s: slots from %s to %s missed (older than its "
                            "catch-up window)", self.id, first.isoformat(),
                            missed.isoformat(), extra=fields(code="missed"))
                self.handled += 1
            first = window
        overlap = self.row["overlap"]
        slots = cron.between(first - timedelta(microseconds=1), self.now,
                             limit=SLOTS_PER_TICK)
        for slot in slots:
            await self.slot(slot, "cron", overlap)
        after = slots[-1] if slots else first - timedelta(microseconds=1)
        if slots and len(slots) == SLOTS_PER_TICK:
            return cron.after(after)  # in the past: the next tick goes on
        return cron.after(max(after, self.now))

    async def slot(self, slot: datetime, kind: str, overlap: str,
                   trigger_key: str | None = None) -> str:
        """Handle one slot under ``overlap``; what became of it (``fired``, ``skipped``,
        ``buffered``, or ``known`` when it was recorded before). ``trigger_key``: the key a
        trigger was sent with, recorded with its slot."""
        decision = "fire"
        if self.running:
            decision = {"allow_all": "fire", "skip": "skip", "cancel_other": "cancel",
                        "buffer_all": "buffer",
                        "buffer_one": "buffer" if self.buffered == 0 else "skip_full",
                        }[overlap]
        if decision in ("skip", "skip_full"):
            reason = "overlap" if decision == "skip" else "buffer_full"
            if not await sched_db.slot_record(self.conn, self.id, slot, kind=kind,
                                              state="skipped", overlap=overlap, reason=reason,
                                              trigger_key=trigger_key):
                return "known"
            return self._count(slot, "skipped")
        if decision == "buffer":
            if not await sched_db.slot_record(self.conn, self.id, slot, kind=kind,
                                              state="buffered", overlap=overlap,
                                              trigger_key=trigger_key):
                return "known"
            self.buffered += 1
            return self._count(slot, "buffered")
        if decision == "cancel" and self.last_run is not None:
            locked = await runs_db.run_lock_last(self.conn, self.last_run)
            if locked is not None:
                await admin.cancel_locked(self.conn, locked)
                self.s.metrics.incr("cancellations", stage="requested")
        run_id = await self._submit(slot, kind, trigger_key)
        if not await sched_db.slot_record(self.conn, self.id, slot, kind=kind, state="fired",
                                          overlap=overlap, run_id=run_id,
                                          trigger_key=trigger_key):
            return "known"
        self.last_run, self.running = run_id, True
        return self._count(slot, "fired")

    def _count(self, slot: datetime, outcome: str) -> str:
        self.handled += 1
        if self.last_slot is None or slot > self.last_slot:
            self.last_slot = slot
        self.s.metrics.incr("schedule_slots", outcome=outcome)
        return outcome

    async def _fire_buffered(self, *, cron: bool = True) -> None:
        """Fire the oldest kept slot (``cron`` false: the oldest a trigger or a backfill
        kept, while the schedule is paused)."""
        kept = await sched_db.slot_oldest_buffered(self.conn, self.id, cron=cron)
        if kept is None:
            if cron:  # the count says more than the rows: trust the rows
                self.buffered = 0
            return
        run_id = await self._submit(kept["slot"], kept["kind"], kept["trigger_key"])
        await sched_db.slot_fire_buffered(self.conn, self.id, kept["slot"], kept["kind"],
                                          run_id)
        self.buffered -= 1
        self.last_run, self.running = run_id, True
        self.handled += 1
        self.s.metrics.incr("schedule_slots", outcome="fired")

    async def _submit(self, slot: datetime, kind: str, trigger_key: str | None) -> uuid.UUID:
        """Submit the slot's run in this transaction; its key makes it the slot's only run."""
        row = self.row
        key = (slot_key(self.id, slot) if kind != "trigger"
               else trigger_run_key(self.id, slot, trigger_key))
        run_row = new_run(
            row["workflow_name"], row["workflow_version"], row["input"],
            limits=self.s.json_limits,
            owner=Owner.model_construct(tenant=row["tenant"], principal=row["principal"]),
            queues=None, idempotency_key=key, queue=self.queue)
        run_id, created, _ = await runs_db.run_insert(self.conn, run_row)
        if created:
            self.s.metrics.incr("runs_submitted")
            log.info("schedule %s fired slot %s: run %s", self.id, slot.isoformat(), run_id,
                     extra=fields(run_id=run_id, workflow=row["workflow_name"]))
        return run_id


def trigger_run_key(schedule_id: str, at: datetime, key: str | None = None) -> str:
    """The submission key of a run fired by hand at ``at``: from the trigger's idempotency
    key when it was sent with one (a digest: any key fits), so that the trigger sent again
    finds that run even once its slot record is pruned; else from ``at`` (to the microsecond:
    two triggers are two runs)."""
    if key is not None:
        digest = hashlib.sha256(key.encode()).hexdigest()[:32]
        return f"schedule:{schedule_id}:trigger:{digest}"
    return f"schedule:{schedule_id}:trigger:{at.astimezone(UTC):%Y%m%dT%H%M%S%f}Z"


async def by_hand(scheduler: Scheduler, conn: Conn, row: dict[str, Any], at: datetime,
                  slots: builtins.list[datetime], kind: str, overlap: str, *,
                  trigger_key: str | None = None) -> builtins.list[dict[str, Any]]:
    """Handle ``slots`` of a schedule whose row ``conn`` holds locked (a trigger, a backfill),
    oldest first, each under ``overlap``, and write the schedule's place once. What became of
    each (``known``: the cron or an earlier backfill handled it, left as it was).
    ``trigger_key``: the key the trigger was sent with."""
    tick = _Tick(scheduler, conn, row, at)
    if tick.last_run is not None:
        status = await sched_db.run_status(conn, tick.last_run)
        tick.running = status is not None and status not in TERMINAL
    handled = (set() if kind == "trigger"
               else await sched_db.slots_handled(conn, tick.id, slots[0], slots[-1])
               if slots else set())
    said: builtins.list[dict[str, Any]] = []
    for slot in slots:
        state = ("known" if slot in handled
                 else await tick.slot(slot, kind, overlap, trigger_key))
        said.append({"slot": slot, "state": state,
                     "run_id": tick.last_run if state == "fired" else None})
    await sched_db.schedule_set_place(conn, tick.id, next_slot=row["next_slot"],
                                      last_slot=tick.last_slot, last_run_id=tick.last_run,
                                      buffered=tick.buffered, queue=tick.queue)
    return said


# -- managing schedules (app.schedules, the CLI) ---------------------------------------------

BACKFILL_MAX = 10_000
"""The most slots one backfill fires or records."""


@dataclass(frozen=True)
class ScheduleInfo:
    """A schedule as ``schedules list`` and ``app.schedules`` show it."""

    id: str
    workflow: str
    version: str
    cron: str
    timezone: str
    overlap: str
    catchup_window: timedelta
    input: Any
    owner: Owner
    declared: bool
    paused: bool
    next_slot: datetime | None
    last_slot: datetime | None
    last_run_id: uuid.UUID | None
    buffered: int
    queue: str | None  # the queue its runs wait in (None: the default queue)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> ScheduleInfo:
        return cls(id=row["id"], workflow=row["workflow_name"], version=row["workflow_version"],
                   cron=row["cron"], timezone=row["timezone"], overlap=row["overlap"],
                   catchup_window=timedelta(seconds=row["catchup_seconds"]),
                   input=row["input"],
                   owner=Owner.model_construct(tenant=row["tenant"],
                                               principal=row["principal"]),
                   declared=row["declared"], paused=row["paused"],
                   next_slot=row["next_slot"], last_slot=row["last_slot"],
                   last_run_id=row["last_run_id"], buffered=row["buffered"],
                   queue=row["queue"])


@dataclass(frozen=True)
class ScheduleDetail:
    """``schedules show``: the schedule, its next slots, what became of its recent slots (with
    their runs' status) and the ranges it missed. ``upcoming``'s times are aware, in one
    zone: that of ``info.next_slot``, the first of them (the database session's, as every
    time read from the database is)."""

    info: ScheduleInfo
    upcoming: list[datetime]
    recent: list[dict[str, Any]]
    gaps: list[dict[str, Any]]


def _who(operator: str | None, evidence: str | None) -> tuple[str, str] | None:
    """Who acts on a schedule and why, checked before anything is read (both or neither)."""
    if operator is None and evidence is None:
        return None
    if operator is None or evidence is None:
        raise InvalidRequest("operator and evidence go together: give both to audit the "
                             "action", path="operator" if operator is None else "evidence")
    check_evidence(evidence, operator)
    return operator, evidence


async def _audit(conn: Conn, who: tuple[str, str] | None, action: str, row: Mapping[str, Any],
                 before: dict[str, Any] | None, after: dict[str, Any] | None) -> None:
    """An operator's action on a schedule, audited as ``schedule.<action>``; its tenant is
    that of the runs the schedule fires."""
    if who is None:
        return
    await audit_record(conn, operator=who[0], action=f"schedule.{action}",
                       target_kind="schedule", target_id=str(row["id"]),
                       tenant=row["tenant"], evidence=who[1],
                       before=None if before is None else json.dumps(before),
                       after=None if after is None else json.dumps(after))


def _paused(row: Mapping[str, Any]) -> dict[str, Any]:
    slot = row["next_slot"]
    return {"paused": bool(row["paused"]), "next_slot": None if slot is None else slot.isoformat()}


def _slot(said: Mapping[str, Any]) -> dict[str, Any]:
    run = said.get("run_id")
    return {"slot": said["slot"].isoformat(), "state": said["state"],
            "run_id": None if run is None else str(run)}


def _definition(row: Mapping[str, Any]) -> dict[str, Any]:
    return {"workflow": row["workflow_name"], "version": row["workflow_version"],
            "cron": row["cron"], "timezone": row["timezone"], "overlap": row["overlap"],
            "paused": bool(row["paused"])}


class ScheduleAdmin:
    """What is done to stored schedules (no application code needed: the CLI uses it as is).
    ``declared_here``: the ids of the schedules the application's code declares (its
    ``@app.schedule``), which only that code changes and deletes; None when the code is not
    known, so that no schedule declared in code is deleted."""

    def __init__(self, database: Database, json_limits: JsonLimits, metrics: Metrics, *,
                 workflows: Mapping[str, Workflow[Any, Any]] | None = None,
                 declared_here: Container[str] | None = None) -> None:
        self.database = database
        self.ticker = Scheduler(database, json_limits, metrics, workflows=workflows)
        self.declared_here = declared_here

    async def list(self) -> builtins.list[ScheduleInfo]:
        rows = await self.database.read(sched_db.schedule_list)
        return [ScheduleInfo.from_row(row) for row in rows]

    async def served(self) -> frozenset[str]:
        """The workflow versions (``name@version``) that a live worker registers. A schedule
        of another one fires runs that wait, queued, until a worker that has it starts
        (docs/versioning.md): ``schedules list`` and ``show`` say so."""
        return admin.served(await self.database.read(lambda conn: workers_db.worker_list_live(
            conn, within_seconds=admin.LIVE_WORKER_SECONDS)))

    async def get(self, schedule_id: str) -> ScheduleInfo:
        sid = check_schedule_id(schedule_id)
        row = await self.database.read(lambda conn: sched_db.schedule_get(conn, sid))
        if row is None:
            raise _missing(sid)
        return ScheduleInfo.from_row(row)

    async def show(self, schedule_id: str, *, upcoming: int = 5,
                   recent: int = 20) -> ScheduleDetail:
        sid = check_schedule_id(schedule_id)

        async def read(conn: Conn) -> tuple[dict[str, Any] | None, builtins.list[Any],
                                            builtins.list[Any]]:
            row = await sched_db.schedule_get(conn, sid)
            if row is None:
                return None, [], []
            return (row, await sched_db.slots_recent(conn, sid, recent),
                    await sched_db.gaps_recent(conn, sid, recent))

        row, slots, gaps = await self.database.read(read)
        if row is None:
            raise _missing(sid)
        nexts: builtins.list[datetime] = []
        when = row["next_slot"]
        if when is not None and not row["paused"]:
            cron = Cron(row["cron"], row["timezone"])
            # In the zone of the stored slot (the session's, as every time read is), not
            # Cron's UTC: one list, one tzinfo.
            nexts = [when, *(slot.astimezone(when.tzinfo) for slot in cron.between(
                when, when + timedelta(days=3660), limit=upcoming - 1))]
        return ScheduleDetail(ScheduleInfo.from_row(row), nexts, slots, gaps)

    async def update(self, schedule_id: str,
                     change: Callable[[ScheduleInfo], tuple[dict[str, Any], Cron]]
                     ) -> ScheduleInfo:
        """Change a schedule made at run time (one declared in code is changed in the code):
        ``change`` is given the schedule as it stands, read under its row's lock, and returns
        its new definition and cron, written in the same transaction. An update that waited
        for another (or for a firing) starts from what that one wrote, so neither's change is
        lost, and a new cron or time zone starts from the first slot after now."""
        sid = check_schedule_id(schedule_id)

        async def write(conn: Conn) -> dict[str, Any]:
            row = await sched_db.schedule_get(conn, sid, lock=True)
            if row is None:
                raise _missing(sid)
            if row["declared"]:
                raise InvalidRequest(f"schedule {sid} is declared in code (@app.schedule): "
                                     "change it there", path="id")
            old = ScheduleInfo.from_row(row)
            new, when = change(old)
            timing = (new["cron"], new["timezone"]) != (old.cron, old.timezone)
            next_slot = when.after(await self.now_in(conn)) if timing else old.next_slot
            changed = await sched_db.schedule_update(conn, sid, {**new, "next_slot": next_slot},
                                                     timing_changed=timing)
            if changed is None:  # pragma: no cover - the row is locked by this transaction
                raise RuntimeError(f"schedule {sid} changed under its lock")
            return changed

        return ScheduleInfo.from_row(await self.database.run_in_transaction(write))

    async def now_in(self, conn: Conn) -> datetime:
        return await self.ticker.now_in(conn)

    async def set_paused(self, schedule_id: str, paused: bool, *, operator: str | None = None,
                         evidence: str | None = None) -> ScheduleInfo:
        """Pause (no slot of the cron fires, nor one of its slots kept by a buffer; a trigger
        or a backfill still fires, also one kept by a buffer) or resume (the slots passed
        meanwhile are recorded as one gap; the next slot is the first after now). With
        ``operator`` and ``evidence`` (both or neither) it is audited (``schedule.pause``,
        ``schedule.resume``) in the same transaction."""
        sid = check_schedule_id(schedule_id)
        who = _who(operator, evidence)
        now = await self.ticker._now()
        async with self.database.connection() as conn, conn.transaction():
            row = await sched_db.schedule_get(conn, sid, lock=True)
            if row is None:
                raise _missing(sid)
            cron = Cron(row["cron"], row["timezone"])
            if not paused and row["paused"]:
                first = row["next_slot"]
                last = cron.before(now)
                if first is not None and last is not None and first <= last:
                    await sched_db.gap_record(conn, sid, first, last, "paused")
            changed = await sched_db.schedule_set_paused(conn, sid, paused,
                                                         next_slot=cron.after(now))
            await _audit(conn, who, "pause" if paused else "resume", row,
                         _paused(row), _paused(changed))
        log.info("schedule %s %s", sid, "paused" if paused else "resumed")
        return ScheduleInfo.from_row(changed)

    async def trigger(self, schedule_id: str, *, overlap: str | None = None,
                      idempotency_key: str | None = None, operator: str | None = None,
                      evidence: str | None = None) -> dict[str, Any]:
        """Fire the schedule now, under its overlap policy (or ``overlap``): what became of it
        (``state``) and its run. With ``idempotency_key`` (the rules of a submission's key),
        a trigger sent again with that key answers with what became of the first (its slot,
        its state, its run) and fires nothing; with another ``overlap`` than the first's,
        ``IDEMPOTENCY_CONFLICT``. ``repeated``: true when the answer is an earlier trigger's
        with this key (nothing fired now), false when this call fired, skipped or buffered.
        With ``operator`` and ``evidence`` a trigger that acted is audited
        (``schedule.trigger``).

        A trigger, keyed or not, whose COMMIT applied but whose answer was lost with its
        connection answers, when the storage layer runs it again, with what it did."""
        sid = check_schedule_id(schedule_id)
        who = _who(operator, evidence)
        policy = None if overlap is None else check_overlap(overlap)
        key = None if idempotency_key is None else validate_idempotency_key(idempotency_key)

        async def fire(conn: Conn) -> dict[str, Any]:
            row = await sched_db.schedule_get(conn, sid, lock=True)
            if row is None:
                raise _missing(sid)
            known = None if key is None else await sched_db.slot_by_trigger_key(conn, sid, key)
            if known is not None:
                if policy is not None and policy != known["overlap"]:
                    raise IdempotencyConflict(
                        f"schedule {sid} was triggered with this idempotency key under "
                        f"overlap {known['overlap']}, not {policy}")
                return {"schedule": sid, "slot": known["slot"], "state": known["state"],
                        "run_id": known["run_id"], "repeated": True}
            now = await self.now_in(conn)
            (said,) = await by_hand(self.ticker, conn, row, now, [now], "trigger",
                                    policy or row["overlap"], trigger_key=key)
            await _audit(conn, who, "trigger", row, None, _slot(said))
            return {"schedule": sid, "slot": now, "state": said["state"],
                    "run_id": said["run_id"], "repeated": False}

        # Run again after a lost COMMIT that applied, it answers with what it fired then:
        # not `repeated`, and no second run.
        return await self.database.run_in_transaction(answered_once(fire))

    async def backfill(self, schedule_id: str, start: datetime, end: datetime, *,
                       overlap: str = "allow_all", operator: str | None = None,
                       evidence: str | None = None,
                       given_as: tuple[str, str] = ("start", "end"),
                       ) -> builtins.list[dict[str, Any]]:
        """Fire the slots in ``[start, end]`` (in the past), oldest first, each under
        ``overlap``: a slot handled before (fired, skipped or buffered by the cron, or an
        earlier backfill) is left as it was. What became of each slot. With ``operator`` and
        ``evidence`` it is audited (``schedule.backfill``). A refused range names its bounds
        as the caller gave them (``given_as``: the parameters, or the CLI's ``--from`` and
        ``--to``), in the message and, without the dashes, as the error's ``path``."""
        sid = check_schedule_id(schedule_id)
        who = _who(operator, evidence)
        policy = check_overlap(overlap)
        low, high = given_as
        at_low, at_high = low.lstrip("-"), high.lstrip("-")
        first, last = utc(start, at_low), utc(end, at_high)
        now = await self.ticker._now()
        if first > last:
            raise InvalidRequest(f"backfill needs {low} before {high}", path=at_low)
        if last > now:
            raise InvalidRequest(f"backfill fires slots in the past: {high} must not be later "
                                 "than now", path=at_high)
        async with self.database.connection() as conn, conn.transaction():
            row = await sched_db.schedule_get(conn, sid, lock=True)
            if row is None:
                raise _missing(sid)
            cron = Cron(row["cron"], row["timezone"])
            try:
                slots = cron.between(first - timedelta(microseconds=1), last,
                                     limit=BACKFILL_MAX + 1)
            except OverflowError as exc:  # within hours of the calendar's first day
                raise InvalidRequest(f"backfill {low} is earlier than the calendar allows",
                                     path=at_low) from exc
            if len(slots) > BACKFILL_MAX:
                raise InvalidRequest(f"that range holds more than {BACKFILL_MAX} slots; "
                                     "backfill a shorter one at a time", path=at_high)
            said = await by_hand(self.ticker, conn, row, now, slots, "backfill", policy)
            states = Counter(str(x["state"]) for x in said)  # up to 10,000 slots: counted
            await _audit(conn, who, "backfill", row, None,
                         {"from": first.isoformat(), "to": last.isoformat(),
                          "slots": len(said), "states": dict(sorted(states.items()))})
        log.info("schedule %s backfilled %d slots from %s to %s", sid, len(slots),
                 first.isoformat(), last.isoformat())
        return said

    async def delete(self, schedule_id: str, *, operator: str | None = None,
                     evidence: str | None = None) -> ScheduleInfo:
        """Delete a schedule made at run time, or one declared in code that this code no
        longer declares (a worker still running code that declares it writes it again when
        it starts); the schedule as it stood. Without the code (``declared_here`` None) a
        schedule declared in code is refused: whether the code still declares it is
        unknown. With ``operator`` and ``evidence`` it is audited (``schedule.delete``). A
        delete whose COMMIT applied but whose answer was lost with its connection answers,
        when the storage layer runs it again, with the schedule it deleted."""
        sid = check_schedule_id(schedule_id)
        who = _who(operator, evidence)
        async def delete(conn: Conn) -> dict[str, Any] | None:
            row = await sched_db.schedule_get(conn, sid, lock=True)
            if row is not None and not self._kept_by_code(row):
                if not await sched_db.schedule_delete(conn, sid):  # pragma: no cover
                    raise RuntimeError(f"schedule {sid} vanished under its lock")
                await _audit(conn, who, "delete", row, _definition(row), None)
            return row

        # Run again after a lost COMMIT that applied, it answers with the schedule it deleted.
        row = await self.database.run_in_transaction(answered_once(delete))
        if row is None:
            raise _missing(sid)
        if self._kept_by_code(row) and self.declared_here is None:
            raise InvalidRequest(f"schedule {sid} is declared in code (@app.schedule): only "
                                 "the code deployed now tells whether it still declares it; "
                                 "delete it with that code (`orchestrator schedules delete "
                                 "--app MODULE:ATTR`, `app.schedules.delete`)", path="app")
        if self._kept_by_code(row):
            raise InvalidRequest(f"schedule {sid} is declared in code (@app.schedule): remove "
                                 "it there; pause it meanwhile", path="id")
        log.info("schedule %s deleted", sid)
        return ScheduleInfo.from_row(row)

    def _kept_by_code(self, row: dict[str, Any]) -> bool:
        return bool(row["declared"]) and (self.declared_here is None
                                          or row["id"] in self.declared_here)


def _missing(schedule_id: str) -> InvalidRequest:
    return InvalidRequest(f"no schedule {schedule_id}; `orchestrator schedules list` shows "
                          "them", path="id")


def definition(schedule_id: str, workflow: tuple[str, str], *, cron: str, timezone: str,
               overlap: str, catchup_window: timedelta, input: Any, owner: Owner,
               queue: str | None, json_limits: JsonLimits) -> tuple[dict[str, Any], Cron]:
    """A schedule's definition row, every field checked (``INVALID_REQUEST`` naming the
    first bad one, before anything is written), and its cron. ``queue``: the one its
    workflow's runs wait in (stored: whoever fires the schedule fires into it)."""
    sid = check_schedule_id(schedule_id)
    when = Cron(cron, timezone)
    if when.after(datetime.now(UTC)) is None:
        raise InvalidRequest(f"cron {cron!r} never fires", path="cron")
    row = {
        "id": sid, "workflow_name": workflow[0], "workflow_version": workflow[1],
        "cron": cron, "timezone": timezone, "overlap": check_overlap(overlap),
        "catchup_seconds": check_catchup(catchup_window).total_seconds(),
        "input": json.loads(json_limits.text(input, "$.input")),
        "tenant": owner.tenant, "principal": owner.principal, "queue": queue,
    }
    return row, when


class Schedules:
    """``app.schedules``: schedules stored in the database, made and changed at run time
    (docs/schedules.md). Each method has an ``_async`` twin for code in an event loop."""

    def __init__(self, admin: ScheduleAdmin, *, json_limits: JsonLimits,
                 resolve: Callable[[Any, str | None], Workflow[Any, Any]],
                 default_owner: Callable[[Owner | None], Owner],
                 call: Callable[[Any], Any]) -> None:
        self.admin = admin
        self._limits = json_limits
        self._resolve = resolve
        self._owner = default_owner
        self._call = call

    async def create_async(self, schedule_id: str, workflow: Any, *, cron: str,
                           timezone: str = "UTC", overlap: str = "skip",
                           catchup_window: timedelta = DEFAULT_CATCHUP, input: Any = None,
                           owner: Owner | None = None, version: str | None = None,
                           paused: bool = False) -> ScheduleInfo:
        """Create a schedule of ``workflow`` (a workflow or its name; ``version``: the
        newest registered here if not given). ``INVALID_REQUEST`` for an id already taken
        (not for one taken by this call's own insert, whose COMMIT applied but whose answer
        was lost with its connection: the storage layer runs it again, and it answers with
        the schedule it made)."""
        if not isinstance(paused, bool):  # "no" is true: never taken for its truth value
            raise InvalidRequest("paused must be True or False", path="paused")
        target = self._resolve(workflow, version)
        row, when = definition(
            schedule_id, (target.name, target.version), cron=cron, timezone=timezone,
            overlap=overlap, catchup_window=catchup_window, input=input,
            owner=self._owner(owner), queue=target.queue, json_limits=self._limits)
        now = await self.admin.ticker._now()
        async def insert(conn: Conn) -> bool:
            return await sched_db.schedule_create(
                conn, {**row, "paused": paused, "next_slot": when.after(now)})

        # Run again after a lost COMMIT that applied, it answers that it made the schedule.
        created = await self.admin.database.run_in_transaction(answered_once(insert))
        if not created:
            raise InvalidRequest(f"a schedule {row['id']} exists; update or delete it",
                                 path="id")
        return await self.get_async(row["id"])

    async def update_async(self, schedule_id: str, *, workflow: Any = None,
                           version: str | None = None, cron: str | None = None,
                           timezone: str | None = None, overlap: str | None = None,
                           catchup_window: timedelta | None = None, input: Any = ...,
                           owner: Owner | None = None) -> ScheduleInfo:
        """Change what is given of a schedule made at run time (one declared in code is
        changed in the code), keeping the rest as it stands when the change is written (two
        updates at once both land). A new cron or time zone starts from the first slot after
        now. The queue is the workflow's, when it is registered here."""

        def change(old: ScheduleInfo) -> tuple[dict[str, Any], Cron]:
            if workflow is None and version is None:
                target = (old.workflow, old.version)
                queue = self.admin.ticker.queue_of(old.workflow, old.version, old.queue)
            else:
                chosen = self._resolve(old.workflow if workflow is None else workflow, version)
                target, queue = (chosen.name, chosen.version), chosen.queue
            # What is given is checked as given (an empty cron, a zero window is refused),
            # never taken for "not given".
            return definition(
                old.id, target, cron=old.cron if cron is None else cron,
                timezone=old.timezone if timezone is None else timezone,
                overlap=old.overlap if overlap is None else overlap,
                catchup_window=old.catchup_window if catchup_window is None
                else catchup_window,
                input=old.input if input is ... else input,
                owner=old.owner if owner is None else self._owner(owner), queue=queue,
                json_limits=self._limits)

        return await self.admin.update(schedule_id, change)

    async def get_async(self, schedule_id: str) -> ScheduleInfo:
        return await self.admin.get(schedule_id)

    async def list_async(self) -> list[ScheduleInfo]:
        return await self.admin.list()

    async def show_async(self, schedule_id: str) -> ScheduleDetail:
        return await self.admin.show(schedule_id)

    async def delete_async(self, schedule_id: str) -> ScheduleInfo:
        """Delete the schedule (see :meth:`ScheduleAdmin.delete`); the schedule as it stood,
        as ``pause``, ``resume`` and ``update`` answer with the schedule they wrote. An
        unknown id is ``INVALID_REQUEST`` (``path`` ``id``), as for them."""
        return await self.admin.delete(schedule_id)

    async def pause_async(self, schedule_id: str) -> ScheduleInfo:
        return await self.admin.set_paused(schedule_id, True)

    async def resume_async(self, schedule_id: str) -> ScheduleInfo:
        return await self.admin.set_paused(schedule_id, False)

    async def trigger_async(self, schedule_id: str, *, overlap: str | None = None,
                            idempotency_key: str | None = None) -> dict[str, Any]:
        return await self.admin.trigger(schedule_id, overlap=overlap,
                                        idempotency_key=idempotency_key)

    async def backfill_async(self, schedule_id: str, start: datetime, end: datetime, *,
                             overlap: str = "allow_all") -> list[dict[str, Any]]:
        return await self.admin.backfill(schedule_id, start, end, overlap=overlap)

    # Sync twins.
    def create(self, schedule_id: str, workflow: Any, **options: Any) -> ScheduleInfo:
        return self._call(self.create_async(schedule_id, workflow, **options))  # type: ignore[no-any-return]

    def update(self, schedule_id: str, **options: Any) -> ScheduleInfo:
        return self._call(self.update_async(schedule_id, **options))  # type: ignore[no-any-return]

    def get(self, schedule_id: str) -> ScheduleInfo:
        return self._call(self.get_async(schedule_id))  # type: ignore[no-any-return]

    def list(self) -> builtins.list[ScheduleInfo]:
        return self._call(self.list_async())  # type: ignore[no-any-return]

    def show(self, schedule_id: str) -> ScheduleDetail:
        return self._call(self.show_async(schedule_id))  # type: ignore[no-any-return]

    def delete(self, schedule_id: str) -> ScheduleInfo:
        return self._call(self.delete_async(schedule_id))  # type: ignore[no-any-return]

    def pause(self, schedule_id: str) -> ScheduleInfo:
        return self._call(self.pause_async(schedule_id))  # type: ignore[no-any-return]

    def resume(self, schedule_id: str) -> ScheduleInfo:
        return self._call(self.resume_async(schedule_id))  # type: ignore[no-any-return]

    def trigger(self, schedule_id: str, *, overlap: str | None = None,
                idempotency_key: str | None = None) -> dict[str, Any]:
        return self._call(self.trigger_async(  # type: ignore[no-any-return]
            schedule_id, overlap=overlap, idempotency_key=idempotency_key))

    def backfill(self, schedule_id: str, start: datetime, end: datetime, *,
                 overlap: str = "allow_all") -> builtins.list[dict[str, Any]]:
        return self._call(self.backfill_async(schedule_id, start, end, overlap=overlap))  # type: ignore[no-any-return]
