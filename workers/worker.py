"""Worker process entry point: ``python -m workers.worker --app package.module:app``.

The same as ``orchestrator worker``; kept as a module so that process managers and containers
can start workers without the console script.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    # The console script's entry: SIGTERM is kept from before the package loads (a second or
    # more on a busy host), and the process stops cleanly once it runs (workers/cli.py).
    from workers.cli import main

    sys.exit(main(["worker", *sys.argv[1:]]))
