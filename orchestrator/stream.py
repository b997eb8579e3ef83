"""A run's stream (CONTRACT C14): its journal read by cursor, and followed live until the run
ends.

The cursor is an entry's ``seq`` (a run's entries are numbered 1, 2, 3 … without gaps). A
read after cursor *N* yields the entries with ``seq > N`` in order, so a client that
reconnects with the last ``seq`` it saw gets every later entry exactly once. With ``topics``
only the ``message`` entries of those topics (``ctx.publish``) are yielded, and the run's
terminal entry, so that a follower still ends; the cursor stays the ``seq``.

Following. A follower that has read everything waits for the run's ``revision`` (its last
``seq``, C3) to move past what it has seen. Every run followed in this event loop is asked
about in one statement (:class:`_RevisionPoller`, :func:`journal_db.journal_poll`): every
:data:`POLL_INTERVAL` while anything moved in the last :data:`IDLE_AFTER`, then, while
nothing does, at pauses doubling up to :data:`IDLE_INTERVAL`. The statement answers only for
the runs that moved past the lowest cursor of their followers, with their new entries (up to
:data:`PAGE`), and for those that are gone; the poller hands each follower those after its own
cursor: a follower reads a page of its own only when it begins, or when more than a page
arrived at once. So an entry reaches a waiting follower within about 50 ms of its commit,
within 200 ms after a quiet spell, and a process costs the database one indexed read per pause
whatever the number of followers, its answer as small as what moved (before, each woken
follower read its own page: one statement per follower per entry, which made 200 followers
cost the workers about a third of their throughput on two cores; then the poll returned a row
for every followed run at every pause). (No NOTIFY
per journal write: every write of every run would pay for it at commit, under a lock that
all notifying commits share, for the rare run that someone follows; and the channels the
engine already notifies say that work is ready, not that a run's journal grew.)

A follower ends right after yielding the run's terminal entry (``run.completed``, ``run.failed``,
``run.cancelled``, or ``run.continued``, which names the run it goes on as), or, when the run had
ended before the cursor, once it has yielded what follows the cursor. ``follow=False`` yields
what exists now and ends. Nothing here writes, and nothing dispatches anything (C3).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections.abc import AsyncGenerator, Iterable, Mapping
from typing import Any

from orchestrator._loops import PerLoop
from orchestrator.db import journal as journal_db
from orchestrator.db import runs as runs_db
from orchestrator.db.database import Database
from orchestrator.errors import AccessDenied, InvalidRequest, RunPruned
from orchestrator.journal import RUN_ENDS, SCHEMA_VERSION, Entry, EventKind, unsupported
from orchestrator.text import check_identifier

POLL_INTERVAL = 0.05
"""Seconds between two polls of the followed runs' revisions while any of them moves."""
IDLE_AFTER = 1.0
"""Seconds without any followed run moving after which the pauses grow."""
IDLE_INTERVAL = 0.2
"""The longest pause between two polls (a quiet spell)."""
PAGE = 500
"""Entries read per statement."""

TERMINAL = ("succeeded", "failed", "cancelled")
DENIED = "the run does not exist or is not accessible"


def check_cursor(after: Any) -> int:
    """``after`` if it is a cursor (an ``int`` from 0: a ``seq``, or 0 for the beginning),
    else ``INVALID_REQUEST``."""
    if type(after) is not int or after < 0:
        raise InvalidRequest("after must be an integer from 0 (the seq of the last entry "
                             "seen, 0 for the beginning)", path="after")
    return after


def check_follow(follow: Any) -> bool:
    """``follow`` if it is True or False, else ``INVALID_REQUEST`` (``"no"`` is true to
    Python: never taken for its truth value)."""
    if not isinstance(follow, bool):
        raise InvalidRequest("follow must be True or False", path="follow")
    return follow


