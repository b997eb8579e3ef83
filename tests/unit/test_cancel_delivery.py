"""How a cancellation held during a write is delivered once the write is accounted for
(``engine.session._Delivering``): after a write that landed, instead of the error of one that did
not, never instead of a stop of the run, and not at all when the caller takes it itself."""

from __future__ import annotations

import asyncio
from typing import Any, cast

import pytest

from orchestrator.engine.control import Stop
from orchestrator.engine.session import Session, _Delivering


class Held:
    """Stands in for the session: only the held-cancellation flag is read."""

    def __init__(self, held: bool) -> None:
        self.held = held
        self.taken = 0

    def take_held_cancel(self) -> bool:
        self.taken += 1
        held, self.held = self.held, False
        return held


def delivering(ex: Held, *, hold: bool = False) -> _Delivering:
    return _Delivering(cast(Session, ex), hold)


def test_a_landed_write_delivers_a_held_cancellation_after_its_bookkeeping() -> None:
    ex = Held(held=True)
    done = []
    with pytest.raises(asyncio.CancelledError), delivering(ex):
        done.append("bookkeeping")
    assert done == ["bookkeeping"] and not ex.held


def test_nothing_held_nothing_raised() -> None:
    ex = Held(held=False)
    with delivering(ex):
        pass
    assert ex.taken == 1


def test_with_hold_the_caller_takes_it() -> None:
    ex = Held(held=True)
    with delivering(ex, hold=True):
        pass
    assert ex.held and ex.taken == 0  # still there for take_held_cancel()


def test_a_failed_write_gives_the_cancellation_instead_of_its_error() -> None:
    ex = Held(held=True)
    error = RuntimeError("write failed")
    with pytest.raises(asyncio.CancelledError) as raised, delivering(ex):
        raise error
    assert raised.value.__cause__ is error


def test_without_a_held_cancellation_the_error_stays() -> None:
    ex = Held(held=False)
    with pytest.raises(RuntimeError, match="write failed"), delivering(ex, hold=True):
        raise RuntimeError("write failed")


@pytest.mark.parametrize("hold", [False, True])
def test_a_stop_of_the_run_wins_and_the_held_cancellation_is_dropped(hold: bool) -> None:
    ex = Held(held=True)
    stop: Any = Stop("lease_lost")
    with pytest.raises(Stop) as raised, delivering(ex, hold=hold):
        raise stop
    assert raised.value is stop and not ex.held
