"""Running a worker or a reconciler in the calling thread until SIGTERM or SIGINT
(``Orchestrator.run_worker``, ``Orchestrator.run_reconciler``), with the metrics served
meanwhile when asked."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from orchestrator.db.config import DatabaseTarget
from orchestrator.db.database import Database
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
    ``workers/worker.py``): the process stops cleanly as soon as its worker or reconciler
    runs, as with :func:`catch_early_sigterm`."""
    _EARLY_STOP.set()


def listen_at(host: str, port: int | None) -> tuple[str, int] | None:
    return None if port is None else (host, port)


def run_until_stopped(create: Callable[[], Worker | Reconciler], *, database: Database,
                      listen: tuple[str, int] | None = None,
                      registry: Callable[[], CollectorRegistry] | None = None,
                      target: Callable[[], DatabaseTarget] | None = None) -> None:
    """Run a worker or a reconciler on a new event loop in this thread until SIGTERM or
    SIGINT (or one that came before, see :func:`catch_early_sigterm`), then close
    ``database``'s pools. ``listen``: where to serve the metrics meanwhile (``registry``'s,
    the gauges read from ``target``)."""

    async def main() -> None:
        service = create()
        loop = asyncio.get_running_loop()
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
            if stop_exporter is not None:
                stop_exporter()
            await database.close()

    asyncio.run(main())


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
    log.info("metrics on http://%s:%d/metrics", listen[0], port)

    def stop() -> None:
        lag.cancel()
        exporter.stop()

    return stop
