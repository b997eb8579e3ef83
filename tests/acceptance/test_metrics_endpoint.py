"""``orchestrator worker --metrics-port``: a real worker process serves its counters and the
database gauges at ``/metrics`` and its health at ``/healthz`` (docs/metrics.md)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import pytest
import yaml
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


def _start_reconciler(workers: Workers, port: int) -> subprocess.Popen[bytes]:
    """``orchestrator reconciler`` of the test application, serving ``--metrics-port``; the
    fixture stops it with the workers."""
    reconciler = subprocess.Popen(
        [sys.executable, "-m", "orchestrator", "reconciler", "--app", APP,
         "--metrics-port", str(port)], cwd=ROOT,
        env={**os.environ, "ORCHESTRATOR_DATABASE_URL": workers.url, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    workers.procs.append(reconciler)
    return reconciler


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
        (("outcome", "cancelled"),): 0, (("outcome", "continued"),): 0}
    assert samples["orchestrator_operations_unknown_total"] == {
        (("cause", "TOOL_OUTCOME_UNCERTAIN"), ("tool", "charge")): 1}
    assert samples["orchestrator_tool_attempts_total"] == {
        (("attempt_kind", "initial"), ("tool", "charge")): 1,
        (("attempt_kind", "initial"), ("tool", "echo")): 3}
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
    reconciler = _start_reconciler(workers, port)
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


def _histogram_counts(samples: dict[str, dict[tuple[tuple[str, str], ...], float]], name: str
                      ) -> dict[tuple[tuple[str, str], ...], float]:
    return samples.get(f"{name}_count", {})


def test_a_known_workload_is_scraped_exactly(workers: Workers, client: Orchestrator) -> None:
    """A worker and a reconciler with --metrics-port, and a workload whose every count is
    known: two runs that succeed, a call retried once (refused before it was sent), an
    unknown outcome a lookup settles and one an operator settles, a cancellation that
    interrupts a call in flight, and a sleep that outlasts the run's deadline."""
    port, rport = _free_port(), _free_port()
    workers.start("metrics", app=APP, args=["--metrics-port", str(port)])
    _start_reconciler(workers, rport)
    flows = metrics_flows
    ok = [client.submit(flows.succeeds, {"n": n}) for n in range(2)]
    retried = client.submit(flows.retried, {})
    looked_up = client.submit(flows.looked_up, {})
    operator = client.submit(flows.uncertain, {})
    stalled = client.submit(flows.stalled, {})
    late = client.submit(flows.late, {}, deadline=timedelta(seconds=3))
    assert [r.result(timeout=30) for r in ok] == [{"n": 0}, {"n": 1}]
    assert retried.result(timeout=30) == {"n": 1}
    assert looked_up.result(timeout=60) == {"shipped": 2}  # the reconciler's lookup
    workers.wait(lambda: operator.status() == "needs_reconciliation", "the operator's item")
    [op] = workers.sql("SELECT o.id FROM orchestrator.operations o WHERE o.run_id = %s",
                       (operator.id,))
    client._portal.call(client.operators.resolve_committed(
        op["id"], receipt={"n": 1}, evidence="the provider's dashboard shows it",
        operator="alice"))
    assert operator.result(timeout=30) == {"n": 1}
    workers.wait(lambda: workers.sql(
        "SELECT 1 FROM orchestrator.operations WHERE tool_name = 'slow_read' "
        "AND state = 'submitted'"), "the read to be in flight")
    assert stalled.cancel() == "running"
    workers.wait(lambda: stalled.status() == "cancelled", "the cancellation")
    workers.wait(lambda: late.status() == "failed", "the deadline")

    s = _scrape(port)
    assert s["orchestrator_runs_started_total"] == {
        (("workflow", w),): n for w, n in (("succeeds", 2), ("retried", 1), ("looked_up", 1),
                                          ("uncertain", 1), ("stalled", 1), ("late", 1))}
    assert s["orchestrator_runs_finished_total"] == {
        (("outcome", "succeeded"),): 5, (("outcome", "failed"),): 1,
        (("outcome", "cancelled"),): 1, (("outcome", "continued"),): 0}
    assert s["orchestrator_tool_attempts_total"] == {
        (("attempt_kind", "initial"), ("tool", t)): n
        for t, n in (("echo", 2), ("flaky", 1), ("ship", 1), ("charge", 1), ("slow_read", 1))
    } | {(("attempt_kind", "retry"), ("tool", "flaky")): 1}
    assert s["orchestrator_tool_retries_total"] == {(("tool", "flaky"),): 1}
    assert s["orchestrator_tool_failures_total"] == {
        (("cause", "connection_before_send"), ("phase", "tool"), ("tool", "flaky")): 1}
    assert _histogram_counts(s, "orchestrator_retry_delay_seconds") == {
        (("delay_class", "backoff"),): 1}
    assert s["orchestrator_operations_unknown_total"] == {
        (("cause", "TOOL_OUTCOME_UNCERTAIN"), ("tool", t)): 1
        for t in ("charge", "ship", "slow_read")}
    assert s["orchestrator_cancellations_total"] == {
        (("stage", "observed"),): 1, (("stage", "provider_aborted"),): 1,
        (("stage", "effect_resolved"),): 1}
    assert s["orchestrator_deadlines_exhausted_total"] == {(): 1}
    # Parked: the two blocked calls and the sleep; each claimed again once, and replayed.
    assert s["orchestrator_run_parks_total"] == {(): 3}
    assert s["orchestrator_run_resumes_total"] == {
        (("workflow", w),): 1 for w in ("looked_up", "uncertain", "late")}
    assert s["orchestrator_run_replays_total"] == {
        (("workflow", w),): 1 for w in ("looked_up", "uncertain", "late")}
    assert _histogram_counts(s, "orchestrator_replay_duration_seconds") == {
        (("workflow", w),): 1 for w in ("looked_up", "uncertain", "late")}
    assert s["orchestrator_fenced_writes_rejected_total"] == {(): 0}
    assert s["orchestrator_lease_losses_total"] == {(): 0}
    assert _histogram_counts(s, "orchestrator_run_queue_wait_seconds") == {
        (("workflow", w),): n for w, n in (("succeeds", 2), ("retried", 1), ("looked_up", 1),
                                          ("uncertain", 1), ("stalled", 1), ("late", 1))}
    assert _histogram_counts(s, "orchestrator_run_duration_seconds") == {
        (("outcome", "succeeded"), ("workflow", w)): n
        for w, n in (("succeeds", 2), ("retried", 1), ("looked_up", 1), ("uncertain", 1))
    } | {(("outcome", "cancelled"), ("workflow", "stalled")): 1,
         (("outcome", "failed"), ("workflow", "late")): 1}
    assert _histogram_counts(s, "orchestrator_tool_call_duration_seconds") == {
        (("outcome", o), ("tool", t)): n
        for t, o, n in (("echo", "returned", 2), ("flaky", "raised", 1),
                        ("flaky", "returned", 1), ("ship", "raised", 1),
                        ("charge", "raised", 1), ("slow_read", "cancelled", 1))}
    assert s["orchestrator_claims_total"][()] >= 1
    assert _histogram_counts(s, "orchestrator_claim_batch_size")[()] == (
        s["orchestrator_claims_total"][()])
    assert _histogram_counts(s, "orchestrator_commit_batch_size")[()] >= 1

    r = _scrape(rport)
    assert r["orchestrator_lookups_total"] == {(("answer", "committed"), ("tool", "ship")): 1}
    assert r["orchestrator_reconciliation_outcomes_total"][
        (("answer", "committed"), ("resolver", "lookup"))] == 1
    # The operator's answer is counted where it was given: this process.
    assert client.metrics.labelled("reconciliation_operator") == {("committed",): 1}
    assert client.metrics.labelled("cancellations") == {("requested",): 1}


