"""Traces (docs/tracing.md), exported to the SDK's in-memory exporter: the submit span, a run
span per execution (a child of the submitter's span or linked to it), a call span per attempt
that is current while the tool runs, lookup spans, park/resume/wait events; no key, argument,
receipt or message in any attribute; log lines that name the trace."""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, SpanKind, StatusCode, TraceFlags

from orchestrator import OperationUncertain
from orchestrator.admin import show_run
from orchestrator.logs import JsonFormatter
from tests.integration.conftest import running, wait_for

SECRET = "sk_live_SECRET"


@pytest.fixture
def exporter() -> Iterator[InMemorySpanExporter]:
    found = InMemorySpanExporter()
    yield found
    found.clear()


@pytest.fixture
def provider(exporter: InMemorySpanExporter) -> Iterator[TracerProvider]:
    made = TracerProvider()
    made.add_span_processor(SimpleSpanProcessor(exporter))
    yield made
    made.shutdown()


def _named(spans: Any, prefix: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name.startswith(prefix)]


def _everything_said(spans: Any) -> str:
    """Every attribute, event and link attribute of ``spans``, as text."""
    parts = []
    for span in spans:
        parts.append(json.dumps(dict(span.attributes or {}), default=str))
        parts += [json.dumps([e.name, dict(e.attributes or {})], default=str)
                  for e in span.events]
        parts += [json.dumps(dict(link.attributes or {}), default=str) for link in span.links]
        parts.append(span.status.description or "")
    return "\n".join(parts)


async def test_a_run_joins_its_submitters_trace_as_a_child(
        make_app, provider, exporter):  # type: ignore[no-untyped-def]
    app = make_app(tracer_provider=provider, trace_parent="child")
    seen: dict[str, Any] = {}

    @app.tool(effect="idempotent")
    async def charge(ctx, *, amount):  # type: ignore[no-untyped-def]
        seen["span"] = trace.get_current_span().get_span_context()
        seen["key"] = ctx.idempotency_key
        return {"charged": amount, "token": SECRET}

    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        first = await ctx.call(charge, amount=data["amount"])
        second = await ctx.call(charge, amount=2)
        return [first, second]

    tracer = provider.get_tracer("the host")
    async with running(app):
        with tracer.start_as_current_span("request") as request:
            run = await app.submit_async(pay, {"amount": 1, "card": SECRET})
        await run.result_async(timeout=10)

    spans = exporter.get_finished_spans()
    (submit,) = _named(spans, "submit pay")
    (ran,) = _named(spans, "run pay")
    calls = _named(spans, "call charge")
    assert len(calls) == 2
    trace_id = request.get_span_context().trace_id
    assert {s.context.trace_id for s in [submit, ran, *calls]} == {trace_id}
    assert submit.parent is not None and submit.parent.span_id == request.context.span_id
    assert submit.kind is SpanKind.PRODUCER
    assert submit.attributes["orchestrator.run_id"] == str(run.id)
    assert submit.attributes["orchestrator.created"] is True
    assert ran.parent is not None and ran.parent.span_id == submit.context.span_id
    assert not ran.links
    assert ran.attributes["orchestrator.run_id"] == str(run.id)
    assert ran.attributes["orchestrator.replay"] is False
    assert ran.attributes["orchestrator.outcome"] == "succeeded"
    # Each call span names its operation (which holds the run and the position).
    detail = await show_run(app.database, run.id)
    operation_ids = {op["position"]: op["id"] for op in detail.operations}
    for position, call in enumerate(calls):
        assert call.parent is not None and call.parent.span_id == ran.context.span_id
        assert call.kind is SpanKind.CLIENT
        attributes = dict(call.attributes or {})
        assert attributes.pop("orchestrator.operation_id") == operation_ids[position]
        digest = attributes.pop("orchestrator.idempotency_key_digest")
        assert len(digest) == 16
        assert attributes == {
            "orchestrator.tool": "charge", "orchestrator.effect_class": "idempotent",
            "orchestrator.attempt": 1, "orchestrator.outcome": "committed"}
        assert call.status.status_code is StatusCode.UNSET
    # The last call's span was current while the tool ran: the tool's own spans nest under it.
    assert seen["span"].span_id == calls[1].context.span_id
    assert calls[1].attributes["orchestrator.idempotency_key_digest"] == (
        hashlib.sha256(seen["key"].encode()).hexdigest()[:16])
    said = _everything_said(spans)
    assert seen["key"] not in said and SECRET not in said


