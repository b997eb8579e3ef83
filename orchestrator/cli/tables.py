"""Plain-text tables for people: aligned columns, a header rule, nothing clever."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

from orchestrator.admin import utc_text


def cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, datetime):
        return utc_text(value)
    return str(value)


def render(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, max_width: int = 60) -> str:
    """Columns sized to their content (each capped at ``max_width`` characters)."""
    text = [[clip(cell(v), max_width) for v in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in text:
        widths = [max(w, len(v)) for w, v in zip(widths, row, strict=True)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip(),
             "  ".join("-" * w for w in widths)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
              for row in text]
    return "\n".join(lines)


def clip(value: str, width: int) -> str:
    """``value`` on one line, cut to ``width`` characters (the last one then ``…``)."""
    value = " ".join(value.split())
    return value if len(value) <= width else value[: width - 1] + "…"
