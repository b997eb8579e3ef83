"""The event loop of worker processes: uvloop's where it is installed, asyncio's on request
(``--event-loop``, ``ORCHESTRATOR_EVENT_LOOP``), and the same run carried across both: a
fleet may mix them. A choice that is not one is refused before anything is written:
``INVALID_REQUEST`` naming the flag, ``CONFIGURATION_ERROR`` naming the variable."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.acceptance import flows
from tests.acceptance.conftest import ROOT

pytest.importorskip("uvloop")  # a dependency of the package wherever it runs (not Windows)


def _started_line(log: str) -> str:
    return next(line for line in log.splitlines() if " started: " in line and "slots" in line)


def test_a_run_moves_between_workers_on_either_loop(workers, client):
    a = workers.start("a", ACCEPTANCE_TOOL_DELAY="60")
    run = client.submit(flows.three_steps, {})
    # Step 2's tool is idempotent and sleeps in A: re-sent with its key on B.
    workers.wait(lambda: workers.sql("SELECT 1 FROM public.sink_calls WHERE step = 2"),
                 "step 2 to start in worker A")
    a.send_signal(signal.SIGKILL)
    a.wait()
    b = workers.start("b", args=["--event-loop", "asyncio"])
    assert [r["step"] for r in client.get_run(run.id).result(timeout=60)] == [1, 2, 3]
    b.send_signal(signal.SIGTERM)
    assert b.wait(timeout=30) == 0
    c = workers.start("c", ORCHESTRATOR_EVENT_LOOP="asyncio", args=["--event-loop", "uvloop"])
    again = client.submit(flows.single, {})
    assert client.get_run(again.id).result(timeout=30) is not None
    c.send_signal(signal.SIGTERM)
    assert c.wait(timeout=30) == 0
    assert _started_line(workers.log("a")).endswith("event loop uvloop")  # the default
    assert _started_line(workers.log("b")).endswith("event loop asyncio")
    assert _started_line(workers.log("c")).endswith("event loop uvloop")  # the flag wins


def test_a_reconciler_runs_on_the_loop_chosen(migrated_database_url, tmp_path):
    env = {**os.environ, "ORCHESTRATOR_DATABASE_URL": migrated_database_url,
           "PYTHONPATH": str(ROOT)}
    for name, how in (("default", []), ("asyncio", ["--event-loop", "asyncio"])):
        with open(tmp_path / f"{name}.log", "wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "orchestrator", "reconciler", "--app",
                 "tests.acceptance.flows:app", *how], cwd=ROOT, env=env, stdout=log,
                stderr=subprocess.STDOUT)
        try:
            give_up = time.monotonic() + 30
            while " started: event loop " not in (tmp_path / f"{name}.log").read_text():
                assert proc.poll() is None and time.monotonic() < give_up, (
                    (tmp_path / f"{name}.log").read_text())
                time.sleep(0.05)
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
        finally:
            if proc.poll() is None:
                proc.kill()
        said = (tmp_path / f"{name}.log").read_text()
        assert f"started: event loop {'uvloop' if name == 'default' else 'asyncio'}" in said


@pytest.mark.parametrize("how", [["--event-loop", "fast"], []])
def test_an_event_loop_that_is_not_one_is_refused_before_anything_is_written(
        migrated_database_url, workers, how):
    env = {**os.environ, "ORCHESTRATOR_DATABASE_URL": migrated_database_url,
           "PYTHONPATH": str(ROOT), "ORCHESTRATOR_EVENT_LOOP": "fast"}
    for command in ("worker", "reconciler"):
        done = subprocess.run(
            [sys.executable, "-m", "orchestrator", command, "--app", "tests.acceptance.flows:app",
             *how], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        said = ("INVALID_REQUEST: --event-loop must be one of auto, uvloop, asyncio, not 'fast'"
                if how else "CONFIGURATION_ERROR: ORCHESTRATOR_EVENT_LOOP must be one of auto, "
                "uvloop, asyncio, not 'fast'")
        assert done.returncode == 2, done.stderr
        assert f"orchestrator: error: {said}" in done.stderr, done.stderr
    assert workers.sql("SELECT count(*) AS n FROM orchestrator.workers") == [{"n": 0}]
