"""CONTRACT C4: workflows are replayed, effects are not; a replay that goes another way stops
the run with ``NONDETERMINISM``."""

from __future__ import annotations

import pytest

from orchestrator import RunFailed
from tests.integration.conftest import running


async def test_caught_nondeterminism_still_stops_the_run(app, sql):
    calls: list[str] = []
    flip = {"changed": False}

    @app.tool()
    async def a(ctx):  # type: ignore[no-untyped-def]
        calls.append("a")

    @app.tool()
    async def b(ctx):  # type: ignore[no-untyped-def]
        calls.append("b")

    @app.tool()
    async def c(ctx):  # type: ignore[no-untyped-def]
        calls.append("c")

    @app.workflow()
    async def drifting(ctx, data):  # type: ignore[no-untyped-def]
        try:
            await ctx.call(b if flip["changed"] else a)
        except Exception:  # noqa: BLE001 - ordinary defensive code must not swallow it
            pass
        flip["changed"] = True
        await ctx.sleep(1.2)
        await ctx.call(c)

    async with running(app):
        run = await app.submit_async(drifting, {})
        with pytest.raises(RunFailed) as info:
            await run.result_async(timeout=20)
    assert info.value.code == "NONDETERMINISM" and calls == ["a"]
