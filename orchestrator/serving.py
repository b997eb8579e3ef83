"""Running a worker or a reconciler in the calling thread until SIGTERM or SIGINT
(``Orchestrator.run_worker``, ``Orchestrator.run_reconciler``), with the metrics served
meanwhile when asked.

The event loop is uvloop's where it is installed (a dependency of the package, except on
Windows, where it does not run), else asyncio's own: ``event_loop`` (or the environment's
``ORCHESTRATOR_EVENT_LOOP``) picks one: ``auto``, ``uvloop`` or ``asyncio``. A worker's
Python time per step is mostly the loop's own (scheduling a task's next step, polling the
sockets, timers): on uvloop, whose loop is compiled, one worker draining K = 3 runs used
0.88–0.92× the CPU per step it used on asyncio's loop (``python -m bench.loops``;
docs/architecture.md, "The write path"). The guarantees do not depend on which: the test
suite runs workers in-process on asyncio's loop and as processes on uvloop's. Where the two
differ, the engine holds to asyncio's behaviour: a timer that uvloop fires early (it rounds
to the millisecond) is armed again for the rest (``Branches._due``), and the signal handlers
are removed before the loop closes (uvloop's ``close()`` leaves them).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any

from orchestrator.db.config import DatabaseTarget
from orchestrator.db.database import Database
from orchestrator.errors import ConfigurationError
from orchestrator.reconcile import Reconciler
from orchestrator.worker import Worker

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

log = logging.getLogger("orchestrator.app")

_EARLY_STOP = threading.Event()  # a SIGTERM that came before the loop's own handler (below)


def catch_early_sigterm() -> None:
    """For a process's entry point, before its slow start (imports, the database check): a
    SIGTERM that arrives before :meth:`Orchestrator.run_worker` or
    :meth:`Orchestrator.run_reconciler` installs its handler is kept, and the process stops
    cleanly as soon as it runs, instead of dying of the signal."""
    signal.signal(signal.SIGTERM, lambda _sig, _frame: _EARLY_STOP.set())


def stop_requested_early() -> None:
    """Keep a SIGTERM that an entry point caught before this package was loaded (see
    ``workers/cli.py``): the process stops cleanly as soon as its worker or reconciler
    runs, as with :func:`catch_early_sigterm`."""
    _EARLY_STOP.set()


def early_stop_requested() -> bool:
    """Whether a SIGTERM came before the process's own stop handling began (see
    :func:`catch_early_sigterm`): for an entry point that serves otherwise (the console)."""
    return _EARLY_STOP.is_set()


EVENT_LOOPS = ("auto", "uvloop", "asyncio")
ENV_EVENT_LOOP = "ORCHESTRATOR_EVENT_LOOP"


def event_loop_choice(event_loop: str | None, *, where: str = "event_loop") -> str:
    """The event loop a worker or reconciler of this process runs on: ``event_loop`` (given
    as ``where``: the argument, a command's flag), else ``ORCHESTRATOR_EVENT_LOOP``, else
    ``auto``; checked (``CONFIGURATION_ERROR``: not one of :data:`EVENT_LOOPS`, or ``uvloop``
    asked for where it is not installed) and resolved: ``uvloop`` or ``asyncio``."""
    if event_loop is None:
        event_loop = os.environ.get(ENV_EVENT_LOOP) or "auto"
        where = ENV_EVENT_LOOP
    if event_loop not in EVENT_LOOPS:
        raise ConfigurationError(f"{where} must be one of {', '.join(EVENT_LOOPS)}, not "
                                 f"{event_loop!r}")
    if event_loop == "asyncio":
        return event_loop
    try:
        import uvloop  # noqa: F401 - only whether it is there
    except ImportError:
        if event_loop == "uvloop":
            raise ConfigurationError(
                f"{where} is uvloop, which is not installed here: pip install uvloop (it does "
                "not run on Windows), or choose auto or asyncio") from None
        return "asyncio"
    return "uvloop"


def new_event_loop(choice: str) -> asyncio.AbstractEventLoop:
    """A new loop of the kind :func:`event_loop_choice` resolved (``uvloop`` or
    ``asyncio``)."""
    if choice not in ("uvloop", "asyncio"):
        raise ValueError(f"not a resolved event loop: {choice!r} (see event_loop_choice)")
    if choice == "uvloop":
        import uvloop

        loop: asyncio.AbstractEventLoop = uvloop.new_event_loop()
        return loop
    return asyncio.new_event_loop()


def listen_at(host: str, port: int | None) -> tuple[str, int] | None:
    return None if port is None else (host, port)


def run_until_stopped(create: Callable[[], Worker | Reconciler], *, database: Database,
                      listen: tuple[str, int] | None = None,
                      registry: Callable[[], CollectorRegistry] | None = None,
                      target: Callable[[], DatabaseTarget] | None = None,
                      event_loop: str = "asyncio") -> None:
    """Run a worker or a reconciler on a new event loop in this thread until SIGTERM or
    SIGINT (or one that came before, see :func:`catch_early_sigterm`), then close
    ``database``'s pools. ``listen``: where to serve the metrics meanwhile (``registry``'s,
    the gauges read from ``target``). ``event_loop``: ``uvloop`` or ``asyncio``, as
    :func:`event_loop_choice` resolved it."""

    async def main() -> None:
        service = create()
        loop = asyncio.get_running_loop()
        if isinstance(service, Reconciler):  # a worker says it in its own started line
            log.info("reconciler %s started: event loop %s", service.id,
                     type(loop).__module__.partition(".")[0])
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, service.request_stop)
        if _EARLY_STOP.is_set():
            service.request_stop()
        stop_exporter = None
        if listen is not None and registry is not None and target is not None:
            stop_exporter = _start_exporter(service, listen, registry(), target())
        try:
            await service.run()
        finally:
            # Given back while the loop runs: uvloop's close() leaves a closed loop's handlers
            # in place, and the process could not be interrupted any more.
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
            if stop_exporter is not None:
                stop_exporter()
            await database.close()

    run_bounded(main(), event_loop=event_loop)


STRAY_GRACE = 1.0
"""Seconds the tasks still running once a worker or reconciler has stopped (a workflow whose
drain ran out, and what it awaits) have to end once cancelled, before the process stops
without them."""


_LEFT_BEHIND: list[asyncio.Task[Any]] = []


def run_bounded(main: Coroutine[Any, Any, None], grace: float = STRAY_GRACE, *,
                event_loop: str = "asyncio") -> None:
    """``asyncio.run(main)``, except that the tasks left when ``main`` returns are waited for
    ``grace`` seconds once cancelled, not for ever: a tool that catches ``CancelledError`` and
    goes on would otherwise hold the stop past the drain timeout (and the process manager's
    grace period), until SIGKILL. What such a task had begun stays as the drain left it: its
    call ``submitted``, its run's lease held until it lapses (C6). ``event_loop``: the
    loop's kind (:func:`new_event_loop`)."""
    loop = new_event_loop(event_loop)
    try:
        asyncio.set_event_loop(loop)
        loop.run_until_complete(main)
    finally:
        try:
            _cancel_stragglers(loop, grace)
            loop.run_until_complete(loop.shutdown_asyncgens())
            loop.run_until_complete(loop.shutdown_default_executor())
        finally:
            asyncio.set_event_loop(None)
            loop.close()


