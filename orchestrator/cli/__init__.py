"""The ``orchestrator`` command line.

Each command group is a module in this package with a ``register(subparsers)`` function that
adds its parsers and sets ``func`` on every leaf parser; ``func(args)`` returns the exit code.
Adding a group means writing such a module and listing it in :data:`GROUPS`.

Exit codes: 0 success; 1 the command ran and found a problem it reports (``db check`` on a
database that is not current); 2 bad usage or configuration, or any orchestrator error (one
line on stderr, ``orchestrator: error: CODE: message``); 70 an unexpected internal error;
141 the output's reader went away (``| head``), nothing printed.
Stack traces are never printed unless ``ORCHESTRATOR_DEBUG=1`` is set.
"""

from __future__ import annotations

import argparse
import os
import select
import signal
import sys
from collections.abc import Sequence
from types import ModuleType

from orchestrator.cli import (
    console,
    db,
    demo,
    incidents,
    ops,
    queues,
    replay,
    retention,
    runs,
    schedules,
    worker,
    workers,
)
from orchestrator.cli.options import one_of
from orchestrator.db.config import ENV_LISTEN_URL, ENV_POOLER, POOLERS
from orchestrator.errors import OrchestratorError
from orchestrator.serving import catch_early_sigterm, stop_requested_early

GROUPS: list[ModuleType] = [db, worker, workers, runs, replay, ops, incidents, schedules,
                            queues, retention, console, demo]
"""Command group modules, in the order ``--help`` lists them."""

EXIT_OK = 0
EXIT_FINDING = 1
EXIT_ERROR = 2
EXIT_INTERNAL = 70
EXIT_BROKEN_PIPE = 141  # what a shell reports for a program that wrote to a closed pipe

PREPARED_STATEMENT_STATES = frozenset({"42P05", "26000"})
"""The SQLSTATEs of a prepared statement that already exists, or does not exist, on the
session: what a pooler in transaction mode answers a client that prepares statements."""
POOLER_HINT = (
    "CONFIGURATION_ERROR: the database refused a prepared statement of this command's own "
    "(it already existed, or did not exist, on the server session): the database URL "
    "seems to lead to a pooler in transaction mode (PgBouncer's pool_mode = transaction); "
    f"give --pooler transaction (or {ENV_POOLER}=transaction), and --listen-url with the "
    "server's own address for notifications and liveness locks "
    "(docs/operations.md, \"Behind a connection pooler\")")
ENV_DEBUG = "ORCHESTRATOR_DEBUG"

PROG = "orchestrator"


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every group in :data:`GROUPS` registered."""
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="A durable workflow orchestrator on PostgreSQL.",
    )
    parser.add_argument(
        "--database-url",
        metavar="URL",
        default=None,
        help="the PostgreSQL database to use (overrides ORCHESTRATOR_DATABASE_URL; without "
        "either, an embedded PostgreSQL in a per-user directory is used)",
    )
    parser.add_argument(
        "--pooler", choices=POOLERS, type=one_of("--pooler", POOLERS), default=None,
        help=f"the database URL leads to a pooler in this mode (overrides {ENV_POOLER}; "
        "docs/operations.md): no prepared statements, no session state between transactions",
    )
    parser.add_argument(
        "--listen-url", metavar="URL", default=None,
        help=f"the same database reached directly, for notifications and the workers' "
        f"liveness locks behind a transaction pooler (overrides {ENV_LISTEN_URL}; without "
        "it, workers poll)",
    )
    subparsers = parser.add_subparsers(title="commands", metavar="COMMAND")
    for group in GROUPS:
        group.register(subparsers)
    parser.set_defaults(func=None, help_parser=parser)
    return parser


def _export_pooler_options(args: argparse.Namespace) -> None:
    """``--pooler`` and ``--listen-url`` are read where the database is resolved, from the
    environment (``resolve_database``): an ``--app`` application built without them, and the
    commands that need no application, see them alike."""
    for name, value in ((ENV_POOLER, args.pooler), (ENV_LISTEN_URL, args.listen_url)):
        if value is not None:
            os.environ[name] = value


def _one_line(text: str) -> str:
    return " ".join(text.split())


def error(message: str) -> None:
    """Print one ``orchestrator: error: …`` line on stderr."""
    print(f"{PROG}: error: {_one_line(message)}", file=sys.stderr)


def main(argv: Sequence[str] | None = None, *, early_sigterm: list[int] | None = None) -> int:
    """Run the command line and return the process exit code. ``early_sigterm``: the SIGTERMs
    an entry point kept while the package loaded (``workers/cli.py``), handed over once the
    command is known (:func:`_hand_over_sigterm`)."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except OrchestratorError as exc:  # an option's value refused (cli.options): nothing ran
        error(str(exc))
        return EXIT_ERROR
    if early_sigterm is not None:
        _hand_over_sigterm(args, early_sigterm)
    if args.func is None:
        args.help_parser.print_help(sys.stderr)
        return EXIT_ERROR
    _export_pooler_options(args)
    try:
        code = int(args.func(args))
        sys.stdout.flush()  # a reader that went away shows here, not at the interpreter's exit
        return code
    except OrchestratorError as exc:
        error(str(exc))
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        debug = os.environ.get(ENV_DEBUG) == "1"
        if isinstance(exc, BrokenPipeError) and not debug and _stdout_closed():
            # `orchestrator runs show ID | head`: the reader closed the pipe; not a failure of
            # the command, so nothing is printed. Later writes (the interpreter's own final
            # flush) go to /dev/null instead of failing again. (A pipe of the command's own
            # that breaks is an internal error like any other.)
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return EXIT_BROKEN_PIPE
        if debug:
            raise
        if getattr(exc, "sqlstate", None) in PREPARED_STATEMENT_STATES:
            error(POOLER_HINT)
            return EXIT_ERROR
        # The text of an unexpected exception may carry driver messages or credentials.
        error(
            f"INTERNAL: unexpected {type(exc).__name__}; "
            f"run again with {ENV_DEBUG}=1 to see the traceback"
        )
        return EXIT_INTERNAL


def _hand_over_sigterm(args: argparse.Namespace, kept: list[int]) -> None:
    """A long-running command (``stops_on_sigterm``: worker, reconciler, console) takes SIGTERM
    with the package's keeper from here on, and one that came while the package loaded stops
    it cleanly as soon as it runs; any other command gets the default back, and dies of a
    signal that came meanwhile, as it would have without the entry point's keeper."""
    if getattr(args, "stops_on_sigterm", False):
        catch_early_sigterm()
        if kept:
            stop_requested_early()
        return
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if kept:
        signal.raise_signal(signal.SIGTERM)


def _stdout_closed() -> bool:
    """Whether standard output is a pipe whose reader has gone (a write would fail)."""
    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll(), or no real stdout
        return False
