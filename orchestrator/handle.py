"""A run as its owner sees it (:class:`RunHandle`), and waiting for many runs at once.

A handle holds the run's id and owner and asks the orchestrator that made it (any object with
the :class:`Client` members: the :class:`~orchestrator.app.Orchestrator` is one) for its
status, result, journal and stream.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Coroutine, Iterable, Iterator, Sequence
from datetime import timedelta
from functools import partial
from typing import Any, Generic, Protocol, TypeVar

from typing_extensions import TypeVar as DefaultTypeVar

from orchestrator._portal import check_sync_caller
from orchestrator.db import operations as ops_db
from orchestrator.db import runs as runs_db
from orchestrator.db.database import Conn, Database
from orchestrator.errors import (
    AccessDenied,
    InvalidRequest,
    OperationInProgress,
    OperationUncertain,
    ResultTimeout,
    RunFailed,
    RunPruned,
)
from orchestrator.journal import shown
from orchestrator.models import JournalEntry, Owner, RunInfo
from orchestrator.stream import RunStreams, check_cursor, check_follow, check_kept, check_topics
from orchestrator.waiting import RunWaits

T = TypeVar("T")
R_co = DefaultTypeVar("R_co", covariant=True, default=Any)
H = TypeVar("H", bound="RunHandle[Any]")
TERMINAL = ("succeeded", "failed", "cancelled")
DENIED = "the run does not exist or is not accessible to this owner"


class _Portal(Protocol):
    def call(self, coro: Coroutine[Any, Any, T], *, instead: str | None = None) -> T: ...


class Client(Protocol):
    """What a handle asks of the orchestrator that made it."""

    @property
    def database(self) -> Database: ...

    @property
    def _portal(self) -> _Portal: ...

    @property
    def _streams(self) -> RunStreams: ...

    @property
    def _waits(self) -> RunWaits: ...

    async def _row(self, run_id: uuid.UUID, owner: Owner, *, result: bool = False
                   ) -> dict[str, Any]: ...

    async def cancel_async(self, run_id: uuid.UUID | str, *, owner: Owner | None = None
                           ) -> str: ...

    async def journal_async(self, run_id: uuid.UUID | str, *, owner: Owner | None = None
                            ) -> list[JournalEntry]: ...

    async def restart_async(self, run_id: uuid.UUID | str, *, reason: str,
                            from_position: int | None = None, operator: str | None = None,
                            owner: Owner | None = None) -> RunHandle[Any]: ...


class RunHandle(Generic[R_co]):
    """One run, as seen by its owner; ``R_co`` is its workflow's result type (for type
    checkers: ``submit(workflow, input)`` gives a ``RunHandle`` of what ``workflow`` returns)."""

    def __init__(self, app: Client, run_id: uuid.UUID, owner: Owner) -> None:
        self.app = app
        self.id = run_id
        self.owner = owner

    def __repr__(self) -> str:
        return f"RunHandle({self.id})"

    async def info_async(self) -> RunInfo:
        return RunInfo.from_row(await self.app._row(self.id, self.owner))

    def info(self) -> RunInfo:
        return self.app._portal.call(self.info_async())

    async def latest_async(self) -> RunInfo:
        """The run the chain is at: this run, or, when it continued as new
        (``ctx.continue_as_new``) or was restarted, the last run of its chain (``latest().id``
        differs then)."""
        return RunInfo.from_row(await self._last(self.id))

    def latest(self) -> RunInfo:
        """Sync twin of :meth:`latest_async`."""
        return self.app._portal.call(self.latest_async())

    async def status_async(self) -> str:
        return (await self.info_async()).status

    def status(self) -> str:
        """The run's current status, e.g. ``queued``, ``waiting``, ``succeeded`` (this run's:
        one that continued as new is ``succeeded``, ``info().outcome`` ``CONTINUED_AS_NEW``,
        one restarted keeps its own end; :meth:`result` follows either, and :meth:`latest` says
        where the chain is)."""
        return self.app._portal.call(self.status_async())

    async def _last(self, run_id: uuid.UUID) -> dict[str, Any]:
        """The row of ``run_id``, or, when it continued as new (``ctx.continue_as_new``) or
        was restarted, of the last run of its chain (the same owner's); ``RUN_PRUNED`` when the
        chain's next run is gone (retention deleted it with its evidence while an earlier one
        was kept)."""
        row = await self.app._row(run_id, self.owner, result=True)
        owner = (self.owner.tenant, self.owner.principal)

        async def last_of(conn: Conn, start: uuid.UUID) -> uuid.UUID | None:
            return await runs_db.run_last_id(conn, start, owner=owner)

        # The last run found may have continued (or been restarted) before its row is read:
        # look again from it.
        while row["superseded_by"] is not None:
            last = await self.app.database.read(partial(last_of, start=row["id"]))
            if last == row["id"]:  # the run that superseded it is gone: deleted by retention
                how = ("continued as" if row["outcome_code"] == runs_db.CONTINUED
                       else "was restarted as")
                raise RunPruned(
                    f"run {row['id']} {how} run {row['superseded_by']}, which retention "
                    "has deleted with its evidence: the chain's result is no longer kept "
                    "(docs/retention.md)", status=row["status"], outcome=row["outcome_code"],
                    pruned_at=row.get("pruned_at"))
            row = await self.app._row(last if last is not None else row["superseded_by"],
                                      self.owner, result=True)
        return row

    async def result_async(self, timeout: float | timedelta | None = None) -> R_co:
        """Wait until the run is terminal; return its result or raise its outcome (C13). A
        run that continued as new (``ctx.continue_as_new``) is followed to the last run of its
        chain: its result is the chain's; so is a run that was restarted (``restart``).

        Raises ``RESULT_TIMEOUT`` (with the current ``status``) when ``timeout`` passes first;
        waiting changes nothing. The waits of one event loop share one poller: a statement
        per pause however many wait (``orchestrator.waiting``); cancelling the caller ends
        its wait.
        """
        seconds = _timeout_seconds(timeout)
        loop = asyncio.get_running_loop()
        give_up = None if seconds is None else loop.time() + seconds
        row = await self._last(self.id)
        while True:
            if row["status"] in TERMINAL:
                result: R_co = _outcome(row)
                return result
            left = None if give_up is None else give_up - loop.time()
            if left is not None and left <= 0:
                raise ResultTimeout(_still(row["status"], self.id), status=row["status"])
            # Every wait of this event loop shares one poller (orchestrator.waiting); woken
            # (the run ended, or went) or out of time, the run is read again here.
            await self.app._waits.finished(row["id"], self.owner, left)
            row = await self._last(row["id"])

    def result(self, timeout: float | timedelta | None = None) -> R_co:
        return self.app._portal.call(self.result_async(timeout))

    async def outcome_async(self) -> R_co:
        """The outcome now, without waiting (submission-level replay).

        Finished: the stored result, or the stored failure raised again; nothing is called.
        Blocked on an unknown operation: ``OPERATION_UNCERTAIN`` with the operations known to be
        committed so far. Otherwise: ``OPERATION_IN_PROGRESS`` with the current status. A run
        that continued as new answers for the last run of its chain.
        """
        row = await self._last(self.id)
        if row["status"] in TERMINAL:
            result: R_co = _outcome(row)
            return result
        if row["status"] == "needs_reconciliation":
            last = row["id"]
            ops = await self.app.database.read(
                lambda conn: ops_db.operation_list_for_run(conn, last))
            known = [{"position": o["position"], "tool": o["tool_name"], "receipt": o["receipt"]}
                     for o in ops if o["state"] == "committed"]
            raise OperationUncertain(
                "the run is blocked on an operation whose outcome is unknown",
                known_operations=known)
        raise OperationInProgress(f"the run is {row['status']}", status=row["status"])

    def outcome(self) -> R_co:
        return self.app._portal.call(self.outcome_async())

    async def cancel_async(self) -> str:
        return await self.app.cancel_async(self.id, owner=self.owner)

    def cancel(self) -> str:
        """Request cancellation (see ``Orchestrator.cancel_async``)."""
        return self.app._portal.call(self.cancel_async())

    async def journal_async(self) -> list[JournalEntry]:
        return await self.app.journal_async(self.id, owner=self.owner)

    async def restart_async(self, *, reason: str, from_position: int | None = None,
                            operator: str | None = None) -> RunHandle[R_co]:
        """Restart this finished run as a new run that does not repeat its effects
        (``Orchestrator.restart_async``); the new run's handle."""
        return await self.app.restart_async(self.id, reason=reason, from_position=from_position,
                                            operator=operator, owner=self.owner)

    def restart(self, *, reason: str, from_position: int | None = None,
                operator: str | None = None) -> RunHandle[R_co]:
        """Sync twin of :meth:`restart_async`."""
        return self.app._portal.call(self.restart_async(
            reason=reason, from_position=from_position, operator=operator))

    def journal(self) -> list[JournalEntry]:
        return self.app._portal.call(self.journal_async())

    def events(self, after: int = 0, *, follow: bool = True,
               topics: Sequence[str] | None = None) -> AsyncIterator[JournalEntry]:
        """The run's stream (CONTRACT C14): its journal entries with ``seq`` greater than
        ``after``, in ``seq`` order, following the run live until it ends.

        ``after`` is a cursor: the ``seq`` of the last entry seen (0, the default, for the
        beginning); a client that reconnects with the last ``seq`` it saw gets every later
        entry exactly once. Following, the iterator waits for new entries (the run's revision
        is polled, every 50 ms while anything followed moves, at most every 200 ms after a
        quiet second: docs/streams.md) and ends right after yielding the run's terminal entry
        (``run.completed``, ``run.failed``, ``run.cancelled`` or ``run.continued``), or, if
        the run had ended before the cursor, after what follows it. ``follow=False`` yields
        what exists now and ends. ``topics`` (a list of names) keeps only the messages that
        workflow code published on those topics (``ctx.publish``) and the run's terminal
        entry.

        The arguments are checked here (``INVALID_REQUEST``: a cursor that is not an ``int``
        from 0, a ``follow`` that is not True or False, topics that are not a list of names);
        the owner when iteration begins: another
        owner's run is ``ACCESS_DENIED``, as a missing one (C9). Reading never dispatches
        anything (C3). An entry newer than this code is ``SCHEMA_UNSUPPORTED``, after the
        entries before it. A run that retention pruned is ``RUN_PRUNED`` when iteration
        begins (its journal is gone), unless ``after`` is already at its end.
        """
        return _flat(self._pages(check_cursor(after), check_follow(follow),
                                 check_topics(topics)))

    def events_sync(self, after: int = 0, *, follow: bool = True,
                    topics: Sequence[str] | None = None) -> Iterator[JournalEntry]:
        """:meth:`events` for synchronous code: each page of entries is read on the private
        loop; the caller's thread waits between them."""
        return _portal_iterate(self.app, self._pages(check_cursor(after), check_follow(follow),
                                                     check_topics(topics)),
                               "async for entry in RunHandle.events()")

    async def _pages(self, after: int, follow: bool, topics: tuple[str, ...] | None
                     ) -> AsyncGenerator[list[JournalEntry], None]:
        row = await self.app._row(self.id, self.owner)  # the owner's run, else ACCESS_DENIED
        check_kept(row, after)
        pages = self.app._streams.pages(self.id, after=after, follow=follow, topics=topics)
        try:
            async for page in pages:
                yield [JournalEntry.from_row(shown(row)) for row in page]
        finally:
            await pages.aclose()



