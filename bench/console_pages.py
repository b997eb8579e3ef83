"""The console's pages over a long history: how long ``GET /api/runs``, ``/runs``,
``GET /api/operations`` and ``/operations`` take with a million finished runs in the tables.

Two ``orchestrator console`` processes serve the kept database of bench/console_seed.py: one
without an application (no operator scopes: every tenant, ``tenants`` NULL in the SQL), one
with this module's ``app``, whose operator ``scoped`` sees one tenant. The driver sends the
requests one at a time over HTTP with a bearer token, the cases in turn (a round is one request
of every case, so a noisy moment falls on all of them), and times each from the request to
the last byte of the answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import sys
import tempfile
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import psycopg  # noqa: TID251 - the deep cursor is read from the kept database

from bench.common import ROOT, log, percentile
from orchestrator import Orchestrator

SCOPED_TENANT = "initech"
app = Orchestrator(os.environ.get("ORCHESTRATOR_DATABASE_URL"),
                   operator_scopes={"scoped": [SCOPED_TENANT]})
"""The application of the scoped console: operator ``scoped`` reads one tenant (20 %)."""


@dataclass
class Case:
    """One page to time: ``path`` with ``query``; ``scoped`` on the scoped console;
    ``follow`` walks the ``next`` cursors from the first page, one page per request."""

    name: str
    path: str
    query: dict[str, str]
    scoped: bool = False
    follow: bool = False


def cases(deep: str, deep_scoped: str) -> list[Case]:
    """The pages measured; ``deep`` and ``deep_scoped`` are cursors half-way into the
    history (the second within the scoped tenant's runs)."""
    return [
        Case("api runs: first page", "/api/runs", {}),
        Case("api runs: next pages (cursor)", "/api/runs", {}, follow=True),
        Case("api runs: deep page (half-way)", "/api/runs", {"before": deep}),
        Case("api runs: status=failed (7%)", "/api/runs", {"status": "failed"}),
        Case("api runs: status=cancelled (3%)", "/api/runs", {"status": "cancelled"}),
        Case("api runs: status=needs_reconciliation (0.1%)", "/api/runs",
             {"status": "needs_reconciliation"}),
        Case("api runs: workflow=refund (25%)", "/api/runs", {"workflow": "refund"}),
        Case("api runs: workflow=payout version=3 (1.7%)", "/api/runs",
             {"workflow": "payout", "version": "3"}),
        Case("api runs: submission_key", "/api/runs", {"submission_key": "sub-300000"}),
        Case("api runs: scoped to 1 tenant", "/api/runs", {}, scoped=True),
        Case("api runs: scoped, next pages", "/api/runs", {}, scoped=True, follow=True),
        Case("api runs: scoped, deep page", "/api/runs", {"before": deep_scoped}, scoped=True),
        Case("api runs: scoped, status=failed", "/api/runs", {"status": "failed"},
             scoped=True),
        Case("page /runs", "/runs", {}),
        Case("page /runs status=failed", "/runs", {"status": "failed"}),
        Case("page /runs deep", "/runs", {"before": deep}),
        Case("page /runs scoped", "/runs", {}, scoped=True),
        Case("api queue: unresolved", "/api/operations", {}),
        Case("api queue: state=all", "/api/operations", {"state": "all"}),
        Case("api queue: tool=charge_card", "/api/operations", {"tool": "charge_card"}),
        Case("api queue: workflow=refund", "/api/operations", {"workflow": "refund"}),
        Case("api queue: older_than=7d", "/api/operations", {"older_than": "7d"}),
        Case("api queue: scoped to 1 tenant", "/api/operations", {}, scoped=True),
        Case("page /operations", "/operations", {}),
        Case("page /operations tool=send_email", "/operations", {"tool": "send_email"}),
        Case("page /operations scoped", "/operations", {}, scoped=True),
    ]


def queue_items(url: str) -> int:
    with psycopg.connect(url) as conn:
        row = conn.execute("SELECT count(*) FROM orchestrator.reconciliation_items").fetchone()
    return int(row[0]) if row else 0


def deep_cursors(url: str) -> tuple[str, str]:
    """Cursors of the runs half-way back in the history, all tenants and the scoped one: what
    following ``next`` that far would give."""
    sql = """SELECT created_at, id FROM orchestrator.runs
             WHERE %(tenant)s::text IS NULL OR tenant = %(tenant)s
             ORDER BY created_at DESC, id DESC
             OFFSET (SELECT count(*) / 2 FROM orchestrator.runs
                     WHERE %(tenant)s::text IS NULL OR tenant = %(tenant)s) LIMIT 1"""
    found = []
    with psycopg.connect(url) as conn:
        for tenant in (None, SCOPED_TENANT):
            row = conn.execute(sql, {"tenant": tenant}).fetchone()
            assert row is not None
            found.append(f"{row[0].isoformat()}_{row[1]}")
    return found[0], found[1]


@contextlib.asynccontextmanager
async def consoles(url: str) -> AsyncIterator[tuple[httpx.AsyncClient, httpx.AsyncClient]]:
    """Two console processes on ``url`` (unscoped, scoped), and a client of each."""
    token = secrets.token_urlsafe(32)
    env = {**os.environ, "ORCHESTRATOR_DATABASE_URL": url, "PYTHONPATH": str(ROOT)}
    procs: list[asyncio.subprocess.Process] = []
    clients: list[httpx.AsyncClient] = []
    with tempfile.TemporaryDirectory() as folder:
        try:
            for operator, extra in (("bench", []), ("scoped", ["--app",
                                                               "bench.console_pages:app"])):
                tokens = Path(folder) / f"{operator}.tokens"
                tokens.write_text(f"{operator} {token}\n")
                port = free_port()
                procs.append(await asyncio.create_subprocess_exec(
                    sys.executable, "-m", "orchestrator", "--database-url", url, "console",
                    *extra, "--port", str(port), "--token-file", str(tokens), cwd=ROOT,
                    env=env, stdout=asyncio.subprocess.DEVNULL,
                    stderr=asyncio.subprocess.DEVNULL))
                clients.append(httpx.AsyncClient(
                    base_url=f"http://127.0.0.1:{port}", timeout=60,
                    headers={"Authorization": f"Bearer {token}"}))
            for client, proc in zip(clients, procs, strict=True):
                await listening(client, proc)
            yield clients[0], clients[1]
        finally:
            for client in clients:
                await client.aclose()
            for proc in procs:
                if proc.returncode is None:
                    proc.terminate()
                await proc.wait()


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def listening(http: httpx.AsyncClient, proc: asyncio.subprocess.Process) -> None:
    for _ in range(600):
        if proc.returncode is not None:
            raise RuntimeError("orchestrator console exited before it served")
        with contextlib.suppress(httpx.TransportError):
            await http.get("/login")
            return
        await asyncio.sleep(0.05)
    raise RuntimeError("orchestrator console did not listen in 30 s")


async def _get(http: httpx.AsyncClient, path: str, query: dict[str, str]) -> tuple[float, Any]:
    started = time.perf_counter()
    answer = await http.get(path + ("?" + urlencode(query) if query else ""))
    body = answer.content
    seconds = time.perf_counter() - started
    if answer.status_code != 200:
        raise RuntimeError(f"GET {path} {query}: {answer.status_code} {body[:200]!r}")
    return seconds, answer


async def measure(url: str, *, requests: int) -> dict[str, Any]:
    """``requests`` timings of every case (after one untimed round that warms the caches);
    per case: p50, p95, max (seconds) and rows shown by its first answer."""
    deep, deep_scoped = deep_cursors(url)
    plan = cases(deep, deep_scoped)
    timings: dict[str, list[float]] = {c.name: [] for c in plan}
    rows: dict[str, int] = {}
    cursors: dict[str, str | None] = {c.name: None for c in plan if c.follow}
    async with consoles(url) as (unscoped, scoped):
        for round_no in range(requests + 1):
            for case in plan:
                query = dict(case.query)
                if case.follow and cursors[case.name]:
                    query["before"] = str(cursors[case.name])
                seconds, answer = await _get(scoped if case.scoped else unscoped, case.path,
                                             query)
                if case.path.startswith("/api/"):
                    doc = answer.json()
                    shown = doc.get("runs", doc.get("items", doc.get("operations", [])))
                    rows.setdefault(case.name, len(shown) if isinstance(shown, list) else -1)
                    if case.follow:
                        cursors[case.name] = doc.get("next")
                if round_no:  # the first round warms the caches and the plans
                    timings[case.name].append(seconds)
            if round_no and round_no % max(1, requests // 4) == 0:
                log(f"console pages: round {round_no}/{requests}")
    shown = [{"name": c.name, "path": c.path, "query": c.query, "scoped": c.scoped,
              "rows": rows.get(c.name), "p50": percentile(timings[c.name], 50),
              "p95": percentile(timings[c.name], 95), "max": max(timings[c.name]),
              "requests": len(timings[c.name])} for c in plan]
    return {"queue_items": queue_items(url), "cases": shown}
