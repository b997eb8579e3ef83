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
from collections import Counter

COUNTERS = (
    "runs_submitted",
    "runs_succeeded",
    "runs_failed",
    "runs_cancelled",
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
)

LABELS: dict[str, tuple[str, ...]] = {
    "operations_dispatched": ("tool",),
    "operations_retried": ("tool",),
    "operations_resent": ("tool",),
    "dispatches_withheld": ("tool",),
    "unknown_outcomes": ("tool", "cause"),
    "reconciliation_operator": ("answer",),
}
"""The counters also kept per label values, and the names of their labels in order. A counter
incremented without labels is counted in its total only."""


class Metrics:
    """Thread-safe counters. Unknown names and labels are refused so that labels stay
    bounded."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter({name: 0 for name in COUNTERS})
        self._labelled: dict[str, Counter[tuple[str, ...]]] = {
            name: Counter() for name in LABELS}

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

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def labelled(self, name: str) -> dict[tuple[str, ...], int]:
        """The counts of ``name`` per label values (in the order of ``LABELS[name]``); what
        was counted without labels is only in :meth:`snapshot`."""
        with self._lock:
            return dict(self._labelled[name])
