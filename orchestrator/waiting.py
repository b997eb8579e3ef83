"""Waiting for runs to finish (``RunHandle.result(timeout=)``, and so the HTTP API's long poll
``GET /api/runs/{id}/result?wait=``, and ``Orchestrator.wait`` / ``as_completed``): every wait
in one event loop shares one poller.

A waiter reads its run once itself (the owner's check, C9, and the answer when the run has
already ended), then waits here; a waiter for many runs (``wait``, ``as_completed``) reads
them all in one statement and waits here until any of them ends. The poller asks, in one
statement by the primary key (:func:`runs_db.run_finished`), which of the runs awaited in
this event loop have ended or are not their waiter's owner's (gone), and wakes those runs'
waiters, which read their runs again themselves (the result, the error, the chain a run
continued as). The answer is as small as what ended. A process so costs the database one
statement per pause however many requests wait, where each waiter used to read its own row
at every pause: 1,000 waiting clients were 4,000 statements a second.

The pace: a poll :data:`FIRST_PAUSE` after a waiter arrives, then pauses doubling up to
:data:`LONGEST_PAUSE`; so never more than one statement per :data:`FIRST_PAUSE`, and one per
:data:`LONGEST_PAUSE` while the same waiters wait. While more than :data:`FEW` runs are
awaited, the first and shortest pause is :data:`BUSY_PAUSE` instead: each poll asks about
every awaited run, so the more runs, the fewer polls a second (a run that ends is then told
up to 20 ms later; a lone ``result()`` of a short run, 5 ms later).

When the database does not answer, every waiter is woken: each reads its run itself, and raises
the database's error or waits again; until a poll succeeds again the pause stays
:data:`LONGEST_PAUSE`, however many waiters come back. The poller's task runs only while
someone waits. No NOTIFY: the engine does not notify on a run's end (a NOTIFY at every
completion would cost every commit for the few runs awaited), and the channels it notifies on
say that work is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import uuid
from collections.abc import Iterable
from collections.abc import Set as AbstractSet

from orchestrator._loops import PerLoop
from orchestrator.db import runs as runs_db
from orchestrator.db.database import Database
from orchestrator.models import Owner

FIRST_PAUSE = 0.005
"""Seconds from a waiter's arrival to the poll that first answers for it (it read its run
itself when it arrived), and the shortest pause between two polls, while at most :data:`FEW`
runs are awaited."""
BUSY_PAUSE = 0.02
""":data:`FIRST_PAUSE` while more than :data:`FEW` runs are awaited."""
FEW = 16
"""How many awaited runs a poll may ask about every :data:`FIRST_PAUSE` (at most 3,200 rows
a second read by their primary key, however many waiters keep arriving)."""
LONGEST_PAUSE = 0.25
"""The longest pause between two polls: the pauses double up to it while no waiter arrives."""

_Key = tuple[uuid.UUID, str, str]


class RunWaits:
    """The result waits of one database; the waits in one event loop share one poller."""

    def __init__(self, database: Database) -> None:
        self.db = database
        self._pollers: PerLoop[_FinishPoller] = PerLoop(lambda: _FinishPoller(database))

    async def finished(self, run_id: uuid.UUID, owner: Owner, timeout: float | None) -> bool:
        """Return True once a poll finds ``run_id`` terminal, or not ``owner``'s run (the
        caller reads it again and finds out which), or the database did not answer; False
        when ``timeout`` seconds (None: no limit) passed first. Cancelling the caller ends
        its wait; nothing is written."""
        return await self.poller().finished({(run_id, owner.tenant, owner.principal)}, timeout)

    async def any_finished(self, runs: Iterable[tuple[uuid.UUID, Owner]],
                           timeout: float | None) -> bool:
        """:meth:`finished` for many runs (each with the owner it is awaited for): True once
        a poll finds any of them terminal or gone, or the database did not answer; False
        when ``timeout`` passed first."""
        keys = {(run_id, owner.tenant, owner.principal) for run_id, owner in runs}
        return await self.poller().finished(keys, timeout)

    def poller(self) -> _FinishPoller:
        """The running event loop's poller (made on first use)."""
        return self._pollers.get()

    async def close(self) -> None:
        """Stop the running loop's poller (its waits are cancelled)."""
        await self._pollers.close()


