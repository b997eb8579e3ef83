"""``python -m orchestrator``: the same as the ``orchestrator`` command."""

from orchestrator.cli import main

raise SystemExit(main())
