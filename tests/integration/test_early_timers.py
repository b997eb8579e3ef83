"""A loop that fires its timers early (uvloop rounds them to the millisecond; the run's clock is
the wall clock, not the loop's) never lets a branch go on before its time: after a sleep,
parked in memory or slept in memory, ``ctx.now()`` is never earlier than the sleep's end, and
the run is not parked again for what is left."""

from __future__ import annotations

import asyncio
from datetime import datetime
from typing import Any

from tests.integration.conftest import long_until_marked, running

EARLY = 0.02  # seconds each timer of the loop below fires before its time


class EarlyLoop(asyncio.SelectorEventLoop):
    """asyncio's loop, its timers firing ``EARLY`` seconds early."""

    def call_at(self, when: float, callback: Any, *args: Any,
                context: Any = None) -> asyncio.TimerHandle:
        return super().call_at(when - EARLY, callback, *args, context=context)


def test_a_branch_never_goes_on_before_its_sleep_ends(app):
    long, mark = long_until_marked(app)  # one branch's call in flight while the other sleeps

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        seen = []

        async def later():  # type: ignore[no-untyped-def]
            await ctx.sleep(1.2)  # longer than an in-memory sleep: the branch parks
            seen.append(ctx.now().isoformat())
            await ctx.sleep(0.3)  # slept in memory
            seen.append(ctx.now().isoformat())
            return await ctx.call(mark)

        await ctx.gather(ctx.call(long), later())
        return seen

    async def main() -> tuple[list[str], list[str], int]:
        async with running(app) as worker:
            run = await app.submit_async(wf, {})
            seen = await run.result_async(timeout=15)
            until = [e.payload["until"] for e in await run.journal_async() if e.kind == "timer"]
        return seen, until, worker.claimed

    loop = EarlyLoop()
    try:
        seen, until, claimed = loop.run_until_complete(main())
    finally:
        loop.close()
    assert len(seen) == len(until) == 2
    for now, end in zip(seen, until, strict=True):
        assert datetime.fromisoformat(now) >= datetime.fromisoformat(end), (now, end)
    assert claimed == 1  # woken in memory, not parked again for what was left
