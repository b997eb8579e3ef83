"""The ``orchestrator`` console script (``[project.scripts]`` in pyproject.toml).

:func:`orchestrator.cli.main` behind a keeper of SIGTERM for the package's imports (a second or
more on a busy host): the console script imports its target before anything runs, and a target
inside the package would be imported with SIGTERM still at its default, so a stop request
meanwhile killed ``orchestrator worker`` (exit -15). Kept here, outside the package, the signal
is handed over once the command is known: the long-running commands (``worker``,
``reconciler``, ``console``) stop cleanly as soon as they run; any other dies of it, as it
would have.
"""

from __future__ import annotations

import signal


def main(argv: list[str] | None = None) -> int:
    """The command line (``argv``: the arguments, else the process's), SIGTERM kept from the
    start; the entry point of ``python -m workers.worker`` and ``workers.reconciler`` too."""
    stops: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, _frame: stops.append(signum))
    from orchestrator.cli import main as run

    return run(argv, early_sigterm=stops)
