"""The console's ``GET /metrics``: the gauges read from the database, for an operator with the
``metrics`` grant (a scraper's token), in the Prometheus text format or OpenMetrics."""

from __future__ import annotations

from typing import Any

from prometheus_client.openmetrics.parser import text_string_to_metric_families as openmetrics
from prometheus_client.parser import text_string_to_metric_families as classic

from tests.consoletools import Client, from_header, uncertain_app
from tests.integration.conftest import OWNER, running, wait_for


async def test_an_operator_with_the_metrics_grant_scrapes_the_database_gauges(
        make_app, sql) -> None:  # type: ignore[no-untyped-def]
    app = uncertain_app(make_app, operator_scopes={"scraper": ["acme"], "alice": ["acme"]})
    async with running(app):
        await app.submit_async("pay", "o1", owner=OWNER)
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs") == [
            {"status": "needs_reconciliation"}], timeout=60)
    console = app.console(from_header, {"scraper": ["metrics"], "alice": ["read", "resolve"]})
    async with Client(console, "scraper") as scraper, Client(console, "alice") as alice, \
            Client(console, None) as nobody:
        answer = await scraper.get("/metrics")
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/plain")
        samples: dict[str, Any] = {(s.name, tuple(sorted(s.labels.items()))): s.value
                                   for f in classic(answer.text) for s in f.samples}
        assert samples[("orchestrator_database_up", ())] == 1
        assert samples[("orchestrator_unknown_operations", (("tool", "charge"),))] == 1
        asked = await scraper.http.get("/metrics",
                                       headers={"Accept": "application/openmetrics-text"})
        assert asked.headers["content-type"].startswith("application/openmetrics-text")
        assert "orchestrator_unknown_operations" in {f.name for f in openmetrics(asked.text)}
        assert (await alice.get("/metrics")).status_code == 403  # no metrics grant
        assert (await nobody.get("/metrics")).status_code == 401
    await app.database.close()


async def test_the_console_counts_what_operators_and_owners_do_through_it(
        make_app, sql) -> None:  # type: ignore[no-untyped-def]
    """A resolution made on the console is counted where it was made, the console process, and
    its ``/metrics`` serves that process's counters beside the gauges: otherwise no scrape
    would ever show ``resolver="operator"`` (C12)."""
    app = uncertain_app(make_app, operator_scopes={"scraper": ["acme"], "alice": ["acme"]})
    async with running(app):
        await app.submit_async("pay", "o1", owner=OWNER)
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs") == [
            {"status": "needs_reconciliation"}], timeout=60)
    (op,) = sql("SELECT id FROM orchestrator.operations")
    queued = await app.submit_async("pay", "o2", owner=OWNER)  # no worker: it stays queued
    console = app.console(from_header, {"scraper": ["metrics"],
                                        "alice": ["read", "resolve", "cancel"]})
    async with Client(console, "scraper") as scraper, Client(console, "alice") as alice:
        done = await alice.post(f"/api/operations/{op['id']}/resolve", {
            "resolution": "committed", "receipt": {"charge": "ch_1"},
            "evidence": "PSP dashboard shows ch_1"})
        assert done.status_code == 200, done.text
        cancelled = await alice.post(f"/api/runs/{queued.id}/cancel",
                                     {"evidence": "the customer called"})
        assert cancelled.status_code == 200, cancelled.text
        again = await alice.post(f"/api/runs/{queued.id}/cancel", {"evidence": "twice"})
        assert again.status_code == 200, again.text  # of a finished run: not counted
        answer = await scraper.get("/metrics")
        samples: dict[str, Any] = {(s.name, tuple(sorted(s.labels.items()))): s.value
                                   for f in classic(answer.text) for s in f.samples}
        assert samples[("orchestrator_reconciliation_outcomes_total",
                        (("answer", "committed"), ("resolver", "operator")))] == 1
        assert samples[("orchestrator_cancellations_total", (("stage", "requested"),))] == 1
        assert samples[("orchestrator_database_up", ())] == 1
    await app.database.close()
