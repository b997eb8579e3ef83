"""Worker process entry point: ``python -m workers.worker --app package.module:app``.

The same as ``orchestrator worker``; kept as a module so that process managers and containers
can start workers without the console script.
"""

from __future__ import annotations

import sys

from orchestrator.cli import main

if __name__ == "__main__":
    sys.exit(main(["worker", *sys.argv[1:]]))
