"""Prometheus export of an application's telemetry (CONTRACT C12; docs/metrics.md).

- :class:`CounterCollector` reads the process's :class:`~orchestrator.metrics.Metrics` when it
  is scraped: the hot path keeps adding to plain counters and never calls prometheus_client.
- :class:`DatabaseCollector` computes gauges from the database at scrape time, with short
  queries driven by partial indexes (:mod:`orchestrator.db.gauges`). An unreachable database
  shows as ``orchestrator_database_up 0`` without those gauges; the scrape itself succeeds.
- :class:`ProcessCollector` exports what only the serving process knows: its event loop's lag
  (:class:`LoopLag`) and a worker's slots.
- :class:`Exporter` serves ``/metrics`` and ``/healthz`` from a thread of its own (what
  ``orchestrator worker --metrics-port`` starts).

Every label comes from a bounded vocabulary (tool and workflow names the application
registered, outcome, cause and answer words): never a run id, a key, an owner or a message.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from orchestrator.db import gauges
from orchestrator.db.config import DatabaseTarget
from orchestrator.errors import ConfigurationError, OrchestratorError
from orchestrator.metrics import HISTOGRAMS, LABELS, Metrics

log = logging.getLogger("orchestrator.telemetry")

# Prometheus name (without ``_total``), help, label names, and how each sample is found:
# (counter in Metrics, label values). A counter kept per label values (metrics.LABELS) is
# exported per those values.
_PLAIN: tuple[tuple[str, str, str], ...] = (
    ("orchestrator_runs_submitted", "runs_submitted",
     "Runs submitted through this process (a new run; an idempotent repeat is not counted)."),
    ("orchestrator_deadlines_exhausted", "deadline_exhausted",
     "Runs whose deadline ran out while this process drove them."),
    ("orchestrator_lease_losses", "lease_losses",
     "Runs this process stopped driving because it lost (or could not keep) their lease."),
    ("orchestrator_run_parks", "run_parks",
     "Runs that released their worker to wait in the database (a timer, an event, a child "
     "run, or reconciliation of an unknown outcome)."),
    ("orchestrator_claims", "claims",
     "Claim statements that returned at least one run (their sizes: "
     "orchestrator_claim_batch_size)."),
    ("orchestrator_fenced_writes_rejected", "fenced_writes_rejected",
     "Writes the lease fence refused: the run had moved on (another worker holds it)."),
    ("orchestrator_database_retries", "database_retries",
     "Statements tried again after a transient database error."),
    ("orchestrator_schedule_gaps", "schedule_gaps",
     "Ranges of schedule slots recorded as missed at once: older than the catch-up window "
     "when a ticker came back after the fleet was away."),
)
_LABELLED: tuple[tuple[str, str, str], ...] = (
    ("orchestrator_runs_started", "runs_started",
     "Runs whose first execution began on this worker, by workflow."),
    ("orchestrator_run_resumes", "run_resumes",
     "Parked runs claimed again to go on (their wait ended), by workflow."),
    ("orchestrator_run_replays", "run_replays",
     "Runs claimed with history, so replayed from their journal (the resumes, and runs let go "
     "by a draining worker, taken over from a lost one or restarted), by workflow."),
    ("orchestrator_tool_failures", "tool_failures",
     "Attempts that failed and applied nothing, by tool, phase (tool: the tool said so; "
     "reconciliation: a lookup or an operator proved it) and normalised cause."),
    ("orchestrator_lookups", "lookups",
     "Reconciliation lookups asked of a tool, by answer (committed, not_applied, "
     "still_unknown, error)."),
    ("orchestrator_reconciliation_unserved", "reconciliation_unserved",
     "Reconciliation items this reconciler handed to operators because no running reconciler "
     "has their tool: they waited past its unserved grace and it does not register the tool, "
     "by tool."),
    ("orchestrator_cancellations", "cancellations",
     "Cancellation by stage: requested (through this process), observed (the run ended "
     "cancelled), provider_aborted (a tool call in flight was cancelled), effect_resolved (an "
     "uncertain effect of a run being cancelled was settled as not applied)."),
    ("orchestrator_schedule_slots", "schedule_slots",
     "Schedule slots this process's ticker handled, by outcome: fired (a run was submitted), "
     "skipped (the overlap policy), buffered (kept until the previous run ends)."),
    ("orchestrator_tool_turn_waits", "tool_turn_waits",
     "Calls that waited for their tool's turn before dispatch, by tool and limit (rate: the "
     "rate window or a shared back-off; concurrency: calls in flight; busy: another admission "
     "of the tool under way)."),
    ("orchestrator_tool_back_offs", "tool_back_offs",
     "Pauses of a tool's dispatch for every run, asked by its provider (429 or 503 with a "
     "Retry-After), by tool."),
)
_HISTOGRAMS: dict[str, str] = {
    "run_queue_wait_seconds": "Seconds from when a run was due (its submission, or the start "
                              "start_at or delay held it back to) to its first claim, by "
                              "workflow.",
    "run_duration_seconds": "Seconds from when a run was due (as the queue wait) to its end, "
                            "by workflow and outcome.",
    "tool_call_duration_seconds": "Seconds a tool call took, per attempt, by tool and outcome "
                                  "(returned, raised, timed_out, cancelled).",
    "replay_duration_seconds": "Seconds from claiming a run with history to its first command "
                               "past the journal or a call's first new attempt, by workflow.",
    "retry_delay_seconds": "Delays before retries, by class: backoff (the policy's), "
                           "retry_after (the tool's hint), deadline_capped (no retry: the "
                           "delay would outlast the deadline; the time that was left).",
    "claim_batch_size": "Runs per claim statement that returned any.",
    "commit_batch_size": "Writes per group commit.",
    "commit_latency_seconds": "Seconds per group commit (the batch's round trip).",
}
_RUN_OUTCOMES = ("succeeded", "failed", "cancelled", "continued")
_BY_TOOL: tuple[tuple[str, str, str], ...] = (
    ("orchestrator_tool_attempts", "operations_dispatched",
     "Tool attempts that reached dispatch, by tool and attempt_kind (initial, retry, "
     "engine_resend, idempotent_resend): retry amplification is the non-initial ones over the "
     "initial ones. A withheld one is also counted in "
     "orchestrator_tool_dispatches_withheld_total."),
    ("orchestrator_tool_retries", "operations_retried",
     "Tool attempts after the first at the same call (retries and re-sends): the retry "
     "amplification is retries / attempts."),
    ("orchestrator_tool_resends", "operations_resent",
     "Attempts sent again outside the retry budget after the earlier one was proven not "
     "applied."),
    ("orchestrator_tool_dispatches_withheld", "dispatches_withheld",
     "Attempts not sent because the run's lease might end before the call did."),
)


class CounterCollector(Collector):
    """The counters of one :class:`Metrics`, read at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    def collect(self) -> Iterator[Metric]:
        counts = self.metrics.snapshot()
        for name, counter, doc in _PLAIN:
            yield CounterMetricFamily(name, doc, value=counts[counter])
        finished = CounterMetricFamily(
            "orchestrator_runs_finished", "Runs this process brought to an end, by outcome.",
            labels=["outcome"])
        for outcome in _RUN_OUTCOMES:
            finished.add_metric([outcome], counts[f"runs_{outcome}"])
        yield finished
        for name, counter, doc in _BY_TOOL:
            yield self._labelled(counts, name, doc, counter, list(LABELS[counter]))
        for name, counter, doc in _LABELLED:
            yield self._labelled(counts, name, doc, counter, list(LABELS[counter]))
        for counter, doc in _HISTOGRAMS.items():
            yield self._histogram(counter, doc)
        yield self._labelled(
            counts,
            "orchestrator_operations_unknown",
            "Operations whose outcome became unknown, by tool and cause (WORKER_LOST, "
            "TOOL_OUTCOME_UNCERTAIN, INVALID_RECEIPT, other).",
            "unknown_outcomes", ["tool", "cause"])
        yield self._reconciliation(counts)

    def _labelled(self, counts: dict[str, int], name: str, doc: str, counter: str,
                  labels: list[str]) -> CounterMetricFamily:
        family = CounterMetricFamily(name, doc, labels=labels)
        by_values = self.metrics.labelled(counter)
        for values, count in sorted(by_values.items()):
            family.add_metric(list(values), count)
        rest = counts[counter] - sum(by_values.values())
        if rest > 0:  # counted without labels (not by the engine): empty label values
            family.add_metric([""] * len(labels), rest)
        return family

    def _histogram(self, name: str, doc: str) -> HistogramMetricFamily:
        labels, bounds = HISTOGRAMS[name]
        family = HistogramMetricFamily(f"orchestrator_{name}", doc, labels=list(labels))
        edges = [repr(float(b)) for b in bounds] + ["+Inf"]
        for values, (counts, total, _) in sorted(self.metrics.histogram(name).items()):
            cumulative, buckets = 0.0, []
            for edge, count in zip(edges, counts, strict=True):
                cumulative += count
                buckets.append((edge, cumulative))
            family.add_metric(list(values), buckets, total)
        return family

    def _reconciliation(self, counts: dict[str, int]) -> CounterMetricFamily:
        family = CounterMetricFamily(
            "orchestrator_reconciliation_outcomes",
            "Unknown operations settled, by answer and by who answered: a tool's lookup (the "
            "reconciler) or an operator.", labels=["answer", "resolver"])
        family.add_metric(["committed", "lookup"], counts["reconciliation_auto_committed"])
        family.add_metric(["not_applied", "lookup"], counts["reconciliation_auto_not_applied"])
        by_answer = self.metrics.labelled("reconciliation_operator")
        for (answer,), count in sorted(by_answer.items()):
            family.add_metric([answer, "operator"], count)
        rest = counts["reconciliation_operator"] - sum(by_answer.values())
        if rest > 0:
            family.add_metric(["", "operator"], rest)
        return family


