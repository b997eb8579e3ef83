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