async def test_by_default_a_run_starts_its_own_trace_linked_to_the_submitter(
        make_app, provider, exporter, sql):  # type: ignore[no-untyped-def]
    app = make_app(tracer_provider=provider)

    @app.workflow()
    async def noop(ctx, data):  # type: ignore[no-untyped-def]
        return data

    async with running(app):
        run = await app.submit_async(noop, 1)
        await run.result_async(timeout=10)
    (submit,) = _named(exporter.get_finished_spans(), "submit noop")
    (ran,) = _named(exporter.get_finished_spans(), "run noop")
    sc = submit.context
    assert sql("SELECT traceparent FROM orchestrator.runs") == [
        {"traceparent": f"00-{sc.trace_id:032x}-{sc.span_id:016x}-{int(sc.trace_flags):02x}"}]
    assert ran.parent is None
    assert ran.context.trace_id != sc.trace_id
    assert [(link.context.trace_id, link.context.span_id) for link in ran.links] == [
        (sc.trace_id, sc.span_id)]


async def test_a_run_without_a_traceparent_starts_its_own_trace(
        make_app, provider, exporter, sql):  # type: ignore[no-untyped-def]
    quiet = make_app()  # no tracer provider here, and no span current: nothing to store
    app = make_app(tracer_provider=provider, trace_parent="child")

    @app.workflow()
    async def noop(ctx, data):  # type: ignore[no-untyped-def]
        return data

    quiet.registry = app.registry
    run = await quiet.submit_async(noop, 1)
    assert sql("SELECT traceparent FROM orchestrator.runs") == [{"traceparent": None}]
    async with running(app):
        await run.result_async(timeout=10)
    (ran,) = exporter.get_finished_spans()
    assert ran.name == "run noop" and ran.parent is None and not ran.links


