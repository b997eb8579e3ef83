"""Tool limits: a tool's calls in flight and dispatches per window across every worker, the
turn a call waits for parked, and a provider's back-off shared by every run (docs/flow.md)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import pytest

from orchestrator import InvalidRequest, Orchestrator, RateLimit, RunFailed, ToolError
from orchestrator.engine import site
from orchestrator.testing import running_worker
from tests.integration.conftest import running, wait_for


class Provider:
    """What the tool's provider saw: calls in flight, the most at once, when each came."""

    def __init__(self) -> None:
        self.live = 0
        self.peak = 0
        self.at: list[float] = []
        self.gate: asyncio.Event | None = None

    async def serve(self, hold: float) -> None:
        self.live += 1
        self.peak = max(self.peak, self.live)
        self.at.append(time.monotonic())
        try:
            if self.gate is not None:
                await self.gate.wait()
            else:
                await asyncio.sleep(hold)
        finally:
            self.live -= 1

    def busiest(self, window: float = 1.0) -> int:
        """The most calls that began within any ``window`` seconds."""
        at = sorted(self.at)
        return max((sum(1 for t in at[i:] if t < first + window) for i, first in enumerate(at)),
                   default=0)


def _app(make_app: Callable[..., Orchestrator], provider: Provider, *, hold: float = 0.05,
         **limits: Any) -> Orchestrator:
    app = make_app()

    @app.tool(effect="idempotent", **limits)
    async def api(ctx, n: int) -> dict[str, int]:  # type: ignore[no-untyped-def]
        await provider.serve(hold)
        return {"n": n}

    @app.workflow()
    async def calls(ctx, n):  # type: ignore[no-untyped-def]
        return await ctx.call(api, n=n)

    @app.workflow()
    async def other(ctx, n):  # type: ignore[no-untyped-def]
        return n

    return app


async def test_concurrency_and_rate_hold_across_workers(make_app):
    provider = Provider()
    apps = [_app(make_app, provider, rate=RateLimit(8, per=timedelta(seconds=1)),
                 concurrency=2) for _ in range(2)]
    handles = [await apps[0].submit_async("calls", i) for i in range(20)]
    async with contextlib.AsyncExitStack() as stack:
        for a in apps:
            await stack.enter_async_context(running_worker(a, concurrency=10, poll_interval=0.2))
        got = [await h.result_async(timeout=60) for h in handles]
    for a in apps:
        await a.database.close()
    assert sorted(r["n"] for r in got) == list(range(20))
    assert provider.peak == 2
    assert provider.busiest() <= 8
    assert len(provider.at) == 20  # each call dispatched once
    assert sum(sum(a.metrics.labelled("tool_turn_waits").values()) for a in apps) > 0


async def test_a_call_waiting_for_its_turn_parks_its_run_and_frees_the_worker(make_app):
    provider = Provider()
    provider.gate = asyncio.Event()
    app = _app(make_app, provider, concurrency=1)
    async with running(app, concurrency=2) as worker:
        first = await app.submit_async("calls", 1)
        await wait_for(lambda: provider.live == 1)
        second = await app.submit_async("calls", 2)

        async def parked() -> bool:
            info = await second.info_async()
            return info.status == "waiting" and info.waiting_for == "the turn of tool api"

        await wait_for(parked, what="the second run parked for the tool's turn")
        assert worker.active_runs == 1  # only the run whose call is in flight
        other = await app.submit_async("other", 7)  # the free slot serves other work
        assert await other.result_async(timeout=10) == 7
        provider.gate.set()
        assert (await first.result_async(timeout=10))["n"] == 1
        assert (await second.result_async(timeout=10))["n"] == 2
    assert provider.peak == 1


