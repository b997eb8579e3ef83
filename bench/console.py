"""The console's live timeline, measured: how long a committed journal entry takes to reach a
client of ``GET /api/runs/{id}/events`` (Server-Sent Events, docs/console.md).

On a fresh database, a worker process runs one ``paced_steps`` run of bench/stream_latency.py
(a tool called ``steps`` times, pausing a random 0 to ``max_pause_ms`` each time, so entries
commit at irregular moments), and ``orchestrator console`` serves it in another process;
``clients`` HTTP clients in this process follow the run's events from the start. For each
event, the delay is the time it was parsed minus the entry's ``at`` (its transaction's start
by the database's clock, a little before the commit: the figures are upper bounds).
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import socket
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx

from bench.common import Server, migrate, percentile
from bench.console_pages import listening
from bench.stream_latency import OWNER, app, paced_steps
from orchestrator import Orchestrator

ROOT = Path(__file__).resolve().parents[1]
APP = "bench.stream_latency:app"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def _follow(http: httpx.AsyncClient, path: str) -> list[float]:
    """The delays of one client's events, until the stream ends (the run's terminal entry)."""
    delays: list[float] = []
    async with http.stream("GET", path) as answer:
        answer.raise_for_status()
        async for line in answer.aiter_lines():
            if line.startswith("data: "):
                at = datetime.fromisoformat(json.loads(line[6:])["at"])
                delays.append(time.time() - at.timestamp())
    return delays


async def measure(url: str, *, steps: int, max_pause_ms: int, clients: int) -> list[float]:
    env = {**os.environ, "ORCHESTRATOR_DATABASE_URL": url, "PYTHONPATH": str(ROOT)}
    token = secrets.token_urlsafe(32)
    port = _port()
    with tempfile.TemporaryDirectory() as folder:
        tokens = Path(folder) / "tokens"
        tokens.write_text(f"bench {token}\n")
        worker = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "orchestrator", "worker", "--app", APP, cwd=ROOT, env=env,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        console = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "orchestrator", "--database-url", url, "console",
            "--port", str(port), "--token-file", str(tokens), cwd=ROOT, env=env,
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
        client = Orchestrator(url, default_owner=OWNER)
        client.registry = app.registry
        http = httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60,
                                 headers={"Authorization": f"Bearer {token}"},
                                 limits=httpx.Limits(max_connections=clients + 4))
        try:
            await listening(http, console)
            await asyncio.sleep(2.0)  # the worker's start (imports, registration)
            handle = await client.submit_async(paced_steps, {"steps": steps,
                                                             "max_pause_ms": max_pause_ms})
            path = f"/api/runs/{handle.id}/events"
            told = await asyncio.gather(*(_follow(http, path) for _ in range(clients)))
            return [delay for delays in told for delay in delays]
        finally:
            await http.aclose()
            for proc in (worker, console):
                if proc.returncode is None:
                    proc.terminate()
                await proc.wait()
            await client.database.close()


async def sse_once(server: Server, *, steps: int, max_pause_ms: int, clients: int
                   ) -> dict[str, Any]:
    """One repetition: the percentiles (seconds) over every event of every client."""
    with server.database("console") as url:
        migrate(url)
        delays = await measure(url, steps=steps, max_pause_ms=max_pause_ms, clients=clients)
    return {"events": len(delays), "clients": clients, "steps": steps,
            **{f"p{p}": percentile(delays, p) for p in (50, 90, 99)},
            "max": max(delays) if delays else float("nan")}
