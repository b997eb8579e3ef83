"""Our engine under load: drain throughput, idle latency, recovery after SIGKILL, worker memory.

Workers are real processes (``python -m orchestrator worker --app bench.app:app``); the driver
submits through the public API. To start every worker on the same starting line, submitted runs
are held (``available_at`` cleared, so nothing claims them) until all workers have registered,
then released with one UPDATE and a NOTIFY: the same thing the engine does when a timer fires.
Rates use the database's clock: from just before the release to the last ``finished_at``.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from statistics import median
from typing import Any

import psycopg  # noqa: TID251 - fixtures and progress queries

from bench.app import build_app, dropping_provider
from bench.common import (
    CpuMeter,
    Proc,
    Server,
    children_of,
    fetch_one,
    log,
    migrate,
    parent_of,
    percentile,
    rss_kib,
    rss_peak_kib,
    spawn,
)

S = "orchestrator"


@dataclass
class Setup:
    workers: int
    concurrency: int
    pool_size: int
    lease_ttl: float | None = None
    floor: bool = False  # bench.floor processes (the engine's writes alone), not workers
    # "off"; "metrics": each worker serves --metrics-port, scraped every SCRAPE_INTERVAL
    # during a drain; "tracing": each worker has the OpenTelemetry SDK, its spans dropped;
    # "tracing-sampled": the same with a parent-based sampler keeping 1 trace in 10
    telemetry: str = "off"
    env: dict[str, str] | None = None  # more environment for the worker processes


TRACING_RATIOS = {"tracing": 1.0, "tracing-sampled": 0.1}
"""The share of traces each tracing arm samples."""

def sdk_span_cost(spans: int = 20_000, rounds: int = 5) -> float:
    """Microseconds the OpenTelemetry SDK takes to start and end one span with no attribute,
    in this process, the provider configured as the ``tracing`` arm's (every span sampled, a
    batching processor, an exporter that drops them): the least a span can cost a worker, which
    pays it under load, with attributes, among its other work. The median of ``rounds``."""
    import timeit

    provider = dropping_provider()
    tracer = provider.get_tracer("bench")
    try:
        times = timeit.repeat(lambda: tracer.start_span("call tool").end(), number=spans,
                              repeat=rounds)
    finally:
        provider.shutdown()
    return median(times) / spans * 1e6


SCRAPE_INTERVAL = 1.0
"""Seconds between two scrapes of each worker's /metrics in the ``metrics`` arm (Prometheus
scrapes every 15 s by default: this is fifteen times its load)."""


def worker_args(concurrency: int, *, floor_k: int | None = None) -> list[str]:
    if floor_k is not None:
        return [sys.executable, "-m", "bench.floor", "--k", str(floor_k),
                "--concurrency", str(concurrency)]
    return [sys.executable, "-m", "orchestrator", "worker", "--app", "bench.app:app",
            "--concurrency", str(concurrency)]


async def start_workers(url: str, setup: Setup, count: int | None = None,
                        prefix: str = "worker", k: int | None = None) -> list[Proc]:
    env = {"ORCHESTRATOR_DATABASE_URL": url, "BENCH_POOL_SIZE": str(setup.pool_size),
           **(setup.env or {})}
    if setup.lease_ttl is not None:
        env["BENCH_LEASE_TTL"] = str(setup.lease_ttl)
    n = setup.workers if count is None else count
    if setup.floor and k is None:
        raise ValueError("bench.floor processes drive runs of one K; give k")
    args = worker_args(setup.concurrency, floor_k=k if setup.floor else None)
    if setup.telemetry in TRACING_RATIOS:
        env["BENCH_TRACING"] = str(TRACING_RATIOS[setup.telemetry])
    procs = []
    for i in range(n):
        port = free_port() if setup.telemetry == "metrics" else None
        extra = [] if port is None else ["--metrics-port", str(port)]
        proc = await spawn(args + extra, name=f"{prefix}-{i}", env=env)
        proc.metrics_port = port
        procs.append(proc)
    return procs


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def scrape_every(procs: Sequence[Proc], interval: float, counted: dict[str, int]
                       ) -> None:
    """Scrape each worker's /metrics every ``interval`` seconds until cancelled (counting
    the scrapes and the bytes)."""
    import httpx

    ports = [p.metrics_port for p in procs if p.metrics_port is not None]
    async with httpx.AsyncClient(timeout=10) as http:
        while True:
            for port in ports:
                answer = await http.get(f"http://127.0.0.1:{port}/metrics")
                answer.raise_for_status()
                counted["scrapes"] += 1
                counted["bytes"] += len(answer.content)
            await asyncio.sleep(interval)


async def wait_registered(url: str, pids: Sequence[int], procs: Sequence[Proc],
                          timeout: float = 60.0) -> None:
    """Until every worker process has a row in orchestrator.workers (it is claiming then)."""
    deadline = time.monotonic() + timeout
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        while True:
            cur = await conn.execute(f"SELECT pid FROM {S}.workers")
            seen = {row[0] for row in await cur.fetchall()}
            if set(pids) <= seen:
                return
            for p in procs:
                if not p.alive():
                    raise RuntimeError(f"{p.name} exited:\n" + "\n".join(p.tail[-20:]))
            if time.monotonic() > deadline:
                tails = "\n".join("\n".join(p.tail[-10:]) for p in procs)
                raise TimeoutError(f"workers did not register within {timeout}s\n{tails}")
            await asyncio.sleep(0.05)


async def submit_many(url: str, workflow: str, n: int, *, parallel: int = 16,
                      pool_size: int = 16) -> list[uuid.UUID]:
    """Submit ``n`` runs through the public API, ``parallel`` at a time."""
    orch = build_app(url, pool_size=pool_size)
    ids: list[uuid.UUID] = []
    gate = asyncio.Semaphore(parallel)

    async def one(i: int) -> None:
        async with gate:
            handle = await orch.submit_async(workflow, {"n": i})
            ids.append(handle.id)

    try:
        if n:  # one first: concurrent first calls would each open a pool
            await one(0)
        await asyncio.gather(*(one(i) for i in range(1, n)))
    finally:
        await orch.database.close()
    return ids


async def hold(url: str, ids: Sequence[uuid.UUID]) -> None:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute(
            f"UPDATE {S}.runs SET available_at = NULL WHERE id = ANY(%s) AND status = 'queued'",
            (list(ids),))


async def release(conn: psycopg.AsyncConnection[Any], ids: Sequence[uuid.UUID]) -> Any:
    async with conn.transaction():
        cur = await conn.execute(
            f"UPDATE {S}.runs SET available_at = now() WHERE id = ANY(%s) AND status = 'queued' "
            "RETURNING now()", (list(ids),))
        row = await cur.fetchone()
        await conn.execute("SELECT pg_notify('orchestrator_runs', '')")
    return row[0] if row else None


async def unfinished(conn: psycopg.AsyncConnection[Any]) -> int:
    """Runs not yet finished, counted through the engine's partial indexes (cheap at scale).

    Each count names a partial index's whole predicate: ready runs are counted apart with and
    without a queue, because no index covers both, and a count over both reads every run of
    the table (with 1,000,000 finished runs in it, that poll alone cost the server more than
    the drain it watched)."""
    row = await fetch_one(
        conn, f"""SELECT (SELECT count(*) FROM {S}.runs
                          WHERE status IN ('queued', 'waiting') AND available_at IS NOT NULL
                            AND queue IS NULL)
                       + (SELECT count(*) FROM {S}.runs
                          WHERE status IN ('queued', 'waiting') AND available_at IS NOT NULL
                            AND queue IS NOT NULL)
                       + (SELECT count(*) FROM {S}.runs WHERE status = 'running')""")
    return int(row[0])


async def unfinished_of(conn: psycopg.AsyncConnection[Any], ids: Sequence[uuid.UUID]) -> int:
    """Runs of ``ids`` not yet finished (by primary key)."""
    row = await fetch_one(
        conn, f"""SELECT count(*) FROM {S}.runs WHERE id = ANY(%s)
                  AND status NOT IN ('succeeded', 'failed', 'cancelled')""", (list(ids),))
    return int(row[0])


async def server_processes(conn: psycopg.AsyncConnection[Any]) -> list[int]:
    """The processes of the PostgreSQL server behind ``conn`` when it runs on this machine
    (the children of its postmaster), else nothing: the backend's pid is only ours to read
    if a local postgres process has it."""
    backend = (await fetch_one(conn, "SELECT pg_backend_pid()"))[0]
    postmaster = parent_of(backend)
    if postmaster is None or not (_is_postgres(backend) and _is_postgres(postmaster)):
        return []
    return children_of(postmaster)


def _is_postgres(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/comm").read_text().startswith("postgres")
    except OSError:
        return False


async def drain(url: str, ids: Sequence[uuid.UUID], procs: Sequence[Proc], *,
                timeout: float, meter: CpuMeter | None = None, only: bool = False
                ) -> tuple[float, dict[str, int]]:
    """Release the held runs, wait until none is left, return (seconds, statuses). With
    ``meter``, the CPU of the worker processes and of the server (when it is local) is
    measured from the release until the last run has finished. With ``only``, other runs
    of the database may go on: the wait is for ``ids`` alone."""
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        t0 = (await fetch_one(conn, "SELECT clock_timestamp()"))[0]
        server = await server_processes(conn) if meter is not None else []
        if meter is not None:
            meter.start({"worker": [p.pid for p in procs], "server": server})
        await release(conn, ids)
        deadline = time.monotonic() + timeout
        while await (unfinished_of(conn, ids) if only else unfinished(conn)) > 0:
            for p in procs:
                if not p.alive():
                    raise RuntimeError(f"{p.name} exited:\n" + "\n".join(p.tail[-20:]))
            if time.monotonic() > deadline:
                raise TimeoutError(f"runs still unfinished after {timeout}s")
            await asyncio.sleep(0.1)
        if meter is not None:  # backends the workers opened during the drain count too
            meter.stop({"worker": [p.pid for p in procs],
                        "server": sorted({*server, *await server_processes(conn)})})
        cur = await conn.execute(
            f"SELECT status, count(*), max(finished_at) FROM {S}.runs WHERE id = ANY(%s) "
            "GROUP BY status", (list(ids),))
        rows = await cur.fetchall()
    statuses = {r[0]: int(r[1]) for r in rows}
    t1 = max((r[2] for r in rows if r[2] is not None), default=None)
    if t1 is None:
        raise RuntimeError("no run finished")
    return (t1 - t0).total_seconds(), statuses


async def throughput_once(server: Server, *, k: int, n: int, setup: Setup, url: str | None = None,
                          timeout: float = 600.0, profile: bool = False,
                          workflow: str | None = None,
                          stacks: Path | None = None) -> dict[str, Any]:
    """One drain of ``n`` runs of K steps on a fresh database (or ``url``, already migrated).

    With ``profile``, the first worker process is sampled by py-spy during the drain (its
    collapsed stacks copied to ``stacks`` if given).
    ``workflow``: another workflow of K steps than ``k{K}`` (``k3q``: in a queue).
    """
    own = url is None
    if url is None:
        url = server.create_database("tp")
        migrate(url)
    try:
        ids = await submit_many(url, workflow or f"k{k}", n)
        await hold(url, ids)
        procs = await start_workers(url, setup, k=k)
        try:
            await wait_registered(url, [p.pid for p in procs], procs)
            meter = CpuMeter()
            extra: dict[str, Any]
            if profile:
                from bench.profile import Recorder

                async with Recorder(procs[0].pid, keep=stacks) as recorder:
                    seconds, statuses = await drain(url, ids, procs, timeout=timeout,
                                                    meter=meter)
                extra = {"profile": recorder.summary()}
            elif setup.telemetry == "metrics":
                counted = {"scrapes": 0, "bytes": 0}
                scraping = asyncio.ensure_future(scrape_every(procs, SCRAPE_INTERVAL, counted))
                try:
                    seconds, statuses = await drain(url, ids, procs, timeout=timeout,
                                                    meter=meter)
                finally:
                    scraping.cancel()
                    with contextlib.suppress(asyncio.CancelledError):
                        await scraping
                extra = {"scrapes": counted["scrapes"], "scrape_bytes": counted["bytes"]}
            else:
                seconds, statuses = await drain(url, ids, procs, timeout=timeout, meter=meter)
                extra = {}
        finally:
            await asyncio.gather(*(p.stop() for p in procs))
    finally:
        if own:
            server.drop_database(url)
    ok = statuses.get("succeeded", 0)
    if ok != n:
        log(f"k={k}: {n - ok} of {n} runs did not succeed: {statuses}")
    return {"k": k, "runs": n, "seconds": seconds, "runs_per_s": ok / seconds,
            "steps_per_s": ok * k / seconds, "statuses": statuses, **cpu_per_step(meter, n * k),
            **extra}


def cpu_per_step(meter: CpuMeter, steps: int) -> dict[str, float | None]:
    """CPU microseconds per step, worker processes and server, the part of each spent in the
    kernel (system time: on loopback TCP a ``send()`` does the receiving side's work too), and
    the machine's busy share (None where it could not be measured: no /proc, or a server on
    another machine)."""
    def per_step(used: float | None) -> float | None:
        return None if used is None else used / steps * 1e6

    return {"worker_cpu_us_per_step": per_step(meter.used.get("worker")),
            "server_cpu_us_per_step": per_step(meter.used.get("server")),
            "worker_sys_us_per_step": per_step(meter.system.get("worker")),
            "server_sys_us_per_step": per_step(meter.system.get("server")),
            "machine_busy": meter.busy}


async def latency_once(server: Server, *, samples: int, warmup: int = 10,
                       url: str | None = None, setup: Setup | None = None,
                       load_rate: float | None = None) -> dict[str, Any]:
    """Sequential K=1 runs: submit → first step, submit → result.

    Idle by default (one worker, concurrency 10). With ``load_rate``, a separate process
    (``bench.load``) submits K=3 runs at that rate to ``setup``'s workers meanwhile.
    """
    own = url is None
    if url is None:
        url = server.create_database("lat")
        migrate(url)
    orch = build_app(url, pool_size=4)
    setup = setup or Setup(workers=1, concurrency=10, pool_size=4)
    first: list[float] = []
    result: list[float] = []
    parts: dict[str, list[float]] = {"submit": [], "to_body": [], "body_to_call": []}
    ids: list[uuid.UUID] = []
    load: Proc | None = None
    extra: dict[str, Any] = {}
    try:
        procs = await start_workers(url, setup)
        try:
            await wait_registered(url, [p.pid for p in procs], procs)
            if load_rate:
                load = await spawn([sys.executable, "-m", "bench.load", "--url", url,
                                    "--rate", str(load_rate)], name="load")
                await load.expect("@ready", 60)
                await asyncio.sleep(2.0)  # let the stream reach a steady state
            meter, pids = CpuMeter(), await _latency_processes(url, procs, load)
            for i in range(warmup + samples):
                if i == warmup:
                    meter.start(pids)
                    started = time.monotonic()
                t0 = time.time()
                handle = await orch.submit_async("k1", {"n": i})
                t1 = time.time()
                out = await handle.result_async(timeout=30)
                t2 = time.time()
                if i >= warmup:
                    first.append(out["first_t"] - t0)
                    parts["submit"].append(t1 - t0)
                    parts["to_body"].append(out["began_t"] - t1)
                    parts["body_to_call"].append(out["first_t"] - out["began_t"])
                    result.append(t2 - t0)
                    ids.append(handle.id)
                await asyncio.sleep(0.01)  # idle between samples
            meter.stop(pids)
            extra.update(cores_used(meter, time.monotonic() - started))
            extra.update(await commit_probe(url))  # in the same conditions, load or not
            if load is not None:
                async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                    extra["backlog_at_end"] = await unfinished(conn)
                await load.stop()
                line = await load.expect("@submitted", 30)
                extra["load_submitted"] = int(line.split()[1])
        finally:
            if load is not None:
                await load.stop()
            await asyncio.gather(*(p.stop() for p in procs))
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            cur = await conn.execute(
                f"SELECT extract(epoch FROM finished_at - created_at) FROM {S}.runs "
                "WHERE id = ANY(%s)", (ids,))
            db = [float(r[0]) for r in await cur.fetchall()]
    finally:
        await orch.database.close()
        if own:
            server.drop_database(url)
    split = {f"{name}_p50": percentile(values, 50) for name, values in parts.items()}
    return {"samples": samples, **summary("first_step", first), **summary("result", result),
            **split,
            **summary("db_created_to_finished", db), **extra}


async def _latency_processes(url: str, procs: Sequence[Proc], load: Proc | None
                             ) -> dict[str, list[int]]:
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        server = await server_processes(conn)
    return {"workers": [p.pid for p in procs], "server": server,
            "load": [load.pid] if load is not None else [], "driver": [os.getpid()]}


def cores_used(meter: CpuMeter, seconds: float) -> dict[str, float]:
    """CPU used during the samples, in cores (CPU seconds per second), by kind of process,
    and the machine's busy share; only what could be measured (a remote server's processes
    or a machine without /proc leave their figures out)."""
    out = {f"cores_{kind}": used / seconds for kind, used in meter.used.items()}
    if meter.busy is not None:
        out["machine_busy"] = meter.busy
    return out


async def commit_probe(url: str, samples: int = 100, gap: float = 0.01) -> dict[str, float]:
    """A lone single-row INSERT + COMMIT, ``gap`` seconds apart, on a scratch table: the
    floor under every write on the way to a first step (submit, claim, write-ahead) in the
    conditions of the latency run (an idle host wakes up for each; a loaded one queues it
    behind other commits' WAL flushes)."""
    times: list[float] = []
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        await conn.execute("CREATE TABLE IF NOT EXISTS bench_commit_probe (x int)")
        for _ in range(samples):
            await asyncio.sleep(gap)
            t0 = time.perf_counter()
            await conn.execute("INSERT INTO bench_commit_probe VALUES (1)")
            times.append(time.perf_counter() - t0)
        await conn.execute("DROP TABLE bench_commit_probe")
    return {"lone_commit_p50": percentile(times, 50), "lone_commit_p99": percentile(times, 99)}


def summary(name: str, values: Sequence[float]) -> dict[str, float]:
    return {f"{name}_p50": percentile(values, 50), f"{name}_p99": percentile(values, 99),
            f"{name}_max": max(values) if values else float("nan")}


async def recovery_once(server: Server, *, runs: int, lease_ttl: float,
                        timeout: float = 180.0) -> dict[str, Any]:
    """SIGKILL a worker holding ``runs`` in-flight runs; time until each runs again elsewhere.

    Two moments per run, from the kill: *claimed* (another worker holds its lease, seen by
    polling every 20 ms) and *re-dispatched* (that worker wrote the retried step's
    ``submitted``: the run is really running again; database clock).
    """
    url = server.create_database("rec")
    migrate(url)
    setup = Setup(workers=1, concurrency=max(runs, 10), pool_size=10, lease_ttl=lease_ttl)
    try:
        victim = (await start_workers(url, setup, prefix="victim"))[0]
        rescuer: Proc | None = None
        try:
            await wait_registered(url, [victim.pid], [victim])
            ids = await submit_many(url, "hold", runs)
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
                async def all_in_flight() -> bool:
                    row = await fetch_one(
                        conn, f"SELECT count(*) FROM {S}.operations WHERE run_id = ANY(%s) "
                        "AND state = 'submitted'", (ids,))
                    return int(row[0]) == runs

                await _wait(all_in_flight, 60, "runs in flight on the victim")
                rescuer = (await start_workers(url, setup, prefix="rescuer"))[0]
                await wait_registered(url, [victim.pid, rescuer.pid], [victim, rescuer])
                os.kill(victim.pid, signal.SIGKILL)
                killed = time.time()
                killed_db = (await fetch_one(conn, "SELECT clock_timestamp()"))[0]
                claimed: dict[uuid.UUID, float] = {}
                marker = f"%:{rescuer.pid}:%"
                deadline = time.monotonic() + timeout
                while len(claimed) < runs:
                    cur = await conn.execute(
                        f"SELECT id FROM {S}.runs WHERE id = ANY(%s) AND lease_owner LIKE %s",
                        (ids, marker))
                    now = time.time()
                    for (rid,) in await cur.fetchall():
                        claimed.setdefault(rid, now - killed)
                    if time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.02)

                async def redispatched() -> bool:
                    row = await fetch_one(
                        conn, f"SELECT count(DISTINCT run_id) FROM {S}.operations "
                        "WHERE run_id = ANY(%s) AND attempt > 1", (ids,))
                    return int(row[0]) >= runs

                await _wait(redispatched, 30, "retried steps")
                cur = await conn.execute(
                    f"SELECT extract(epoch FROM min(submitted_at) - %s) FROM {S}.operations "
                    "WHERE run_id = ANY(%s) AND attempt > 1 GROUP BY run_id", (killed_db, ids))
                again = [float(r[0]) for r in await cur.fetchall()]
        finally:
            await victim.stop(signal.SIGKILL)
            if rescuer is not None:
                await rescuer.stop(signal.SIGKILL)
    finally:
        server.drop_database(url)
    claims = list(claimed.values())
    return {"runs": runs, "lease_ttl": lease_ttl, "recovered": len(again),
            **summary("claimed", claims), **summary("redispatched", again)}