DEPLOY = ROOT / "deploy"
_NAMED = re.compile(r"\borchestrator_[a-z_]+\b")
_SERIES = ("_bucket", "_sum", "_count", "_total", "_created")


def _family(series: str) -> str:
    """The family a series name belongs to (``…_total`` of a counter, ``…_bucket`` of a
    histogram)."""
    for suffix in _SERIES:
        if series.endswith(suffix):
            return series[: -len(suffix)]
    return series


def _dashboard_expressions() -> list[str]:
    dashboard = json.loads((DEPLOY / "grafana" / "orchestrator.json").read_text())
    found = [target["expr"] for panel in dashboard["panels"]
             for target in panel.get("targets", [])]
    found += [v["query"]["query"] for v in dashboard["templating"]["list"]
              if isinstance(v.get("query"), dict)]
    return found


def _alert_rules() -> list[dict[str, Any]]:
    rules = yaml.safe_load((DEPLOY / "prometheus" / "alerts.yml").read_text())
    return [rule for group in rules["groups"] for rule in group["rules"]]


def test_the_alert_rules_are_complete() -> None:
    rules = _alert_rules()
    assert len(rules) >= 6
    for rule in rules:
        assert set(rule) >= {"alert", "expr", "for", "labels", "annotations"}, rule
        assert rule["labels"]["severity"] in ("warning", "critical")
        assert rule["annotations"]["summary"] and rule["annotations"]["description"]
    dashboard = json.loads((DEPLOY / "grafana" / "orchestrator.json").read_text())
    assert dashboard["uid"] == "orchestrator" and dashboard["panels"]


def test_every_metric_the_dashboard_and_the_alerts_name_is_served(
        workers: Workers, client: Orchestrator) -> None:
    """The families a worker and a reconciler serve cover every ``orchestrator_*`` name in
    deploy/grafana/orchestrator.json and deploy/prometheus/alerts.yml (a family with no
    sample yet is still listed, with its type)."""
    port, rport = _free_port(), _free_port()
    worker = workers.start("metrics", app=APP, args=["--metrics-port", str(port)])
    reconciler = _start_reconciler(workers, rport)

    def families(at: int) -> set[str] | None:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{at}/metrics",
                                        timeout=10) as response:
                text = response.read().decode()
        except OSError:
            return None  # not listening yet
        return {family.name for family in text_string_to_metric_families(text)}

    workers.wait(lambda: families(port), "the worker's metrics", proc=worker)
    workers.wait(lambda: families(rport), "the reconciler's metrics", proc=reconciler)
    served = (families(port) or set()) | (families(rport) or set())
    named = {_family(name) for expr in _dashboard_expressions()
             + [rule["expr"] for rule in _alert_rules()] for name in _NAMED.findall(expr)}
    assert len(named) >= 25
    assert named - served == set()


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="this host has no IPv6 loopback")
def test_a_worker_serves_its_metrics_on_every_ipv6_and_ipv4_address(
        workers: Workers, client: Orchestrator) -> None:
    # `--metrics-host ::`, as in a pod of an IPv6 or dual-stack cluster: it stopped the worker
    # at start (CONFIGURATION_ERROR: address family not supported).
    port = _free_port()
    proc = workers.start("metrics", app=APP,
                         args=["--metrics-host", "::", "--metrics-port", str(port)])
    for url in (f"http://[::1]:{port}/healthz", f"http://127.0.0.1:{port}/healthz"):
        with urllib.request.urlopen(url, timeout=10) as response:
            assert response.status == 200
            assert json.loads(response.read())["database_reachable"] is True
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
