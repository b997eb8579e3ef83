"""SIGTERM kept while the package loads under ``python -m orchestrator`` (its ``__main__`` is
imported only after the package): the console script's keeper (``workers/cli.py``), for the
one command line that cannot go through it. Imported first by the package's ``__init__``,
which is why it imports nothing of the package."""

from __future__ import annotations

import signal
import sys

KEPT: list[int] | None = None
"""The SIGTERMs that came while the package loaded under ``python -m orchestrator``, handed to
:func:`orchestrator.cli.main` by ``__main__``; None when this process is not that command (the
signal was left as it was)."""


def running_as_main(argv: list[str]) -> bool:
    """Whether the interpreter's own command line (``sys.orig_argv``) runs the module
    ``orchestrator`` (``-m orchestrator``, also among other short options: ``-Im
    orchestrator``, ``-morchestrator``)."""
    args = iter(argv[1:])
    for arg in args:
        if arg == "--check-hash-based-pycs":
            next(args, None)
            continue
        if not arg.startswith("-") or arg == "-" or arg.startswith("--"):
            return False  # a script, standard input, or a long option we do not know
        for i, flag in enumerate(arg[1:], start=2):
            if flag in "XW":  # an option with a value: the rest, or the next argument
                if i == len(arg):
                    next(args, None)
                break
            if flag == "m":
                return (arg[i:] or next(args, "")) == "orchestrator"
            if flag == "c":
                return False
    return False


if sys.argv[:1] == ["-m"] and running_as_main(list(getattr(sys, "orig_argv", []))):
    # While the module is located sys.argv[0] is "-m": the package is being imported by
    # ``python -m orchestrator`` itself, before its ``__main__``.
    KEPT = []
    _kept = KEPT
    signal.signal(signal.SIGTERM, lambda signum, _frame: _kept.append(signum))
