"""The chaos harness: real workers and a reconciler, many runs, random faults, then the truth.

One :class:`Harness` run:

1. plans ``runs`` workflow runs from the seed (which workflow, which steps, which tool calls
   misbehave and how, which events are sent when, which runs get cancelled);
2. starts ``workers`` worker processes and one reconciler against the orchestrator database,
   and submits the runs (with idempotency keys, retried through outages), sends their events
   and cancellations on schedule;
3. meanwhile injects a fault every ``fault_interval`` seconds on average (exponentially
   distributed): SIGKILL of a worker or of the reconciler, a worker drained and restarted with
   a fault point armed (it SIGKILLs itself at that point on the effect path), SIGSTOP of a
   worker past its lease then SIGCONT, ``pg_terminate_backend`` of a share of the
   orchestrator's connections, and a restart (fast or immediate) of the PostgreSQL cluster when
   the harness started that cluster itself. At least one worker is always left healthy;
4. stops the faults, resumes anything paused, sends every pending event and waits until the
   system is quiescent (nothing queued, running or due; no lookup pending);
5. checks the invariants (:mod:`tests.chaos.checks`), then acts as the operator for every
   operation listed for operators (deciding from the sink's evidence), waits again, checks
   again and prints the table.

The faults, and everything done to each process, are logged with wall-clock times so that
every unknown operation can be matched with a fault in its dispatch window.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import json
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row

from orchestrator import Orchestrator, OrchestratorError
from orchestrator.errors import DatabaseError
from tests.chaos import app as chaos_app
from tests.chaos import checks, sink
from tests.chaos.cluster import PrivateCluster

ROOT = Path(__file__).resolve().parents[2]
# Where worker and reconciler processes import ``orchestrator`` from: the work tree, or a
# snapshot of a committed engine made by ``python -m tests.chaos --engine REF``.
ENGINE_DIR = Path(os.environ.get("CHAOS_ENGINE_DIR") or ROOT)
APP = "tests.chaos.app:app"
HARNESS_APP_NAME = "chaos-harness"
FAULT_POINTS = ("after_intent", "after_submitted", "after_tool_return", "after_receipt")
MAX_ATTEMPTS = {"pay": 3, "ship": 2, "notify": 3, "index": 4, "fetch": 3}
DEFAULT_FAULT_WEIGHTS = {
    "worker_kill": 20,
    "worker_fault_point": 14,
    "worker_stop": 10,
    "reconciler_kill": 6,
    "terminate_backends": 20,
    "postgres_restart": 4,
}
WORKFLOW_WEIGHTS = {"checkout": 30, "approval": 20, "fanout": 20, "parent": 15, "retrying": 15,
                    "looping": 10}
OPERATOR = "chaos-operator"


@dataclass
class Config:
    runs: int = 150
    seed: int | None = None
    workers: int = 3
    concurrency: int = 8
    fault_interval: float = 0.5
    duration: float | None = None  # the fault phase lasts at least this long; paces submission
    lease_ttl: float = 3.0
    max_in_flight: int = 80
    tool_fault_rate: float = 0.15
    cancel_rate: float = 0.03
    fault_weights: dict[str, int] = field(default_factory=lambda: dict(DEFAULT_FAULT_WEIGHTS))
    postgres_restart_spacing: float = 15.0
    fault_points: tuple[str, ...] = FAULT_POINTS  # where an armed worker kills itself ...
    fault_tools: tuple[str | None, ...] = (None, "pay", "ship", "notify", "index", "fetch")
    unsafe_redispatch: bool = False  # the test-only switch: the no-redispatch guard disabled
    workflows: dict[str, int] = field(default_factory=lambda: dict(WORKFLOW_WEIGHTS))
    quiesce_timeout: float = 240.0
    max_tail: float = 120.0  # without duration: faults go on this long at most after submitting
    operator_rounds: int = 5
    # Runs planted among the others with an input no worker can decode (nested 3,000 deep,
    # an integer of 10,000 digits), as an older release or a hand-written INSERT could leave
    # them; each must fail alone (RUN_UNREADABLE) and no worker may die of one. The same
    # values are also offered through the API, which must refuse them.
    poison_runs: int = 0
    # More environment for every worker and reconciler process: e.g. the database through a
    # pooler (ORCHESTRATOR_DATABASE_URL, ORCHESTRATOR_POOLER, ORCHESTRATOR_LISTEN_URL) while
    # the harness itself stays on the server.
    process_env: dict[str, str] = field(default_factory=dict)

    def resolved_seed(self) -> int:
        if self.seed is None:
            self.seed = random.SystemRandom().randrange(1, 2**31)
        return self.seed


# -- plans ------------------------------------------------------------------------------------


@dataclass
class RunPlan:
    index: int
    key: str
    workflow: str
    steps: list[dict[str, Any]]
    events: list[tuple[float, str, Any, str | None]]  # (delay, name, payload, event key)
    cancel_after: float | None


def _call(rng: random.Random, cfg: Config, tool: str, sid: str) -> dict[str, Any]:
    step: dict[str, Any] = {"call": tool, "id": sid}
    if rng.random() < cfg.tool_fault_rate:
        choices = ["transient", "transient", "hang", "late", "error_after", "error_before"]
        if tool in ("notify", "index"):
            choices.append("resend_busy")
        fault = rng.choice(choices)
        step["fault"] = fault
        if fault == "transient":
            step["n"] = rng.randint(1, MAX_ATTEMPTS[tool])
        elif fault == "resend_busy":
            step["n"] = rng.randint(2, MAX_ATTEMPTS[tool])
        else:
            step["n"] = 1
    return step


def plan_runs(cfg: Config, seed: int) -> list[RunPlan]:
    rng = random.Random(seed)
    names, weights = zip(*cfg.workflows.items(), strict=True)
    plans = []
    for i in range(cfg.runs):
        wf = rng.choices(names, weights)[0]
        events: list[tuple[float, str, Any, str | None]] = []

        def call(tool: str, label: str, i: int = i) -> dict[str, Any]:
            return _call(rng, cfg, tool, f"{i}.{label}")

        if wf == "checkout":
            steps = [call("pay", "pay"), {"sleep": round(rng.uniform(0.2, 2.5), 2)},
                     call("notify", "notify")]
        elif wf == "approval":
            steps = [call("fetch", "fetch"),
                     {"event": "approve", "timeout": round(rng.uniform(2.0, 6.0), 2)},
                     call("ship", "ship")]
            how = rng.choice(["early", "late", "late", "twice", "never"])
            payload = {"approved": True, "run": i}
            if how == "early":
                events.append((0.0, "approve", payload, f"approve-{i}"))
            elif how == "late":
                events.append((rng.uniform(0.5, 6.0), "approve", payload, f"approve-{i}"))
            elif how == "twice":
                events.append((rng.uniform(0.0, 3.0), "approve", payload, f"approve-{i}"))
                events.append((rng.uniform(0.0, 4.0), "approve", payload, f"approve-{i}"))
            if rng.random() < 0.2:
                events.append((rng.uniform(0.0, 3.0), "unrelated", {"noise": i}, None))
        elif wf == "fanout":
            steps = [{"gather": [call("notify", "notify"), call("index", "index"),
                                 call("fetch", "fetch")]},
                     call("pay", "pay")]
        elif wf == "parent":
            steps = [{"child": [call("pay", "child-pay"), {"sleep": 0.5},
                                call("index", "child-index")], "id": f"{i}.child"},
                     call("ship", "ship")]
        elif wf == "looping":  # a few generations, each a new run (ctx.continue_as_new)
            steps = [{"generations": rng.randint(2, 4)}, call("pay", "pay"),
                     {"sleep": round(rng.uniform(0.1, 1.0), 2)}, call("index", "index")]
        else:  # retrying: not-applied transient errors, retried as new attempts
            first = call("pay", "pay")
            first.update(fault="transient", n=rng.randint(1, 2))
            second = call("notify", "notify")
            second.update(fault="transient", n=rng.randint(1, 3))
            steps = [first, second, call("index", "index")]
        cancel = rng.uniform(0.0, 5.0) if rng.random() < cfg.cancel_rate else None
        plans.append(RunPlan(i, f"chaos-{seed}-{i}", wf, steps, events, cancel))
    return plans


# -- processes --------------------------------------------------------------------------------


@dataclass
class Slot:
    role: str  # worker | reconciler
    index: int
    proc: subprocess.Popen[bytes] | None = None
    record: checks.ProcRecord | None = None
    armed: str | None = None
    arm_next: tuple[str, str | None] | None = None
    restart_at: float = 0.0
    generation: int = 0
    killed: bool = False
    stopped: bool = False

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Result:
    seed: int
    config: Config
    verdict: checks.Verdict
    first_verdict: checks.Verdict
    faults: Counter[str]
    timings: dict[str, float]
    text: str
    log_dir: Path

    @property
    def ok(self) -> bool:
        return self.verdict.ok and self.first_verdict.ok


class Harness:
    """See the module docstring. ``db_url``: the orchestrator's (migrated) database;
    ``sink_url``: the effect sink's database; ``cluster``: the private cluster that holds
    ``db_url``, if the harness started one (then, and only then, it restarts it)."""

    def __init__(self, cfg: Config, *, db_url: str, sink_url: str, log_dir: Path,
                 cluster: PrivateCluster | None = None,
                 out: Callable[[str], None] = print) -> None:
        self.cfg = cfg
        self.seed = cfg.resolved_seed()
        self.db_url = db_url
        self.sink_url = sink_url
        self.cluster = cluster
        self.log_dir = log_dir
        self.out = out
        self.rng = random.Random(self.seed * 7919 + 1)
        self.plans = plan_runs(cfg, self.seed)
        self.slots = [Slot("worker", i) for i in range(cfg.workers)] + [Slot("reconciler", 0)]
        self.records: list[checks.ProcRecord] = []
        self.draining: list[tuple[subprocess.Popen[bytes], checks.ProcRecord, float]] = []
        self.db_faults: list[checks.Interval] = []
        self.faults: Counter[str] = Counter()
        self.answers: Counter[str] = Counter()
        self.resolutions: Counter[str] = Counter()
        self.submitted: dict[str, uuid.UUID | None] = {p.key: None for p in self.plans}
        self.cancelled: set[uuid.UUID] = set()
        self.poison: set[uuid.UUID] = set()
        self.events: list[tuple[float, int, uuid.UUID, str, Any, str | None]] = []
        self.cancels: list[tuple[float, uuid.UUID]] = []
        self._seq = itertools.count()
        self.faulting = False
        self.stopping = False
        self.in_flight = 0
        self.last_restart = 0.0
        self.notes: list[str] = []
        self._conn: psycopg.AsyncConnection[dict[str, Any]] | None = None
        self._connecting = asyncio.Lock()
        self.client = Orchestrator(_with_app_name(db_url), default_owner=chaos_app.OWNER)
        self.client.registry = chaos_app.app.registry

    # -- the database, as the harness sees it --------------------------------------------

    async def sql(self, query: str, params: Any = None, *,
                  tries: int = 120) -> list[dict[str, Any]]:
        """Run one statement on the orchestrator database, reconnecting through outages."""
        for attempt in range(tries):
            conn = None
            try:
                # Background tasks call this concurrently: one of them (re)connects, the others
                # wait and share that connection (two connecting at once left one unclosed).
                async with self._connecting:
                    if self._conn is None or self._conn.closed:
                        self._conn = await psycopg.AsyncConnection.connect(
                            _with_app_name(self.db_url), autocommit=True, row_factory=dict_row,
                            connect_timeout=5)
                    conn = self._conn
                cur = await conn.execute(query, params)
                return await cur.fetchall() if cur.description else []
            except psycopg.OperationalError:
                if conn is not None:
                    with contextlib.suppress(Exception):
                        await conn.close()
                    if self._conn is conn:
                        self._conn = None
                if attempt == tries - 1:
                    raise
                await asyncio.sleep(0.5)
        raise AssertionError("unreachable")

    # -- processes -----------------------------------------------------------------------

    def _spawn(self, slot: Slot) -> None:
        extra: dict[str, str] = dict(self.cfg.process_env)
        if self.cfg.unsafe_redispatch:
            extra["ORCHESTRATOR_TEST_UNSAFE_REDISPATCH"] = "1"
        slot.armed = None
        if slot.arm_next is not None:
            point, tool = slot.arm_next
            extra["ORCHESTRATOR_FAULT_POINT"] = point
            if tool is not None:
                extra["ORCHESTRATOR_FAULT_TOOL"] = tool
            slot.armed = f"{point}:{tool or 'any'}"
            slot.arm_next = None
        env = process_env(self.db_url, self.sink_url, self.cfg.lease_ttl, extra)
        cmd = (worker_command(self.cfg.concurrency, self.cfg.lease_ttl)
               if slot.role == "worker" else reconciler_command())
        slot.generation += 1
        log = self.log_dir / f"{slot.name}-{slot.generation}.log"
        with open(log, "wb") as handle:
            slot.proc = subprocess.Popen(cmd, cwd=ENGINE_DIR, env=env, stdout=handle,
                                         stderr=subprocess.STDOUT, start_new_session=True)
        slot.record = checks.ProcRecord(slot.role, slot.proc.pid, time.time())
        self.records.append(slot.record)
        slot.killed = slot.stopped = False

    def _reap(self, slot: Slot, since: float) -> None:
        """Notice that ``slot``'s process ended; log why; schedule its replacement."""
        assert slot.proc is not None and slot.record is not None
        now = time.time()
        code = slot.proc.returncode
        slot.record.ended = now
        slot.record.exit_code = code
        if not slot.killed:
            if code == -signal.SIGKILL and slot.armed:
                kind = f"fault point {slot.armed.split(':')[0]}"
            else:
                kind = f"exit {code}"
            slot.record.faults.append(checks.Interval(since, now, kind))
            self.faults[f"{slot.role} died at a fault point" if slot.armed and code == -9
                        else f"{slot.role} exited by itself"] += 1
        slot.proc = None
        slot.record = None
        slot.restart_at = time.monotonic() + (self.rng.uniform(0.2, 1.2) if self.faulting
                                              else 0.2)

    async def _supervise(self) -> None:
        last = time.time()
        while not self.stopping:
            now = time.time()
            for slot in self.slots:
                if slot.proc is not None and slot.proc.poll() is not None:
                    self._reap(slot, last)
                if slot.proc is None and time.monotonic() >= slot.restart_at:
                    self._spawn(slot)
            for entry in list(self.draining):
                proc, record, began = entry
                if proc.poll() is not None:
                    record.ended = now
                    self.draining.remove(entry)
                elif now - began > 20:
                    record.faults.append(checks.Interval(now, now, "SIGKILL (drain too long)"))
                    proc.kill()
                    self.faults["worker drain overran: SIGKILL"] += 1
            last = now
            await asyncio.sleep(0.1)

    def _healthy_workers(self) -> list[Slot]:
        return [s for s in self.slots
                if s.role == "worker" and s.alive() and not s.stopped and not s.killed]

    # -- faults --------------------------------------------------------------------------

    async def _inject(self) -> None:
        kinds = [k for k, w in self.cfg.fault_weights.items() if w > 0]
        weights = [self.cfg.fault_weights[k] for k in kinds]
        if not kinds:
            return
        while self.faulting:
            mean = self.cfg.fault_interval
            await asyncio.sleep(min(max(self.rng.expovariate(1 / mean), 0.02), mean * 5))
            if not self.faulting:
                break
            kind = self.rng.choices(kinds, weights)[0]
            try:
                done = await asyncio.wait_for(self._fault(kind), 60)
            except Exception as exc:  # noqa: BLE001 - a fault that could not be injected
                done = f"not injected: {type(exc).__name__}: {exc}"
                self.notes.append(f"fault {kind} {done}")
            self._log_fault(kind, done)

    def _log_fault(self, kind: str, detail: str) -> None:
        with open(self.log_dir / "faults.jsonl", "a") as log:
            log.write(json.dumps({"t": time.time(), "kind": kind, "detail": detail}) + "\n")

    async def _fault(self, kind: str) -> str:
        """Inject one fault of ``kind`` (or a substitute); returns what was done."""
        now = time.time()
        healthy = self._healthy_workers()
        if kind.startswith("worker_") and len(healthy) < 2:
            kind = "terminate_backends"
        if kind == "postgres_restart" and (
                self.cluster is None
                or time.monotonic() - self.last_restart < self.cfg.postgres_restart_spacing):
            kind = "terminate_backends"
        if kind == "worker_kill":
            slot = self.rng.choice(healthy)
            assert slot.proc is not None and slot.record is not None
            slot.killed = True
            slot.record.faults.append(checks.Interval(now, now, "SIGKILL"))
            slot.proc.kill()
            self.faults["worker SIGKILL"] += 1
            return f"SIGKILL worker pid {slot.proc.pid}"
        elif kind == "worker_fault_point":
            slot = self.rng.choice(healthy)
            assert slot.proc is not None and slot.record is not None
            tool = self.rng.choice(self.cfg.fault_tools)
            slot.arm_next = (self.rng.choice(self.cfg.fault_points), tool)
            self.draining.append((slot.proc, slot.record, now))
            slot.proc.send_signal(signal.SIGTERM)  # drains; its replacement comes up armed
            slot.proc, slot.record = None, None
            slot.restart_at = time.monotonic()
            self.faults["worker drained, restarted with a fault point armed"] += 1
            return f"SIGTERM {self.draining[-1][0].pid}; next worker armed {slot.arm_next}"
        elif kind == "worker_stop":
            slot = self.rng.choice(healthy)
            assert slot.proc is not None and slot.record is not None
            pause = self.cfg.lease_ttl + self.rng.uniform(0.5, 2.5)
            interval = checks.Interval(now, now + pause, "SIGSTOP")
            slot.record.faults.append(interval)
            slot.stopped = True
            slot.proc.send_signal(signal.SIGSTOP)
            proc = slot.proc
            asyncio.get_running_loop().call_later(pause, self._resume, slot, proc, interval)
            self.faults["worker SIGSTOP past the lease, then SIGCONT"] += 1
            return f"SIGSTOP worker pid {proc.pid} for {pause:.2f} s"
        elif kind == "reconciler_kill":
            slot = self.slots[-1]
            if slot.alive():
                assert slot.proc is not None and slot.record is not None
                slot.killed = True
                slot.record.faults.append(checks.Interval(now, now, "SIGKILL"))
                slot.proc.kill()
                self.faults["reconciler SIGKILL"] += 1
                return f"SIGKILL reconciler pid {slot.proc.pid}"
            return "reconciler not running"
        elif kind == "terminate_backends":
            rows = await self.sql(
                "SELECT pid FROM pg_stat_activity WHERE datname = current_database() "
                "AND pid <> pg_backend_pid() AND backend_type = 'client backend' "
                "AND application_name <> %s", (HARNESS_APP_NAME,))
            share = self.rng.uniform(0.2, 1.0)
            victims = [r["pid"] for r in rows if self.rng.random() < share]
            if victims:
                await self.sql("SELECT pg_terminate_backend(pid) FROM unnest(%s::int[]) pid",
                               (victims,))
                self.db_faults.append(checks.Interval(now, time.time(), "terminate"))
                self.faults["connections terminated (pg_terminate_backend)"] += 1
                self.faults["connections terminated: backends in all"] += len(victims)
            return f"terminated {len(victims)} of {len(rows)} connections"
        elif kind == "postgres_restart":
            assert self.cluster is not None
            mode = self.rng.choice(["fast", "immediate"])
            began = time.time()
            try:
                await asyncio.to_thread(self.cluster.restart, mode)
            finally:
                self.db_faults.append(checks.Interval(began, time.time(), f"restart {mode}"))
                self.last_restart = time.monotonic()
            self.faults[f"PostgreSQL restart ({mode})"] += 1
            return f"restarted PostgreSQL ({mode})"
        raise ValueError(f"unknown fault kind {kind}")

    def _resume(self, slot: Slot, proc: subprocess.Popen[bytes],
                interval: checks.Interval) -> None:
        interval.end = max(interval.start, time.time())
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
        if slot.proc is proc:
            slot.stopped = False

    # -- load: submissions, events, cancellations ---------------------------------------

    async def _retrying(self, what: str, call: Callable[[], Any], limit: float = 180) -> Any:
        """Call through database outages; an answer that is not an outage (e.g. an event for
        a run that already finished) is counted, not retried."""
        give_up = time.monotonic() + limit
        while True:
            try:
                return await call()
            except (DatabaseError, psycopg.Error, OSError) as exc:
                if time.monotonic() > give_up:
                    self.notes.append(f"{what} gave up: {type(exc).__name__}: {exc}")
                    return None
                await asyncio.sleep(self.rng.uniform(0.1, 0.6))
            except OrchestratorError as exc:
                self.answers[f"{what.split()[0]} refused: {exc.code}"] += 1
                return None

    async def _plant_poison(self, number: int) -> None:
        """One run whose stored input no worker can decode, inserted as a hand-written
        statement would (the API refuses such input: checked first)."""
        deep = "[" * 3000 + "1" + "]" * 3000
        text = deep if number % 2 else '{"n": ' + "7" * 10_000 + "}"
        value: Any = {"n": 10**400} if number % 2 == 0 else json.loads("[" * 100 + "]" * 100)
        refused = await self._retrying(f"hostile submit {number}", lambda: (
            self.client.submit_async(chaos_app.WORKFLOWS["checkout"], value)))
        if refused is not None:
            self.notes.append(f"the API accepted hostile input {number}")
        rows = await self.sql(
            "INSERT INTO orchestrator.runs (id, tenant, principal, workflow_name, "
            "workflow_version, input, options, request_digest, idempotency_key, status, "
            "available_at) VALUES (gen_random_uuid(), %s, %s, 'checkout', '1', %s::jsonb, "
            "'{}'::jsonb, 'poison', %s, 'queued', now()) RETURNING id",
            (chaos_app.OWNER.tenant, chaos_app.OWNER.principal, text,
             f"poison-{self.seed}-{number}"))
        await self.sql("SELECT pg_notify('orchestrator_runs', '')")
        self.poison.add(rows[0]["id"])

    async def _submit_all(self) -> None:
        began = time.monotonic()
        every = max(len(self.plans) // self.cfg.poison_runs, 1) if self.cfg.poison_runs else 0
        for plan in self.plans:
            if every and plan.index % every == every // 2 and len(self.poison) < (
                    self.cfg.poison_runs):
                await self._plant_poison(len(self.poison))
            if self.cfg.duration:
                due = began + plan.index * self.cfg.duration / max(len(self.plans), 1)
                await asyncio.sleep(max(0.0, due - time.monotonic()))
            while self.in_flight >= self.cfg.max_in_flight:
                await asyncio.sleep(0.1)
            wf = chaos_app.WORKFLOWS[plan.workflow]

            async def submit(plan: RunPlan = plan, wf: Any = wf) -> Any:
                return await self.client.submit_async(wf, {"steps": plan.steps, "n": plan.index},
                                                      idempotency_key=plan.key)

            handle = await self._retrying(f"submit {plan.key}", submit)
            if handle is None:
                continue
            self.submitted[plan.key] = handle.id
            self.in_flight += 1
            at = time.monotonic()
            for delay, name, payload, key in plan.events:
                heapq.heappush(self.events, (at + delay, next(self._seq), handle.id, name,
                                             payload, key))
            if plan.cancel_after is not None:
                heapq.heappush(self.cancels, (at + plan.cancel_after, handle.id))

    async def _count_in_flight(self) -> None:
        while not self.stopping:
            rows = await self.sql("SELECT count(*) AS n FROM orchestrator.runs WHERE status IN "
                                  "('queued', 'running', 'waiting') AND parent_run_id IS NULL")
            self.in_flight = int(rows[0]["n"])
            await asyncio.sleep(0.5)

    async def _deliver(self, flush: bool = False) -> None:
        """Send due events and cancellations (all of them with ``flush``)."""
        while self.events and (flush or self.events[0][0] <= time.monotonic()):
            _, _, run_id, name, payload, key = heapq.heappop(self.events)

            async def send(run_id: uuid.UUID = run_id, name: str = name, payload: Any = payload,
                           key: str | None = key) -> bool:
                return await self.client.send_event_async(run_id, name, payload, event_key=key)

            await self._retrying(f"event {name} to {run_id}", send)
        while self.cancels and (flush or self.cancels[0][0] <= time.monotonic()):
            _, run_id = heapq.heappop(self.cancels)

            async def cancel(run_id: uuid.UUID = run_id) -> str:
                return await self.client.cancel_async(run_id)

            self.cancelled.add(run_id)
            await self._retrying(f"cancel {run_id}", cancel)

    async def _delivery_loop(self) -> None:
        while not self.stopping:
            await self._deliver()
            await asyncio.sleep(0.05)

    # -- quiescence and the operator -----------------------------------------------------

    async def _settled(self) -> tuple[bool, Counter[str]]:
        """True when nothing can move without an operator: every run is terminal, blocked on
        operations listed for operators, or waiting on a child that is itself settled."""
        runs = await self.sql("SELECT id, status, parent_run_id, available_at FROM "
                              "orchestrator.runs WHERE status NOT IN "
                              "('succeeded', 'failed', 'cancelled')")
        ops = await self.sql(
            "SELECT o.run_id, o.state, i.state AS item FROM orchestrator.operations o LEFT JOIN "
            "orchestrator.reconciliation_items i ON i.operation_id = o.id "
            "WHERE o.state IN ('pending', 'submitted', 'unknown')")
        counts = Counter(r["status"] for r in runs)
        blocked_ok: dict[Any, bool] = {}
        for op in ops:
            # Listed for operators; or unknown with no queue item at all, which nothing will
            # ever pick up (the checks report it): waiting longer changes nothing.
            fine = op["state"] == "unknown" and op["item"] in ("operator", None)
            blocked_ok[op["run_id"]] = blocked_ok.get(op["run_id"], True) and fine
        children: dict[Any, list[dict[str, Any]]] = {}
        for r in runs:
            if r["parent_run_id"] is not None:
                children.setdefault(r["parent_run_id"], []).append(r)

        def settled(run: dict[str, Any]) -> bool:
            if run["status"] == "needs_reconciliation":
                return blocked_ok.get(run["id"], False)
            if run["status"] == "waiting" and run["available_at"] is None:
                kids = children.get(run["id"], [])
                return bool(kids) and all(settled(k) for k in kids)
            return False

        return all(settled(r) for r in runs), counts

    async def _quiesce(self, phase: str) -> bool:
        give_up = time.monotonic() + self.cfg.quiesce_timeout
        stable = 0
        counts: Counter[str] = Counter()
        while time.monotonic() < give_up:
            await self._deliver(flush=True)
            done, counts = await self._settled()
            stable = stable + 1 if done else 0
            if stable >= 3:
                return True
            await asyncio.sleep(1.0)
        stuck = await self.sql(
            "SELECT r.id, r.status, r.waiting_for, r.available_at, (SELECT json_agg(json_build_"
            "array(o.id, o.state, i.state)) FROM orchestrator.operations o LEFT JOIN "
            "orchestrator.reconciliation_items i ON i.operation_id = o.id WHERE o.run_id = r.id"
            " AND o.state NOT IN ('committed', 'failed', 'not_applied')) AS ops FROM "
            "orchestrator.runs r WHERE r.status NOT IN ('succeeded', 'failed', 'cancelled') "
            "LIMIT 10")
        self.notes.append(f"{phase}: not quiescent after {self.cfg.quiesce_timeout:.0f} s: "
                          f"{dict(counts)}; e.g. {stuck}")
        return False

    async def _operate(self) -> int:
        """Resolve every operation listed for operators from the sink's evidence."""
        items = await self.sql(
            "SELECT i.operation_id, o.idempotency_key, o.tool_name FROM "
            "orchestrator.reconciliation_items i JOIN orchestrator.operations o ON "
            "o.id = i.operation_id WHERE i.state = 'operator' AND o.state = 'unknown' "
            "ORDER BY i.id")
        operators = self.client.operators
        for item in items:
            answer, receipt = await asyncio.to_thread(
                sink.operator_evidence, self.sink_url, item["idempotency_key"],
                item["tool_name"])
            op_id, key = item["operation_id"], item["idempotency_key"]

            async def resolve(op_id: int = op_id, key: str = key, answer: str = answer,
                              receipt: Any = receipt) -> str:
                if answer == "committed":
                    return await operators.resolve_committed(
                        op_id, receipt=receipt, operator=OPERATOR,
                        evidence=f"the provider applied key {key} as effect "
                                 f"{receipt['effect'] if receipt else '?'}")
                return await operators.resolve_not_applied(
                    op_id, operator=OPERATOR,
                    evidence=f"the provider has no effect for key {key}; the key is voided")

            await self._retrying(f"resolve operation {op_id}", resolve)
            self.resolutions[answer] += 1
        return len(items)

    # -- checks ----------------------------------------------------------------------------

    async def _verdict(self) -> checks.Verdict:
        # continued_from (migration 0015) read so that an older schema (--engine) answers too
        runs = await self.sql("SELECT id, workflow_name, status, outcome_code, error, revision, "
                              "parent_run_id, available_at, waiting_for, idempotency_key, "
                              "(to_jsonb(r) ->> 'continued_from')::uuid AS continued_from, "
                              # what a failure's incident kept: the traceback, in the report
                              "CASE WHEN status = 'failed' THEN (SELECT i.detail ->> "
                              "'traceback' FROM orchestrator.incidents i WHERE i.ref = "
                              "r.error ->> 'incident') END AS traceback "
                              "FROM orchestrator.runs r")
        journal = await self.sql("SELECT run_id, seq, kind, position, name, payload, "
                                 "lease_token, created_at FROM orchestrator.journal")
        ops = await self.sql("SELECT id, run_id, position, attempt, tool_name, effect_class, "
                             "state, idempotency_key, worker_id, submitted_at, receipt, "
                             "lease_token FROM orchestrator.operations")
        items = await self.sql("SELECT operation_id, state, reason, resolution FROM "
                               "orchestrator.reconciliation_items")
        found = await asyncio.to_thread(sink.load, self.sink_url)
        data = checks.Data(runs, journal, ops, items, found["calls"], found["effects"],
                           time.time())
        observed = checks.Observed(dict(self.submitted), list(self.records),
                                   list(self.db_faults), set(self.poison))
        return checks.verdict(data, observed, set(self.cancelled))

    # -- the whole run ---------------------------------------------------------------------

    async def run(self) -> Result:
        t0 = time.monotonic()
        self.out(f"chaos: seed {self.seed}; {self.cfg.runs} runs, {self.cfg.workers} workers, "
                 f"a fault every {self.cfg.fault_interval:g} s on average"
                 + (f", for at least {self.cfg.duration:g} s" if self.cfg.duration else "")
                 + ("; UNSAFE re-dispatch switch ON" if self.cfg.unsafe_redispatch else "")
                 + f"; logs in {self.log_dir}")
        self.log_dir.mkdir(parents=True, exist_ok=True)
        await asyncio.to_thread(sink.create, self.sink_url)
        background = [asyncio.ensure_future(c) for c in (
            self._supervise(), self._count_in_flight(), self._delivery_loop())]
        timings: dict[str, float] = {}
        try:
            self.faulting = True
            self._log_fault("phase", "faults start")
            injector = asyncio.ensure_future(self._inject())
            submitter = asyncio.ensure_future(self._submit_all())
            await submitter
            if self.cfg.duration:
                await asyncio.sleep(max(0.0, t0 + self.cfg.duration - time.monotonic()))
            else:  # keep faulting while submitted runs are still moving
                limit = time.monotonic() + self.cfg.max_tail
                await asyncio.sleep(1.0)
                while (self.in_flight > 0 or self.events) and time.monotonic() < limit:
                    await asyncio.sleep(0.5)
            self.faulting = False
            self._log_fault("phase", "faults stop")
            await injector
            timings["fault phase"] = time.monotonic() - t0
            await self._calm()
            await self._quiesce("after the faults")
            timings["quiescence"] = time.monotonic() - t0 - timings["fault phase"]
            first = await self._verdict()
            self.out("at quiescence, before any operator action:\n"
                     + checks.format_table(first))
            resolved = 0
            try:
                for _ in range(self.cfg.operator_rounds):
                    handled = await self._operate()
                    if not handled:
                        break
                    resolved += handled
                    await self._quiesce("after operator resolutions")
                verdict = await self._verdict() if resolved else first
            except Exception as exc:  # noqa: BLE001 - keep the first table; fail the run
                self.notes.append(f"the operator phase broke off: {type(exc).__name__}: {exc}")
                verdict = checks.Verdict(
                    [*first.rows, checks.Row("operator phase errors", 1, 0, [repr(exc)])],
                    first.stats)
            timings["total"] = time.monotonic() - t0
        finally:
            self.stopping = True
            self.faulting = False
            for task in background:
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
            await self._stop_processes()
            with contextlib.suppress(Exception):
                await self.client.database.close()
            if self._conn is not None:
                with contextlib.suppress(Exception):
                    await self._conn.close()
        text = self.report(first, verdict, timings, resolved)
        self.out(text)
        return Result(self.seed, self.cfg, verdict, first, self.faults, timings, text,
                      self.log_dir)

    async def _calm(self) -> None:
        """End of the fault phase: resume paused workers, replace armed ones, wait for any
        restart of the server to finish."""
        for slot in self.slots:
            if slot.proc is not None and slot.stopped:
                slot.proc.send_signal(signal.SIGCONT)
                slot.stopped = False
            if slot.alive() and slot.armed:
                assert slot.proc is not None and slot.record is not None
                self.draining.append((slot.proc, slot.record, time.time()))
                slot.proc.send_signal(signal.SIGTERM)
                slot.proc, slot.record = None, None
                slot.restart_at = time.monotonic()
        if self.cluster is not None:
            await asyncio.to_thread(self.cluster.wait_ready)
        give_up = time.monotonic() + 30
        while self.draining and time.monotonic() < give_up:
            await asyncio.sleep(0.2)

    async def _stop_processes(self) -> None:
        procs = [s.proc for s in self.slots if s.proc is not None]
        procs += [p for p, _, _ in self.draining]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.send_signal(signal.SIGTERM)
        give_up = time.monotonic() + 15
        while any(p.poll() is None for p in procs) and time.monotonic() < give_up:
            await asyncio.sleep(0.1)
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def report(self, first: checks.Verdict, final: checks.Verdict, timings: dict[str, float],
               resolved: int) -> str:
        lines = [
            "",
            f"chaos report: seed {self.seed}, {self.cfg.runs} runs submitted "
            f"({sum(1 for v in self.submitted.values() if v is not None)} accepted), "
            f"{self.cfg.workers} workers x {self.cfg.concurrency}, lease {self.cfg.lease_ttl:g} s,"
            f" fault interval {self.cfg.fault_interval:g} s"
            + ("; UNSAFE re-dispatch switch ON" if self.cfg.unsafe_redispatch else ""),
            "time: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()),
            "faults injected:",
        ]
        tool_faults = Counter(f for p in self.plans for s in _calls(p.steps)
                              if (f := s.get("fault")))
        for name, count in sorted(self.faults.items()):
            lines.append(f"  {name}: {count}")
        lines.append("  planned tool faults (calls): " + ", ".join(
            f"{k} {v}" for k, v in sorted(tool_faults.items())))
        lines.append("")
        lines.append("at quiescence, before any operator action:")
        lines.append(checks.format_table(first))
        if resolved:
            lines.append("")
            lines.append(f"after the harness resolved {resolved} operations as the operator "
                         "from the sink's evidence ("
                         + ", ".join(f"{k} {v}" for k, v in sorted(self.resolutions.items()))
                         + "):")
            lines.append(checks.format_table(final))
        lines.append("")
        if self.answers:
            lines.append("harness requests refused (expected: events or cancellations for "
                         "finished runs): " + ", ".join(f"{k} {v}" for k, v in
                                                         sorted(self.answers.items())))
        for key, value in final.stats.items():
            lines.append(f"{key}: {json.dumps(value, sort_keys=True, default=str)}")
        for note in self.notes[:20]:
            lines.append(f"note: {note}")
        lines.append(f"verdict: {'PASS' if first.ok and final.ok else 'FAIL'} (seed {self.seed})")
        return "\n".join(lines)


