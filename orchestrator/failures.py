"""How a failed tool call is classified (CONTRACT C7): what tool code raises to say what it
knows (:class:`ToolError`) and what the engine makes of it (:class:`Classification`).

Pure: no I/O, no engine state. :mod:`orchestrator.recovery` decides what to do next from a
classification; this module only says what a failure means.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from orchestrator.errors import InvalidRequest

EffectKnowledge = Literal["none", "committed", "unknown"]


@dataclass(frozen=True)
class Classification:
    """What a failure means: a public ``cause``, whether anything may have been applied, and
    whether a retry is allowed at all."""

    cause: str
    effects: EffectKnowledge
    transient: bool


def classify_status(status: int, *, proves_not_applied: bool = False) -> Classification:
    """Classify an HTTP-style status returned by a provider (C7).

    401/403 authentication and 400/404/422 invalid requests are definitive and not retryable;
    409 is a conflict (not a rate limit), not retryable; 408/429 are retryable only when the
    failure proves the request was not applied; ≥500 leaves the effects unknown.
    """
    if status in (401, 403):
        return Classification("authentication", "none", False)
    if status in (400, 404, 422):
        return Classification("invalid_request", "none", False)
    if status == 409:
        return Classification("conflict", "none", False)
    if status in (408, 429):
        if proves_not_applied:
            return Classification("rate_limited" if status == 429 else "request_timeout",
                                  "none", True)
        return Classification("rate_limited" if status == 429 else "request_timeout",
                              "unknown", False)
    if status >= 500:
        return Classification("upstream_error", "unknown", False)
    if 400 <= status < 500:
        return Classification("rejected", "none", False)
    raise InvalidRequest(f"status {status} is not a failure", path="status")


def classify_transport(phase: Literal["before_send", "after_send"], kind: str) -> Classification:
    """Classify a transport failure: before the request left, nothing was applied and a retry
    is allowed; after it was sent (timeouts, dropped connections, partial responses) the
    effects are unknown."""
    if phase == "before_send":
        return Classification(f"{kind}_before_send", "none", True)
    return Classification(f"{kind}_after_send", "unknown", False)


class ToolError(Exception):
    """Raised by tool code to say what is known about a failed call (CONTRACT C7).

    Build it from what happened, and the orchestrator classifies it:

    - ``ToolError.from_status(429, proves_not_applied=True, retry_after="2")``: a provider's
      status; 401/403, 400/404/422 and 409 are definitive; 408/429 are retryable only when
      they prove nothing was applied; ≥ 500 leaves the effects unknown;
    - ``ToolError.before_send("connection")``: the request never left: retryable;
    - ``ToolError.after_send("timeout")``: it was sent; the effects are unknown;
    - ``ToolError(msg, applied=False, retryable=True)``: the general form.

    ``retry_after`` is the provider's least wait: whole seconds as text (an HTTP
    ``Retry-After`` header as it came), an HTTP-date, or a number of seconds. A retry the
    failure allows waits at least that long; a hint that does not parse (``"0.5"``) or is
    longer than the retry policy's ``max_delay_ms`` stops the call (reason ``budget``)
    instead. With a 429 or 503 it also pauses the tool for every run (docs/flow.md).

    Every other exception from a tool is a protocol failure: not retryable, and after
    dispatch the effects are unknown. The message is kept in protected diagnostics only.
    """

    def __init__(
        self,
        message: str = "",
        *,
        applied: bool | None = None,
        retryable: bool = False,
        status: int | None = None,
        retry_after: str | float | None = None,
        cause: str | None = None,
    ) -> None:
        super().__init__(message)
        self.applied = applied
        self.retryable = retryable
        self.status = status
        self.retry_after = retry_after
        self.cause = cause

    @classmethod
    def from_status(cls, status: int, message: str = "", *, proves_not_applied: bool = False,
                    retry_after: str | float | None = None) -> ToolError:
        return cls(message, status=status, applied=False if proves_not_applied else None,
                   retry_after=retry_after)

    @classmethod
    def before_send(cls, kind: str = "connection", message: str = "", *,
                    retry_after: str | float | None = None) -> ToolError:
        return cls(message, applied=False, retryable=True, cause=f"{kind}_before_send",
                   retry_after=retry_after)

    @classmethod
    def after_send(cls, kind: str = "timeout", message: str = "") -> ToolError:
        return cls(message, applied=None, cause=f"{kind}_after_send")

    def classification(self) -> Classification:
        """What this failure means (:class:`Classification`)."""
        if self.status is not None and self.status >= 400:
            return classify_status(self.status, proves_not_applied=self.applied is False)
        if self.applied is False:
            return Classification(self.cause or "not_applied", "none", self.retryable)
        return Classification(self.cause or "outcome_unknown", "unknown", False)


ENGINE_CAUSES = frozenset({
    # classify_status
    "authentication", "invalid_request", "conflict", "rate_limited", "request_timeout",
    "upstream_error", "rejected",
    # ToolError's own defaults, and the transport kinds its documentation names
    "not_applied", "outcome_unknown", "connection_before_send", "connection_after_send",
    "timeout_before_send", "timeout_after_send",
    # the policy stages and the calls workflow code withdrew
    "denied", "policy_timeout", "cancelled",
    # why an attempt's outcome was unknown before reconciliation proved it not applied
    "timeout", "invalid_receipt", "worker_lost", "outcome_unrecorded",
})
"""The cause words the orchestrator itself produces for a failed tool call."""

TOOL_DEFINED = "tool_defined"
"""What a public error says of a cause word the tool chose itself (:func:`public_cause`)."""

STOP_REASONS = frozenset({"cause", "visible", "effects", "budget", "operator", "resend_limit"})
"""Why a failed call was not retried: the retry policy's ``orchestrator.recovery.StopReason``,
an operator's ``not applied, then fail`` (``operator``), or the cap on re-sends of attempts the
engine lost (``resend_limit``, ``RetryPolicy.max_engine_resends``)."""


def public_cause(cause: str | None) -> str | None:
    """``cause`` as a public error may carry it (CONTRACT C10): the word itself when the
    orchestrator produces it (:data:`ENGINE_CAUSES`), :data:`TOOL_DEFINED` for any other.
    A tool may name its own cause (``ToolError(cause=...)``, ``ToolError.before_send(kind)``),
    and what it chose is tool text: it stays in the incident's diagnostics."""
    if cause is None:
        return None
    return cause if cause in ENGINE_CAUSES else TOOL_DEFINED


