"""Public errors.

Every error the orchestrator raises to a user derives from :class:`OrchestratorError` and carries
a stable ``code`` (CONTRACT C10), a message built only from controlled fields, a ``retryable``
flag and an ``incident`` reference. Upstream text, payloads and stack traces never go into a
public error; they go to the protected diagnostics store under the incident reference.

The tree::

    OrchestratorError
    ├── ConfigurationError            CONFIGURATION_ERROR
    ├── DatabaseError                 DATABASE_UNAVAILABLE, SCHEMA_MISMATCH
    ├── InvalidRequest                INVALID_REQUEST
    │   ├── PayloadTooLarge           PAYLOAD_TOO_LARGE
    │   └── UnknownWorkflow           UNKNOWN_WORKFLOW
    │       └── UnknownTool           UNKNOWN_TOOL (``ctx.call``; was UNKNOWN_WORKFLOW)
    ├── IdempotencyConflict           IDEMPOTENCY_CONFLICT
    ├── AccessDenied                  ACCESS_DENIED
    ├── Unauthenticated               UNAUTHENTICATED (the console: no operator identified)
    ├── Forbidden                     FORBIDDEN (the console: a grant or a CSRF token missing)
    ├── NotFound                      NOT_FOUND (the console: no such path; was
    │                                 INVALID_REQUEST)
    ├── JournalFull                   JOURNAL_FULL
    ├── EventBacklogFull              EVENT_BACKLOG_FULL
    ├── SchemaUnsupported             SCHEMA_UNSUPPORTED
    ├── RunUnreadable                 RUN_UNREADABLE (a stored value cannot be decoded)
    ├── LeaseLost                     LEASE_LOST (internal to workers; never a run outcome)
    ├── ResultTimeout                 RESULT_TIMEOUT (carries the run's current ``status``)
    ├── ToolFailed                    TOOL_FAILED, TOOL_DENIED (raised into workflow code)
    ├── EventTimeout                  EVENT_TIMEOUT (raised into workflow code; also a
    │                                 built-in ``TimeoutError``)
    ├── OperationInProgress           OPERATION_IN_PROGRESS
    ├── OperationUncertain            OPERATION_UNCERTAIN (carries ``known_operations``)
    ├── ResolutionConflict            RESOLUTION_CONFLICT
    └── RunFailed                     the run's outcome code: WORKFLOW_FAILED, CANCELLED,
                                      DEADLINE_EXCEEDED, NONDETERMINISM, OPERATION_ABANDONED;
                                      ``cause`` names what stopped it (below)

:class:`WorkflowError` is not an orchestrator failure: workflow code raises it on purpose to fail
a run with a message that callers may see (CONTRACT C13).

A run that workflow code let an orchestrator error escape from fails with ``WORKFLOW_FAILED``
(the outcome codes do not change), and its stored error, its ``run.failed`` journal entry and
the caller's :class:`RunFailed` name that error as the run's ``cause``: a dict of controlled
fields, never tool text. ``{"code": "TOOL_FAILED", "tool": "charge", "cause": "timeout",
"reason": "budget", "attempts": 1, "reconciled": "lookup"}`` for a call that failed,
``{"code": "EVENT_TIMEOUT", "event": "approval"}`` for a wait that timed out,
``{"code": "WORKFLOW_FAILED", "run_id": "…", "cause": …}`` for a child run, and ``{"code":
CODE}`` for any other. The run's one incident reference leads to the rest (the tool's
incidents, the lookups', the call's timeline).
"""

from __future__ import annotations

import hashlib
import json
import secrets
from datetime import datetime
from typing import Any


def new_incident_ref() -> str:
    """Return a short, unguessable reference that links a public error to its diagnostics."""
    return "inc_" + secrets.token_hex(8)


