"""The exporter's database gauges (docs/metrics.md): the values, and queries that an index
can answer (a scrape never scans every run or every operation)."""

from __future__ import annotations

from typing import Any

import psycopg
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator.db import gauges
from orchestrator.telemetry import DatabaseCollector


def _scrape(target: Any) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(DatabaseCollector(target))
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(generate_latest(registry).decode()):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = (
                sample.value)
    return samples


def test_queued_runs_by_workflow_with_the_oldest_age(app, sql):  # type: ignore[no-untyped-def]
    @app.workflow()
    async def pay(ctx, data):  # type: ignore[no-untyped-def]
        return data

    @app.workflow()
    async def ship(ctx, data):  # type: ignore[no-untyped-def]
        return data

    paid = [app.submit(pay, {"n": n}) for n in range(3)]
    app.submit(ship, {})
    sql("UPDATE orchestrator.runs SET available_at = now() - interval '90 seconds' "
        "WHERE id = %s", (paid[0].id,))
    sql("UPDATE orchestrator.runs SET available_at = now() + interval '1 hour' "
        "WHERE id = %s", (paid[1].id,))  # not ready yet: not in the backlog
    samples = _scrape(app.target)
    assert samples["orchestrator_database_up"] == {(): 1}
    assert samples["orchestrator_runs_queued"] == {
        (("workflow", "pay"),): 2, (("workflow", "ship"),): 1}
    age = samples["orchestrator_runs_queued_oldest_age_seconds"]
    assert 90 <= age[(("workflow", "pay"),)] < 150
    assert 0 <= age[(("workflow", "ship"),)] < 60
    assert "orchestrator_unknown_operations" not in samples


def _plan(url: str, query: str) -> str:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute("SET enable_seqscan = off")
        return "\n".join(row[0] for row in conn.execute(f"EXPLAIN {query}").fetchall())


def test_the_gauge_queries_are_answered_by_partial_indexes(  # type: ignore[no-untyped-def]
        app):
    unknown = _plan(app.target.url, gauges.UNKNOWN_BY_TOOL)
    assert "ix_operations_unknown_tool" in unknown
    assert "Seq Scan on operations" not in unknown
    queued = _plan(app.target.url, gauges.QUEUED_BY_WORKFLOW)
    assert "ix_runs_claimable" in queued and "ix_runs_queue_ready" in queued
    assert "Seq Scan on runs" not in queued
