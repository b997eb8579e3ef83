"""``RunState.race_cancellation``: a tool's call raced against the run's cancellation and a time
budget, driven in the calling task (``engine.run._drive``) as a task of its own would run it.
What the callee sees (its result, its errors, a cancellation at the await it is suspended at,
a context of its own) and what the caller gets (a verdict, or a cancellation of its own that
goes on) must be what a separate task gave."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import weakref
from typing import Any

import pytest

from orchestrator.engine.control import Verdict
from orchestrator.engine.run import RunState

marker: contextvars.ContextVar[str] = contextvars.ContextVar("marker", default="unset")


def run_state() -> RunState:
    """Only what the race reads: the loop, the cancellation flag and its waiters."""
    state = RunState.__new__(RunState)
    state.loop = asyncio.get_running_loop()
    state.cancel_requested = False
    state._cancel_waiters = set()
    return state


async def race(state: RunState, coro: Any, timeout: float | None = 5.0,
               signal: asyncio.Event | None = None) -> Verdict:
    return await state.race_cancellation(coro, timeout, signal or asyncio.Event())


def test_a_value_returned_at_once_or_after_waiting() -> None:
    async def at_once() -> dict[str, int]:
        return {"ok": 1}

    async def after_waiting() -> int:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        loop.call_later(0.01, future.set_result, 7)
        await asyncio.sleep(0)  # a bare yield too
        return await future + 1

    async def main() -> None:
        state = run_state()
        task = asyncio.current_task()
        assert task is not None
        assert (await race(state, at_once())).value == {"ok": 1}
        assert (await race(state, after_waiting())).value == 8
        assert task.cancelling() == 0 and not state._cancel_waiters

    asyncio.run(main())


def test_the_callee_keeps_its_context_variables_to_itself() -> None:
    async def tool() -> str:
        seen = marker.get()
        marker.set("tool")
        await asyncio.sleep(0.001)
        assert marker.get() == "tool"
        return seen

    async def main() -> None:
        marker.set("workflow")
        verdict = await race(run_state(), tool())
        assert verdict.value == "workflow"  # it sees the caller's context
        assert marker.get() == "workflow"  # and what it set stays its own

    asyncio.run(main())


def test_an_exception_from_the_callee_or_from_a_future_it_awaits() -> None:
    async def raises() -> None:
        await asyncio.sleep(0.001)
        raise ValueError("boom")

    async def handles_a_failed_future() -> str:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        loop.call_soon(future.set_exception, KeyError("k"))
        try:
            await future
        except KeyError:
            return "handled"
        return "not reached"

    async def main() -> None:
        state = run_state()
        verdict = await race(state, raises())
        assert isinstance(verdict.error, ValueError) and not verdict.timed_out
        assert (await race(state, handles_a_failed_future())).value == "handled"

    asyncio.run(main())


def test_a_callee_that_cancels_itself_is_an_error_not_a_cancellation_of_the_caller() -> None:
    async def cancels_itself() -> None:
        await asyncio.sleep(0)
        raise asyncio.CancelledError

    async def main() -> None:
        verdict = await race(run_state(), cancels_itself())
        assert isinstance(verdict.error, asyncio.CancelledError)
        assert str(verdict.error) == "the call cancelled itself"
        assert not verdict.cancelled and not verdict.timed_out
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        await asyncio.sleep(0)  # and no cancellation is left pending for the caller

    asyncio.run(main())


def test_a_timeout_cancels_the_callee_where_it_waits_and_sets_its_signal() -> None:
    seen: list[str] = []

    async def hangs(signal: asyncio.Event) -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            seen.append(f"cancelled, signal set: {signal.is_set()}")
            raise

    async def main() -> None:
        state = run_state()
        signal = asyncio.Event()
        verdict = await race(state, hangs(signal), timeout=0.01, signal=signal)
        assert verdict.timed_out and not verdict.cancelled and verdict.error is None
        assert seen == ["cancelled, signal set: True"]
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0  # ours was taken back
        await asyncio.sleep(0.001)  # nothing pending for the caller
        assert not state._cancel_waiters

    asyncio.run(main())


def test_a_callee_that_swallows_the_timeout_and_returns_still_timed_out() -> None:
    async def stubborn() -> str:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            await asyncio.sleep(0.001)  # and it goes on waiting a while
        return "too late"

    async def main() -> None:
        verdict = await race(run_state(), stubborn(), timeout=0.01)
        assert verdict.timed_out and verdict.value is None

    asyncio.run(main())


def test_the_runs_cancellation_during_the_call() -> None:
    async def hangs() -> None:
        await asyncio.sleep(60)

    async def main() -> None:
        state = run_state()
        asyncio.get_running_loop().call_later(0.01, state.note_cancel)
        verdict = await race(state, hangs())
        assert verdict.cancelled and not verdict.timed_out

    asyncio.run(main())


def test_a_cancellation_requested_before_the_call_never_starts_the_callee() -> None:
    started: list[bool] = []

    async def tool() -> None:
        started.append(True)

    async def main() -> None:
        state = run_state()
        state.cancel_requested = True
        signal = asyncio.Event()
        verdict = await race(state, tool(), signal=signal)
        assert verdict.cancelled and signal.is_set() and started == []

    asyncio.run(main())


def test_the_callers_own_cancellation_goes_on_after_the_callee_unwound() -> None:
    seen: list[str] = []

    async def hangs() -> None:
        try:
            await asyncio.sleep(60)
        finally:
            seen.append("unwound")

    async def swallows() -> str:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            pass
        return "value"

    async def main() -> None:
        state = run_state()
        for callee in (hangs, swallows):
            signal = asyncio.Event()
            # workflow code's own timeout around the call
            with pytest.raises(TimeoutError):
                async with asyncio.timeout(0.01):
                    await race(state, callee(), signal=signal)
            assert signal.is_set()
            task = asyncio.current_task()
            assert task is not None and task.cancelling() == 0
        assert seen == ["unwound"]
        assert not state._cancel_waiters

    asyncio.run(main())


def test_a_timeout_inside_the_callee_is_its_own_error() -> None:
    async def own_timeout() -> None:
        async with asyncio.timeout(0.01):
            await asyncio.sleep(60)

    async def main() -> None:
        verdict = await race(run_state(), own_timeout())
        assert isinstance(verdict.error, TimeoutError) and not verdict.timed_out
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0

    asyncio.run(main())


def test_an_awaitable_that_is_not_a_coroutine_is_raced_as_a_future() -> None:
    async def main() -> None:
        state = run_state()
        loop = asyncio.get_running_loop()
        done: asyncio.Future[int] = loop.create_future()
        loop.call_later(0.001, done.set_result, 3)
        assert (await race(state, done)).value == 3
        never: asyncio.Future[int] = loop.create_future()
        assert (await race(state, never, timeout=0.01)).timed_out
        assert never.cancelled()

    asyncio.run(main())


def test_a_failed_call_leaves_no_cycle_that_holds_the_run() -> None:
    """The callee's exception holds the race's frames in its traceback: they must not hold the
    exception back (the run and its task would be kept until the cycle collector runs)."""
    async def raises() -> None:
        await asyncio.sleep(0)
        raise ValueError("declined")

    async def rethrows_a_failed_future() -> None:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()
        loop.call_soon(future.set_exception, ConnectionError("dropped"))
        await future

    async def main() -> None:
        for callee in (raises, rethrows_a_failed_future):
            state = run_state()
            kept = weakref.ref(state)
            verdict = await race(state, callee())
            failed = verdict.error is not None  # not in an assert: its temporaries would hold it
            del state, verdict
            assert failed
            assert kept() is None, f"{callee.__name__}: the run is held by a reference cycle"

    gc.collect()
    gc.disable()
    try:
        asyncio.run(main())
    finally:
        gc.enable()
