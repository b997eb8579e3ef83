"""The console in headless chromium on an operation whose call is in flight (``submitted``,
not in the reconciliation queue): its page says what to wait for and offers no resolve form;
a resolution sent for it meanwhile is refused with the page again, the form kept as the
operator filled it in, to be sent again once the operation enters the queue."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest

from orchestrator import Orchestrator, ToolError
from orchestrator.testing import wait_until
from tests.browser.test_console_pages import GRANTS, OWNER, TOKENS, WorkerThread, sign_in
from tests.consoletools import Served

EVIDENCE = "Carrier portal, 09:14: no shipment\nunder this key"


@pytest.fixture
def in_flight(migrated_database_url: str, sql: Any
              ) -> Iterator[tuple[Served, int, threading.Event]]:
    """A run whose ``ship`` call is in flight until the returned event is set (then its
    outcome is lost after sending: unknown, in the queue), a worker and the console served;
    yields the server, the operation's id and the event."""
    app = Orchestrator(migrated_database_url, default_owner=OWNER, lease_ttl=5.0,
                       operator_scopes={"alice": ["acme"], "viewer": ["acme"]})
    release = threading.Event()

    @app.tool(timeout=timedelta(seconds=120))
    async def ship(ctx, *, order):  # type: ignore[no-untyped-def]
        await asyncio.to_thread(release.wait, 90)
        raise ToolError.after_send("timeout", "the carrier did not answer")

    @app.workflow()
    async def send(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(ship, order=order)

    console = app.console(tokens=TOKENS, grants=GRANTS)
    try:
        with WorkerThread(app), Served(console) as server:
            app.submit(send, "o1", idempotency_key="send-o1")
            (op,) = wait_until(lambda: sql("SELECT id FROM orchestrator.operations WHERE "
                                           "state = 'submitted'"), timeout=30)
            yield server, op["id"], release
            release.set()
    finally:
        release.set()
        app.close()


def test_the_page_of_an_operation_in_flight_says_what_to_wait_for(
        in_flight: Any, browser_context: Any, sql: Any) -> None:
    server, op, _ = in_flight
    page = browser_context.new_page()
    sign_in(page, server.base, "alice")
    page.goto(f"{server.base}/operations/{op}")
    assert page.locator("h1").inner_text().startswith(f"Operation {op}")
    assert "submitted" in page.locator("h1").inner_text()
    wait = page.locator("#wait").inner_text()
    assert wait.startswith(f"Not in the reconciliation queue: operation {op} is submitted: "
                           "its call is in flight"), wait
    assert "wait until it ends or enters the reconciliation queue" in wait
    assert page.locator("form[action$='/resolve']").count() == 0
    assert page.locator("text=Mark committed").count() == 0
    attempts = page.locator("section:has(h2:text('Attempts at this position')) tbody tr")
    assert attempts.count() == 1 and "submitted" in attempts.first.inner_text()
    assert "only an operation in the reconciliation queue is looked up" in page.inner_text(
        "body")
    assert sql("SELECT 1 FROM orchestrator.operator_audit") == []


def test_a_refused_resolution_keeps_what_the_operator_typed_to_send_again(
        in_flight: Any, browser_context: Any, sql: Any) -> None:
    server, op, release = in_flight
    page = browser_context.new_page()
    sign_in(page, server.base, "alice")
    page.goto(f"{server.base}/operations/{op}")
    # a form loaded before (another tab, a bookmark): sent while the call is in flight
    page.evaluate("""([action, evidence]) => {
        const form = document.createElement("form");
        form.method = "post"; form.action = action;
        const token = document.querySelector("meta[name=csrf-token]").content;
        for (const [name, value] of [["csrf_token", token], ["resolution", "not_applied"],
                                     ["then", "fail"], ["evidence", evidence]]) {
            const field = document.createElement("input");
            field.type = "hidden"; field.name = name; field.value = value;
            form.appendChild(field);
        }
        document.body.appendChild(form);
        form.submit();
    }""", [f"{server.base}/operations/{op}/resolve", EVIDENCE])
    page.locator(".notice.failure").wait_for()
    assert "OPERATION_IN_PROGRESS" in page.locator(".notice.failure").inner_text()
    assert page.locator("#wait").count() == 1
    kept = page.locator("#resolve-not-applied")
    assert kept.locator("textarea[name=evidence]").input_value() == EVIDENCE
    assert kept.locator("select[name=then]").input_value() == "fail"
    assert page.locator("#resolve-committed, #resolve-abandon").count() == 0
    assert sql("SELECT 1 FROM orchestrator.operator_audit") == []

    release.set()  # the call's outcome is lost: the operation enters the queue
    wait_until(lambda: sql("SELECT 1 FROM orchestrator.reconciliation_items WHERE "
                           "operation_id = %s", (op,)), timeout=30)
    kept.locator("button[type=submit]").click()  # sent again as it was typed
    page.wait_for_url(re.compile(rf"/operations/{op}\?done=not_applied$"))
    assert page.locator("#resolution").inner_text() == "not_applied"
    assert sql("SELECT operator, action, evidence, after->>'then' AS then "
               "FROM orchestrator.operator_audit") == [
        {"operator": "alice", "action": "resolve.not_applied", "evidence": EVIDENCE,
         "then": "fail"}]
