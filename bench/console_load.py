"""What the console's live streams cost the workers: K=3 throughput with and without 200
clients of ``GET /api/runs/{id}/events`` on one console process.

Each round is one drain of bench/ours.py (``runs`` K=3 runs on a fresh database, held, then
released to ``workers`` processes, timed on the database's clock), beside the same background
in both arms: one ``orchestrator console`` process, and a third worker process (concurrency
``clients``, serving only bench/stream_latency.py's ``paced_steps``) running ``clients`` runs
that call a tool every 0 to 1 s for longer than the round lasts. In the arm with clients, one
HTTP client per paced run follows it from before the release until after the drain (each
receives about two events a second, every one of its run's entries); in the other nobody
follows anything. So the difference between the arms is the streams alone: the console's work
for them (its poller, the journal pages, the SSE answers), the database's, and the clients'.

The clients are plain sockets in the driver's process (a request, then the response's bytes
counted, no parsing beyond counting events): they stand for browsers on other machines, and
the CPU they use here is reported beside the console's.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
import secrets
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import psycopg  # noqa: TID251 - progress queries

from bench import ours
from bench.common import CpuMeter, Server, cpu_seconds, log, migrate, spawn
from bench.console_pages import free_port, listening
from bench.profile import Recorder
from bench.stream_latency import OWNER, paced_steps
from bench.stream_latency import app as paced_app
from orchestrator import Orchestrator

PACED_STEPS = 150
PACED_MAX_PAUSE_MS = 1000


def _process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class Follower:
    """One SSE client on a raw socket: counts the events of one run's stream."""

    def __init__(self, port: int, token: str, run_id: uuid.UUID) -> None:
        self.port, self.token, self.run_id = port, token, run_id
        self.events = 0
        self.status: int | None = None
        self.first = asyncio.Event()  # the stream answered and sent its first event

    async def follow(self) -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            writer.write(f"GET /api/runs/{self.run_id}/events HTTP/1.1\r\n"
                         f"Host: 127.0.0.1\r\nAuthorization: Bearer {self.token}\r\n"
                         "Accept: text/event-stream\r\nConnection: close\r\n\r\n".encode())
            await writer.drain()
            head = await reader.readuntil(b"\r\n\r\n")
            self.status = int(head.split(b" ", 2)[1])
            while chunk := await reader.read(65536):
                self.events += chunk.count(b"\nevent: ")
                if self.events:
                    self.first.set()
        finally:
            self.first.set()
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()


async def _console(url: str, token: str, port: int) -> Any:
    folder = tempfile.mkdtemp(prefix="bench-console-")
    tokens = Path(folder) / "tokens"
    tokens.write_text(f"bench {token}\n")
    proc = await spawn([sys.executable, "-m", "orchestrator", "--database-url", url, "console",
                        "--port", str(port), "--token-file", str(tokens)], name="console",
                       env={"ORCHESTRATOR_DATABASE_URL": url})
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        await listening(http, proc.proc)
    return proc


