"""The console in headless chromium, served by uvicorn, with a real worker: an operator filters
the reconciliation queue, opens an operation, resolves it with evidence, sees the run go on
and the audit entry; a read-only operator sees no action and a forged POST is refused; an
input holding a script is shown as text and never runs; the Workers page keys each worker state
to what it means."""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from orchestrator import Orchestrator, Owner, ToolError
from orchestrator.testing import wait_until
from tests.consoletools import Served

OWNER = Owner(tenant="acme", principal="alice")
TOKENS = {"alice": "alice-token-" + "a" * 20, "viewer": "viewer-token-" + "v" * 20}
GRANTS = {"alice": ["read", "resolve", "cancel"], "viewer": ["read"]}


def make_app(url: str) -> Orchestrator:
    """Two tools whose first call per order is lost after sending (outcome unknown) and
    whose later calls succeed; ``pay`` calls ``charge``, ``give_back`` calls ``refund``."""
    app = Orchestrator(url, default_owner=OWNER, lease_ttl=5.0,
                       operator_scopes={"alice": ["acme"], "viewer": ["acme"]})
    calls: dict[str, int] = {}

    def lost_once(order: Any) -> None:
        calls[repr(order)] = calls.get(repr(order), 0) + 1
        if calls[repr(order)] == 1:
            raise ToolError.after_send("timeout", "the PSP did not answer")

    @app.tool(max_attempts=2)
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        lost_once(order)
        return {"charge": "ch_auto"}

    @app.tool(max_attempts=2)
    async def refund(ctx, *, order):  # type: ignore[no-untyped-def]
        lost_once(order)
        return {"refund": "re_auto"}

    @app.workflow()
    async def pay(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(charge, order=order)

    @app.workflow()
    async def give_back(ctx, order):  # type: ignore[no-untyped-def]
        return await ctx.call(refund, order=order)

    return app


class WorkerThread:
    """A worker of ``app`` on its own event loop in a thread, until :meth:`stop`."""

    def __init__(self, app: Orchestrator) -> None:
        self.app = app
        self.ready = threading.Event()
        self.thread = threading.Thread(target=asyncio.run, args=(self._main(),), daemon=True)

    async def _main(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.worker = self.app.create_worker(poll_interval=0.2)
        self.ready.set()
        try:
            await self.worker.run()
        finally:
            await self.app.database.close()

    def __enter__(self) -> WorkerThread:
        self.thread.start()
        assert self.ready.wait(30)
        return self

    def __exit__(self, *exc: object) -> None:
        self.loop.call_soon_threadsafe(self.worker.request_stop)
        self.thread.join(60)
        assert not self.thread.is_alive()


@pytest.fixture
def served(migrated_database_url: str, sql: Any) -> Iterator[tuple[Served, Orchestrator]]:
    """Three runs parked on unknown operations (two charges, one refund), a worker running
    and the console served; the browser signs in with :data:`TOKENS`."""
    app = make_app(migrated_database_url)
    console = app.console(tokens=TOKENS, grants=GRANTS)
    with WorkerThread(app):
        for order, workflow in (("o1", "pay"), ("o2", "pay"), ("r1", "give_back")):
            app.submit(workflow, order, idempotency_key=f"sub-{order}")
        wait_until(lambda: len(sql("SELECT 1 FROM orchestrator.runs WHERE status = "
                                   "'needs_reconciliation'")) == 3, timeout=60)
        with Served(console) as server:
            yield server, app
    app.close()


def sign_in(page: Any, base: str, operator: str) -> None:
    page.goto(f"{base}/operations")
    assert "/login" in page.url  # a browser without a session is sent to sign in
    page.fill("input[name=token]", TOKENS[operator])
    page.click("button[type=submit]")
    page.wait_for_url(f"{base}/operations")


def test_an_operator_filters_opens_resolves_and_sees_the_run_go_on(
        served: Any, browser_context: Any, sql: Any) -> None:
    server, app = served
    page = browser_context.new_page()
    sign_in(page, server.base, "alice")
    assert page.locator("tr.queue-row").count() == 3
    page.fill("input[name=tool]", "refund")
    page.press("input[name=tool]", "Enter")  # htmx swaps the table in place
    # wait by locator, not wait_for_function: its polling evaluates a string, which the
    # console's CSP (no eval) refuses
    page.locator("tr.queue-row").nth(1).wait_for(state="detached")
    assert page.locator("tr.queue-row").count() == 1
    assert "tool=refund" in page.url  # and the filter is in the address
    row = page.locator("tr.queue-row")
    assert "refund" in row.inner_text()
    row.locator("td a").first.click()
    page.wait_for_url(re.compile(r"/operations/\d+$"))
    op = int(page.url.rsplit("/", 1)[1])
    assert page.locator("h1").inner_text().startswith(f"Operation {op}")
    form = page.locator("#resolve-committed")
    form.locator("textarea[name=receipt]").fill('{"refund": "re_by_hand"}')
    form.locator("textarea[name=evidence]").fill("PSP dashboard: refund re_by_hand exists")
    form.locator("button[type=submit]").click()
    page.wait_for_url(re.compile(rf"/operations/{op}\?done=committed$"))
    assert "resolved as committed" in page.locator(".notice.done").inner_text()
    assert page.locator("#resolution").inner_text() == "committed"
    page.click("#run-link")
    page.wait_for_url(re.compile(r"/runs/[0-9a-f-]+$"))
    run_url = page.url

    def succeeded() -> bool:
        page.goto(run_url)
        return "succeeded" in page.locator("h1").inner_text()

    wait_until(succeeded, timeout=30, what="the run page shows the run succeeded")
    assert '"re_by_hand"' in page.locator("#run-result").inner_text()
    page.click("nav >> text=Audit log")
    page.wait_for_url(f"{server.base}/audit")
    entry = page.locator("tr.audit-row").first.inner_text()
    assert "alice" in entry and "resolve.committed" in entry
    assert "refund re_by_hand exists" in entry
    assert sql("SELECT operator, action FROM orchestrator.operator_audit") == [
        {"operator": "alice", "action": "resolve.committed"}]


def test_a_read_only_operator_sees_no_action_and_a_forged_post_is_refused(
        served: Any, browser_context: Any, sql: Any) -> None:
    server, _ = served
    page = browser_context.new_page()
    sign_in(page, server.base, "viewer")
    op = sql("SELECT min(id) AS id FROM orchestrator.operations")[0]["id"]
    run_id = sql("SELECT run_id FROM orchestrator.operations WHERE id = %s", (op,))[0]["run_id"]
    for path in ("/operations", f"/operations/{op}", f"/runs/{run_id}", "/"):
        page.goto(server.base + path)
        assert page.locator("h1").count() == 1
        actions = page.locator("form[method=post]:not([action$='/logout'])")
        assert actions.count() == 0, path
        assert page.locator("text=Mark committed").count() == 0
        assert page.locator("text=Cancel this run").count() == 0
    # forged: the viewer's own session and CSRF token, a POST the page never offered
    token = page.locator("meta[name=csrf-token]").get_attribute("content")
    forged = page.request.post(f"{server.base}/operations/{op}/resolve", form={
        "csrf_token": token, "resolution": "abandoned", "evidence": "forged"},
        max_redirects=0)
    assert forged.status == 403 and "FORBIDDEN" in forged.text()
    api = page.request.post(f"{server.base}/api/operations/{op}/abandon",
                            data={"evidence": "forged"}, headers={"X-CSRF-Token": token})
    assert api.status == 403 and api.json()["code"] == "FORBIDDEN"
    no_token = page.request.post(f"{server.base}/api/operations/{op}/abandon",
                                 data={"evidence": "forged"})
    assert no_token.status == 403
    assert sql("SELECT state FROM orchestrator.operations WHERE id = %s", (op,)) == [
        {"state": "unknown"}]
    assert sql("SELECT 1 FROM orchestrator.operator_audit") == []


def test_an_input_holding_a_script_renders_as_text(
        served: Any, browser_context: Any, sql: Any) -> None:
    server, app = served
    hostile = {"note": "<script>window.__ran = 1</script>",
               "img": "<img src=x onerror=\"window.__ran = 2\">"}
    handle = app.submit("pay", hostile)
    wait_until(lambda: sql("SELECT status FROM orchestrator.runs WHERE id = %s",
                           (handle.id,))[0]["status"] == "needs_reconciliation", timeout=30)
    page = browser_context.new_page()
    sign_in(page, server.base, "alice")
    for path in (f"/runs/{handle.id}", "/operations", "/runs"):
        page.goto(server.base + path)
        assert page.evaluate("window.__ran") is None, path
    page.goto(f"{server.base}/runs/{handle.id}")
    shown = page.locator("#run-input").inner_text()
    assert "<script>window.__ran = 1</script>" in shown
    assert page.locator("#run-input script, #run-input img").count() == 0


def test_a_runs_timeline_gains_entries_live_while_a_worker_executes_it(
        migrated_database_url: str, browser_context: Any, sql: Any) -> None:
    app = Orchestrator(migrated_database_url, default_owner=OWNER, lease_ttl=5.0,
                       operator_scopes={"alice": ["acme"]})

    @app.workflow()
    async def story(ctx, steps):  # type: ignore[no-untyped-def]
        for step in range(steps):
            ctx.publish({"step": step})
        told = await ctx.wait_for_event("go")
        await ctx.sleep(0.3)
        ctx.publish({"told": told})
        return "told"

    console = app.console(tokens=TOKENS, grants=GRANTS)
    with WorkerThread(app), Served(console) as server:
        handle = app.submit("story", 2, idempotency_key="live")
        wait_until(lambda: sql("SELECT status FROM orchestrator.runs WHERE id = %s",
                               (handle.id,))[0]["status"] == "waiting", timeout=30)
        page = browser_context.new_page()
        sign_in(page, server.base, "alice")
        page.goto(f"{server.base}/runs/{handle.id}")
        rows = page.locator("#timeline tbody tr")
        before = rows.count()
        assert before == len(sql("SELECT 1 FROM orchestrator.journal WHERE run_id = %s",
                                 (handle.id,)))
        page.evaluate("window.__same_page = true")  # gone if the page were loaded again
        app.send_event(handle.id, "go", {"by": "alice"})
        page.locator("#timeline[data-ended='run.completed']").wait_for(state="attached",
                                                                       timeout=30_000)
        journal = sql("SELECT seq, kind FROM orchestrator.journal WHERE run_id = %s "
                      "ORDER BY seq", (handle.id,))
        assert rows.count() == len(journal) > before
        shown = [(int(r.locator("td").nth(0).inner_text()), r.locator("code").inner_text())
                 for r in rows.all()]
        assert shown == [(e["seq"], e["kind"]) for e in journal]  # each once, in order
        assert page.locator("#timeline tbody tr.live").count() == len(journal) - before
        assert '"by": "alice"' in rows.nth(before).inner_text()
        assert page.evaluate("window.__same_page") is True
        assert "waiting" in page.locator("h1").inner_text()  # the page was never reloaded
    app.close()


def test_the_workers_page_keys_each_state_to_its_meaning(
        migrated_database_url: str, browser_context: Any, sql: Any) -> None:
    """Under the table, each state is a term of its own, in the table's badge for that state,
    beside what it means (on one line on a wide screen), so that an operator finds the state
    a worker shows without reading one long paragraph."""
    app = make_app(migrated_database_url)
    console = app.console(tokens=TOKENS, grants=GRANTS)
    with WorkerThread(app) as worker, Served(console) as server:
        wait_until(lambda: sql("SELECT 1 FROM orchestrator.workers WHERE id = %s",
                               (worker.worker.worker_id,)), timeout=30)
        page = browser_context.new_page()
        page.set_viewport_size({"width": 1400, "height": 900})
        sign_in(page, server.base, "viewer")
        page.goto(f"{server.base}/workers")
        badge = page.locator("table.grid strong.holder")
        assert badge.inner_text() == "live"
        states = page.locator("#worker-states")
        terms = states.locator("dt")
        assert terms.all_inner_texts() == ["live", "draining", "waiting", "silent", "dead"]
        for term in terms.all():
            assert term.get_attribute("class") == f"holder h-{term.inner_text()}"
        meanings = states.locator("dd").all_inner_texts()
        assert meanings[0] == "it heartbeats"
        assert meanings[2].startswith("it heartbeats, but holds no liveness lock yet")
        assert meanings[3].startswith("no recent heartbeat")
        assert len(meanings) == 5 and all(meanings)

        def colour(locator: Any) -> str:
            return str(locator.evaluate("e => getComputedStyle(e).color"))

        assert colour(terms.first) == colour(badge) != colour(states.locator("dd").first)
        assert colour(terms.last) != colour(terms.first)  # dead is not drawn as live
        for term, meaning in zip(terms.all(), states.locator("dd").all(), strict=True):
            assert term.bounding_box()["y"] == meaning.bounding_box()["y"], term.inner_text()
        after = page.locator("#worker-states + p")
        assert after.inner_text() == "A worker that stopped cleanly is no longer listed."
    app.close()
