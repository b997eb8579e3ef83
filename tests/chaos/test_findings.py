"""Engine bugs the chaos suite found, each replayed as one focused scenario with real
processes, kept as regression tests once fixed.

1. An idempotent call whose first attempt became unknown is re-sent with the same key (C5).
   When that re-send was answered "not applied" (a provider that is busy says so for *that
   request*; it says nothing about the first one), the gateway started the next attempt with a
   *new* key and left the first attempt ``unknown`` with no reconciliation item: the first
   attempt had been applied, so the new key applied the effect a second time, and the run
   ended ``needs_reconciliation`` on an operation no queue listed (a lost run). Found at
   e03fbe0 (the test failed there); fixed in 7dad19b.
2. A resolution that landed while its run was ``queued`` settled the ledger but not the run's
   journal, and the next replay parked the run on an operation already resolved (a lost run).
   Found by the long profile at 23bd8e4 and e922f1e (the test failed there); fixed in bced646.
"""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from orchestrator import Orchestrator
from tests.chaos import app as chaos_app
from tests.chaos import sink
from tests.chaos.environment import Environment
from tests.chaos.harness import (
    ENGINE_DIR,
    process_env,
    reconciler_command,
    worker_command,
)

pytestmark = pytest.mark.chaos
LEASE = 2.0