async def test_a_call_that_passed_its_policy_stages_holds_its_place(make_app, sql):
    """A tool with an authorize hook records its call ``pending`` first and admits it against
    the limit when it is dispatched (pending → submitted): it counts as one in flight then."""
    provider = Provider()
    provider.gate = asyncio.Event()
    app = make_app()

    @app.tool(effect="idempotent", concurrency=1)
    async def api(ctx, n: int) -> dict[str, int]:  # type: ignore[no-untyped-def]
        await provider.serve(0.0)
        return {"n": n}

    @api.authorize
    async def allow(pctx):  # type: ignore[no-untyped-def]
        return True

    @app.workflow()
    async def calls(ctx, n):  # type: ignore[no-untyped-def]
        return await ctx.call(api, n=n)

    async with running(app, concurrency=2):
        first = await app.submit_async("calls", 1)
        await wait_for(lambda: provider.live == 1)
        assert sql("SELECT state, in_flight_tool FROM orchestrator.operations") == [
            {"state": "submitted", "in_flight_tool": "api"}]
        second = await app.submit_async("calls", 2)

        async def parked() -> bool:
            info = await second.info_async()
            return info.status == "waiting" and info.waiting_for == "the turn of tool api"

        await wait_for(parked, what="the second run parked for the tool's turn")
        provider.gate.set()
        assert (await first.result_async(timeout=10))["n"] == 1
        assert (await second.result_async(timeout=10))["n"] == 2
    assert provider.peak == 1
    assert sql("SELECT DISTINCT in_flight_tool FROM orchestrator.operations") == [
        {"in_flight_tool": None}]


async def test_a_call_ending_wakes_the_runs_waiting_for_its_tool_only(make_app, sql,
                                                                       monkeypatch):
    """``pay`` and ``payout``: one name begins the other. A call of ``pay`` ending wakes the
    runs parked for the turn of ``pay``; a run parked for ``payout`` stays parked, untouched
    (not claimed, its wake time as it was). A claim clears the tool the run waited for, from
    the default queue and from a queue."""
    monkeypatch.setattr(site, "FULL_RECHECK", (3600.0, 3600.0))  # no re-asking on their own
    gates = {n: asyncio.Event() for n in range(1, 6)}
    live: set[int] = set()
    app = make_app()
    app.queue("payouts")

    async def serve(n: int) -> dict[str, int]:
        live.add(n)
        try:
            await gates[n].wait()
        finally:
            live.discard(n)
        return {"n": n}

    @app.tool(effect="idempotent", concurrency=2)
    async def pay(ctx, n: int) -> dict[str, int]:  # type: ignore[no-untyped-def]
        return await serve(n)

    @app.tool(effect="idempotent", concurrency=1)
    async def payout(ctx, n: int) -> dict[str, int]:  # type: ignore[no-untyped-def]
        return await serve(n)

    @app.workflow()
    async def paying(ctx, n):  # type: ignore[no-untyped-def]
        return await ctx.call(pay, n=n)

    @app.workflow(queue="payouts")
    async def paying_out(ctx, n):  # type: ignore[no-untyped-def]
        return await ctx.call(payout, n=n)

    def row(handle: Any) -> dict[str, Any]:
        return sql("SELECT status, waiting_for, waiting_tool, lease_token, available_at "
                   "FROM orchestrator.runs WHERE id = %s", (handle.id,))[0]

    async with running(app, concurrency=8):
        busy = [await app.submit_async(paying, 1), await app.submit_async(paying, 2),
                await app.submit_async(paying_out, 4)]
        await wait_for(lambda: live == {1, 2, 4}, what="both tools at their concurrency")
        payer = await app.submit_async(paying, 3)
        payee = await app.submit_async(paying_out, 5)
        await wait_for(lambda: row(payer)["status"] == row(payee)["status"] == "waiting",
                       what="both runs parked for their tool's turn")
        assert row(payer)["waiting_tool"] == "pay"
        assert row(payer)["waiting_for"] == "the turn of tool pay"
        assert row(payee)["waiting_tool"] == "payout"
        assert row(payee)["waiting_for"] == "the turn of tool payout"
        parked = row(payee)

        gates[1].set()
        gates[2].set()  # two calls of pay end: each wakes up to two runs waiting for pay
        await wait_for(lambda: 3 in live, what="the run waiting for pay to call it")
        assert row(payer)["status"] == "running" and row(payer)["waiting_tool"] is None
        assert row(payee) == parked  # neither woken nor claimed

        gates[4].set()  # the call of payout ends: the run waiting for it goes
        await wait_for(lambda: 5 in live, what="the run waiting for payout to call it")
        assert row(payee)["status"] == "running" and row(payee)["waiting_tool"] is None
        gates[3].set()
        gates[5].set()
        got = [(await h.result_async(timeout=10))["n"] for h in (*busy, payer, payee)]
    assert got == [1, 2, 4, 3, 5]
    assert sql("SELECT count(*) AS n FROM orchestrator.runs "
               "WHERE waiting_tool IS NOT NULL") == [{"n": 0}]


