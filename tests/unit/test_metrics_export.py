"""The Prometheus export (docs/metrics.md): names, types and labels as promised, label values
from bounded vocabularies only, and an unreachable database that never fails a scrape."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families

from orchestrator import Orchestrator
from orchestrator.db.config import DatabaseTarget
from orchestrator.metrics import Metrics
from orchestrator.telemetry import (
    CounterCollector,
    DatabaseCollector,
    Exporter,
    LoopLag,
    ProcessCollector,
)

ALLOWED_LABELS = {"workflow", "tool", "effect_class", "code", "cause", "phase", "outcome",
                  "answer", "resolver", "state", "attempt_kind", "delay_class", "stage"}

COUNTERS = {
    "orchestrator_runs_submitted": set(),
    "orchestrator_runs_finished": {"outcome"},
    "orchestrator_tool_attempts": {"tool", "attempt_kind"},
    "orchestrator_tool_retries": {"tool"},
    "orchestrator_tool_resends": {"tool"},
    "orchestrator_tool_dispatches_withheld": {"tool"},
    "orchestrator_operations_unknown": {"tool", "cause"},
    "orchestrator_reconciliation_outcomes": {"answer", "resolver"},
    "orchestrator_deadlines_exhausted": set(),
    "orchestrator_lease_losses": set(),
    "orchestrator_run_parks": set(),
    "orchestrator_run_resumes": {"workflow"},
    "orchestrator_claims": set(),
    "orchestrator_fenced_writes_rejected": set(),
    "orchestrator_database_retries": set(),
    "orchestrator_runs_started": {"workflow"},
    "orchestrator_run_replays": {"workflow"},
    "orchestrator_tool_failures": {"tool", "phase", "cause"},
    "orchestrator_lookups": {"tool", "answer"},
    "orchestrator_reconciliation_unserved": {"tool"},
    "orchestrator_cancellations": {"stage"},
    "orchestrator_schedule_slots": {"outcome"},
    "orchestrator_tool_turn_waits": {"tool", "limit"},
    "orchestrator_tool_back_offs": {"tool"},
    "orchestrator_schedule_gaps": set(),
}

HISTOGRAMS = {
    "orchestrator_run_queue_wait_seconds": {"workflow"},
    "orchestrator_run_duration_seconds": {"workflow", "outcome"},
    "orchestrator_tool_call_duration_seconds": {"tool", "outcome"},
    "orchestrator_replay_duration_seconds": {"workflow"},
    "orchestrator_retry_delay_seconds": {"delay_class"},
    "orchestrator_claim_batch_size": set(),
    "orchestrator_commit_batch_size": set(),
    "orchestrator_commit_latency_seconds": set(),
}


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


UNREACHABLE = DatabaseTarget(f"postgresql://nobody@127.0.0.1:{_closed_port()}/nothing",
                             "argument")


def _scrape(*collectors: object) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    registry = CollectorRegistry(auto_describe=False)
    for collector in collectors:
        registry.register(collector)  # type: ignore[arg-type]
    text = generate_latest(registry).decode()
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = (
                sample.value)
    return samples


def _busy_metrics() -> Metrics:
    metrics = Metrics()
    metrics.incr("runs_submitted", 5)
    metrics.incr("runs_succeeded", 3)
    metrics.incr("runs_failed")
    metrics.incr("operations_dispatched", 3, tool="charge", attempt_kind="initial")
    metrics.incr("operations_dispatched", tool="charge", attempt_kind="retry")
    metrics.incr("runs_started", 4, workflow="checkout")
    metrics.incr("tool_failures", tool="charge", phase="tool", cause="rate_limited")
    metrics.incr("lookups", tool="charge", answer="committed")
    metrics.incr("cancellations", stage="requested")
    metrics.incr("run_replays", workflow="checkout")
    metrics.observe("run_queue_wait_seconds", 0.02, "checkout")
    metrics.observe("run_duration_seconds", 3.0, "checkout", "succeeded")
    metrics.observe("tool_call_duration_seconds", 0.003, "charge", "returned")
    metrics.observe("replay_duration_seconds", 0.01, "checkout")
    metrics.observe("retry_delay_seconds", 0.2, "backoff")
    metrics.observe("claim_batch_size", 3)
    metrics.observe("commit_batch_size", 12)
    metrics.observe("commit_latency_seconds", 0.002)
    metrics.incr("operations_retried", tool="charge")
    metrics.incr("unknown_outcomes", tool="charge", cause="TOOL_OUTCOME_UNCERTAIN")
    metrics.incr("unknown_outcomes", tool="charge", cause="WORKER_LOST")
    metrics.incr("reconciliation_auto_committed")
    metrics.incr("reconciliation_operator", answer="abandoned")
    metrics.incr("lease_losses")
    return metrics


def test_counters_have_the_promised_names_types_and_labels() -> None:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CounterCollector(_busy_metrics()))
    families = {f.name: f for f in text_string_to_metric_families(
        generate_latest(registry).decode())}
    assert set(families) == set(COUNTERS) | set(HISTOGRAMS)
    for name, family in families.items():
        if name in HISTOGRAMS:
            assert family.type == "histogram", name
            for sample in family.samples:
                assert sample.name in (f"{name}_bucket", f"{name}_sum", f"{name}_count")
                assert set(sample.labels) - {"le"} == HISTOGRAMS[name], name
            continue
        assert family.type == "counter", name
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            assert sample.name == f"{name}_total"
            assert set(sample.labels) == COUNTERS[name], name
            assert set(sample.labels) <= ALLOWED_LABELS


def test_counter_values_follow_the_snapshot() -> None:
    metrics = _busy_metrics()
    samples = _scrape(CounterCollector(metrics))
    assert samples["orchestrator_runs_submitted_total"] == {(): 5}
    assert samples["orchestrator_runs_finished_total"] == {
        (("outcome", "succeeded"),): 3, (("outcome", "failed"),): 1,
        (("outcome", "cancelled"),): 0, (("outcome", "continued"),): 0}
    assert samples["orchestrator_tool_attempts_total"] == {
        (("attempt_kind", "initial"), ("tool", "charge")): 3,
        (("attempt_kind", "retry"), ("tool", "charge")): 1}
    assert samples["orchestrator_tool_retries_total"] == {(("tool", "charge"),): 1}
    assert samples["orchestrator_operations_unknown_total"] == {
        (("cause", "TOOL_OUTCOME_UNCERTAIN"), ("tool", "charge")): 1,
        (("cause", "WORKER_LOST"), ("tool", "charge")): 1}
    assert samples["orchestrator_reconciliation_outcomes_total"] == {
        (("answer", "committed"), ("resolver", "lookup")): 1,
        (("answer", "not_applied"), ("resolver", "lookup")): 0,
        (("answer", "abandoned"), ("resolver", "operator")): 1}
    assert samples["orchestrator_lease_losses_total"] == {(): 1}
    assert samples["orchestrator_tool_failures_total"] == {
        (("cause", "rate_limited"), ("phase", "tool"), ("tool", "charge")): 1}
    # A histogram: cumulative buckets, the sum and the count.
    wait = samples["orchestrator_run_queue_wait_seconds_bucket"]
    assert wait[(("le", "0.01"), ("workflow", "checkout"))] == 0
    assert wait[(("le", "0.025"), ("workflow", "checkout"))] == 1
    assert wait[(("le", "+Inf"), ("workflow", "checkout"))] == 1
    assert samples["orchestrator_run_queue_wait_seconds_sum"] == {
        (("workflow", "checkout"),): 0.02}
    assert samples["orchestrator_commit_batch_size_count"] == {(): 1}
    assert samples["orchestrator_commit_batch_size_bucket"][(("le", "8.0"),)] == 0
    assert samples["orchestrator_commit_batch_size_bucket"][(("le", "16.0"),)] == 1
    # The snapshot the tests and the CLI read is the same as before: totals by counter.
    assert metrics.snapshot()["unknown_outcomes"] == 2
    assert metrics.snapshot()["operations_dispatched"] == 4


def test_a_count_without_labels_is_exported_with_empty_label_values() -> None:
    metrics = Metrics()
    metrics.incr("unknown_outcomes")
    samples = _scrape(CounterCollector(metrics))
    assert samples["orchestrator_operations_unknown_total"] == {
        (("cause", ""), ("tool", "")): 1}


def test_labels_other_than_the_counters_own_are_refused() -> None:
    metrics = Metrics()
    with pytest.raises(KeyError):
        metrics.incr("unknown_outcomes", tool="charge", run_id="0f0e")
    with pytest.raises(KeyError):
        metrics.incr("runs_submitted", workflow="checkout")
    with pytest.raises(KeyError):
        metrics.incr("no_such_counter")
    with pytest.raises(KeyError):
        metrics.observe("run_queue_wait_seconds", 1.0)  # its workflow label is missing
    assert metrics.snapshot()["unknown_outcomes"] == 0


def test_an_unreachable_database_reports_down_without_the_gauges() -> None:
    samples = _scrape(DatabaseCollector(UNREACHABLE))
    assert samples == {"orchestrator_database_up": {(): 0}}


def test_the_process_gauges() -> None:
    lag = LoopLag()
    lag.seconds = 0.25
    samples = _scrape(ProcessCollector(lag, slots=lambda: (3, 10)))
    assert samples["orchestrator_event_loop_lag_seconds"] == {(): 0.25}
    assert samples["orchestrator_worker_slots"] == {
        (("state", "used"),): 3, (("state", "free"),): 7}


def test_the_loop_lag_shows_a_loop_that_is_blocked_now_not_only_once_it_wakes() -> None:
    """The lag was measured only when the loop woke its sleep: a loop blocked by a
    synchronous call (a tool's ``time.sleep``, blocking I/O, a deadlock) showed its last lag
    before the block, about 0, on ``/metrics`` and ``/healthz`` for as long as it stayed
    blocked; the gauge that should show it first showed it last, once it was over."""
    import asyncio
    import threading
    import time

    lag = LoopLag(interval=0.05)
    loop = asyncio.new_event_loop()
    blocked, release = threading.Event(), threading.Event()

    def block() -> None:
        blocked.set()
        release.wait(10)  # the loop's thread is stuck here, as in a synchronous call

    async def main() -> None:
        measuring = asyncio.ensure_future(lag.run())
        await asyncio.sleep(0.3)
        loop.call_soon(block)
        await asyncio.sleep(0.2)
        measuring.cancel()

    thread = threading.Thread(target=loop.run_until_complete, args=(main(),))
    thread.start()
    try:
        assert blocked.wait(10)
        time.sleep(1.0)
        during = _scrape(ProcessCollector(lag))["orchestrator_event_loop_lag_seconds"][()]
    finally:
        release.set()
        thread.join(10)
        loop.close()
    assert during >= 0.8, during


@pytest.fixture
def exporter() -> Iterator[tuple[Exporter, int]]:
    app = Orchestrator(UNREACHABLE.url)
    served = Exporter(app.metrics_registry(), app.target)
    port = served.start("127.0.0.1", 0)
    yield served, port
    served.stop()


def test_the_exporter_serves_metrics_and_health_while_the_database_is_down(
        exporter: tuple[Exporter, int]) -> None:
    _, port = exporter
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    # OpenMetrics to a scraper that asks for it; every family parses (no two of one name).
    request = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                     headers={"Accept": "application/openmetrics-text"})
    with urllib.request.urlopen(request, timeout=10) as response:
        assert response.headers["Content-Type"].startswith("application/openmetrics-text")
        families = list(openmetrics_families(response.read().decode()))
    assert "orchestrator_operations_unknown" in {f.name for f in families}
    assert "orchestrator_database_up 0.0" in text
    assert "orchestrator_runs_finished_total{outcome=\"failed\"} 0.0" in text
    assert "orchestrator_event_loop_lag_seconds" in text
    with pytest.raises(urllib.error.HTTPError) as failed:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10)
    assert failed.value.code == 503
    body = json.loads(failed.value.read())
    assert body == {"alive": True, "database_reachable": False, "event_loop_lag_seconds": 0.0}


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as sock:
            sock.bind(("::1", 0))
    except OSError:
        return False
    return True


@pytest.mark.skipif(not _ipv6_loopback(), reason="this host has no IPv6 loopback")
@pytest.mark.parametrize("host", ["::1", "::", "[::1]"])
def test_the_exporter_listens_on_an_ipv6_address(host: str) -> None:
    # `--metrics-host ::` is how a pod of an IPv6 or dual-stack cluster listens everywhere:
    # the server's socket must be of the address's family, not always IPv4's.
    served = Exporter(Orchestrator(UNREACHABLE.url).metrics_registry(), UNREACHABLE)
    port = served.start(host, 0)
    try:
        with urllib.request.urlopen(f"http://[::1]:{port}/metrics", timeout=10) as response:
            assert response.status == 200
            assert "orchestrator_database_up 0.0" in response.read().decode()
        if host == "::":  # every address: IPv4's too
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics",
                                        timeout=10) as response:
                assert response.status == 200
    finally:
        served.stop()


def test_the_exporter_names_an_ipv6_address_in_brackets() -> None:
    from orchestrator.telemetry import metrics_url

    assert metrics_url("::1", 9464) == "http://[::1]:9464/metrics"
    assert metrics_url("0.0.0.0", 9464) == "http://0.0.0.0:9464/metrics"
    assert metrics_url("localhost", 9464) == "http://localhost:9464/metrics"


def test_an_empty_metrics_host_listens_on_every_ipv4_address() -> None:
    # `metrics_host=""` is socketserver's "every IPv4 address", and served so before IPv6
    # was taken: the resolver knows no such name, and the start must not ask it.
    served = Exporter(Orchestrator(UNREACHABLE.url).metrics_registry(), UNREACHABLE)
    port = served.start("", 0)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            assert response.status == 200
    finally:
        served.stop()


def test_a_name_with_an_ipv4_address_is_listened_on_over_ipv4(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # A resolver that gives a name's IPv6 address first (`localhost` as ::1 where /etc/hosts
    # lists both, as most do): the name was served on its IPv4 address, and a scrape of
    # 127.0.0.1 must still find it there, not on ::1 alone.
    from orchestrator import telemetry

    both = [(socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", 0, 0, 0)),
            (socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", 0))]
    monkeypatch.setattr(telemetry.socket, "getaddrinfo", lambda *a, **k: both)
    assert telemetry._server_class("localhost", 0) is telemetry._ThreadingServer


def _link_local() -> tuple[str, int] | None:
    """A link-local IPv6 address of this host with its zone (``fe80::1%eth0``) and the
    zone's index, from Linux's table; None elsewhere or without one."""
    try:
        with open("/proc/net/if_inet6") as table:
            rows = [line.split() for line in table]
    except OSError:
        return None
    for address, index, _, scope, _, name in rows:
        if scope == "20":  # link
            packed = bytes.fromhex(address)
            return f"{socket.inet_ntop(socket.AF_INET6, packed)}%{name}", int(index, 16)
    return None


@pytest.mark.skipif(_link_local() is None, reason="this host has no link-local IPv6 address")
def test_the_exporter_listens_on_a_link_local_address_with_its_zone() -> None:
    # `--metrics-host fe80::1%eth0`: a bind of (host, port) drops the zone, and the start
    # failed with `cannot serve metrics on [fe80::1%eth0]:N (Invalid argument)`.
    host, index = _link_local()  # type: ignore[misc]
    served = Exporter(Orchestrator(UNREACHABLE.url).metrics_registry(), UNREACHABLE)
    port = served.start(host, 0)
    try:
        address = host.split("%")[0]
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as conn:
            conn.settimeout(10)
            conn.connect((address, port, 0, index))
            conn.sendall(b"GET /healthz HTTP/1.0\r\n\r\n")
            assert conn.recv(64).startswith(b"HTTP/")
    finally:
        served.stop()


def test_a_zone_is_written_as_in_a_url() -> None:
    from orchestrator.telemetry import metrics_url

    assert metrics_url("fe80::1%eth0", 9464) == "http://[fe80::1%25eth0]:9464/metrics"
