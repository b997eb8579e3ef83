"""Telemetry counters (CONTRACT C12): low-cardinality names, no payloads.

Each :class:`~orchestrator.Orchestrator` has its own :class:`Metrics`; ``snapshot()`` returns a
plain dict that tests and exporters read.
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


class Metrics:
    """Thread-safe counters. Unknown names are refused so that labels stay bounded."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter({name: 0 for name in COUNTERS})

    def incr(self, name: str, amount: int = 1) -> None:
        if name not in self._counts:
            raise KeyError(f"unknown counter {name!r}")
        with self._lock:
            self._counts[name] += amount

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)
