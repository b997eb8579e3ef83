"""Condition waiters (orchestrator.testing): the value, the deadline, and what the message
says when the deadline passes."""

from __future__ import annotations

import pytest

from orchestrator.testing import wait_until, wait_until_async


def test_wait_until_returns_the_true_value() -> None:
    seen: list[int] = []

    def grows() -> list[int] | None:
        seen.append(1)
        return seen if len(seen) >= 3 else None

    assert wait_until(grows, timeout=5) == [1, 1, 1]


def test_wait_until_names_what_it_waited_for() -> None:
    with pytest.raises(AssertionError) as info:
        wait_until(lambda: 0, timeout=0.05, what="the moon to turn blue")
    assert str(info.value) == "not met within 0.05 s: the moon to turn blue (last value: 0)"


def test_without_a_name_the_message_quotes_the_condition() -> None:
    ready = {"now": False}
    with pytest.raises(AssertionError, match=r'ready\["now"\].*last value: False'):
        wait_until(lambda: ready["now"], timeout=0.05)


async def test_wait_until_async_awaits_an_async_condition() -> None:
    calls: list[int] = []

    async def check() -> bool:
        calls.append(1)
        return len(calls) == 2

    assert await wait_until_async(check, timeout=5) is True
    with pytest.raises(AssertionError, match="never, said the condition"):
        await wait_until_async(check, timeout=0.05, what="never, said the condition")


def test_wait_until_refuses_an_async_condition() -> None:
    """The sync helper cannot await: an async condition's coroutine is not a true value to
    return at once (it would pass without ever checking anything)."""
    checked: list[int] = []

    async def check() -> bool:
        checked.append(1)
        return False

    with pytest.raises(TypeError, match="wait_until_async"):
        wait_until(check, timeout=0.05)
    assert checked == []
