"""Reconciler process entry point: ``python -m workers.reconciler --app package.module:app``.

The same as ``orchestrator reconciler``.
"""

from __future__ import annotations

import sys

if __name__ == "__main__":
    # The console script's entry: SIGTERM is kept from before the package loads (a second or
    # more on a busy host), and the process stops cleanly once it runs (workers/cli.py).
    from workers.cli import main

    sys.exit(main(["reconciler", *sys.argv[1:]]))
