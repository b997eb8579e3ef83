"""``orchestrator worker --metrics-port``: a real worker process serves its counters and the
database gauges at ``/metrics`` and its health at ``/healthz`` (docs/metrics.md)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client.parser import text_string_to_metric_families

from orchestrator import Orchestrator
from tests.acceptance import metrics_flows
from tests.acceptance.conftest import ROOT, Workers

APP = "tests.acceptance.metrics_flows:app"


@pytest.fixture
def client(migrated_database_url: str) -> Iterator[Orchestrator]:
    os.environ["ORCHESTRATOR_DATABASE_URL"] = migrated_database_url
    app = Orchestrator(migrated_database_url, default_owner=metrics_flows.app.default_owner)
    app.registry = metrics_flows.app.registry
    yield app
    app.close()
    os.environ.pop("ORCHESTRATOR_DATABASE_URL", None)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _scrape(port: int) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = (
                sample.value)
    return samples


def test_a_worker_serves_its_metrics_and_health(workers: Workers, client: Orchestrator) -> None:
    port = _free_port()
    proc = workers.start("metrics", app=APP, args=["--metrics-port", str(port)])
    runs = [client.submit(metrics_flows.succeeds, {"n": n}) for n in range(3)]
    failing = client.submit(metrics_flows.fails, {})
    blocked = client.submit(metrics_flows.uncertain, {})
    assert [run.result(timeout=30) for run in runs] == [{"n": 0}, {"n": 1}, {"n": 2}]
    workers.wait(lambda: failing.status() == "failed", "the failing run to fail")
    workers.wait(lambda: blocked.status() == "needs_reconciliation",
                 "the uncertain run to wait for reconciliation")

    samples = _scrape(port)
    assert samples["orchestrator_runs_finished_total"] == {
        (("outcome", "succeeded"),): 3, (("outcome", "failed"),): 1,
        (("outcome", "cancelled"),): 0}
    assert samples["orchestrator_operations_unknown_total"] == {
        (("cause", "TOOL_OUTCOME_UNCERTAIN"), ("tool", "charge")): 1}
    assert samples["orchestrator_tool_attempts_total"] == {
        (("tool", "charge"),): 1, (("tool", "echo"),): 3}
    assert samples["orchestrator_database_up"] == {(): 1}
    assert samples["orchestrator_unknown_operations"] == {(("tool", "charge"),): 1}
    assert samples["orchestrator_unknown_operations_oldest_age_seconds"][
        (("tool", "charge"),)] >= 0
    assert samples.get("orchestrator_runs_queued", {}) == {}  # every run was claimed
    assert samples["orchestrator_worker_slots"] == {
        (("state", "used"),): 0, (("state", "free"),): 10}
    assert (samples["orchestrator_event_loop_lag_seconds"][()]) >= 0

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as response:
        assert response.status == 200
        health = json.loads(response.read())
    assert health["alive"] is True and health["database_reachable"] is True
    assert health["event_loop_lag_seconds"] >= 0

    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    with pytest.raises(OSError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2)


def test_a_reconciler_serves_the_operator_queue(workers: Workers, client: Orchestrator) -> None:
    """The tool has no lookup: the reconciler hands the item to operators, and its own
    endpoint shows the queue (and no worker slots: it has none)."""
    workers.start("worker", app=APP)
    blocked = client.submit(metrics_flows.uncertain, {})
    workers.wait(lambda: blocked.status() == "needs_reconciliation",
                 "the uncertain run to wait for reconciliation")
    port = _free_port()
    reconciler = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "reconciler", "--app", APP,
         "--metrics-port", str(port)], cwd=ROOT,
        env={**os.environ, "ORCHESTRATOR_DATABASE_URL": workers.url, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers.procs.append(reconciler)
    workers.wait(lambda: workers.sql(
        "SELECT 1 FROM orchestrator.reconciliation_items WHERE state = 'operator'"),
        "the item to reach the operators' queue", proc=reconciler)

    def scraped() -> dict[str, dict[tuple[tuple[str, str], ...], float]] | None:
        try:
            return _scrape(port)
        except OSError:
            return None  # not listening yet

    workers.wait(scraped, "the reconciler's metrics endpoint", proc=reconciler)
    samples = _scrape(port)
    assert samples["orchestrator_operator_queue_items"] == {(("tool", "charge"),): 1}
    assert samples["orchestrator_operator_queue_oldest_age_seconds"][
        (("tool", "charge"),)] >= 0
    assert samples["orchestrator_unknown_operations"] == {(("tool", "charge"),): 1}
    assert "orchestrator_worker_slots" not in samples
    assert samples["orchestrator_runs_finished_total"][(("outcome", "failed"),)] == 0
    reconciler.send_signal(signal.SIGTERM)
    assert reconciler.wait(timeout=30) == 0