_WHY_STILL = {
    "queued": "it waits for its start, for its queue to let it start (paused, full, its "
              "rate window), or for a worker that serves this workflow and version "
              "(`orchestrator runs show {id}` says which)",
    "waiting": "it waits for a timer, an event or a child run",
    "needs_reconciliation": "an operation's outcome is unknown and waits for reconciliation: "
                            "see `orchestrator ops list`",
}


def _still(status: str, run_id: uuid.UUID) -> str:
    """RESULT_TIMEOUT's message: the status the run is in, and what that usually means."""
    why = _WHY_STILL.get(status)
    text = f"the run's status is still {status}"
    return text if why is None else f"{text}; {why.format(id=run_id)}"


def _outcome(row: dict[str, Any]) -> Any:
    if row["status"] == "succeeded":
        if row.get("pruned_at") is not None:  # its result went with its journal
            raise RunPruned(f"run {row['id']} succeeded and was pruned by retention at "
                            f"{row['pruned_at'].isoformat()}: its result is no longer kept "
                            "(docs/retention.md)", status=row["status"],
                            outcome=row["outcome_code"], pruned_at=row["pruned_at"])
        return row["result"]
    error = row["error"] or {}
    code = row["outcome_code"] or ("CANCELLED" if row["status"] == "cancelled"
                                   else "WORKFLOW_FAILED")
    cause = error.get("cause")
    raise RunFailed(error.get("message", "the run failed"), code=code, run_id=str(row["id"]),
                    cause=cause if isinstance(cause, dict) else None,
                    incident=error.get("incident"))


