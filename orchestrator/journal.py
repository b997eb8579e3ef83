"""What a journal entry is (CONTRACT C3, C4): its kinds, their payloads, the schema version,
and the index a replay reads them through. Pure: no I/O.

A run's journal is the ordered list of what happened to it. Every entry has a ``kind`` (one of
:class:`EventKind`), the command ``position`` it belongs to (None for the run's own entries),
a ``name`` (the tool, event, workflow or value name, or a message's topic), the schema
version ``v`` and a ``payload`` whose fields :data:`PAYLOAD_FIELDS` defines for each kind.
Python builds entries with :func:`entry`; the hot steps' set-based statements
(:mod:`orchestrator.db.steps`) write theirs in SQL, and a unit test holds their kinds and
payloads to the same definition, so a payload's shape is written down once.

When workflow code issues the command at position *p*, :mod:`orchestrator.matching` checks
through the index that what was recorded there is the same kind of command with the same name;
anything else is nondeterminism (:class:`Nondeterminism`) and stops the run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from enum import StrEnum
from typing import Any

from orchestrator.errors import SchemaUnsupported

SCHEMA_VERSION = 1
"""The journal event schema this code writes and understands."""

Entry = dict[str, Any]
"""One journal entry as written: ``kind``, ``position``, ``name``, ``v`` and ``payload``; read
back, it also has ``seq``, ``schema_version``, ``lease_token`` and ``created_at``."""


class EventKind(StrEnum):
    """Every kind of journal entry. The value is what the journal stores."""

    # a tool call (the gateway), one attempt after another at one position
    CALL_PENDING = "call.pending"  # intent recorded; policy stages not yet passed
    CALL_SUBMITTED = "call.submitted"  # write-ahead: about to be sent
    CALL_COMPLETED = "call.completed"  # its receipt (or an operator's / a lookup's)
    CALL_FAILED = "call.failed"  # definitively failed, nothing applied (or withdrawn)
    CALL_DENIED = "call.denied"  # a policy stage said no; never sent
    CALL_CANCELLED = "call.cancelled"  # never sent: the run was cancelled, out of time or ended
    CALL_RETRYING = "call.retrying"  # nothing applied; the next attempt waits (or is re-sent)
    CALL_UNKNOWN = "call.unknown"  # sent, outcome unknown: what comes next
    CALL_NOT_APPLIED = "call.not_applied"  # reconciliation proved nothing was applied
    CALL_ABANDONED = "call.abandoned"  # an operator gave up on it; the run fails
    # the other commands
    TIMER = "timer"
    EVENT_WAIT = "event.wait"
    EVENT_RECEIVED = "event.received"
    EVENT_TIMEOUT = "event.timeout"
    VALUE = "value"  # ctx.now(), ctx.uuid(), ctx.random()
    MESSAGE = "message"  # ctx.publish(value, topic): the workflow's own entry in its stream
    CHILD_STARTED = "child.started"
    CHILD_COMPLETED = "child.completed"
    CHILD_FAILED = "child.failed"
    # ctx.patched / ctx.deprecate_patch: this run took a patch's new code (a marker that
    # takes no position of its own: it is filed under the position of the next command)
    PATCH = "patch"
    # the run's end
    RUN_COMPLETED = "run.completed"
    RUN_FAILED = "run.failed"
    RUN_CANCELLED = "run.cancelled"
    RUN_CONTINUED = "run.continued"  # ctx.continue_as_new: the run goes on as a new run


K = EventKind

RUN_ENDS = (K.RUN_COMPLETED, K.RUN_FAILED, K.RUN_CANCELLED, K.RUN_CONTINUED)
"""The kinds of a run's terminal entry: every way a run ends writes exactly one of them, in
the transaction that makes its status terminal."""

PAYLOAD_FIELDS: Mapping[EventKind, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # kind: (fields always present, fields present only in some entries)
    K.CALL_PENDING: (("tool_version", "intent", "attempt", "op", "key", "effect"), ()),
    K.CALL_SUBMITTED: (("tool_version", "intent", "attempt", "op", "key", "effect"), ()),
    K.CALL_COMPLETED: (("result", "op"), ("resolved", "resolved_by")),
    # retry_after: the tool's Retry-After hint that stopped the call (reason budget), in
    # entries written since the error names it (orchestrator.recovery.refused_hint)
    K.CALL_FAILED: (("op", "attempt", "cause", "reason", "incident"), ("retry_after",)),
    K.CALL_DENIED: (("op", "stage", "cause", "incident"), ()),
    # why: cancelled, deadline or ended; not in entries written before every writer gave it
    # (a call the database found cancelled as it was sent: read as "cancelled")
    K.CALL_CANCELLED: (("op",), ("why",)),
    K.CALL_RETRYING: (("op", "attempt", "cause", "incident", "delay_ms", "not_before", "key"),
                      ("resend",)),
    K.CALL_UNKNOWN: (("op", "reason", "next"), ("incident", "delay_ms", "not_before")),
    K.CALL_NOT_APPLIED: (("op", "resolved_by"), ("then",)),
    K.CALL_ABANDONED: (("op", "resolved_by"), ()),
    K.TIMER: (("until",), ()),
    K.EVENT_WAIT: (("timeout_at",), ()),
    # event_id: the delivered event's number, in entries written before it was left out (a
    # sequence every tenant shares, so it said how many events others sent; nothing reads it)
    K.EVENT_RECEIVED: (("payload",), ("event_id",)),
    K.EVENT_TIMEOUT: ((), ("incident",)),  # not in entries written before it was kept
    K.VALUE: (("value",), ()),
    K.MESSAGE: (("value",), ()),  # its name is the topic
    K.CHILD_STARTED: (("run_id", "version"), ()),
    K.CHILD_COMPLETED: (("result",), ()),
    K.CHILD_FAILED: (("code", "message"), ("cause", "incident")),
    K.PATCH: ((), ()),  # its name is the patch's id
    K.RUN_COMPLETED: (("result",), ()),
    K.RUN_FAILED: (("code", "message", "incident"), ("cause",)),
    K.RUN_CANCELLED: ((), ()),
    K.RUN_CONTINUED: (("run_id", "version"), ()),
}
"""The payload of each kind: the fields it always has, and those only some entries have."""


def entry(kind: EventKind, position: int | None, name: str | None,
          payload: dict[str, Any]) -> Entry:
    """A journal entry of ``kind``, to be appended (the storage numbers it)."""
    return {"kind": kind._value_, "position": position, "name": name, "v": SCHEMA_VERSION,
            "payload": payload}


UNSHOWN_FIELDS: Mapping[str, frozenset[str]] = {
    K.EVENT_RECEIVED.value: frozenset({"event_id"}),
}
"""Fields that entries written by earlier code may hold and that no reader of a run's journal
is shown (its owner, an operator, the command line): kept stored, as the journal is
append-only, and read by nothing."""


def shown_payload(kind: str, payload: Any) -> Any:
    """A ``kind`` entry's ``payload`` as a reader of the journal sees it: without
    :data:`UNSHOWN_FIELDS` (a copy when it had any; ``payload`` is never changed, as a
    stream's followers share the rows they read)."""
    unshown = UNSHOWN_FIELDS.get(kind)
    if unshown is None or not isinstance(payload, dict) or unshown.isdisjoint(payload):
        return payload
    return {k: v for k, v in payload.items() if k not in unshown}


def shown(e: Mapping[str, Any]) -> Mapping[str, Any]:
    """Entry ``e`` as a reader of the journal sees it (:func:`shown_payload`; ``e`` itself
    when nothing is left out)."""
    payload = shown_payload(e["kind"], e["payload"])
    return e if payload is e["payload"] else {**e, "payload": payload}


def check_payload(kind: EventKind, payload: Mapping[str, Any]) -> None:
    """Raise ``ValueError`` unless ``payload`` has exactly the fields ``kind`` defines (for
    tests and tools: the engine builds payloads from this definition and does not re-check)."""
    required, optional = PAYLOAD_FIELDS[kind]
    keys = set(payload)
    missing = set(required) - keys
    extra = keys - set(required) - set(optional)
    if missing or extra:
        raise ValueError(f"{kind.value}: missing {sorted(missing)}, unexpected {sorted(extra)}")


class Nondeterminism(BaseException):  # noqa: N818
    """The workflow issued a command that does not match the journal at that position.

    A BaseException, so that ordinary ``except Exception`` in workflow code cannot swallow it
    and carry on (CONTRACT C4: never silently continued). Its text is the failed run's message
    (outcome ``NONDETERMINISM``). One found by replay matching (:mod:`orchestrator.matching`)
    also says where (``position``), what the journal recorded there and what the code issued,
    in words (``call 'charge'``, ``sleep``). ``report``, the offline check's sentence, is the
    message: a worker and ``orchestrator replay`` say one thing of one mismatch."""

    code = "NONDETERMINISM"

    def __init__(self, message: str, *, position: int | None = None,
                 recorded: str | None = None, issued: str | None = None,
                 report: str | None = None) -> None:
        super().__init__(message)
        self.position = position
        self.recorded = recorded
        self.issued = issued
        self.report = report or message


def unsupported(event: Mapping[str, Any]) -> SchemaUnsupported:
    """The refusal of a stored ``event`` written by newer code than this (CONTRACT C3: never
    read as an entry of this code), in the words of every reader of a journal: a worker's
    replay, the offline check, ``app.journal``, a stream, ``runs show``, ``ops show``, ``runs
    export`` and the console."""
    return SchemaUnsupported(
        f"journal event {event['seq']} has schema version {event['schema_version']}; this "
        f"code understands up to {SCHEMA_VERSION}: read it with the orchestrator version "
        "that wrote it, or a later one")


def check_versions(events: Iterable[Mapping[str, Any]]) -> None:
    """:func:`unsupported` for the first of ``events`` (stored entries) written by newer
    code, if any."""
    for event in events:
        if event["schema_version"] > SCHEMA_VERSION:
            raise unsupported(event)


class JournalIndex:
    """The events of one run, grouped by command position, with schema versions checked."""

    def __init__(self, events: Iterable[Entry]) -> None:
        self.by_position: dict[int, list[Entry]] = {}
        self.run_events: list[Entry] = []
        self.max_position = -1
        for event in events:
            if event["schema_version"] > SCHEMA_VERSION:
                raise unsupported(event)
            position = event["position"]
            if position is None:
                self.run_events.append(event)
                continue
            self.by_position.setdefault(position, []).append(event)
            self.max_position = max(self.max_position, position)

    def patched(self, position: int, patch_id: str) -> bool:
        """Whether a marker of patch ``patch_id`` is filed at ``position``."""
        return any(e["kind"] == K.PATCH and e["name"] == patch_id
                   for e in self.by_position.get(position, ()))

    def add(self, event: Entry) -> None:
        """Keep the index current with an event this process just committed."""
        position = event["position"]
        if position is None:
            self.run_events.append(event)
            return
        self.by_position.setdefault(position, []).append(event)
        self.max_position = max(self.max_position, position)

    def last(self, position: int, kinds: tuple[str, ...]) -> Entry | None:
        """The last event at ``position`` whose kind is one of ``kinds``."""
        for event in reversed(self.by_position.get(position, ())):
            if event["kind"] in kinds:
                return event
        return None