async def test_the_wait_for_a_turn_counts_against_the_deadline(make_app, sql):
    provider = Provider()
    provider.gate = asyncio.Event()
    app = _app(make_app, provider, concurrency=1)
    async with running(app, concurrency=3):
        first = await app.submit_async("calls", 1)
        await wait_for(lambda: provider.live == 1)
        late = await app.submit_async("calls", 2, deadline=timedelta(seconds=1.5))
        with pytest.raises(RunFailed) as failed:
            await late.result_async(timeout=20)
        assert failed.value.code == "DEADLINE_EXCEEDED"
        provider.gate.set()
        await first.result_async(timeout=10)
    assert len(provider.at) == 1  # the late run's call was never dispatched
    assert sql("SELECT count(*) AS n FROM orchestrator.operations WHERE run_id = %s",
               (late.id,))[0]["n"] == 0


async def test_a_429_with_retry_after_pauses_the_tool_for_every_run(make_app, sql):
    app = make_app()
    at: list[float] = []
    refused = asyncio.Event()

    @app.tool(effect="idempotent", retry=None, max_attempts=3)
    async def api(ctx, n: int) -> dict[str, int]:  # type: ignore[no-untyped-def]
        at.append(time.monotonic())
        if not refused.is_set():
            refused.set()
            raise ToolError.from_status(429, "slow down", proves_not_applied=True,
                                        retry_after="2")
        return {"n": n}

    @app.workflow()
    async def calls(ctx, n):  # type: ignore[no-untyped-def]
        return await ctx.call(api, n=n)

    async with running(app, concurrency=10):
        first = await app.submit_async(calls, 0)
        await wait_for(refused.is_set)
        paused_at = time.monotonic()
        # The back-off is recorded after the tool's answer: the others come once it is (a
        # run submitted in between could be called before it, which is not what this tests).
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.tool_limits WHERE name = 'api' "
                                   "AND backoff_until > now()"), what="the back-off recorded")
        others = [await app.submit_async(calls, n) for n in range(1, 6)]
        for h in (first, *others):
            await h.result_async(timeout=20)
    # After the 429, no call of the tool went out until its Retry-After had passed.
    assert len(at) > 1 and min(at[1:]) >= paused_at + 1.5
    assert len(at) == 7  # the refused call, its retry, the five others: none twice
    row = sql("SELECT backoff_until > now() - interval '1 minute' AS recent "
              "FROM orchestrator.tool_limits WHERE name = 'api'")
    assert row == [{"recent": True}]
    assert app.metrics.labelled("tool_back_offs") == {("api",): 1}


@pytest.mark.parametrize(("field", "options"), [
    ("rate", {"rate": "10/fortnight"}),
    ("rate", {"rate": 5}),
    ("concurrency", {"concurrency": 0}),
    ("concurrency", {"concurrency": -3}),
    ("shared_backoff", {"shared_backoff": "yes"}),
])
def test_bad_tool_limits_name_the_field(make_app, field, options):
    app = make_app()
    with pytest.raises(InvalidRequest) as caught:
        app.tool(**options)
    assert caught.value.path == field
