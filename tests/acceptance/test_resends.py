"""Re-sending what is proven not sent (CONTRACT C8) and the dispatch check of the lease (C6),
with real worker processes that die or are paused mid-call.

- An attempt its worker lost, which a lookup or an operator proves not applied, is sent again
  as a new attempt with a new key, outside the tool's retry budget.
- While its outcome is unknown, a consequential call is never sent again.
- A tool that kills its worker every time ends with a clear code after ``max_engine_resends``.
- A worker paused between ``submitted`` and the call, past its lease, does not send once it
  resumes; resumed while nobody took the run, it renews the lease and sends once.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from orchestrator import RunFailed
from tests.acceptance import flows
from tests.acceptance.conftest import ROOT, Workers
from tests.clitools import run_cli


def _reconciler(workers: Workers) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "reconciler", "--app",
         "tests.acceptance.flows:app", "--base-delay", "0.2"], cwd=ROOT,
        env={**os.environ, "ORCHESTRATOR_DATABASE_URL": workers.url, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers.procs.append(proc)
    return proc


def _calls(workers: Workers) -> list[dict[str, Any]]:
    return workers.sql("SELECT key, pid FROM public.sink_calls ORDER BY id")


def _ops(workers: Workers) -> list[dict[str, Any]]:
    return workers.sql("SELECT attempt, state, idempotency_key FROM orchestrator.operations "
                       "ORDER BY attempt")


def _journal(workers: Workers, run_id: Any) -> list[tuple[str, dict[str, Any]]]:
    return [(e["kind"], e["payload"]) for e in workers.sql(
        "SELECT kind, payload FROM orchestrator.journal WHERE run_id = %s ORDER BY seq",
        (run_id,))]


def _status(workers: Workers, run_id: Any) -> str:
    return str(workers.sql("SELECT status FROM orchestrator.runs WHERE id = %s",
                           (run_id,))[0]["status"])


def _die_at_submitted(workers: Workers, client: Any, tool: str) -> Any:
    first = workers.start("a", ORCHESTRATOR_FAULT_POINT="after_submitted",
                          ORCHESTRATOR_FAULT_TOOL=tool)
    run = client.submit(flows.one_call, {"tool": tool})
    first.wait(timeout=30)
    assert first.returncode == -9, "the worker did not die at the fault point"
    return run


def test_a_lost_attempt_that_a_lookup_proves_not_applied_is_sent_again(workers, client):
    run = _die_at_submitted(workers, client, "record_with_lookup")
    workers.start("b")
    _reconciler(workers)
    result = client.get_run(run.id).result(timeout=60)
    calls = _calls(workers)
    assert len(calls) == 1 and result["key"] == calls[0]["key"]  # one send, the re-sent one
    assert workers.sql("SELECT count(*) AS n FROM public.sink_effects")[0]["n"] == 1
    ops = _ops(workers)
    assert [(o["attempt"], o["state"]) for o in ops] == [(1, "not_applied"), (2, "committed")]
    assert ops[0]["idempotency_key"] != ops[1]["idempotency_key"]  # a new key
    story = _journal(workers, run.id)
    assert [k for k, _ in story] == [
        "call.submitted", "call.unknown", "call.not_applied", "call.retrying",
        "call.submitted", "call.completed", "run.completed"]
    assert story[1][1]["reason"] == "WORKER_LOST"
    assert story[2][1]["resolved_by"] == "reconciler"
    assert story[3][1]["resend"] == "lost"  # why attempt 2 exists
    shown = run_cli(["runs", "show", str(run.id)], database_url=workers.url)
    assert shown.returncode == 0, shown.stderr
    for told in ("outcome unknown (WORKER_LOST)", "proven not applied by reconciler",
                 "re-sent as attempt 2: attempt 1 was lost by its worker",
                 "attempt 2 sent", "committed"):
        assert told in shown.stdout, shown.stdout


def test_a_consequential_call_is_never_sent_again_while_its_outcome_is_unknown(
        workers, client):
    """No lookup: the operation waits for a person, and nothing is sent meanwhile, however
    long; the operator's `--not-applied` (re-send by default) sends it once."""
    run = _die_at_submitted(workers, client, "record")
    workers.start("b")
    _reconciler(workers)
    workers.wait(lambda: workers.sql(
        "SELECT 1 FROM orchestrator.reconciliation_items WHERE state = 'operator'"),
        "the item to reach operators")
    time.sleep(2.0)  # workers and the reconciler keep running: still nothing is sent
    assert _calls(workers) == []
    assert _status(workers, run.id) == "needs_reconciliation"
    op = _ops(workers)
    assert [(o["attempt"], o["state"]) for o in op] == [(1, "unknown")]
    op_id = workers.sql("SELECT id FROM orchestrator.operations")[0]["id"]
    resolved = run_cli(["ops", "resolve", str(op_id), "--not-applied", "--evidence",
                        "provider dashboard shows no such charge", "--operator", "ann"],
                       database_url=workers.url)
    assert resolved.returncode == 0, resolved.stderr
    assert "sends the call again as a new attempt" in resolved.stdout
    assert client.get_run(run.id).result(timeout=30)["step"] == 1
    assert len(_calls(workers)) == 1
    story = _journal(workers, run.id)
    assert story[2] == ("call.not_applied", {"op": op_id, "resolved_by": "ann",
                                             "then": "resend"})
    assert story[3][1]["resend"] == "lost"


