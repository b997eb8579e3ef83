"""OpenTelemetry traces of the engine (docs/tracing.md).

The package depends on ``opentelemetry-api`` only. Until the host installs an SDK and sets a
tracer provider (globally, or ``Orchestrator(tracer_provider=...)``), :attr:`Tracing.tracer` is
None and the engine creates no span at all: the hot path pays one call and one identity check.

The spans, all with attributes under ``orchestrator.*``:

- ``submit {workflow}`` in the submitting process. The W3C ``traceparent`` of that span (of the
  caller's current span when tracing is off here) is stored with the run, without baggage or
  tracestate.
- ``run {workflow}`` for each execution of a run on a worker: a replay after a crash, a resume
  after a park, is a new span. With ``trace_parent="child"`` it is a child of the stored
  ``traceparent``; with ``"link"`` (the default, as long-delayed work should be) it starts a
  trace of its own with a link to it. A run stored without one starts a trace of its own.
- ``call {tool}`` for each attempt of a tool call, current while the tool runs (a tool's own
  instrumented HTTP client nests under it); ``lookup {tool}`` for each reconciliation lookup.
- ``park``, ``resume`` and each wait are events of the run's span.

Errors are recorded as a status and an ``orchestrator.code`` attribute drawn from a bounded
vocabulary (error codes, exception type names), never as a message, an argument or a receipt.
The idempotency key appears only as a digest (``orchestrator.idempotency_key_digest``).
"""

from __future__ import annotations

import hashlib
import re
from typing import Any, Literal

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import (
    Link,
    NonRecordingSpan,
    NoOpTracerProvider,
    ProxyTracerProvider,
    Span,
    SpanContext,
    SpanKind,
    Status,
    StatusCode,
    TraceFlags,
    Tracer,
    TracerProvider,
)

ParentMode = Literal["link", "child"]
PARENT_MODES: tuple[str, ...] = ("link", "child")
INSTRUMENTATION = "orchestrator"

_OFF = (ProxyTracerProvider, NoOpTracerProvider)
_TRACEPARENT = re.compile(r"00-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})")


class Tracing:
    """Where the engine's spans go, and how a run's span relates to its submitter's.

    ``provider``: None follows the global tracer provider (``trace.set_tracer_provider``), even
    one set after this object was made. ``parent``: ``"link"`` or ``"child"`` (see the module
    docstring)."""

    __slots__ = ("parent", "_provider", "_seen", "_tracer")

    def __init__(self, *, parent: ParentMode = "link",
                 provider: TracerProvider | None = None) -> None:
        if parent not in PARENT_MODES:
            raise ValueError(f"trace_parent must be one of {', '.join(PARENT_MODES)}")
        self.parent = parent
        self._provider = provider
        self._seen: TracerProvider | None = None
        self._tracer: Tracer | None = None

    @property
    def tracer(self) -> Tracer | None:
        """The engine's tracer; None while no SDK provider is set (tracing is off)."""
        provider = self._provider or trace.get_tracer_provider()
        if provider is not self._seen:
            self._seen = provider
            self._tracer = (None if isinstance(provider, _OFF)
                            else provider.get_tracer(INSTRUMENTATION))
        return self._tracer

    def run_span(self, tracer: Tracer, name: str, traceparent: str | None,
                 attributes: dict[str, Any]) -> Span:
        """A new ``run {workflow}`` span for one execution of a run, related to the stored
        ``traceparent`` as configured. Not made current: the caller attaches it."""
        return self.related_span(tracer, f"run {name}", traceparent, attributes,
                                 SpanKind.CONSUMER)

    def related_span(self, tracer: Tracer, name: str, traceparent: str | None,
                     attributes: dict[str, Any], kind: SpanKind) -> Span:
        """A new span of work done for a run away from its submitter (an execution, a
        reconciliation lookup), related to the run's stored ``traceparent`` as configured: a
        child of it, or the root of a trace of its own with a link to it. Not made current."""
        stored = parse_traceparent(traceparent)
        if stored is not None and self.parent == "child":
            parent = trace.set_span_in_context(NonRecordingSpan(stored), otel_context.Context())
            return tracer.start_span(name, parent, kind, attributes)
        links = [Link(stored, {"orchestrator.link": "submit"})] if stored is not None else None
        # An empty context: the process's own current span (if any) is no parent of it.
        return tracer.start_span(name, otel_context.Context(), kind, attributes, links)


def format_traceparent(ctx: SpanContext) -> str:
    """The W3C ``traceparent`` header value of ``ctx``."""
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def parse_traceparent(text: str | None) -> SpanContext | None:
    """The remote span context a ``traceparent`` value names; None when absent or malformed
    (version 00 only; an all-zero id is invalid)."""
    if not text:
        return None
    match = _TRACEPARENT.fullmatch(text)
    if match is None:
        return None
    trace_id, span_id = int(match[1], 16), int(match[2], 16)
    if not trace_id or not span_id:
        return None
    return SpanContext(trace_id, span_id, is_remote=True,
                       trace_flags=TraceFlags(int(match[3], 16)))


def current_traceparent() -> str | None:
    """The ``traceparent`` of the current span, if there is a valid one."""
    ctx = trace.get_current_span().get_span_context()
    return format_traceparent(ctx) if ctx.is_valid else None


def key_digest(key: str) -> str:
    """What a span says of an idempotency key: the first 16 hex digits of its SHA-256."""
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def record_error(span: Span, code: str) -> None:
    """Mark ``span`` failed with a bounded ``code`` (an error code or an exception's type
    name), never a message."""
    span.set_attribute("orchestrator.code", code)
    span.set_status(Status(StatusCode.ERROR))


def event(name: str, attributes: dict[str, Any] | None = None) -> None:
    """Add an event to the current span (nothing when it does not record)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.add_event(name, attributes)


def annotate(name: str, value: str | int | bool) -> None:
    """Set an attribute of the current span (nothing when it does not record)."""
    span = trace.get_current_span()
    if span.is_recording():
        span.set_attribute(name, value)


def fail_current(code: str) -> None:
    """Mark the current span failed with ``code`` (see :func:`record_error`)."""
    span = trace.get_current_span()
    if span.is_recording():
        record_error(span, code)
