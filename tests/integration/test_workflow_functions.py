"""Calling a workflow's function: an exception raised by the call itself, before there is a
coroutine to run (a wrapper that checks its input, a signature the worker's call does not
bind), fails the run as one raised inside the workflow does, and the replay check reads it
as that run's end."""

from __future__ import annotations

import functools
from collections.abc import Awaitable, Callable
from typing import Any

import pytest

from orchestrator import RunFailed
from orchestrator.testing import replay_async
from tests.integration.conftest import running


def checked(fn: Callable[[Any, Any], Awaitable[Any]]) -> Callable[[Any, Any], Awaitable[Any]]:
    """A plain decorator around an async workflow that refuses some inputs before the
    coroutine exists."""

    @functools.wraps(fn)
    def wrapper(ctx: Any, data: Any) -> Awaitable[Any]:
        if not isinstance(data, dict):
            raise ValueError("the input must be an object")
        return fn(ctx, data)

    return wrapper


async def test_a_workflow_function_that_raises_when_called_fails_its_run(app, sql):
    @app.workflow()
    @checked
    async def strict(ctx, data):  # type: ignore[no-untyped-def]
        return data

    async with running(app):
        good = await app.submit_async(strict, {"ok": True})
        bad = await app.submit_async(strict, 5)
        assert await good.result_async(timeout=10) == {"ok": True}
        with pytest.raises(RunFailed) as failed:
            await bad.result_async(timeout=10)
    assert failed.value.code == "WORKFLOW_FAILED"
    assert failed.value.message == "the workflow raised an exception; see the incident for details"
    rows = sql("SELECT status, outcome_code FROM orchestrator.runs "
               "WHERE id = %s", (bad.id,))
    assert [(r["status"], r["outcome_code"]) for r in rows] == [("failed", "WORKFLOW_FAILED")]
    verdicts = await replay_async(app, [good, bad])
    assert [(v.verdict, v.message) for v in verdicts] == [("ok", "the code ran to its end")] * 2
