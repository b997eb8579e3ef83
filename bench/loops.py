"""A worker's CPU per step on each event loop: ``python -m bench.loops``.

One worker (concurrency 32) in this process drains N queued K = 3 runs of bench/app.py on a
fresh database, on asyncio's own loop and on uvloop's, the order alternating by round. The
table gives each loop's median CPU per step of this process (the worker and a progress poll
every 50 ms, the same for both) and the median over rounds of uvloop's ÷ asyncio's in the same
round. Worker processes pick the loop with ``--event-loop`` (orchestrator/serving.py); this
measures the loop alone, without a second worker process or a driver sharing the cores.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from typing import Any

import psycopg  # noqa: TID251 - the benchmark's progress poll, outside the engine

from bench.common import Server, Table, fx, log, median, migrate

LOOPS = ("asyncio", "uvloop")


async def _drain(url: str, runs: int, k: int) -> tuple[float, float]:
    from bench.app import build_app
    from orchestrator.testing import running_worker

    app = build_app(url, pool_size=16)
    try:
        for _ in range(runs):
            await app.submit_async(f"k{k}", None)
        began_cpu, began = time.process_time(), time.monotonic()
        async with running_worker(app, concurrency=32, poll_interval=0.05):
            with psycopg.connect(url, autocommit=True) as conn:
                while True:
                    row = conn.execute("SELECT count(*) FROM orchestrator.runs "
                                       "WHERE status = 'succeeded'").fetchone()
                    if row is not None and row[0] >= runs:
                        break
                    await asyncio.sleep(0.05)
        cpu, wall = time.process_time() - began_cpu, time.monotonic() - began
    finally:
        await app.database.close()
    return 1e6 * cpu / (k * runs), k * runs / wall


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.loops", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=2000, help="runs per drain")
    parser.add_argument("--k", type=int, default=3, choices=(1, 3, 10), help="steps per run")
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args(argv)
    from orchestrator.serving import event_loop_choice, new_event_loop

    if event_loop_choice("auto") != "uvloop":
        print("bench.loops: uvloop is not installed here", file=sys.stderr)
        return 2
    server = Server.find(None)
    found: dict[str, list[tuple[float, float]]] = {kind: [] for kind in LOOPS}
    for r in range(args.rounds):
        for kind in LOOPS if r % 2 == 0 else LOOPS[::-1]:
            log(f"round {r + 1}/{args.rounds}: {kind}")
            with server.database("loops") as url:
                migrate(url)
                loop = new_event_loop(kind)
                try:
                    found[kind].append(loop.run_until_complete(_drain(url, args.runs, args.k)))
                finally:
                    loop.close()
    table = Table(f"loops: one worker × concurrency 32 drains {args.runs:,} K={args.k} runs "
                  f"in this process, {args.rounds} rounds alternating",
                  ["event loop", "CPU µs/step", "min–max", "÷ asyncio (paired median)",
                   "steps/s"])
    base = found["asyncio"]
    for kind, rows in found.items():
        cpu = [c for c, _ in rows]
        paired: Any = (fx(median([c / b[0] for (c, _), b in zip(rows, base, strict=True)]))
                       if kind != "asyncio" else "—")
        table.add(kind, f"{median(cpu):.0f}", f"{min(cpu):.0f}–{max(cpu):.0f}", paired,
                  f"{median([s for _, s in rows]):,.0f}")
    table.notes.append("CPU: this process's user + system time from the release of the "
                       "worker until its poll saw the last run succeed, per step")
    table.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
