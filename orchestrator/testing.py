"""Helpers for testing workflows and the engine, shared by users and by this project's tests.

A test that sleeps and hopes is slow when the machine is fast and flaky when it is slow. These
helpers wait for what the test means instead:

- :func:`wait_until` / :func:`wait_until_async`: poll a condition until it holds, with a
  deadline; on failure the message names what was awaited and the last value seen.
- :func:`run_until_idle` / :func:`run_until_idle_sync`: run a worker until there is nothing
  left for it to do (or until given runs and their child runs have ended or are waiting,
  timers due within ``timers_within`` seconds fired), then stop it.
- :func:`replay` / :func:`replay_async`: run new workflow code against stored journals
  (runs in the database, or exported with ``orchestrator runs export``), dispatching
  nothing: ``ok`` or the first ``NONDETERMINISM`` per run (docs/versioning.md).
- :func:`fault_gate`: arm a named fault point (:mod:`orchestrator.faults`) so that the engine
  stops there until the test releases it; ``await gate.arrived()`` says it got there.

Time is not injectable: the engine takes durable time from the database (``now()`` in its
statements) and timeouts from the event loop, and routing a fake clock through every one of
them would put a lookup on every step's path. A test of durable timers uses short real
durations and waits on the run's state with :func:`wait_until_async`.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable, Iterator, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from orchestrator import faults
from orchestrator import replay as checks
from orchestrator.app import Orchestrator
from orchestrator.db import queues as queues_db
from orchestrator.db import runs as runs_db
from orchestrator.db.database import Conn
from orchestrator.errors import AccessDenied, InvalidRequest
from orchestrator.faults import Gate
from orchestrator.handle import DENIED, RunHandle
from orchestrator.replay import RecordedRun, Verdict
from orchestrator.submission import as_run_id
from orchestrator.worker import Worker

__all__ = [
    "IDLE_STATES",
    "TERMINAL_STATES",
    "Gate",
    "fault_gate",
    "replay",
    "replay_async",
    "run_until_idle",
    "run_until_idle_sync",
    "running_worker",
    "wait_until",
    "wait_until_async",
]

TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})
"""A run in one of these states has its outcome."""

IDLE_STATES = TERMINAL_STATES | {"waiting", "needs_reconciliation"}
"""A run in one of these states needs nothing from a worker now: it has ended, or waits for a
timer, an event, a child or a reconciliation."""

POLL_INTERVAL = 0.02  # seconds between two looks at a condition


def _describe(condition: Callable[..., object], what: str | None) -> str:
    """``what``, else the condition's source line (a lambda's text), else its name."""
    if what:
        return what
    try:
        source = inspect.getsource(condition).strip()
    except (OSError, TypeError):
        source = ""
    if source and len(source) <= 300:
        return source
    return getattr(condition, "__qualname__", repr(condition))


def _timed_out(condition: Callable[..., object], what: str | None, timeout: float,
               last: object) -> AssertionError:
    return AssertionError(f"not met within {timeout} s: {_describe(condition, what)} "
                          f"(last value: {last!r})")


def wait_until(condition: Callable[[], object], *, timeout: float = 10.0,
               what: str | None = None, interval: float = POLL_INTERVAL) -> Any:
    """Call ``condition`` until it returns a true value and return that value.

    ``AssertionError`` after ``timeout`` seconds, naming ``what`` (default: the condition's
    source) and the last value. For a test that does not run in an event loop (the sync API);
    inside one, use :func:`wait_until_async`, which lets the engine run meanwhile. An async
    condition (one that returns an awaitable) is a ``TypeError``: it needs
    :func:`wait_until_async`.
    """
    give_up = time.monotonic() + timeout
    while True:
        last = condition()
        if inspect.isawaitable(last):  # truthy, and nothing here can await it
            if inspect.iscoroutine(last):
                last.close()
            raise TypeError("wait_until's condition returned an awaitable: use "
                            "wait_until_async for an async condition")
        if last:
            return last
        if time.monotonic() >= give_up:
            raise _timed_out(condition, what, timeout, last)
        time.sleep(interval)


async def wait_until_async(condition: Callable[[], object | Awaitable[object]], *,
                           timeout: float = 10.0, what: str | None = None,
                           interval: float = POLL_INTERVAL) -> Any:
    """Await ``condition`` (a plain or an async callable) until it returns a true value and
    return that value; ``AssertionError`` after ``timeout`` seconds, as :func:`wait_until`."""
    loop = asyncio.get_running_loop()
    give_up = loop.time() + timeout
    while True:
        last = condition()
        if inspect.isawaitable(last):
            last = await last
        if last:
            return last
        if loop.time() >= give_up:
            raise _timed_out(condition, what, timeout, last)
        await asyncio.sleep(interval)


@contextlib.contextmanager
def fault_gate(point: str, *, tool: str | None = None, block: bool = True) -> Iterator[Gate]:
    """Arm fault point ``point`` (for ``tool`` only, if given) for the body of the ``with``.

    With ``block=True`` the engine task that reaches the point waits there until
    ``gate.release()``; ``await gate.arrived()`` returns once one has. ``gate.hits`` counts
    the arrivals. On leaving the block the gate is disarmed and whatever it holds is let go,
    also when the test failed. ``ValueError`` for an unknown point.
    """
    gate = faults.arm(point, tool=tool, block=block)
    try:
        yield gate
    finally:
        faults.disarm(gate)


def _listed(items: object, name: str, what: str) -> list[Any]:
    """``items`` as a list; ``INVALID_REQUEST`` (``path`` ``name``) for one item given bare:
    a run id, a UUID, a handle, an export document or a recorded run. Iterated, text would
    give its characters and a document its keys, each then refused as a run that does not
    exist; a type checker lets both through (a ``str`` and a ``dict`` are iterables)."""
    if isinstance(items, str | bytes | uuid.UUID | RunHandle | RecordedRun | Mapping) or (
            not isinstance(items, Iterable)):
        raise InvalidRequest(f"{name} must be a list of {what}, got one "
                             f"{type(items).__name__}: wrap it in a list", path=name)
    return list(items)


def _run_ids(runs: Iterable[RunHandle | uuid.UUID | str]) -> list[uuid.UUID]:
    """The runs' ids; ``INVALID_REQUEST`` (``path`` ``run_id``) for text that is not a run id,
    as ``app.get_run`` answers it."""
    return [run.id if isinstance(run, RunHandle) else as_run_id(run) for run in runs]


def _due(row: dict[str, Any], now: datetime) -> bool:
    """A queued or waiting run that a worker would claim by ``now`` (its timer is due, its
    event has arrived)."""
    due = row["available_at"]
    return row["status"] in ("queued", "waiting") and due is not None and due <= now


def _horizon(timers_within: float) -> datetime:
    """The time up to which :func:`run_until_idle` drives timers (checked first)."""
    if isinstance(timers_within, bool) or not isinstance(timers_within, int | float) or not (
            0 <= timers_within < float("inf")):
        raise InvalidRequest(f"timers_within must be a number of seconds >= 0, got "
                             f"{timers_within!r}", path="timers_within")
    return datetime.now(UTC) + timedelta(seconds=timers_within)


async def _settled(app: Orchestrator, ids: list[uuid.UUID], horizon: datetime,
                   limit: int) -> bool:
    """Every run of ``ids``, every run started under one (a child, its children …) and every
    run one continued or was restarted as is in :data:`IDLE_STATES` or held back (queued,
    with its start later), and none is due by ``max(now, horizon)``."""
    now = max(datetime.now(UTC), horizon)

    async def look(conn: Conn) -> bool:
        # One snapshot: a child that ends and wakes its parent between two reads must not
        # show a waiting parent beside a finished child.
        await runs_db.run_read_snapshot(conn)
        rows = []
        for run_id in ids:
            row = await runs_db.run_get(conn, run_id, result=False)
            if row is None:
                raise AccessDenied(DENIED)
            rows.append(row)
        seen = set(ids)
        ready = []  # queued and due: idle only if their queue holds them back
        while rows:
            row = rows.pop()
            # queued and not due: held back (start_at, delay) past the horizon
            if row["status"] not in IDLE_STATES | {"queued"}:
                return False
            if _due(row, now):
                if row["status"] != "queued":
                    return False
                ready.append(row["id"])
            related = await runs_db.run_list(conn, tenant=None, principal=None, status=None,
                                             workflow=None, limit=limit, parent=row["id"])
            if row["superseded_by"] is not None:
                successor = await runs_db.run_get(conn, row["superseded_by"], result=False)
                related += [successor] if successor is not None else []
            rows += [r for r in related if r["id"] not in seen]
            seen.update(r["id"] for r in related)
        return await _held_by_queues(conn, ready, now)

    return await app.database.run_in_transaction(look)


async def _nothing_ready(app: Orchestrator, worker: Worker, horizon: datetime,
                         limit: int) -> bool:
    """The worker holds no run, and no run of a workflow it registers is running or ready
    (queued or waiting, due by ``max(now, horizon)`` by this process's clock)."""
    if worker.active_runs:
        return False
    registered = set(app.registry.workflows)
    now = max(datetime.now(UTC), horizon)
    ready = []  # queued and due: idle only if their queue holds them back
    async with app.database.connection() as conn:
        for status in ("running", "queued", "waiting"):
            rows = await runs_db.run_list(conn, tenant=None, principal=None, status=status,
                                          workflow=None, limit=limit)
            for row in rows:
                if f"{row['workflow_name']}@{row['workflow_version']}" not in registered:
                    continue
                if status == "queued" and _due(row, now):
                    ready.append(row["id"])
                elif status == "running" or _due(row, now):
                    return False
        return await _held_by_queues(conn, ready, now)


async def _held_by_queues(conn: Conn, ready: list[uuid.UUID], now: datetime) -> bool:
    """Whether every run of ``ready`` (queued and due) is one its queue keeps from starting
    until something outside the worker happens (the queue paused, its slots or its key's held
    by runs that wait): such a run is idle, as a held-back start is."""
    if not ready:
        return True
    return len(await queues_db.runs_held_by_queue(conn, ready, now)) == len(ready)


@contextlib.asynccontextmanager
async def running_worker(app: Orchestrator, *, drain_timeout: float = 30.0,
                         **options: Any) -> AsyncIterator[Worker]:
    """A worker of ``app`` running in this event loop for the body of the ``async with``;
    stopped (drained) on the way out, also when the body failed. ``options`` go to
    :meth:`Orchestrator.create_worker`."""
    worker = app.create_worker(drain_timeout=drain_timeout, **options)
    task = asyncio.ensure_future(worker.run())
    try:
        yield worker
    finally:
        worker.request_stop()
        await asyncio.wait_for(task, drain_timeout + 30)


async def run_until_idle(app: Orchestrator, *,
                         runs: Iterable[RunHandle | uuid.UUID | str] | None = None,
                         timers_within: float = 0.0, timeout: float = 30.0,
                         scan_limit: int = 1000, **options: Any) -> Worker:
    """Run a worker of ``app`` in this event loop until it is idle, stop it, and return it
    (its ``claimed`` count and metrics stay readable).

    Idle means: with ``runs``, every one of them, every run started under one of them (its
    child runs, theirs, and so on) and every run one continued as (``continue_as_new``) is
    in :data:`IDLE_STATES` (ended, or waiting for a timer, an event, a child or a
    reconciliation) or held back (``start_at``, ``delay``), and none is due (a timer that has
    fired, an event that has arrived or a start that has come makes a run due); without,
    the worker holds no run and no run of its workflows is running or due. A run ready to
    start that its queue keeps back until something outside the worker happens (the queue
    paused, its slots or its key's held by runs that all wait) is idle too; one that waits
    for the queue's rate window is not. The newest
    ``scan_limit`` runs of each state (with ``runs``: the newest ``scan_limit`` children of
    each run) are looked at. Due is judged by this process's clock.

    Timers are real time (time is not injectable): a run waiting for a durable timer (a
    ``ctx.sleep`` over 1 s, a wait's timeout, a retry's backoff, the run's deadline) is
    idle, and this returns
    without firing it. ``timers_within=S`` waits for the timers due within ``S`` seconds of
    this call and drives their runs too (``timeout`` must leave room for them). A sleep of at
    most 1 s is slept by the worker holding its run, which stays ``running``: it is always
    waited for.

    ``AssertionError`` if idle is not reached within ``timeout`` seconds (the worker is
    stopped all the same). A run of ``runs`` that the database does not hold is
    ``ACCESS_DENIED``, as for ``app.get_run``; text that is not a run id (``path`` ``run_id``)
    and one run given bare, not in a list, are ``INVALID_REQUEST``. ``options`` go to
    :meth:`Orchestrator.create_worker`, e.g. ``poll_interval``.
    """
    horizon = _horizon(timers_within)
    ids = None if runs is None else _run_ids(_listed(runs, "runs", "runs (handles or ids)"))
    async with running_worker(app, **options) as worker:
        if ids is not None:
            await wait_until_async(lambda: _settled(app, ids, horizon, scan_limit),
                                   timeout=timeout,
                                   what=f"runs {', '.join(map(str, ids))} ended or waiting")
        else:
            await wait_until_async(lambda: _nothing_ready(app, worker, horizon, scan_limit),
                                   timeout=timeout,
                                   what="no run running or due for this worker")
    return worker


def run_until_idle_sync(app: Orchestrator, *,
                        runs: Iterable[RunHandle | uuid.UUID | str] | None = None,
                        timers_within: float = 0.0, timeout: float = 30.0,
                        scan_limit: int = 1000, **options: Any) -> Worker:
    """:func:`run_until_idle` for a test that uses the sync API (``app.submit``,
    ``run.result``): the worker runs on the loop that serves those calls, then stops. It takes
    the same parameters."""
    coro = run_until_idle(app, runs=runs, timers_within=timers_within, timeout=timeout,
                          scan_limit=scan_limit, **options)
    return app._portal.call(coro)


Journal = RecordedRun | Mapping[str, Any] | RunHandle | uuid.UUID | str
"""What :func:`replay` checks: a run's export document (``orchestrator runs export``), a
:class:`~orchestrator.replay.RecordedRun`, or a run in ``app``'s database (a handle or an id)."""

JOURNALS = "journals (export documents, recorded runs, handles or run ids)"


async def replay_async(app: Orchestrator, journals: Iterable[Journal]) -> list[Verdict]:
    """Run ``app``'s workflow code against each journal, dispatching nothing (no tool is
    called, nothing is written): a :class:`~orchestrator.replay.Verdict` per run, in order;
    ``verdict.ok``, or ``verdict.verdict == "nondeterminism"`` with the ``position``, the
    ``recorded`` command and the ``issued`` one. Runs given by id are read from ``app``'s
    database (``app`` may be new code beside the one that wrote them); an id the database
    does not hold is ``ACCESS_DENIED``, as for ``app.get_run``; text that is not a run id
    (``path`` ``run_id``) and one journal given bare, not in a list, are
    ``INVALID_REQUEST``."""
    runs: list[RecordedRun] = []
    for item in _listed(journals, "journals", JOURNALS):
        if isinstance(item, RecordedRun):
            runs.append(item)
        elif isinstance(item, Mapping):
            runs.append(RecordedRun.from_document(item))
        else:
            run_id = _run_ids([item])[0]
            async with app.database.connection() as conn:
                found = await checks.load_runs(conn, run_id=run_id, last=1)
            if not found:
                raise AccessDenied(DENIED)
            runs.extend(found)
    return await checks.check_runs(runs, app.registry, app.arguments_text)


def replay(app: Orchestrator, journals: Iterable[Journal]) -> list[Verdict]:
    """:func:`replay_async` from synchronous code (a test, a script)."""
    items = _listed(journals, "journals", JOURNALS)
    return app._portal.call(replay_async(app, items))
