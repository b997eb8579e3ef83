"""Fault points (orchestrator.faults): gates armed in process, and the SIGKILL points armed by
the environment."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading

import pytest

from orchestrator import faults
from orchestrator.testing import fault_gate


async def one_turn() -> None:
    """One turn of the event loop: whatever was ready to run has run."""
    loop = asyncio.get_running_loop()
    turn: asyncio.Future[None] = loop.create_future()
    loop.call_soon(lambda: loop.call_soon(turn.set_result, None))
    await turn


def test_nothing_armed_reach_returns_none() -> None:
    assert faults._armed == {}
    assert all(faults.reach(point, "t") is None for point in faults.POINTS)


def test_an_unknown_point_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown fault point 'after_lunch'"):
        faults.arm("after_lunch")
    assert faults._armed == {}


async def test_a_blocking_gate_holds_the_engine_until_released() -> None:
    passed: list[str] = []

    async def engine_step(tool: str) -> None:
        if (held := faults.reach("after_submitted", tool)) is not None:
            await held
        passed.append(tool)

    with fault_gate("after_submitted", tool="charge") as gate:
        other = asyncio.ensure_future(engine_step("notify"))  # another tool: not held
        step = asyncio.ensure_future(engine_step("charge"))
        await gate.arrived(timeout=5)
        await asyncio.wait_for(other, 5)
        assert passed == ["notify"] and gate.hits == 1 and not step.done()
        gate.release()
        await asyncio.wait_for(step, 5)
        assert passed == ["notify", "charge"]
        await engine_step("charge")  # once released, nothing more is held; still counted
        assert gate.hits == 2 and gate.released
    assert faults._armed == {}


async def test_a_gate_that_does_not_block_only_counts() -> None:
    with fault_gate("after_receipt", block=False) as gate:
        assert faults.reach("after_receipt", "a") is None
        assert faults.reach("after_receipt", "b") is None
        await gate.arrived(timeout=1)
        assert gate.hits == 2


async def test_leaving_the_block_lets_a_held_step_go_on() -> None:
    with fault_gate("after_intent"):
        held = faults.reach("after_intent", "t")
        assert held is not None
        waiting = asyncio.ensure_future(held)  # type: ignore[arg-type]
        await one_turn()
        assert not waiting.done()
    await asyncio.wait_for(waiting, 5)  # disarmed: released
    assert faults.reach("after_intent", "t") is None


async def test_a_gate_not_reached_says_which_point() -> None:
    with fault_gate("after_tool_return", tool="charge") as gate:
        with pytest.raises(AssertionError, match="after_tool_return.*charge.*not reached"):
            await gate.arrived(timeout=0.05)


async def test_a_gate_released_from_another_thread_wakes_the_loop() -> None:
    """The sync API runs the engine on a background loop: its gates are released from the
    test's thread."""
    with fault_gate("after_submitted") as gate:
        held = faults.reach("after_submitted", "t")
        assert held is not None
        waiting = asyncio.ensure_future(held)  # type: ignore[arg-type]
        threading.Thread(target=gate.release).start()
        await asyncio.wait_for(waiting, 5)


def test_the_sync_arrival_wait() -> None:
    with fault_gate("after_receipt", block=False) as gate:
        threading.Thread(target=faults.reach, args=("after_receipt", "t")).start()
        gate.arrived_sync(timeout=5)
        with fault_gate("after_intent") as never:
            with pytest.raises(AssertionError, match="after_intent"):
                never.arrived_sync(timeout=0.01)


@pytest.mark.parametrize(("tool", "killed"), [(None, True), ("charge", True), ("other", False)])
def test_the_environment_arms_a_sigkill_point(tool: str | None, killed: bool) -> None:
    env = {**os.environ, "ORCHESTRATOR_FAULT_POINT": "after_submitted"}
    env.pop("ORCHESTRATOR_FAULT_TOOL", None)
    if tool is not None:
        env["ORCHESTRATOR_FAULT_TOOL"] = tool
    code = ("from orchestrator import faults\n"
            "faults.reach('after_intent', 'charge')\n"  # another point: nothing happens
            "faults.reach('after_submitted', 'charge')\n"
            "print('alive')\n")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          timeout=60)
    if killed:
        assert proc.returncode == -signal.SIGKILL and proc.stdout == b""
    else:
        assert proc.returncode == 0 and proc.stdout == b"alive\n"