async def _flat(batches: AsyncGenerator[list[T], None]) -> AsyncGenerator[T, None]:
    """The items of ``batches`` one by one (closing ``batches`` when this is closed)."""
    try:
        async for batch in batches:
            for item in batch:
                yield item
    finally:
        await batches.aclose()


def _timeout_seconds(timeout: float | timedelta | None) -> float | None:
    """``result(timeout=)`` in seconds: None (wait as long as it takes), a timedelta or a
    number of seconds, finite and not negative; anything else is ``INVALID_REQUEST``."""
    if timeout is None:
        return None
    seconds = (timeout.total_seconds() if isinstance(timeout, timedelta)
               else timeout if type(timeout) in (int, float) else None)
    if seconds is None or not 0 <= seconds < float("inf"):
        raise InvalidRequest("timeout must be a timedelta or a number of seconds, not "
                             "negative", path="timeout")
    return float(seconds)


async def wait_all(app: Client, handles: Iterable[H], timeout: float | timedelta | None
                   ) -> list[H]:
    """``Orchestrator.wait_async``: every handle, once every run is terminal."""
    pending, give_up = _wait_plan(app, handles, timeout)
    given = list(pending)
    async for _ in _finishing(app, pending, give_up, len(given)):
        pass
    return given


def completing(app: Client, handles: Iterable[H], timeout: float | timedelta | None
               ) -> AsyncIterator[H]:
    """``Orchestrator.as_completed_async``: the handles as their runs become terminal."""
    pending, give_up = _wait_plan(app, handles, timeout)
    return _flat(_finishing(app, pending, give_up, len(pending)))


