"""The worker: claims ready runs, drives them, keeps their leases alive, drains on stop.

One worker process holds up to ``concurrency`` runs at once. It wakes on NOTIFY (new work,
events, finished children, expired leases) and polls only as a fallback; news of an event for
a run it holds wakes the branch waiting for it in place (``Branches.event_arrived``). It
claims from the default queue and from every queue (docs/flow.md) it has news of: a NOTIFY
names the queue whose runs it concerns (``.``: the default queue; empty, from an older sender:
any), and a source is claimed from again only after such news, after a claim that filled every
free slot (more may wait), when a queue's rate window has room again, or at the poll. Stopping
(SIGTERM) drains: no new claims; in-flight runs go on to their next durable point, then their
leases are released so another worker picks them up at once. Runs still busy when the drain
times out are abandoned, and released at once too unless a call of theirs is in flight.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, Tracer

from orchestrator._portal import serving
from orchestrator.db import grants as grants_db
from orchestrator.db import journal as journal_db
from orchestrator.db import operations as ops_db
from orchestrator.db import queues as queues_db
from orchestrator.db import runs as runs_db
from orchestrator.db import workers as workers_db
from orchestrator.db.config import display_url
from orchestrator.db.database import (
    CANCEL_CHANNEL,
    DEFAULT_QUEUE_NEWS,
    EVENTS_CHANNEL,
    RUNS_CHANNEL,
    TOOLS_CHANNEL,
    Conn,
    Database,
)
from orchestrator.db.events import incident_record
from orchestrator.db.probe import connect_options, connection_name
from orchestrator.db.workers import DEAD_AFTER
from orchestrator.db.writer import GroupWriter
from orchestrator.engine.config import EngineConfig
from orchestrator.engine.executor import RunExecutor
from orchestrator.engine.outcome import STRANDED_ERROR, strand_entries
from orchestrator.engine.run import Lease, claim_lease, lease_lost
from orchestrator.errors import (
    ConfigurationError,
    DatabaseError,
    LeaseLost,
    OrchestratorError,
    RunUnreadable,
    SchemaUnsupported,
)
from orchestrator.ids import default_worker_id
from orchestrator.journal import EventKind, entry
from orchestrator.logs import FailureStreak, fields
from orchestrator.metrics import Metrics
from orchestrator.registry import Registry, Workflow
from orchestrator.text import storable
from orchestrator.tracing import record_error

log = logging.getLogger("orchestrator.worker")

COMPANION_GRACE = 5.0
"""Seconds a companion (the schedules' ticker) has, after the drain, to finish what it was
doing (a tick is one transaction: cancelled, it rolls back) before it is cancelled."""
SWEEP_INTERVAL = 0.5  # seconds between looks for expired leases and dead workers
HEARTBEAT_INTERVAL = 0.25  # at most; a worker's liveness is judged by it (one row per beat)
# Seconds a stopping worker waits, after its drain timeout, for writes in flight to land before
# it gives up on them (GroupWriter.abandon).
WRITE_GRACE = 5.0
# The part of the lease TTL for which a write that cannot reach the database is tried again
# (GroupWriter's patience) before its run is let go: a lease renewed a third of the TTL apart
# still has two thirds of it left when an outage begins.
OUTAGE_PATIENCE = 0.5
# A busy worker claims at most this often; an idle worker claims at once. Under a stream of
# submissions every NOTIFY wakes every worker, and a claim costs a transaction (and a commit)
# whether it takes one run, several or none (a quarter found nothing: another worker had taken
# the run). At 2 ms apart the claims of a 550 runs/s stream took so much CPU that the machine
# was saturated and the first step waited for it: 14.8 ms p50, 33.5 ms p99 on 2 cores; 10 ms
# apart, 9.7 / 20.4 ms, with drains no slower (bench latency and throughput sections).
CLAIM_GAP = 0.010


@dataclass(eq=False)
class _InFlight:
    """A run this worker claimed, from its claim until its task ends: the task driving it,
    the claim's lease (renewed from the claim on, while the run's journal is read too) and,
    once built, its executor (which reads the same lease)."""

    task: asyncio.Future[None]
    lease: Lease
    executor: RunExecutor | None = None


class Worker:
    """Claims and runs the workflows in ``registry``. Create with ``app.create_worker``."""

    def __init__(
        self,
        config: EngineConfig,
        registry: Registry,
        database: Database,
        metrics: Metrics,
        *,
        concurrency: int = 10,
        worker_id: str | None = None,
        lease_ttl: float | None = None,
        poll_interval: float = 1.0,
        drain_timeout: float = 30.0,
        companions: Sequence[Callable[[asyncio.Event], Awaitable[None]]] = (),
        queues: Sequence[dict[str, Any]] = (),
    ) -> None:
        if concurrency < 1:
            raise ValueError("concurrency must be at least 1")
        self.config = config
        self.registry = registry
        self.database = database
        self.metrics = metrics
        self.concurrency = concurrency
        self.worker_id = worker_id or default_worker_id()
        self.lease_ttl = lease_ttl if lease_ttl is not None else config.lease_ttl
        self.poll_interval = poll_interval
        self.drain_timeout = drain_timeout
        # Its sessions, the liveness lock's above all, named after it in pg_stat_activity (the
        # connections opened from now on: a process that runs a worker opens its pool in the
        # worker's own loop).
        database.application_name = connection_name("worker", self.worker_id)
        self._liveness = workers_db.LivenessLock(
            database.target.session_url, secrets.randbits(62) + 1,
            options=connect_options(database.target, database.connect_timeout,
                                    name=database.application_name))
        self.writer = GroupWriter(database, patience=self.lease_ttl * OUTAGE_PATIENCE)
        self._running: dict[uuid.UUID, _InFlight] = {}
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._hurry = asyncio.Event()  # asked to stop again: the drain waits no more
        self.claimed = 0  # runs claimed since start (for tests and the demo)
        self._spans: dict[uuid.UUID, Span] = {}  # the run span of each run driven here
        # What else runs in this process beside the claims (the schedules' ticker): started
        # once the worker is registered, told to stop when it begins to drain.
        self.companions = tuple(companions)
        # Queues (docs/flow.md): those declared by this app (``Queue.row()``), written when the
        # worker starts; the names of those stored and not paused, read at each sweep; the
        # sources with news since their last claim (None: the default queue); and when a
        # queue's rate window next has room (monotonic time).
        self.declared_queues = tuple(queues)
        self._queues: set[str] = set()
        self._dirty: set[str | None] = {None}
        self._rate_wakes: dict[str, float] = {}
        self._registered = False  # its row written at start (a heartbeat before only updates)
        # The liveness lock's session last seen in the database URL's pg_locks (its count of
        # takings): a lock is published and relied on only once seen there; and the error
        # that stopped the worker when it was not (raised by run() after the drain).
        self._lock_checked = 0
        self._misconfigured: ConfigurationError | None = None
        self._lock_lost_said = False  # a lock held before is lost, and that was logged
        # The background steps' failures, said once per streak (an outage of seconds would
        # otherwise be a line per attempt, every quarter second).
        self._beats = FailureStreak(log, "heartbeat", "heartbeats")
        # One streak per claim source (the default queue: None): a queue whose claim keeps
        # failing is said once, not once per poll between another source's successes.
        self._claims: dict[str | None, FailureStreak] = {}
        self._renewals = FailureStreak(log, "lease renewal", "lease renewals")
        self._sweeps = FailureStreak(log, "lease sweep", "lease sweeps")
        self._lock_checks = FailureStreak(log, "liveness lock check", "liveness lock checks",
                                          prefix=f"worker {self.worker_id}: ",
                                          failure="could not check its liveness lock")

    def request_stop(self) -> None:
        """Begin draining (what SIGTERM and SIGINT do); asked again while draining, stop now:
        the drain ends as if its timeout had passed (a second Ctrl-C)."""
        if self._stop.is_set():
            if not self._hurry.is_set():
                log.warning("worker %s: asked again to stop: stopping now, without waiting "
                            "for the runs in flight", self.worker_id)
                self._hurry.set()
            return
        self._stop.set()
        self._wake.set()

    @property
    def active_runs(self) -> int:
        return len(self._running)

    async def run(self, stop: asyncio.Event | None = None) -> None:
        """Work until ``stop`` is set (or :meth:`request_stop`), then drain. Meanwhile the
        app's sync methods are refused on this loop (they would stop the worker to wait)."""
        with serving():
            await self._run(stop)
        if self._misconfigured is not None:
            raise self._misconfigured

    @property
    def _lock_held(self) -> bool:
        """The liveness lock is held, and its session was seen in the database URL's
        ``pg_locks`` (:meth:`_hold_lock`): only then is it published, and are runs claimed."""
        return self._liveness.held and (self._liveness.key is None
                                        or self._liveness.taken == self._lock_checked)

    async def _hold_lock(self) -> bool:
        """Hold the liveness lock (:meth:`LivenessLock.ensure`), and check each session it is
        taken on anew. The lock is taken on the session URL (``listen_url`` behind a
        transaction pooler) but tested in ``pg_locks`` of the database URL's database: one
        that another database or server holds is never seen, and this worker would look dead
        to every sweep at its first late heartbeat (its runs re-queued while their calls are
        in flight). Such a lock is let go for good and ``CONFIGURATION_ERROR`` raised, before
        it is published: at start, or whenever it is first taken (a ``listen_url`` that could
        not be reached at start is checked once it can)."""
        if not await self._liveness.ensure():
            return False
        key, taken = self._liveness.key, self._liveness.taken
        if key is None or taken == self._lock_checked:
            return True
        async with self.database.connection() as conn:
            seen = await workers_db.worker_lock_seen(conn, key)
        if not seen:
            await self._liveness.close()
            raise ConfigurationError(
                f"listen_url {display_url(self._liveness.url or '')} does not reach the "
                "database of the database URL: the worker's liveness lock taken there is not "
                "seen in that database's pg_locks, so other workers would take this one for "
                "dead at its first late heartbeat and re-queue its runs while their calls are "
                "in flight; give listen_url the same server and database, reached directly "
                "(docs/operations.md)")
        self._lock_checked = taken
        return True

    async def _check_liveness_lock(self) -> None:
        """At start: :meth:`_hold_lock` (a ``listen_url`` that reaches another database is
        refused before the worker registers); one that cannot be reached yet is said, and
        tried again at each heartbeat: the worker claims nothing until it holds the lock."""
        if not await self._hold_lock():
            log.warning("worker %s: its liveness lock cannot be taken on listen_url %s yet: "
                        "it claims nothing until it can (tried at each heartbeat, and checked "
                        "to reach the database URL's database then)", self.worker_id,
                        display_url(self._liveness.url or ""))
            self._lock_lost_said = True  # and said once it holds it (_say_lock)

    async def _relock(self) -> bool:
        """:meth:`_hold_lock` at a heartbeat: a lock that turns out to be held in another
        database stops the worker (it drains), and :meth:`run` raises the error then."""
        try:
            held = await self._hold_lock()
        except ConfigurationError as exc:
            log.error("worker %s stops: %s", self.worker_id, exc.message)
            self._misconfigured = exc
            self.request_stop()
            return False
        except OrchestratorError as exc:  # the check's read failed: tried again next beat
            self._lock_checks.failed(exc.code)
            return False
        if held:  # checked (a lock not taken yet was not: no news about the checks)
            self._lock_checks.succeeded()
        self._say_lock(held)
        return held

    def _say_lock(self, held: bool) -> None:
        """Say once that a liveness lock held before is not held any more (the worker claims
        nothing meanwhile: ``waiting`` in ``workers list``), and once that it is held again
        (or at last, when it could not be taken at start)."""
        if self._liveness.key is None or self._stop.is_set():
            return
        if not held and self._lock_checked and not self._lock_lost_said:
            self._lock_lost_said = True
            log.warning("worker %s: its liveness lock's session ended and the lock cannot be "
                        "taken again yet (%s cannot be reached, or the old session is not yet "
                        "ended on the server and keeps it): it claims nothing new until it can "
                        "(tried at each heartbeat), keeps the runs it has, and is listed "
                        "waiting", self.worker_id, display_url(self._liveness.url or ""))
        elif held and self._lock_lost_said:
            self._lock_lost_said = False
            log.info("worker %s holds its liveness lock now: it claims work",
                     self.worker_id)

    async def _run(self, stop: asyncio.Event | None) -> None:
        async with self.database.connection() as conn:  # before anything else starts
            await grants_db.require_privileges(conn, "worker")
        await self._check_liveness_lock()
        if stop is not None:
            asyncio.ensure_future(self._forward_stop(stop))
        listen_stop = asyncio.Event()
        listener = asyncio.ensure_future(self.database.listen(
            [RUNS_CHANNEL, CANCEL_CHANNEL, EVENTS_CHANNEL, TOOLS_CHANNEL], self._on_notify,
            listen_stop))
        # Side duties, each its own task: a heartbeat waiting on the workers table (a lock, a
        # DDL) must not hold back the renewals that keep the runs' leases.
        heart = asyncio.ensure_future(self._heartbeat_loop())
        renewals = asyncio.ensure_future(self._renewal_loop())
        workflows = list(self.registry.workflows)
        # Taken (or tried) just above: a listen_url that cannot be reached is not waited for
        # twice before the worker registers; the heartbeat takes it once it can.
        held = self._lock_held
        async with self.database.connection() as conn:
            if self.declared_queues:
                await queues_db.queue_declare(conn, self.declared_queues)
            self._queues = set(await queues_db.queue_names(conn))
            self._dirty.update(self._queues)
            self.config.back_offs.update(await ops_db.tool_back_offs(conn))
            await self._register(conn, locked=held)
        self._registered = True
        last_sweep = last_claim = last_look = 0.0
        log.info("worker %s started: %d slots, workflows %s, event loop %s", self.worker_id,
                 self.concurrency, ", ".join(workflows),
                 type(asyncio.get_running_loop()).__module__.partition(".")[0])
        if self.database.target.session_url is None:
            log.info("worker %s: no listen_url behind the transaction pooler: it looks for "
                     "work every %g s, and a dead worker's runs wait for their leases (%g s) "
                     "to expire", self.worker_id, self.poll_interval, self.lease_ttl)
        companions_stop = asyncio.Event()
        companions = [asyncio.ensure_future(self._companion(run, companions_stop))
                      for run in self.companions]
        try:
            while not self._stop.is_set():
                self._wake.clear()
                if time.monotonic() - last_look >= self.poll_interval:
                    # The fallback poll, however often news came meanwhile: a run whose
                    # timer fell due, or a queue's news that was missed, is claimed by it.
                    last_look = time.monotonic()
                    self._dirty.add(None)
                    self._dirty.update(self._queues)
                if time.monotonic() - last_sweep > min(self.lease_ttl / 2, SWEEP_INTERVAL):
                    last_sweep = time.monotonic()
                    await self._sweep()
                free = self.concurrency - len(self._running)
                if free > 0 and workflows and self._lock_held and self._dirty:
                    gap = last_claim + CLAIM_GAP - time.monotonic()
                    if self._running and gap > 0:
                        await asyncio.sleep(gap)
                        free = self.concurrency - len(self._running)
                    last_claim = time.monotonic()
                    if await self._claim_sources(workflows, free):
                        continue
                timeout = max(0.0, last_look + self.poll_interval - time.monotonic())
                if self._rate_wakes:
                    timeout = max(0.0, min(timeout,
                                           min(self._rate_wakes.values()) - time.monotonic()))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), timeout)
                now = time.monotonic()
                for queue, due in list(self._rate_wakes.items()):
                    if due <= now:
                        del self._rate_wakes[queue]
                        self._dirty.add(queue)
        finally:
            companions_stop.set()
            await self._drain()
            if companions:  # told to stop before the drain; one stuck on the database goes
                _, stuck = await self._wait_unless_hurried(companions, COMPANION_GRACE)
                for companion in stuck:
                    companion.cancel()
                for companion in companions:
                    with contextlib.suppress(BaseException):
                        await companion
            listen_stop.set()
            heart.cancel()
            renewals.cancel()
            for task in (listener, heart, renewals):
                with contextlib.suppress(BaseException):
                    await task
            with contextlib.suppress(OrchestratorError):
                async with self.database.connection() as conn:
                    await workers_db.worker_unregister(conn, self.worker_id)
            await self._liveness.close()
            log.info("worker %s stopped", self.worker_id)

    async def _register(self, conn: Conn, *, locked: bool) -> None:
        await workers_db.worker_register(
            conn, worker_id=self.worker_id, hostname=socket.gethostname(), pid=os.getpid(),
            workflows=list(self.registry.workflows), concurrency=self.concurrency,
            lock_key=self._liveness.key if locked else None, draining=self._stop.is_set(),
            lock_wanted=self._liveness.key is not None)

    def _on_notify(self, channel: str, payload: str) -> None:
        if channel == TOOLS_CHANNEL:  # a provider paused a tool: its calls wait here too
            name, _, until = payload.partition("\t")
            # Anyone connected may NOTIFY: an end that is no number, or no time a datetime
            # holds (inf, 1e300), is skipped quietly, not logged as the listener's failure.
            with contextlib.suppress(ValueError, OverflowError):
                when = datetime.fromtimestamp(float(until), UTC)
                if when > self.config.back_offs.get(name, when - timedelta(seconds=1)):
                    self.config.back_offs[name] = when
            return
        if channel == CANCEL_CHANNEL:
            for rid, held in self._running.items():
                if held.executor is not None and str(rid) == payload:
                    held.executor.run.note_cancel()
            return
        if channel == EVENTS_CHANNEL:  # a branch of a run held here may be waiting for it
            run_id, _, name = payload.partition("\t")
            for rid, held in self._running.items():
                if held.executor is not None and str(rid) == run_id:
                    held.executor.branches.event_arrived(name)
            return
        if payload == DEFAULT_QUEUE_NEWS:  # a run outside every queue: the default queue only
            self._dirty.add(None)
        elif payload:  # news of one queue (a submission, a slot freed, a limit changed)
            self._queues.add(payload)
            self._dirty.add(payload)
        else:  # news of any run: look everywhere
            self._dirty.add(None)
            self._dirty.update(self._queues)
        self._wake.set()

    async def _companion(self, run: Callable[[asyncio.Event], Awaitable[None]],
                         stop: asyncio.Event) -> None:
        """One companion until ``stop``; one that fails is logged and not restarted: the
        worker goes on claiming."""
        try:
            await run(stop)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("worker %s: a companion task failed (%s); the worker goes on",
                          self.worker_id, getattr(run, "__qualname__", run))

    async def _forward_stop(self, stop: asyncio.Event) -> None:
        await stop.wait()
        self.request_stop()

    async def _sweep(self) -> None:
        try:
            async with self.database.connection() as conn:
                lapsed = await runs_db.run_release_expired(conn)
                orphaned = await runs_db.run_release_orphaned(conn, stale=DEAD_AFTER)
                await workers_db.worker_forget_dead(conn)
                self._queues = set(await queues_db.queue_names(conn))
                expired = await runs_db.run_any_unstarted_expired(conn)
            if lapsed:
                log.warning("re-queued %s whose lease expired (its worker stopped renewing it: "
                            "dead, paused, overloaded or cut off)", _runs(lapsed))
            if orphaned:
                log.warning("re-queued %s whose worker died (no heartbeat, its liveness lock "
                            "released): `orchestrator workers list` shows it dead",
                            _runs(orphaned))
            if expired:
                await self._expire_unstarted()
        except OrchestratorError as exc:  # the next sweep tries again; the message says why
            self._sweeps.failed(exc.code, str(exc))
            return
        self._sweeps.succeeded()

    async def _expire_unstarted(self) -> None:
        """End the runs whose deadline passed before they could start (their queue held them
        back, or no worker serves them): their owners' waits end at the deadline, and they
        take no slot of their queue to fail in."""
        async with self.database.connection() as conn, conn.transaction():
            ended = await runs_db.run_expire_unstarted(conn)
        for run in ended:
            workflow = f"{run['workflow_name']}@{run['workflow_version']}"
            self.metrics.incr("deadline_exhausted")
            self.metrics.incr("runs_failed")
            log.info("run %s (%s) failed: DEADLINE_EXCEEDED before it started (incident %s)",
                     run["id"], workflow, run["incident"],
                     extra=fields(run_id=run["id"], workflow=workflow,
                                  code="DEADLINE_EXCEEDED", incident=run["incident"]))

    async def _claim_sources(self, workflows: list[str], free: int) -> bool:
        """Claim from each source with news, the default queue first, while slots are free;
        True when a source filled every slot it was offered (more may wait: claim again)."""
        dirty, self._dirty = self._dirty, set()
        full = False
        for source in sorted(dirty, key=lambda q: (q is not None, q or "")):
            if free <= 0:
                self._dirty.add(source)  # not looked at: still news
                continue
            claims = await self._claim(workflows, free, source)
            for claim in claims:
                self._start(claim)
            if len(claims) == free:
                self._dirty.add(source)
                full = True
            free -= len(claims)
        return full

    def _claim_streak(self, queue: str | None) -> FailureStreak:
        """The failures in a row of the claims from ``queue`` (None: the default queue)."""
        streak = self._claims.get(queue)
        if streak is None:
            streak = self._claims[queue] = FailureStreak(
                log, "claim", "claims" if queue is None else f"claims from queue {queue}")
        return streak

    async def _claim(self, workflows: list[str], free: int,
                     queue: str | None = None) -> list[dict[str, Any]]:
        try:
            async with self.database.connection() as conn:
                sent = time.monotonic()  # the leases last at least ttl from here (C6)
                wall = time.time()
                if queue is None:
                    claims = await runs_db.run_claim_ready(
                        conn, worker=self.worker_id, workflows=workflows, limit=free,
                        ttl=self.lease_ttl)
                else:
                    claims, wake = await queues_db.queue_claim(
                        conn, queue=queue, worker=self.worker_id, workflows=workflows,
                        limit=free, ttl=self.lease_ttl)
                    if wake is not None:  # its rate window is full for so many seconds
                        self._rate_wakes[queue] = time.monotonic() + wake
        except OrchestratorError as exc:
            self._claim_streak(queue).failed(
                exc.code, exc.code if queue is None else f"{exc.code} (queue {queue})")
            self._dirty.add(queue)
            await asyncio.sleep(self.poll_interval)
            return []
        self._claim_streak(queue).succeeded()
        # The wall clock when the claim was sent, a moment before the server read its own
        # (``db_now``, the statement's start): a run's offset to the server's clock is
        # measured against it, not against the time its executor is built, after a journal
        # read that may take seconds.
        for claim in claims:
            claim["lease"] = Lease(claim["lease_token"], sent=sent, ttl=self.lease_ttl)
            claim["claimed_wall"] = wall
        self.claimed += len(claims)
        if claims:
            self._count_claims(claims)
        return claims

    def _count_claims(self, claims: list[dict[str, Any]]) -> None:
        """The claim, and the starts in it: a run's first claim (its lease token 1; every claim
        raises it), with how long the run waited since it was due. A run claimed again, its
        lease lapsed before its first step, started once already; the runs with history are
        counted once their journal is read (:meth:`_count_replay`)."""
        metrics = self.metrics
        metrics.incr("claims")
        metrics.observe("claim_batch_size", len(claims))
        for claim in claims:
            if claim["lease_token"] == 1:
                workflow = claim["workflow_name"]
                metrics.incr("runs_started", workflow=workflow)
                if claim["due_at"] is not None:  # (a row edited by hand: not counted)
                    metrics.observe("run_queue_wait_seconds", max(0.0, (
                        claim["db_now"] - claim["due_at"]).total_seconds()), workflow)

    def _count_replay(self, claim: dict[str, Any], journal: list[dict[str, Any]]) -> None:
        """A run claimed with history is replayed from its journal; it is a resume when it
        had parked: a wait of its ended (it was ``waiting``), or what it waited for in
        reconciliation was settled (its journal ends with the resolution)."""
        self.metrics.incr("run_replays", workflow=claim["workflow_name"])
        last = journal[-1] if journal else None
        if claim.get("claimed_from") == "waiting" or (last is not None and (
                last["kind"] == EventKind.CALL_NOT_APPLIED
                or (last["kind"] == EventKind.CALL_COMPLETED
                    and isinstance(last["payload"], dict) and "resolved_by" in last["payload"]))):
            self.metrics.incr("run_resumes", workflow=claim["workflow_name"])

    def _start(self, claim: dict[str, Any]) -> None:
        run_id = claim["id"]
        held = self._running[run_id] = _InFlight(asyncio.ensure_future(self._execute(claim)),
                                                 claim_lease(claim, self.lease_ttl))

        def done(_: asyncio.Future[None]) -> None:
            if self._running.get(run_id) is held:  # not a newer claim of the same run
                del self._running[run_id]
            self._wake.set()

        held.task.add_done_callback(done)

    async def _execute(self, claim: dict[str, Any]) -> None:
        run_id = claim["id"]
        executor: RunExecutor | None = None
        try:
            executor = await self._executor_for(claim)
            if executor is None:
                return
            held = self._running.get(run_id)
            if held is None or held.task is not asyncio.current_task():
                # Its lease lapsed while its journal was read, and this worker claimed the run
                # again meanwhile: the newer claim drives it, this one's token is superseded.
                executor.run.lose_lease("claimed again")
                return
            held.executor = executor
            if self._stop.is_set():
                executor.run.request_drain()
            workflow = self.registry.workflows[executor.workflow_key]
            tracer = executor.run.tracer
            if tracer is None:
                await executor.drive(workflow)
            else:
                await self._drive_traced(tracer, executor, workflow, claim)
        except asyncio.CancelledError:
            raise
        except DatabaseError:
            # The database stopped answering on a path with nothing more to write for the run
            # (a drain's release of it, say): it is let go as in any outage, said lost once,
            # and its lease lapses.
            if executor is not None:  # (_executor_for lets go of its own failures)
                executor.run.lose_lease("database unavailable")
        except Exception:
            with self._in_span(run_id):
                log.exception("run %s: the worker failed while driving it; its lease will "
                              "expire", run_id,
                              extra=fields(run_id=run_id, workflow=_workflow(claim)))
        finally:
            self._spans.pop(run_id, None)

    def _in_span(self, run_id: uuid.UUID) -> AbstractContextManager[Any]:
        """The run's span current (if it has one here): for a line logged about the run
        outside its own task, so that the line names its trace."""
        span = self._spans.get(run_id)
        if span is None:
            return nullcontext()
        return trace.use_span(span, record_exception=False, set_status_on_exception=False)

    async def _drive_traced(self, tracer: Tracer, executor: RunExecutor, workflow: Workflow,
                            claim: dict[str, Any]) -> None:
        """:meth:`RunExecutor.drive` inside this execution's ``run`` span, current for the
        run's task and so for every branch, call and log line of it (docs/tracing.md)."""
        run = executor.run
        span = self.config.tracing.run_span(tracer, run.workflow_name, claim.get("traceparent"), {
            "orchestrator.run_id": run.run_text,
            "orchestrator.workflow": run.workflow_name,
            "orchestrator.workflow_version": claim["workflow_version"],
            "orchestrator.worker_id": self.worker_id,
            "orchestrator.lease_token": run.token,
            "orchestrator.replay": claim["revision"] > 0})
        self._spans[run.run_id] = span
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            if claim["revision"] > 0:
                span.add_event("resume", {"orchestrator.revision": claim["revision"]})
            await executor.drive(workflow)
            if run.lost:
                record_error(span, "LEASE_LOST")
        except BaseException as exc:
            record_error(span, getattr(exc, "code", None) or type(exc).__name__)
            raise
        finally:
            span.end()
            otel_context.detach(token)

    async def _executor_for(self, claim: dict[str, Any]) -> RunExecutor | None:
        """Decode one claimed run (its input, its journal) and build its executor. A run whose
        stored values this code cannot read fails alone (``RUN_UNREADABLE``, with an incident)
        or, for a journal from newer code, goes back to the queue; a run whose journal the
        database did not give is let go (its lease lapses); None then. The journal is read as
        patiently as the run's other reads (:meth:`GroupWriter.patiently`): a database that
        cannot be reached is waited for, up to the writer's patience, before the run is let
        go. The worker goes on claiming either way: no run's content can stop it."""
        run_id = claim["id"]
        try:
            journal: list[dict[str, Any]] = []
            if claim["revision"] > 0:  # a fresh run has nothing to replay
                journal = await self.writer.patiently(lambda: self.database.read(
                    lambda conn: journal_db.journal_read(conn, run_id)))
                self._count_replay(claim, journal)
            return self.new_executor(claim, journal)
        except SchemaUnsupported as exc:
            log.error("run %s has journal events newer than this code; released", run_id,
                      extra=fields(run_id=run_id, workflow=_workflow(claim), code=exc.code))
            async with self.database.connection() as conn:
                await runs_db.run_release(
                    conn, run_id=run_id, token=claim["lease_token"], delay=60.0,
                    waiting_for="a worker that understands its journal's schema version")
            return None
        except DatabaseError as exc:
            # Infrastructure, not the run: this worker lets it go as it would any run whose
            # writes the database stopped taking; its lease lapses and it is claimed again.
            lease_lost(self.metrics, run_id, claim["lease_token"],
                       f"{exc.code} before it started", _workflow(claim))
            return None
        except Exception as exc:  # noqa: BLE001 - whatever the stored rows hold
            await fail_unreadable(self.database, self.metrics, claim, exc)
            return None

    def new_executor(self, claim: dict[str, Any], journal: list[dict[str, Any]]) -> RunExecutor:
        """The executor of a run this worker claimed (raises what decoding it raises)."""
        return RunExecutor(claim, journal, config=self.config, registry=self.registry,
                           database=self.database, writer=self.writer, metrics=self.metrics,
                           worker_id=self.worker_id)

    def _beat_interval(self) -> float:
        """Seconds between two heartbeats, and between two looks at whether the leases are due
        for renewal."""
        return max(min(self.lease_ttl / 3, HEARTBEAT_INTERVAL), 0.05)

    async def _heartbeat_loop(self) -> None:
        """The worker's liveness beat: one row, often. The leases of its runs are renewed by
        :meth:`_renewal_loop`, never held back by a beat that waits."""
        interval = self._beat_interval()
        checking: asyncio.Future[bool] | None = None
        try:
            while True:
                await asyncio.sleep(interval)
                # The lock's connection is checked beside the beat, not before it: one whose
                # network path dropped answers nothing until the kernel gives up (minutes),
                # and the beat goes through the pool meanwhile.
                if checking is None or checking.done():
                    checking = asyncio.ensure_future(self._relock())
                await self._beat()
        finally:
            if checking is not None and not checking.done():
                # Closed first, a check waiting on a dropped path ends at once (cancelled
                # mid-query, psycopg would try to cancel the query over that path).
                await self._liveness.close()
                checking.cancel()
                with contextlib.suppress(BaseException):
                    await checking

    async def _beat(self) -> None:
        """One heartbeat; the row made again if it is gone. A failure is logged, once per
        streak (the next beat tries again)."""
        locked = self._lock_held
        try:
            async with self.database.connection() as conn:
                if not await workers_db.worker_heartbeat(
                        conn, self.worker_id, lock_key=self._liveness.key if locked else None
                ) and self._registered:
                    # Its row was forgotten (a silence of an hour) or deleted: without it the
                    # fleet does not list this worker, and its death would not be noticed
                    # through its lock.
                    log.warning("worker %s was not registered any more; registered again",
                                self.worker_id)
                    await self._register(conn, locked=locked)
        except OrchestratorError as exc:
            self._beats.failed(exc.code)
            return
        self._beats.succeeded()

    async def _renewal_loop(self) -> None:
        """The leases of the runs this worker holds, renewed a third of the lease TTL apart
        (they only have to outlive the TTL); a renewal that failed is tried again at the next
        beat's interval. Its own task: a heartbeat that fails or waits (its row locked by a
        DDL or an operator's transaction) delays no renewal."""
        interval = self._beat_interval()
        renew_every = max(self.lease_ttl / 3, interval)
        renewed = time.monotonic()
        while True:
            await asyncio.sleep(interval)
            if time.monotonic() - renewed >= renew_every and await self._renew_leases():
                renewed = time.monotonic()

    async def _renew_leases(self) -> bool:
        """Extend the leases of the runs this worker is working on; a run whose lease was not
        extended has been taken away: stop working on it. A run whose final write is under way
        is renewed too (a slow database must not let its lease lapse and send it to another
        worker for a replay while the write is still coming), but never reported lost: if its
        write landed it is simply not running any more, and if it was taken away the write is
        fenced. Returns False if the database could not be asked."""
        # Each run claimed whose task goes on, its journal being read (no executor yet) or
        # driven; not one whose executor was told it lost its lease, nor one whose task has
        # ended (it let go of the run, or is about to leave this book).
        held = [(rid, h.lease, h.executor) for rid, h in list(self._running.items())
                if not h.task.done() and (h.executor is None or not h.executor.run.lost)]
        leases = [(rid, lease.token) for rid, lease, _ in held]
        try:
            async with self.database.connection() as conn:
                sent = time.monotonic()
                kept, renewed = await runs_db.run_leases_renew(
                    conn, worker=self.worker_id, leases=leases, ttl=self.lease_ttl)
        except OrchestratorError as exc:
            self._renewals.failed(exc.code)
            return False
        self._renewals.succeeded()
        for rid, lease, ex in held:
            if rid in renewed:  # the executor's lease too, built before or after the renewal
                lease.renewed(sent)
            elif (ex is not None and rid not in kept and rid in self._running
                  and not ex.run.ending):
                with self._in_span(rid):
                    ex.run.lose_lease("heartbeat rejected")
        return True

    async def _drain(self) -> None:
        busy = len(self._running)
        log.info("worker %s draining: %d run%s in flight, up to %g s to reach a durable point",
                 self.worker_id, busy, "" if busy == 1 else "s", self.drain_timeout)
        for held in self._running.values():
            if held.executor is not None:
                held.executor.run.request_drain()
        # The fleet shows it draining; a database that does not answer holds no run back.
        marking = asyncio.ensure_future(self._mark_draining())
        try:
            await self._drain_runs()
        finally:
            if not marking.done():
                marking.cancel()
            with contextlib.suppress(BaseException):
                await marking

    async def _mark_draining(self) -> None:
        try:
            async with self.database.connection() as conn:
                if not await workers_db.worker_mark_draining(conn, self.worker_id):
                    log.info("worker %s: its row was gone or said draining already",
                             self.worker_id)
        except OrchestratorError as exc:
            log.warning("worker %s: could not record its drain: %s", self.worker_id, exc.code)

    async def _drain_runs(self) -> None:
        leases = {held.task: (rid, held.lease.token) for rid, held in self._running.items()}
        pending: set[asyncio.Future[Any]] = set()
        if leases:
            _, pending = await self._wait_unless_hurried(list(leases), self.drain_timeout)
            if pending:
                n = len(pending)
                log.warning("worker %s: %d run%s did not reach a durable point %s and %s "
                            "abandoned: %s given back at once unless it has a call in "
                            "flight", self.worker_id, n, "" if n == 1 else "s",
                            "before the second stop request" if self._hurry.is_set()
                            else f"within the drain ({self.drain_timeout:g} s)",
                            "is" if n == 1 else "are", "it is" if n == 1 else "each is")
            if pending:  # a write waiting for the database must not hold them any longer
                self.writer.hurry("the worker stopped before the database answered")
            for task in pending:
                task.cancel()
            for task in pending:
                with contextlib.suppress(BaseException):
                    await task
        # A workflow cancelled while its write is in flight wakes once the write has landed
        # (its bookkeeping must follow the write); a database that does not answer must not
        # hold the stop for as long as the writer's own attempts would take.
        grace_ends = time.monotonic() + WRITE_GRACE
        await self.writer.drain(WRITE_GRACE)
        if pending:  # within the same grace (half a second at least): the stop's budget holds
            await self._release_abandoned([leases[task] for task in pending],
                                          max(grace_ends - time.monotonic(), 0.5))

    async def _release_abandoned(self, leases: list[tuple[uuid.UUID, int]],
                                 timeout: float) -> None:
        """Give the runs abandoned by the drain back to the queue at once, so that a rolling
        restart does not hold them for the lease TTL. Their tasks have ended and every write
        of theirs has landed, so nothing of this process acts for them any more, except a
        call sent before the drain gave up: a cancelled call may still be under way at its
        provider (a thread, a request already on the wire), so a run with a call
        ``submitted`` and no outcome keeps its lease until it lapses (C6), as before. Nothing
        is released when the writer gave up on a write (it may still land); nor when the
        database does not answer within ``timeout`` (what is left of :data:`WRITE_GRACE`):
        the leases lapse then."""
        n = len(leases)
        if self.writer.abandoned:
            log.warning("worker %s: a write was still in flight as it stopped: the %d run%s "
                        "it abandoned keep%s %s lease%s until %s lapse%s", self.worker_id, n,
                        "" if n == 1 else "s", "s" if n == 1 else "",
                        "its" if n == 1 else "their", "" if n == 1 else "s",
                        "it" if n == 1 else "they", "s" if n == 1 else "")
            return

        async def release(conn: Conn) -> tuple[set[uuid.UUID], set[uuid.UUID]]:
            return await runs_db.run_release_abandoned(conn, worker=self.worker_id,
                                                       leases=leases)

        try:
            released, in_flight = await asyncio.wait_for(
                self.database.run_in_transaction(release, attempts=1), timeout)
        except (OrchestratorError, TimeoutError) as exc:
            log.warning("worker %s: could not give back the %d run%s it abandoned (%s): "
                        "another worker takes %s over when %s lease%s lapse%s",
                        self.worker_id, n, "" if n == 1 else "s",
                        getattr(exc, "code", None) or type(exc).__name__,
                        "it" if n == 1 else "them", "its" if n == 1 else "their",
                        "" if n == 1 else "s", "s" if n == 1 else "")
            return
        log.info("worker %s: released %d of the %d run%s it abandoned, for another worker "
                 "at once; %d kept (a call in flight: taken over when the lease lapses)%s",
                 self.worker_id, len(released), n, "" if n == 1 else "s", len(in_flight),
                 "" if len(released) + len(in_flight) == n else
                 f"; {n - len(released) - len(in_flight)} had ended or were another's")
        for rid in in_flight:
            log.warning("run %s: abandoned by the drain with a call in flight: it keeps its "
                        "lease until it lapses, and the call becomes unknown for the next "
                        "holder", rid, extra=fields(run_id=rid))

    async def _wait_unless_hurried(
        self, tasks: Sequence[asyncio.Future[Any]], timeout: float,
    ) -> tuple[set[asyncio.Future[Any]], set[asyncio.Future[Any]]]:
        """``asyncio.wait(tasks, timeout=timeout)``, ended early by a second stop request."""
        if not self._hurry.is_set():
            every = asyncio.ensure_future(asyncio.wait(tasks))
            hurry = asyncio.ensure_future(self._hurry.wait())
            try:
                await asyncio.wait([every, hurry], timeout=timeout,
                                   return_when=asyncio.FIRST_COMPLETED)
            finally:
                for waiter in (every, hurry):
                    waiter.cancel()
        return {t for t in tasks if t.done()}, {t for t in tasks if not t.done()}


