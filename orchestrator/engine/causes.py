"""What a failed run's error names (CONTRACT C10, C13): the public ``cause`` of an orchestrator
error that workflow code did not catch, the message built from it, and, for a failed tool
call, the story the run's incident keeps. Pure: no I/O.

The public cause holds only controlled values: codes, registered tool names, event names the
workflow chose, and cause and reason words the engine produces (a cause word a tool chose
itself is ``tool_defined``). Everything else, the tool's own words included, goes to the run's
incident, which names the tool's incidents, the lookups' and the call's timeline.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from orchestrator.errors import EventTimeout, OrchestratorError, RunFailed, ToolFailed
from orchestrator.failures import STOP_REASONS, public_cause, unknown_cause
from orchestrator.journal import Entry, EventKind
from orchestrator.recovery import hint_refusal

_BEGUN = (EventKind.CALL_PENDING, EventKind.CALL_SUBMITTED)
_ENDED = (EventKind.CALL_FAILED, EventKind.CALL_DENIED)
_HIDDEN = ("intent", "result")  # a timeline keeps what happened, not the digests and receipts


def cause_of(exc: OrchestratorError) -> dict[str, Any]:
    """The public cause of ``exc`` from the exception alone (a tool call's story adds to it:
    :func:`tool_story`)."""
    if isinstance(exc, ToolFailed):
        if exc.position is None:  # made by workflow code, not by the engine: nothing to vouch for
            return {"code": exc.code}
        cause: dict[str, Any] = {
            "code": exc.code, "tool": exc.tool, "cause": public_cause(exc.cause),
            "reason": exc.reason if exc.reason in STOP_REASONS else None,
            "attempts": None, "stage": None, "reconciled": None}
        if exc.retry_after is not None:  # only then: the hint that stopped it (reason budget)
            cause["retry_after"] = exc.retry_after
        return cause
    if isinstance(exc, EventTimeout):
        return {"code": exc.code, "event": exc.event}
    if isinstance(exc, RunFailed):
        return {"code": exc.code, "run_id": exc.run_id, "cause": exc.cause}
    return {"code": exc.code}


def headline(cause: Mapping[str, Any]) -> str:
    """The run's message for a cause: ``the workflow stopped on TOOL_FAILED: tool charge,
    cause timeout``; a call that a Retry-After hint stopped adds what the call's own error
    says of it (:func:`~orchestrator.recovery.hint_refusal`)."""
    code = cause["code"]
    text = f"the workflow stopped on {code}"
    if cause.get("tool") is not None:
        text += f": tool {cause['tool']}"
        if cause.get("cause") is not None:
            text += f", cause {cause['cause']}"
        if cause.get("stage") is not None:
            text += f" ({cause['stage']})"
    elif "event" in cause:
        text += f": event {cause['event']!r}"
    elif cause.get("run_id") is not None:
        text += f": child run {cause['run_id']}"
    if isinstance(cause.get("retry_after"), Mapping):
        text += f"; {hint_refusal(cause['retry_after'])}"
    return text


def tool_story(exc: ToolFailed, entries: Iterable[Entry],
               incidents: Iterable[Mapping[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The public cause of a failed call and the story its run's incident keeps, from the
    journal ``entries`` at the call's position (oldest first) and the ``incidents`` of its
    operations (their summary: ``ref``, ``code``, ``operation_id``, ``phase``, ``cause``,
    ``upstream_status``).

    The cause is that of the last attempt. One whose outcome was unknown and that
    reconciliation then proved not applied is named by why it was unknown (``timeout`` for a
    dispatch that timed out), and ``reconciled`` says by whom (``lookup`` or ``operator``)."""
    entries, incidents = list(entries), list(incidents)
    cause = cause_of(exc)
    begun = [e for e in entries if e["kind"] in _BEGUN]
    last_op = begun[-1]["payload"]["op"] if begun else None
    mine = [e for e in entries if e["payload"].get("op") == last_op]
    ended = next((e for e in reversed(mine) if e["kind"] in _ENDED), None)
    if begun:
        cause["attempts"] = max(e["payload"]["attempt"] for e in begun)
    if ended is not None and ended["kind"] == EventKind.CALL_DENIED:
        cause["stage"] = ended["payload"].get("stage")
    if ended is not None and ended["payload"].get("cause") == "not_applied":
        cause |= _reconciled(mine, incidents)
    story = {
        "cause": cause,
        "tool": exc.tool,
        "position": exc.position,
        "operation": last_op,
        "operations": sorted({e["payload"]["op"] for e in begun}),
        "incidents": [{key: i.get(key) for key in
                       ("ref", "code", "operation_id", "phase", "cause", "upstream_status")}
                      for i in incidents],
        "timeline": [_line(e) for e in entries],
    }
    return cause, story


def _reconciled(mine: list[Entry], incidents: list[Mapping[str, Any]]) -> dict[str, Any]:
    """The root cause of an attempt that was unknown and then proven not applied."""
    unknown = next((e for e in mine if e["kind"] == EventKind.CALL_UNKNOWN), None)
    if unknown is None:
        return {}
    ref = unknown["payload"].get("incident")
    kept = next((i for i in incidents if ref is not None and i["ref"] == ref), None)
    found: dict[str, Any] = {"cause": unknown_cause(
        unknown["payload"]["reason"], None if kept is None else kept.get("phase"),
        None if kept is None else kept.get("upstream_status"),
        None if kept is None else kept.get("cause"))}
    proof = next((e for e in mine if e["kind"] == EventKind.CALL_NOT_APPLIED), None)
    if proof is not None:
        found["reconciled"] = ("lookup" if proof["payload"].get("resolved_by") == "reconciler"
                               else "operator")
    return found


def _line(e: Entry) -> dict[str, Any]:
    at = e.get("created_at")
    return {"seq": e.get("seq"), "at": at.isoformat() if isinstance(at, datetime) else at,
            "kind": e["kind"], "payload": {k: v for k, v in e["payload"].items()
                                           if k not in _HIDDEN}}