def completing_sync(app: Client, handles: Iterable[H], timeout: float | timedelta | None
                    ) -> Iterator[H]:
    """``Orchestrator.as_completed``: :func:`completing` driven from a sync caller."""
    pending, give_up = _wait_plan(app, handles, timeout)
    return _portal_iterate(app, _finishing(app, pending, give_up, len(pending)),
                           "async for handle in Orchestrator.as_completed_async()")


def _wait_plan(app: Client, handles: Iterable[H], timeout: float | timedelta | None
               ) -> tuple[list[H], float | None]:
    """The handles to wait for and when to give up (:func:`time.monotonic`), checked."""
    seconds = _timeout_seconds(timeout)
    if isinstance(handles, RunHandle) or not isinstance(handles, Iterable):
        raise InvalidRequest("handles must be an iterable of RunHandles of this "
                             "orchestrator (a list, even of one)", path="handles")
    pending = list(handles)
    for handle in pending:
        if not isinstance(handle, RunHandle) or handle.app is not app:
            raise InvalidRequest("handles must be RunHandles of this orchestrator",
                                 path="handles")
    return pending, None if seconds is None else time.monotonic() + seconds

async def _finishing(app: Client, pending: list[H], give_up: float | None, total: int
                     ) -> AsyncGenerator[list[H], None]:
    """Batches of ``pending`` as their runs become terminal, until none is left (removed
    from ``pending`` as they are yielded). One statement reads all of them (a run that
    continued as new, at the run its chain is at), then the waits of this event loop share
    one poller (``orchestrator.waiting``) until any of them ends, is gone, or the timeout
    passes; then they are read again."""
    while pending:
        keys = {h: (h.id, h.owner.tenant, h.owner.principal) for h in pending}
        async with app.database.connection() as conn:
            statuses = await runs_db.run_statuses(conn, list(set(keys.values())))
        if any(key not in statuses for key in keys.values()):
            raise AccessDenied(DENIED)
        done = [h for h in pending if statuses[keys[h]][0] in TERMINAL]
        if done:
            pending[:] = [h for h in pending if statuses[keys[h]][0] not in TERMINAL]
            yield done
            if not pending:
                return
        left = None if give_up is None else give_up - time.monotonic()
        if left is not None and left <= 0:
            first = pending[0]
            status = statuses[keys[first]][0]
            raise ResultTimeout(
                f"{len(pending)} of {total} runs have not finished; run {first.id}: "
                f"{_still(status, first.id)}",
                status=status, pending=tuple(str(h.id) for h in pending))
        await app._waits.any_finished(
            {(statuses[keys[h]][1], h.owner) for h in pending}, left)


def _portal_iterate(app: Client, batches: AsyncGenerator[list[T], None], instead: str
                    ) -> Iterator[T]:
    """Drive ``batches`` on the private loop, one batch per call, from a sync caller; refused
    at once in async code, saying to write ``instead`` (see ``Portal.call``)."""
    check_sync_caller(instead)
    return _driven(app, batches, instead)


def _driven(app: Client, batches: AsyncGenerator[list[T], None], instead: str
            ) -> Iterator[T]:
    async def step() -> list[T] | None:
        return await anext(batches, None)

    async def close() -> None:
        await batches.aclose()

    try:
        while (batch := app._portal.call(step(), instead=instead)) is not None:
            yield from batch
    finally:
        app._portal.call(close(), instead=instead)
