"""Workers on a replicated pair, a load, a failover, and what came of it.

:class:`Scenario` owns the processes of one failover test or measurement: worker and
reconciler processes started once with the pair's multi-host URL (and never restarted: the
point is that they find the new primary by themselves), a client in this process that submits
through the same URL, and the effect sink outside the pair. :func:`effects_by_key` and
:func:`timings` read back what happened, from the sink and from the new primary.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row

from orchestrator import Orchestrator
from orchestrator.db import migrate
from orchestrator.db.config import DatabaseTarget, validate_url
from tests import dbtools
from tests.chaos import sink
from tests.failover import app as failover_app
from tests.failover.pair import ReplicatedPair, replicated_pair

ROOT = Path(__file__).resolve().parents[2]
APP = "tests.failover.app:app"
DATABASE = "orchestrator"


def _migrate(url: str) -> None:
    status = migrate.upgrade(DatabaseTarget(validate_url(url), "argument"))
    assert status.ok, status.describe()


class Scenario:
    """See the module docstring."""

    def __init__(self, pair: ReplicatedPair, sink_url: str, log_dir: Path, *,
                 lease_ttl: float = 3.0) -> None:
        self.pair = pair
        self.url = pair.url(DATABASE)
        self.sink_url = sink_url
        self.log_dir = log_dir
        self.lease_ttl = lease_ttl
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.client = Orchestrator(self.url, default_owner=failover_app.OWNER)
        self.client.registry = failover_app.app.registry

    # -- processes -----------------------------------------------------------------------

    def start(self, workers: int = 2, concurrency: int = 8) -> None:
        env = {**os.environ, "ORCHESTRATOR_DATABASE_URL": self.url,
               sink.ENV_SINK_URL: self.sink_url, "PYTHONPATH": str(ROOT),
               "FAILOVER_LEASE_TTL": str(self.lease_ttl)}
        commands = {f"worker{i}": [sys.executable, "-m", "orchestrator", "worker", "--app", APP,
                                   "--concurrency", str(concurrency),
                                   "--lease-ttl", str(self.lease_ttl)]
                    for i in range(workers)}
        commands["reconciler"] = [sys.executable, "-m", "orchestrator", "reconciler", "--app",
                                  APP, "--max-lookups", "8", "--base-delay", "0.3"]
        for name, cmd in commands.items():
            with open(self.log_dir / f"{name}.log", "wb") as log:
                self.procs[name] = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log,
                                                    stderr=subprocess.STDOUT,
                                                    start_new_session=True)
        pids = [p.pid for n, p in self.procs.items() if n.startswith("worker")]
        self.wait(lambda: len(self.sql("SELECT 1 FROM orchestrator.workers WHERE pid = "
                                       "ANY(%s)", (pids,))) == len(pids),
                  "the workers to register")

    def alive(self) -> dict[str, bool]:
        return {name: proc.poll() is None for name, proc in self.procs.items()}

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        give_up = time.monotonic() + 15
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(max(0.1, give_up - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    def logs(self) -> str:
        out = []
        for name in self.procs:
            text = (self.log_dir / f"{name}.log").read_text(errors="replace")
            out.append(f"--- {name}\n" + "\n".join(text.splitlines()[-15:]))
        return "\n".join(out)

    # -- the database, through the multi-host URL ----------------------------------------

    def sql(self, query: str, params: Any = None) -> list[dict[str, Any]]:
        with psycopg.connect(self.url, autocommit=True, connect_timeout=5,
                             row_factory=dict_row) as conn:
            cur = conn.execute(query, params)
            return cur.fetchall() if cur.description else []

    def wait(self, predicate: Callable[[], Any], what: str, timeout: float = 60) -> None:
        give_up = time.monotonic() + timeout
        while True:
            with contextlib.suppress(psycopg.OperationalError):
                if predicate():
                    return
            if time.monotonic() > give_up:
                raise AssertionError(f"waited {timeout:.0f} s for {what}\n{self.logs()}")
            time.sleep(0.1)

    def statuses(self, ids: list[uuid.UUID]) -> dict[uuid.UUID, str]:
        rows = self.sql("SELECT id, status FROM orchestrator.runs WHERE id = ANY(%s)", (ids,))
        return {r["id"]: r["status"] for r in rows}

    def wait_finished(self, ids: list[uuid.UUID], timeout: float = 120) -> None:
        terminal = {"succeeded", "failed", "cancelled"}
        self.wait(lambda: all(s in terminal for s in self.statuses(ids).values())
                  and len(self.statuses(ids)) == len(ids), f"{len(ids)} runs to finish",
                  timeout)

    def submit(self, workflow: Any, data: dict[str, Any], key: str,
               patience: float = 60) -> uuid.UUID:
        """Submit with an idempotency key, retried through an outage (a retry with the same
        key is safe); returns the run id once a server acknowledged it."""
        give_up = time.monotonic() + patience
        while True:
            try:
                handle = self.client.submit(workflow, data, idempotency_key=key)
                return handle.id
            except Exception:
                if time.monotonic() > give_up:
                    raise
                time.sleep(0.2)


def effects_by_key(sink_url: str) -> dict[str, list[dict[str, Any]]]:
    """The provider's applications, grouped by idempotency key."""
    found: dict[str, list[dict[str, Any]]] = {}
    for effect in sink.load(sink_url)["effects"]:
        found.setdefault(effect["key"], []).append(effect)
    return found


