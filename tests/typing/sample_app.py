"""A typed application, checked by ``mypy --strict`` against the installed package
(tests/typing/test_installed_types.py): it must pass cleanly. ``assert_type`` proves what the
API infers, not merely that nothing is ``Any``-typed into silence."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, assert_type

from orchestrator import (
    Committed,
    JournalEntry,
    NotApplied,
    Orchestrator,
    Owner,
    PolicyContext,
    RunHandle,
    RunInfo,
    StillUnknown,
    Tool,
    ToolContext,
    Workflow,
    WorkflowContext,
)

app = Orchestrator(default_owner=Owner(tenant="acme", principal="alice"))


@app.tool(effect="consequential", timeout=timedelta(seconds=10))
async def charge(ctx: ToolContext, *, customer: str, cents: int) -> dict[str, Any]:
    return {"customer": customer, "cents": cents, "key": ctx.idempotency_key}


@charge.lookup
async def find_charge(ctx: ToolContext, *, customer: str, cents: int
                      ) -> Committed | NotApplied | StillUnknown:
    return NotApplied(f"no charge for {customer}")


@charge.authorize
async def small_enough(ctx: PolicyContext) -> bool:
    return int(ctx.arguments["cents"]) < 10_000


@app.tool(effect="read")
async def quote(ctx: ToolContext, sku: str, quantity: int = 1) -> int:
    return 100 * quantity


@app.workflow(version="2")
async def price(ctx: WorkflowContext, sku: str) -> int:
    return await ctx.call(quote, sku=sku, quantity=2)


@app.workflow(version="1")
async def checkout(ctx: WorkflowContext, order: dict[str, Any]) -> dict[str, Any]:
    receipt = await ctx.call(charge, customer=order["customer"], cents=order["cents"])
    assert_type(receipt, dict[str, Any])
    ctx.log.info("charged %s", order["customer"], extra={"step": "charge"})
    quiet: bool = ctx.log.replaying
    cents: int = receipt["cents"]
    total = await ctx.run_child(price, "sku-1")
    assert_type(total, int)
    by_name = await ctx.call("charge", customer="c1", cents=1)  # by name: Any
    assert_type(by_name, Any)
    assert_type(await ctx.run_child("price", "sku-2"), Any)
    both = await ctx.gather(ctx.call(quote, sku="a"), ctx.call(quote, sku="b"))
    ctx.publish({"charged": cents})
    assert_type(ctx.publish("done", topic="milestones"), None)
    return {"receipt": receipt, "cents": cents + total, "both": both, "by_name": by_name,
            "quiet": quiet}


the_tool: Tool[..., dict[str, Any]] = charge
the_workflow: Workflow[dict[str, Any], dict[str, Any]] = checkout
assert_type(price, Workflow[str, int])


def submit_and_wait() -> int:
    run = app.submit(checkout, {"customer": "c1", "cents": 500},
                     idempotency_key="checkout-c1-1", deadline=timedelta(days=3))
    assert_type(run, RunHandle[dict[str, Any]])
    result = run.result(timeout=60)
    assert_type(result, dict[str, Any])
    delivered: bool = app.send_event(run.id, "approval", {"ok": True}, event_key="appr-1")
    runs: list[RunInfo] = app.list_runs(status="succeeded", limit=10)
    entries: list[JournalEntry] = run.journal()
    assert_type(app.journal(run.id), list[JournalEntry])
    assert_type(app.cancel(run.id), str)
    for entry in run.events_sync(after=entries[-1].seq, topics=["progress"]):
        assert_type(entry, JournalEntry)
        assert_type(entry.seq, int)
    named = app.submit("price", "sku-9")
    assert_type(named, RunHandle[Any])
    prices = [app.submit(price, sku) for sku in ("a", "b")]
    done = app.wait(prices, timeout=timedelta(seconds=30))
    assert_type(done, list[RunHandle[int]])
    first = next(app.as_completed(prices, timeout=30))
    any_handle: RunHandle = first
    assert any_handle is not None
    return sum(h.result() for h in done) + first.result() + len(runs) + len(entries) + delivered


async def submit_and_wait_async() -> int:
    run = await app.submit_async(price, "sku-1")
    assert_type(await run.result_async(), int)
    handles = [run, await app.submit_async(price, "sku-2")]
    total = 0
    async for entry in run.events(follow=False):
        total += entry.seq + entry.at.second
    async for handle in app.as_completed_async(handles, timeout=30):
        total += await handle.result_async()
    for handle in await app.wait_async(handles):
        total += await handle.outcome_async()
    return total


def serve() -> None:
    worker = app.create_worker(concurrency=4, poll_interval=0.5, drain_timeout=10.0)
    reconciler = app.create_reconciler(max_lookups=3, base_delay=0.5)
    assert worker is not None and reconciler is not None
    app.run_worker(concurrency=2)
