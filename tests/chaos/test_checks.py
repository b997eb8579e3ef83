"""The invariant checks on hand-made evidence: each one notices what it is there to notice."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from tests.chaos import checks

pytestmark = pytest.mark.chaos

RUN = uuid.uuid4()
T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _at(seconds: float) -> datetime:
    return datetime.fromtimestamp(T0.timestamp() + seconds, UTC)


def _run(**over: Any) -> dict[str, Any]:
    return {"id": RUN, "workflow_name": "checkout", "status": "succeeded", "outcome_code": None,
            "error": None, "revision": 3, "parent_run_id": None, "available_at": None,
            "waiting_for": None, "idempotency_key": "k", **over}


def _journal(*kinds: tuple[str, dict[str, Any]], tokens: list[int] | None = None
             ) -> list[dict[str, Any]]:
    tokens = tokens or [1] * len(kinds)
    return [{"run_id": RUN, "seq": i + 1, "kind": kind, "position": 0 if "call" in kind else None,
             "name": "pay", "payload": payload, "lease_token": tokens[i], "created_at": _at(i)}
            for i, (kind, payload) in enumerate(kinds)]


def _op(op_id: int, state: str, key: str, **over: Any) -> dict[str, Any]:
    return {"id": op_id, "run_id": RUN, "position": 0, "attempt": op_id, "tool_name": "pay",
            "effect_class": "consequential", "state": state, "idempotency_key": key,
            "worker_id": "host:4242:abc", "submitted_at": _at(0), "receipt": None, **over}


def _effect(effect_id: int, key: str, op_id: int, effect: str = "consequential"
            ) -> dict[str, Any]:
    return {"id": effect_id, "tool": "pay", "effect": effect, "key": key, "run_id": RUN,
            "position": 0, "attempt": op_id, "op_id": op_id, "pid": 4242, "at": _at(1)}


def _call(key: str, op_id: int, fault: str = "none", effect: str = "consequential",
          started: float = 0.5) -> dict[str, Any]:
    return {"tool": "pay", "effect": effect, "run_id": RUN, "position": 0, "attempt": op_id,
            "op_id": op_id, "key": key, "pid": 4242, "fault": fault, "outcome": "ok",
            "started_at": _at(started)}


def _verdict(runs: list[dict[str, Any]], journal: list[dict[str, Any]],
             ops: list[dict[str, Any]], effects: list[dict[str, Any]],
             calls: list[dict[str, Any]] | None = None, items: list[dict[str, Any]] | None = None,
             procs: list[checks.ProcRecord] | None = None) -> checks.Verdict:
    data = checks.Data(runs, journal, ops, items or [], calls or [], effects, _at(100).timestamp())
    observed = checks.Observed({"k": RUN}, procs or [], [])
    return checks.verdict(data, observed, set())


def _clean_story() -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[dict[str, Any]],
                            list[dict[str, Any]]]:
    journal = _journal(("call.submitted", {"op": 1, "attempt": 1}),
                       ("call.completed", {"op": 1}), ("run.completed", {}))
    ops = [_op(1, "committed", "K1", receipt={"effect": 10})]
    return [_run()], journal, ops, [_effect(10, "K1", 1)]


def test_a_clean_story_passes() -> None:
    verdict = _verdict(*_clean_story())
    assert verdict.ok, checks.format_table(verdict)


def test_a_second_application_of_a_consequential_call_is_a_duplicate() -> None:
    runs, journal, ops, effects = _clean_story()
    effects.append(_effect(11, "K2", 2))
    ops.append(_op(2, "not_applied", "K2"))
    verdict = _verdict(runs, journal, ops, effects)
    assert verdict.row("duplicate consequential effects").value == 1
    assert verdict.row("ledger/sink disagreements").value == 1  # not_applied, yet it applied
    assert not verdict.ok


def test_an_idempotent_effect_sent_again_under_another_key_is_counted() -> None:
    runs, journal, ops, _ = _clean_story()
    effects = [_effect(10, "K1", 1, "idempotent")]
    calls = [_call("K1", 1, effect="idempotent"), _call("K3", 3, effect="idempotent", started=5)]
    assert _verdict(runs, journal, ops, effects, calls).row(
        "idempotent re-sends with a different key").value == 1


def test_a_late_request_the_provider_refused_is_no_resend_under_another_key() -> None:
    # Attempt 3 (K3) was submitted under lease 1; its worker paused past its lease; the next
    # holder (lease 2, from 1 s) had K3 proven not applied (voided) and applied attempt 4
    # (K4); the paused worker's request for K3 arrived at 5 s and was refused.
    runs = [_run()]
    journal = _journal(("call.submitted", {"op": 3}), ("call.unknown", {"op": 3}),
                       ("call.submitted", {"op": 4}), ("call.completed", {"op": 4}),
                       ("run.completed", {}), tokens=[1, 2, 2, 2, 2])
    ops = [_op(3, "not_applied", "K3", lease_token=1),
           _op(4, "committed", "K4", lease_token=2, receipt={"effect": 10})]
    effects = [_effect(10, "K4", 4, "idempotent")]
    late = _call("K3", 3, effect="idempotent", started=5)
    late["outcome"] = "refused"
    calls = [late, _call("K4", 4, effect="idempotent", started=2.5)]
    row = "idempotent re-sends with a different key"
    assert _verdict(runs, journal, ops, effects, calls).row(row).value == 0
    late["outcome"] = "ok"  # had the provider taken it, it would count
    assert _verdict(runs, journal, ops, effects, calls).row(row).value == 1
    late["outcome"] = "refused"  # and so would a refused request from the lease's holder
    ops[0]["lease_token"] = 2
    assert _verdict(runs, journal, ops, effects, calls).row(row).value == 1


def test_a_writer_with_an_older_lease_after_a_newer_one_breaks_the_history() -> None:
    runs, _, ops, effects = _clean_story()
    journal = _journal(("call.submitted", {"op": 1, "attempt": 1}),
                       ("call.completed", {"op": 1}), ("run.completed", {}), tokens=[2, 1, 2])
    assert _verdict(runs, journal, ops, effects).row("journal integrity violations").value == 1


def test_a_gap_in_the_sequence_breaks_the_history() -> None:
    runs, journal, ops, effects = _clean_story()
    journal[2]["seq"] = 4
    assert _verdict(runs, journal, ops, effects).row("journal integrity violations").value >= 1


def test_an_unknown_without_a_fault_is_unexplained_and_one_left_unlisted_is_unresolved() -> None:
    journal = _journal(("call.submitted", {"op": 1, "attempt": 1}),
                       ("call.unknown", {"op": 1, "reason": "WORKER_LOST", "next": "reconcile"}))
    ops = [_op(1, "unknown", "K1")]
    procs = [checks.ProcRecord("worker", 4242, _at(-10).timestamp())]
    verdict = _verdict([_run(status="needs_reconciliation", revision=2)], journal, ops, [],
                       procs=procs)
    assert verdict.row("unexplained unknowns").value == 1
    assert verdict.row("unknowns neither auto-resolved nor listed for operators").value == 1
    assert verdict.row("runs lost").value == 1  # blocked on an operation no list shows


def test_an_unknown_whose_worker_was_killed_in_its_window_is_explained() -> None:
    journal = _journal(("call.submitted", {"op": 1, "attempt": 1}),
                       ("call.unknown", {"op": 1, "reason": "WORKER_LOST", "next": "reconcile"}))
    ops = [_op(1, "unknown", "K1")]
    killed = checks.ProcRecord("worker", 4242, _at(-10).timestamp(), ended=_at(0.5).timestamp(),
                               faults=[checks.Interval(_at(0.5).timestamp(),
                                                       _at(0.5).timestamp(), "SIGKILL")])
    items = [{"operation_id": 1, "state": "operator", "reason": "WORKER_LOST",
              "resolution": None}]
    verdict = _verdict([_run(status="needs_reconciliation", revision=2)], journal, ops, [],
                       items=items, procs=[killed])
    assert verdict.ok, checks.format_table(verdict)


def test_an_effect_the_ledger_does_not_know_and_an_operation_left_in_flight_disagree() -> None:
    runs, journal, ops, effects = _clean_story()
    effects.append(_effect(12, "K9", 9))
    ops.append(_op(2, "submitted", "K2"))
    assert _verdict(runs, journal, ops, effects).row("ledger/sink disagreements").value == 2


def test_a_submission_that_never_became_a_run_is_lost() -> None:
    runs, journal, ops, effects = _clean_story()
    data = checks.Data(runs, journal, ops, [], [], effects, _at(100).timestamp())
    observed = checks.Observed({"k": RUN, "other": None}, [], [])
    assert checks.verdict(data, observed, set()).row("runs lost").value == 1


def test_an_earlier_attempt_is_listed_through_a_later_one_with_the_same_key() -> None:
    journal = _journal(("call.submitted", {"op": 1, "attempt": 1}),
                       ("call.unknown", {"op": 1, "reason": "WORKER_LOST", "next": "resend"}),
                       ("call.submitted", {"op": 2, "attempt": 2}),
                       ("call.unknown", {"op": 2, "reason": "WORKER_LOST",
                                         "next": "reconcile"}))
    ops = [_op(1, "unknown", "K1", effect_class="idempotent"),
           _op(2, "unknown", "K1", effect_class="idempotent")]
    killed = checks.ProcRecord("worker", 4242, _at(-10).timestamp(), ended=_at(0.5).timestamp())
    items = [{"operation_id": 2, "state": "operator", "reason": "WORKER_LOST",
              "resolution": None}]
    verdict = _verdict([_run(status="needs_reconciliation", revision=4)], journal, ops, [],
                       items=items, procs=[killed])
    assert verdict.ok, checks.format_table(verdict)


def test_a_blocked_run_with_nothing_unknown_is_lost() -> None:
    runs, journal, ops, effects = _clean_story()
    runs[0].update(status="needs_reconciliation", waiting_for="reconciliation of operation 1")
    journal = journal[:2]
    runs[0]["revision"] = 2
    assert _verdict(runs, journal, ops, effects).row("runs lost").value == 1


def test_a_worker_that_died_of_an_unexpected_error_or_a_crash_is_counted() -> None:
    procs = [checks.ProcRecord("worker", 1, 0.0, 5.0, exit_code=70),
             checks.ProcRecord("worker", 2, 0.0, 5.0, exit_code=-11),
             checks.ProcRecord("worker", 3, 0.0, 5.0, exit_code=-9),  # the harness's SIGKILL
             checks.ProcRecord("worker", 4, 0.0, 5.0, exit_code=0),
             checks.ProcRecord("reconciler", 5, 0.0, 5.0, exit_code=70)]
    verdict = _verdict(*_clean_story(), procs=procs)
    row = verdict.row("workers killed by a run")
    assert row.value == 2 and not verdict.ok
    assert any("pid 1" in d for d in row.details) and any("pid 2" in d for d in row.details)


def test_a_poison_run_must_fail_alone_with_run_unreadable() -> None:
    runs, journal, ops, effects = _clean_story()
    poison = uuid.uuid4()
    data = checks.Data([*runs, _run(id=poison, status="queued", revision=0)], journal, ops, [],
                       [], effects, _at(100).timestamp())
    observed = checks.Observed({"k": RUN}, [], [], {poison})
    verdict = checks.verdict(data, observed, set())
    assert verdict.row("poison runs not failed alone").value == 1
    failed = _run(id=poison, status="failed", outcome_code="RUN_UNREADABLE", revision=1)
    journal_failed = [*journal, {"run_id": poison, "seq": 1, "kind": "run.failed",
                                 "position": None, "name": None, "payload": {},
                                 "lease_token": 1, "created_at": _at(5)}]
    data = checks.Data([*runs, failed], journal_failed, ops, [], [], effects,
                       _at(100).timestamp())
    verdict = checks.verdict(data, observed, set())
    assert verdict.ok, checks.format_table(verdict)  # not counted as a failure without reason


def test_a_call_started_after_another_worker_wrote_the_run_counts_as_late() -> None:
    journal = _journal(("call.submitted", {"op": 1}), ("call.unknown", {"op": 1}),
                       tokens=[1, 2])  # the second holder wrote at 1 s
    ops = [_op(1, "not_applied", "k1", lease_token=1)]
    on_time = checks.Data([_run()], journal, ops, [], [_call("k1", 1, started=0.5)], [],
                          _at(100).timestamp())
    late = checks.Data([_run()], journal, ops, [], [_call("k1", 1, started=1.5)], [],
                       _at(100).timestamp())
    assert checks.late_dispatches(on_time) == 0
    assert checks.late_dispatches(late) == 1


def test_a_run_failed_without_a_workflow_reason_is_reported_with_its_traceback() -> None:
    """The report names the run and shows the end of its incident's traceback (where the
    exception that failed it was raised), so a failure in CI can be read from its log."""
    trace = "Traceback (most recent call last):\n" + "".join(
        f'  File "f{i}.py", line {i}, in g\n' for i in range(40)) + "psycopg.InternalError: x"
    failed = _run(status="failed", outcome_code="WORKFLOW_FAILED",
                  error={"message": "the workflow raised an exception"}, traceback=trace)
    row = checks.failed_runs(checks.Data([failed], [], [], [], [], [], 0.0), set())
    assert row.value == 1 and len(row.details) == 1
    lines = row.details[0].splitlines()
    assert "WORKFLOW_FAILED the workflow raised an exception" in lines[0]
    assert lines[-1].strip() == "psycopg.InternalError: x"
    assert len(lines) == 1 + checks.TRACEBACK_LINES  # the last lines only


def test_runs_cancelled_with_a_run_the_harness_cancelled_are_expected() -> None:
    """A cancellation reaches the unfinished children at every depth, also those of a later
    run of the chain the harness cancelled by its first id; another cancelled run is not."""
    first, later, child, grandchild, stray = (uuid.uuid4() for _ in range(5))
    cancelled = {"status": "cancelled", "outcome_code": "CANCELLED"}
    runs = [_run(id=first, status="succeeded", outcome_code="CONTINUED_AS_NEW"),
            _run(id=later, continued_from=first, **cancelled),
            _run(id=child, parent_run_id=later, **cancelled),
            _run(id=grandchild, parent_run_id=child, **cancelled),
            _run(id=stray, **cancelled)]
    row = checks.failed_runs(checks.Data(runs, [], [], [], [], [], 0.0), {first})
    assert row.value == 1 and str(stray) in row.details[0]