def recorded_incident_ref(identity: str) -> str:
    """The reference of an error raised into workflow code that kept no diagnostics of its
    own, derived from what its journal records (``identity``: ``operation:7`` for a call's
    failure or denial, ``child:<run id>`` for a child's end): the same on every replay, in
    the restart that carries the entry too, so workflow code that passes the reference on
    (to a call's arguments, say) replays its history. It names no stored diagnostics."""
    return "inc_" + hashlib.sha256(identity.encode()).hexdigest()[:16]


def error_json(code: str, message: str, incident: str | None,
               cause: dict[str, Any] | None = None) -> str:
    """A run's stored error (what its owner reads): ``incident`` names its diagnostics (None:
    there are none, as for a cancellation), ``cause`` the orchestrator error that stopped the
    workflow (None: there was none). Built only from controlled fields (C10)."""
    return json.dumps({"code": code, "message": message, "retryable": False,
                       "incident": incident, "cause": cause})


def operation_error_json(code: str, **fields: Any) -> str:
    """An operation's stored error: its ``code`` and controlled ``fields`` (``cause``,
    ``stage``, ``incident``, ``message``)."""
    return json.dumps({"code": code, **fields})


CANCELLED_BEFORE_SENT = {
    "cancelled": "the run was cancelled before the call was sent",
    "deadline": "the run's deadline passed before the call was sent",
    "ended": "the run ended before the call was sent",
}
"""Why a call was never sent, by its ``call.cancelled`` entry's ``why``."""


def cancelled_error(why: str) -> str:
    """The stored error of an operation that was never sent because its run was cancelled,
    ran out of time or ended (``why``, as its ``call.cancelled`` entry says): code
    ``CALL_CANCELLED``, cause ``why`` and the words of :data:`CANCELLED_BEFORE_SENT`. Every
    path that journals ``call.cancelled`` stores it, so the ledger says why on its own."""
    return operation_error_json("CALL_CANCELLED", cause=why,
                                message=CANCELLED_BEFORE_SENT[why])


class OrchestratorError(Exception):
    """Root of every public error: a stable ``code``, ``retryable`` and an ``incident`` ref."""

    code: str = "INTERNAL"
    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        retryable: bool | None = None,
        incident: str | None = None,
    ) -> None:
        super().__init__(message)
        if code is not None:
            self.code = code
        if retryable is not None:
            self.retryable = retryable
        self.message = message
        self.incident = incident or new_incident_ref()

    def __str__(self) -> str:
        return f"{self.code}: {self.message}"

    def to_dict(self) -> dict[str, Any]:
        """The public form of the error, safe to show to any caller."""
        return {
            "code": self.code,
            "message": self.message,
            "retryable": self.retryable,
            "incident": self.incident,
        }


class ConfigurationError(OrchestratorError):
    """The orchestrator's configuration is unusable (bad URL, missing database, bad option)."""

    code = "CONFIGURATION_ERROR"


class DatabaseError(OrchestratorError):
    """The database cannot be reached or its schema does not match the code."""

    code = "DATABASE_UNAVAILABLE"
    retryable = True