def test_an_operator_may_fail_the_call_instead(workers, client):
    run = _die_at_submitted(workers, client, "record")
    workers.start("b")
    workers.wait(lambda: _status(workers, run.id) == "needs_reconciliation", "the run to park")
    op_id = workers.sql("SELECT id FROM orchestrator.operations")[0]["id"]
    resolved = run_cli(["ops", "resolve", str(op_id), "--not-applied", "--then", "fail",
                        "--evidence", "the customer cancelled", "--operator", "ann"],
                       database_url=workers.url)
    assert resolved.returncode == 0, resolved.stderr
    assert "the call fails with TOOL_FAILED" in resolved.stdout
    with pytest.raises(RunFailed) as failed:
        client.get_run(run.id).result(timeout=30)
    assert failed.value.code == "WORKFLOW_FAILED"
    assert failed.value.cause is not None and failed.value.cause["reason"] == "operator"
    assert _calls(workers) == []
    failure = [p for k, p in _journal(workers, run.id) if k == "call.failed"]
    assert failure == [{"op": op_id, "attempt": 1, "cause": "not_applied",
                        "reason": "operator", "incident": None}]


def test_then_goes_only_with_not_applied(workers):
    refused = run_cli(["ops", "resolve", "1", "--committed", "--receipt", "{}", "--then",
                       "fail", "--evidence", "x", "--operator", "ann"],
                      database_url=workers.url)
    assert refused.returncode == 2
    assert "--then goes only with --not-applied" in refused.stderr


def test_a_tool_that_kills_its_worker_every_time_ends_at_the_resend_cap(workers, client):
    """``max_engine_resends=2``: the first attempt and two re-sends each kill a worker; the
    third proof of a non-effect fails the call with reason ``resend_limit``."""
    _reconciler(workers)
    run = client.submit(flows.one_call, {"tool": "crashes_its_worker"})
    started = 0
    give_up = time.monotonic() + 90
    while _status(workers, run.id) not in ("failed", "succeeded"):
        assert time.monotonic() < give_up, "the run did not end"
        if all(p.poll() is not None for p in workers.procs[1:]):
            started += 1
            assert started <= 5, "more workers died than the cap allows"
            workers.start(f"w{started}")
        time.sleep(0.1)
    with pytest.raises(RunFailed) as failed:
        client.get_run(run.id).result(timeout=5)
    assert failed.value.code == "WORKFLOW_FAILED"
    assert len(_calls(workers)) == 3  # the first attempt and two re-sends
    assert [o["state"] for o in _ops(workers)] == ["not_applied"] * 3
    failure = [p for k, p in _journal(workers, run.id) if k == "call.failed"]
    assert [(p["cause"], p["reason"]) for p in failure] == [("worker_lost", "resend_limit")]
    assert failed.value.cause is not None
    assert (failed.value.cause["tool"], failed.value.cause["cause"],
            failed.value.cause["reason"]) == ("crashes_its_worker", "worker_lost", "resend_limit")


def _stopped(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return stat.rsplit(")", 1)[1].split()[0] == "T"


def _paused_past_its_lease(workers: Workers, client: Any) -> tuple[Any, Any]:
    """A worker that stopped itself (SIGSTOP) right after committing ``submitted`` for a
    ``record_with_lookup`` call, and stays stopped until that run's lease has passed."""
    paused = workers.start("a", ORCHESTRATOR_FAULT_POINT="after_submitted",
                           ORCHESTRATOR_FAULT_TOOL="record_with_lookup",
                           ORCHESTRATOR_FAULT_SIGNAL="SIGSTOP")
    run = client.submit(flows.one_call, {"tool": "record_with_lookup"})
    workers.wait(lambda: _stopped(paused.pid), "the worker to stop itself")
    workers.wait(lambda: workers.sql(
        "SELECT 1 FROM orchestrator.runs WHERE id = %s AND lease_expires_at < now()",
        (run.id,)), "its lease to pass")
    return paused, run


def test_a_worker_paused_after_submitted_past_its_lease_does_not_send(workers, client):
    paused, run = _paused_past_its_lease(workers, client)
    other = workers.start("b")
    _reconciler(workers)
    result = client.get_run(run.id).result(timeout=60)  # re-sent by b, proven not applied
    paused.send_signal(signal.SIGCONT)
    workers.wait(lambda: "not sent" in workers.log("a"), "the paused worker to withhold")
    time.sleep(0.5)
    calls = _calls(workers)
    assert [c["pid"] for c in calls] == [other.pid]  # nothing from the paused worker
    assert result["key"] == calls[0]["key"]
    assert [(o["attempt"], o["state"]) for o in _ops(workers)] == [
        (1, "not_applied"), (2, "committed")]


def test_a_paused_worker_whose_run_nobody_took_sends_once(workers, client):
    """Resumed before another worker took the run: it renews the lease and sends (or, if its
    own sweep re-queued the run first, withholds, claims it again and re-sends once the lookup
    proved attempt 1 not applied). Either way, one send."""
    paused, run = _paused_past_its_lease(workers, client)
    _reconciler(workers)
    paused.send_signal(signal.SIGCONT)  # nobody else works: the lease may still be its own
    result = client.get_run(run.id).result(timeout=60)
    calls = _calls(workers)
    assert [c["pid"] for c in calls] == [paused.pid]
    assert result["key"] == calls[0]["key"]
    assert workers.sql("SELECT count(*) AS n FROM public.sink_effects")[0]["n"] == 1
    assert [o["state"] for o in _ops(workers)][-1] == "committed"
