"""Replay matching: what a run's journal says for the command workflow code issues at a
position (CONTRACT C3, C4). Pure: no I/O, no clock, no event loop.

Two readers replay a journal: a worker (:mod:`orchestrator.engine`), which then goes on live,
and the offline check (:mod:`orchestrator.replay`, ``orchestrator replay``), which dispatches,
writes and waits for nothing. Both ask this module, so they cannot disagree about a history:
the same journal, command and position give the same :class:`Verdict`. What each does with it
is its own (the engine dispatches a :attr:`Outcome.NEW` call, the check stops that branch of
the code where its history ends).

One function per command, each given the run's :class:`~orchestrator.journal.JournalIndex`,
the position and what identifies the command there (its name, a call's intent digest, a
message's canonical text)::

    match_call     NEW | DIFFERS | RETURNS receipt | RAISES ToolFailed | WITHDRAWN | WAITS
    match_value    NEW | DIFFERS | RETURNS value (decoded: datetime, UUID or float)
    match_publish  NEW | DIFFERS | RETURNS None
    match_sleep    NEW | DIFFERS | WAITS until (a datetime)
    match_event    NEW | DIFFERS | RETURNS payload | RAISES EventTimeout | WAITS timeout_at
    match_child    NEW | DIFFERS | RETURNS result | RAISES RunFailed | WAITS child's run id

Invariants:

- Patch markers (``patch`` entries) are not commands: a command is matched against the first
  other entry at its position.
- Nothing recorded at the position is :data:`NEW`, the one shared verdict (``verdict is
  NEW``): the live path of a run (every step of a run that is not replaying) allocates nothing
  here. A recorded command costs one :class:`Verdict` (a named tuple: cheap to make).
- Another kind of command or another name is :attr:`Outcome.DIFFERS` (:attr:`Mismatch.COMMAND`),
  checked before anything else; a call recorded with another intent digest, or a message with
  another value, is :attr:`Outcome.DIFFERS` too. Its error is a
  :class:`~orchestrator.journal.Nondeterminism` (code ``NONDETERMINISM``), which a worker
  raises (its text is the failed run's message) and the check reports, in the same words:
  the position, what the journal recorded there and what the code issued. Code that ends (or
  continues as new) before the commands its journal holds is :func:`code_ended`'s, for both.
- A call's verdict follows the last entry recorded at its position (a worker resumes the call
  from there): a receipt returns, a failure or a denial raises :class:`ToolFailed`, a
  withdrawal waits for the same cancellation, anything else waits (the engine resumes the
  call's attempts from :attr:`Verdict.recorded`).
- The journal is read, never changed, and copied only where a patch marker comes first at a
  position (the entries after it); payloads are decoded (timestamps, ids) but not
  re-canonicalised, except a recorded message's value, compared as canonical JSON.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from enum import Enum
from typing import Any, NamedTuple

from orchestrator.canonical import canonical_json
from orchestrator.errors import EventTimeout, RunFailed, ToolFailed, recorded_incident_ref
from orchestrator.journal import Entry, EventKind, JournalIndex, Nondeterminism
from orchestrator.recovery import hint_refusal

K = EventKind

FIRST_KIND: Mapping[str, tuple[str, ...]] = {
    "call": (K.CALL_SUBMITTED.value, K.CALL_PENDING.value),
    "sleep": (K.TIMER.value,),
    "event": (K.EVENT_WAIT.value,),
    "value": (K.VALUE.value,),
    "publish": (K.MESSAGE.value,),
    "child": (K.CHILD_STARTED.value,),
}
"""Which kinds a command of each kind may find first at its position."""

# The kinds as the plain strings a journal holds, bound once: on Python 3.11 an attribute of
# an enum class and a comparison with a member each cost more than the rest of a match.
_PATCH = K.PATCH.value
_COMPLETED, _FAILED = K.CALL_COMPLETED.value, K.CALL_FAILED.value
_DENIED = K.CALL_DENIED.value
_FAILURES = (_FAILED, _DENIED)
_EVENT_ENDS = (K.EVENT_RECEIVED.value, K.EVENT_TIMEOUT.value)
_TIMED_OUT = K.EVENT_TIMEOUT.value
_CHILD_ENDS = (K.CHILD_COMPLETED.value, K.CHILD_FAILED.value)
_CHILD_COMPLETED = K.CHILD_COMPLETED.value


class Outcome(Enum):
    """What the journal says a command does at its position."""

    NEW = "new"
    """Nothing is recorded there: a command the history does not hold yet (a worker does the
    work and records it; the offline check's history ends there)."""
    RETURNS = "returns"
    """Recorded and settled: the command returns :attr:`Verdict.value`."""
    RAISES = "raises"
    """Recorded and settled: the command raises :attr:`Verdict.error` into workflow code."""
    WAITS = "waits"
    """Recorded, not settled: the command goes on from what was recorded (a timer or an event
    not over, a child not ended, a call with no outcome yet)."""
    WITHDRAWN = "withdrawn"
    """A call that workflow code cancelled before it was sent: it returns nothing, it waits for
    that same cancellation."""
    DIFFERS = "differs"
    """Nondeterminism: the journal recorded something else there; :attr:`Verdict.error` is the
    :class:`~orchestrator.journal.Nondeterminism` to raise."""


class Mismatch(Enum):
    """How a command differs from what the journal recorded at its position."""

    COMMAND = "command"  # another kind of command, or another name
    INTENT = "intent"  # a call with other arguments (intent digest)
    MESSAGE = "message"  # a message published with another value


class Verdict(NamedTuple):
    """What the journal says for one command at one position.

    ``value``: what a settled command returns (:attr:`Outcome.RETURNS`), what a waiting one
    waits with (:attr:`Outcome.WAITS`: a timer's end, an event's timeout or None, a child's
    run id), or the :class:`Mismatch` of a :attr:`Outcome.DIFFERS`. ``error`` is set exactly
    for :attr:`Outcome.RAISES` and :attr:`Outcome.DIFFERS`. ``recorded``: a call's entries at
    its position (patch markers left out when they came first), the journal's own list.
    """

    outcome: Outcome
    value: Any = None
    error: BaseException | None = None
    recorded: Sequence[Entry] = ()

    def settle(self) -> Any:
        """Raise :attr:`error` if there is one, else return :attr:`value`."""
        if self.error is not None:
            raise self.error
        return self.value


NEW = Verdict(Outcome.NEW)
"""The verdict for a position with nothing recorded: the only one whose outcome is
:attr:`Outcome.NEW` (``verdict is NEW`` says it)."""
_PUBLISHED = Verdict(Outcome.RETURNS)
_RETURNS, _RAISES, _WAITS = Outcome.RETURNS, Outcome.RAISES, Outcome.WAITS
_WITHDRAWN, _DIFFERS = Outcome.WITHDRAWN, Outcome.DIFFERS


def describe(event: Entry) -> str:
    """A recorded command in words: ``call 'charge'``, ``sleep``, ``value 'now'``."""
    kind = event["kind"]
    command = next((c for c, kinds in FIRST_KIND.items() if kind in kinds), kind)
    return "sleep" if command == "sleep" else f"{command} {event['name']!r}"


# -- one function per command ------------------------------------------------------------------

def match_call(index: JournalIndex, position: int, tool: str, intent: str) -> Verdict:
    """``ctx.call(tool, …)`` with intent digest ``intent`` at ``position``."""
    events = index.by_position.get(position)
    if not events:  # the live path: one lookup
        return NEW
    found = _commands(events, position, "call", tool)
    if isinstance(found, Verdict):
        return found
    if found[0]["payload"]["intent"] != intent:
        words = f"call {tool!r}"
        message = (f"position {position}: tool {tool!r} was recorded with other arguments "
                   "(intent digest differs)")
        return Verdict(_DIFFERS, Mismatch.INTENT, Nondeterminism(
            message, position=position, recorded=words, issued=words))
    last = found[-1]
    kind, payload = last["kind"], last["payload"]
    if kind == _COMPLETED:
        return Verdict(_RETURNS, payload["result"], recorded=found)
    if kind == _FAILED and payload.get("reason") == "withdrawn":
        return Verdict(_WITHDRAWN, recorded=found)
    if kind in _FAILURES:
        return Verdict(_RAISES, error=tool_failed(tool, kind, payload), recorded=found)
    return Verdict(_WAITS, recorded=found)


def match_value(index: JournalIndex, position: int, name: str) -> Verdict:
    """``ctx.now()`` / ``ctx.uuid()`` / ``ctx.random()`` (``name``) at ``position``."""
    events = index.by_position.get(position)
    if not events:  # the live path: one lookup
        return NEW
    found = _commands(events, position, "value", name)
    if isinstance(found, Verdict):
        return found
    return Verdict(_RETURNS, decode_value(name, found[0]["payload"]["value"]))


def match_publish(index: JournalIndex, position: int, topic: str, value: Any,
                  text: str | None = None) -> Verdict:
    """``ctx.publish(value, topic)`` at ``position``. ``text`` is ``value`` as canonical JSON
    when the caller has it already (else it is made here, only if a message is recorded):
    a recorded message with another value differs (compared as canonical JSON, which keeps
    every value's type through the database)."""
    events = index.by_position.get(position)
    if not events:  # the live path: one lookup
        return NEW
    found = _commands(events, position, "publish", topic)
    if isinstance(found, Verdict):
        return found
    if canonical_json(found[0]["payload"]["value"]) == (
            canonical_json(value) if text is None else text):
        return _PUBLISHED
    words = f"publish {topic!r}"
    return Verdict(_DIFFERS, Mismatch.MESSAGE, Nondeterminism(
        f"position {position}: the code published another value on topic {topic!r} than "
        "the journal recorded", position=position, recorded=words, issued=words))


def match_sleep(index: JournalIndex, position: int) -> Verdict:
    """``ctx.sleep(…)`` at ``position``: a recorded timer waits until its recorded end."""
    events = index.by_position.get(position)
    if not events:  # the live path: one lookup
        return NEW
    found = _commands(events, position, "sleep", "sleep")
    if isinstance(found, Verdict):
        return found
    return Verdict(_WAITS, datetime.fromisoformat(found[0]["payload"]["until"]))


def match_event(index: JournalIndex, position: int, name: str) -> Verdict:
    """``ctx.wait_for_event(name, …)`` at ``position``: the event's payload, its timeout
    (:class:`EventTimeout`), or a wait until its recorded timeout (None: none)."""
    events = index.by_position.get(position)
    if not events:  # the live path: one lookup
        return NEW
    found = _commands(events, position, "event", name)
    if isinstance(found, Verdict):
        return found
    raw = found[0]["payload"]["timeout_at"]
    timeout_at = None if raw is None else datetime.fromisoformat(raw)
    ended = index.last(position, _EVENT_ENDS)
    if ended is None:
        return Verdict(_WAITS, timeout_at)
    if ended["kind"] == _TIMED_OUT:
        incident = ended["payload"].get("incident")
        if incident is None:  # recorded before timeouts kept one: from what the wait recorded
            incident = recorded_incident_ref(f"event:{position}:{name}:{raw}")
        return Verdict(_RAISES, error=event_timeout(name, timeout_at, incident))
    return Verdict(_RETURNS, ended["payload"]["payload"])


def match_child(index: JournalIndex, position: int, workflow: str) -> Verdict:
    """``ctx.run_child(workflow, …)`` at ``position``: the child's result, its failure
    (:class:`RunFailed`), or a wait for the child (whose run id is the value)."""
    events = index.by_position.get(position)
    if not events:  # the live path: one lookup
        return NEW
    found = _commands(events, position, "child", workflow)
    if isinstance(found, Verdict):
        return found
    child_id = uuid.UUID(found[0]["payload"]["run_id"])
    ended = index.last(position, _CHILD_ENDS)
    if ended is None:
        return Verdict(_WAITS, child_id)
    return child_ended(child_id, ended)


# -- decoding, shared with the live paths ------------------------------------------------------

def decode_value(name: str, raw: Any) -> Any:
    """A recorded value as ``ctx.now()`` (datetime), ``ctx.uuid()`` (UUID) or
    ``ctx.random()`` (float) returns it, recorded now or long ago."""
    if name == "now":
        return datetime.fromisoformat(raw)
    if name == "uuid":
        return uuid.UUID(raw)
    return float(raw)


def tool_failed(tool: str, kind: str, payload: Mapping[str, Any]) -> ToolFailed:
    """What a call that ended in a ``call.failed`` or ``call.denied`` entry (``kind``, with its
    ``payload``) raises into workflow code: live, as the entry is written, and on every replay
    alike (a workflow that branches on the error's ``code`` or ``cause`` takes the same branch
    again, and one that passes its ``incident`` on passes the same one). A denial is
    ``TOOL_DENIED`` naming the policy stage; a failure ``TOOL_FAILED``. Its ``incident`` is the
    one the entry names, else one derived from the operation (``op``)."""
    incident = payload.get("incident") or recorded_incident_ref(f"operation:{payload['op']}")
    if kind == _DENIED:
        return ToolFailed(f"tool {tool} was not allowed ({payload['stage']})", tool=tool,
                          code="TOOL_DENIED", cause=payload.get("cause"), reason="cause",
                          incident=incident)
    refused = payload.get("retry_after")
    if refused is not None:  # a Retry-After hint stopped it: say which, and what is accepted
        return ToolFailed(f"tool {tool} failed and was not retried: {hint_refusal(refused)}",
                          tool=tool, cause=payload.get("cause"), reason=payload.get("reason"),
                          retry_after=refused, incident=incident)
    return ToolFailed(f"tool {tool} failed", tool=tool, cause=payload.get("cause"),
                      reason=payload.get("reason"), incident=incident)


def event_timeout(name: str, timeout_at: datetime | None, incident: str) -> EventTimeout:
    """What a wait for event ``name`` that timed out raises, live and on replay alike: its
    ``incident`` is the one its ``event.timeout`` entry records."""
    return EventTimeout(f"event {name!r} did not arrive in time", event=name,
                        timeout_at=timeout_at, incident=incident)


def child_ended(child_id: uuid.UUID, ended: Entry) -> Verdict:
    """What ``run_child`` does once child ``child_id`` ended (``ended`` is its
    ``child.completed`` or ``child.failed`` entry, recorded or just made): return the child's
    result, or raise its failure, whose ``incident`` is the child's own (recorded with it, so
    the same on every replay; where the child's error named none, as for a cancelled child,
    one derived from the child's run id, the same on every replay too)."""
    payload = ended["payload"]
    if ended["kind"] == _CHILD_COMPLETED:
        return Verdict(_RETURNS, payload["result"])
    return Verdict(_RAISES, error=RunFailed(
        payload["message"], code=payload["code"], run_id=str(child_id),
        cause=payload.get("cause"),
        incident=payload.get("incident") or recorded_incident_ref(f"child:{child_id}")))


# -- the check every command starts with -------------------------------------------------------

def _commands(events: list[Entry], position: int, command: str,
              name: str) -> list[Entry] | Verdict:
    """``events`` (what is recorded at ``position``: at least one entry) if they begin with
    ``command`` named ``name``: the journal's list, patch markers left out when they come
    first; :data:`NEW` if they are only markers; a :attr:`Outcome.DIFFERS` verdict if
    something else is recorded there."""
    first = events[0]
    if first["kind"] == _PATCH:  # markers are not commands: look past them
        events = [e for e in events if e["kind"] != _PATCH]
        if not events:
            return NEW
        first = events[0]
    if first["kind"] in FIRST_KIND[command] and first["name"] == name:
        return events
    recorded = describe(first)
    issued = "sleep" if command == "sleep" else f"{command} {name!r}"
    return Verdict(_DIFFERS, Mismatch.COMMAND, Nondeterminism(
        f"position {position}: the journal recorded {recorded}, the code issued {issued}",
        position=position, recorded=recorded, issued=issued))


def code_ended(index: JournalIndex, position: int, how: str = "ended") -> Nondeterminism | None:
    """The code ended (``how``: ``ended``, or ``continued as new``) having issued commands up
    to ``position``: the :class:`~orchestrator.journal.Nondeterminism` of a journal that holds
    a command from there on (patch markers are not commands), else None. A worker ending a
    run and the offline check ask this, so both say the same of it."""
    later = sorted(p for p, events in index.by_position.items()
                   if p >= position and any(e["kind"] != _PATCH for e in events))
    if not later:
        return None
    first = next(e for e in index.by_position[later[0]] if e["kind"] != _PATCH)
    recorded = describe(first)
    return Nondeterminism(
        f"position {later[0]}: the journal recorded {recorded}, the code {how}",
        position=later[0], recorded=recorded, issued="the end of the workflow")
