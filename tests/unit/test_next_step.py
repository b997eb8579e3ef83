"""What a resolution leads its run to (``reconcile.next_step``), the word `ops resolve-many
--json` gives each item as `then`: every case, in the order `ops resolve` checks them."""

from __future__ import annotations

import pytest

from orchestrator.reconcile import NEXT_STEPS, Resolved, next_step


@pytest.mark.parametrize(("resolution", "then", "done", "expected"), [
    ("not_applied", "resend", Resolved("noop"), None),
    ("not_applied", "resend", Resolved("resolved", "needs_reconciliation"), "resend"),
    ("not_applied", "fail", Resolved("resolved", "needs_reconciliation"), "fail"),
    ("not_applied", None, Resolved("resolved", "waiting"), "policy"),
    ("committed", None, Resolved("resolved", "needs_reconciliation"), "resume"),
    ("abandoned", None, Resolved("resolved", "needs_reconciliation", True, (7,)), "run_failed"),
    ("committed", None, Resolved("resolved", "needs_reconciliation", True, (7,)), "waits"),
    ("not_applied", "fail", Resolved("resolved", "needs_reconciliation", True), "cancelled"),
    ("not_applied", "resend", Resolved("resolved", "failed", True, (7,)), "ended"),
    ("abandoned", None, Resolved("resolved", "cancelled"), "ended"),
])
def test_next_step(resolution: str, then: str | None, done: Resolved,
                   expected: str | None) -> None:
    assert next_step(resolution, then, done) == expected
    assert expected is None or expected in NEXT_STEPS
