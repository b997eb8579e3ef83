"""``orchestrator worker`` and ``orchestrator reconciler``: the long-running processes of an
application. Both log at INFO on standard error, as text or one JSON object per line
(``--log-format``, or ``ORCHESTRATOR_LOG_FORMAT``; docs/logging.md)."""

from __future__ import annotations

import argparse
import gc
import importlib
import logging
import os
import sys
import traceback
from collections.abc import Callable
from typing import Any

from orchestrator import logs
from orchestrator.app import MAX_LEASE_TTL, MIN_LEASE_TTL, Orchestrator, catch_early_sigterm
from orchestrator.cli.options import MAX_PORT, one_of, seconds, whole
from orchestrator.db import migrate
from orchestrator.db.config import ENV_URL
from orchestrator.db.probe import ping
from orchestrator.errors import ConfigurationError, InvalidRequest, OrchestratorError
from orchestrator.reconcile import PRUNE_INTERVAL, UNSERVED_GRACE
from orchestrator.serving import ENV_EVENT_LOOP, EVENT_LOOPS, event_loop_choice


def register(subparsers: Any) -> None:
    worker = subparsers.add_parser(
        "worker", help="claim and run workflows until SIGTERM (then drain)")
    add_app_argument(worker)
    worker.add_argument("--concurrency", type=whole("--concurrency", low=1), default=10,
                        help="runs held at once (default 10)")
    worker.add_argument("--lease-ttl", type=seconds("--lease-ttl"), default=None,
                        help="seconds a lease lasts without a heartbeat (default: the app's)")
    worker.add_argument("--poll-interval", type=seconds("--poll-interval"), default=1.0,
                        metavar="SECONDS",
                        help="seconds between looks for work when no notification came "
                             "(default 1; all there is behind a transaction pooler without "
                             "--listen-url, docs/operations.md)")
    worker.add_argument("--drain-timeout", type=seconds("--drain-timeout", zero=True),
                        default=30.0, metavar="SECONDS",
                        help="on SIGTERM, seconds the runs in flight have to reach a durable "
                             "point before they are abandoned (default 30; a second signal "
                             "stops at once). Give the process manager's stop grace period "
                             "about 10 s more")
    worker.add_argument("--migrate", action="store_true",
                        help="upgrade the schema first instead of refusing an old one")
    worker.add_argument("--no-schedules", dest="schedules", action="store_false",
                        help="do not tick the schedules here (other workers do; "
                             "docs/schedules.md)")
    add_log_format_argument(worker)
    add_metrics_arguments(worker)
    add_event_loop_argument(worker)
    worker.set_defaults(func=cmd_worker, stops_on_sigterm=True)

    reconciler = subparsers.add_parser(
        "reconciler", help="resolve unknown operations with the tools' lookups until SIGTERM")
    add_app_argument(reconciler)
    reconciler.add_argument("--max-lookups", type=whole("--max-lookups", low=1), default=5,
                            help="inconclusive lookups before an operator decides (default 5)")
    reconciler.add_argument("--base-delay", type=seconds("--base-delay"), default=1.0,
                            help="seconds before the second lookup; doubles after (default 1)")
    reconciler.add_argument("--max-delay", type=seconds("--max-delay"), default=300.0,
                            metavar="SECONDS",
                            help="the longest pause between two lookups of one operation "
                                 "(default 300)")
    reconciler.add_argument("--lookup-timeout", type=seconds("--lookup-timeout"), default=30.0,
                            metavar="SECONDS",
                            help="how long one lookup may take before it counts as "
                                 "inconclusive (default 30)")
    reconciler.add_argument("--batch", type=whole("--batch", low=1), default=10, metavar="N",
                            help="unknown operations claimed at a time (default 10)")
    reconciler.add_argument("--poll-interval", type=seconds("--poll-interval"), default=1.0,
                            metavar="SECONDS",
                            help="seconds between looks for unknown operations when no "
                                 "notification came (default 1)")
    reconciler.add_argument("--prune-interval", type=seconds("--prune-interval"),
                            default=PRUNE_INTERVAL, metavar="SECONDS",
                            help="seconds between two prunes, for an app with a retention "
                                 f"(default {PRUNE_INTERVAL:g}; docs/retention.md)")
    reconciler.add_argument("--unserved-grace", type=seconds("--unserved-grace", zero=True),
                            default=UNSERVED_GRACE,
                            metavar="SECONDS",
                            help="seconds an unknown operation of a tool this app does not "
                                 "register waits for a reconciler that has it before this one "
                                 f"hands it to operators (default {UNSERVED_GRACE:g}; 0: at "
                                 "once)")
    add_log_format_argument(reconciler)
    add_metrics_arguments(reconciler)
    add_event_loop_argument(reconciler)
    reconciler.set_defaults(func=cmd_reconciler, stops_on_sigterm=True)


