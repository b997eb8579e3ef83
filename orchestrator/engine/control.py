"""The engine's control-flow vocabulary: why a run stops here (:class:`Stop`), why a branch
waits for the database (:class:`Wait`), how a raced step ended (:class:`Verdict`), and where
an executor is in its life (:class:`Phase`). Pure: no I/O."""

from __future__ import annotations

import enum
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from orchestrator.context import ContinueAsNew
from orchestrator.errors import ConfigurationError, DatabaseError, InvalidRequest
from orchestrator.flow import MAX_DEADLINE
from orchestrator.journal import Nondeterminism


class Stop(BaseException):  # noqa: N818 - a control-flow signal, not an error
    """Unwinds workflow code when the run must stop here (BaseException: not caught by
    ``except Exception`` in user code)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason  # cancelled | deadline | abandoned | lease_lost | drain | let_go
        self.detail = detail


@dataclass
class Verdict:
    """How an awaited step ended when raced against cancellation and a time budget."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    cancelled: bool = False


@dataclass
class Wait:
    """Why a branch of the workflow cannot proceed without the database's help."""

    kind: str  # timer | event | child | blocked | turn (a tool's limits, docs/flow.md)
    position: int
    wake_at: datetime | None = None
    name: str | None = None
    operation_id: int | None = None


class Phase(enum.Enum):
    """Where an executor is in its life; it only moves forward (``RunState.enter``).

    The lease is a separate fact (``RunState.lost``): the fence can reject a write in any
    phase."""

    RUNNING = 0  # the workflow runs; new steps are taken
    DRAINING = 1  # the worker stops: the run goes on until its next new step
    DRAIN_STOPPED = 2  # a branch stopped at a new step for the drain; the rest is let go
    ENDING = 3  # the workflow finished: its outcome is being written
    PARKING = 4  # every branch waits on the database: the run is being parked
    GONE = 5  # nothing of this run runs in this process any more


def as_seconds(value: timedelta | float | None, path: str) -> float | None:
    """A duration given as a timedelta or a number of seconds (an int or a float, not a bool
    nor a string of digits), checked: from 0 to :data:`~orchestrator.flow.MAX_DEADLINE`, so
    that the time it ends at is one a timer's entry and the database can hold (anything else
    is ``INVALID_REQUEST`` with ``path``, the argument's name, never a ``ValueError`` or an
    ``OverflowError`` from the arithmetic)."""
    if value is None:
        return None
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, int | float) and not isinstance(value, bool):
        try:
            seconds = float(value)
        except OverflowError:  # an int too large for a float
            seconds = float("inf")
    else:
        seconds = float("nan")
    if not 0 <= seconds <= MAX_DEADLINE.total_seconds():
        raise InvalidRequest(f"{path} must be a timedelta or a number of seconds from 0 to "
                             f"{MAX_DEADLINE.days} days, got {value!r}", path=path)
    return seconds


def engine_error_in(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """What decides the end of a run whose workflow's task group collected ``group``, when the
    engine raised it: a :class:`Stop` (a lost lease first: nothing more can be written), else
    a :class:`DatabaseError` (never an outcome), else :class:`Nondeterminism`, else a
    continuation (``ctx.continue_as_new``). None when the group holds only the workflow's own
    errors (the run fails with the group)."""
    ranked = [(rank, exc) for exc in _leaves(group) if (rank := _engine_rank(exc)) is not None]
    return min(ranked, key=lambda pair: pair[0])[1] if ranked else None  # the first of the best


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    """The exceptions of ``group`` and of the groups nested in it, in order."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


def _engine_rank(exc: BaseException) -> int | None:
    """Which engine error decides first (lower first); None for the workflow's own."""
    if isinstance(exc, Stop):
        return 0 if exc.reason == "lease_lost" else 1
    if isinstance(exc, DatabaseError | ConfigurationError):
        return 2
    if isinstance(exc, Nondeterminism):
        return 3
    if isinstance(exc, ContinueAsNew):  # ctx.continue_as_new in a branch of the group
        return 4
    return None
