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


def render(headers: Sequence[str], rows: Sequence[Sequence[Any]], *, max_width: int = 60,
           clip_last: bool = True) -> str:
    """Columns sized to their content (each capped at ``max_width`` characters). With
    ``clip_last`` False the last column is never cut: it takes the rest of the line (a prose
    column whose end matters, such as a timeline's detail)."""
    last = len(headers) - 1
    text = [[clip(cell(v), max_width) if clip_last or i < last else fold(cell(v))
             for i, v in enumerate(row)] for row in rows]
    widths = [len(h) for h in headers]
    for row in text:
        widths = [max(w, len(v)) for w, v in zip(widths, row, strict=True)]
    rule = widths if clip_last else [*widths[:-1], min(widths[-1], max_width)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip(),
             "  ".join("-" * w for w in rule)]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
              for row in text]
    return "\n".join(lines)


def fold(value: str) -> str:
    """``value`` on one line: every run of whitespace, newlines included, one space."""
    return " ".join(value.split())


def clip(value: str, width: int) -> str:
    """``value`` on one line, cut to ``width`` characters (the last one then ``…``)."""
    value = fold(value)
    return value if len(value) <= width else value[: width - 1] + "…"


def duration(seconds: float) -> str:
    """Seconds in words a person reads at a glance: ``0.3 s``, ``45 s``, ``3 min 20 s``,
    ``2 h 5 min``, ``4 d 1 h``."""
    if seconds < 10:
        return f"{seconds:.1f} s"
    s = int(seconds)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60} s"
    if s < 86400:
        return f"{s // 3600} h {s % 3600 // 60} min"
    return f"{s // 86400} d {s % 86400 // 3600} h"
