"""Worker process entry point: ``python -m workers.worker --app package.module:app``.

The same as ``orchestrator worker``; kept as a module so that process managers and containers
can start workers without the console script.
"""

from __future__ import annotations

import signal
import sys

_STOPS: list[int] = []
if __name__ == "__main__":
    # Before the package loads (a second or more on a busy host): a SIGTERM meanwhile is kept
    # and the process stops cleanly once it runs, instead of dying of the signal mid-import.
    signal.signal(signal.SIGTERM, lambda signum, _frame: _STOPS.append(signum))

from orchestrator.cli import main  # noqa: E402
from orchestrator.serving import catch_early_sigterm, stop_requested_early  # noqa: E402

if __name__ == "__main__":
    catch_early_sigterm()  # the package's own keeper from here on, then what came before it
    if _STOPS:
        stop_requested_early()
    sys.exit(main(["worker", *sys.argv[1:]]))
