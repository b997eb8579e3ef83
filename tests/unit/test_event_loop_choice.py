"""Which event loop a worker or reconciler process runs on (orchestrator/serving.py)."""

from __future__ import annotations

import asyncio
import signal
import sys

import pytest

from orchestrator.errors import ConfigurationError
from orchestrator.serving import ENV_EVENT_LOOP, event_loop_choice, new_event_loop, run_bounded

uvloop = pytest.importorskip("uvloop")


def test_auto_is_uvloop_where_installed_and_the_argument_wins_over_the_environment(
        monkeypatch):
    monkeypatch.delenv(ENV_EVENT_LOOP, raising=False)
    assert event_loop_choice(None) == "uvloop"
    assert event_loop_choice("auto") == "uvloop"
    monkeypatch.setenv(ENV_EVENT_LOOP, "asyncio")
    assert event_loop_choice(None) == "asyncio"
    assert event_loop_choice("uvloop") == "uvloop"
    monkeypatch.setenv(ENV_EVENT_LOOP, "")  # set but empty: as if unset
    assert event_loop_choice(None) == "uvloop"


def test_without_uvloop_auto_is_asyncio_and_asking_for_it_says_what_to_do(monkeypatch):
    monkeypatch.delenv(ENV_EVENT_LOOP, raising=False)
    monkeypatch.setitem(sys.modules, "uvloop", None)  # an import of it fails
    assert event_loop_choice("auto") == "asyncio"
    with pytest.raises(ConfigurationError, match="event_loop is uvloop, which is not "
                       "installed here: pip install uvloop"):
        event_loop_choice("uvloop")
    monkeypatch.setenv(ENV_EVENT_LOOP, "uvloop")
    with pytest.raises(ConfigurationError, match=f"ERROR: {ENV_EVENT_LOOP} is uvloop"):
        event_loop_choice(None)


@pytest.mark.parametrize("bad", ["fast", "UVLOOP", " asyncio"])
def test_a_choice_that_is_not_one_is_refused(bad):
    with pytest.raises(ConfigurationError, match="event_loop must be one of auto, uvloop, "
                       "asyncio, not"):
        event_loop_choice(bad)


@pytest.mark.parametrize("choice, kind", [("uvloop", "uvloop.Loop"),
                                          ("asyncio", "asyncio.unix_events")])
def test_the_loop_runs_on_the_kind_chosen(choice, kind):
    seen: list[str] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        seen.append(f"{type(loop).__module__}.{type(loop).__name__}")

    run_bounded(main(), event_loop=choice)
    assert seen[0].startswith(kind), seen
    new_event_loop(choice).close()


class _Service:
    """A worker's part that run_until_stopped needs: it stops at once."""

    async def run(self) -> None:
        await asyncio.sleep(0)

    def request_stop(self) -> None:
        pass


class _Database:
    async def close(self) -> None:
        pass


@pytest.mark.parametrize("choice", ["uvloop", "asyncio"])
def test_the_signals_are_the_processs_own_again_once_the_worker_stopped(choice):
    """uvloop's close() leaves a closed loop's handlers in place: a program that ran a worker
    and goes on could not be interrupted any more (nor a CLI's exit after the drain)."""
    from typing import Any

    from orchestrator.serving import run_until_stopped

    before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    database: Any = _Database()
    run_until_stopped(lambda: _Service(), database=database,  # type: ignore[arg-type,return-value]
                      event_loop=choice)
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
