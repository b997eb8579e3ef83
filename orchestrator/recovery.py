"""The recovery decision, Retry-After parsing and failure classification (CONTRACT C7).

Pure functions, no I/O, no clock: the caller passes ``now`` and the jitter sample. Times are
whole milliseconds so that every boundary is exact.

The decision, in order of precedence:

1. effects ``unknown``                       → ``reconcile`` (always, whatever else is true)
2. the cause is not transient                → ``stop("cause")``
3. an effect was already ``committed``       → ``stop("effects")``
4. output was already visible to the caller  → ``stop("visible")``
5. attempts begun ≥ max attempts             → ``stop("budget")``
6. an upstream minimum wait that is invalid or longer than ``max_delay`` → ``stop("budget")``
7. delay = max(jitter × min(max_delay, base × 2^(attempts−1)), upstream minimum); the upstream
   minimum is never shortened to fit;
8. a deadline that cannot hold delay + minimum attempt time → ``stop("budget")``
9. otherwise                                 → ``retry(delay)``
"""

from __future__ import annotations

import email.utils
import math
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from orchestrator.errors import InvalidRequest
from orchestrator.failures import (  # noqa: F401 - re-exported: recovery speaks of them
    Classification,
    EffectKnowledge,
    classify_status,
    classify_transport,
)
from orchestrator.text import is_number

StopReason = Literal["cause", "visible", "effects", "budget"]
MAX_ATTEMPTS_LIMIT = 10
MAX_ENGINE_RESENDS_LIMIT = 100
# The longest pause a Retry-After may ask for: 36,600 days (about a century, the longest
# deadline a run may have). A longer one cannot be kept as a pause of the tool and is treated
# as a hint that does not parse.
MAX_RETRY_AFTER_MS = 36_600 * 86_400_000


