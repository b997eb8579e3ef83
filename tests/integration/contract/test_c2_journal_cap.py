"""CONTRACT C2: a run's journal has a cap, and new work leaves room in it for the outcomes of
work already accepted."""

from __future__ import annotations

import pytest

from orchestrator import RunFailed
from tests.integration.conftest import running
from tests.integration.contract.helpers import operations


async def test_new_work_keeps_room_in_the_journal_for_receipts(make_app, sql):
    app = make_app(max_journal_events=5)

    @app.tool()
    async def step(ctx):  # type: ignore[no-untyped-def]
        return 1

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        for _ in range(5):
            await ctx.call(step)

    async with running(app):
        run = await app.submit_async(wf, {})
        with pytest.raises(RunFailed):
            await run.result_async(timeout=15)
    assert all(o["state"] == "committed" for o in operations(sql))