async def fail_unreadable(database: Database, metrics: Metrics, claim: dict[str, Any],
                          exc: Exception) -> None:
    """End a run this code cannot decode or replay: ``failed`` with ``RUN_UNREADABLE``, its
    ``run.failed`` entry and an incident with the decoder's complaint. A run may not end
    while an operation of it was dispatched without an outcome (C5): as a replay would,
    such operations become ``unknown`` and go to the reconciliation queue, and the run
    waits for them (``needs_reconciliation``); once they are settled, it is claimed again
    and fails here."""
    run_id, token = claim["id"], claim["lease_token"]
    error = RunUnreadable("a value stored for this run cannot be decoded by this worker "
                          "(see the incident)")
    diagnostics = {"type": type(exc).__name__, "message": storable(str(exc)[:2000])}

    async def end(conn: Conn) -> bool:
        await incident_record(conn, {
            "ref": error.incident, "code": error.code, "run_id": run_id,
            "operation_id": None, "phase": "decode", "cause": type(exc).__name__,
            "upstream_status": None, "detail": json.dumps(diagnostics)})
        settled = strand_entries(await ops_db.operation_strand(
            conn, run_id=run_id, token=token, error=STRANDED_ERROR))
        if await ops_db.operation_count_unknown(conn, run_id=run_id):
            if settled:
                await journal_db.journal_append(
                    conn, run_id=run_id, token=token, expected=claim["revision"],
                    events=settled)
            await runs_db.run_block_for_reconciliation(
                conn, run_id=run_id, token=token,
                waiting_for=f"reconciliation of its unsettled operations; then it fails: "
                            f"{error.code} (incident {error.incident})")
            return False
        await journal_db.journal_append(
            conn, run_id=run_id, token=token, expected=claim["revision"],
            events=[*settled, entry(EventKind.RUN_FAILED, None, None, {
                "code": error.code, "message": error.message, "incident": error.incident})])
        await runs_db.run_finish(conn, run_id=run_id, token=token, status="failed",
                                 outcome_code=error.code, result=None,
                                 error=json.dumps(error.to_dict()))
        return True

    said = fields(run_id=run_id, workflow=_workflow(claim), code=error.code,
                  incident=error.incident, cause=type(exc).__name__)
    try:
        ended = await database.run_in_transaction(end)
    except (LeaseLost, DatabaseError) as lost:
        log.warning("run %s: %s, but its failure could not be written (%s)", run_id,
                    error.code, lost.code, extra=said)
        return
    if not ended:
        log.error("run %s: %s (incident %s: %s); it waits for the reconciliation of its "
                  "unsettled operations first", run_id, error.code, error.incident,
                  type(exc).__name__, extra=said)
        return
    metrics.incr("runs_failed")
    log.error("run %s failed: %s (incident %s: %s); this worker goes on", run_id,
              error.code, error.incident, type(exc).__name__, extra=said)


def _runs(count: int) -> str:
    return f"{count} run" if count == 1 else f"{count} runs"


def _workflow(claim: dict[str, Any]) -> str:
    return f"{claim['workflow_name']}@{claim['workflow_version']}"