def add_app_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--app", required=True, metavar="MODULE:ATTR",
                        help="where the Orchestrator instance is, e.g. myproject.flows:app")


def add_log_format_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--log-format", choices=logs.FORMATS,
                        type=one_of("--log-format", logs.FORMATS), default=None,
                        help=f"how log lines look on stderr: text, or one JSON object per line "
                        f"(default: {logs.ENV_LOG_FORMAT}, else text)")


def add_metrics_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--metrics-port", type=whole("--metrics-port", low=0, high=MAX_PORT),
                        default=None, metavar="N",
                        help="serve /metrics (Prometheus) and /healthz on this port "
                        "(docs/metrics.md; default: none)")
    parser.add_argument("--metrics-host", default="127.0.0.1",
                        help="the address --metrics-port listens on (default 127.0.0.1; 0.0.0.0: "
                        "every IPv4 address, '::': every IPv6 and IPv4 address)")


def add_event_loop_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--event-loop", choices=EVENT_LOOPS,
                        type=one_of("--event-loop", EVENT_LOOPS), default=None,
                        help="auto (uvloop where installed, else asyncio's own), uvloop or "
                        f"asyncio (default: {ENV_EVENT_LOOP}, else auto)")


def metrics_options(args: argparse.Namespace) -> dict[str, Any]:
    if args.metrics_port is None:
        return {}
    return {"metrics_port": args.metrics_port, "metrics_host": args.metrics_host}


def start_logging(args: argparse.Namespace) -> Callable[[str], None]:
    """Log at INFO in the chosen format; return how the process announces its start and stop:
    a line on stdout with text logs, a log line with JSON logs (so that a collector reading
    both streams gets JSON only)."""
    chosen = logs.log_format(args.log_format)
    logs.configure(chosen)
    if chosen == "json":
        return logging.getLogger("orchestrator.cli").info
    return lambda line: print(line, flush=True)


def load_app(spec: str, database_url: str | None) -> Orchestrator:
    """Import ``module:attr`` (from the current directory too) and return the Orchestrator."""
    if database_url:
        os.environ[ENV_URL] = database_url  # for apps built with Orchestrator() and no URL
    module_name, _, attr = spec.partition(":")
    if not module_name or not attr:
        raise ConfigurationError(f"--app {spec!r} must look like package.module:attribute")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and not _names_the_module(exc.name, module_name):
            # The module was found; one it imports was not.
            raise ConfigurationError(
                f"importing {module_name!r} for --app failed: {exc} (a module it imports: "
                "install that in this environment, or put its directory on PYTHONPATH)"
            ) from None
        raise ConfigurationError(
            f"cannot import {module_name!r} for --app: {exc}; run the command from the "
            "directory that holds the module, or put that directory on PYTHONPATH") from None
    except ImportError as exc:
        raise ConfigurationError(
            f"cannot import {module_name!r} for --app: {exc}; run the command from the "
            "directory that holds the module, or put that directory on PYTHONPATH") from None
    except OrchestratorError:
        raise  # the application's own refusal (Orchestrator(...) misconfigured): its code
    except Exception as exc:
        # The application's code raised while its module ran: its error, not the command's.
        if os.environ.get(ENV_DEBUG) == "1":
            raise  # the command line shows its traceback
        raise ConfigurationError(
            f"importing {module_name!r} for --app raised {_raised(exc)}{_raised_where(exc)}"
            + ("" if isinstance(exc, _TOLD) else
               f"; run again with {ENV_DEBUG}=1 to see its message and traceback")) from None
    # The module's own instances, named in the refusals below: what --app should have said.
    instances = ", ".join(name for name, value in vars(module).items()
                          if isinstance(value, Orchestrator))
    if not hasattr(module, attr):
        raise ConfigurationError(
            f"--app {spec}: module {module_name!r} has no attribute {attr!r}; "
            + (f"its orchestrator.Orchestrator instances: {instances}" if instances
               else "it defines no orchestrator.Orchestrator instance"))
    app = getattr(module, attr)
    if not isinstance(app, Orchestrator):
        kind = "None" if app is None else f"a {type(app).__name__}"
        raise ConfigurationError(
            f"--app {spec} is {kind}, not an orchestrator.Orchestrator instance; "
            + (f"the module's instances: {instances}" if instances
               else "the module defines none"))
    return app


def _names_the_module(missing: str, module_name: str) -> bool:
    """Whether the module not found is the one ``--app`` names or a package on its path."""
    return module_name == missing or module_name.startswith(missing + ".")


