"""Bulk resolution: ``orchestrator ops resolve-many`` on N operations whose outcome is unknown.

Each repetition parks N runs on a fresh database (a ``consequential`` tool whose call is lost
after sending, so every run waits in ``needs_reconciliation``), then times the command an
operator would type, ``ops resolve-many --not-applied --yes``, as a subprocess: from its start
to its exit, interpreter start-up included. It also counts the audit rows the command wrote
(one per item, or the figure is wrong) and the span between the first and the last of them
(the resolutions themselves, without start-up and selection).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from typing import Any

import psycopg  # noqa: TID251 - fixtures and the audit count

from bench.common import Server, log, migrate
from orchestrator import Orchestrator, Owner, ToolContext, WorkflowContext


def _stuck_app(url: str) -> Orchestrator:
    app = Orchestrator(url, default_owner=Owner(tenant="bench", principal="bench"))

    @app.tool(effect="consequential")
    async def charge(ctx: ToolContext, *, i: int) -> dict[str, Any]:
        raise ConnectionResetError("lost after sending")

    @app.workflow(version="1", name="stuck")
    async def stuck(ctx: WorkflowContext, i: int) -> dict[str, Any]:
        result: dict[str, Any] = await ctx.call(charge, i=i)
        return result

    return app


async def _park(url: str, n: int) -> None:
    """N runs, each blocked on its unknown operation, with no worker left running."""
    app = _stuck_app(url)
    logging.getLogger("orchestrator").setLevel(logging.ERROR)  # N "outcome unknown" warnings
    worker = app.create_worker(concurrency=32, poll_interval=0.2)
    task = asyncio.ensure_future(worker.run())
    try:
        for i in range(n):
            await app.submit_async("stuck", i)
        deadline = time.monotonic() + 120
        async with await psycopg.AsyncConnection.connect(url, autocommit=True) as conn:
            while True:
                cur = await conn.execute("SELECT count(*) FROM orchestrator.runs "
                                         "WHERE status = 'needs_reconciliation'")
                row = await cur.fetchone()
                if row is not None and row[0] == n:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"only {row} of {n} runs parked in time")
                await asyncio.sleep(0.1)
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, 60)
        with contextlib.suppress(Exception):
            await app.database.close()
        app.close()


async def bulk_once(server: Server, *, items: int) -> dict[str, Any]:
    """One repetition: park ``items`` runs, resolve them all with one command."""
    with server.database("bulk") as url:
        migrate(url)
        await _park(url, items)
        started = time.monotonic()
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "orchestrator", "--database-url", url, "ops", "resolve-many",
            "--not-applied", "--evidence", "the provider shows no charge", "--operator",
            "bench", "--yes", "--json", stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE)
        _, err = await proc.communicate()
        seconds = time.monotonic() - started
        if proc.returncode != 0:
            raise RuntimeError(f"resolve-many exited {proc.returncode}: {err.decode()[-500:]}")
        async with await psycopg.AsyncConnection.connect(url) as conn:
            cur = await conn.execute(
                "SELECT count(*), EXTRACT(EPOCH FROM max(created_at) - min(created_at)) "
                "FROM orchestrator.operator_audit WHERE action = 'resolve.not_applied'")
            row = await cur.fetchone()
            assert row is not None
            cur = await conn.execute("SELECT count(*) FROM orchestrator.reconciliation_items "
                                     "WHERE state = 'resolved'")
            resolved = await cur.fetchone()
            assert resolved is not None
    log(f"bulk: {items} items in {seconds:.2f} s, {row[0]} audit rows")
    return {"seconds": seconds, "audit_rows": int(row[0]), "audit_span": float(row[1] or 0),
            "resolved": int(resolved[0]), "items": items}
