"""Browser tests of the console: headless chromium driven by Playwright for Python.

The browser is Debian's ``chromium`` package (``apt-get install chromium``), handed to Playwright
as its ``executable_path``: nothing here downloads a browser. ``ORCHESTRATOR_TEST_CHROMIUM``
names another executable. Without a chromium, or without the ``playwright`` package, every
test in this folder is skipped, and the end of the run says so in one line, so that a green
run without a browser does not pass for one that drove it.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

ENV_CHROMIUM = "ORCHESTRATOR_TEST_CHROMIUM"
_HERE = Path(__file__).resolve().parent
_SKIPPED = pytest.StashKey[list[str]]()


def chromium_path() -> str | None:
    """The chromium the tests drive: ``ORCHESTRATOR_TEST_CHROMIUM``, else ``chromium`` (or
    ``chromium-browser``) on PATH, else None."""
    return (os.environ.get(ENV_CHROMIUM) or shutil.which("chromium")
            or shutil.which("chromium-browser"))


def missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if importlib.util.find_spec("playwright") is None:
        return "the playwright package is not installed (make install)"
    if chromium_path() is None:
        return (f"no chromium on PATH and {ENV_CHROMIUM} is not set "
                "(apt-get install chromium)")
    return None


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = missing()
    skipped: list[str] = []
    if reason is not None:
        for item in items:
            if item.path.is_relative_to(_HERE):
                item.add_marker(pytest.mark.skip(reason=f"browser test: {reason}"))
                skipped.append(item.nodeid)
    config.stash[_SKIPPED] = skipped


def pytest_terminal_summary(terminalreporter: Any, config: pytest.Config) -> None:
    skipped = config.stash.get(_SKIPPED, [])
    if skipped:
        terminalreporter.write_line(
            f"browser tests skipped: {len(skipped)} (only these): {missing()}", yellow=True)


@pytest.fixture(scope="package")
def chromium() -> Iterator[Any]:
    """One headless chromium for the browser tests (Playwright's sync API). Package-scoped,
    not session-scoped: the sync API keeps an event loop running while it is open, and the
    suite's asyncio tests that come after these need it gone."""
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), headless=True)
        try:
            yield browser
        finally:
            browser.close()


@pytest.fixture
def browser_context(chromium: Any) -> Iterator[Any]:
    """A fresh browser context (its own cookies) for one test."""
    context = chromium.new_context()
    context.set_default_timeout(15_000)
    try:
        yield context
    finally:
        context.close()
