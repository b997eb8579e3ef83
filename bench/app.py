"""The application our benchmark workers run: ``orchestrator worker --app bench.app:app``.

Workflows ``k1``, ``k3`` and ``k10`` make K calls of a trivial ``consequential`` tool that
returns a small dict, so every step pays the whole contract: a fenced write-ahead
``submitted``, the call, a fenced receipt, and at the end a fenced completion. The tool stamps
the wall-clock time it started, which the latency section reads back from the result.

Queues (the queues section, docs/flow.md): ``k3q`` is ``k3`` in the queue ``wide``, whose
limit never binds (what a configured queue costs); ``capped`` makes one call and then holds
its slot for ``BENCH_QUEUE_HOLD`` seconds in the queue ``capped`` (``BENCH_QUEUE_CAP`` runs at
once: how close to the limit the workers keep it); ``rated`` is ``k1`` in the queue ``rated``
(``BENCH_QUEUE_RATE`` starts per second: how close to the rate they start).

``k1c`` runs ``k1`` as its child and returns its result: the child's end wakes the parent
(with the three queues above declared, what a wake costs the workers' claims).

``hold`` parks its run inside a ``read`` tool that never returns: the recovery section kills
the worker holding such runs (a ``read`` tool may be repeated as a new attempt, so the run
really runs again elsewhere rather than waiting for reconciliation).

Configuration comes from the environment so that one module serves every section:
``ORCHESTRATOR_DATABASE_URL``, ``BENCH_LEASE_TTL`` (default: the engine's own default) and
``BENCH_POOL_SIZE`` (connections per worker process); with ``BENCH_TRACING=R`` the process
has the OpenTelemetry SDK (``1``: every span sampled; ``0.1``: one trace in ten; batched and
handed to an exporter that drops it: the cost of tracing without the cost of a collector).
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

from orchestrator import Orchestrator, Owner, ToolContext, WorkflowContext

try:
    from orchestrator import RateLimit
except ImportError:  # an engine from before queues (bench --engine REF): no queue workflows
    RateLimit = None  # type: ignore[assignment,misc]

OWNER = Owner(tenant="bench", principal="bench")
QUEUE_CAP = int(os.environ.get("BENCH_QUEUE_CAP", "8"))
QUEUE_RATE = int(os.environ.get("BENCH_QUEUE_RATE", "100"))
QUEUE_HOLD = float(os.environ.get("BENCH_QUEUE_HOLD", "0.1"))


def build_app(url: str | None, *, lease_ttl: float | None = None,
              pool_size: int | None = None) -> Orchestrator:
    """An Orchestrator with this module's workflows; the driver builds one per database."""
    options: dict[str, Any] = {"default_owner": OWNER}
    if lease_ttl is not None:
        options["lease_ttl"] = lease_ttl
    if pool_size is not None:
        options["pool_size"] = pool_size
    orch = Orchestrator(url, **options)
    _register(orch)
    return orch


def _register(orch: Orchestrator) -> None:
    @orch.tool(effect="consequential")
    async def noop(ctx: ToolContext, *, i: int) -> dict[str, Any]:
        return {"ok": True, "i": i, "t": time.time()}

    @orch.tool(effect="read")
    async def hold(ctx: ToolContext) -> dict[str, Any]:
        await asyncio.sleep(3600)
        return {"held": True}

    async def steps(ctx: WorkflowContext, k: int) -> dict[str, Any]:
        # When the body began (its first execution: these runs never park, so never replay):
        # the latency section splits a first step at it, the claim before and the write-ahead
        # after.
        began = time.time()
        first: dict[str, Any] = {}
        last: dict[str, Any] = {}
        for i in range(k):
            last = await ctx.call(noop, i=i)
            if i == 0:
                first = last
        return {"began_t": began, "first_t": first.get("t"), "last": last}

    for k in (1, 3, 10):
        async def run_k(ctx: WorkflowContext, data: Any, k: int = k) -> dict[str, Any]:
            return await steps(ctx, k)

        orch.workflow(version="1", name=f"k{k}")(run_k)

    if RateLimit is not None:
        _queues(orch, steps)

    @orch.workflow(version="1", name="k1c")
    async def k1_child(ctx: WorkflowContext, data: Any) -> dict[str, Any]:
        result: dict[str, Any] = await ctx.run_child("k1", data)
        return result

    @orch.workflow(version="1", name="hold")
    async def hold_run(ctx: WorkflowContext, data: Any) -> dict[str, Any]:
        result: dict[str, Any] = await ctx.call(hold)
        return result


def _queues(orch: Orchestrator, steps: Any) -> None:
    orch.queue("wide", concurrency=1_000_000)
    orch.queue("capped", concurrency=QUEUE_CAP)
    orch.queue("rated", rate=RateLimit(QUEUE_RATE))

    @orch.workflow(version="1", name="k3q", queue="wide")
    async def k3q(ctx: WorkflowContext, data: Any) -> dict[str, Any]:
        return await steps(ctx, 3)

    @orch.workflow(version="1", name="capped", queue="capped")
    async def capped(ctx: WorkflowContext, data: Any) -> dict[str, Any]:
        done = await steps(ctx, 1)
        await asyncio.sleep(QUEUE_HOLD)
        return done

    @orch.workflow(version="1", name="rated", queue="rated")
    async def rated(ctx: WorkflowContext, data: Any) -> dict[str, Any]:
        return await steps(ctx, 1)


def _env_float(name: str) -> float | None:
    value = os.environ.get(name)
    return float(value) if value else None


def dropping_provider(ratio: float = 1.0) -> Any:
    """An SDK tracer provider: every span (or the ``ratio`` of traces a parent-based ratio
    sampler keeps) batched to an exporter that drops it: tracing's cost without a collector's."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import (
        BatchSpanProcessor,
        SpanExporter,
        SpanExportResult,
    )
    from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

    class Dropped(SpanExporter):
        def export(self, spans: Any) -> SpanExportResult:
            return SpanExportResult.SUCCESS

    provider = (TracerProvider() if ratio >= 1
                else TracerProvider(sampler=ParentBased(TraceIdRatioBased(ratio))))
    provider.add_span_processor(BatchSpanProcessor(Dropped()))
    return provider


def _trace_to_nowhere(ratio: float) -> None:
    from opentelemetry import trace

    trace.set_tracer_provider(dropping_provider(ratio))


if os.environ.get("BENCH_TRACING"):
    _trace_to_nowhere(float(os.environ["BENCH_TRACING"]))

app = build_app(os.environ.get("ORCHESTRATOR_DATABASE_URL"),
                lease_ttl=_env_float("BENCH_LEASE_TTL"),
                pool_size=int(os.environ["BENCH_POOL_SIZE"]) if os.environ.get("BENCH_POOL_SIZE")
                else None)