# Exceptions whose message Python writes about the code itself, shown in full; any other's
# text may carry what the module handled (a URL with a password, a token), as an unexpected
# exception's may, and is shown only with ORCHESTRATOR_DEBUG=1.
_TOLD = (SyntaxError, NameError, AttributeError)
ENV_DEBUG = "ORCHESTRATOR_DEBUG"  # orchestrator.cli.ENV_DEBUG (which imports this module)


def _raised(exc: BaseException) -> str:
    """The exception's type, and for the kinds in :data:`_TOLD` its message on one line."""
    if not isinstance(exc, _TOLD):
        return type(exc).__name__
    text = " ".join((exc.msg if isinstance(exc, SyntaxError) else str(exc)).split())
    return f"{type(exc).__name__}: {text if len(text) <= 300 else text[:299] + '…'}"


def _raised_where(exc: BaseException) -> str:
    """`` (file, line N)`` where the exception was raised: for a syntax error the line that
    does not parse, else the innermost frame outside the import machinery."""
    if isinstance(exc, SyntaxError) and exc.filename and exc.lineno:
        return f" ({exc.filename}, line {exc.lineno})"
    frames = [frame for frame in traceback.extract_tb(exc.__traceback__)
              if not frame.filename.startswith("<frozen ")]
    if not frames:
        return ""
    return f" ({frames[-1].filename}, line {frames[-1].lineno})"


def ensure_schema(app: Orchestrator, *, upgrade: bool) -> None:
    status = migrate.check(app.target)
    if status.ok:
        return
    if upgrade and status.state != "ahead":
        migrate.upgrade(app.target)
        return
    raise migrate.schema_error(app.target, status)


def cmd_worker(args: argparse.Namespace) -> int:
    catch_early_sigterm()
    # The options' types refused values out of range (cli.options); the lease's bounds say why.
    if args.lease_ttl is not None and args.lease_ttl < MIN_LEASE_TTL:
        raise InvalidRequest(f"--lease-ttl must be at least {MIN_LEASE_TTL:g} s (a heartbeat "
                             "renews a lease a third of its TTL apart, and must land before "
                             "it runs out)", path="lease_ttl")
    if args.lease_ttl is not None and args.lease_ttl > MAX_LEASE_TTL:
        raise InvalidRequest(f"--lease-ttl must be at most {MAX_LEASE_TTL:g} s (a day: a dead "
                             "worker's runs wait that long for their leases where no liveness "
                             "lock tells its death)", path="lease_ttl")
    event_loop = event_loop_choice(args.event_loop, where="--event-loop")
    announce = start_logging(args)
    app = load_app(args.app, args.database_url)
    ping(app.target)
    ensure_schema(app, upgrade=args.migrate)
    options: dict[str, Any] = {"concurrency": args.concurrency, "schedules": args.schedules,
                               "poll_interval": args.poll_interval,
                               "drain_timeout": args.drain_timeout, "event_loop": event_loop,
                               **metrics_options(args)}
    if args.lease_ttl is not None:
        options["lease_ttl"] = args.lease_ttl
    announce(f"worker starting on {app.target.masked} with {args.concurrency} slots; "
             "SIGTERM drains")
    settle_garbage_collector()
    app.run_worker(**options)
    announce("worker stopped")
    return 0


GC_YOUNG_THRESHOLD = 20_000
"""Allocations between two collections of the youngest generation in a worker process
(Python's default is 700). A step allocates hundreds of short-lived containers (tasks, futures,
rows) that reference counting frees anyway; collecting every 700 made the collector a visible
share of a busy worker's CPU."""


def settle_garbage_collector() -> None:
    """For a worker process (its own, so process-wide settings are ours to choose): what is
    loaded by now (modules, the application, its registry) lives as long as the process, so it
    is moved out of the collector's way (``gc.freeze``), and young generations are collected
    less often. Reference cycles are still collected, a little later."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


def cmd_reconciler(args: argparse.Namespace) -> int:
    catch_early_sigterm()  # the options' types refused values out of range (cli.options)
    event_loop = event_loop_choice(args.event_loop, where="--event-loop")
    announce = start_logging(args)
    app = load_app(args.app, args.database_url)
    ping(app.target)
    ensure_schema(app, upgrade=False)
    metrics = metrics_options(args)
    announce(f"reconciler starting on {app.target.masked}; SIGTERM stops it")
    app.run_reconciler(max_lookups=args.max_lookups, base_delay=args.base_delay,
                       max_delay=args.max_delay, batch=args.batch,
                       poll_interval=args.poll_interval, lookup_timeout=args.lookup_timeout,
                       prune_interval=args.prune_interval,
                       unserved_grace=args.unserved_grace, event_loop=event_loop, **metrics)
    announce("reconciler stopped")
    return 0
