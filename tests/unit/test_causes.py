"""What a failed run's public error names (orchestrator.engine.causes, failures.public_cause):
controlled words only, the last attempt's cause, the root of a reconciled one."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator import EventTimeout, InvalidRequest, RunFailed, ToolError, ToolFailed
from orchestrator.engine.causes import cause_of, headline, tool_story
from orchestrator.failures import TOOL_DEFINED, incident_cause, public_cause, unknown_cause


def _e(seq: int, kind: str, **payload: Any) -> dict[str, Any]:
    return {"seq": seq, "kind": kind, "position": 2, "name": "charge", "payload": payload}


def _failed(cause: str, reason: str = "cause", **kw: Any) -> ToolFailed:
    return ToolFailed("tool charge failed", tool="charge", cause=cause, reason=reason,
                      position=2, **kw)


@pytest.mark.parametrize(("word", "public"), [
    ("authentication", "authentication"), ("connection_before_send", "connection_before_send"),
    ("denied", "denied"), ("busy_before_send", TOOL_DEFINED), ("sk_live_SECRET", TOOL_DEFINED),
    (None, None)])
def test_only_the_engines_cause_words_are_public(word, public):  # type: ignore[no-untyped-def]
    assert public_cause(word) == public


@pytest.mark.parametrize(("reason", "phase", "status", "word"), [
    ("TOOL_OUTCOME_UNCERTAIN", "dispatch", None, "timeout"),
    ("TOOL_OUTCOME_UNCERTAIN", "tool", 503, "upstream_error"),
    ("TOOL_OUTCOME_UNCERTAIN", "tool", 429, "rate_limited"),
    ("TOOL_OUTCOME_UNCERTAIN", "tool", None, "outcome_unknown"),
    ("TOOL_OUTCOME_UNCERTAIN", None, None, "outcome_unknown"),
    ("INVALID_RECEIPT", "receipt", None, "invalid_receipt"),
    ("WORKER_LOST", None, None, "worker_lost"),
    ("SOMETHING_NEW", None, None, "outcome_unknown")])
def test_why_an_outcome_was_unknown_in_one_word(reason, phase, status, word):  # type: ignore[no-untyped-def]
    assert unknown_cause(reason, phase, status) == word


@pytest.mark.parametrize(("tool_cause", "word"), [
    ("timeout_after_send", "timeout_after_send"),
    ("connection_after_send", "connection_after_send"),
    (TOOL_DEFINED, TOOL_DEFINED), ("ConnectionResetError", "outcome_unknown"),
    ("sk_live_SECRET", "outcome_unknown"), (None, "outcome_unknown")])
def test_an_unknown_outcome_is_named_by_the_cause_its_tool_gave(tool_cause, word):  # type: ignore[no-untyped-def]
    assert unknown_cause("TOOL_OUTCOME_UNCERTAIN", "tool", None, tool_cause) == word
    assert unknown_cause("TOOL_OUTCOME_UNCERTAIN", "dispatch", None, tool_cause) == "timeout"


@pytest.mark.parametrize(("exc", "kept"), [
    (ToolError.after_send("timeout"), ("timeout_after_send", None)),
    (ToolError("lost"), ("outcome_unknown", None)),
    (ToolError.from_status(503), ("upstream_error", None)),
    (ToolError("lost", cause="psp_gateway_timeout"), (TOOL_DEFINED, "psp_gateway_timeout")),
    (ConnectionResetError("reset"), ("ConnectionResetError", None))])
def test_a_tools_incident_keeps_its_cause_word(exc, kept):  # type: ignore[no-untyped-def]
    assert incident_cause(exc) == kept


def test_a_retried_call_is_named_by_its_last_attempt() -> None:
    entries = [
        _e(1, "call.submitted", attempt=1, op=10, intent="d", key="k1"),
        _e(2, "call.retrying", op=10, attempt=1, cause="rate_limited", incident="inc_a"),
        _e(3, "call.submitted", attempt=2, op=11, intent="d", key="k2"),
        _e(4, "call.failed", op=11, attempt=2, cause="authentication", reason="cause",
           incident="inc_b")]
    incidents = [{"ref": "inc_a", "code": "TOOL_ERROR", "operation_id": 10, "phase": "tool",
                  "cause": "ToolError", "upstream_status": 429},
                 {"ref": "inc_b", "code": "TOOL_ERROR", "operation_id": 11, "phase": "tool",
                  "cause": "ToolError", "upstream_status": 401}]
    cause, story = tool_story(_failed("authentication"), entries, incidents)
    assert cause == {"code": "TOOL_FAILED", "tool": "charge", "cause": "authentication",
                     "reason": "cause", "attempts": 2, "stage": None, "reconciled": None}
    assert (story["operation"], story["operations"], story["position"]) == (11, [10, 11], 2)
    assert [i["ref"] for i in story["incidents"]] == ["inc_a", "inc_b"]
    assert all("intent" not in line["payload"] for line in story["timeline"])


def test_a_reconciled_attempt_is_named_by_why_it_was_unknown() -> None:
    entries = [
        _e(1, "call.submitted", attempt=1, op=10, intent="d", key="k1"),
        _e(2, "call.unknown", op=10, reason="TOOL_OUTCOME_UNCERTAIN", next="reconcile",
           incident="inc_a"),
        _e(3, "call.not_applied", op=10, resolved_by="alice"),
        _e(4, "call.failed", op=10, attempt=1, cause="not_applied", reason="budget",
           incident=None)]
    incidents = [{"ref": "inc_a", "code": "TOOL_ERROR", "operation_id": 10, "phase": "dispatch",
                  "cause": "TimeoutError", "upstream_status": None}]
    cause, _ = tool_story(_failed("not_applied", "budget"), entries, incidents)
    assert (cause["cause"], cause["reason"], cause["reconciled"]) == (
        "timeout", "budget", "operator")
    assert headline(cause) == "the workflow stopped on TOOL_FAILED: tool charge, cause timeout"


def test_a_denied_call_names_its_stage() -> None:
    entries = [_e(1, "call.pending", attempt=1, op=10, intent="d", key="k1"),
               _e(2, "call.denied", op=10, stage="approve", cause="denied", incident=None)]
    cause, _ = tool_story(_failed("denied", code="TOOL_DENIED"), entries, [])
    assert (cause["code"], cause["stage"]) == ("TOOL_DENIED", "approve")
    assert headline(cause) == ("the workflow stopped on TOOL_DENIED: tool charge, cause denied "
                               "(approve)")


def test_errors_the_engine_did_not_raise_vouch_for_nothing_but_their_code() -> None:
    made = ToolFailed("mine", tool="sk_live_SECRET", cause="sk_live_SECRET")  # no position
    assert cause_of(made) == {"code": "TOOL_FAILED"}
    odd = _failed("conflict", reason="because I said so")
    assert cause_of(odd)["reason"] is None
    assert cause_of(InvalidRequest("bad")) == {"code": "INVALID_REQUEST"}
    assert headline(cause_of(InvalidRequest("bad"))) == "the workflow stopped on INVALID_REQUEST"
    waited = EventTimeout("late", event="approval")
    assert cause_of(waited) == {"code": "EVENT_TIMEOUT", "event": "approval"}
    assert isinstance(waited, TimeoutError)
    child = RunFailed("x", code="CANCELLED", run_id="r1")
    assert cause_of(child) == {"code": "CANCELLED", "run_id": "r1", "cause": None}