class DatabaseCollector(Collector):
    """Gauges read from the database at scrape time (see :mod:`orchestrator.db.gauges`)."""

    def __init__(self, target: DatabaseTarget) -> None:
        self.target = target

    def collect(self) -> Iterator[Metric]:
        try:
            rows = gauges.read_gauges(self.target)
        except OrchestratorError as exc:
            log.warning("metrics: %s", exc.message)
            yield GaugeMetricFamily("orchestrator_database_up", _UP_DOC, value=0)
            return
        yield GaugeMetricFamily("orchestrator_database_up", _UP_DOC, value=1)
        unknown = rows["unknown"]
        yield _gauge("orchestrator_unknown_operations",
                     "Operations whose outcome is unknown now, by tool.",
                     "tool", unknown, "unknown")
        yield _gauge("orchestrator_unknown_operations_oldest_age_seconds",
                     "Seconds since the oldest operation still unknown became unknown, by tool.",
                     "tool", unknown, "unknown_oldest")
        waiting = [row for row in unknown if row["operator"]]
        yield _gauge("orchestrator_operator_queue_items",
                     "Reconciliation items waiting for an operator, by tool.",
                     "tool", waiting, "operator")
        yield _gauge("orchestrator_operator_queue_oldest_age_seconds",
                     "Seconds since the oldest item waiting for an operator entered "
                     "reconciliation (its operation became unknown), by tool.",
                     "tool", waiting, "operator_oldest")
        queued = rows["queued"]
        yield _gauge("orchestrator_runs_queued",
                     "Runs ready to start that no worker has claimed yet, by workflow.",
                     "workflow", queued, "queued")
        yield _gauge("orchestrator_runs_queued_oldest_age_seconds",
                     "Seconds the oldest of those runs has been ready, by workflow.",
                     "workflow", queued, "oldest")


