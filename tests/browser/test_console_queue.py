"""The reconciliation queue's bulk actions in headless chromium, with a real worker: an operator
filters the queue, resolves everything the filter selects after seeing the count (50), sees
the progress note while it runs and each item's result, and the runs go on; another ticks a few
rows and resolves only those."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from orchestrator import Orchestrator
from orchestrator.testing import wait_until
from tests.browser.test_console_pages import TOKENS, WorkerThread, make_app, sign_in
from tests.consoletools import Served

GRANTS = {"alice": ["read", "resolve", "bulk"], "viewer": ["read"]}


@contextmanager
def parked(url: str, sql: Any, orders: dict[str, str]) -> Iterator[tuple[Served, Orchestrator]]:
    """A run per order (order → workflow: ``pay`` calls ``charge``, ``give_back`` calls
    ``refund``) parked on its unknown operation, a worker running and the console served."""
    app = make_app(url)
    console = app.console(tokens=TOKENS, grants=GRANTS)
    with WorkerThread(app):
        for order, workflow in orders.items():
            app.submit(workflow, order, idempotency_key=f"sub-{order}")
        wait_until(lambda: len(sql("SELECT 1 FROM orchestrator.runs WHERE status = "
                                   "'needs_reconciliation'")) == len(orders), timeout=120,
                   what="every run parked on its unknown operation")
        with Served(console) as server:
            yield server, app
    app.close()


def operation_of(sql: Any, order: str) -> int:
    """The order's first operation (the one that parked; a re-send is another)."""
    (row,) = sql("SELECT min(id) AS id FROM orchestrator.operations "
                 "WHERE arguments->>'order' = %s", (order,))
    return int(row["id"])


def statuses(sql: Any, workflow: str) -> list[str]:
    return [r["status"] for r in sql("SELECT status FROM orchestrator.runs "
                                     "WHERE workflow_name = %s", (workflow,))]


def test_a_bulk_resolution_of_50_matching_items(
        migrated_database_url: str, browser_context: Any, sql: Any) -> None:
    orders = {f"c{i:02}": "pay" for i in range(50)} | {"r1": "give_back", "r2": "give_back"}
    evidence = "PSP export 2026-12-01: none of these 50 charges exists"
    with parked(migrated_database_url, sql, orders) as (server, _):
        page = browser_context.new_page()
        sign_in(page, server.base, "alice")
        assert page.locator("tr.queue-row").count() == 52
        page.fill("#queue-filters input[name=tool]", "charge")
        page.press("#queue-filters input[name=tool]", "Enter")
        page.locator("tr.queue-row").nth(50).wait_for(state="detached")
        assert page.locator("tr.queue-row").count() == 50
        form = page.locator("#bulk-form")
        form.locator("select[name=resolution]").select_option("not_applied")
        form.locator("select[name=then]").select_option("resend")
        form.locator("textarea[name=evidence]").fill(evidence)
        form.locator("button[type=submit]").click()
        count = page.locator("#bulk-count")
        count.wait_for()
        assert "This filter selects 50 unresolved operations" in count.inner_text()
        assert page.locator("#bulk-confirm q").inner_text() == evidence
        assert sql("SELECT 1 FROM orchestrator.operator_audit") == []

        during: list[bool] = []

        def while_it_runs(route: Any) -> None:
            # the request is on its way: the page says so and the button cannot be pressed
            during.append(page.locator("#bulk-progress").is_visible())
            during.append(page.locator("#bulk-confirm button[type=submit]").is_disabled())
            route.continue_()

        assert not page.locator("#bulk-progress").is_visible()
        page.route("**/operations/bulk", while_it_runs)
        page.locator("#bulk-confirm button[type=submit]").click()
        result = page.locator("#bulk-result")
        result.wait_for(timeout=60_000)
        assert during == [True, True]
        assert result.inner_text() == ("Resolved 50 of 50 operations as not applied; "
                                       "skipped 0.")
        assert page.locator("tr.bulk-outcome.o-resolved").count() == 50
        audit = sql("SELECT operator, action, evidence, target_id "
                    "FROM orchestrator.operator_audit")
        assert len(audit) == 50
        assert {(a["operator"], a["action"], a["evidence"]) for a in audit} == {
            ("alice", "resolve.not_applied", evidence)}
        assert {int(a["target_id"]) for a in audit} == {
            operation_of(sql, o) for o, wf in orders.items() if wf == "pay"}
        wait_until(lambda: statuses(sql, "pay") == ["succeeded"] * 50, timeout=120,
                   what="the 50 runs sent their charges again and succeeded")
        assert statuses(sql, "give_back") == ["needs_reconciliation"] * 2


def test_an_operator_ticks_three_rows_and_resolves_only_those(
        migrated_database_url: str, browser_context: Any, sql: Any) -> None:
    orders = {f"c{i}": "pay" for i in range(5)}
    chosen = ("c0", "c2", "c3")
    with parked(migrated_database_url, sql, orders) as (server, app):
        page = browser_context.new_page()
        sign_in(page, server.base, "alice")
        shown = page.locator("[data-selected-count=selected-form]")
        page.check("input[data-select-all=selected-form]")  # every row of the page …
        assert shown.inner_text() == "5 selected"
        page.uncheck("input[data-select-all=selected-form]")  # … and none again
        assert shown.inner_text() == "0 selected"
        for order in chosen:
            page.check(f"input[name=id][value='{operation_of(sql, order)}']")
        assert shown.inner_text() == "3 selected"
        assert page.eval_on_selector("input[data-select-all=selected-form]",
                                     "box => box.indeterminate") is True
        form = page.locator("#selected-form")
        form.locator("select[name=resolution]").select_option("committed")
        form.locator("textarea[name=receipt]").fill('{"charge": "ch_by_hand"}')
        form.locator("textarea[name=evidence]").fill("PSP dashboard shows these three")
        form.locator("button[type=submit]").click()
        count = page.locator("#bulk-count")
        count.wait_for()
        assert count.inner_text() == "Of the 3 selected operations, 3 still wait."
        page.locator("#bulk-confirm button[type=submit]").click()
        result = page.locator("#bulk-result")
        result.wait_for(timeout=60_000)
        assert result.inner_text() == "Resolved 3 of 3 operations as committed; skipped 0."
        assert sorted(int(x) for x in page.locator(
            "tr.bulk-outcome.o-resolved td:first-child").all_inner_texts()) == sorted(
            operation_of(sql, o) for o in chosen)
        audit = sql("SELECT action, target_id, evidence FROM orchestrator.operator_audit")
        assert sorted(int(a["target_id"]) for a in audit) == sorted(
            operation_of(sql, o) for o in chosen)
        assert {a["action"] for a in audit} == {"resolve.committed"}
        for order in chosen:
            handle = app.get_run(sql("SELECT run_id FROM orchestrator.operations WHERE id = %s",
                                     (operation_of(sql, order),))[0]["run_id"])
            assert handle.result(timeout=60) == {"charge": "ch_by_hand"}
        assert sorted(statuses(sql, "pay")) == ["needs_reconciliation"] * 2 + ["succeeded"] * 3
        page.goto(f"{server.base}/operations")
        assert page.locator("tr.queue-row").count() == 2  # the others still wait
