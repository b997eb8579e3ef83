"""Spans of a test's processes written to a file, one JSON line as each span starts and as it
ends: a process killed mid-run leaves the starts of the spans it never ended.

A process of the acceptance app traces when ``ACCEPTANCE_SPAN_FILE`` names a file
(:func:`provider`); ``read`` gives a test the lines back."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from opentelemetry.context import Context
from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor, TracerProvider

ENV = "ACCEPTANCE_SPAN_FILE"


class FileSpans(SpanProcessor):
    """Appends a line per span start and end, each with one unbuffered write."""

    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def _write(self, what: str, span: ReadableSpan) -> None:
        ctx = span.get_span_context()
        assert ctx is not None
        line = {
            "what": what, "pid": os.getpid(), "name": span.name,
            "trace_id": f"{ctx.trace_id:032x}", "span_id": f"{ctx.span_id:016x}",
            "parent_id": f"{span.parent.span_id:016x}" if span.parent else None,
            "links": [[f"{link.context.trace_id:032x}", f"{link.context.span_id:016x}"]
                      for link in span.links],
            "attributes": dict(span.attributes or {}),
            "events": [e.name for e in span.events],
        }
        os.write(self.fd, (json.dumps(line) + "\n").encode())

    def on_start(self, span: Span, parent_context: Context | None = None) -> None:
        self._write("start", span)

    def on_end(self, span: ReadableSpan) -> None:
        self._write("end", span)

    def shutdown(self) -> None:
        os.close(self.fd)

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True


def provider() -> TracerProvider | None:
    """A tracer provider writing to ``$ACCEPTANCE_SPAN_FILE``; None when it is not set."""
    path = os.environ.get(ENV)
    if not path:
        return None
    made = TracerProvider()
    made.add_span_processor(FileSpans(path))
    return made


def read(path: Path) -> list[dict[str, Any]]:
    """The lines of a span file (none if the process wrote none)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line]