def check_kept(row: Mapping[str, Any], after: int) -> None:
    """``RUN_PRUNED`` for a read after ``after`` of a run that retention pruned
    (docs/retention.md): the entries past the cursor were deleted, and an empty stream would
    say that there were none. A cursor at the run's end has nothing to miss: no error."""
    if row.get("pruned_at") is not None and after < row["revision"]:
        raise RunPruned(f"run {row['id']} was pruned by retention at "
                        f"{row['pruned_at'].isoformat()}: its journal is no longer kept",
                        status=row["status"], outcome=row.get("outcome_code"),
                        pruned_at=row["pruned_at"])


def check_topics(topics: Iterable[str] | None) -> tuple[str, ...] | None:
    """``topics`` as a tuple of names (None: every entry), else ``INVALID_REQUEST``; a single
    string is refused rather than read as its letters."""
    if topics is None:
        return None
    if isinstance(topics, str | bytes) or not isinstance(topics, Iterable):
        raise InvalidRequest("topics must be a list of topic names", path="topics")
    names = tuple(topics)
    if not names:
        raise InvalidRequest("topics must name at least one topic (or be None for every "
                             "entry)", path="topics")
    for name in names:
        check_identifier("topics", name)
    return names


_PageKey = tuple[asyncio.AbstractEventLoop, uuid.UUID, int, "tuple[str, ...] | None"]


class RunStreams:
    """Reads runs' streams from one database; followers in one event loop share one poller.

    No owner check here: the owner's API (``RunHandle.events``) checks the owner before it
    begins, as every read does (C9); the console checks the operator's tenant scope before
    it begins (``ConsoleService.events``); the operators' command line reads any run.
    """

    def __init__(self, database: Database) -> None:
        self.db = database
        self._pollers: PerLoop[_RevisionPoller] = PerLoop(lambda: _RevisionPoller(database))
        self._reading: dict[_PageKey, asyncio.Future[list[Entry]]] = {}  # reads in flight

    async def pages(self, run_id: uuid.UUID, *, after: int, follow: bool,
                    topics: tuple[str, ...] | None = None, heartbeat: float | None = None
                    ) -> AsyncGenerator[list[Entry], None]:
        """The run's entries after ``after`` (checked: :func:`check_cursor`), in pages of at
        most :data:`PAGE`, oldest first, following the run live with ``follow`` (see the
        module docstring). ``ACCESS_DENIED`` if the run does not exist; ``SCHEMA_UNSUPPORTED``
        at an entry newer than this code (the entries before it are yielded). With
        ``heartbeat``, an empty page after about that many seconds of waiting without an
        entry (a stream's keep-alive, timed by the poller: a follower needs no timer)."""
        cursor = scanned = after  # the last seq yielded; every seq up to scanned was looked at
        state: dict[str, Any] | None = None
        fetched: list[Entry] | None = None  # what the poller read after the cursor, if it did
        while True:
            if state is None:
                state = await self._state(run_id)
            ended = state["status"] in TERMINAL
            while True:
                if fetched is not None:  # every entry there was after the cursor
                    rows, fetched, complete = _kept(fetched, topics), None, True
                else:
                    rows = await self._page(run_id, max(cursor, scanned), topics)
                    complete = len(rows) < PAGE
                page, last = _up_to_the_end(rows) if follow else (rows, False)
                newer = _newer(page)
                if newer is not None:
                    if newer:
                        yield page[:newer]
                    raise unsupported(page[newer])
                if page:
                    cursor = page[-1]["seq"]
                    yield page
                if last:
                    return
                if complete:
                    break
            # Every entry up to the revision read before the pages was committed then.
            scanned = max(scanned, state["revision"])
            if not follow or ended:
                return
            # The poller's reading of the run's state serves as this one's next (it too was
            # read before the entries that follow it), and the entries it read after the
            # cursor as the next page, when it read them all.
            while (woken := await self._poller().changed(run_id, max(cursor, scanned),
                                                         heartbeat)) is None:
                yield []  # heartbeat seconds without an entry
            state, fetched = woken

    async def _page(self, run_id: uuid.UUID, after: int, topics: tuple[str, ...] | None
                    ) -> list[Entry]:
        """A page of entries; followers of one run woken together (at the same cursor) share
        one read of it. The rows are shared too: nothing here changes them."""
        key = (asyncio.get_running_loop(), run_id, after, topics)
        reading = self._reading.get(key)
        if reading is None:
            reading = asyncio.ensure_future(self.db.read(
                lambda conn: journal_db.journal_read_after(conn, run_id, after=after,
                                                           limit=PAGE, topics=topics)))
            self._reading[key] = reading
            reading.add_done_callback(lambda done: self._read(key, done))
        return await asyncio.shield(reading)

    def _read(self, key: _PageKey, done: asyncio.Future[list[Entry]]) -> None:
        self._reading.pop(key, None)
        if not done.cancelled():
            done.exception()  # retrieved, even if every reader has gone

    async def _state(self, run_id: uuid.UUID) -> dict[str, Any]:
        found = await self.db.read(lambda conn: runs_db.run_revisions(conn, [run_id]))
        state = found.get(run_id)
        if state is None:
            raise AccessDenied(DENIED)
        return state

    def _poller(self) -> _RevisionPoller:
        return self._pollers.get()

    async def close(self) -> None:
        """Stop the running loop's poller (its followers' waits are cancelled)."""
        await self._pollers.close()


