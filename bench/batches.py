"""What one group commit costs, by its size (the ``batches`` section).

A worker writes its runs' steps in shared transactions (``GroupWriter``): during a drain a
batch holds tens of writes, under a stream of submissions only a few. Part of a step's cost is
paid per write (its rows, index entries, checks, WAL) and part per batch (a transaction and its
commit, each statement's start on the server, a round trip and the writer's own bookkeeping in
the worker), so the same step costs more in small batches. This section measures the two parts:
it drives K-step runs through exactly the floor's writes (``bench.floor.drive``: the engine's
claim, its set-based statements and its group writer) in this process, with the writer's batch
size capped at each size in turn, and measures the CPU of the server's processes and of this
process per batch and per write. A straight line through those points gives the cost per batch
and per write.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Sequence
from typing import Any

import psycopg  # noqa: TID251 - fixtures and the server's processes

from bench.common import CpuMeter, Server, migrate
from bench.floor import drive
from bench.ours import server_processes, submit_many
from orchestrator.db import runs as runs_db
from orchestrator.db.config import resolve_database
from orchestrator.db.database import Database
from orchestrator.db.writer import GroupWriter

WORKER = "bench-batches"


async def batches_once(server: Server, *, size: int, runs: int, k: int = 3) -> dict[str, Any]:
    """Claim ``runs`` fresh K-step runs and drive them all at once, the writer's batches
    capped at ``size`` writes; CPU per batch and per write of the server and of this process."""
    url = server.create_database("batches")
    migrate(url)
    try:
        await submit_many(url, f"k{k}", runs)
        db = Database(resolve_database(url), max_pool_size=1)  # one connection, as one worker
        writer = GroupWriter(db, max_batch=size)
        try:
            async with db.connection() as conn:
                claims = await runs_db.run_claim_ready(
                    conn, worker=WORKER, workflows=[f"k{k}@1"], limit=runs, ttl=600.0)
            if len(claims) != runs:
                raise RuntimeError(f"claimed {len(claims)} of {runs} runs")
            async with await psycopg.AsyncConnection.connect(url, autocommit=True) as watch:
                pids = {"server": await server_processes(watch), "process": [os.getpid()]}
            meter = CpuMeter()
            meter.start(pids)
            await asyncio.gather(*(drive(writer, claim, k, WORKER) for claim in claims))
            meter.stop(pids)
        finally:
            await db.close()
    finally:
        server.drop_database(url)
    out: dict[str, Any] = {"size": size, "runs": runs, "k": k, "batches": writer.batches,
                           "writes": writer.writes, "machine_busy": meter.busy}
    for kind in pids:
        used = meter.used.get(kind)
        out[f"{kind}_us_per_batch"] = None if used is None else used / writer.batches * 1e6
        out[f"{kind}_us_per_write"] = None if used is None else used / writer.writes * 1e6
    return out


def per_batch_and_write(points: Sequence[tuple[float, float]]) -> tuple[float, float] | None:
    """Least squares through (writes per batch, CPU per batch): (per batch, per write)."""
    if len(points) < 2:
        return None
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if spread == 0:
        return None
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    return mean_y - slope * mean_x, slope