def incident_cause(exc: BaseException) -> tuple[str, str | None]:
    """The ``cause`` a tool's incident summary keeps, and the tool's own word for its details
    (None: it chose none). A :class:`ToolError`'s cause is its classification's, e.g.
    ``timeout_after_send`` from ``ToolError.after_send("timeout")``: in the summary as
    :func:`public_cause` has it (``tool_defined`` for a word the tool chose, which is tool
    text and stays in the details, read by incident readers only, CONTRACT C10). Any other
    exception's cause is its type's name."""
    if isinstance(exc, ToolError):
        word = exc.classification().cause
        return public_cause(word) or TOOL_DEFINED, None if word in ENGINE_CAUSES else word
    return type(exc).__name__, None


def unknown_cause(reason: str, phase: str | None, upstream_status: int | None,
                  tool_cause: str | None = None) -> str:
    """Why an attempt's outcome was unknown, as a cause word: from the ``call.unknown``
    entry's ``reason`` and the phase, upstream status and cause of the incident it names
    (None: it names none). A timed-out dispatch is ``timeout``; a tool's failure with a
    provider's status is that status's cause; one whose incident keeps a cause word the
    orchestrator knows is that word (``timeout_after_send``, or ``tool_defined`` for one the
    tool chose, :func:`incident_cause`); any other tool failure (an exception's type) is
    ``outcome_unknown``."""
    if reason == "TOOL_OUTCOME_UNCERTAIN":
        if phase == "dispatch":
            # The only dispatch incident a failed call can follow: the run's own cancellation
            # after dispatch stops the run cancelled instead, never as a failed call.
            return "timeout"
        if phase == "tool" and upstream_status is not None and upstream_status >= 400:
            return classify_status(upstream_status).cause
        if phase == "tool" and (tool_cause in ENGINE_CAUSES or tool_cause == TOOL_DEFINED):
            return tool_cause
        return "outcome_unknown"
    return {"INVALID_RECEIPT": "invalid_receipt", "WORKER_LOST": "worker_lost",
            "OUTCOME_UNRECORDED": "outcome_unrecorded"}.get(reason, "outcome_unknown")