def process_env(db_url: str, sink_url: str, lease_ttl: float,
                extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a worker or reconciler process: no fault switch unless ``extra``
    sets one."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("ORCHESTRATOR_FAULT", "ORCHESTRATOR_TEST_UNSAFE"))}
    path = [str(ENGINE_DIR), str(ROOT)] if ENGINE_DIR != ROOT else [str(ROOT)]
    env.update({"ORCHESTRATOR_DATABASE_URL": db_url, sink.ENV_SINK_URL: sink_url,
                "PYTHONPATH": os.pathsep.join(path), "CHAOS_LEASE_TTL": str(lease_ttl)})
    env.update(extra or {})
    return env


def worker_command(concurrency: int, lease_ttl: float) -> list[str]:
    return [sys.executable, "-m", "orchestrator", "worker", "--app", APP,
            "--concurrency", str(concurrency), "--lease-ttl", str(lease_ttl)]


def reconciler_command() -> list[str]:
    return [sys.executable, "-m", "orchestrator", "reconciler", "--app", APP,
            "--max-lookups", "8", "--base-delay", "0.3"]


def _calls(steps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for step in steps:
        if "call" in step:
            out.append(step)
        out += _calls(step.get("gather", []) + step.get("child", []))
    return out


def _with_app_name(url: str) -> str:
    return url + ("&" if "?" in url else "?") + f"application_name={HARNESS_APP_NAME}"