_UP_DOC = "1 when the last scrape could read the database gauges, else 0."


def _gauge(name: str, doc: str, label: str, rows: Iterable[dict[str, Any]], column: str
           ) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=[label])
    for row in sorted(rows, key=lambda r: str(r[label])):
        family.add_metric([str(row[label])], max(0.0, float(row[column] or 0)))
    return family


class LoopLag:
    """How late the event loop wakes a periodic sleep (``seconds``, the last measure; and
    :meth:`now`, what is exported): a loop blocked by a synchronous call or starved of CPU
    shows here before anything else."""

    def __init__(self, interval: float = 0.5) -> None:
        self.interval = interval
        self.seconds = 0.0
        self._due: float | None = None  # when the sleep under way should end (monotonic)

    def now(self) -> float:
        """The lag as of now, read from another thread (the exporter's): the last measure,
        or, while the loop is late to wake its sleep under way (blocked now), how late it is
        so far, which the last measure, taken before the block, would not show until the
        block is over."""
        due = self._due
        late = 0.0 if due is None else time.monotonic() - due
        return max(self.seconds, late)

    async def run(self) -> None:
        try:
            while True:
                start = time.monotonic()
                self._due = start + self.interval
                await asyncio.sleep(self.interval)
                self.seconds = max(0.0, time.monotonic() - start - self.interval)
        finally:
            self._due = None


Slots = Callable[[], tuple[int, int]]
"""A worker's slots: (used, total)."""


class ProcessCollector(Collector):
    """What the serving process knows: its event loop's lag, a worker's slots."""

    def __init__(self, lag: LoopLag, slots: Slots | None = None) -> None:
        self.lag = lag
        self.slots = slots

    def collect(self) -> Iterator[Metric]:
        yield GaugeMetricFamily(
            "orchestrator_event_loop_lag_seconds",
            "How late the process's event loop woke its last periodic sleep (or is late to "
            "wake the one under way).",
            value=self.lag.now())
        if self.slots is not None:
            used, total = self.slots()
            family = GaugeMetricFamily("orchestrator_worker_slots",
                                       "The worker's run slots, used and free.",
                                       labels=["state"])
            family.add_metric(["used"], used)
            family.add_metric(["free"], max(0, total - used))
            yield family


