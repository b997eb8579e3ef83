"""Schedules: what a cron expression in a time zone means, as instants (docs/schedules.md).

A schedule's *slots* are instants. A cron expression names wall-clock times in the schedule's
time zone; :class:`Cron` turns them into instants, daylight-saving changes included, by the
rule classic cron follows for its jobs:

- A wall time that does not exist (the clocks jump forward over it): a *fixed-hour* expression
  (its hour field is not ``*``) fires at the first instant after the jump (``30 2 * * *`` in
  Europe/Berlin on the last Sunday of March fires at 03:00 CEST); an expression whose hour
  field is ``*`` has no slot in the gap (it fires every hour anyway).
- A wall time that happens twice (the clocks go back): a fixed-hour expression fires once, at
  the first occurrence; an expression whose hour field is ``*`` fires at both (an
  every-five-minutes schedule does not stop for the repeated hour).
- Two wall times that land on one instant are one slot.

Expressions have five fields (minute hour day-of-month month day-of-week) or six, the first
being seconds (``*/10 * * * * *``: every ten seconds); ``@hourly``, ``@daily`` and the other
``@`` names are accepted. Parsing is ``croniter``'s; time zones are IANA names read by
``zoneinfo``.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any
from zoneinfo import ZoneInfo, ZoneInfoNotFoundError

from croniter import croniter
from croniter.croniter import CroniterError

from orchestrator.errors import InvalidRequest

OVERLAP_POLICIES = ("skip", "buffer_one", "buffer_all", "cancel_other", "allow_all")
"""What a slot does while the schedule's previous run has not finished: ``skip`` it (the
default), keep it until that run ends (``buffer_one``: at most one kept, later ones skipped;
``buffer_all``: every one, fired in order), cancel that run and fire (``cancel_other``), or fire
anyway (``allow_all``)."""

DEFAULT_CATCHUP = timedelta(hours=1)
"""How late a slot may still fire (after the fleet was down): older ones are recorded as missed."""

MIN_CATCHUP = timedelta(seconds=10)
"""The least catch-up window: a slot is handled a moment after its time (the ticker runs about
every second), so a shorter window would miss slots on a healthy fleet."""

MAX_CATCHUP = timedelta(days=366)

SCHEDULE_ID_MAX = 64
"""A schedule id's length: its runs' idempotency keys (``schedule:{id}:{slot}``) stay within
the key rules."""

_MARGIN = timedelta(hours=3)  # wider than any daylight-saving change


_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_RANDOM = re.compile(r"r(\(\d+-\d+\))?(/\d+)?", re.IGNORECASE)
"""A field croniter fills with a random value (``R``, ``R(0-29)``, ``R/15``), drawn again by
every reading of the expression: each tick and each worker would see other slots."""


def check_schedule_id(value: Any) -> str:
    """A schedule id: 1 to :data:`SCHEDULE_ID_MAX` ASCII letters, digits, ``.``, ``_``, ``-``,
    starting with a letter or a digit (it becomes part of its runs' submission keys)."""
    if not isinstance(value, str) or not 0 < len(value) <= SCHEDULE_ID_MAX \
            or _ID.fullmatch(value) is None:
        raise InvalidRequest(
            f"a schedule id is 1 to {SCHEDULE_ID_MAX} ASCII letters, digits, '.', '_' or '-', "
            "starting with a letter or a digit", path="id")
    return value


def check_overlap(value: Any, path: str = "overlap") -> str:
    if value not in OVERLAP_POLICIES:
        raise InvalidRequest(f"{path} must be one of {', '.join(OVERLAP_POLICIES)}", path=path)
    return str(value)


def check_catchup(value: Any) -> timedelta:
    if not isinstance(value, timedelta) or not MIN_CATCHUP <= value <= MAX_CATCHUP:
        raise InvalidRequest(
            f"catchup_window must be a timedelta from {MIN_CATCHUP.total_seconds():.0f} "
            f"seconds to {MAX_CATCHUP.days} days", path="catchup_window")
    return value


def slot_key(schedule_id: str, slot: datetime) -> str:
    """The idempotency key of the run a slot fires: one run per slot, whoever fires it."""
    return f"schedule:{schedule_id}:{slot.astimezone(UTC):%Y%m%dT%H%M%S}Z"


@dataclass(frozen=True)
class Cron:
    """A cron expression in a time zone; raises ``INVALID_REQUEST`` when either is invalid."""

    expression: str
    timezone: str = "UTC"
    zone: ZoneInfo = field(init=False, repr=False, compare=False)
    seconds: bool = field(init=False, repr=False, compare=False)
    every_hour: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        expression = self.expression
        if not isinstance(expression, str) or not expression.strip() or len(expression) > 200:
            raise InvalidRequest("cron must be a cron expression", path="cron")
        if not isinstance(self.timezone, str) or not self.timezone or len(self.timezone) > 64:
            raise InvalidRequest("timezone must be an IANA time zone name", path="timezone")
        try:
            zone = ZoneInfo(self.timezone)
        except (ZoneInfoNotFoundError, ValueError, OSError) as exc:  # OSError: a region ("Europe")
            raise InvalidRequest(f"timezone {self.timezone!r} is not a known IANA time zone",
                                 path="timezone") from exc
        seconds = len(expression.split()) == 6
        try:
            if not croniter.is_valid(expression, second_at_beginning=seconds) or len(
                    expression.split()) not in (1, 5, 6):
                raise ValueError(expression)
            fields, _ = croniter.expand(expression, second_at_beginning=seconds)
        except (CroniterError, ValueError, TypeError, KeyError) as exc:
            raise InvalidRequest(
                f"cron {expression!r} is not a valid expression (five fields, or six with "
                "seconds first)", path="cron") from exc
        if any(_RANDOM.fullmatch(part) for part in expression.split()):
            raise InvalidRequest(
                f"cron {expression!r} asks for a random value (R), which every worker and "
                "every tick would draw again: write the value", path="cron")
        object.__setattr__(self, "zone", zone)
        object.__setattr__(self, "seconds", seconds)
        object.__setattr__(self, "every_hour", fields[1] == ["*"])

    # -- instants ----------------------------------------------------------------------------

    def between(self, after: datetime, until: datetime, limit: int = 10_000) -> list[datetime]:
        """The slots in ``(after, until]``, oldest first, at most ``limit`` (UTC instants)."""
        found: set[datetime] = set()
        end = self._local(until) + _MARGIN
        for naive in self._walk(after):
            if naive > end:
                break
            for instant in self._instants(naive):
                if after < instant <= until:
                    found.add(instant)
            if len(found) >= limit and self._settled(naive):
                break
        return sorted(found)[:limit]

    def after(self, when: datetime) -> datetime | None:
        """The first slot after ``when``; None if the expression never fires again within
        ten years (``0 0 30 2 *``)."""
        for horizon in (timedelta(days=2), timedelta(days=400), timedelta(days=3660)):
            slots = self.between(when, when + horizon, limit=1)
            if slots:
                return slots[0]
        return None

    def before(self, when: datetime) -> datetime | None:
        """The last slot before ``when``; None if there is none in the ten years before."""
        start = self._local(when)
        if not self._settled(start):
            start += _MARGIN
        oldest = start - timedelta(days=3660)
        it = croniter(self.expression, start, second_at_beginning=self.seconds)
        found: list[datetime] = []
        while True:
            try:
                naive = it.get_prev(datetime)
            except CroniterError:
                break
            if naive < oldest:
                break
            found.extend(instant for instant in self._instants(naive) if instant < when)
            if found and self._settled(naive):
                break
        return max(found) if found else None

    def _walk(self, after: datetime) -> Iterator[datetime]:
        """Naive local wall times the expression names, from about ``after`` on; from a few
        hours earlier when a daylight-saving change is near (its slots may map out of order)."""
        start = self._local(after)
        if not self._settled(start):
            start -= _MARGIN
        it = croniter(self.expression, start, second_at_beginning=self.seconds)
        while True:
            try:
                yield it.get_next(datetime)
            except CroniterError:  # no later date (``0 0 30 2 *``)
                return

    def _settled(self, naive: datetime) -> bool:
        """No daylight-saving change within a few hours of this wall time."""
        before = (naive - _MARGIN).replace(tzinfo=self.zone).utcoffset()
        later = (naive + _MARGIN).replace(tzinfo=self.zone).utcoffset()
        return before == later

    def _local(self, instant: datetime) -> datetime:
        return instant.astimezone(self.zone).replace(tzinfo=None)

    def _instants(self, naive: datetime) -> list[datetime]:
        """The instants a wall time names, by the rule in the module docstring."""
        first = naive.replace(tzinfo=self.zone, fold=0).astimezone(UTC)
        second = naive.replace(tzinfo=self.zone, fold=1).astimezone(UTC)
        if first == second:
            return [first]
        if self._local(first) != naive:  # in a gap: this wall time never happens
            return [] if self.every_hour else [self._jump(second, first)]
        return [first, second] if self.every_hour else [first]

    def _jump(self, early: datetime, late: datetime) -> datetime:
        """The instant the clocks jumped, between two instants on either side of it."""
        offset = late.astimezone(self.zone).utcoffset()
        while late - early > timedelta(seconds=1):
            mid = early + (late - early) / 2
            if mid.astimezone(self.zone).utcoffset() == offset:
                late = mid
            else:
                early = mid
        return late.replace(microsecond=0)


def utc(when: datetime, name: str) -> datetime:
    """An aware time as UTC; INVALID_REQUEST naming ``name`` (the argument that gave it) for
    a naive one."""
    if not isinstance(when, datetime) or when.tzinfo is None or when.utcoffset() is None:
        raise InvalidRequest(f"{name} must be a timezone-aware datetime", path=name)
    return when.astimezone(UTC)
