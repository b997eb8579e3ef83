"""Reconciler process entry point: ``python -m workers.reconciler --app package.module:app``.

The same as ``orchestrator reconciler``.
"""

from __future__ import annotations

import sys

from orchestrator.cli import main

if __name__ == "__main__":
    sys.exit(main(["reconciler", *sys.argv[1:]]))