class Processes:
    def __init__(self, env: Environment, logs: Path) -> None:
        self.env = env
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []
        logs.mkdir(parents=True, exist_ok=True)

    def start(self, name: str, cmd: list[str], **extra: str) -> subprocess.Popen[bytes]:
        with open(self.logs / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(cmd, cwd=ENGINE_DIR, stdout=log, stderr=subprocess.STDOUT,
                                    env=process_env(self.env.db_url, self.env.sink_url, LEASE,
                                                    extra))
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


def _sql(url: str, query: str, params: Any = None) -> list[dict[str, Any]]:
    with psycopg.connect(url, autocommit=True, row_factory=dict_row) as conn:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []


@pytest.mark.timeout(120)
def test_an_idempotent_resend_answered_not_applied_keeps_its_key(
        chaos_env: Environment, tmp_path: Path) -> None:
    sink.create(chaos_env.sink_url)
    client = Orchestrator(chaos_env.db_url, default_owner=chaos_app.OWNER)
    client.registry = chaos_app.app.registry
    procs = Processes(chaos_env, tmp_path / "logs")
    try:
        # Worker A applies attempt 1 (key K1), then dies before recording the receipt.
        a = procs.start("a", worker_command(4, LEASE),
                        ORCHESTRATOR_FAULT_POINT="after_tool_return",
                        ORCHESTRATOR_FAULT_TOOL="index")
        run = client.submit(chaos_app.checkout, {"steps": [
            {"call": "index", "id": "only", "fault": "resend_busy", "n": 2}]})
        assert a.wait(timeout=60) == -9, "worker A did not die at after_tool_return"
        # Worker B finds attempt 1 submitted without an outcome: unknown, re-sent with K1
        # (attempt 2), which the provider answers "busy, not applied".
        procs.start("b", worker_command(4, LEASE))
        procs.start("reconciler", reconciler_command())
        give_up, blocked_since = time.monotonic() + 45, None
        while time.monotonic() < give_up:
            status = _sql(chaos_env.db_url, "SELECT status FROM orchestrator.runs WHERE id = %s",
                          (run.id,))[0]["status"]
            if status in ("succeeded", "failed", "cancelled"):
                break
            if status != "needs_reconciliation":
                blocked_since = None
            elif blocked_since is None:
                blocked_since = time.monotonic()
            elif time.monotonic() - blocked_since > 5:
                break  # blocked, and nothing here resolves an operation of index
            time.sleep(0.2)
        effects = _sql(chaos_env.sink_url, "SELECT key, attempt FROM chaos_effects "
                       "WHERE run_id = %s ORDER BY id", (run.id,))
        ops = _sql(chaos_env.db_url,
                   "SELECT o.attempt, o.state, o.idempotency_key, i.state AS item FROM "
                   "orchestrator.operations o LEFT JOIN orchestrator.reconciliation_items i "
                   "ON i.operation_id = o.id WHERE o.run_id = %s ORDER BY o.attempt", (run.id,))
        story = f"run {status}; ledger {ops}; sink effects {effects}"
        assert len(effects) == 1, f"the effect was applied {len(effects)} times: {story}"
        assert {e["key"] for e in effects} == {ops[0]["idempotency_key"]}, story
        unlisted = [o for o in ops if o["state"] == "unknown" and o["item"] is None]
        assert not unlisted, f"unknown operations no queue lists: {story}"
        assert status == "succeeded", story
    finally:
        procs.close()
        client.close()



def _waiting_behind(url: str, blocker_pid: int, text: str) -> bool:
    """A backend blocked by ``blocker_pid`` whose current statement contains ``text``."""
    return bool(_sql(url, "SELECT 1 FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))"
                     " AND query ILIKE %s", (blocker_pid, f"%{text}%")))


def _until(what: str, predicate: Any, timeout: float = 20.0) -> None:
    give_up = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.mark.timeout(120)
def test_a_resolution_that_lands_while_the_run_is_queued_reaches_the_run(
        chaos_env: Environment, tmp_path: Path) -> None:
    """Found by the long profile at 23bd8e4 and e922f1e (seeds 912829479 and 1497526820: 4
    and 6 runs lost this way); fixed in bced646.

    A worker marks a consequential call unknown (its tool timed out after applying), then dies
    before it parks the run (there: a dropped connection failed the park; here: SIGKILL while
    the park waits for a row lock). The lease lapses and a sweep queues the run again. The
    reconciler may resolve the operation while the run is ``queued``: ``recon_settle`` then
    settles only the ledger and writes nothing to the run's journal (db/reconciliation.py,
    "a run that already moved on ... keeps its journal"). But the run had not moved on: its
    journal still ends that call with ``call.unknown`` / ``next: reconcile``, so the next
    claim replays into ``park_blocked`` and parks the run on an operation that is already
    committed. Nothing resolves it again: the run is lost.

    A worker of another application does the sweep here, so the run stays queued until the
    resolution is in (with workers of one app it is the gap between a sweep and a claim)."""
    sink.create(chaos_env.sink_url)
    client = Orchestrator(chaos_env.db_url, default_owner=chaos_app.OWNER)
    client.registry = chaos_app.app.registry
    procs = Processes(chaos_env, tmp_path / "logs")
    first = psycopg.connect(chaos_env.db_url, autocommit=False)
    second = psycopg.connect(chaos_env.db_url, autocommit=False)
    try:
        a = procs.start("a", worker_command(4, LEASE))
        run = client.submit(chaos_app.checkout, {"steps": [
            {"call": "pay", "id": "only", "fault": "late", "n": 1}]})
        # The tool applied and now hangs; the gateway's timeout fires within 2 s.
        _until("the late payment to apply", lambda: _sql(
            chaos_env.sink_url, "SELECT 1 FROM chaos_calls WHERE outcome = 'late'"))
        first.execute("SELECT 1 FROM orchestrator.runs WHERE id = %s FOR UPDATE", (run.id,))
        first_pid = first.info.backend_pid
        # Worker A's write that marks the operation unknown waits behind our row lock ...
        _until("the unknown mark to wait", lambda: _waiting_behind(
            chaos_env.db_url, first_pid, "reconciliation_items") or _waiting_behind(
            chaos_env.db_url, first_pid, "fence"))
        # ... a second lock request queues behind it, and once the mark commits, the park
        # that follows waits behind that one.
        holder = threading.Thread(target=lambda: second.execute(
            "SELECT 1 FROM orchestrator.runs WHERE id = %s FOR UPDATE", (run.id,)))
        holder.start()
        _until("the second lock request to queue", lambda: _sql(
            chaos_env.db_url, "SELECT 1 FROM pg_stat_activity WHERE pid = %s AND "
            "wait_event_type = 'Lock'", (second.info.backend_pid,)))
        first.commit()
        holder.join(timeout=20)
        _until("the operation to be marked unknown", lambda: _sql(
            chaos_env.db_url, "SELECT 1 FROM orchestrator.operations WHERE state = 'unknown'"))
        _until("the park to wait", lambda: _waiting_behind(
            chaos_env.db_url, second.info.backend_pid, "needs_reconciliation"))
        a.kill()
        a.wait()
        second.commit()
        status = _sql(chaos_env.db_url, "SELECT status FROM orchestrator.runs WHERE id = %s",
                      (run.id,))[0]["status"]
        assert status == "running", f"the scenario did not set up: the run is {status}"
        # A worker of another application sweeps the lapsed lease: the run is queued again.
        procs.start("sweeper", [*worker_command(2, LEASE)[:5], "tests.acceptance.flows:app",
                                *worker_command(2, LEASE)[6:]])
        _until("the sweep", lambda: _sql(
            chaos_env.db_url, "SELECT 1 FROM orchestrator.runs WHERE id = %s AND status = "
            "'queued'", (run.id,)), timeout=30)
        procs.start("reconciler", reconciler_command())
        _until("the lookup to resolve the operation", lambda: _sql(
            chaos_env.db_url, "SELECT 1 FROM orchestrator.reconciliation_items WHERE state = "
            "'resolved'"), timeout=30)
        procs.start("b", worker_command(4, LEASE))
        give_up = time.monotonic() + 15
        while time.monotonic() < give_up:
            row = _sql(chaos_env.db_url, "SELECT status, waiting_for FROM orchestrator.runs "
                       "WHERE id = %s", (run.id,))[0]
            if row["status"] == "succeeded":
                break
            time.sleep(0.2)
        journal = [e["kind"] for e in _sql(
            chaos_env.db_url, "SELECT kind FROM orchestrator.journal WHERE run_id = %s "
            "ORDER BY seq", (run.id,))]
        ops = _sql(chaos_env.db_url, "SELECT state FROM orchestrator.operations")
        assert row["status"] == "succeeded", (
            f"run {row['status']} ({row['waiting_for']}); operations {ops}; journal {journal}")
    finally:
        first.close()
        second.close()
        procs.close()
        client.close()
