"""The console's screenshots in ``docs/img/``: ``python -m tests.browser.screenshots``.

A fresh database on the test server (``ORCHESTRATOR_TEST_DATABASE_URL`` or 127.0.0.1:5432),
the browser tests' application with a worker, a few runs (one settled by an operator on the
operation's page, eight more ticked and settled at once on the queue page, the rest waiting on
an unknown charge), the console under uvicorn and Debian's chromium through Playwright: the
overview, the queue, a run and an operation, as an operator sees them.
"""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import psycopg
from psycopg.rows import dict_row

from orchestrator.db import migrate
from orchestrator.db.config import resolve_database
from orchestrator.testing import wait_until
from tests.browser.conftest import chromium_path
from tests.browser.test_console_pages import GRANTS, TOKENS, WorkerThread, make_app
from tests.consoletools import Served

OUT = Path(__file__).resolve().parents[2] / "docs" / "img"


def main() -> int:
    server = os.environ.get("ORCHESTRATOR_TEST_DATABASE_URL",
                            "postgresql://postgres@127.0.0.1:5432/postgres")
    name = f"orch_shots_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(server, autocommit=True) as admin:
        admin.execute(f'CREATE DATABASE "{name}"')
    url = server.rsplit("/", 1)[0] + f"/{name}"
    try:
        migrate.upgrade(resolve_database(url))
        shoot(url)
    finally:
        with psycopg.connect(server, autocommit=True) as admin:
            admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    return 0


def shoot(url: str) -> None:
    from playwright.sync_api import sync_playwright

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
            page.screenshot(path=str(OUT / "console-queue.png"), full_page=True)
            print(f"wrote {OUT / 'console-queue.png'}")
            for path, file in (("/", "console-overview.png"),
                               (f"/runs/{run['run_id']}", "console-run.png"),
                               (f"/operations/{waiting['id']}", "console-operation.png")):
                page.goto(served.base + path)
                page.wait_for_load_state("networkidle")
                page.screenshot(path=str(OUT / file), full_page=True)
                print(f"wrote {OUT / file}")
            browser.close()
    app.close()


if __name__ == "__main__":
    sys.exit(main())
