"""The engine's write path alone: ``python -m bench.floor --concurrency N`` (a worker process of
the ``floor`` section).

It claims the same held runs as a worker (the engine's claim statement) and drives each one
through exactly the durable writes a K-step run of ``bench.app`` makes, with the engine's own
set-based statements and its group writer: per step the fenced write-ahead ``submitted`` with
its journal event, carrying the previous step's receipt (``submitted → committed`` and its
``call.completed``), and at the end the fenced success carrying the last receipt. Everything
the engine does besides those writes is left out: no workflow code or replay, no effect
gateway (policy stages, cancellation races, retries), no lease renewal. The database does the
same work as for the engine's drain; the difference in rate is what the engine's own Python
costs on top of the writes.

Not a worker: it ignores cancellation requests and never recovers anything. Benchmark only.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import socket
import sys
import time
import uuid
from functools import partial
from typing import Any

from orchestrator import canonical
from orchestrator.db import runs as runs_db
from orchestrator.db import steps as steps_db
from orchestrator.db import workers as workers_db
from orchestrator.db.config import resolve_database
from orchestrator.db.database import Database
from orchestrator.db.writer import GroupWriter

try:
    from orchestrator.journal import SCHEMA_VERSION
except ImportError:  # an engine from before the journal module (bench --engine <older ref>)
    from orchestrator.replay import SCHEMA_VERSION  # type: ignore[no-redef]

TOOL, VERSION, EFFECT = "noop", "1", "consequential"  # bench.app's tool, as the engine names it


async def drive(writer: GroupWriter, claim: dict[str, Any], k: int, worker: str) -> None:
    """One run: K write-aheads, each carrying the previous receipt, then the success."""
    run_id, token = claim["id"], claim["lease_token"]
    owner = canonical.canonical_json({"principal": claim["principal"],
                                      "tenant": claim["tenant"]})
    expected, receipt, run_text = claim["revision"], None, str(run_id)
    value: dict[str, Any] = {}
    first_t = None
    for i in range(k):
        arguments = canonical.canonical_bytes({"i": i}).decode()
        row = {"run_id": run_id, "token": token, "position": i, "attempt": 1,
               "tool_name": TOOL, "tool_version": VERSION, "effect_class": EFFECT,
               "tenant": claim["tenant"], "principal": claim["principal"],
               "intent_digest": canonical.intent_digest_text(TOOL, VERSION, owner, arguments),
               "arguments": arguments, "idempotency_key": f"{run_text}:{i}:1",
               "worker_id": worker}
        op_id, _ = await writer.run_statement(steps_db.operation_begin_fast(
            row, expected=expected, v=SCHEMA_VERSION, receipt=receipt))
        expected += 2 if receipt is not None else 1
        value = {"ok": True, "i": i, "t": time.time()}  # what bench.app's tool returns
        text = canonical.canonical_bytes(value).decode()
        receipt = steps_db.Receipt(op_id=op_id, position=i, name=TOOL, text=text,
                                 digest=canonical.text_digest(text))
        first_t = value["t"] if i == 0 else first_t
    result = canonical.canonical_bytes({"first_t": first_t, "last": value}).decode()
    await writer.run_statement(steps_db.run_succeed_fast(
        run_id=run_id, token=token, expected=expected, result=result, v=SCHEMA_VERSION,
        receipt=receipt))


def _done(running: set[asyncio.Task[None]], freed: asyncio.Event, task: asyncio.Task[None]
          ) -> None:
    running.discard(task)
    freed.set()
    if not task.cancelled() and task.exception() is not None:  # a miss: nothing to fall back on
        print(f"floor: a run failed: {task.exception()!r}", flush=True)
        os._exit(1)


async def main(url: str, k: int, concurrency: int, pool_size: int) -> None:
    db = Database(resolve_database(url), max_pool_size=pool_size)
    writer = GroupWriter(db)
    worker = f"floor:{os.getpid()}:{uuid.uuid4().hex[:6]}"
    workflow = [f"k{k}@1"]
    async with db.connection() as conn:
        await workers_db.worker_register(conn, worker_id=worker, hostname=socket.gethostname(),
                                         pid=os.getpid(), workflows=workflow,
                                         concurrency=concurrency)
    running: set[asyncio.Task[None]] = set()
    freed = asyncio.Event()
    while True:
        free = concurrency - len(running)
        if free > 0:
            async with db.connection() as conn:
                claims = await runs_db.run_claim_ready(conn, worker=worker, workflows=workflow,
                                                       limit=free, ttl=60.0)
            for claim in claims:
                task = asyncio.ensure_future(drive(writer, claim, k, worker))
                running.add(task)
                task.add_done_callback(partial(_done, running, freed))
            if claims:
                continue
        freed.clear()
        try:  # nothing ready: the held runs are released all at once, so poll briefly
            await asyncio.wait_for(freed.wait(), 0.005 if not running else None)
        except TimeoutError:
            pass


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.floor")
    parser.add_argument("--k", type=int, required=True)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # the driver stops us with SIGTERM
    asyncio.run(main(os.environ["ORCHESTRATOR_DATABASE_URL"], args.k, args.concurrency,
                     int(os.environ.get("BENCH_POOL_SIZE", "16"))))