class _FinishPoller:
    """One event loop's waiters and the task that polls their runs for them all."""

    def __init__(self, database: Database) -> None:
        self.db = database
        self.waiting: dict[_Key, list[asyncio.Future[None]]] = {}
        self.polls = 0
        """Statements this poller made (one per poll, however many runs it asked about)."""
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()  # the next poll is due sooner, or nobody waits
        self._pause = FIRST_PAUSE
        self._due = math.inf  # the loop time of the next poll
        self._failing = False
        """The last poll failed: arrivals do not shorten the pause until a poll succeeds (each
        waiter read its run itself and waits again; hurrying would make a storm of reads)."""

    async def finished(self, keys: AbstractSet[_Key], timeout: float | None) -> bool:
        """Wait until a poll finds any of ``keys`` ended (or gone, or could not ask): True;
        False when ``timeout`` passed first. One future stands for the waiter under each key."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        for key in keys:
            self.waiting.setdefault(key, []).append(future)
        self._hurry(loop.time())
        if self._task is None:
            self._task = loop.create_task(self._poll(), name="orchestrator-result-poller")
        try:
            await asyncio.wait_for(future, timeout)
        except TimeoutError:
            return False
        finally:
            for key in keys:
                self._leave(key, future)
        return True

    def _hurry(self, now: float) -> None:
        """A waiter arrived: its run is asked about :data:`FIRST_PAUSE` from now
        (:data:`BUSY_PAUSE` while more than :data:`FEW` runs are awaited), or sooner when a
        poll is due sooner, and the pauses double again from there; while polls fail,
        :data:`LONGEST_PAUSE` from now at the soonest."""
        pause = LONGEST_PAUSE if self._failing else self._shortest()
        self._pause = pause
        if now + pause < self._due:
            self._due = now + pause
            self._wake.set()

    def _shortest(self) -> float:
        """The first pause after an arrival, and the shortest between two polls, for as many
        runs as are awaited now."""
        return FIRST_PAUSE if len(self.waiting) <= FEW else BUSY_PAUSE

    def _leave(self, key: _Key, future: asyncio.Future[None]) -> None:
        waiters = self.waiting.get(key, [])
        if future in waiters:
            waiters.remove(future)
            if not waiters:
                del self.waiting[key]
        if not self.waiting:
            self._wake.set()  # the last one to go ends the poller's pause, and so the poller

    async def _poll(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while await self._until_due(loop):
                asked = list(self.waiting)
                self._due = math.inf  # a waiter that arrives during the read sets it
                ended = await self._read(asked)
                self.polls += 1
                for key in asked if ended is None else [k for k in asked if k[0] in ended]:
                    for future in self.waiting.pop(key, []):
                        if not future.done():
                            future.set_result(None)
                now = loop.time()
                self._failing = ended is None
                if self._failing:  # arrivals during the read do not bring the poll nearer
                    self._pause = LONGEST_PAUSE
                    self._due = now + LONGEST_PAUSE
                    continue
                self._pause = min(self._pause * 2, LONGEST_PAUSE)
                self._due = max(min(self._due, now + self._pause), now + self._shortest())
        finally:
            self._task = None
            self._due = math.inf
            for waiters in self.waiting.values():  # stopped by close(): nobody polls now
                for future in waiters:
                    future.cancel()

    async def _until_due(self, loop: asyncio.AbstractEventLoop) -> bool:
        """Pause until the next poll is due; False when nobody waits any more."""
        while self.waiting and (left := self._due - loop.time()) > 0:
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), left)
        return bool(self.waiting)

    async def _read(self, asked: list[_Key]) -> set[uuid.UUID] | None:
        """The ids of the runs ``asked`` that ended or are not their owner's; None if the
        database did not answer (every waiter reads its run itself then)."""
        try:
            return await self.db.read(lambda conn: runs_db.run_finished(conn, asked))
        except Exception:  # noqa: BLE001 - the waiters find out themselves
            return None

    async def close(self) -> None:
        task = self._task
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
