"""A steady stream of submissions for latency under load: ``python -m bench.load --url U
--rate R --workflow k3``. Prints ``@ready`` once it submits, ``@submitted N`` when stopped."""

from __future__ import annotations

import argparse
import asyncio
import signal
from typing import Any

from bench.app import build_app


async def main(args: argparse.Namespace) -> None:
    orch = build_app(args.url, pool_size=8)
    await orch.submit_async(args.workflow, {"load": -1})  # opens the pool
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    pending: set[asyncio.Task[Any]] = set()
    submitted = 0
    interval = 1.0 / args.rate
    due = loop.time()
    print("@ready", flush=True)
    while not stop.is_set():
        task = asyncio.ensure_future(orch.submit_async(args.workflow, {"load": submitted}))
        pending.add(task)
        task.add_done_callback(pending.discard)
        submitted += 1
        due += interval
        delay = due - loop.time()
        if delay > 0:
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except TimeoutError:
                pass
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    await orch.database.close()
    print(f"@submitted {submitted}", flush=True)


def parse() -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--url", required=True)
    parser.add_argument("--rate", type=float, required=True, help="submissions per second")
    parser.add_argument("--workflow", default="k3")
    return parser.parse_args()


if __name__ == "__main__":
    asyncio.run(main(parse()))
