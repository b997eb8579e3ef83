"""How long a committed journal entry takes to reach a follower of the run's stream
(``handle.events()``, docs/streams.md): ``python -m bench.stream_latency``.

A worker process runs one workflow that calls a tool ``--steps`` times, the tool pausing a
random 0 to ``--max-pause-ms`` each time, so that entries are committed at irregular moments
(a call's ``submitted``, and its receipt riding with the next one). ``--followers`` iterators in
this process follow the run from the start; for each entry, the delay is the time it was
yielded minus its ``at`` (its transaction's start by the database's clock, a little before the
commit, so the figures are upper bounds). Prints p50, p90, p99 and the maximum over all
entries of all followers. Nothing is appended to bench/results/.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import Server, migrate, percentile
from orchestrator import Orchestrator, Owner, ToolContext, WorkflowContext

OWNER = Owner(tenant="bench", principal="bench")
ROOT = Path(__file__).resolve().parents[1]

app = Orchestrator(os.environ.get("ORCHESTRATOR_DATABASE_URL"), default_owner=OWNER)


@app.tool(effect="idempotent")
async def paced(ctx: ToolContext, *, i: int, max_pause_ms: int) -> int:
    await asyncio.sleep(random.uniform(0, max_pause_ms) / 1000)  # noqa: S311
    return i


@app.workflow(name="paced_steps")
async def paced_steps(ctx: WorkflowContext, data: dict[str, Any]) -> int:
    for i in range(data["steps"]):
        await ctx.call(paced, i=i, max_pause_ms=data["max_pause_ms"])
    return int(data["steps"])


async def _follow(handle: Any) -> list[float]:
    delays = []
    async for entry in handle.events():
        delays.append(time.time() - entry.at.timestamp())
    return delays


async def measure(url: str, *, steps: int, max_pause_ms: int, followers: int) -> list[float]:
    client = Orchestrator(url, default_owner=OWNER)
    client.registry = app.registry
    env = {**os.environ, "ORCHESTRATOR_DATABASE_URL": url, "PYTHONPATH": str(ROOT)}
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "orchestrator", "worker", "--app", "bench.stream_latency:app",
        cwd=ROOT, env=env, stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL)
    try:
        await asyncio.sleep(2.0)  # the worker's start (imports, registration)
        handle = await client.submit_async(paced_steps, {"steps": steps,
                                                         "max_pause_ms": max_pause_ms})
        told = await asyncio.gather(*(_follow(handle) for _ in range(followers)))
        return [delay for delays in told for delay in delays]
    finally:
        worker.terminate()
        await worker.wait()
        await client.database.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200, help="tool calls (about 2 entries each)")
    parser.add_argument("--max-pause-ms", type=int, default=40)
    parser.add_argument("--followers", type=int, default=1)
    parser.add_argument("--server", help="an admin URL of the PostgreSQL server to use")
    args = parser.parse_args()
    server = Server.find(args.server)
    with server.database("stream") as url:
        migrate(url)
        delays = asyncio.run(measure(url, steps=args.steps, max_pause_ms=args.max_pause_ms,
                                     followers=args.followers))
    ms = [d * 1000 for d in delays]
    print(f"{len(ms)} entries seen by {args.followers} follower(s), {args.steps} steps, "
          f"pauses 0-{args.max_pause_ms} ms")
    print("commit -> yielded (ms): " + ", ".join(
        f"p{p} {percentile(ms, p):.1f}" for p in (50, 90, 99)) + f", max {max(ms):.1f}")


if __name__ == "__main__":
    main()
