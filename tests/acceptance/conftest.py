"""Real worker processes for acceptance tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from orchestrator import Orchestrator
from tests.acceptance import flows

ROOT = Path(__file__).resolve().parents[2]


class Workers:
    """Starts worker processes on one database and stops whatever is left at the end."""

    def __init__(self, url: str, logs: Path) -> None:
        self.url = url
        self.logs = logs
        self.procs: list[subprocess.Popen[bytes]] = []
        self.conn = psycopg.connect(url, autocommit=True, row_factory=dict_row)

    def sql(self, query: str, params: Any = None) -> list[dict[str, Any]]:
        cur = self.conn.execute(query, params)
        return cur.fetchall() if cur.description else []

    def start(self, name: str, *, concurrency: int = 10, app: str = "tests.acceptance.flows:app",
              args: Sequence[str] = (), **env: str) -> subprocess.Popen[bytes]:
        environ = {**os.environ, "ORCHESTRATOR_DATABASE_URL": self.url,
                   "PYTHONPATH": str(ROOT), **env}
        with open(self.logs / f"{name}.log", "wb") as log:  # the child keeps its own copy
            proc = subprocess.Popen(
                [sys.executable, "-m", "orchestrator", "worker", "--app", app,
                 "--concurrency", str(concurrency), *args],
                cwd=ROOT, env=environ, stdout=log, stderr=subprocess.STDOUT)
        self.procs.append(proc)
        self.wait(lambda: self.sql("SELECT 1 FROM orchestrator.workers WHERE pid = %s",
                                   (proc.pid,)), f"worker {name} to register", proc=proc)
        return proc

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")

    def wait(self, predicate: Callable[[], Any], what: str, timeout: float = 30.0,
             proc: subprocess.Popen[bytes] | None = None) -> None:
        give_up = time.monotonic() + timeout
        while not predicate():
            if proc is not None and proc.poll() is not None:
                raise AssertionError(f"the worker exited ({proc.returncode}) before {what}")
            if time.monotonic() > give_up:
                raise AssertionError(f"timed out waiting for {what}")
            time.sleep(0.05)

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait()
        self.conn.close()


@pytest.fixture
def workers(migrated_database_url: str, tmp_path: Path) -> Iterator[Workers]:
    manager = Workers(migrated_database_url, tmp_path)
    manager.sql(flows.SINK_DDL)
    yield manager
    manager.close()


@pytest.fixture
def client(migrated_database_url: str) -> Iterator[Orchestrator]:
    """The acceptance app, as a submitting client in the test process."""
    os.environ["ORCHESTRATOR_DATABASE_URL"] = migrated_database_url
    app = Orchestrator(migrated_database_url, default_owner=flows.app.default_owner)
    app.registry = flows.app.registry
    yield app
    app.close()
    os.environ.pop("ORCHESTRATOR_DATABASE_URL", None)
