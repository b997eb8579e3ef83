"""The queues section's drains: a binding concurrency limit and a start rate (docs/flow.md).

Both read the database's own record of each run (``started_at``: when a queue's claim first
started it; ``finished_at``), so the figures are what the limits were enforced on.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import psycopg  # noqa: TID251 - fixtures and progress queries

from bench.common import Server, migrate
from bench.ours import Setup, drain, hold, start_workers, submit_many, wait_registered

S = "orchestrator"


async def _drain_queue(server: Server, workflow: str, n: int, setup: Setup,
                       env: dict[str, str]) -> list[tuple[Any, Any]]:
    """Submit ``n`` runs of ``workflow``, drain them, return each run's (started, finished)."""
    url = server.create_database("q")
    try:
        migrate(url)
        ids = await submit_many(url, workflow, n)
        await hold(url, ids)
        procs = await start_workers(url, replace(setup, env=env))
        try:
            await wait_registered(url, [p.pid for p in procs], procs)
            await drain(url, ids, procs, timeout=600)
        finally:
            for p in procs:
                await p.stop()
        with psycopg.connect(url) as conn:
            rows = conn.execute(
                f"SELECT started_at, finished_at FROM {S}.runs WHERE id = ANY(%s) "
                "AND status = 'succeeded'", (ids,)).fetchall()
    finally:
        server.drop_database(url)
    if len(rows) != n:
        raise RuntimeError(f"{n - len(rows)} of {n} {workflow} runs did not succeed")
    return rows


async def capped_once(server: Server, *, n: int, cap: int, hold_s: float,
                      setup: Setup) -> dict[str, Any]:
    """``n`` runs that each hold their slot ``hold_s`` seconds in a queue of concurrency
    ``cap`` (less than the workers' slots, so the limit binds): the share of the limit in use
    from the first start to the last finish (slot-seconds used ÷ ``cap`` × elapsed), and the
    most slots ever held at once."""
    rows = await _drain_queue(server, "capped", n, setup, {
        "BENCH_QUEUE_CAP": str(cap), "BENCH_QUEUE_HOLD": str(hold_s)})
    first = min(r[0] for r in rows)
    last = max(r[1] for r in rows)
    elapsed = (last - first).total_seconds()
    used = sum((f - s).total_seconds() for s, f in rows)
    edges = sorted([(s, 1) for s, _ in rows] + [(f, -1) for _, f in rows],
                   key=lambda e: (e[0], e[1]))
    held = peak = 0
    for _, step in edges:
        held += step
        peak = max(peak, held)
    return {"runs": n, "cap": cap, "hold_s": hold_s, "seconds": elapsed,
            "utilisation": used / (cap * elapsed), "peak": peak,
            "ideal_seconds": n * hold_s / cap}


async def rated_once(server: Server, *, n: int, rate: int, setup: Setup) -> dict[str, Any]:
    """``n`` short runs in a queue of ``rate`` starts per second: the starts in each whole
    second from the first start (the first second holds the burst a sliding window allows, so
    the steady rate is the median of the seconds after it), and the most starts in any
    one-second window."""
    rows = await _drain_queue(server, "rated", n, setup, {"BENCH_QUEUE_RATE": str(rate)})
    starts = sorted(r[0] for r in rows)
    first = starts[0]
    seconds = [(s - first).total_seconds() for s in starts]
    whole = int(seconds[-1])
    per_second = [sum(1 for t in seconds if i <= t < i + 1) for i in range(whole)]
    busiest = 0
    j = 0
    for i, t in enumerate(seconds):
        while seconds[j] <= t - 1.0:
            j += 1
        busiest = max(busiest, i - j + 1)
    steady = sorted(per_second[1:]) if len(per_second) > 1 else per_second
    median = steady[len(steady) // 2] if steady else float("nan")
    return {"runs": n, "rate": rate, "seconds": seconds[-1], "per_second": per_second,
            "steady_rate": median, "overall_rate": (n - rate) / seconds[-1]
            if seconds[-1] else None, "busiest_window": busiest}
