"""The logs of real worker and reconciler processes in JSON (``--log-format json`` or
``ORCHESTRATOR_LOG_FORMAT=json``): every line an object with the run's fields; ``ctx.log``
lines written once across a killed worker's replay; no secret in any line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from orchestrator import RunFailed
from tests.acceptance import flows
from tests.acceptance.conftest import ROOT

SECRET = "sk_live_SECRET"


def _json_lines(text: str) -> list[dict[str, Any]]:
    """Every line of a process's output (stdout and stderr), each one JSON object."""
    lines = [json.loads(line) for line in text.splitlines()]
    for line in lines:
        assert {"ts", "level", "logger", "message"} <= line.keys(), line
    return lines


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0


def test_json_logs_and_ctx_log_once_across_a_killed_worker(workers, client):
    a = workers.start("a", args=["--log-format", "json"], ACCEPTANCE_TOOL_DELAY="60")
    run = client.submit(flows.logged, {})
    workers.wait(lambda: workers.sql("SELECT 1 FROM public.sink_calls WHERE step = 1"),
                 "step 1 to start in worker A")
    a.send_signal(signal.SIGKILL)
    a.wait()
    b = workers.start("b", ORCHESTRATOR_LOG_FORMAT="json")
    assert client.get_run(run.id).result(timeout=30)["step"] == 1
    leak = client.submit(flows.leaks, {"secret": SECRET})
    with pytest.raises(RunFailed) as failed:
        client.get_run(leak.id).result(timeout=30)
    _stop(b)

    said = {name: _json_lines(workers.log(name)) for name in ("a", "b")}
    mine = {name: [line["message"] for line in lines
                   if line["logger"] == "orchestrator.workflow.logged"]
            for name, lines in said.items()}
    # A wrote the line before the call; B replayed that code silently and wrote the rest.
    assert mine == {"a": ["step 1 begins"], "b": ["step 1 done"]}
    for lines in said.values():
        for line in lines:
            if line["logger"] == "orchestrator.workflow.logged":
                assert (line["run_id"], line["workflow"]) == (str(run.id), "logged@1")
    assert any(line["message"].startswith("worker starting on ") for line in said["b"])
    # and its stop announcement, as a reconciler's (docs/logging.md): the last line
    assert (said["b"][-1]["logger"], said["b"][-1]["message"]) == (
        "orchestrator.cli", "worker stopped")
    ended = [line for line in said["b"] if line.get("run_id") == str(leak.id)]
    assert [{k: line.get(k) for k in ("level", "logger", "workflow", "code", "incident",
                                      "cause")} for line in ended] == [
        {"level": "INFO", "logger": "orchestrator.worker", "workflow": "leaks@1",
         "code": "WORKFLOW_FAILED", "incident": failed.value.incident, "cause": "KeyError"}]
    assert SECRET not in workers.log("b")


def test_a_parked_run_and_the_reconciler_log_the_operation_in_json(workers, client):
    first = workers.start("a", ORCHESTRATOR_FAULT_POINT="after_submitted",
                          ORCHESTRATOR_FAULT_TOOL="record")
    run = client.submit(flows.one_call, {"tool": "record"})
    first.wait(timeout=30)
    assert first.returncode == -9, "the worker did not die at the fault point"
    second = workers.start("b", args=["--log-format", "json"])
    workers.wait(lambda: workers.sql("SELECT 1 FROM orchestrator.runs WHERE id = %s AND "
                                     "status = 'needs_reconciliation'", (run.id,)),
                 "the run to park")
    op = workers.sql("SELECT id FROM orchestrator.operations")[0]["id"]
    env = {**os.environ, "ORCHESTRATOR_DATABASE_URL": workers.url, "PYTHONPATH": str(ROOT)}
    with open(workers.logs / "reconciler.log", "wb") as out:
        reconciler = subprocess.Popen(
            [sys.executable, "-m", "orchestrator", "reconciler", "--app",
             "tests.acceptance.flows:app", "--log-format", "json"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
    workers.procs.append(reconciler)
    workers.wait(lambda: workers.sql("SELECT 1 FROM orchestrator.reconciliation_items "
                                     "WHERE state = 'operator'"), "the item to reach operators",
                 proc=reconciler)
    _stop(reconciler)
    _stop(second)

    parked = [line for line in _json_lines(workers.log("b"))
              if line["message"].startswith(f"run {run.id} (one_call@1) needs reconciliation")]
    assert [(p["level"], p["run_id"], p["workflow"], p["operation_id"], p["tool"])
            for p in parked] == [("INFO", str(run.id), "one_call@1", op, "record")]
    assert "incident" not in parked[0]  # the worker was lost: nothing went wrong to keep
    handed = [line for line in _json_lines(workers.log("reconciler"))
              if line["logger"] == "orchestrator.reconciler"]
    assert [(h["level"], h["run_id"], h["operation_id"], h["tool"]) for h in handed] == [
        ("INFO", str(run.id), op, "record")]
    assert "handed to operators" in handed[0]["message"]