def _int(name: str, value: object, *, low: int = 0) -> int:
    if type(value) is not int or value < low:
        raise InvalidRequest(f"{name} must be an integer ≥ {low}, got {value!r}", path=name)
    return value


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how patiently a tool call is retried.

    ``max_attempts`` counts the first attempt and the attempts that follow a failure the tool
    reported, or an uncertain outcome its effect class lets the engine repeat (at most 10).
    Delays are milliseconds: full jitter over a window that doubles from ``base_delay_ms`` up to
    ``max_delay_ms``. An attempt is only started if ``min_attempt_ms`` fits before the deadline.

    ``max_engine_resends`` caps the attempts sent again, outside that budget, because the
    engine lost one (its worker died, its lease or connection was lost around the dispatch)
    and reconciliation proved it not applied (CONTRACT C8). A tool that kills its worker every
    time fails the call after that many (``TOOL_FAILED``, cause ``worker_lost``, reason
    ``resend_limit``) instead of looping. 0 turns such re-sends off: a proven non-effect then
    counts against ``max_attempts`` like any other.
    """

    max_attempts: int = 1
    base_delay_ms: int = 200
    max_delay_ms: int = 30_000
    min_attempt_ms: int = 0
    max_engine_resends: int = 10

    def __post_init__(self) -> None:
        _int("max_attempts", self.max_attempts, low=1)
        if self.max_attempts > MAX_ATTEMPTS_LIMIT:
            raise InvalidRequest(f"max_attempts must be at most {MAX_ATTEMPTS_LIMIT}",
                                 path="max_attempts")
        _int("base_delay_ms", self.base_delay_ms)
        _int("max_delay_ms", self.max_delay_ms)
        _int("min_attempt_ms", self.min_attempt_ms)
        _int("max_engine_resends", self.max_engine_resends)
        if self.max_engine_resends > MAX_ENGINE_RESENDS_LIMIT:
            raise InvalidRequest(f"max_engine_resends must be at most {MAX_ENGINE_RESENDS_LIMIT}",
                                 path="max_engine_resends")
        if self.base_delay_ms > self.max_delay_ms:
            raise InvalidRequest("base_delay_ms must not exceed max_delay_ms",
                                 path="base_delay_ms")


DEFAULT_POLICIES: dict[str, RetryPolicy] = {
    "consequential": RetryPolicy(max_attempts=1),
    "idempotent": RetryPolicy(max_attempts=3),
    "read": RetryPolicy(max_attempts=3),
}


@dataclass(frozen=True)
class Decision:
    """``retry`` (after ``delay_ms``), ``reconcile`` or ``stop`` (with ``reason``)."""

    action: Literal["retry", "reconcile", "stop"]
    delay_ms: int = 0
    reason: StopReason | None = None
    detail: str | None = None  # for "budget": attempts, upstream or deadline

    @staticmethod
    def retry(delay_ms: int) -> Decision:
        return Decision("retry", delay_ms=delay_ms)

    @staticmethod
    def stop(reason: StopReason, detail: str | None = None) -> Decision:
        return Decision("stop", reason=reason, detail=detail)


RECONCILE = Decision("reconcile")


def decide(
    *,
    transient: bool,
    effects: EffectKnowledge,
    visible: bool,
    attempts: int,
    policy: RetryPolicy,
    jitter: float,
    remaining_ms: int | None = None,
    upstream_wait_ms: int | None = None,
    upstream_invalid: bool = False,
) -> Decision:
    """What to do after a failed attempt. See the module docstring for the rules.

    ``attempts`` is how many attempts have begun (≥ 1). ``remaining_ms`` is the time left
    before the run's deadline (None: no deadline). ``upstream_wait_ms`` is a parsed
    Retry-After (None: none given); ``upstream_invalid`` says one was given but did not parse.
    """
    if type(transient) is not bool or type(visible) is not bool:
        raise InvalidRequest("transient and visible must be booleans")
    if effects not in ("none", "committed", "unknown"):
        raise InvalidRequest(f"effects must be none, committed or unknown, got {effects!r}",
                             path="effects")
    _int("attempts", attempts, low=1)
    if type(jitter) not in (float, int) or not 0 <= jitter < 1 or math.isnan(jitter):
        raise InvalidRequest(f"jitter must be in [0, 1), got {jitter!r}", path="jitter")
    if remaining_ms is not None:
        _int("remaining_ms", remaining_ms)
    if upstream_wait_ms is not None:
        _int("upstream_wait_ms", upstream_wait_ms)

    if effects == "unknown":
        return RECONCILE
    if not transient:
        return Decision.stop("cause")
    if effects == "committed":
        return Decision.stop("effects")
    if visible:
        return Decision.stop("visible")
    if attempts >= policy.max_attempts:
        return Decision.stop("budget", "attempts")
    if upstream_invalid or (upstream_wait_ms is not None
                            and upstream_wait_ms > policy.max_delay_ms):
        return Decision.stop("budget", "upstream")
    delay = backoff_ms(policy, attempts, jitter)
    if upstream_wait_ms is not None:
        delay = max(delay, upstream_wait_ms)
    if remaining_ms is not None and delay + policy.min_attempt_ms > remaining_ms:
        return Decision.stop("budget", "deadline")
    return Decision.retry(delay)


def backoff_ms(policy: RetryPolicy, attempts: int, jitter: float) -> int:
    """The policy's jittered delay after ``attempts`` attempts: full jitter over a window that
    doubles from ``base_delay_ms`` up to ``max_delay_ms``."""
    window = min(policy.max_delay_ms, policy.base_delay_ms << min(attempts - 1, 62))
    return math.floor(jitter * window)


def resend_delay_ms(policy: RetryPolicy, attempts: int, jitter: float,
                    remaining_ms: int | None = None) -> int:
    """How long to wait before repeating an attempt whose outcome the tool left unknown (an
    idempotent tool's re-send with the same key, a read's new attempt): the policy's backoff
    after ``attempts``, as for a retry, shortened so that ``min_attempt_ms`` still fits
    before the deadline (the repetition is not given up for it: that is the reconciliation's
    or the attempt's own deadline check's to decide)."""
    _int("attempts", attempts, low=1)
    if type(jitter) not in (float, int) or not 0 <= jitter < 1 or math.isnan(jitter):
        raise InvalidRequest(f"jitter must be in [0, 1), got {jitter!r}", path="jitter")
    delay = backoff_ms(policy, attempts, jitter)
    if remaining_ms is not None:
        delay = min(delay, max(0, remaining_ms - policy.min_attempt_ms))
    return delay


def parse_retry_after(value: str | int | float | None, now: datetime) -> tuple[int | None, bool]:
    """Parse a Retry-After hint: delay-seconds or an HTTP-date.

    Returns ``(milliseconds, invalid)``: ``(None, False)`` when there is no hint,
    ``(None, True)`` when there is one that does not parse, is negative, or asks for a pause
    longer than :data:`MAX_RETRY_AFTER_MS` (digits of another script or more than 18 of
    them, a date out of range, a number of seconds no pause could keep).
    """
    if value is None:
        return None, False
    if isinstance(value, bool):
        return None, True
    if isinstance(value, int | float):
        if not math.isfinite(value) or value < 0:
            return None, True
        return _kept(math.ceil(value * 1000))
    text = value.strip()
    if text.isdigit():  # any script's digits: only ASCII ones are delay-seconds
        return _kept(int(text) * 1000) if is_number(text) else (None, True)
    try:
        when = email.utils.parsedate_to_datetime(text)
    except (TypeError, ValueError, IndexError, OverflowError):
        return None, True
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    return _kept(max(0, math.ceil((when - now).total_seconds() * 1000)))


def _kept(ms: int) -> tuple[int | None, bool]:
    return (ms, False) if ms <= MAX_RETRY_AFTER_MS else (None, True)


def refused_hint(value: str | float, wait_ms: int | None, max_delay_ms: int) -> dict[str, Any]:
    """What a call's ``call.failed`` entry keeps of the Retry-After hint that stopped it
    (``decide``'s ``stop("budget", "upstream")``), for :func:`hint_refusal` to say live and on
    every replay: ``given``, a hint given as a finite number (None for anything else, a text or
    bytes: what a provider wrote stays out of the journal and the errors, C10), ``wait_ms``,
    the wait it asked for (None: it did not parse), and the policy's ``max_delay_ms``."""
    number = (isinstance(value, int | float) and not isinstance(value, bool)
              and math.isfinite(value))
    given = repr(value) if number else None
    return {"given": given, "wait_ms": wait_ms, "max_delay_ms": max_delay_ms}


def hint_refusal(refused: Mapping[str, Any]) -> str:
    """Why a Retry-After hint stopped a call (``refused``: :func:`refused_hint`'s), saying
    what is accepted: the one sentence every surface says of it."""
    given, wait_ms = refused.get("given"), refused.get("wait_ms")
    hint = "the tool's Retry-After hint" + (f" {given}" if given is not None else "")
    if wait_ms is None:
        return (f"{hint} was not accepted: it takes whole seconds (ASCII digits, or a number "
                f"of seconds of 0 or more) or an HTTP-date, at most "
                f"{MAX_RETRY_AFTER_MS // 86_400_000} days away")
    return (f"{hint} asks for a wait of {wait_ms} ms, longer than the retry policy's "
            f"max_delay_ms ({refused['max_delay_ms']}): give the tool a RetryPolicy whose "
            "max_delay_ms covers the waits its provider asks for")
