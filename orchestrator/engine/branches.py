"""The branch scheduler: drives the workflow's coroutine, counts the work in flight of its
branches, and parks the run once every branch waits on the database.

The executor runs the workflow coroutine once from the top, feeding recorded results from the
journal (replay) and executing new commands, and keeps the coroutine in memory while the run
makes progress, so a run with *n* steps costs *n* steps, not *n²*. When every branch waits on
something durable (a timer, an event, a child run, an unknown operation) the run is *parked* in
the database and the coroutine dropped; the next claim replays it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable
from typing import Any, NoReturn

from orchestrator import tracing
from orchestrator.engine.control import Phase, Wait
from orchestrator.engine.outcome import Outcome
from orchestrator.engine.run import RunState
from orchestrator.engine.session import Session


class Branches:
    """The workflow's branches in this process: what is in flight, what waits."""

    def __init__(self, run: RunState, session: Session, outcome: Outcome) -> None:
        self.run = run
        self.session = session
        self.outcome = outcome
        self.active_count = 0
        self.active_depth: dict[int, int] = {}
        self.waits: dict[int, Wait] = {}
        self._parked: list[asyncio.Future[None]] = []
        self._for_events: dict[asyncio.Future[None], Wait] = {}  # parked event waits
        self._heard: dict[str, int] = {}  # news of events, by name (event_arrived)
        self.changed = asyncio.Event()
        self.task: asyncio.Task[Any] | None = None
        session.rider.last_write_next = self.last_write_next
        session.holding = self.active

    def active(self, position: int | None = None) -> _Active:
        """Marks in-flight work (``with branches.active():``): the run is not parked while any
        is going on."""
        return _Active(self, position)

    def last_write_next(self) -> bool:
        """Nothing is in flight and the workflow has finished or every branch waits on the
        database: the run's end or its park comes next (and carries the riding receipts). With
        a branch in flight that end would wait for the branch, so a receipt goes at once."""
        task = self.task
        return self.active_count == 0 and bool(
            self.waits or (task is not None and task.done()))

    async def park(self, wait: Wait) -> None:
        """Wait for the database's help: the run is parked once no branch has work in flight,
        and the next claim replays (this call then never returns in this process).

        A wait with a time (a timer, a retry's backoff, a tool's turn, an event's timeout)
        that comes while another branch keeps the run in this process returns then: the
        branch goes on in memory, as the replay after a park would at that time. The wait
        is this branch's only while it waits: woken or cancelled (workflow code's own
        cancellation, a race it lost), it is dropped, so that the run neither parks for it
        nor wakes for it; but a wait for an unknown outcome stays, as that outcome blocks the
        run (C8) whatever its branch became. A wait for an event also returns when news of
        that event comes (:meth:`event_arrived`)."""
        if wait.kind != "blocked":
            self.run.boundary()
        tracing.event("wait", {"orchestrator.wait": wait.kind,
                               "orchestrator.position": wait.position})
        self.waits[wait.position] = wait
        # A command may park from inside its own active() section (a call whose outcome became
        # unknown): while parked it is not work in flight.
        depth = self.active_depth.get(wait.position, 0)
        self.active_count -= depth
        self.changed.set()
        run = self.run
        parked: asyncio.Future[None] = run.loop.create_future()
        self._parked.append(parked)
        armed: list[asyncio.TimerHandle] = []
        if wait.wake_at is not None:
            delay = (wait.wake_at - run.now()).total_seconds()
            armed.append(run.loop.call_later(max(delay, 0.0), self._due, parked, wait, armed))
        if wait.kind == "event":
            self._for_events[parked] = wait
        try:
            # Woken by its time or its event, or cancelled (the run parked, or workflow code).
            await parked
        finally:
            for timer in armed:
                timer.cancel()
            self._for_events.pop(parked, None)
            self.active_count += depth
            self._parked.remove(parked)
            if parked.done() and not parked.cancelled():
                self.active_count -= 1  # counted by _wake until this branch went on
                self.changed.set()  # what _drive decides may change now
            # An unknown outcome blocks the run, not only its branch (C8): its wait stays.
            elif wait.kind != "blocked" and self.waits.get(wait.position) is wait:
                del self.waits[wait.position]
                self.changed.set()  # fewer waits: what _drive decides may change

    async def idle(self, position: int) -> NoReturn:
        """Wait until the run leaves this process (or workflow code cancels the branch),
        neither as work in flight nor as a wait on the database: for the replay of a command
        that the run's end left undone, whose branch went no further then either."""
        depth = self.active_depth.get(position, 0)
        self.active_count -= depth
        self.changed.set()
        parked: asyncio.Future[None] = self.run.loop.create_future()
        self._parked.append(parked)
        try:
            await parked  # cancelled when the run leaves this process
        finally:
            self.active_count += depth
            self._parked.remove(parked)
        raise AssertionError("unreachable")  # pragma: no cover - nothing resolves it

    def heard(self, name: str) -> int:
        """How much news of events ``name`` this process has had for the run: a branch that
        found no event compares it before and after its look, and looks again if news came
        meanwhile (its NOTIFY may have come before the branch parked)."""
        return self._heard.get(name, 0)

    def event_arrived(self, name: str) -> None:
        """News that an event ``name`` was stored for the run (the worker heard its NOTIFY)
        while the run is in this process: a branch parked for such an event goes on in
        memory and takes it as a replay after a park would (``event_take``, journaled
        ``event.received``), instead of at the next park, which another branch that keeps
        the run here may never let come. A branch that finds it taken (another wait for the
        same name was first) parks again."""
        self._heard[name] = self._heard.get(name, 0) + 1
        for parked, wait in list(self._for_events.items()):
            if wait.name == name:
                self._wake(parked, wait)

    def _due(self, parked: asyncio.Future[None], wait: Wait,
             armed: list[asyncio.TimerHandle]) -> None:
        """A parked branch's timer: it wakes the branch once the run's clock has reached
        ``wait.wake_at``, and until then is armed again for what is left. A loop may fire a
        timer early (uvloop's rounds to the millisecond), and the run's clock is the wall
        clock, not the loop's: a branch never goes on before its time (workflow code that
        reads ``ctx.now()`` after a sleep never finds it earlier than the sleep's end, and a
        wait's timeout is not found still ahead, which would park the run again)."""
        assert wait.wake_at is not None
        left = (wait.wake_at - self.run.now()).total_seconds()
        if left > 0:
            armed[:] = [self.run.loop.call_later(left, self._due, parked, wait, armed)]
            return
        self._wake(parked, wait)

    def _wake(self, parked: asyncio.Future[None], wait: Wait) -> None:
        """A parked branch's time (or its event) has come while the run is still in this
        process (another branch kept it here): it goes on, counted as work in flight until it
        runs."""
        if parked.done() or self.run.ending or self.run.lost:
            return  # parking, ending or let go: the next claim replays it
        if self.waits.get(wait.position) is wait:
            del self.waits[wait.position]
        self.active_count += 1
        parked.set_result(None)
        self.changed.set()

    async def drive(self, workflow: Awaitable[Any]) -> None:
        """Run the workflow until it finishes or parks; record the outcome."""
        task: asyncio.Task[Any] = asyncio.ensure_future(workflow)
        self.task = task
        task.add_done_callback(lambda _: self.changed.set())
        try:
            await self._drive(task)
        finally:  # whatever happened, nothing of this run keeps running in this process
            self.run.enter(Phase.GONE)
            task.cancel()
            # A workflow's exception holds its frames, and they hold the context and so this
            # executor: kept, the task would leave the executor in a cycle, in memory until the
            # cycle collector runs.
            self.task = None
            for parked in self._parked:
                parked.cancel()
            try:
                if self.session.rider.receipts:
                    # Every end of the run writes them first; this is the backstop, also for a
                    # run cancelled by a drain that ran out of time: what is known is written.
                    with contextlib.suppress(Exception):
                        await asyncio.shield(self.session.settle())
            finally:
                self.session.detach()

    async def _drive(self, task: asyncio.Task[Any]) -> None:
        changed = self.changed
        while True:
            await changed.wait()
            changed.clear()
            if task.done():
                break
            if self.active_count == 0 and self.waits:
                for _ in range(4):  # let callbacks that are already due run first
                    await asyncio.sleep(0)
                if task.done():
                    break
                if self.active_count == 0 and self.waits and not changed.is_set():
                    self.run.enter(Phase.PARKING)
                    waits = list(self.waits.values())  # cancelled branches drop theirs
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
                    await self.outcome.park(waits)
                    return
                if self.session.rider.receipts and not task.done():  # no park after all
                    self.session.settle_in_background()
        while self.active_count:  # other branches still have work in flight: let it land
            await changed.wait()
            changed.clear()
        self.run.enter(Phase.ENDING)
        await self.outcome.finish(task, list(self.waits.values()))


class _Active:
    """``with branches.active(position):`` (a plain class, not a generator-based context
    manager: a step enters several, and the generator cost three times as much). Made per
    use: one kept on the scheduler would make a reference cycle, and an executor in a cycle
    outlives its run until the cycle collector runs."""

    __slots__ = ("branches", "position")

    def __init__(self, branches: Branches, position: int | None) -> None:
        self.branches = branches
        self.position = position

    def __enter__(self) -> None:
        branches, position = self.branches, self.position
        branches.active_count += 1
        if position is not None:
            branches.active_depth[position] = branches.active_depth.get(position, 0) + 1

    def __exit__(self, *exc: object) -> None:
        branches, position = self.branches, self.position
        branches.active_count -= 1
        if position is not None:
            branches.active_depth[position] -= 1
        if branches.active_count == 0 and (
                branches.waits or (branches.task is not None and branches.task.done())):
            branches.changed.set()  # what _drive waits for: it may park or finish now