def _cancel_stragglers(loop: asyncio.AbstractEventLoop, grace: float) -> None:
    tasks = [task for task in asyncio.all_tasks(loop) if not task.done()]
    if not tasks:
        return
    for task in tasks:
        task.cancel()
    loop.run_until_complete(asyncio.wait(tasks, timeout=grace))
    for task in tasks:
        if task.done() and not task.cancelled() and task.exception() is not None:
            loop.call_exception_handler({
                "message": "unhandled exception during shutdown", "exception": task.exception(),
                "task": task})
    stuck = [task for task in tasks if not task.done()]
    # Kept, not collected with the closed loop: a pending task destroyed is logged as an
    # error, and its coroutine closed mid-flight raises its cancellation again.
    _LEFT_BEHIND.extend(stuck)
    if stuck:
        log.warning("%d task%s still running %g s after %s cancelled (code that catches "
                    "CancelledError and goes on): stopping without waiting for %s",
                    len(stuck), "" if len(stuck) == 1 else "s", grace,
                    "it was" if len(stuck) == 1 else "they were",
                    "it" if len(stuck) == 1 else "them")


def _start_exporter(service: Worker | Reconciler, listen: tuple[str, int],
                    registry: CollectorRegistry, target: DatabaseTarget) -> Callable[[], None]:
    """Serve the metrics (and measure the loop's lag) until the returned function is called."""
    from orchestrator import telemetry

    worker = service if isinstance(service, Worker) else None

    def slots() -> tuple[int, int]:
        assert worker is not None
        return worker.active_runs, worker.concurrency

    exporter = telemetry.Exporter(registry, target,
                                  slots=slots if worker is not None else None)
    port = exporter.start(*listen)
    lag = asyncio.ensure_future(exporter.lag.run())
    log.info("metrics on %s", telemetry.metrics_url(listen[0], port))

    def stop() -> None:
        lag.cancel()
        exporter.stop()

    return stop
