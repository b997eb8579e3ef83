"""Replay matching (orchestrator.matching) without a database: every command against crafted
journals, recorded or not, settled or not, and every way a command can differ."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

import pytest

from orchestrator.errors import EventTimeout, RunFailed, ToolFailed
from orchestrator.journal import Entry, EventKind, JournalIndex, Nondeterminism, entry
from orchestrator.matching import (
    NEW,
    Mismatch,
    Outcome,
    Verdict,
    child_ended,
    code_ended,
    describe,
    match_call,
    match_child,
    match_event,
    match_publish,
    match_sleep,
    match_value,
    tool_failed,
)

K = EventKind
INTENT = "d" * 64
CHILD = uuid.UUID("6f1c1a52-0000-4000-8000-000000000001")
WHEN = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)


def journal(*entries: Entry) -> JournalIndex:
    """A journal as read back: numbered, at the current schema version."""
    return JournalIndex([{**e, "seq": seq, "schema_version": 1}
                         for seq, e in enumerate(entries, 1)])


def begun(position: int = 0, tool: str = "charge", kind: EventKind = K.CALL_SUBMITTED,
          intent: str = INTENT, attempt: int = 1) -> Entry:
    return entry(kind, position, tool, {"tool_version": "1", "intent": intent,
                                        "attempt": attempt, "op": attempt, "key": "k",
                                        "effect": "consequential"})


def differs(verdict: Verdict, how: Mismatch) -> Nondeterminism:
    assert verdict.outcome is Outcome.DIFFERS and verdict.value is how
    assert isinstance(verdict.error, Nondeterminism)
    assert verdict.error.code == "NONDETERMINISM"
    with pytest.raises(Nondeterminism):
        verdict.settle()
    return verdict.error


# -- beyond the end of the journal --------------------------------------------------------------

@pytest.mark.parametrize("match", [
    lambda ix, p: match_call(ix, p, "charge", INTENT),
    lambda ix, p: match_value(ix, p, "now"),
    lambda ix, p: match_publish(ix, p, "t", 1),
    lambda ix, p: match_sleep(ix, p),
    lambda ix, p: match_event(ix, p, "go"),
    lambda ix, p: match_child(ix, p, "child"),
])
def test_a_position_with_nothing_recorded_is_new(match: Any) -> None:
    index = journal(begun(0), entry(K.CALL_COMPLETED, 0, "charge", {"result": 1, "op": 1}),
                    entry(K.PATCH, 1, "p", {}))
    for position in (1, 2, 99):  # a lone patch marker, and beyond the end of the journal
        assert match(index, position) is NEW
    assert match(journal(), 0) is NEW
    assert NEW.outcome is Outcome.NEW and NEW.settle() is None


# -- calls ----------------------------------------------------------------------------------------

def test_a_call_with_its_receipt_returns_it() -> None:
    index = journal(begun(), entry(K.CALL_COMPLETED, 0, "charge", {"result": {"id": 7}, "op": 1}))
    verdict = match_call(index, 0, "charge", INTENT)
    assert verdict.outcome is Outcome.RETURNS and verdict.settle() == {"id": 7}
    assert verdict.recorded is index.by_position[0]  # the journal's own list, not a copy


@pytest.mark.parametrize("kind", [K.CALL_FAILED, K.CALL_DENIED])
def test_a_call_that_failed_or_was_denied_raises_tool_failed(kind: EventKind) -> None:
    payload = ({"op": 1, "attempt": 1, "cause": "conflict", "reason": "budget",
                "incident": "inc_1"} if kind == K.CALL_FAILED else
               {"op": 1, "stage": "authorize", "cause": "denied", "incident": "inc_1"})
    verdict = match_call(journal(begun(), entry(kind, 0, "charge", payload)), 0, "charge",
                         INTENT)
    assert verdict.outcome is Outcome.RAISES
    error = verdict.error
    assert isinstance(error, ToolFailed)
    expected = (("TOOL_FAILED", "tool charge failed", "budget") if kind == K.CALL_FAILED else
                ("TOOL_DENIED", "tool charge was not allowed (authorize)", "cause"))
    assert (error.code, error.message, error.reason) == expected
    assert (error.tool, error.cause, error.incident) == ("charge", payload["cause"], "inc_1")
    with pytest.raises(ToolFailed):
        verdict.settle()


def test_a_withdrawn_call_waits_for_its_cancellation() -> None:
    index = journal(begun(), entry(K.CALL_FAILED, 0, "charge", {
        "op": 1, "attempt": 1, "cause": "cancelled", "reason": "withdrawn", "incident": None}))
    verdict = match_call(index, 0, "charge", INTENT)
    assert verdict.outcome is Outcome.WITHDRAWN and verdict.error is None


@pytest.mark.parametrize("last", [
    None,  # submitted, no outcome: its worker died
    entry(K.CALL_UNKNOWN, 0, "charge", {"op": 1, "reason": "WORKER_LOST", "next": "reconcile"}),
    entry(K.CALL_RETRYING, 0, "charge", {"op": 1, "attempt": 1, "cause": "timeout",
                                         "incident": None, "delay_ms": 5,
                                         "not_before": WHEN.isoformat(), "key": None}),
    entry(K.CALL_NOT_APPLIED, 0, "charge", {"op": 1, "resolved_by": "lookup"}),
    entry(K.CALL_CANCELLED, 0, "charge", {"op": 1}),
    entry(K.CALL_ABANDONED, 0, "charge", {"op": 1, "resolved_by": "ops"}),
])
def test_a_call_without_an_outcome_waits_and_hands_back_its_entries(last: Entry | None) -> None:
    entries = [begun()] + ([last] if last else [])
    verdict = match_call(journal(*entries), 0, "charge", INTENT)
    assert verdict.outcome is Outcome.WAITS and verdict.error is None
    assert [e["kind"] for e in verdict.recorded] == [e["kind"] for e in entries]


def test_a_pending_call_and_a_later_attempt_are_judged_by_the_last_entry() -> None:
    assert match_call(journal(begun(kind=K.CALL_PENDING)), 0, "charge",
                      INTENT).outcome is Outcome.WAITS
    retried = journal(
        begun(),
        entry(K.CALL_RETRYING, 0, "charge", {"op": 1, "attempt": 1, "cause": "timeout",
                                             "incident": None, "delay_ms": 0,
                                             "not_before": WHEN.isoformat(), "key": None}),
        begun(attempt=2),
        entry(K.CALL_COMPLETED, 0, "charge", {"result": "second", "op": 2}))
    assert match_call(retried, 0, "charge", INTENT).settle() == "second"


def test_a_call_with_other_arguments_differs_by_its_intent() -> None:
    index = journal(begun(), entry(K.CALL_COMPLETED, 0, "charge", {"result": 1, "op": 1}))
    error = differs(match_call(index, 0, "charge", "e" * 64), Mismatch.INTENT)
    assert str(error) == error.report == (
        "position 0: tool 'charge' was recorded with other arguments (intent digest differs)")
    assert (error.position, error.recorded, error.issued) == (0, "call 'charge'",
                                                            "call 'charge'")


def test_a_call_where_another_tool_or_another_command_was_recorded_differs() -> None:
    index = journal(begun(3, tool="a"), entry(K.TIMER, 4, "sleep", {"until": WHEN.isoformat()}))
    error = differs(match_call(index, 3, "b", INTENT), Mismatch.COMMAND)
    assert (error.position, error.recorded, error.issued) == (3, "call 'a'", "call 'b'")
    # the worker's message and the offline check's report: one sentence, in the words of
    # describe() (not the entry's kind, call.submitted)
    assert str(error) == error.report == (
        "position 3: the journal recorded call 'a', the code issued call 'b'")
    error = differs(match_call(index, 4, "a", INTENT), Mismatch.COMMAND)
    assert (error.recorded, error.issued) == ("sleep", "call 'a'")
    assert error.report == "position 4: the journal recorded sleep, the code issued call 'a'"


def test_code_that_ends_before_its_journal_does_differs_at_the_first_command_left() -> None:
    index = journal(begun(0, tool="a"), entry(K.PATCH, 1, "p", {}),
                    entry(K.TIMER, 2, "sleep", {"until": WHEN.isoformat()}))
    error = code_ended(index, 1)
    assert error is not None and str(error) == error.report == (
        "position 2: the journal recorded sleep, the code ended")
    assert (error.position, error.recorded, error.issued) == (2, "sleep",
                                                            "the end of the workflow")
    assert str(code_ended(index, 0, "continued as new")) == (
        "position 0: the journal recorded call 'a', the code continued as new")
    assert code_ended(index, 3) is None
    assert code_ended(journal(begun(0), entry(K.PATCH, 1, "p", {})), 1) is None  # markers only


def test_the_kind_and_name_are_checked_before_the_intent() -> None:
    index = journal(begun(tool="a"))
    differs(match_call(index, 0, "b", "e" * 64), Mismatch.COMMAND)


def test_patch_markers_are_looked_past() -> None:
    index = journal(entry(K.PATCH, 0, "new-charge", {}), begun(),
                    entry(K.CALL_COMPLETED, 0, "charge", {"result": 1, "op": 1}))
    verdict = match_call(index, 0, "charge", INTENT)
    assert verdict.settle() == 1
    assert [e["kind"] for e in verdict.recorded] == ["call.submitted", "call.completed"]
    assert differs(match_value(index, 0, "now"), Mismatch.COMMAND).recorded == "call 'charge'"


# -- values and messages -----------------------------------------------------------------------

def test_recorded_values_are_decoded_as_the_context_returns_them() -> None:
    some = uuid.uuid4()
    index = journal(entry(K.VALUE, 0, "now", {"value": WHEN.isoformat()}),
                    entry(K.VALUE, 1, "uuid", {"value": str(some)}),
                    entry(K.VALUE, 2, "random", {"value": 0.25}))
    assert match_value(index, 0, "now").settle() == WHEN
    assert match_value(index, 1, "uuid").settle() == some
    assert match_value(index, 2, "random").settle() == 0.25
    for position, name in ((0, "uuid"), (1, "now")):
        error = differs(match_value(index, position, name), Mismatch.COMMAND)
        assert error.issued == f"value {name!r}"
        assert error.recorded == f"value {'now' if name == 'uuid' else 'uuid'!r}"


def test_a_recorded_message_is_checked_by_its_canonical_value() -> None:
    index = journal(entry(K.MESSAGE, 0, "progress", {"value": {"b": 1, "a": [1.0, "x"]}}))
    same = match_publish(index, 0, "progress", {"a": [1.0, "x"], "b": 1})
    assert same.outcome is Outcome.RETURNS and same.settle() is None
    given = match_publish(index, 0, "progress", None, '{"a":[1.0,"x"],"b":1}')
    assert given.outcome is Outcome.RETURNS  # the caller's canonical text is used as it is
    error = differs(match_publish(index, 0, "progress", {"a": [1, "x"], "b": 1}),
                    Mismatch.MESSAGE)  # 1 is not 1.0: the type is kept
    assert str(error) == error.report == ("position 0: the code published another value on "
                                          "topic 'progress' than the journal recorded")
    assert (error.recorded, error.issued) == ("publish 'progress'", "publish 'progress'")
    error = differs(match_publish(index, 0, "other", 1), Mismatch.COMMAND)
    assert (error.recorded, error.issued) == ("publish 'progress'", "publish 'other'")


# -- timers, events and children ---------------------------------------------------------------

def test_a_recorded_timer_waits_until_its_recorded_end() -> None:
    index = journal(entry(K.TIMER, 0, "sleep", {"until": WHEN.isoformat()}),
                    entry(K.EVENT_WAIT, 1, "go", {"timeout_at": None}))
    verdict = match_sleep(index, 0)
    assert verdict.outcome is Outcome.WAITS and verdict.settle() == WHEN
    error = differs(match_sleep(index, 1), Mismatch.COMMAND)
    assert (error.recorded, error.issued) == ("event 'go'", "sleep")


def test_an_event_received_timed_out_or_still_awaited() -> None:
    wait = entry(K.EVENT_WAIT, 0, "go", {"timeout_at": WHEN.isoformat()})
    received = journal(wait, entry(K.EVENT_RECEIVED, 0, "go", {"payload": {"ok": True},
                                                                "event_id": 4}))
    assert match_event(received, 0, "go").outcome is Outcome.RETURNS
    assert match_event(received, 0, "go").settle() == {"ok": True}

    timed_out = match_event(journal(wait, entry(K.EVENT_TIMEOUT, 0, "go", {})), 0, "go")
    assert timed_out.outcome is Outcome.RAISES
    assert isinstance(timed_out.error, EventTimeout)
    assert (timed_out.error.code, timed_out.error.message, timed_out.error.event,
            timed_out.error.timeout_at) == ("EVENT_TIMEOUT", "event 'go' did not arrive in time",
                                            "go", WHEN)

    waiting = match_event(journal(wait), 0, "go")
    assert waiting.outcome is Outcome.WAITS and waiting.settle() == WHEN
    forever = match_event(journal(entry(K.EVENT_WAIT, 0, "go", {"timeout_at": None})), 0, "go")
    assert forever.outcome is Outcome.WAITS and forever.settle() is None
    error = differs(match_event(received, 0, "stop"), Mismatch.COMMAND)
    assert (error.recorded, error.issued) == ("event 'go'", "event 'stop'")


def test_a_child_completed_failed_or_still_running() -> None:
    started = entry(K.CHILD_STARTED, 0, "child", {"run_id": str(CHILD), "version": "1"})
    done = journal(started, entry(K.CHILD_COMPLETED, 0, "child", {"result": [1, 2]}))
    assert match_child(done, 0, "child").settle() == [1, 2]

    cause = {"code": "TOOL_FAILED", "tool": "charge"}
    failed = match_child(journal(started, entry(K.CHILD_FAILED, 0, "child", {
        "code": "WORKFLOW_FAILED", "message": "the child failed", "cause": cause})), 0, "child")
    assert failed.outcome is Outcome.RAISES and isinstance(failed.error, RunFailed)
    assert (failed.error.code, failed.error.message, failed.error.run_id, failed.error.cause) == (
        "WORKFLOW_FAILED", "the child failed", str(CHILD), cause)
    plain = match_child(journal(started, entry(K.CHILD_FAILED, 0, "child", {
        "code": "CANCELLED", "message": "cancelled"})), 0, "child")
    assert isinstance(plain.error, RunFailed) and plain.error.cause is None

    running = match_child(journal(started), 0, "child")
    assert running.outcome is Outcome.WAITS and running.settle() == CHILD
    error = differs(match_child(done, 0, "other"), Mismatch.COMMAND)
    assert (error.recorded, error.issued) == ("child 'child'", "child 'other'")


def test_an_error_without_diagnostics_names_a_reference_its_journal_fixes() -> None:
    """An error raised into workflow code names one incident reference on every replay, and
    in a restart that carries its entries: the one its entry records, else one derived from
    what the journal records (the operation, the child, the wait), never a fresh one."""
    def incident(verdict: Verdict) -> str:
        assert verdict.outcome is Outcome.RAISES and verdict.error is not None
        return verdict.error.incident  # type: ignore[attr-defined]

    failed = entry(K.CALL_FAILED, 0, "charge", {"op": 1, "attempt": 1, "cause": "conflict",
                                                "reason": "cause", "incident": None})
    denied = entry(K.CALL_DENIED, 0, "charge", {"op": 1, "stage": "authorize",
                                                "cause": "denied", "incident": None})
    other_op = {**begun(), "payload": {**begun()["payload"], "op": 2}}
    for ended in (failed, denied):
        ref = incident(match_call(journal(begun(), ended), 0, "charge", INTENT))
        assert ref.startswith("inc_") and len(ref) == len("inc_") + 16
        assert ref == incident(match_call(journal(begun(), ended), 0, "charge", INTENT))
        assert ref == tool_failed("charge", ended["kind"], ended["payload"]).incident
        moved = {**ended, "payload": {**ended["payload"], "op": 2}}
        assert ref != incident(match_call(journal(other_op, moved), 0, "charge", INTENT))

    wait = entry(K.EVENT_WAIT, 0, "go", {"timeout_at": WHEN.isoformat()})
    kept = entry(K.EVENT_TIMEOUT, 0, "go", {"incident": "inc_kept"})
    assert incident(match_event(journal(wait, kept), 0, "go")) == "inc_kept"
    older = journal(wait, entry(K.EVENT_TIMEOUT, 0, "go", {}))  # written before one was kept
    assert incident(match_event(older, 0, "go")) == incident(match_event(older, 0, "go"))

    started = entry(K.CHILD_STARTED, 0, "child", {"run_id": str(CHILD), "version": "1"})
    cancelled = entry(K.CHILD_FAILED, 0, "child", {"code": "CANCELLED", "message": "c"})
    ref = incident(match_child(journal(started, cancelled), 0, "child"))
    assert ref == incident(child_ended(CHILD, cancelled))
    assert ref != incident(child_ended(uuid.uuid4(), cancelled))
    named = {**cancelled, "payload": {**cancelled["payload"], "incident": "inc_child"}}
    assert incident(match_child(journal(started, named), 0, "child")) == "inc_child"


def test_a_child_that_ended_just_now_is_decoded_as_a_recorded_one() -> None:
    ended = entry(K.CHILD_COMPLETED, 0, "child", {"result": "r"})
    assert child_ended(CHILD, ended).settle() == "r"


# -- words -------------------------------------------------------------------------------------

def test_recorded_commands_in_words() -> None:
    assert describe(begun(tool="charge")) == "call 'charge'"
    assert describe(begun(tool="charge", kind=K.CALL_PENDING)) == "call 'charge'"
    assert describe(entry(K.TIMER, 0, "sleep", {"until": ""})) == "sleep"
    assert describe(entry(K.VALUE, 0, "now", {"value": ""})) == "value 'now'"
    assert describe(entry(K.CALL_COMPLETED, 0, "x", {"result": 1, "op": 1})) == (
        "call.completed 'x'")  # not a command's first entry: named by its kind
