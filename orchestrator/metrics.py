"""Telemetry counters (CONTRACT C12): low-cardinality names, no payloads.

Each :class:`~orchestrator.Orchestrator` has its own :class:`Metrics`; ``snapshot()`` returns a
plain dict that tests and exporters read. Some counters are also kept per label values
(``LABELS``: the tool, the cause code of an unknown outcome, an operator's answer), all from
bounded vocabularies: never a run id, a key, an owner or a message.

The hot path only adds to a dict under a lock; the Prometheus exporter
(:mod:`orchestrator.telemetry`) reads :meth:`Metrics.snapshot` and :meth:`Metrics.labelled`
when it is scraped.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections import Counter

COUNTERS = (
    "runs_submitted",
    "runs_succeeded",
    "runs_failed",
    "runs_cancelled",
    "runs_continued",  # ended by ctx.continue_as_new, going on as a new run
    "operations_dispatched",
    "operations_retried",
    "operations_resent",  # sent again outside the retry budget, proven not applied (C8)
    "dispatches_withheld",  # not sent: the lease might end first (C6); the run was let go
    "unknown_outcomes",
    "reconciliation_auto_committed",
    "reconciliation_auto_not_applied",
    "reconciliation_operator",
    "deadline_exhausted",
    "lease_losses",
    "runs_started",  # a run's first execution began (its first claim)
    "run_parks",  # a run released its worker to wait in the database (timer, event, child...)
    "run_resumes",  # a parked run was claimed again to go on
    "run_replays",  # a run was claimed again after its worker was lost or let it go
    "tool_failures",  # an attempt that failed definitively (applied nothing), by phase and cause
    "lookups",  # reconciliation lookups asked of a tool, by answer
    "reconciliation_unserved",  # items handed to operators: no running reconciler had the tool
    "cancellations",  # by stage: requested, observed, provider_aborted, effect_resolved
    "claims",  # claim statements that returned at least one run
    "fenced_writes_rejected",  # writes the lease fence refused (the run had moved on)
    "database_retries",  # statements tried again after a transient database error
    "schedule_slots",  # schedule slots handled one by one, by outcome: fired, skipped, buffered
    "schedule_gaps",  # ranges of schedule slots recorded as missed at once (after downtime)
    "tool_turn_waits",  # a call waited for its tool's turn (its limits), by tool and limit
    "tool_back_offs",  # a provider's 429/503 with a Retry-After paused a tool for every run
)

LABELS: dict[str, tuple[str, ...]] = {
    "operations_dispatched": ("tool", "attempt_kind"),
    "operations_retried": ("tool",),
    "operations_resent": ("tool",),
    "dispatches_withheld": ("tool",),
    "unknown_outcomes": ("tool", "cause"),
    "reconciliation_operator": ("answer",),
    "runs_started": ("workflow",),
    "run_replays": ("workflow",),
    "run_resumes": ("workflow",),
    "tool_failures": ("tool", "phase", "cause"),
    "lookups": ("tool", "answer"),
    "reconciliation_unserved": ("tool",),
    "cancellations": ("stage",),
    "schedule_slots": ("outcome",),
    "tool_turn_waits": ("tool", "limit"),
    "tool_back_offs": ("tool",),
}
"""The counters also kept per label values, and the names of their labels in order. A counter
incremented without labels is counted in its total only."""


ATTEMPT_KINDS = ("initial", "retry", "engine_resend", "idempotent_resend")
"""What an attempt is: the call's first; another after a definitive failure, within the retry
budget; a re-send outside it after an earlier attempt was proven not applied (a lost worker, or
an operator's ``resend``); or a re-send of an uncertain attempt with its idempotency key."""
CANCELLATION_STAGES = ("requested", "observed", "provider_aborted", "effect_resolved")

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)
_DURATION = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0,
             21600.0, 86400.0)
_SIZES = (1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)

HISTOGRAMS: dict[str, tuple[tuple[str, ...], tuple[float, ...]]] = {
    "run_queue_wait_seconds": (("workflow",), _LATENCY),
    "run_duration_seconds": (("workflow", "outcome"), _DURATION),
    "tool_call_duration_seconds": (("tool", "outcome"), _LATENCY),
    "replay_duration_seconds": (("workflow",), _LATENCY),
    "retry_delay_seconds": (("delay_class",), _DURATION),
    "claim_batch_size": ((), _SIZES),
    "commit_batch_size": ((), _SIZES),
    "commit_latency_seconds": ((), _FAST),
}
"""The histograms: their label names and bucket bounds (upper, inclusive; +Inf is implied)."""


class Histogram:
    """One histogram's series: per label values, the count in each bucket (not cumulative; the
    last is +Inf), the sum and the count."""

    __slots__ = ("bounds", "series")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.series: dict[tuple[str, ...], list[float]] = {}

    def observe(self, values: tuple[str, ...], value: float) -> None:
        row = self.series.get(values)
        if row is None:
            row = self.series[values] = [0.0] * (len(self.bounds) + 3)
        row[bisect_left(self.bounds, value)] += 1
        row[-2] += value
        row[-1] += 1


class Metrics:
    """Thread-safe counters. Unknown names and labels are refused so that labels stay
    bounded."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter({name: 0 for name in COUNTERS})
        self._labelled: dict[str, Counter[tuple[str, ...]]] = {
            name: Counter() for name in LABELS}
        self._histograms = {name: Histogram(bounds) for name, (_, bounds) in HISTOGRAMS.items()}

    def incr(self, name: str, amount: int = 1, **labels: str) -> None:
        if name not in self._counts:
            raise KeyError(f"unknown counter {name!r}")
        values: tuple[str, ...] | None = None
        if labels:
            names = LABELS.get(name, ())
            if tuple(labels) != names:  # another order, or other labels
                if sorted(labels) != sorted(names):
                    raise KeyError(f"counter {name!r} takes the labels {names}, "
                                   f"not {tuple(labels)}")
                labels = {label: labels[label] for label in names}
            values = tuple(labels.values())
        with self._lock:
            self._counts[name] += amount
            if values is not None:
                self._labelled[name][values] += amount

    def observe(self, name: str, value: float, *values: str) -> None:
        """Add ``value`` to histogram ``name`` (:data:`HISTOGRAMS`), for the label values
        ``values`` in the order of its label names."""
        histogram = self._histograms[name]
        if len(values) != len(HISTOGRAMS[name][0]):
            raise KeyError(f"histogram {name!r} takes the labels {HISTOGRAMS[name][0]}")
        with self._lock:
            histogram.observe(values, value)

    def histogram(self, name: str) -> dict[tuple[str, ...], tuple[list[float], float, int]]:
        """Histogram ``name`` per label values: (the count in each bucket of
        ``HISTOGRAMS[name]``'s bounds and then +Inf, not cumulative; the sum; the count)."""
        with self._lock:
            return {values: (row[:-2], row[-2], int(row[-1]))
                    for values, row in self._histograms[name].series.items()}

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def labelled(self, name: str) -> dict[tuple[str, ...], int]:
        """The counts of ``name`` per label values (in the order of ``LABELS[name]``); what
        was counted without labels is only in :meth:`snapshot`."""
        with self._lock:
            return dict(self._labelled[name])
