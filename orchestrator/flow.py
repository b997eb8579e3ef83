"""Flow control: when a run may start, and the rate limits of queues and tools (docs/flow.md).

A submission may hold its run back, ``start_at`` (a timezone-aware time) or ``delay`` (from
the moment of submission). The run is written at once (its idempotency key is taken, its
owner can read, cancel or send it events) but no worker claims it before its start, and its
deadline counts from its start. What the submission asked is part of the request that its
idempotency key names: the same key with the same ``delay`` is the same request (a retry,
whatever the clock says by then), with another ``delay`` or ``start_at`` a conflict.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from orchestrator.errors import InvalidRequest

START_AT_TOLERANCE = timedelta(minutes=5)
"""How far in the past ``start_at`` may be (clocks differ; a time this close to now starts the
run at once). Further back is a mistake, not a schedule: ``INVALID_REQUEST``."""

MAX_HOLD = timedelta(days=3660)
"""The furthest a submission may hold its run back (about ten years)."""
MAX_DEADLINE = timedelta(days=36600)
"""The longest deadline a submission may give (about a hundred years): its expiry, counted
from a start held back up to :data:`MAX_HOLD`, must be a time the database can store."""


@dataclass(frozen=True)
class Start:
    """A held-back start as stored: exactly one of the two is set."""

    at: datetime | None = None  # UTC
    delay_seconds: float | None = None

    def option(self) -> dict[str, Any]:
        """What the request digest and ``runs.options`` record of it."""
        if self.at is not None:
            return {"start_at": self.at.isoformat()}
        return {"delay_seconds": self.delay_seconds}


def check_start(start_at: datetime | None, delay: timedelta | None,
                now: datetime) -> Start | None:
    """The held-back start a submission asks (None: start now), or ``INVALID_REQUEST`` naming
    the field: both given, a naive or far-past ``start_at``, a negative ``delay``, either
    beyond :data:`MAX_HOLD`."""
    if start_at is None and delay is None:
        return None
    if start_at is not None and delay is not None:
        raise InvalidRequest("give start_at or delay, not both", path="start_at")
    if delay is not None:
        if not isinstance(delay, timedelta) or delay < timedelta(0) or delay > MAX_HOLD:
            raise InvalidRequest(f"delay must be a timedelta from 0 to {MAX_HOLD.days} days",
                                 path="delay")
        return Start(delay_seconds=delay.total_seconds())
    if not isinstance(start_at, datetime) or start_at.tzinfo is None \
            or start_at.utcoffset() is None:
        raise InvalidRequest("start_at must be a timezone-aware datetime", path="start_at")
    try:
        at = start_at.astimezone(UTC)
    except OverflowError:  # year 1 east of UTC, or 9999 west of it: no such time in UTC
        raise InvalidRequest(f"start_at must be a time within the next {MAX_HOLD.days} days",
                             path="start_at") from None
    if at < now - START_AT_TOLERANCE:
        raise InvalidRequest(
            f"start_at is {_ago(now - at)} in the past (at most "
            f"{int(START_AT_TOLERANCE.total_seconds() // 60)} minutes is taken as now)",
            path="start_at")
    if at > now + MAX_HOLD:
        raise InvalidRequest(f"start_at is more than {MAX_HOLD.days} days ahead",
                             path="start_at")
    return Start(at=at)


def _ago(span: timedelta) -> str:
    seconds = int(span.total_seconds())
    if seconds < 3600:
        return f"{seconds // 60} minutes"
    if seconds < 2 * 86400:
        return f"{seconds // 3600} hours"
    return f"{seconds // 86400} days"


MAX_LIMIT = 1_000_000
"""The largest concurrency or rate count a queue takes."""
MAX_WINDOW = timedelta(days=1)
"""The longest rate window."""

_UNITS = {"s": 1, "sec": 1, "second": 1, "seconds": 1, "m": 60, "min": 60, "minute": 60,
          "minutes": 60, "h": 3600, "hour": 3600, "hours": 3600, "d": 86400, "day": 86400,
          "days": 86400}
_RATE = re.compile(r"\s*(\d+)\s*/\s*(\d+(?:\.\d+)?)?\s*([a-z]+)\s*")


@dataclass(frozen=True)
class RateLimit:
    """At most ``limit`` starts (or dispatches) in any window of length ``per``."""

    limit: int
    per: timedelta = timedelta(seconds=1)

    def __post_init__(self) -> None:
        if type(self.limit) is not int or not 0 < self.limit <= MAX_LIMIT:
            raise InvalidRequest(f"rate limit must be an integer from 1 to {MAX_LIMIT}",
                                 path="rate")
        if not isinstance(self.per, timedelta) or not timedelta(0) < self.per <= MAX_WINDOW:
            raise InvalidRequest("rate per must be a positive timedelta of at most a day",
                                 path="rate")

    @classmethod
    def parse(cls, text: str) -> RateLimit:
        """``"100/s"``, ``"10/5s"``, ``"600/min"``, ``"1000/h"``, ``"5000/day"``."""
        match = _RATE.fullmatch(text.lower()) if isinstance(text, str) else None
        if match is None or match.group(3) not in _UNITS:
            raise InvalidRequest(
                f"rate {text!r} is not COUNT/UNIT: a count, '/', an optional number and a "
                "unit of s, min, h or day (e.g. 100/s, 10/5s, 600/min)", path="rate")
        seconds = float(match.group(2) or 1) * _UNITS[match.group(3)]
        if seconds <= 0:
            raise InvalidRequest(f"rate {text!r} has an empty window", path="rate")
        if seconds > MAX_WINDOW.total_seconds():  # before timedelta(), which may overflow
            raise InvalidRequest(f"rate {text!r} has a window longer than a day", path="rate")
        return cls(int(match.group(1)), timedelta(seconds=seconds))

    def __str__(self) -> str:
        seconds = self.per.total_seconds()
        return f"{self.limit}/s" if seconds == 1 else f"{self.limit}/{seconds:g}s"
