"""Named fault points for crash tests.

A test starts a worker with ``ORCHESTRATOR_FAULT_POINT=<name>`` (and optionally
``ORCHESTRATOR_FAULT_TOOL=<tool name>``); when the worker reaches that point it kills itself
with SIGKILL, exactly as a machine failure would. The points sit right after each commit on the
effect path. With the variable unset, :func:`reach` costs one dict lookup.
"""

from __future__ import annotations

import os
import signal

POINTS = (
    "after_intent",  # the operation's intent is committed (pending/submitted row written)
    "after_submitted",  # `submitted` is committed; the tool has not been called
    "after_tool_return",  # the tool returned; its receipt is not committed
    "after_receipt",  # the receipt is committed
)

_point = os.environ.get("ORCHESTRATOR_FAULT_POINT")
_tool = os.environ.get("ORCHESTRATOR_FAULT_TOOL")


def reach(point: str, tool: str) -> None:
    """Die here if this fault point is armed for this tool."""
    if _point == point and (_tool is None or _tool == tool):
        os.kill(os.getpid(), signal.SIGKILL)

# Test-only: re-dispatch consequential operations whose outcome is unknown, as engines without
# an effect ledger do. It exists so that the chaos suite can show that it catches the duplicate
# effects this causes. No configuration or environment variable turns it on: only code that
# assigns it (the chaos suite's own application module does, for its self-test).
UNSAFE_REDISPATCH = False