async def round_once(server: Server, *, runs: int, clients: int, follow: bool,
                     setup: ours.Setup, profile: bool = False) -> dict[str, Any]:
    """One drain with the background running, and ``clients`` followers if ``follow``;
    with ``profile``, py-spy samples the console process during the drain."""
    url = server.create_database("sse")
    token = secrets.token_urlsafe(32)
    port = free_port()
    procs = []
    tasks: list[asyncio.Task[None]] = []
    try:
        migrate(url)
        ids = await ours.submit_many(url, "k3", runs)
        await ours.hold(url, ids)
        console = await _console(url, token, port)
        procs.append(console)
        paced = await spawn([sys.executable, "-m", "orchestrator", "worker", "--app",
                             "bench.stream_latency:app", "--concurrency", str(clients)],
                            name="paced-worker", env={"ORCHESTRATOR_DATABASE_URL": url})
        procs.append(paced)
        client = Orchestrator(url, default_owner=OWNER)
        client.registry = paced_app.registry
        try:
            handles = [await client.submit_async(paced_steps, {
                "steps": PACED_STEPS, "max_pause_ms": PACED_MAX_PAUSE_MS})
                for _ in range(clients)]
        finally:
            await client.database.close()
        workers = await ours.start_workers(url, setup, k=3)
        procs.extend(workers)
        await ours.wait_registered(url, [p.pid for p in workers], workers)
        await _all_running(url, [h.id for h in handles])
        followers = [Follower(port, token, h.id) for h in handles] if follow else []
        tasks = [asyncio.create_task(f.follow()) for f in followers]
        await asyncio.wait_for(asyncio.gather(*(f.first.wait() for f in followers)), 60)
        await asyncio.sleep(1.0)  # every stream past its first page, at its steady pace
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as watch:
            backends = await _backends_of(watch, console.pid)
            side = CpuMeter()
            side.start({"console_db": backends})
            before = {"console": cpu_seconds(console.pid), "paced": cpu_seconds(paced.pid),
                      "driver": _process_cpu(), "events": sum(f.events for f in followers),
                      "xacts": await _statements(watch)}
            meter = CpuMeter()
            started = time.monotonic()
            async with (Recorder(console.pid) if profile
                        else contextlib.nullcontext()) as recorder:
                seconds, statuses = await ours.drain(url, ids, workers, timeout=600,
                                                     meter=meter, only=True)
            wall = time.monotonic() - started
            used = {"console": cpu_seconds(console.pid), "paced": cpu_seconds(paced.pid),
                    "driver": _process_cpu(), "xacts": await _statements(watch)}
            side.stop({"console_db": sorted({*backends,
                                             *await _backends_of(watch, console.pid)})})
        events = sum(f.events for f in followers) - before["events"]
        open_streams = sum(1 for t in tasks if not t.done())
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await asyncio.gather(*(p.stop() for p in procs), return_exceptions=True)
        server.drop_database(url)
    ok = statuses.get("succeeded", 0)
    if ok != runs:
        log(f"console sse: {runs - ok} of {runs} runs did not succeed: {statuses}")

    def cores(kind: str) -> float | None:
        a, b = before[kind], used[kind]
        return None if a is None or b is None else (b - a) / wall

    return {"follow": follow, "clients": clients if follow else 0, "runs": runs,
            "seconds": seconds, "steps_per_s": ok * 3 / seconds, "wall": wall,
            "open_streams_at_end": open_streams, "events_during_drain": events,
            "cores_console": cores("console"), "cores_paced_worker": cores("paced"),
            "cores_driver": cores("driver"),
            "cores_console_db": (side.used["console_db"] / wall
                                 if "console_db" in side.used else None),
            "console_backends": len(backends),
            "xacts_per_s": (used["xacts"] - before["xacts"]) / wall,
            **({"profile": recorder.summary()} if recorder is not None else {}),
            **ours.cpu_per_step(meter, runs * 3)}


def _sockets_of(pid: int) -> set[int]:
    """The local ports of ``pid``'s TCP connections to the server on 127.0.0.1:5432."""
    try:
        out = subprocess.run(["ss", "-tnpH", "state", "established", "dst", "127.0.0.1:5432"],
                             capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        return set()
    ports = set()
    for line in out.splitlines():
        if f"pid={pid}," in line:
            local = next(w for w in line.split() if w.startswith("127.0.0.1:"))
            ports.add(int(local.rsplit(":", 1)[1]))
    return ports


async def _backends_of(conn: psycopg.AsyncConnection[Any], pid: int) -> list[int]:
    """The server processes serving ``pid``'s connections (its pool), when both are local."""
    ports = _sockets_of(pid)
    if not ports:
        return []
    cur = await conn.execute("SELECT pid FROM pg_stat_activity WHERE client_port = ANY(%s)",
                             (sorted(ports),))
    return [int(row[0]) for row in await cur.fetchall()]


async def _statements(conn: psycopg.AsyncConnection[Any]) -> int:
    """Transactions committed in this database so far (an autocommit statement is one)."""
    cur = await conn.execute("SELECT pg_stat_get_db_xact_commit(oid) FROM pg_database "
                             "WHERE datname = current_database()")
    row = await cur.fetchone()
    return int(row[0]) if row else 0


async def _all_running(url: str, ids: list[uuid.UUID], timeout: float = 60) -> None:
    """Until every paced run has been claimed (its first step is under way)."""
    deadline = time.monotonic() + timeout
    async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
        while True:
            cur = await conn.execute(
                "SELECT count(*) FROM orchestrator.runs WHERE id = ANY(%s) AND revision > 0",
                (ids,))
            row = await cur.fetchone()
            if row is not None and row[0] >= len(ids):
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the paced runs did not all start within 60 s")
            await asyncio.sleep(0.1)


async def compare(server: Server, *, runs: int, clients: int, rounds: int,
                  setup: ours.Setup) -> list[dict[str, Any]]:
    """``rounds`` pairs, the arms alternating which goes first."""
    out = []
    for i in range(rounds):
        order = (False, True) if i % 2 == 0 else (True, False)
        for follow in order:
            log(f"console sse: round {i + 1}/{rounds}, "
                f"{'with' if follow else 'without'} {clients} clients")
            out.append(await round_once(server, runs=runs, clients=clients, follow=follow,
                                        setup=setup))
    return out


if __name__ == "__main__":  # a smoke run: python -m bench.console_load
    result = asyncio.run(round_once(Server.find(), runs=int(os.environ.get("RUNS", "500")),
                                    clients=int(os.environ.get("CLIENTS", "20")),
                                    follow=True, setup=ours.Setup(2, 32, 16)))
    print(result)
