"""The benchmark suite: ``python -m bench.run`` (or ``make bench``). Prints one table per
section and appends every figure to ``bench/results/results.jsonl``.

Sections (``--sections a,b``; default: all):

  ceiling     pgbench, one single-row INSERT per commit, at 1, 4 and 16 clients
  throughput  N runs of K = 1, 3, 10 trivial consequential steps, W worker processes
  floor       the same runs driven through the engine's writes alone (bench/floor.py), each
              repetition beside one of ours: what the engine's own Python costs on top
  batches     the floor's writes in group commits of 1 to 64 writes: CPU per batch and per write,
              server and writer (why a stream's small batches cost more per step than a drain)
  peers       DBOS (K = 3, 10), PgQueuer and Procrastinate (no-op jobs), matched concurrency
  latency     submit → first step, submit → result, K = 1, idle (ours and the peers), and ours
              again while another process submits K = 3 runs at 30% of the drain rate
  scale       throughput (K = 3) and latency again with 1,000,000 finished runs in the tables
  recovery    SIGKILL a worker holding 100 in-flight runs: time until they run elsewhere
  memory      one worker's peak RSS draining 10,000 queued runs at concurrency 100
  profile     py-spy samples of one worker during a K = 3 throughput drain
  bulk        `orchestrator ops resolve-many` on 200 unknown operations: seconds, audit rows
  console     a committed journal entry reaching the console's Server-Sent Events clients
              (GET /api/runs/{id}/events, `orchestrator console` in its own process): p50, p99
  telemetry   K = 3 throughput and first-step latency with the workers' /metrics served and
              scraped every second, and with OpenTelemetry tracing (SDK, spans dropped), beside
              the same without either, interleaved
  queues      K = 3 throughput in a queue whose limit never binds beside the default queue,
              interleaved; a binding concurrency limit's utilisation; a start rate's accuracy
  retention   `orchestrator prune` over the scale section's history (1,000,000 finished runs),
              timed, with K = 3 drains beside it in the same database: their throughput
              during the prune ÷ before and after
  pooler      K = 3 throughput and first-step latency through PgBouncer in transaction mode,
              with listen_url and polling, beside direct, interleaved (bench/pooler.py)
  hosts       K = 3 throughput with one worker in each of 1, 2 and 4 network namespaces (hosts)
              against one server, and the server's CPU per step (needs root; bench/hosts.py);
              then the pooler section's comparison (unless it runs too) and a failover: seconds
              from a primary's death to the first step on the promoted standby and to every
              in-flight run running again (bench/failover.py)

Every figure is the median of ``--reps`` repetitions. Every rate is also printed as a ratio to
the 16-client pgbench ceiling measured in the same run (measured briefly even when the ceiling
section is not selected), latencies as multiples of one single-client commit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

from bench import (
    batches,
    bulk,
    console_load,
    console_pages,
    console_seed,
    flow,
    ours,
    peers,
    pooler,
    scale,
)
from bench import ceiling as ceiling_mod
from bench import console as console_mod
from bench.common import (
    Server,
    Table,
    append_result,
    engine_state,
    fmt,
    fx,
    git_commit,
    log,
    machine_info,
    median,
    migrate,
    ms,
    ratio,
    snapshot_engine,
)
from bench.peers import dbos_peer
from bench.profile import py_spy

CPU_FIGURES = ("worker_cpu_us_per_step", "server_cpu_us_per_step", "worker_sys_us_per_step",
               "server_sys_us_per_step", "machine_busy")


def median_of(reps: list[dict[str, Any]], key: str) -> float | None:
    """The median of a figure over repetitions, of those that measured it."""
    values = [r[key] for r in reps if r.get(key) is not None]
    return median(values) if values else None


def split_note(lat: dict[str, Any]) -> str:
    """Where a first step's time went (p50 of each part; they need not add up to the
    whole's p50): the submission's commit, from it to the workflow body's start (the news,
    a busy worker's claim gap, the claim's commit, the run's executor), and from there to the
    tool's start (the write-ahead's wait for the group writer and its commit)."""
    if "submit_p50" not in lat:
        return "no split"
    return (f"split p50: submit {ms(lat['submit_p50'])}, to the body "
            f"{ms(lat['to_body_p50'])}, body to the call {ms(lat['body_to_call_p50'])} ms")


def cpu_note(lat: dict[str, Any]) -> str:
    """The CPU used while the latency samples ran (bench.ours.cores_used), for a table note."""
    parts = [f"{label} {lat[key]:.2f}" for key, label in (
        ("cores_workers", "workers"), ("cores_server", "server"),
        ("cores_load", "load process"), ("cores_driver", "this driver"))
        if lat.get(key) is not None]
    if not parts:
        return "CPU not measured"
    return f"cores used meanwhile: {', '.join(parts)}; machine busy {pct(lat.get('machine_busy'))}"


def pct(share: float | None) -> str:
    return "—" if share is None else f"{share:.0%}"


SECTIONS = ("ceiling", "throughput", "floor", "batches", "peers", "latency", "scale", "recovery",
            "memory", "profile", "bulk", "console", "telemetry", "queues", "retention",
            "pooler", "hosts")


@dataclass
class Plan:
    """Sizes for one invocation; ``--quick`` shrinks everything to a smoke run."""

    reps: int
    ceiling_seconds: float
    clients: tuple[int, ...]
    runs: dict[int, int]
    workers: int
    concurrency: int
    pool_size: int
    latency_samples: int
    scale_rows: int
    recovery_runs: int
    recovery_lease_ttl: float | None
    memory_runs: int
    memory_concurrency: int
    pgqueuer_min_jobs: int
    pgqueuer_batches: tuple[int, ...]
    # The submitting process shares the machine: at half the drain rate its own CPU left the
    # workers short on 2 cores and the backlog grew without bound.
    load_fraction: float = 0.3
    batch_sizes: tuple[int, ...] = (1, 4, 16, 64)  # the batches section's group commit sizes
    batch_runs: int = 512  # K=3 runs per batches measurement (2,048 writes)
    bulk_items: int = 200  # unknown operations one `ops resolve-many` resolves
    console_steps: int = 200  # tool calls of the run the console's SSE clients follow
    console_clients: int = 10  # SSE clients following it
    console_rows: int = 1_000_000  # finished runs behind the console's pages
    console_page_requests: int = 100  # timed requests of each page
    console_sse_clients: int = 200  # SSE clients beside a K=3 drain
    # K=3 runs of each drain beside them: some seconds of drain, so that the clients' and the
    # console's start does not decide the rate
    console_sse_runs: int = 12_000
    console_sse_rounds: int = 5  # drains with and without the clients, each
    console_parts: tuple[str, ...] = ("latency", "pages", "sse")
    # K=3 runs of each telemetry drain: about ten seconds, so that the steady state decides
    # its rate; with 1,000 runs (a second and a half) a drain held two scrapes, both in the
    # worker's first seconds (lazy imports, first connections), and the arms' order mattered
    # more than telemetry did.
    telemetry_runs: int = 20_000
    queue_runs: int = 6_000  # K=3 runs of each queues drain (default queue, then a queue)
    queue_cap: int = 8  # the binding concurrency limit (fewer than the workers' slots)
    queue_cap_runs: int = 400  # runs holding a slot for queue_hold seconds each: 5 s ideal
    queue_hold: float = 0.1
    queue_rate: int = 100  # starts per second of the rated drain
    queue_rate_runs: int = 800  # 8 s at the rate
    retention_runs: int = 6_000  # K=3 runs of each drain beside the prune
    hosts_runs: int = 3_000  # K=3 runs of each hosts drain
    hosts_counts: tuple[int, ...] = (1, 2, 4)  # namespaces, one worker in each
    profile_stacks: str | None = None  # where the profile section copies py-spy's stacks
    quick: bool = False


def plan_from(args: argparse.Namespace) -> Plan:
    if args.quick:
        plan = Plan(reps=1, ceiling_seconds=2, clients=(1, 4, 16),
                    runs={1: 200, 3: 150, 10: 50}, workers=2, concurrency=32, pool_size=16,
                    latency_samples=40, scale_rows=20_000, recovery_runs=100,
                    recovery_lease_ttl=3.0, memory_runs=1_000, memory_concurrency=100,
                    pgqueuer_min_jobs=5_000, pgqueuer_batches=(10,), batch_sizes=(1, 8, 64),
                    batch_runs=128, console_steps=40, console_clients=2,
                    console_rows=20_000, console_page_requests=10, console_sse_clients=20,
                    console_sse_runs=500, console_sse_rounds=1, telemetry_runs=300,
                    queue_runs=300, queue_cap_runs=80, queue_rate_runs=300,
                    retention_runs=300, hosts_runs=300, quick=True)
    else:
        plan = Plan(reps=3, ceiling_seconds=10, clients=(1, 4, 16),
                    runs={1: 1_500, 3: 1_000, 10: 400}, workers=2, concurrency=32, pool_size=16,
                    latency_samples=200, scale_rows=1_000_000, recovery_runs=100,
                    recovery_lease_ttl=None, memory_runs=10_000, memory_concurrency=100,
                    pgqueuer_min_jobs=20_000, pgqueuer_batches=(10, 100))
    for name in ("reps", "workers", "concurrency", "scale_rows", "latency_samples",
                 "memory_runs", "recovery_runs", "console_steps", "console_clients",
                 "console_rows", "console_page_requests", "console_sse_clients",
                 "console_sse_runs", "console_sse_rounds", "telemetry_runs"):
        value = getattr(args, name)
        if value is not None:
            setattr(plan, name, value)
    if args.runs is not None:
        plan.runs = {k: args.runs for k in plan.runs}
    if args.lease_ttl is not None:
        plan.recovery_lease_ttl = args.lease_ttl
    if args.load_fraction is not None:
        if not 0 < args.load_fraction < 1:
            raise SystemExit(f"--load-fraction {args.load_fraction:g}: give a share of the drain "
                             "rate between 0 and 1, such as 0.1")
        plan.load_fraction = args.load_fraction
    plan.profile_stacks = args.profile_stacks
    if args.console_parts is not None:
        plan.console_parts = tuple(x.strip() for x in args.console_parts.split(",") if x.strip())
    return plan


HELD_BACK = 100
"""Runs of the retention section's history given an operation whose outcome is unknown: the
prune must leave every one of them."""


@dataclass
class Suite:
    server: Server
    plan: Plan
    context: dict[str, Any]
    baseline_tps: float | None = None  # 16-client pgbench ceiling
    commit_latency: float | None = None  # seconds, 1-client pgbench
    ours_tp: dict[int, dict[str, Any]] = field(default_factory=dict)
    ours_lat: dict[str, float] | None = None
    sections: tuple[str, ...] = ()  # the sections this run measures

    def record(self, section: str, payload: dict[str, Any]) -> None:
        append_result(section, {"plan": self.plan.__dict__, **payload}, self.context)

    def setup(self) -> ours.Setup:
        return ours.Setup(self.plan.workers, self.plan.concurrency, self.plan.pool_size)

    async def repeat(self, what: str, fn: Callable[[], Awaitable[dict[str, Any]]]
                     ) -> list[dict[str, Any]]:
        out = []
        for i in range(self.plan.reps):
            log(f"{what}: repetition {i + 1}/{self.plan.reps}")
            out.append(await fn())
        return out

    # -- ceiling -----------------------------------------------------------------------------

    def measure_ceiling(self, clients: tuple[int, ...], seconds: float, reps: int
                        ) -> dict[int, list[dict[str, Any]]]:
        pgbench = self.server.pgbench()
        if pgbench is None:
            raise RuntimeError("pgbench not found (PATH, /usr/lib/postgresql, embedded wheel)")
        results: dict[int, list[dict[str, Any]]] = {c: [] for c in clients}
        with self.server.database("ceiling") as url:
            ceiling_mod.prepare(url)
            for rep in range(reps):
                for c in clients:
                    log(f"ceiling: {c} clients, repetition {rep + 1}/{reps}")
                    ceiling_mod.truncate(url)
                    results[c].append(ceiling_mod.pgbench_once(self.server, pgbench, url, c,
                                                               seconds))
        if 16 in results:
            self.baseline_tps = median([r["tps"] for r in results[16]])
        if 1 in results:
            lat = [r["latency_ms"] for r in results[1] if r["latency_ms"] is not None]
            self.commit_latency = median(lat) / 1000 if lat else None
        return results

    async def ensure_baseline(self) -> None:
        if self.baseline_tps is None:
            log("baseline: a short 1- and 16-client pgbench run for the ratios")
            self.measure_ceiling((1, 16), min(self.plan.ceiling_seconds, 5), 1)

    async def section_ceiling(self) -> None:
        p = self.plan
        results = self.measure_ceiling(p.clients, p.ceiling_seconds, p.reps)
        settings = self.server.settings()
        table = Table("ceiling: pgbench, 1 single-row INSERT + COMMIT per transaction",
                      ["clients", "tps (median)", "min", "max", "latency ms",
                       "÷ 16-client ceiling"])
        for c, runs in results.items():
            tps = [r["tps"] for r in runs]
            lat = [r["latency_ms"] for r in runs if r["latency_ms"] is not None]
            table.add(str(c), median(tps), min(tps), max(tps), f"{median(lat):.2f}",
                      fx(ratio(median(tps), self.baseline_tps)))
        table.notes.append(
            f"{p.reps} × {p.ceiling_seconds:g} s each, -M prepared, fresh database; "
            f"synchronous_commit={settings.get('synchronous_commit')}, "
            f"fsync={settings.get('fsync')}, PostgreSQL {settings.get('server_version')}")
        table.print()
        self.record("ceiling", {"results": results, "settings": settings,
                                "baseline_tps": self.baseline_tps})

    # -- throughput --------------------------------------------------------------------------

    async def ours_throughput(self, k: int) -> dict[str, Any]:
        if k not in self.ours_tp:
            reps = await self.repeat(f"throughput k={k}", lambda: ours.throughput_once(
                self.server, k=k, n=self.plan.runs[k], setup=self.setup()))
            self.ours_tp[k] = {"reps": reps,
                               "runs_per_s": median([r["runs_per_s"] for r in reps]),
                               "steps_per_s": median([r["steps_per_s"] for r in reps]),
                               **{key: median_of(reps, key) for key in CPU_FIGURES}}
        return self.ours_tp[k]

    async def section_throughput(self) -> None:
        await self.ensure_baseline()
        p = self.plan
        table = Table(f"throughput: {p.workers} worker processes × concurrency {p.concurrency}, "
                      "K trivial consequential steps per run",
                      ["K", "runs", "runs/s", "steps/s", "steps/s min–max",
                       "steps/s ÷ 16-client ceiling", "CPU µs/step: worker", "server",
                       "system µs/step: worker", "server", "machine busy"])
        for k in sorted(p.runs):
            try:
                tp = await self.ours_throughput(k)
            except Exception as exc:  # noqa: BLE001 - report and go on with the suite
                table.add(str(k), str(p.runs[k]), f"failed: {exc}", "", "", "")
                traceback.print_exc()
                continue
            steps = [r["steps_per_s"] for r in tp["reps"]]
            table.add(str(k), str(p.runs[k]), tp["runs_per_s"], tp["steps_per_s"],
                      f"{min(steps):,.0f}–{max(steps):,.0f}",
                      fx(ratio(tp["steps_per_s"], self.baseline_tps)),
                      tp["worker_cpu_us_per_step"], tp["server_cpu_us_per_step"],
                      tp["worker_sys_us_per_step"], tp["server_sys_us_per_step"],
                      pct(tp["machine_busy"]))
        table.notes.append(f"median of {p.reps}; each repetition drains N held runs on a fresh "
                           f"database; pool {p.pool_size} connections per worker; ceiling "
                           f"{self.baseline_tps:,.0f} tps")
        table.notes.append("CPU: user + system time of the worker processes and of the server's "
                           "processes from the release until the progress poll (every 0.1 s) "
                           "saw the last finish, per step; system = the kernel's part of it "
                           "(on loopback TCP a send() does the receiving side's work as well); "
                           "machine busy = share of all CPUs' time not idle meanwhile (/proc)")
        table.print()
        self.record("throughput", {"results": self.ours_tp, "baseline_tps": self.baseline_tps})

    # -- floor -------------------------------------------------------------------------------

    async def section_floor(self) -> None:
        await self.ensure_baseline()
        p = self.plan
        table = Table(f"floor: the same drains through the engine's writes alone "
                      f"(bench/floor.py), {p.workers} processes × concurrency {p.concurrency}",
                      ["K", "floor steps/s", "÷ 16-client ceiling", "ours steps/s",
                       "ours ÷ floor", "CPU µs/step: floor process", "server", "machine busy"])
        payload: dict[int, Any] = {}
        for k in sorted(p.runs):
            try:
                pairs = []
                for i in range(p.reps):  # side by side, so that the host's drift cancels out
                    log(f"floor k={k}: repetition {i + 1}/{p.reps}")
                    mine = await ours.throughput_once(self.server, k=k, n=p.runs[k],
                                                      setup=self.setup())
                    floor = await ours.throughput_once(
                        self.server, k=k, n=p.runs[k], setup=replace(self.setup(), floor=True))
                    pairs.append((mine, floor))
            except Exception as exc:  # noqa: BLE001 - report and go on with the suite
                table.add(str(k), f"failed: {exc}", "", "", "", "", "", "")
                traceback.print_exc()
                continue
            floors = [f for _, f in pairs]
            rate = median([f["steps_per_s"] for f in floors])
            table.add(str(k), rate, fx(ratio(rate, self.baseline_tps)),
                      median([m["steps_per_s"] for m, _ in pairs]),
                      fx(median([m["steps_per_s"] / f["steps_per_s"] for m, f in pairs])),
                      median_of(floors, "worker_cpu_us_per_step"),
                      median_of(floors, "server_cpu_us_per_step"),
                      pct(median_of(floors, "machine_busy")))
            payload[k] = {"pairs": [{"ours": m, "floor": f} for m, f in pairs]}
        table.notes.append(
            "floor: the engine's claim, its set-based write-ahead/receipt/success statements "
            "and its group writer, driven by a minimal loop (no workflow code, effect gateway, "
            "lease renewal); the database does the same work; ours ÷ floor is the median of "
            "the pairs' ratios")
        table.print()
        self.record("floor", {"results": payload, "baseline_tps": self.baseline_tps})

    # -- batches -----------------------------------------------------------------------------

    async def section_batches(self) -> None:
        p = self.plan
        sizes = list(p.batch_sizes)
        reps: dict[int, list[dict[str, Any]]] = {size: [] for size in sizes}
        for i in range(p.reps):  # sizes interleaved, alternating order: the host drifts
            for size in (sizes if i % 2 == 0 else sizes[::-1]):
                log(f"batches of {size}: repetition {i + 1}/{p.reps}")
                reps[size].append(await batches.batches_once(self.server, size=size,
                                                             runs=p.batch_runs))
        table = Table(f"batches: the floor's K=3 writes ({p.batch_runs} runs, "
                      f"{p.batch_runs * 4:,} writes) in group commits of at most N writes",
                      ["N", "writes per batch", "server µs/batch", "server µs/write",
                       "writer process µs/batch", "µs/write", "machine busy"])
        fits: dict[str, Any] = {}
        for kind in ("server", "process"):
            points = [(r["writes"] / r["batches"], r[f"{kind}_us_per_batch"])
                      for size in sizes for r in reps[size]
                      if r.get(f"{kind}_us_per_batch") is not None]
            fits[kind] = batches.per_batch_and_write(points)
        for size in sizes:
            rs = reps[size]
            table.add(str(size), median([r["writes"] / r["batches"] for r in rs]),
                      median_of(rs, "server_us_per_batch"), median_of(rs, "server_us_per_write"),
                      median_of(rs, "process_us_per_batch"), median_of(rs, "process_us_per_write"),
                      pct(median_of(rs, "machine_busy")))
        for kind, label in (("server", "server"), ("process", "writer process")):
            fit = fits[kind]
            if fit is not None:
                table.notes.append(f"{label}: about {fit[0]:,.0f} µs per batch + {fit[1]:,.0f} µs "
                                   "per write (least squares over every repetition)")
        table.notes.append(
            "a batch is one transaction: one set-based statement per kind of write in it and one "
            "commit; a drain's batches hold tens of writes, a stream's a few (see latency under "
            "load); the writer process is this driver running bench.floor's loop")
        table.print()
        self.record("batches", {"results": reps, "fits": fits})

    # -- peers -------------------------------------------------------------------------------

    async def section_peers(self) -> None:
        await self.ensure_baseline()
        p = self.plan
        table = Table(f"peers: same server, fresh database each, {p.workers} processes × "
                      f"concurrency {p.concurrency}",
                      ["system", "workload", "rate/s", "÷ ceiling", "ours ÷ theirs", "notes"])
        payload: dict[str, Any] = {}
        for k in (3, 10):
            try:
                mine = await self.ours_throughput(k)
                table.add("orchestrator (ours)", f"K={k}: {p.runs[k]} runs", mine["steps_per_s"],
                          fx(ratio(mine["steps_per_s"], self.baseline_tps)), "1×",
                          f"steps/s; {mine['runs_per_s']:,.0f} runs/s")
            except Exception as exc:  # noqa: BLE001
                mine = None
                table.add("orchestrator (ours)", f"K={k}", "—", "—", "—", f"failed: {exc}")
            why = peers.available("dbos")
            if why:
                table.add("DBOS Transact", f"K={k}", "—", "—", "—", f"cannot run: {why}")
                continue
            try:
                reps = await self.repeat(f"dbos k={k}", partial(
                    dbos_peer.drain, self.server, k=k, runs=p.runs[k], workers=p.workers,
                    concurrency=p.concurrency, pool_size=p.pool_size))
                steps = median([r["steps_per_s"] for r in reps])
                payload[f"dbos_k{k}"] = {"reps": reps, "steps_per_s": steps}
                table.add("DBOS Transact", f"K={k}: {p.runs[k]} runs", steps,
                          fx(ratio(steps, self.baseline_tps)),
                          fx(ratio(mine["steps_per_s"] if mine else None, steps)),
                          f"steps/s; {median([r['runs_per_s'] for r in reps]):,.0f} runs/s; "
                          "in-process start_workflow_async")
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                table.add("DBOS Transact", f"K={k}", "—", "—", "—", f"failed: {exc}")
        mine3 = self.ours_tp.get(3)
        ours3 = mine3["steps_per_s"] if mine3 else None
        jobs = p.runs[3] * 3
        for name, label in (("pgqueuer", "PgQueuer"), ("procrastinate", "Procrastinate")):
            why = peers.available(name)
            if why:
                table.add(label, "no-op jobs", "—", "—", "—", f"cannot run: {why}")
                continue
            configs: list[dict[str, Any]]
            if name == "pgqueuer":
                configs = [{"batch_size": b, "concurrency": p.concurrency}
                           for b in p.pgqueuer_batches]
                n = max(jobs, p.pgqueuer_min_jobs)
            else:
                configs = [{"concurrency": p.concurrency, "pool_size": p.pool_size}]
                n = jobs
            best: tuple[float, dict[str, Any], list[dict[str, Any]]] | None = None
            for options in configs:
                try:
                    reps = await self.repeat(f"{name} {options}", partial(
                        peers.drain, self.server, name, jobs=n, workers=p.workers,
                        options=options))
                except Exception as exc:  # noqa: BLE001
                    traceback.print_exc()
                    table.add(label, f"{n} no-op jobs", "—", "—", "—", f"failed {options}: {exc}")
                    continue
                rate = median([r["jobs_per_s"] for r in reps])
                payload[f"{name}_{'_'.join(f'{k}{v}' for k, v in options.items())}"] = {
                    "reps": reps, "jobs_per_s": rate, "options": options}
                if best is None or rate > best[0]:
                    best = (rate, options, reps)
            if best is not None:
                rate, options, _ = best
                detail = ", ".join(f"{k}={v}" for k, v in options.items())
                if name == "pgqueuer":
                    tried = ", ".join(str(b) for b in p.pgqueuer_batches)
                    detail += f" (best of batch sizes {tried}); asyncpg driver"
                table.add(label, f"{n} no-op jobs", rate, fx(ratio(rate, self.baseline_tps)),
                          fx(ratio(ours3, rate)), f"jobs/s vs our K=3 steps/s; {detail}")
        table.notes.append(f"median of {p.reps}; rates from the server's clock: before release "
                           "or enqueue → the last completion each system recorded")
        table.print()
        self.record("peers", {"results": payload, "ours": self.ours_tp,
                              "baseline_tps": self.baseline_tps})

    # -- latency -----------------------------------------------------------------------------

    async def ours_latency(self, url: str | None = None) -> dict[str, float]:
        reps = await self.repeat("latency (ours)", lambda: ours.latency_once(
            self.server, samples=self.plan.latency_samples, url=url))
        keys = [k for k in reps[0] if k != "samples"]
        return {k: median([r[k] for r in reps]) for k in keys}

    async def section_latency(self) -> None:
        await self.ensure_baseline()
        p = self.plan
        commit = self.commit_latency
        table = Table(f"latency: K=1 runs, {p.latency_samples} sequential samples, idle worker "
                      "unless noted (ms)",
                      ["system", "first step p50", "p99", "result p50", "p99",
                       "first p50 ÷ 1 commit", "notes"])
        payload: dict[str, Any] = {}
        try:
            self.ours_lat = await self.ours_latency()
            lat = self.ours_lat
            payload["ours"] = lat
            table.add("orchestrator (ours)", ms(lat["first_step_p50"]), ms(lat["first_step_p99"]),
                      ms(lat["result_p50"]), ms(lat["result_p99"]),
                      fx(ratio(lat["first_step_p50"], commit)),
                      f"result via result_async (polls); created→finished in the database: "
                      f"p50 {ms(lat['db_created_to_finished_p50'])}, "
                      f"p99 {ms(lat['db_created_to_finished_p99'])}; a lone commit "
                      f"{ms(lat.get('lone_commit_p50'))} ms p50; {split_note(lat)}")
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            table.add("orchestrator (ours)", "—", "—", "—", "—", "—", f"failed: {exc}")
        try:
            capacity = (await self.ours_throughput(3))["runs_per_s"]
            rate = round(capacity * p.load_fraction, 1)
            reps = await self.repeat("latency under load (ours)", partial(
                ours.latency_once, self.server, samples=p.latency_samples, setup=self.setup(),
                load_rate=rate))
            lat = {k: median([r[k] for r in reps]) for k in reps[0] if k != "samples"}
            payload["ours_under_load"] = {**lat, "load_rate": rate}
            table.add("ours, under load", ms(lat["first_step_p50"]), ms(lat["first_step_p99"]),
                      ms(lat["result_p50"]), ms(lat["result_p99"]),
                      fx(ratio(lat["first_step_p50"], commit)),
                      f"while another process submits K=3 runs at {rate:g}/s "
                      f"({p.load_fraction:.0%} of the measured drain rate) to "
                      f"{p.workers} × {p.concurrency} workers; backlog at the end "
                      f"{lat.get('backlog_at_end', float('nan')):.0f} runs; a lone commit "
                      f"meanwhile {ms(lat.get('lone_commit_p50'))} ms p50; {split_note(lat)}; "
                      f"{cpu_note(lat)}")
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            table.add("ours, under load", "—", "—", "—", "—", "—", f"failed: {exc}")
        for name, label in (("dbos", "DBOS Transact"), ("pgqueuer", "PgQueuer"),
                            ("procrastinate", "Procrastinate")):
            why = peers.available(name)
            if why:
                table.add(label, "—", "—", "—", "—", "—", f"cannot run: {why}")
                continue
            try:
                if name == "dbos":
                    reps = await self.repeat("latency dbos", lambda: dbos_peer.latency(
                        self.server, samples=p.latency_samples))
                    note = "started in the worker's own process (no queue hand-off)"
                else:
                    reps = await self.repeat(f"latency {name}", partial(
                        peers.latency, self.server, name, samples=p.latency_samples,
                        options={}))
                    note = "job start; a queue has no result to wait for"
                lat = {k: median([r[k] for r in reps]) for k in reps[0] if k != "samples"}
                payload[name] = lat
                table.add(label, ms(lat["first_step_p50"]), ms(lat["first_step_p99"]),
                          ms(lat.get("result_p50")), ms(lat.get("result_p99")),
                          fx(ratio(lat["first_step_p50"], commit)), note)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                table.add(label, "—", "—", "—", "—", "—", f"failed: {exc}")
        table.notes.append(f"median over {p.reps} repetitions of each percentile; one commit = "
                           f"{ms(commit)} ms (1-client pgbench, back to back); a lone commit: "
                           "one INSERT + COMMIT every 10 ms during the run (a first step "
                           "waits for three: submit, claim, write-ahead)")
        table.print()
        self.record("latency", {"results": payload, "commit_latency": commit})

    # -- scale -------------------------------------------------------------------------------

    async def section_scale(self) -> None:
        """Empty and filled databases measured in alternation, so that the background load of
        a shared machine falls on both; ratios are the median of the paired repetitions."""
        p = self.plan
        lat_keys = (("first_step_p50", "first step p50 ms"),
                    ("first_step_p99", "first step p99 ms"),
                    ("result_p50", "result p50 ms"), ("result_p99", "result p99 ms"),
                    ("db_created_to_finished_p50", "created→finished p50 ms"))
        pairs: list[dict[str, Any]] = []
        url = self.server.create_database("scale")
        try:
            migrate(url)
            filled = await scale.fill(url, runs=p.scale_rows, k=3)
            for i in range(p.reps):
                log(f"scale: repetition {i + 1}/{p.reps} (empty, then with history)")
                pair: dict[str, Any] = {}
                for label, where in (("empty", None), ("history", url)):
                    pair[f"{label}_tp"] = await ours.throughput_once(
                        self.server, k=3, n=p.runs[3], setup=self.setup(), url=where)
                    pair[f"{label}_lat"] = await ours.latency_once(
                        self.server, samples=p.latency_samples, url=where)
                pairs.append(pair)
        finally:
            self.server.drop_database(url)

        def paired(kind: str, key: str) -> tuple[float, float, float | None]:
            empty = [q[f"empty_{kind}"][key] for q in pairs]
            big = [q[f"history_{kind}"][key] for q in pairs]
            ratios = [r for r in (ratio(b, e) for e, b in zip(empty, big, strict=True))
                      if r is not None]
            return median(empty), median(big), median(ratios) if ratios else None

        table = Table(f"scale: {p.scale_rows:,} finished runs (K=3: {p.scale_rows * 3:,} "
                      f"operations, {p.scale_rows * 7:,} journal events, "
                      f"{filled['tables_gib']:.1f} GiB) already in the tables",
                      ["figure", "empty tables", "with history", "ratio", "target"])
        summary: dict[str, Any] = {}
        empty, big, r = paired("tp", "steps_per_s")
        summary["steps_per_s"] = (empty, big, r)
        table.add("K=3 steps/s", empty, big, fx(r), "≥ 0.9×")
        for key, label in lat_keys:
            empty, big, r = paired("lat", key)
            summary[key] = (empty, big, r)
            table.add(label, ms(empty), ms(big), fx(r), "≤ 1.2×")
        table.notes.append(f"loaded with INSERT … SELECT generate_series in "
                           f"{filled['fill_seconds']:.0f} s, then VACUUM ANALYZE; {p.reps} "
                           "pairs, empty and filled in alternation; ratio = median of the "
                           "paired ratios")
        table.print()
        self.record("scale", {"fill": filled, "pairs": pairs, "summary": summary})

    # -- recovery ----------------------------------------------------------------------------

    async def section_recovery(self) -> None:
        p = self.plan
        ttl = p.recovery_lease_ttl
        if ttl is None:
            from orchestrator import Orchestrator

            ttl = Orchestrator("postgresql://localhost/unused").lease_ttl
        reps = await self.repeat("recovery", lambda: ours.recovery_once(
            self.server, runs=p.recovery_runs, lease_ttl=ttl))
        table = Table(f"recovery: SIGKILL a worker holding {p.recovery_runs} in-flight runs; "
                      "seconds until each runs again on the other worker",
                      ["lease ttl s", "recovered", "claimed p50", "claimed max",
                       "step re-sent p50", "step re-sent max", "target p50"])
        med = {k: median([r[k] for r in reps]) for k in reps[0] if isinstance(reps[0][k], float)}
        table.add(f"{ttl:g}", f"{min(r['recovered'] for r in reps)}/{p.recovery_runs}",
                  f"{med['claimed_p50']:.2f}", f"{med['claimed_max']:.2f}",
                  f"{med['redispatched_p50']:.2f}", f"{med['redispatched_max']:.2f}", "≤ 2 s")
        table.notes.append(f"median of {p.reps}; the runs sit in a `read` tool, so on the new "
                           "worker the step is re-sent as attempt 2 (a consequential one would "
                           "go to reconciliation instead)")
        table.print()
        self.record("recovery", {"reps": reps, "lease_ttl": ttl})

    # -- pooler ------------------------------------------------------------------------------

    async def section_pooler(self) -> None:
        p = self.plan
        runs = p.runs[3]
        results = await pooler.measure(self.server, runs=runs, setup=self.setup(),
                                       samples=p.latency_samples, reps=p.reps)
        table = Table(f"pooler: K=3 drains of {runs} runs ({p.workers} × {p.concurrency} "
                      f"workers) and idle K=1 latency ({p.latency_samples} samples), through "
                      "PgBouncer (transaction mode) and direct",
                      ["workers reach the server", "steps/s", "÷ direct", "target",
                       "first step p50 ms", "p99", "result p50 ms", "p99"])
        labels = {"direct": "directly", "listen_url": "PgBouncer + listen_url",
                  "polling": "PgBouncer, polling (1 s)"}
        for arm, label in labels.items():
            r = results[arm]
            table.add(label, r["steps_per_s"], fx(r["ratio_to_direct"]),
                      "" if arm == "direct" else "≥ 0.8×", ms(r["first_step_p50"]),
                      ms(r["first_step_p99"]), ms(r["result_p50"]), ms(r["result_p99"]))
        table.notes.append(
            f"median of {p.reps}; ÷ direct is the median of each repetition's ratio; PgBouncer "
            f"{p.pool_size} server sessions per database (one worker's pool); the driver "
            "submits directly in every arm")
        table.notes.append(
            "polling: nobody hears the release's NOTIFY, so a drain starts at the workers' next "
            "look (up to 1 s after they started, which a short drain feels), and each latency "
            "sample, submitted just after the look that ran the one before, waits almost a "
            "whole interval: the worst case, not the mean of arrivals at random")
        table.print()
        self.record("pooler", {"results": results})

    # -- memory ------------------------------------------------------------------------------

    async def section_memory(self) -> None:
        p = self.plan
        reps = await self.repeat("memory", lambda: ours.memory_once(
            self.server, runs=p.memory_runs, concurrency=p.memory_concurrency,
            pool_size=p.pool_size))
        table = Table(f"memory: one worker drains {p.memory_runs:,} queued K=3 runs at "
                      f"concurrency {p.memory_concurrency}",
                      ["figure", "median", "min", "max", "target"])
        for key, label, target in (("idle_rss_mib", "RSS before the drain MiB", ""),
                                   ("peak_rss_mib", "peak RSS (VmHWM) MiB", "≤ 200"),
                                   ("seconds", "drain seconds", "")):
            values = [r[key] for r in reps]
            table.add(label, median(values), min(values), max(values), target)
        table.notes.append(f"median of {p.reps}; succeeded "
                           f"{min(r['succeeded'] for r in reps)}/{p.memory_runs}")
        table.print()
        self.record("memory", {"reps": reps})

    # -- profile -----------------------------------------------------------------------------

    async def section_profile(self) -> None:
        p = self.plan
        stacks = Path(p.profile_stacks) if p.profile_stacks else None
        result = await ours.throughput_once(self.server, k=3, n=p.runs[3] * 2,
                                            setup=self.setup(), profile=True, stacks=stacks)
        prof = result["profile"]
        table = Table(f"profile: py-spy on one of {p.workers} workers during a K=3 drain "
                      f"({result['steps_per_s']:,.0f} steps/s, {prof['samples']} samples "
                      "holding the GIL)", ["where the worker spends its own time", "share"])
        for name, share in prof["self"]:
            table.add(name, f"{share:.1%}")
        table.rows.append(["", ""])
        table.rows.append(["own time by package or module", ""])
        for name, share in prof["packages"]:
            table.add("  " + name, f"{share:.1%}")
        table.rows.append(["", ""])
        table.rows.append(["engine functions, including callees", ""])
        for name, share in prof["inclusive"]:
            table.add("  " + name, f"{share:.1%}")
        table.print()
        self.record("profile", {"result": result})

    # -- bulk --------------------------------------------------------------------------------

    async def section_bulk(self) -> None:
        p = self.plan
        reps = await self.repeat("bulk", lambda: bulk.bulk_once(self.server,
                                                                items=p.bulk_items))
        seconds = [r["seconds"] for r in reps]
        table = Table(f"bulk: `orchestrator ops resolve-many --not-applied --yes` on "
                      f"{p.bulk_items} unknown operations",
                      ["figure", "median", "min", "max", "target"])
        table.add("command seconds (start to exit)", f"{median(seconds):.2f}",
                  f"{min(seconds):.2f}", f"{max(seconds):.2f}", "< 5")
        spans = [r["audit_span"] for r in reps]
        table.add("first to last audit row, seconds", f"{median(spans):.2f}",
                  f"{min(spans):.2f}", f"{max(spans):.2f}", "")
        table.add("audit rows written", f"{median([r['audit_rows'] for r in reps]):.0f}",
                  str(min(r["audit_rows"] for r in reps)),
                  str(max(r["audit_rows"] for r in reps)), str(p.bulk_items))
        table.notes.append(f"median of {p.reps}; each repetition parks {p.bulk_items} runs on a "
                           "fresh database first (not timed); the command runs as a subprocess, "
                           "interpreter start-up included; one transaction and one audit row "
                           "per item")
        table.print()
        self.record("bulk", {"reps": reps})

    # -- console -----------------------------------------------------------------------------

    async def section_telemetry(self) -> None:
        """What telemetry costs the workers: the same K=3 drain with telemetry off, with each
        worker's ``/metrics`` served and scraped every second, with tracing (the SDK in every
        worker, every span sampled and batched to an exporter that drops it) and with tracing
        sampled as a production service would (a parent-based sampler keeping one trace in
        ten; the target is the unsampled arm's), the arms
        interleaved (their order alternates), each compared with the ``off`` drain of its own
        repetition; then first-step latency in each arm."""
        p = self.plan
        arms = ("off", "metrics", "tracing", "tracing-sampled")
        targets = {"metrics": 0.97, "tracing": 0.9}
        drains: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
        for i in range(p.reps):
            for arm in (arms if i % 2 == 0 else arms[::-1]):
                log(f"telemetry: repetition {i + 1}/{p.reps}, {arm}")
                drains[arm].append(await ours.throughput_once(
                    self.server, k=3, n=p.telemetry_runs,
                    setup=replace(self.setup(), telemetry=arm)))
        lat: dict[str, dict[str, Any]] = {}
        for arm in arms:
            reps = await self.repeat(f"telemetry latency, {arm}", partial(
                ours.latency_once, self.server, samples=p.latency_samples,
                setup=ours.Setup(workers=1, concurrency=10, pool_size=4, telemetry=arm)))
            lat[arm] = {key: median([r[key] for r in reps])
                        for key in ("first_step_p50", "first_step_p99")}
        table = Table(f"telemetry: K=3 throughput ({p.telemetry_runs:,} runs, "
                      f"{p.workers} workers × concurrency {p.concurrency}) and K=1 first-step "
                      "latency (idle worker), "
                      "telemetry off, metrics scraped, tracing on (every trace, 1 in 10)",
                      ["arm", "steps/s", "min–max", "÷ off (paired median)", "target",
                       "worker µs/step", "first step p50 ms", "p99 ms", "scrapes"])
        payload: dict[str, Any] = {"drains": drains, "latency": lat}
        for arm in arms:
            steps = [d["steps_per_s"] for d in drains[arm]]
            paired = median([d["steps_per_s"] / off["steps_per_s"]
                             for d, off in zip(drains[arm], drains["off"], strict=True)])
            payload[f"{arm}_ratio"] = paired
            target = targets.get(arm)
            verdict = ("" if target is None else
                       f"≥ {target:g}×: {'meets' if paired >= target else 'misses'}")
            table.add(arm, median(steps), f"{min(steps):,.0f}–{max(steps):,.0f}",
                      "—" if arm == "off" else fx(paired), verdict,
                      median_of(drains[arm], "worker_cpu_us_per_step"),
                      ms(lat[arm]["first_step_p50"]), ms(lat[arm]["first_step_p99"]),
                      str(sum(d.get("scrapes", 0) for d in drains[arm])) if arm == "metrics"
                      else "—")
        table.notes.append(f"{p.reps} drains per arm on fresh databases, the arms' order "
                           "alternating; ÷ off is the median over repetitions of each drain "
                           "over the off drain of the same repetition")
        table.notes.append(f"metrics: each worker serves --metrics-port, scraped every "
                           f"{ours.SCRAPE_INTERVAL:g} s (every scrape also reads the database "
                           "gauges); tracing: opentelemetry-sdk TracerProvider, "
                           "BatchSpanProcessor, an exporter that drops every span; "
                           "tracing-sampled: the same with ParentBased(TraceIdRatioBased(0.1))")
        # The floor under the tracing arm: what the SDK alone takes per span, here, with no
        # attribute, times the spans a K=3 step makes (a run span per run, a call span per
        # attempt: 4 per 3 steps), beside what the off arm's workers spend per step.
        span_us = ours.sdk_span_cost()
        off_us = median_of(drains["off"], "worker_cpu_us_per_step")
        payload["sdk_span_us"] = span_us
        table.notes.append(
            f"the SDK alone (start + end of a span with no attribute, in this process, same "
            f"provider): {span_us:.1f} µs per span; a K=3 step makes 4/3 spans, so at least "
            f"{span_us * 4 / 3:.1f} µs per step before any attribute, against the off arm's "
            f"{off_us or 0:.0f} µs of worker CPU per step")
        table.print()
        self.record("telemetry", payload)

    async def section_queues(self) -> None:
        """What queues cost and how well their limits are used: K=3 drains of runs in the
        default queue and in a queue configured with a limit that never binds, interleaved
        (their order alternates), each compared with the default drain of its repetition; a
        binding concurrency limit's utilisation; a start rate's steady rate and busiest
        window."""
        p = self.plan
        arms = ("default queue", "queue, limit not binding")
        drains: dict[str, list[dict[str, Any]]] = {arm: [] for arm in arms}
        for i in range(p.reps):
            for arm in (arms if i % 2 == 0 else arms[::-1]):
                log(f"queues: repetition {i + 1}/{p.reps}, {arm}")
                drains[arm].append(await ours.throughput_once(
                    self.server, k=3, n=p.queue_runs, setup=self.setup(),
                    workflow="k3" if arm == arms[0] else "k3q"))
        capped = await self.repeat("queues: binding concurrency", partial(
            flow.capped_once, self.server, n=p.queue_cap_runs, cap=p.queue_cap,
            hold_s=p.queue_hold, setup=self.setup()))
        rated = await self.repeat("queues: start rate", partial(
            flow.rated_once, self.server, n=p.queue_rate_runs, rate=p.queue_rate,
            setup=self.setup()))
        table = Table(f"queues: K=3 throughput ({p.queue_runs:,} runs, {p.workers} workers × "
                      f"concurrency {p.concurrency}), a binding limit, a start rate",
                      ["measure", "figure", "min–max", "target", "verdict"])
        off = [d["steps_per_s"] for d in drains[arms[0]]]
        on = [d["steps_per_s"] for d in drains[arms[1]]]
        paired = median([a / b for a, b in zip(on, off, strict=True)])
        table.add("K=3 steps/s, default queue", median(off), f"{min(off):,.0f}–{max(off):,.0f}",
                  "—", "")
        table.add("K=3 steps/s, queue not binding", median(on), f"{min(on):,.0f}–{max(on):,.0f}",
                  "—", "")
        table.add("÷ default (paired median)", fx(paired), "", "≥ 0.9×",
                  "meets" if paired >= 0.9 else "misses")
        use = [c["utilisation"] for c in capped]
        table.add(f"utilisation of concurrency {p.queue_cap}", pct(median(use)),
                  f"{min(use):.1%}–{max(use):.1%}", "≥ 90 %",
                  "meets" if median(use) >= 0.9 else "misses")
        table.add("most slots held at once", str(max(c["peak"] for c in capped)), "",
                  f"≤ {p.queue_cap}",
                  "holds" if max(c["peak"] for c in capped) <= p.queue_cap else "BROKEN")
        steady = [r["steady_rate"] for r in rated]
        off_by = abs(median(steady) - p.queue_rate) / p.queue_rate
        table.add(f"starts per second at {p.queue_rate}/s (steady)", f"{median(steady):g}",
                  f"{min(steady):g}–{max(steady):g}", "within 5 %",
                  f"{off_by:.1%} off: {'meets' if off_by <= 0.05 else 'misses'}")
        busiest = max(r["busiest_window"] for r in rated)
        table.add("most starts in any 1 s window", str(busiest), "", f"≤ {p.queue_rate}",
                  "holds" if busiest <= p.queue_rate else "BROKEN")
        table.notes.append(f"{p.reps} repetitions, fresh databases; binding limit: "
                           f"{p.queue_cap_runs} runs each holding its slot "
                           f"{p.queue_hold:g} s (ideal {capped[0]['ideal_seconds']:.1f} s), "
                           "utilisation = slot-seconds held ÷ (limit × first start to last "
                           f"finish); rate: {p.queue_rate_runs} K=1 runs, starts counted per "
                           "whole second from the first (the first second, the window's "
                           "burst, left out of the steady figure), from runs.started_at")
        table.print()
        self.record("queues", {"drains": drains, "ratio": paired, "capped": capped,
                               "rated": rated})

    async def section_retention(self) -> None:
        """Pruning the scale section's history: ``orchestrator prune`` in its own process over
        ``scale_rows`` finished runs (1,000,000 in the full plan), timed, while K=3 drains run
        back to back in the same database; the drains' throughput during the prune beside
        drains of the same database before it and after it."""
        p = self.plan
        url = self.server.create_database("retention")
        before: list[float] = []
        during: list[float] = []
        after: list[float] = []
        try:
            migrate(url)
            filled = await scale.fill(url, runs=p.scale_rows, k=3)
            held = await scale.unsettle(url, runs=HELD_BACK)

            async def drain() -> float:
                tp = await ours.throughput_once(self.server, k=3, n=p.retention_runs,
                                                setup=self.setup(), url=url)
                return float(tp["steps_per_s"])

            for i in range(2):
                log(f"retention: drain {i + 1}/2 before the prune")
                before.append(await drain())
            log(f"retention: pruning {p.scale_rows:,} runs, K=3 drains meanwhile")
            started = time.monotonic()
            prune = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "orchestrator", "--database-url", url, "prune",
                "--older-than", "1h", "--quiet", "--json",
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE)
            waiting = asyncio.ensure_future(prune.communicate())
            while not waiting.done():
                figure = await drain()
                if not waiting.done():  # the whole drain ran beside the prune
                    during.append(figure)
            out, err = await waiting
            seconds = time.monotonic() - started
            still = await scale.unpruned(url, held)
            if prune.returncode != 0:
                raise RuntimeError(f"orchestrator prune failed: {err.decode()[-2000:]}")
            report = json.loads(out)
            log(f"retention: {report['runs']:,} runs pruned in {seconds:.0f}s")
            for i in range(2):
                log(f"retention: drain {i + 1}/2 after the prune")
                after.append(await drain())
        finally:
            self.server.drop_database(url)
        alone = before + after
        ratio_during = median(during) / median(alone) if during else None
        table = Table(f"retention: pruning {p.scale_rows:,} finished runs (K=3: "
                      f"{p.scale_rows * 7:,} journal events, {filled['tables_gib']:.1f} GiB) "
                      "beside a K=3 drain", ["measure", "figure", "target", "verdict"])
        table.add("runs pruned", f"{report['runs']:,}", f"{p.scale_rows - len(held):,}",
                  "all" if report["runs"] == p.scale_rows - len(held) else "MISSING")
        table.add("runs with an unknown operation left alone", f"{still}/{len(held)}",
                  f"{len(held)}/{len(held)}", "holds" if still == len(held) else "BROKEN")
        table.add("journal rows deleted", f"{report['journal_rows']:,}", "", "")
        table.add("prune wall time", f"{seconds:.0f} s ({seconds / 60:.1f} min)",
                  "minutes, not hours", "meets" if seconds < 3600 else "misses")
        table.add("runs pruned per second", f"{report['runs'] / seconds:,.0f}", "", "")
        table.add("K=3 steps/s, no prune (before, after)", f"{median(alone):,.0f}", "",
                  ", ".join(f"{x:,.0f}" for x in alone))
        table.add(f"K=3 steps/s during the prune ({len(during)} drains)",
                  f"{median(during):,.0f}" if during else "—", "",
                  ", ".join(f"{x:,.0f}" for x in during))
        table.add("÷ no prune", fx(ratio_during), "≥ 0.8×",
                  "—" if ratio_during is None else
                  ("meets" if ratio_during >= 0.8 else "misses"))
        table.notes.append(f"history loaded as in the scale section in "
                           f"{filled['fill_seconds']:.0f} s; `orchestrator prune --older-than "
                           f"1h` in its own process, batches of 500 runs, one transaction "
                           f"each; drains of {p.retention_runs:,} K=3 runs in the same "
                           "database (its own new runs are not pruned); a drain counts as "
                           "during the prune only if the prune was still running when it "
                           "ended")
        table.print()
        self.record("retention", {"fill": filled, "prune": report, "seconds": seconds,
                                  "before": before, "during": during, "after": after,
                                  "ratio": ratio_during})

    async def section_console(self) -> None:
        """Three parts (``--console-parts``): the SSE latency, the pages over a long history,
        the cost of many SSE clients to the workers."""
        parts = self.plan.console_parts
        for part in parts:
            if part not in ("latency", "pages", "sse"):
                raise ValueError(f"unknown console part {part!r}: latency, pages or sse")
        if "latency" in parts:
            await self.console_latency()
        if "pages" in parts:
            await self.console_pages()
        if "sse" in parts:
            await self.console_sse()

    async def console_latency(self) -> None:
        p = self.plan
        max_pause_ms = 40
        reps = await self.repeat("console", lambda: console_mod.sse_once(
            self.server, steps=p.console_steps, max_pause_ms=max_pause_ms,
            clients=p.console_clients))
        table = Table(f"console: a committed journal entry reaching {p.console_clients} SSE "
                      f"client(s) of GET /api/runs/{{id}}/events ({p.console_steps} tool calls, "
                      f"pauses 0-{max_pause_ms} ms) (ms)",
                      ["figure", "median", "min", "max", "target"])
        for key, target in (("p50", "≤ 50"), ("p90", ""), ("p99", "≤ 250"), ("max", "")):
            values = [r[key] for r in reps]
            table.add(f"commit → event {key}", ms(median(values)), ms(min(values)),
                      ms(max(values)), target)
        table.notes.append(f"median of {p.reps}; each repetition: a fresh database, one worker "
                           "and one `orchestrator console` process, the clients in the bench's "
                           f"process; {reps[0]['events']} events seen; the delay runs from the "
                           "entry's `at` (its transaction's start, before the commit): upper "
                           "bounds")
        table.print()
        self.record("console", {"reps": reps})

    async def console_pages(self) -> None:
        p = self.plan
        url, seeded = console_seed.ensure(self.server, runs=p.console_rows)
        result = await console_pages.measure(url, requests=p.console_page_requests)
        target = 0.200
        table = Table(f"console pages: {p.console_rows:,} finished runs, "
                      f"{result['queue_items']:,} queue items; one request at a time over "
                      f"HTTP (ms)", ["case", "rows", "p50", "p95", "max", "target p95",
                                     "verdict"])
        for case in result["cases"]:
            table.add(case["name"], "" if case["rows"] is None else str(case["rows"]),
                      ms(case["p50"]), ms(case["p95"]), ms(case["max"]), "≤ 200",
                      "meets" if case["p95"] <= target else "misses")
        how = ("reused" if seeded["reused"] else f"loaded in {seeded['seconds']:.0f} s")
        table.notes.append(f"{p.console_page_requests} requests per case after one untimed "
                           "round, the cases in turn; `orchestrator console` (uvicorn) without "
                           "an application for every tenant, another with operator `scoped` "
                           f"limited to {console_pages.SCOPED_TENANT} (20 % of the runs); "
                           f"database {seeded['database']} ({how}; kept for the next run); "
                           "runs pages of 50, queue pages of 100; deep = half-way back")
        table.print()
        self.record("console_pages", {"seed": seeded, **result})

    async def console_sse(self) -> None:
        p = self.plan
        rounds = await console_load.compare(
            self.server, runs=p.console_sse_runs, clients=p.console_sse_clients,
            rounds=p.console_sse_rounds, setup=self.setup())
        arms = {False: [r for r in rounds if not r["follow"]],
                True: [r for r in rounds if r["follow"]]}
        table = Table(f"console streams: K=3 throughput ({p.console_sse_runs:,} runs, "
                      f"{p.workers} workers) beside {p.console_sse_clients} SSE clients of one "
                      "console process, and without them",
                      ["arm", "steps/s", "min", "max", "console cores", "its db cores",
                       "clients' cores", "paced worker cores", "worker µs/step",
                       "server µs/step", "machine busy", "db xacts/s", "events/s"])
        for follow, label in ((False, "no clients"), (True, f"{p.console_sse_clients} clients")):
            rs = arms[follow]
            rates = [r["steps_per_s"] for r in rs]
            events = median([r["events_during_drain"] / r["wall"] for r in rs])
            table.add(label, median(rates), min(rates), max(rates),
                      fmt(median_of(rs, "cores_console"), 2),
                      fmt(median_of(rs, "cores_console_db"), 2),
                      fmt(median_of(rs, "cores_driver"), 2),
                      fmt(median_of(rs, "cores_paced_worker"), 2),
                      median_of(rs, "worker_cpu_us_per_step"),
                      median_of(rs, "server_cpu_us_per_step"),
                      pct(median_of(rs, "machine_busy")), median_of(rs, "xacts_per_s"),
                      events if follow else "")
        base = median([r["steps_per_s"] for r in arms[False]])
        loaded = median([r["steps_per_s"] for r in arms[True]])
        pairs = [ratio(b["steps_per_s"], a["steps_per_s"])
                 for a, b in zip(arms[False], arms[True], strict=True)]
        paired = median([x for x in pairs if x is not None])
        # The verdict reads the pairs, as the telemetry section does: the two drains of a
        # round run back to back (which goes first alternates), so the host's drift between
        # rounds cancels out; the ratio of the arms' medians keeps it, and is shown beside.
        cost = 1 - paired
        table.notes.append(f"with ÷ without, the median of the rounds' pairs: {fx(paired)}: "
                           f"a cost of {cost:.1%}, target ≤ 5 %: "
                           f"{'meets' if cost <= 0.05 else 'misses'} (the arms' medians: "
                           f"{fx(loaded / base)}; each pair: "
                           f"{', '.join(fx(x) for x in pairs if x is not None)})")
        table.notes.append(f"{p.console_sse_rounds} rounds each, alternating which arm goes "
                           "first; both arms run the console process and a worker running "
                           f"{p.console_sse_clients} paced runs (a tool call every 0-1 s); the "
                           "clients (raw sockets in this driver, one per paced run) stream them "
                           "from before the release to after the drain; cores = CPU seconds "
                           "per second of the drain; its db cores = the server processes "
                           "serving the console's connections; db xacts/s = the database's "
                           "commits per second (every statement of the console is one)")
        table.print()
        profiled = None
        if not p.quick and py_spy() is None:
            print("  (no profile of the console: py-spy is not installed; make bench installs "
                  "it)")
        elif not p.quick:
            log("console sse: one more round with the clients, py-spy on the console")
            profiled = await console_load.round_once(
                self.server, runs=p.console_sse_runs, clients=p.console_sse_clients,
                follow=True, setup=self.setup(), profile=True)
            prof = profiled["profile"]
            table = Table(f"console streams: where the console process spends its time with "
                          f"{p.console_sse_clients} clients during a drain ({prof['samples']} "
                          "samples holding the GIL; not counted above)", ["function", "share"])
            for name, share in prof["self"][:12]:
                table.add(name, f"{share:.1%}")
            table.rows.append(["", ""])
            table.rows.append(["own time by package or module", ""])
            for name, share in prof["packages"][:10]:
                table.add("  " + name, f"{share:.1%}")
            table.rows.append(["", ""])
            table.rows.append(["engine functions, including callees", ""])
            for name, share in prof["inclusive"][:12]:
                table.add("  " + name, f"{share:.1%}")
            table.print()
        self.record("console_sse", {"rounds": rounds, "ratio": loaded / base,
                                    "paired_ratio": paired, "profiled": profiled})

    # -- hosts -------------------------------------------------------------------------------

    async def section_hosts(self) -> None:
        """K=3 drains with one worker in each of 1, 2 and 4 network namespaces against one
        private cluster, beside one worker in the root namespace over loopback; the repetitions
        interleave the arms."""
        from bench import hosts as hosts_mod

        p = self.plan
        why = hosts_mod.unavailable()
        if why is not None:
            log(f"hosts: skipped: {why}")
            return
        arms = (0, *p.hosts_counts)
        results: dict[int, list[dict[str, Any]]] = {arm: [] for arm in arms}
        with hosts_mod.HostsBench(max(p.hosts_counts)) as bench_hosts:
            for rep in range(p.reps):
                for arm in arms:
                    log(f"hosts: {arm or 'root'} namespaces, repetition {rep + 1}/{p.reps}")
                    setup = ours.Setup(max(arm, 1), p.concurrency, p.pool_size)
                    results[arm].append(await bench_hosts.drain_once(
                        k=3, n=p.hosts_runs, namespaces=arm, setup=setup))
        table = Table(f"hosts: K=3 throughput ({p.hosts_runs:,} runs per drain), one worker "
                      f"× concurrency {p.concurrency} per host, one server",
                      ["hosts", "workers", "steps/s", "min–max", "÷ 1 host",
                       "CPU µs/step: server", "workers", "machine busy"])
        one = median([r["steps_per_s"] for r in results[arms[1]]])
        for arm in arms:
            reps = results[arm]
            steps = [r["steps_per_s"] for r in reps]
            table.add("root, loopback" if arm == 0 else str(arm), str(max(arm, 1)),
                      median(steps), f"{min(steps):,.0f}–{max(steps):,.0f}",
                      fx(ratio(median(steps), one)),
                      median_of(reps, "server_cpu_us_per_step"),
                      median_of(reps, "worker_cpu_us_per_step"),
                      pct(median_of(reps, "machine_busy")))
        table.notes.append(f"median of {p.reps}, arms interleaved; each host a network "
                           "namespace reaching the server over its own veth pair; a private "
                           "cluster (fsync off, synchronous_commit on) on this machine's "
                           f"{os.cpu_count()} cores, shared by the server, the workers and "
                           "the driver")
        table.print()
        self.record("hosts", {"results": {str(k): v for k, v in results.items()}})
        # The other two measurements beyond one host, in the same section: through
        # PgBouncer against direct (unless the pooler section runs on its own), and a failover.
        if "pooler" not in self.sections:
            await self.section_pooler()
        await self.failover_timings()

    async def failover_timings(self) -> None:
        """A primary SIGKILLed under load and its standby promoted (bench/failover.py): seconds
        to the promotion, the first step on the new primary, every in-flight run again."""
        from bench import failover
        from tests.failover.pair import unavailable_reason

        why = unavailable_reason()
        if why is not None:
            log(f"hosts: failover skipped: {why}")
            return
        log("hosts: failover, synchronous and asynchronous standby")
        logging.getLogger("psycopg.pool").setLevel(logging.CRITICAL)  # the outage, as expected
        logging.getLogger("psycopg").setLevel(logging.CRITICAL)
        table, results = await asyncio.to_thread(
            failover.measure, self.server.admin_url, reps=self.plan.reps)
        table.print()
        self.record("failover", {"results": results})


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bench.run", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a smoke run of every section, "
                        "smaller and with one repetition (under two minutes)")
    parser.add_argument("--sections", default=",".join(SECTIONS),
                        help=f"comma-separated, from {', '.join(SECTIONS)}")
    parser.add_argument("--skip", default="", help="comma-separated sections to leave out")
    parser.add_argument("--reps", type=int, help="repetitions per figure (default 3; quick 1)")
    parser.add_argument("--runs", type=int, help="runs per throughput drain, for every K")
    parser.add_argument("--workers", type=int, help="worker processes (default 2)")
    parser.add_argument("--concurrency", type=int, help="runs per worker (default 32)")
    parser.add_argument("--scale-rows", type=int, help="finished runs loaded for the scale "
                        "section (default 1,000,000)")
    parser.add_argument("--latency-samples", type=int, help="samples per latency repetition")
    parser.add_argument("--load-fraction", type=float,
                        help="the latency section's load stream, as a share of the K=3 drain "
                             "rate it measures first (default 0.3)")
    parser.add_argument("--memory-runs", type=int, help="queued runs for the memory section")
    parser.add_argument("--console-steps", type=int, help="tool calls of the run the console "
                        "section's SSE clients follow (default 200; quick 40)")
    parser.add_argument("--console-clients", type=int, help="SSE clients of the console "
                        "section (default 10; quick 2)")
    parser.add_argument("--console-rows", type=int, help="finished runs behind the console's "
                        "pages (default 1,000,000, kept between runs; quick 20,000)")
    parser.add_argument("--console-page-requests", type=int, help="timed requests of each "
                        "console page (default 100; quick 10)")
    parser.add_argument("--console-sse-clients", type=int, help="SSE clients beside the K=3 "
                        "drains (default 200; quick 20)")
    parser.add_argument("--console-sse-runs", type=int, help="K=3 runs per drain beside them "
                        "(default 12,000; quick 500)")
    parser.add_argument("--console-sse-rounds", type=int, help="drains with and without the "
                        "clients, each (default 5; quick 1)")
    parser.add_argument("--console-parts", help="of the console section: latency, pages, sse "
                        "(comma-separated; default all)")
    parser.add_argument("--telemetry-runs", type=int, help="K=3 runs per drain of the "
                        "telemetry section (default 20000)")
    parser.add_argument("--recovery-runs", type=int, help="in-flight runs killed (default 100)")
    parser.add_argument("--lease-ttl", type=float, help="lease ttl for the recovery section "
                        "(default: the engine's default; quick: 3 s)")
    parser.add_argument("--server", help="admin URL of the PostgreSQL server to use "
                        "(default: 127.0.0.1:5432, else ORCHESTRATOR_DATABASE_URL's server)")
    parser.add_argument("--engine", metavar="REF",
                        help="measure a committed revision of the engine (e.g. HEAD) from a "
                        "snapshot, not the work tree that others may be editing")
    parser.add_argument("--profile-stacks", metavar="FILE",
                        help="profile section: also write py-spy's collapsed stacks to FILE "
                        "(one line per stack and its count: the input of a flame graph)")
    parser.add_argument("--no-record", action="store_true",
                        help="do not append to bench/results/results.jsonl")
    return parser.parse_args(argv)


async def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    unknown = [s for s in [*wanted, *skip] if s not in SECTIONS]
    if unknown:
        print(f"unknown section(s): {', '.join(unknown)}; choose from {', '.join(SECTIONS)}",
              file=sys.stderr)
        return 2
    sections = [s for s in SECTIONS if s in wanted and s not in skip]
    if args.engine and not os.environ.get("BENCH_ENGINE_DIR"):
        folder, sha = snapshot_engine(args.engine)
        env = {**os.environ, "BENCH_ENGINE_DIR": str(folder), "BENCH_ENGINE_COMMIT": sha,
               "PYTHONPATH": os.pathsep.join([str(folder), os.environ.get("PYTHONPATH", "")])}
        os.chdir(folder)
        os.execve(sys.executable, [sys.executable, "-m", "bench.run", *sys.argv[1:]], env)
    plan = plan_from(args)
    server = Server.find(args.server)
    git = git_commit()
    engine = engine_state()
    import orchestrator

    engine["engine_path"] = str(Path(orchestrator.__file__).parent)
    context = {"git": git, "engine": engine, "machine": machine_info(server), "argv": sys.argv[1:],
               "quick": plan.quick}
    suite = Suite(server, plan, context, sections=tuple(sections))
    if args.no_record:
        suite.record = lambda section, payload: None  # type: ignore[method-assign]
    print(f"bench: {', '.join(sections)} on {server.source} "
          f"({'quick' if plan.quick else 'full'}; {plan.reps} repetition(s); "
          f"engine {(engine['engine_commit'] or '?')[:10]}"
          f"{' snapshot' if engine['engine_snapshot'] else ''}"
          f"{' + local changes' if engine['engine_dirty'] else ''} from "
          f"{engine['engine_path']})", flush=True)
    started = time.monotonic()
    failed = []
    for name in sections:
        t0 = time.monotonic()
        try:
            await getattr(suite, f"section_{name}")()
        except Exception as exc:  # noqa: BLE001 - one broken section must not hide the others
            traceback.print_exc()
            print(f"\n== {name}: failed: {type(exc).__name__}: {exc}", flush=True)
            failed.append(name)
        log(f"{name} took {time.monotonic() - t0:.0f}s")
        now = engine_state()
        if (now["engine_commit"], now["engine_dirty"]) != (engine["engine_commit"],
                                                          engine["engine_dirty"]):
            print(f"\nwarning: the engine in the work tree changed during `{name}` (now "
                  f"{(now['engine_commit'] or '?')[:10]}"
                  f"{' + local changes' if now['engine_dirty'] else ''}); figures taken "
                  "before and after are not comparable; --engine HEAD measures a snapshot",
                  flush=True)
            engine = now
    print(f"\nbench: done in {time.monotonic() - started:.0f}s"
          + (f"; failed: {', '.join(failed)}" if failed else "")
          + ("" if args.no_record else "; results appended to bench/results/results.jsonl"),
          flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
