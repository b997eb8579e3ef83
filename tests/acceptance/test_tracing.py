"""One trace from the submitting process to the worker that finishes the run (docs/tracing.md):
a process submits ``two_steps`` inside a span of its own; worker ``a`` calls the first tool and
is killed (SIGKILL) once its receipt is committed; worker ``b`` replays the run and makes the
second call. Every process writes its spans to a file (tests/acceptance/spanfile.py); the test
reads the trace's shape from them, with ``trace_parent`` "child" and "link"."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.acceptance import spanfile
from tests.acceptance.conftest import ROOT


@pytest.mark.parametrize("mode", ["child", "link"])
def test_a_run_killed_mid_way_keeps_one_trace_from_submit_to_the_last_call(
        workers, tmp_path, mode):  # type: ignore[no-untyped-def]
    files = {name: tmp_path / f"{name}.jsonl" for name in ("submitter", "a", "b")}
    first = workers.start("a", ORCHESTRATOR_FAULT_POINT="after_receipt",
                          ORCHESTRATOR_FAULT_TOOL="record", ACCEPTANCE_RECEIPTS_RIDE="0",
                          ACCEPTANCE_SPAN_FILE=str(files["a"]), ACCEPTANCE_TRACE_PARENT=mode)
    submitted = subprocess.run(
        [sys.executable, "-m", "tests.acceptance.trace_submit"], cwd=ROOT, check=True,
        capture_output=True, text=True, timeout=60,
        env={**os.environ, "ORCHESTRATOR_DATABASE_URL": workers.url, "PYTHONPATH": str(ROOT),
             "ACCEPTANCE_SPAN_FILE": str(files["submitter"])})
    run_id = submitted.stdout.strip()
    first.wait(timeout=30)
    assert first.returncode == -9, "the worker did not die at the fault point"
    workers.start("b", ACCEPTANCE_SPAN_FILE=str(files["b"]), ACCEPTANCE_TRACE_PARENT=mode)
    workers.wait(lambda: workers.sql("SELECT 1 FROM orchestrator.runs WHERE id = %s AND "
                                     "status = 'succeeded'", (run_id,)), "the run to finish")
    workers.wait(lambda: any(s["what"] == "end" and s["name"] == "run two_steps"
                             for s in spanfile.read(files["b"])), "worker b's run span")

    lines = {name: spanfile.read(path) for name, path in files.items()}
    ended = {name: {s["name"]: s for s in spans if s["what"] == "end"}
             for name, spans in lines.items()}
    started = {name: {s["name"]: s for s in spans if s["what"] == "start"}
               for name, spans in lines.items()}
    request, submit = ended["submitter"]["request"], ended["submitter"]["submit two_steps"]
    trace_id = request["trace_id"]
    assert submit["trace_id"] == trace_id and submit["parent_id"] == request["span_id"]
    assert submit["attributes"]["orchestrator.run_id"] == run_id
    # Worker a: its run and its call started and never ended (it was killed).
    assert set(started["a"]) == {"run two_steps", "call record"}
    assert ended["a"] == {}
    run_a, call_a = started["a"]["run two_steps"], started["a"]["call record"]
    # Worker b: the first call is replayed from the journal (no span), the second is called.
    assert set(ended["b"]) == {"run two_steps", "call slow_idempotent"}
    run_b, call_b = ended["b"]["run two_steps"], ended["b"]["call slow_idempotent"]
    assert run_a["attributes"]["orchestrator.replay"] is False
    assert run_b["attributes"]["orchestrator.replay"] is True
    assert run_b["events"] == ["resume"]
    assert run_b["attributes"]["orchestrator.outcome"] == "succeeded"
    for run in (run_a, run_b):
        assert run["attributes"]["orchestrator.run_id"] == run_id
        if mode == "child":
            assert run["trace_id"] == trace_id and run["parent_id"] == submit["span_id"]
            assert run["links"] == []
        else:
            assert run["trace_id"] != trace_id and run["parent_id"] is None
            assert run["links"] == [[trace_id, submit["span_id"]]]
    assert run_a["span_id"] != run_b["span_id"]
    if mode == "child":  # one trace from the request to the last call
        assert {s["trace_id"] for spans in lines.values() for s in spans} == {trace_id}
    for call, run in ((call_a, run_a), (call_b, run_b)):
        assert call["trace_id"] == run["trace_id"] and call["parent_id"] == run["span_id"]
    assert call_b["attributes"]["orchestrator.outcome"] == "committed"
    assert call_b["attributes"]["orchestrator.tool"] == "slow_idempotent"
    assert isinstance(call_b["attributes"]["orchestrator.operation_id"], int)
    assert call_b["attributes"]["orchestrator.attempt"] == 1
    assert call_b["attributes"]["orchestrator.effect_class"] == "idempotent"
