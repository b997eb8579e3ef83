"""The vendored htmx loads in the browser the tests drive (from the package, no other site)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

STATIC = Path(__file__).resolve().parents[2] / "orchestrator" / "console" / "static"


def test_the_vendored_htmx_runs_in_chromium(browser_context: Any) -> None:
    page = browser_context.new_page()
    page.set_content("<html><body></body></html>")
    page.add_script_tag(path=str(STATIC / "htmx.min.js"))
    assert page.evaluate("window.htmx.version") == "2.0.11"
