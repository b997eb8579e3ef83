"""Crash windows on the effect path (CONTRACT C5, C8): a worker kills itself with SIGKILL at a
named fault point right after a commit; another worker (and the reconciler) take over.

Never two calls of a consequential tool; idempotent re-sends only with the same key; unknown
operations land in the queue with their reason; a lookup answering Committed finishes the run
with the original receipt and no second call."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.acceptance import flows
from tests.acceptance.conftest import ROOT


def _crash(workers, client, tool, point, seen=None, **env):  # type: ignore[no-untyped-def]
    """Submit one call of ``tool``; the first worker dies at ``point``; ``seen(run)`` looks at
    what it left; a second worker starts."""
    first = workers.start("a", ORCHESTRATOR_FAULT_POINT=point, ORCHESTRATOR_FAULT_TOOL=tool,
                          **env)
    run = client.submit(flows.one_call, {"tool": tool})
    first.wait(timeout=30)
    assert first.returncode == -9, "the worker did not die at the fault point"
    if seen is not None:
        seen(run)
    workers.start("b")
    return run


def _calls(workers):  # type: ignore[no-untyped-def]
    return workers.sql("SELECT key FROM public.sink_calls ORDER BY id")


def _status(workers, run):  # type: ignore[no-untyped-def]
    return workers.sql("SELECT status FROM orchestrator.runs WHERE id = %s", (run.id,))[0][
        "status"]


@pytest.mark.parametrize("point", ["after_intent", "after_submitted", "after_tool_return"])
def test_a_consequential_call_in_flight_goes_to_reconciliation(workers, client, point):
    run = _crash(workers, client, "record", point)
    workers.wait(lambda: _status(workers, run) == "needs_reconciliation", "the run to park")
    expected_calls = 1 if point == "after_tool_return" else 0
    assert len(_calls(workers)) == expected_calls  # never sent again
    item = workers.sql("SELECT i.reason, i.state, o.state AS op FROM "
                       "orchestrator.reconciliation_items i JOIN orchestrator.operations o "
                       "ON o.id = i.operation_id")
    assert item == [{"reason": "WORKER_LOST", "state": "open", "op": "unknown"}]


@pytest.mark.parametrize("ride", ["1", "0"])
def test_after_the_receipt_the_run_finishes_without_calling_again(workers, client, ride):
    """The worker dies once the receipt is committed. Riding, that commit is the run's success
    itself (the workflow's next write); with ``receipts_ride=False`` the receipt commits alone
    and the second worker replays the run from it."""
    def seen(run):  # type: ignore[no-untyped-def]
        left = workers.sql("SELECT status FROM orchestrator.runs WHERE id = %s", (run.id,))
        ops = workers.sql("SELECT state FROM orchestrator.operations")
        assert left[0]["status"] == ("succeeded" if ride == "1" else "running")
        assert ops == [{"state": "committed"}]

    run = _crash(workers, client, "record", "after_receipt", seen=seen,
                 ACCEPTANCE_RECEIPTS_RIDE=ride)
    assert client.get_run(run.id).result(timeout=30)["step"] == 1
    assert len(_calls(workers)) == 1
    kinds = [e["kind"] for e in workers.sql(
        "SELECT kind FROM orchestrator.journal WHERE run_id = %s ORDER BY seq", (run.id,))]
    assert kinds == ["call.submitted", "call.completed", "run.completed"]


@pytest.mark.parametrize("point", ["after_submitted", "after_tool_return"])
def test_an_idempotent_call_is_resent_with_the_same_key(workers, client, point):
    run = _crash(workers, client, "record_idempotent", point)
    result = client.get_run(run.id).result(timeout=30)
    keys = [c["key"] for c in _calls(workers)]
    assert len(keys) == (2 if point == "after_tool_return" else 1)
    assert set(keys) == {result["key"]}
    effects = workers.sql("SELECT count(*) AS n FROM public.sink_effects")[0]["n"]
    assert effects == 1
    states = workers.sql("SELECT attempt, state, idempotency_key FROM orchestrator.operations "
                         "ORDER BY attempt")
    assert [s["state"] for s in states] == ["committed", "committed"]
    assert {s["idempotency_key"] for s in states} == {result["key"]}


def test_a_lookup_that_answers_committed_finishes_with_the_original_receipt(workers, client):
    run = _crash(workers, client, "record_with_lookup", "after_tool_return")
    workers.wait(lambda: _status(workers, run) == "needs_reconciliation", "the run to park")
    reconciler = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "reconciler", "--app",
         "tests.acceptance.flows:app"], cwd=ROOT,
        env={**__import__("os").environ, "ORCHESTRATOR_DATABASE_URL": workers.url,
             "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers.procs.append(reconciler)
    result = client.get_run(run.id).result(timeout=30)
    calls = _calls(workers)
    assert len(calls) == 1  # the tool was not called again
    assert result == {"step": 1, "key": calls[0]["key"]}
    op = workers.sql("SELECT state, receipt FROM orchestrator.operations")
    assert op == [{"state": "committed", "receipt": result}]
    lookups = workers.sql("SELECT answer FROM orchestrator.reconciliation_lookups")
    assert [x["answer"] for x in lookups] == ["committed"]


def test_a_crash_while_the_intent_is_pending_never_loses_or_repeats_the_call(workers, client):
    """With a policy stage, the intent is committed as ``pending`` before the stage runs; a
    worker that dies there left nothing dispatched, so the next one runs the stage again and
    dispatches exactly once."""
    run = _crash(workers, client, "record_gated", "after_intent")
    assert client.get_run(run.id).result(timeout=30)["step"] == 1
    assert len(_calls(workers)) == 1
    assert workers.sql("SELECT state FROM orchestrator.operations") == [{"state": "committed"}]