async def test_without_tracing_the_callers_span_is_still_stored(
        make_app, sql):  # type: ignore[no-untyped-def]
    app = make_app()  # the API alone: no span is made, the caller's context is kept

    @app.workflow()
    async def noop(ctx, data):  # type: ignore[no-untyped-def]
        return data

    incoming = SpanContext(0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331,
                           is_remote=True, trace_flags=TraceFlags(1))
    token = otel_context.attach(trace.set_span_in_context(NonRecordingSpan(incoming)))
    try:
        await app.submit_async(noop, 1)
    finally:
        otel_context.detach(token)
    assert sql("SELECT traceparent FROM orchestrator.runs") == [
        {"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}]


def test_the_sync_submit_carries_the_callers_span(
        make_app, provider, exporter, sql):  # type: ignore[no-untyped-def]
    app = make_app(tracer_provider=provider)

    @app.workflow()
    async def noop(ctx, data):  # type: ignore[no-untyped-def]
        return data

    with provider.get_tracer("the host").start_as_current_span("request") as request:
        app.submit(noop, 1)
    (submit,) = _named(exporter.get_finished_spans(), "submit noop")
    assert submit.parent is not None and submit.parent.span_id == request.context.span_id


async def test_each_execution_is_a_run_span_of_the_same_trace_with_waits_parks_and_resumes(
        make_app, provider, exporter):  # type: ignore[no-untyped-def]
    app = make_app(tracer_provider=provider, trace_parent="child")

    @app.workflow()
    async def naps(ctx, data):  # type: ignore[no-untyped-def]
        await ctx.sleep(timedelta(seconds=1.1))  # longer than a sleep waited in memory
        return "rested"

    async with running(app):
        run = await app.submit_async(naps, None)
        assert await run.result_async(timeout=10) == "rested"
    spans = exporter.get_finished_spans()
    (submit,) = _named(spans, "submit naps")
    first, second = _named(spans, "run naps")
    assert {first.context.trace_id, second.context.trace_id} == {submit.context.trace_id}
    assert first.context.span_id != second.context.span_id
    assert [(e.name, dict(e.attributes or {})) for e in first.events] == [
        ("wait", {"orchestrator.wait": "timer", "orchestrator.position": 0}),
        ("park", {"orchestrator.waits": "timer"})]
    assert [e.name for e in second.events] == ["resume"]
    assert second.attributes["orchestrator.replay"] is True
    assert second.attributes["orchestrator.outcome"] == "succeeded"


@pytest.mark.parametrize("mode", ["child", "link"])
async def test_an_uncertain_call_and_its_lookup_say_so_without_the_upstream_text(
        make_app, provider, exporter, sql, caplog, mode):  # type: ignore[no-untyped-def]
    from orchestrator import StillUnknown

    app = make_app(tracer_provider=provider, trace_parent=mode)

    @app.tool()
    async def charge(ctx):  # type: ignore[no-untyped-def]
        raise ConnectionResetError(f"upstream said {SECRET}")  # sent, outcome unknown

    @charge.lookup
    async def find(ctx):  # type: ignore[no-untyped-def]
        return StillUnknown(f"the provider said {SECRET}")

    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        return await ctx.call(charge)

    caplog.set_level(logging.INFO, logger="orchestrator")
    async with running(app):
        run = await app.submit_async(pay, {})
        await wait_for(lambda: sql("SELECT 1 FROM orchestrator.runs "
                                   "WHERE status = 'needs_reconciliation'"))
        await app.create_reconciler().run_once()
        with pytest.raises(OperationUncertain):
            await run.outcome_async()
    spans = exporter.get_finished_spans()
    (ran,) = _named(spans, "run pay")
    (call,) = _named(spans, "call charge")
    (lookup,) = _named(spans, "lookup charge")
    op = sql("SELECT id FROM orchestrator.operations")[0]["id"]
    assert call.attributes["orchestrator.outcome"] == "unknown"
    assert call.attributes["orchestrator.operation_id"] == op
    assert [e.name for e in ran.events] == ["park"]
    assert lookup.attributes["orchestrator.operation_id"] == op
    assert lookup.attributes["orchestrator.outcome"] == "still_unknown"
    # The lookup relates to the run's submitter as the run's executions do.
    (submit,) = _named(spans, "submit pay")
    if mode == "child":
        assert lookup.context.trace_id == ran.context.trace_id == submit.context.trace_id
        assert lookup.parent is not None and lookup.parent.span_id == submit.context.span_id
    else:
        assert lookup.parent is None and lookup.context.trace_id != submit.context.trace_id
        assert [link.context.span_id for link in lookup.links] == [submit.context.span_id]
    assert SECRET not in _everything_said(spans)
    # The log line that says the run waits names its trace (the run's span was current).
    formatter = JsonFormatter()
    lines = [json.loads(formatter.format(r)) for r in caplog.records
             if r.name == "orchestrator.worker" and "needs reconciliation" in r.getMessage()]
    assert [(line["trace_id"], line["run_id"]) for line in lines] == [
        (f"{ran.context.trace_id:032x}", str(run.id))]
    # So does the reconciler's line about the lookup (its span was current).
    lines = [json.loads(formatter.format(r)) for r in caplog.records
             if r.name == "orchestrator.reconciler"]
    assert [(line["trace_id"], line["span_id"]) for line in lines] == [
        (f"{lookup.context.trace_id:032x}", f"{lookup.context.span_id:016x}")]


async def test_a_failed_run_is_an_error_with_its_code_and_no_message(
        make_app, provider, exporter):  # type: ignore[no-untyped-def]
    from orchestrator import RunFailed

    app = make_app(tracer_provider=provider)

    @app.workflow()
    async def breaks(ctx, data):  # type: ignore[no-untyped-def]
        raise KeyError(SECRET)

    async with running(app):
        run = await app.submit_async(breaks, None)
        with pytest.raises(RunFailed):
            await run.result_async(timeout=10)
    (ran,) = _named(exporter.get_finished_spans(), "run breaks")
    assert ran.status.status_code is StatusCode.ERROR
    assert ran.attributes["orchestrator.outcome"] == "failed"
    assert ran.attributes["orchestrator.code"] == "WORKFLOW_FAILED"
    assert SECRET not in _everything_said(exporter.get_finished_spans())

