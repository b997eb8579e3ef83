"""The console's screenshots in ``docs/img/``: ``python -m tests.browser.screenshots [FILE
...]`` (every one, or only the files named, e.g. ``console-workers.png``).

A fresh database on the test server (``ORCHESTRATOR_TEST_DATABASE_URL`` or 127.0.0.1:5432),
the browser tests' application with a worker, a few runs (one settled by an operator on the
operation's page, eight more ticked and settled at once on the queue page, the rest waiting on
an unknown charge), the console under uvicorn and Debian's chromium through Playwright: the
overview, the queue, a run and an operation, as an operator sees them; then a second worker,
of another application, told to stop while its run's call is in flight: the Workers page with
one worker live and one draining.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import psycopg
from psycopg.rows import dict_row

from orchestrator import Orchestrator
from orchestrator.db import migrate
from orchestrator.db.config import resolve_database
from orchestrator.testing import wait_until
from tests.browser.conftest import chromium_path
from tests.browser.test_console_pages import GRANTS, OWNER, TOKENS, WorkerThread, make_app
from tests.consoletools import Served

OUT = Path(__file__).resolve().parents[2] / "docs" / "img"
FILES = ("console-queue.png", "console-overview.png", "console-run.png",
         "console-operation.png", "console-workers.png")


def main(argv: list[str] | None = None) -> int:
    names = sys.argv[1:] if argv is None else argv
    unknown = sorted(set(names) - set(FILES))
    if unknown:
        print(f"no screenshot {', '.join(unknown)}; there are {', '.join(FILES)}",
              file=sys.stderr)
        return 2
    wanted = set(names or FILES)
    server = os.environ.get("ORCHESTRATOR_TEST_DATABASE_URL",
                            "postgresql://postgres@127.0.0.1:5432/postgres")
    name = f"orch_shots_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = server.rsplit("/", 1)[0] + f"/{name}"
    try:
        migrate.upgrade(resolve_database(url))
        shoot(url, wanted)
    finally:
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return 0


def exporter(url: str) -> tuple[Orchestrator, threading.Event, threading.Event]:
    """Another application on the same database (another team's worker): ``nightly_export``
    calls ``export``, which runs until ``release`` is set. ``(app, entered, release)``."""
    app = Orchestrator(url, default_owner=OWNER)
    entered, release = threading.Event(), threading.Event()

    @app.tool(effect="read")
    async def export(ctx, *, day):  # type: ignore[no-untyped-def]
        entered.set()
        await asyncio.to_thread(release.wait, 60)
        return {"exported": day}

    @app.workflow()
    async def nightly_export(ctx, day):  # type: ignore[no-untyped-def]
        return await ctx.call(export, day=day)

    return app, entered, release


def shoot(url: str, wanted: set[str]) -> None:
    from playwright.sync_api import sync_playwright

    def save(page: Any, file: str) -> None:
        if file in wanted:
            page.screenshot(path=str(OUT / file), full_page=True)
            print(f"wrote {OUT / file}")

    app = make_app(url)
    console = app.console(tokens=TOKENS, grants={**GRANTS, "alice": [*GRANTS["alice"], "bulk"]})
    with psycopg.connect(url, autocommit=True, row_factory=dict_row) as conn, \
            WorkerThread(app):
        orders = [(f"o{i}", "pay") for i in range(1, 13)] + [("r1", "give_back")]
        for order, workflow in orders:
            app.submit(workflow, order, idempotency_key=f"sub-{order}")
        wait_until(lambda: len(conn.execute(
            "SELECT 1 FROM orchestrator.runs WHERE status = 'needs_reconciliation'"
        ).fetchall()) == len(orders), timeout=60)
        first = conn.execute("SELECT min(id) AS id FROM orchestrator.operations").fetchone()
        assert first is not None
        with Served(console) as served, sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=chromium_path(),
                                                 headless=True)
            page = browser.new_page(viewport={"width": 1280, "height": 860})
            page.goto(f"{served.base}/login")
            page.fill("input[name=token]", TOKENS["alice"])
            page.click("button[type=submit]")
            page.wait_for_load_state()
            # One resolved by an operator, so that a run's page tells the whole story.
            page.goto(f"{served.base}/operations/{first['id']}")
            form = page.locator("#resolve-committed")
            form.locator("textarea[name=receipt]").fill('{"charge": "ch_by_hand"}')
            form.locator("textarea[name=evidence]").fill("PSP dashboard shows ch_by_hand")
            form.locator("button[type=submit]").click()
            page.wait_for_load_state()
            run = conn.execute("SELECT run_id FROM orchestrator.operations WHERE id = %s",
                               (first["id"],)).fetchone()
            assert run is not None
            wait_until(lambda: conn.execute(
                "SELECT status FROM orchestrator.runs WHERE id = %s", (run["run_id"],)
            ).fetchone()["status"] == "succeeded", timeout=30)
            # Eight more settled at once, ticked on the queue page: the overview's chart
            # then has a minute of successes.
            page.goto(f"{served.base}/operations")
            for box in page.locator("input[name=id]").all()[:8]:
                box.check()
            form = page.locator("#selected-form")
            form.locator("select[name=resolution]").select_option("not_applied")
            form.locator("textarea[name=evidence]").fill("PSP shows no charge for these eight")
            form.locator("button[type=submit]").click()
            page.locator("#bulk-count").wait_for()
            page.locator("#bulk-confirm button[type=submit]").click()
            page.locator("#bulk-result").wait_for(timeout=60_000)
            wait_until(lambda: conn.execute(
                "SELECT count(*) AS n FROM orchestrator.runs WHERE status = 'succeeded'"
            ).fetchone()["n"] == 9, timeout=60)
            waiting = conn.execute(
                "SELECT max(id) AS id FROM orchestrator.operations WHERE state = 'unknown'"
            ).fetchone()
            assert waiting is not None
            OUT.mkdir(parents=True, exist_ok=True)
            page.goto(f"{served.base}/operations")
            for box in page.locator("input[name=id]").all()[:2]:
                box.check()  # the queue as an operator sees it while choosing
            save(page, "console-queue.png")
            for path, file in (("/", "console-overview.png"),
                               (f"/runs/{run['run_id']}", "console-run.png"),
                               (f"/operations/{waiting['id']}", "console-operation.png")):
                page.goto(served.base + path)
                page.wait_for_load_state("networkidle")
                save(page, file)
            shoot_draining(url, conn, served, page, save)
            browser.close()
    app.close()


def shoot_draining(url: str, conn: Any, served: Served, page: Any, save: Any) -> None:
    """The Workers page while a second worker drains: told to stop with its run's call in
    flight, it heartbeats and holds the run until the call lands."""
    other, entered, release = exporter(url)
    draining = WorkerThread(other).__enter__()
    try:
        other.submit("nightly_export", "2026-12-05", idempotency_key="export-2026-12-05")
        assert entered.wait(30)
        draining.loop.call_soon_threadsafe(draining.worker.request_stop)
        wait_until(lambda: conn.execute(
            "SELECT 1 FROM orchestrator.workers WHERE id = %s AND draining_since IS NOT NULL",
            (draining.worker.worker_id,)).fetchone() is not None, timeout=30)
        page.goto(f"{served.base}/workers")
        page.wait_for_load_state("networkidle")
        save(page, "console-workers.png")
    finally:
        release.set()  # the call lands, the run is let go and the worker stops
        draining.thread.join(60)
        other.close()


if __name__ == "__main__":
    sys.exit(main())