async def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await predicate():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def memory_once(server: Server, *, runs: int, concurrency: int, k: int = 3,
                      pool_size: int = 10) -> dict[str, Any]:
    """Peak RSS of one worker that drains ``runs`` queued runs at ``concurrency``."""
    url = server.create_database("mem")
    migrate(url)
    setup = Setup(workers=1, concurrency=concurrency, pool_size=pool_size)
    try:
        ids = await submit_many(url, f"k{k}", runs)
        await hold(url, ids)
        proc = (await start_workers(url, setup, prefix="mem"))[0]
        samples: list[int] = []
        try:
            await wait_registered(url, [proc.pid], [proc])
            idle = rss_kib(proc.pid)
            sampler_stop = asyncio.Event()

            async def sample() -> None:
                while not sampler_stop.is_set():
                    value = rss_kib(proc.pid)
                    if value:
                        samples.append(value)
                    await asyncio.sleep(0.1)

            sampler = asyncio.ensure_future(sample())
            seconds, statuses = await drain(url, ids, [proc], timeout=900)
            sampler_stop.set()
            await sampler
            peak = rss_peak_kib(proc.pid)
        finally:
            await proc.stop()
    finally:
        server.drop_database(url)
    return {"runs": runs, "concurrency": concurrency, "k": k, "idle_rss_mib": (idle or 0) / 1024,
            "peak_rss_mib": (peak or 0) / 1024,
            "sampled_max_rss_mib": max(samples, default=0) / 1024, "seconds": seconds,
            "succeeded": statuses.get("succeeded", 0)}
