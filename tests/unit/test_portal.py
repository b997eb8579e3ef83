"""The private loop behind the sync methods (:mod:`orchestrator._portal`): a sync call waits in
its caller's thread for a coroutine on the private loop, is refused on a worker's loop, and does not
leave its coroutine running when the wait is interrupted."""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
import time
from collections.abc import Iterator

import pytest

from orchestrator._portal import Portal, serving
from orchestrator.errors import InvalidRequest


@pytest.fixture
def portal() -> Iterator[Portal]:
    made = Portal()
    yield made
    made.close()


def test_a_call_returns_what_its_coroutine_returns(portal: Portal) -> None:
    async def answer() -> int:
        return 42

    assert portal.call(answer()) == 42


async def test_a_call_on_a_workers_loop_is_refused_and_its_coroutine_closed(
        portal: Portal) -> None:
    async def answer() -> int:
        return 42

    assert portal.call(answer()) == 42  # async code of one's own (a notebook): it waits
    with serving():  # a worker or a reconciler runs on this loop now
        with pytest.raises(InvalidRequest, match=r"await .*answer\(\) instead") as refused:
            portal.call(answer())  # closed, so no "never awaited" warning (an error here)
        assert refused.value.code == "INVALID_REQUEST"
        with serving():  # two of them, one stops
            pass
        with pytest.raises(InvalidRequest, match=r"await RunHandle\.result_async\(\) instead"):
            portal.call(answer(), instead="await RunHandle.result_async()")
    assert portal.call(answer()) == 42


def test_an_interrupted_call_cancels_its_coroutine(portal: Portal) -> None:
    """Ctrl-C during ``run.result()`` (a script, a notebook cell) stops the wait in the
    caller's thread; the coroutine on the private loop must stop with it, not go on polling
    unseen for the life of the process."""
    started, stopped = threading.Event(), threading.Event()

    async def forever() -> None:
        started.set()
        try:
            await asyncio.Event().wait()
        finally:
            stopped.set()

    main = threading.get_ident()

    def waiting() -> bool:
        """The caller's thread is blocked in the future's ``result()``, inside the call."""
        frame = sys._current_frames().get(main)
        while frame is not None:
            if frame.f_code.co_name == "result" and "concurrent" in frame.f_code.co_filename:
                return True
            frame = frame.f_back
        return False

    def interrupt() -> None:
        give_up = time.monotonic() + 10
        while not (started.is_set() and waiting()) and time.monotonic() < give_up:
            time.sleep(0.001)
        signal.pthread_kill(main, signal.SIGUSR1)

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGUSR1, on_signal)
    helper = threading.Thread(target=interrupt)
    helper.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            portal.call(forever())
    finally:
        helper.join()
        signal.signal(signal.SIGUSR1, previous)
    assert stopped.wait(10), "the coroutine goes on running on the private loop"