class InvalidRequest(OrchestratorError):
    """The caller's input is not acceptable; nothing was written."""

    code = "INVALID_REQUEST"

    def __init__(self, message: str, *, path: str | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.path = path

    def to_dict(self) -> dict[str, Any]:
        """The public form, with ``path`` (the argument, field or header that was refused, or
        where in a JSON value the refused part is, from the caller's own keys) when it is
        set."""
        public = super().to_dict()
        if self.path is not None:
            public["path"] = self.path
        return public


class PayloadTooLarge(InvalidRequest):
    """A record exceeds the configured size cap (CONTRACT C2)."""

    code = "PAYLOAD_TOO_LARGE"


class UnknownWorkflow(InvalidRequest):
    """The workflow (or the workflow version) is not registered with this orchestrator
    instance."""

    code = "UNKNOWN_WORKFLOW"


class UnknownTool(UnknownWorkflow):
    """``ctx.call`` names a tool this orchestrator instance does not register: by a name it
    does not know, or as a :class:`~orchestrator.Tool` object registered on another
    ``Orchestrator`` (even one whose name this instance registers too). Raised into workflow
    code before anything is written. A subclass of :class:`UnknownWorkflow`, which this case
    raised before it had its own code, so that ``except UnknownWorkflow`` still catches it."""

    code = "UNKNOWN_TOOL"


class IdempotencyConflict(OrchestratorError):
    """The idempotency key was used by the same owner for a different request."""

    code = "IDEMPOTENCY_CONFLICT"


class AccessDenied(OrchestratorError):
    """The run does not exist or belongs to another owner; both look the same (CONTRACT C9)."""

    code = "ACCESS_DENIED"


class Unauthenticated(OrchestratorError):
    """The console could not tell which operator sent the request (no valid token or
    session); nothing was read or changed. HTTP 401."""

    code = "UNAUTHENTICATED"


class Forbidden(OrchestratorError):
    """The operator is known but may not do this: it lacks the grant the request needs, or an
    action came without its CSRF token. Says nothing about whether the object exists (that
    is :class:`AccessDenied`, answered as a missing object). HTTP 403."""

    code = "FORBIDDEN"


class NotFound(OrchestratorError):
    """The console (its pages, the operators' JSON API, the submitters' HTTP API) serves no
    such path; nothing was read or changed. HTTP 404. Not a missing or hidden run or operation
    at a path it serves: that is :class:`AccessDenied`, whose 404 says the object is not
    there for this caller. A path it serves for another method is ``INVALID_REQUEST`` (HTTP
    405)."""

    code = "NOT_FOUND"


class JournalFull(OrchestratorError):
    """The run's journal reached its cap; no new work is accepted for it (CONTRACT C2)."""

    code = "JOURNAL_FULL"


class EventBacklogFull(OrchestratorError):
    """The run already has as many events waiting to be consumed as its cap allows
    (``max_pending_events``); nothing was stored. Retryable: the cap frees up as the run
    consumes its events."""

    code = "EVENT_BACKLOG_FULL"
    retryable = True


class SchemaUnsupported(OrchestratorError):
    """A journal event was written by a newer schema version than this code understands."""

    code = "SCHEMA_UNSUPPORTED"


class RunUnreadable(OrchestratorError):
    """A value stored for a run cannot be decoded by this process (nested too deep, an integer
    too long to parse: written before today's caps, or by hand). The run fails alone with this
    code; nothing else stops."""

    code = "RUN_UNREADABLE"


class LeaseLost(OrchestratorError):
    """A worker's write was rejected because it no longer holds the run's lease (CONTRACT C6)."""

    code = "LEASE_LOST"
    retryable = True


class RunPruned(OrchestratorError):
    """The run finished long enough ago that retention pruned it (docs/retention.md): its
    result, input and journal are gone. Its row stays as long as its evidence, so that its
    submission key keeps answering with this run (never a second one); ``status`` and
    ``outcome`` say how it ended, ``pruned_at`` when it was pruned. HTTP 410."""

    code = "RUN_PRUNED"

    def __init__(self, message: str, *, status: str, outcome: str | None = None,
                 pruned_at: Any = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.status = status
        self.outcome = outcome
        self.pruned_at = pruned_at


class ResultTimeout(OrchestratorError):
    """``result(timeout)`` passed before the run became terminal; nothing was changed.

    From ``wait`` and ``as_completed``, ``pending`` lists the runs not finished yet (their ids,
    in the order given) and ``status`` is the first one's.
    """

    code = "RESULT_TIMEOUT"
    retryable = True

    def __init__(self, message: str, *, status: str, pending: tuple[str, ...] = (),
                 **kw: Any) -> None:
        super().__init__(message, **kw)
        self.status = status
        self.pending = pending


class RunFailed(OrchestratorError):
    """The run ended without success; ``code`` is its outcome (CONTRACT C13).

    ``cause`` is what stopped the workflow when that was an orchestrator error it did not
    catch (a :class:`ToolFailed`, an :class:`EventTimeout`, a child's :class:`RunFailed`): a
    dict of controlled fields whose ``code`` is that error's (see the module docstring), or
    None. ``incident`` leads operators to the whole story: the run's own reference, as its
    stored error names it, or None when it has none (a cancelled run: no diagnostics were
    kept), never one made up for the error raised.
    """

    incident: str | None  # type: ignore[assignment]  # None: the run kept no diagnostics

    def __init__(self, message: str, *, code: str, run_id: str,
                 cause: dict[str, Any] | None = None, incident: str | None = None,
                 **kw: Any) -> None:
        super().__init__(message, code=code, **kw)
        self.incident = incident
        self.run_id = run_id
        self.cause = cause

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "cause": self.cause}


class WorkflowError(Exception):
    """Raise from workflow code to fail a run with a message callers are allowed to see.

    Any other exception fails the run too, but its text goes only to the protected diagnostics.
    """


OUTCOME_CODES = frozenset(
    {"WORKFLOW_FAILED", "CANCELLED", "DEADLINE_EXCEEDED", "NONDETERMINISM", "OPERATION_ABANDONED"}
)


class ToolFailed(OrchestratorError):
    """Raised into workflow code when a tool call failed definitively (nothing was applied).

    The tool's own message is not part of this error; it is in the incident's diagnostics.
    ``position`` is the journal position of the call (set by the engine; None for one that
    workflow code made itself): a run that this error fails names the call's story from there.
    """

    code = "TOOL_FAILED"

    def __init__(self, message: str, *, tool: str, cause: str | None = None,
                 reason: str | None = None, position: int | None = None,
                 retry_after: dict[str, Any] | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.tool = tool
        self.cause = cause  # e.g. authentication, conflict, rate_limited, denied
        # why it was not retried: cause, visible, effects, budget (the retry policy),
        # operator (an operator chose to fail it) or resend_limit (max_engine_resends)
        self.reason = reason
        self.position = position
        # the tool's Retry-After hint that stopped the call (reason budget), else None:
        # ``given`` (a hint given as a finite number, else None), ``wait_ms`` (None: it did
        # not parse) and the retry policy's ``max_delay_ms``; the message says it in words
        self.retry_after = retry_after


class EventTimeout(OrchestratorError, TimeoutError):
    """Raised into workflow code when ``ctx.wait_for_event(name, timeout=...)`` passed its
    timeout before the event arrived (CONTRACT C11). Its timeout is journaled, so a replay
    raises it again at the same command.

    Catch it to go another way. Uncaught, the run fails with ``WORKFLOW_FAILED`` and its
    ``cause`` ``{"code": "EVENT_TIMEOUT", "event": name}``. It is a :class:`TimeoutError`
    too, so workflow code written for the built-in exception keeps working.
    """

    code = "EVENT_TIMEOUT"

    def __init__(self, message: str, *, event: str, timeout_at: datetime | None = None,
                 **kw: Any) -> None:
        super().__init__(message, **kw)
        self.event = event
        self.timeout_at = timeout_at


class OperationInProgress(OrchestratorError):
    """The run (or the operation) is still being worked on; ask again later."""

    code = "OPERATION_IN_PROGRESS"
    retryable = True

    def __init__(self, message: str, *, status: str | None = None, **kw: Any) -> None:
        super().__init__(message, **kw)
        self.status = status


class OperationUncertain(OrchestratorError):
    """The run is blocked on an operation whose outcome is unknown (CONTRACT C8).

    ``known_operations`` lists what is known: the operations committed so far, in order.
    """

    code = "OPERATION_UNCERTAIN"

    def __init__(self, message: str, *, known_operations: list[dict[str, Any]], **kw: Any
                 ) -> None:
        super().__init__(message, **kw)
        self.known_operations = known_operations


class ResolutionConflict(OrchestratorError):
    """The operation was already resolved differently; the new resolution is rejected."""

    code = "RESOLUTION_CONFLICT"
