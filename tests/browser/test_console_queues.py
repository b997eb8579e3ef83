"""The console's queues page in headless chromium, with a real worker: an operator with the
``queues`` grant pauses a queue with evidence (its runs stop starting), raises its limit and
resumes it (they start again), and the audit log shows both; a read-only operator sees the
queue and no action."""

from __future__ import annotations

import asyncio
from typing import Any

from orchestrator import Orchestrator, Owner
from orchestrator.testing import wait_until
from tests.browser.test_console_pages import TOKENS, WorkerThread, sign_in
from tests.consoletools import Served

OWNER = Owner(tenant="acme", principal="alice")
GRANTS = {"alice": ["read", "queues"], "viewer": ["read"]}


def make_app(url: str) -> Orchestrator:
    app = Orchestrator(url, default_owner=OWNER, lease_ttl=5.0)
    app.queue("exports", concurrency=1)

    @app.workflow(queue="exports")
    async def export(ctx, n):  # type: ignore[no-untyped-def]
        await asyncio.sleep(0.05)
        return n

    return app


def statuses(sql: Any) -> list[str]:
    return sorted(r["status"] for r in sql("SELECT status FROM orchestrator.runs"))


def test_an_operator_pauses_changes_and_resumes_a_queue(
        migrated_database_url: str, browser_context: Any, sql: Any) -> None:
    app = make_app(migrated_database_url)
    console = app.console(tokens=TOKENS, grants=GRANTS)
    with WorkerThread(app), Served(console) as server:
        wait_until(lambda: sql("SELECT 1 FROM orchestrator.queues"), timeout=30,
                   what="the worker stored the queue")
        page = browser_context.new_page()
        sign_in(page, server.base, "alice")
        page.goto(f"{server.base}/queues")
        line = page.locator("tr.queue-line[data-queue=exports]")
        assert line.locator(".queue-state").inner_text() == "active"
        assert line.locator(".queue-concurrency").inner_text() == "1"

        form = page.locator("section.queue-action[data-queue=exports] form")
        form.locator("textarea[name=evidence]").fill("a release is going out")
        form.locator("button[value=pause]").click()
        page.wait_for_url(f"{server.base}/queues?done=queue_pause")
        assert "The queue is paused" in page.locator("p.notice.done").inner_text()
        assert line.locator(".queue-state").inner_text() == "paused"

        for n in range(3):
            app.submit("export", n)
        wait_until(lambda: len(statuses(sql)) == 3, timeout=10, what="three runs submitted")
        assert statuses(sql) == ["queued"] * 3  # nothing starts from a paused queue

        form = page.locator("section.queue-action[data-queue=exports] form")
        form.locator("input[name=concurrency]").fill("3")
        form.locator("input[name=rate]").fill("100/s")
        form.locator("textarea[name=evidence]").fill("the partner raised our quota")
        form.locator("button[value=set]").click()
        page.wait_for_url(f"{server.base}/queues?done=queue_set")
        assert line.locator(".queue-concurrency").inner_text() == "3"
        assert line.locator(".queue-rate").inner_text() == "100 per 1.0 s"

        form = page.locator("section.queue-action[data-queue=exports] form")
        form.locator("textarea[name=evidence]").fill("the release is out")
        form.locator("button[value=resume]").click()
        page.wait_for_url(f"{server.base}/queues?done=queue_resume")
        wait_until(lambda: statuses(sql) == ["succeeded"] * 3, timeout=30,
                   what="the runs ran once the queue was resumed")

        page.goto(f"{server.base}/audit")
        audit = page.locator("main").inner_text()
        assert "queue.pause" in audit and "queue.set" in audit and "queue.resume" in audit

        viewer = browser_context.new_page()
        viewer.context.clear_cookies()
        sign_in(viewer, server.base, "viewer")
        viewer.goto(f"{server.base}/queues")
        assert viewer.locator("tr.queue-line[data-queue=exports]").count() == 1
        assert viewer.locator("section.queue-action").count() == 0
    app.close()