MESSAGE = EventKind.MESSAGE.value


def _kept(rows: list[Entry], topics: tuple[str, ...] | None) -> list[Entry]:
    """``rows`` as a read with ``topics`` gives them (:func:`journal_db.journal_read_after`):
    the ``message`` entries of those topics and the run's terminal entry; all without."""
    if topics is None:
        return rows
    return [row for row in rows if (row["kind"] == MESSAGE and row["name"] in topics)
            or row["kind"] in RUN_ENDS]


def _up_to_the_end(rows: list[Entry]) -> tuple[list[Entry], bool]:
    """``rows`` up to and including the run's terminal entry, and whether it is there."""
    for index, row in enumerate(rows):
        if row["kind"] in RUN_ENDS:
            return rows[: index + 1], True
    return rows, False


def _newer(rows: list[Entry]) -> int | None:
    """The index of the first entry newer than this code understands (C3), if any."""
    for index, row in enumerate(rows):
        if row["schema_version"] > SCHEMA_VERSION:
            return index
    return None


Woken = tuple["dict[str, Any] | None", "list[Entry] | None"]
"""What wakes a follower: the run's ``revision`` and ``status`` as a poll found them (None:
the run is gone, or the database did not answer), and the entries after the follower's cursor
the poll read next (None: the follower reads them itself; the poll read only the first
:data:`PAGE` after the lowest cursor of the run's followers, and there may be more)."""
_Waiter = tuple[int, "asyncio.Future[Woken | None]", float]
"""A follower waiting: the revision it has seen, what wakes it, and the loop time at which it
is woken with None if nothing happened (its heartbeat; ``inf`` for none)."""