def metrics_registry(metrics: Metrics, target: DatabaseTarget) -> CollectorRegistry:
    """A new registry with the counters of ``metrics`` and the gauges of ``target``."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(CounterCollector(metrics))
    registry.register(DatabaseCollector(target))
    return registry


class _ThreadingServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


def _server_class(host: str, port: int) -> type[_ThreadingServer]:
    """The server class for ``host``: IPv4's, as it always was, for every host that has an
    IPv4 address (``0.0.0.0``, ``localhost``, a name with both, and ``""``, every IPv4
    address), so that what was listened on stays what is listened on; IPv6's for one that
    has only an IPv6 address (``::1``, ``::``, ``fe80::1%eth0``, a name with only an IPv6
    address), which ``socketserver`` alone cannot listen on: its socket is always IPv4's."""
    if not host:
        return _ThreadingServer
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    if any(info[0] == socket.AF_INET for info in infos):
        return _ThreadingServer
    return _ThreadingServer6


class _ThreadingServer6(_ThreadingServer):
    """Over IPv6; ``::`` takes IPv4 connections too (as ``http.server`` does), whatever the
    host's ``net.ipv6.bindv6only`` says."""

    address_family = socket.AF_INET6

    def server_bind(self) -> None:
        with contextlib.suppress(AttributeError, OSError):
            self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 0)
        # The address as the resolver gives it, with the scope of a zone (``fe80::1%eth0``):
        # a bind of ``(host, port)`` drops it, and a link-local address without it is EINVAL.
        host, port = self.server_address[0], self.server_address[1]
        if isinstance(host, str):
            found = socket.getaddrinfo(host, port, socket.AF_INET6, socket.SOCK_STREAM,
                                       flags=socket.AI_PASSIVE)[0][4]
            if isinstance(found[0], str) and len(found) == 4:
                self.server_address = (found[0], found[1], found[2], found[3])
        super().server_bind()


def _host_text(host: str) -> str:
    """``host`` as it goes in a URL or before ``:port``: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def metrics_url(host: str, port: int) -> str:
    """Where ``/metrics`` is served on ``host:port`` (the line a worker logs when it starts);
    a zone's ``%`` is written ``%25`` in it, as in any URL (RFC 6874)."""
    text = _host_text(host)
    if text.startswith("["):
        text = text.replace("%", "%25")
    return f"http://{text}:{port}/metrics"


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base's name
        pass  # a scrape every few seconds is not worth a log line


class Exporter:
    """Serves ``/metrics`` (Prometheus text format) and ``/healthz`` from a daemon thread.

    ``/healthz`` answers JSON ``{"alive", "database_reachable", "event_loop_lag_seconds"}``:
    200 while the database answers, 503 when it does not.

    ``/metrics`` answers in the classic text format (version 0.0.4), or in OpenMetrics to a
    scraper that asks for it (``Accept``)."""

    def __init__(self, registry: CollectorRegistry, target: DatabaseTarget,
                 slots: Slots | None = None, lag: LoopLag | None = None) -> None:
        self.target = target
        self.lag = lag or LoopLag()
        registry.register(ProcessCollector(self.lag, slots))
        self._metrics_app = make_wsgi_app(registry)
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def start(self, host: str, port: int) -> int:
        """Listen on ``host:port`` (port 0: any free one) and return the port. ``host`` may
        be an IPv6 address, bare or in brackets as in a URL (``::``, ``[::1]``)."""
        if host.startswith("[") and host.endswith("]"):
            host = host[1:-1]
        try:
            server = make_server(host, port, self._wsgi,
                                 server_class=_server_class(host, port),
                                 handler_class=_QuietHandler)
        except OSError as exc:
            raise ConfigurationError(
                f"cannot serve metrics on {_host_text(host)}:{port} "
                f"({exc.strerror or exc})") from exc
        self._server = server
        self._thread = threading.Thread(target=server.serve_forever, name="orchestrator-metrics",
                                        daemon=True)
        self._thread.start()
        return int(server.server_address[1])

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def health(self) -> tuple[bool, dict[str, Any]]:
        reachable = gauges.database_reachable(self.target)
        return reachable, {"alive": True, "database_reachable": reachable,
                           "event_loop_lag_seconds": self.lag.now()}

    def _wsgi(self, environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self._metrics_app(environ, start_response)  # type: ignore[no-any-return]
        if path == "/healthz":
            healthy, body = self.health()
            data = json.dumps(body).encode()
            start_response("200 OK" if healthy else "503 Service Unavailable",
                           [("Content-Type", "application/json"),
                            ("Content-Length", str(len(data)))])
            return [data]
        start_response("404 Not Found", [("Content-Type", "text/plain")])
        return [b"not found: try /metrics or /healthz\n"]
