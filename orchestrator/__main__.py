"""``python -m orchestrator``: the same as the ``orchestrator`` command, SIGTERM kept from
the package's first import as the console script keeps it (``orchestrator/_early.py``)."""

from orchestrator._early import KEPT
from orchestrator.cli import main

raise SystemExit(main(early_sigterm=KEPT))