class _RevisionPoller:
    """One event loop's followers waiting for their runs to move, and the task that polls
    the runs' revisions for them all (it runs only while someone waits)."""

    def __init__(self, database: Database) -> None:
        self.db = database
        self.waiting: dict[uuid.UUID, list[_Waiter]] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()  # cuts a pause short: the last follower left
        self._next_due = math.inf  # the earliest heartbeat of a waiting follower

    async def changed(self, run_id: uuid.UUID, seen: int, beat: float | None = None
                      ) -> Woken | None:
        """Return once the run's revision is past ``seen``: the run's ``revision`` and
        ``status`` as the poll found them, or None (the run is gone, or the database did not
        answer: the caller reads again itself), and the entries after ``seen`` the poll read
        (:data:`Woken`). With ``beat``, None once about ``beat`` seconds passed without
        either (checked at each poll, so up to a pause late): the caller's heartbeat, without
        a timer of its own."""
        loop = asyncio.get_running_loop()
        due = math.inf if beat is None else loop.time() + beat
        waiter: _Waiter = (seen, loop.create_future(), due)
        self._next_due = min(self._next_due, due)
        self.waiting.setdefault(run_id, []).append(waiter)
        if self._task is None:
            self._task = loop.create_task(self._poll(), name="orchestrator-stream-poller")
        try:
            return await waiter[1]
        finally:
            self._leave(run_id, waiter)

    def _leave(self, run_id: uuid.UUID, waiter: _Waiter) -> None:
        """A follower stopped waiting without being woken (it was cancelled or closed); the
        last one to go ends the poller's pause, and so the poller."""
        waiters = self.waiting.get(run_id, [])
        if waiter in waiters:
            waiters.remove(waiter)
            if not waiters:
                del self.waiting[run_id]
            if not self.waiting:
                self._wake.set()

    async def _poll(self) -> None:
        loop = asyncio.get_running_loop()
        pause, quiet_since = POLL_INTERVAL, loop.time()
        try:
            while self.waiting:
                self._wake.clear()
                asked = {run_id: min(waiter[0] for waiter in waiters)
                         for run_id, waiters in self.waiting.items()}
                if self._settle(asked, await self._read(asked)):
                    pause, quiet_since = POLL_INTERVAL, loop.time()
                elif loop.time() - quiet_since >= IDLE_AFTER:
                    pause = min(pause * 2, IDLE_INTERVAL)
                if loop.time() >= self._next_due:
                    self._beat(loop.time())  # they too wait again meanwhile
                # The followers just woken read and wait again meanwhile: the next poll,
                # at the same pace, is theirs too (the poller ends when nobody waits then).
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), pause)
        finally:
            self._task = None
            for waiters in self.waiting.values():  # stopped by close(): nobody polls now
                for _, future, _ in waiters:
                    future.cancel()

    async def _read(self, asked: dict[uuid.UUID, int]) -> journal_db.Polled | None:
        """Of the runs ``asked``, those that moved past the lowest cursor of their followers
        (``asked``'s values) with the first :data:`PAGE` entries after it, and those that are
        gone (:func:`journal_db.journal_poll`: one statement however many runs, whose answer
        is as small as what moved). None if the database did not answer."""
        try:
            return await self.db.read(
                lambda conn: journal_db.journal_poll(conn, asked, limit=PAGE))
        except Exception:  # noqa: BLE001 - the followers find out themselves (_settle)
            return None

    def _settle(self, asked: dict[uuid.UUID, int], polled: journal_db.Polled | None) -> bool:
        """Wake the followers whose run, one of those the poll ``asked`` for, moved past what
        they saw, or is gone, in ``polled``; all of those when the database did not answer
        (each reads again on its own: it raises the database's error, or goes on if the
        database is back). Each gets the entries after its cursor when the poll read them all
        (it read up to :data:`PAGE` after the lowest cursor: fewer means all there were).
        A run absent from the answer did not move. A run first waited for while the poll was
        under way was not asked for: its followers wait for the next poll. Whether any was
        woken."""
        woken = False
        revisions, entries = polled if polled is not None else ({}, {})
        for run_id, lowest in asked.items():
            waiters = self.waiting.get(run_id)
            if waiters is None:
                continue  # its followers left meanwhile
            if polled is not None and run_id not in revisions:
                continue  # it did not move past any of its followers' cursors
            state = revisions.get(run_id)
            read = entries.get(run_id, [])
            whole = len(read) < PAGE
            for waiter in list(waiters):
                seen, future, _ = waiter
                if state is not None and state["revision"] <= seen:
                    continue
                after = ([row for row in read if row["seq"] > seen]
                         if state is not None and whole and seen >= lowest else None)
                if not future.done():
                    future.set_result((state, after))
                waiters.remove(waiter)
                woken = True
            if not waiters:
                del self.waiting[run_id]
        return woken

    def _beat(self, now: float) -> None:
        """Wake with None the followers whose heartbeat is due (they send one and wait
        again), and note when the next one is."""
        self._next_due = math.inf
        for run_id, waiters in list(self.waiting.items()):
            for waiter in list(waiters):
                if waiter[2] <= now:
                    if not waiter[1].done():
                        waiter[1].set_result(None)
                    waiters.remove(waiter)
                else:
                    self._next_due = min(self._next_due, waiter[2])
            if not waiters:
                del self.waiting[run_id]

    async def close(self) -> None:
        task = self._task
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