def last_replicated(pair: ReplicatedPair) -> float:
    """The newest journal entry the promoted standby holds (wall clock, epoch seconds): what
    it received from the old primary. Read right after the promotion."""
    rows = ReplicatedPair.query(pair.standby, "SELECT extract(epoch FROM max(created_at))"
                                "::float8 AS t FROM orchestrator.journal", database=DATABASE)
    return float(rows[0]["t"] or 0.0)


def timings(scenario: Scenario, killed_at: float, in_flight: list[uuid.UUID],
            replicated: float) -> dict[str, float | None]:
    """Seconds from the primary's death to the first journal entry committed on the new
    primary, and to the first entry there of every run that was in flight (each one running
    again); from the server's clock (the same machine's). An entry is the new primary's when
    it is newer than the kill and than everything the standby held at its promotion
    (``replicated``, from :func:`last_replicated`)."""
    since = max(killed_at, replicated)
    first = scenario.sql("SELECT extract(epoch FROM min(created_at))::float8 AS t FROM "
                         "orchestrator.journal WHERE created_at > to_timestamp(%s)",
                         (since,))[0]["t"]
    again = scenario.sql(
        "SELECT run_id, extract(epoch FROM min(created_at))::float8 AS t FROM "
        "orchestrator.journal WHERE created_at > to_timestamp(%s) AND run_id = ANY(%s) "
        "GROUP BY run_id", (since, in_flight))
    every = (max(r["t"] for r in again) - killed_at
             if in_flight and len(again) == len(in_flight) else None)
    return {"first_step": None if first is None else first - killed_at,
            "all_in_flight_again": every, "in_flight": float(len(in_flight))}


@contextlib.contextmanager
def environment(admin_url: str, *, synchronous: bool
                ) -> Iterator[tuple[ReplicatedPair, str]]:
    """A pair with the orchestrator's database migrated on it (before the standby is made),
    and a fresh effect sink on the test server (``admin_url``), both removed on the way out."""
    sink_name = dbtools.unique_name("failoversink")
    sink_url = dbtools.create_database(admin_url, sink_name)
    try:
        sink.create(sink_url)
        failover_app.create_gates(sink_url)
        with replicated_pair(synchronous=synchronous, databases=(DATABASE,),
                             setup=_migrate) as pair:
            yield pair, sink_url
    finally:
        with contextlib.suppress(Exception):
            dbtools.drop_database(admin_url, sink_name)
