"""orchestrator.tracing without a database: the traceparent stored with a run, the tracer
that is None while tracing is off, how a run's span relates to its submitter's, and the trace
fields of log lines."""

from __future__ import annotations

import json
import logging

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NoOpTracerProvider, SpanContext

from orchestrator import Orchestrator
from orchestrator.errors import ConfigurationError
from orchestrator.logs import JsonFormatter, fields
from orchestrator.tracing import (
    Tracing,
    current_traceparent,
    format_traceparent,
    key_digest,
    parse_traceparent,
)

HEADER = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def _provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def test_a_traceparent_round_trips() -> None:
    ctx = parse_traceparent(HEADER)
    assert ctx is not None and ctx.is_remote and ctx.is_valid
    assert (ctx.trace_id, ctx.span_id) == (0x0AF7651916CD43DD8448EB211C80319C, 0xB7AD6B7169203331)
    assert ctx.trace_flags.sampled
    assert format_traceparent(ctx) == HEADER


@pytest.mark.parametrize("text", [
    None, "", "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
    "00-00000000000000000000000000000000-b7ad6b7169203331-01",
    "00-0af7651916cd43dd8448eb211c80319c-0000000000000000-01",
    "00-0AF7651916CD43DD8448EB211C80319C-b7ad6b7169203331-01",
    "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
    HEADER + "-extra", "garbage"])
def test_a_malformed_traceparent_is_ignored(text: str | None) -> None:
    assert parse_traceparent(text) is None


def test_tracing_is_off_until_a_provider_is_set() -> None:
    assert Tracing().tracer is None  # the API's proxy provider: no SDK configured here
    assert Tracing(provider=NoOpTracerProvider()).tracer is None
    provider, _ = _provider()
    tracing = Tracing(provider=provider)
    tracer = tracing.tracer
    assert tracer is not None and tracing.tracer is tracer  # kept, not fetched per span


def test_the_parent_mode_is_checked() -> None:
    with pytest.raises(ValueError):
        Tracing(parent="sideways")  # type: ignore[arg-type]
    with pytest.raises(ConfigurationError):
        Orchestrator("postgresql://nowhere/none", trace_parent="sideways")  # type: ignore[arg-type]


def test_a_key_is_only_ever_a_digest() -> None:
    digest = key_digest("run:1:0:1")
    assert digest == key_digest("run:1:0:1") and len(digest) == 16
    assert "run" not in digest and digest != key_digest("run:1:0:2")


@pytest.mark.parametrize("mode", ["child", "link"])
def test_a_run_span_is_a_child_of_or_linked_to_the_stored_span(mode: str) -> None:
    provider, exporter = _provider()
    tracing = Tracing(parent=mode, provider=provider)  # type: ignore[arg-type]
    tracer = tracing.tracer
    assert tracer is not None
    with tracer.start_as_current_span("the worker's own"):  # never a run's parent
        tracing.run_span(tracer, "pay", HEADER, {"orchestrator.run_id": "r"}).end()
        tracing.run_span(tracer, "pay", None, {}).end()
    stored = parse_traceparent(HEADER)
    assert stored is not None
    linked, alone, _ = exporter.get_finished_spans()
    assert linked.name == "run pay" and linked.attributes == {"orchestrator.run_id": "r"}
    if mode == "child":
        assert linked.parent == stored and linked.context.trace_id == stored.trace_id
        assert not linked.links
    else:
        assert linked.parent is None and linked.context.trace_id != stored.trace_id
        assert [link.context for link in linked.links] == [stored]
    assert alone.parent is None and not alone.links


def test_log_lines_name_the_current_span() -> None:
    provider, _ = _provider()
    record = logging.LogRecord("orchestrator.worker", logging.INFO, __file__, 1, "m", None,
                               None)
    assert "trace_id" not in fields(run_id="r")
    assert current_traceparent() is None
    with provider.get_tracer("t").start_as_current_span("run pay") as span:
        ctx: SpanContext = span.get_span_context()
        said = fields(run_id="r")
        line = json.loads(JsonFormatter().format(record))
        assert current_traceparent() == format_traceparent(ctx)
    ids = {"trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}"}
    assert said == {"run_id": "r", **ids}
    assert {k: line[k] for k in ids} == ids
    later = json.loads(JsonFormatter().format(record))  # formatted outside the span
    assert "trace_id" not in later
    assert trace.get_current_span().get_span_context().is_valid is False
