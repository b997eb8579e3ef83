"""The chaos suite's limits profile: queue and tool limits while workers are killed and paused.

``python -m tests.chaos.limits [--seed S] [--scale F]`` (and ``test_chaos.py``'s short run).
Real worker processes (:mod:`tests.chaos.limits_app`) drain runs in three queues (concurrency
3; one run per key over 20 keys; 50 starts per second) and runs calling a tool limited to 2
calls in flight and 20 dispatches per second, while a worker is SIGKILLed (and started again)
or SIGSTOPped past its lease (then SIGCONTed) every ``fault_interval`` seconds on average, one
worker always left alone. At the end every run must have succeeded, and an independent sink,
timestamping every effect by its own clock, must show:

- ``capped``: no moment with more than 3 runs between their first ``begin`` effect and their
  ``end`` effect;
- ``keyed``: no moment with more than 1 run of a key between those effects;
- ``rated``: no one-second window with more than 50 starts (the database's ``started_at``,
  the moment the limit is enforced on; the sink's first effects are reported beside it, later
  by each run's claim-to-call time);
- ``api``: no moment with more than 2 calls in flight at the provider and no one-second window
  with more than 20 calls begun. A call counts from its start to its end; one its worker was
  killed in, until its hold time has passed. The provider here runs inside the worker, so a
  call its worker was paused in is frozen with it; it counts for at most the tool's timeout,
  which is how long the engine counts a lost call as in flight (docs/flow.md), as a real
  provider, not paused with its caller, would have finished by then.

The table prints each limit beside the sink's measured maximum.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import signal
import subprocess
import sys
import time
import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row

from orchestrator import Orchestrator, Owner
from tests import dbtools
from tests.chaos import limits_app
from tests.chaos.environment import migrate_to_head

ROOT = Path(__file__).resolve().parents[2]
ENGINE_DIR = Path(os.environ.get("CHAOS_ENGINE_DIR") or ROOT)
KEYS = 20


@dataclass
class LimitsConfig:
    seed: int | None = None
    workers: int = 3
    concurrency: int = 8
    capped: int = 60
    keyed: int = 120
    rated: int = 300
    api: int = 120
    fault_interval: float = 1.5
    lease_ttl: float = 3.0
    timeout: float = 300.0

    def scaled(self, factor: float) -> LimitsConfig:
        return LimitsConfig(self.seed, self.workers, self.concurrency,
                            max(1, int(self.capped * factor)), max(1, int(self.keyed * factor)),
                            max(1, int(self.rated * factor)), max(1, int(self.api * factor)),
                            self.fault_interval, self.lease_ttl, self.timeout)


@dataclass
class Row:
    limit: str
    allowed: int
    measured: int
    note: str = ""

    @property
    def ok(self) -> bool:
        return self.measured <= self.allowed


@dataclass
class LimitsResult:
    rows: list[Row]
    runs: int
    succeeded: int
    faults: dict[str, int]
    seed: int
    text: str = ""
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.succeeded == self.runs and all(r.ok for r in self.rows)


def most_at_once(intervals: Iterable[tuple[datetime, datetime]]) -> int:
    """The most intervals ``[start, end)`` that overlap at any moment."""
    edges = sorted([(s, 1) for s, _ in intervals] + [(e, -1) for _, e in intervals],
                   key=lambda edge: (edge[0], edge[1]))
    now = peak = 0
    for _, step in edges:
        now += step
        peak = max(peak, now)
    return peak


def most_in_window(times: Iterable[datetime], window: timedelta) -> int:
    """The most of ``times`` inside any window ``[t, t + window)``."""
    at = sorted(times)
    best = j = 0
    for i, t in enumerate(at):
        while at[j] <= t - window:
            j += 1
        best = max(best, i - j + 1)
    return best


class Workers:
    """The worker processes, their faults, and a log of what was done to each."""

    def __init__(self, cfg: LimitsConfig, db_url: str, sink_url: str, log_dir: Path) -> None:
        self.cfg = cfg
        self.env = {**os.environ, "ORCHESTRATOR_DATABASE_URL": db_url,
                    "CHAOS_SINK_URL": sink_url, "CHAOS_LEASE_TTL": str(cfg.lease_ttl),
                    "PYTHONPATH": os.pathsep.join([str(ENGINE_DIR), str(ROOT)])}
        self.log_dir = log_dir
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * cfg.workers
        self.stopped: set[int] = set()
        self.faults: dict[str, int] = defaultdict(int)

    def start(self, i: int) -> None:
        with (self.log_dir / f"worker-{i}.log").open("ab") as out:  # the child keeps its own
            self.procs[i] = subprocess.Popen(
                [sys.executable, "-m", "orchestrator", "worker", "--app",
                 "tests.chaos.limits_app:app", "--concurrency", str(self.cfg.concurrency)],
                env=self.env, stdout=out, stderr=subprocess.STDOUT, cwd=str(ENGINE_DIR))

    def start_all(self) -> None:
        for i in range(self.cfg.workers):
            self.start(i)

    async def fault(self, rng: random.Random) -> None:
        """Kill or pause one worker, never the last one left alone (worker 0)."""
        i = rng.randrange(1, self.cfg.workers)
        proc = self.procs[i]
        if proc is None or i in self.stopped:
            return
        if rng.random() < 0.6:
            proc.kill()
            proc.wait()
            self.faults["worker killed"] += 1
            await asyncio.sleep(0.3)
            self.start(i)
        else:
            proc.send_signal(signal.SIGSTOP)
            self.stopped.add(i)
            self.faults["worker paused past its lease"] += 1
            await asyncio.sleep(self.cfg.lease_ttl + rng.uniform(0.5, 2.0))
            proc.send_signal(signal.SIGCONT)
            self.stopped.discard(i)

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGCONT)
                    proc.terminate()
        for proc in self.procs:
            if proc is not None:
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()


async def run_profile(cfg: LimitsConfig, *, db_url: str, sink_url: str, log_dir: Path,
                      out: Any = print) -> LimitsResult:
    seed = cfg.seed if cfg.seed is not None else random.SystemRandom().randrange(1, 2**31)
    rng = random.Random(seed)
    out(f"chaos limits: seed {seed}; runs: capped {cfg.capped}, keyed {cfg.keyed} over {KEYS} "
        f"keys, rated {cfg.rated}, api {cfg.api}; {cfg.workers} workers × {cfg.concurrency}")
    log_dir.mkdir(parents=True, exist_ok=True)
    with psycopg.connect(sink_url, autocommit=True) as conn:
        conn.execute(limits_app.DDL)
    submitter = Orchestrator(db_url, default_owner=Owner(tenant="chaos", principal="limits"))
    for name in ("capped", "keyed", "rated"):
        submitter.queue(name)  # declared for submitting; the workers store the real limits
    for wf in ("capped", "keyed", "rated", "calls_api"):
        queue = None if wf == "calls_api" else wf

        async def body(ctx: Any, data: Any) -> Any:  # never run here
            raise AssertionError

        submitter.workflow(name=wf, queue=queue)(body)
    plans: list[tuple[str, dict[str, Any], str | None]] = []
    plans += [("capped", {"hold": rng.uniform(0.05, 0.3)}, None) for _ in range(cfg.capped)]
    plans += [("keyed", {"hold": rng.uniform(0.05, 0.2)}, f"key-{rng.randrange(KEYS)}")
              for _ in range(cfg.keyed)]
    plans += [("rated", {}, None) for _ in range(cfg.rated)]
    plans += [("calls_api", {}, None) for _ in range(cfg.api)]
    rng.shuffle(plans)
    workers = Workers(cfg, db_url, sink_url, log_dir)
    workers.start_all()
    started = time.monotonic()
    keys: dict[uuid.UUID, str | None] = {}
    kinds: dict[uuid.UUID, str] = {}
    try:
        async def submit_all() -> None:
            for i, (wf, data, key) in enumerate(plans):
                handle = await submitter.submit_async(
                    wf, data, idempotency_key=f"limits-{seed}-{i}", concurrency_key=key)
                keys[handle.id], kinds[handle.id] = key, wf
                if i % 20 == 19:
                    await asyncio.sleep(0.05)

        submitting = asyncio.ensure_future(submit_all())
        deadline = time.monotonic() + cfg.timeout
        while True:
            await asyncio.sleep(rng.expovariate(1 / cfg.fault_interval))
            if submitting.done():
                submitting.result()
                left = await _unfinished(db_url)
                if left == 0:
                    break
                if time.monotonic() > deadline:
                    out(f"chaos limits: {left} runs unfinished after {cfg.timeout:.0f} s")
                    break
            await workers.fault(rng)
    finally:
        workers.stop_all()
        await submitter.database.close()
    elapsed = time.monotonic() - started
    result = await _measure(cfg, db_url, sink_url, keys, kinds, dict(workers.faults), seed)
    result.extra["seconds"] = elapsed
    result.text = report(result)
    out(result.text)
    return result


async def _unfinished(db_url: str) -> int:
    async with await psycopg.AsyncConnection.connect(db_url, autocommit=True) as conn:
        cur = await conn.execute(
            "SELECT count(*) FROM orchestrator.runs "
            "WHERE status NOT IN ('succeeded', 'failed', 'cancelled')")
        row = await cur.fetchone()
    return int(row[0]) if row else 0


async def _measure(cfg: LimitsConfig, db_url: str, sink_url: str,
                   keys: dict[uuid.UUID, str | None], kinds: dict[uuid.UUID, str],
                   faults: dict[str, int], seed: int) -> LimitsResult:
    with psycopg.connect(db_url, row_factory=dict_row) as conn:
        runs = conn.execute("SELECT id, status, started_at FROM orchestrator.runs").fetchall()
    with psycopg.connect(sink_url, row_factory=dict_row) as conn:
        effects = conn.execute("SELECT run_id, phase, at FROM limit_effects").fetchall()
        calls = conn.execute("SELECT started_at, ended_at FROM limit_calls").fetchall()
    marks: dict[uuid.UUID, dict[str, datetime]] = defaultdict(dict)
    for e in effects:
        marks[e["run_id"]][e["phase"]] = e["at"]

    def spans(kind: str) -> list[tuple[uuid.UUID, datetime, datetime]]:
        return [(rid, m["begin"], m["end"]) for rid, m in marks.items()
                if kinds.get(rid) == kind and "begin" in m and "end" in m]

    by_key: dict[str | None, list[tuple[datetime, datetime]]] = defaultdict(list)
    for rid, begin, end in spans("keyed"):
        by_key[keys[rid]].append((begin, end))
    second = timedelta(seconds=1)
    hold = timedelta(seconds=limits_app.API_HOLD)
    rated_db = [r["started_at"] for r in runs if kinds.get(r["id"]) == "rated"
                and r["started_at"] is not None]
    rated_sink = [m["begin"] for rid, m in marks.items() if kinds.get(rid) == "rated"
                  and "begin" in m]
    rows = [
        Row("capped: runs at once (concurrency)", limits_app.CAPPED,
            most_at_once([(b, e) for _, b, e in spans("capped")])),
        Row("keyed: runs of one key at once", 1,
            max((most_at_once(v) for v in by_key.values()), default=0)),
        Row("rated: starts in any 1 s (runs.started_at)", limits_app.RATED,
            most_in_window(rated_db, second),
            f"first effects in the sink: {most_in_window(rated_sink, second)} in any 1 s"),
        Row("api: calls in flight at the provider", limits_app.API_CONCURRENCY,
            most_at_once([(c["started_at"],
                           min(c["ended_at"] or c["started_at"] + hold,
                               c["started_at"] + limits_app.API_TIMEOUT))
                          for c in calls])),
        Row("api: calls begun in any 1 s", limits_app.API_RATE,
            most_in_window([c["started_at"] for c in calls], second)),
    ]
    succeeded = sum(1 for r in runs if r["status"] == "succeeded")
    return LimitsResult(rows, len(kinds), succeeded, faults, seed,
                        extra={"api_calls": len(calls)})


def report(result: LimitsResult) -> str:
    lines = ["", "limit                                          allowed  measured  verdict",
             "---------------------------------------------  -------  --------  -------"]
    for r in result.rows:
        lines.append(f"{r.limit:<45}  {r.allowed:>7}  {r.measured:>8}  "
                     f"{'holds' if r.ok else 'BROKEN'}" + (f"  ({r.note})" if r.note else ""))
    lines.append(f"runs: {result.succeeded} of {result.runs} succeeded; api calls sent "
                 f"{result.extra.get('api_calls')} (re-sends after a lost worker included); "
                 "faults: " + ", ".join(f"{n} {k}" for k, n in sorted(result.faults.items())))
    lines.append(f"verdict: {'PASS' if result.ok else 'FAIL'} (seed {result.seed})")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos.limits",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--scale", type=float, default=1.0,
                        help="multiply every run count (default 1)")
    parser.add_argument("--fault-interval", type=float, default=1.5)
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--keep-databases", action="store_true",
                        help="leave the engine's and the sink's databases for inspection")
    args = parser.parse_args(argv)
    cfg = LimitsConfig(seed=args.seed, fault_interval=args.fault_interval).scaled(args.scale)
    admin = dbtools.choose_server().admin_url
    db_name, sink_name = dbtools.unique_name("limits"), dbtools.unique_name("limitssink")
    db_url = dbtools.create_database(admin, db_name)
    sink_url = dbtools.create_database(admin, sink_name)
    try:
        migrate_to_head(db_url)
        log_dir = args.log_dir or Path(f"/tmp/chaos-limits-{os.getpid()}")
        result = asyncio.run(run_profile(cfg, db_url=db_url, sink_url=sink_url,
                                         log_dir=log_dir))
    finally:
        if args.keep_databases:
            print(f"chaos limits: kept the databases: {db_url} and {sink_url}")
        else:
            for name in (db_name, sink_name):
                with contextlib.suppress(Exception):
                    dbtools.drop_database(admin, name)
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
