"""One claimed run's state in this process: who it is, its clock, its lease, its phase, its
cancellation, and the checks made before every new step (:meth:`RunState.boundary`)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import copy
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, NoReturn

from orchestrator import canonical, matching
from orchestrator.db.database import load_json
from orchestrator.engine.control import Phase, Stop, Verdict
from orchestrator.journal import Entry, JournalIndex
from orchestrator.logs import fields
from orchestrator.metrics import Metrics
from orchestrator.models import Owner

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

log = logging.getLogger("orchestrator.worker")

_LETTING_GO = frozenset({Phase.DRAIN_STOPPED, Phase.PARKING, Phase.GONE})


def lease_lost(metrics: Metrics, run_id: uuid.UUID, token: int, where: str,
               workflow: str) -> None:
    """Say that this worker let go of a run it held under lease ``token`` (counted in
    ``lease_losses``): the one wording operators and the tests read, also for a run let go
    before its executor was built."""
    metrics.incr("lease_losses")
    log.warning("run %s: lease %d lost (%s); this worker stops working on it",
                run_id, token, where, extra=fields(run_id=run_id, workflow=workflow))


class Lease:
    """A run's lease as this process holds it, from its claim on: the token the claim took,
    and until when the lease lasts at the earliest by this process's monotonic clock (the
    database set its expiry to its own now() + ``ttl`` after the claim, or a renewal, was
    sent). One object per claim, shared: the worker's renewals extend it while the run's
    journal is read and once the run is driven, and the run's executor reads it before every
    dispatch (C6)."""

    __slots__ = ("sent", "token", "ttl", "until")

    def __init__(self, token: int, *, sent: float, ttl: float) -> None:
        self.token, self.ttl = token, ttl
        self.sent = sent  # when the claim was sent (``time.monotonic()``)
        self.until = sent + ttl

    def renewed(self, sent: float) -> None:
        """Extended by a renewal sent at ``sent`` (``time.monotonic()``)."""
        self.until = max(self.until, sent + self.ttl)

    def left(self) -> float:
        """Seconds the lease is sure to last (negative: it may be over, and another worker
        may hold the run)."""
        return self.until - time.monotonic()


def claim_lease(claim: dict[str, Any], ttl: float = 30.0) -> Lease:
    """The lease a claim took (``claim["lease"]``, set by the worker as the claim returned);
    for a claim made otherwise (a test's), one counted from now, kept in the claim."""
    lease: Lease | None = claim.get("lease")
    if lease is None:
        lease = claim["lease"] = Lease(claim["lease_token"], sent=time.monotonic(), ttl=ttl)
    return lease


class RunState:
    """A claimed run as this process holds it. Built from the claim's row and the journal."""

    def __init__(self, claim: dict[str, Any], journal: list[Entry], *, worker_id: str,
                 metrics: Metrics) -> None:
        # The worker's loop. Kept: asyncio's own lookup of the running loop makes a getpid()
        # system call each time on Python 3.11, and this is on every step's path.
        self.loop = asyncio.get_running_loop()
        self.worker_id = worker_id
        self.metrics = metrics
        self.run_id: uuid.UUID = claim["id"]
        self.run_text = str(self.run_id)  # UUID.__str__ is slow Python; keys use it per call
        # Stored names are not checked again: a run written under older rules still runs.
        self.owner = Owner.model_construct(tenant=claim["tenant"], principal=claim["principal"])
        self.owner_text = canonical.canonical_json(self.owner.as_dict())
        self.token: int = claim["lease_token"]
        self.deadline_at: datetime | None = claim["deadline_at"]
        self.cancel_requested = claim["cancel_requested_at"] is not None
        self._cancel_waiters: set[Callable[[], None]] = set()  # races to end on a cancel
        self.input = load_json(claim["input_text"])  # may raise RunUnreadable
        self.workflow_name: str = claim["workflow_name"]
        self.workflow_key = f"{claim['workflow_name']}@{claim['workflow_version']}"
        # The server's clock minus this host's, both read at the claim (docs/operations.md).
        self.skew = claim["db_now"].timestamp() - float(claim.get("claimed_wall", time.time()))
        self.index = JournalIndex(journal)  # may raise SchemaUnsupported
        # The highest command position the journal held when this process claimed the run
        # (-1: none); see replaying.
        self.recorded_until = self.index.max_position
        # The position whose command ends a replay (the first not in the journal), when there
        # is history; its issue times the replay (from the claim) for the metrics.
        self._replayed_at = self.recorded_until + 1 if self.recorded_until >= 0 else -1
        self.lost = False  # the fence rejected a write (or a renewal): the lease is gone
        # The claim's lease (renewed by the worker from the claim on, the journal's read
        # included: worker._renew_leases).
        self.lease = claim_lease(claim)
        self.due_at: datetime | None = claim.get("due_at")
        self.phase = Phase.RUNNING
        self.position = 0  # the next command's journal position
        # The NONDETERMINISM a command met (see settle); None while the code matches.
        self.diverged: BaseException | None = None
        self.tracer: Tracer | None = None  # this execution's, when it is traced (the executor)

    # -- lease and phase ---------------------------------------------------------------------

    def lose_lease(self, where: str) -> None:
        """The fence rejected us (or a heartbeat did): stop writing for this run."""
        if not self.lost:
            self.lost = True
            lease_lost(self.metrics, self.run_id, self.token, where, self.workflow_key)

    def lease_left(self) -> float:
        """Seconds the lease is sure to last, by this process's clock (negative: it may be
        over, and another worker may hold the run)."""
        return self.lease.left()

    @property
    def dispatch_margin(self) -> float:
        """The lease time a tool call needs left before it is sent (a third of the TTL: a
        renewal every third keeps the lease above twice that)."""
        return self.lease.ttl / 3

    def enter(self, phase: Phase) -> None:
        """Move to ``phase`` if it is ahead of the current one (phases never go back)."""
        if phase.value > self.phase.value:
            self.phase = phase

    def request_drain(self) -> None:
        """The worker stops: the run goes on until its next new step (then ``Stop("drain")``)."""
        if self.phase is Phase.RUNNING:
            self.phase = Phase.DRAINING

    @property
    def ending(self) -> bool:
        """Its last write in this process (an outcome, a park) is decided or under way."""
        return self.phase.value >= Phase.ENDING.value

    @property
    def letting_go(self) -> bool:
        """The executor is giving up the run in this process (parking it, its lease lost, or a
        branch stopped for the worker's drain, whose task group cancels the others): a
        cancellation is then the executor's, not workflow code's. (A draining worker lets its
        runs go on until their next new step; their own cancellations are still theirs.)"""
        return self.lost or self.phase in _LETTING_GO

    # -- time --------------------------------------------------------------------------------

    def ended(self, outcome: str) -> None:
        """Count the run's duration, from when it was due (its submission, or the start it
        was held back to) to this end, by ``outcome``."""
        if self._replayed_at != -1:
            self._replayed()
        if self.due_at is not None:
            self.metrics.observe("run_duration_seconds",
                                 max(0.0, (self.now() - self.due_at).total_seconds()),
                                 self.workflow_name, outcome)

    def now(self) -> datetime:
        """The database's clock, as seen from this process."""
        return datetime.fromtimestamp(time.time() + self.skew, UTC)

    def remaining(self) -> float | None:
        """Seconds left before the run's deadline (None: no deadline)."""
        if self.deadline_at is None:
            return None
        return max((self.deadline_at - self.now()).total_seconds(), 0.0)

    # -- boundaries and positions ------------------------------------------------------------

    @property
    def replaying(self) -> bool:
        """Whether the workflow is replaying history: a command the journal held when the run
        was claimed has not been issued again yet in this process (its next position is at or
        below the highest recorded one). Code before the last recorded command ran in an
        earlier execution; code after it runs here first. ``ctx.log`` is silent while this
        holds."""
        return self.position <= self.recorded_until

    def next_position(self) -> int:
        position = self.position
        self.position += 1
        if position == self._replayed_at:
            self._replayed()
        return position

    def new_attempt(self) -> None:
        """A call begins an attempt in this execution: whatever came before was replay, even
        at a recorded position (a call found uncertain, re-sent now)."""
        if self._replayed_at != -1:
            self._replayed()

    def _replayed(self) -> None:
        """The replay of the journal is over (the first command past it, a call's first new
        attempt, or the run's end): its duration from the claim, once."""
        self._replayed_at = -1
        self.metrics.observe("replay_duration_seconds", time.monotonic() - self.lease.sent,
                             self.workflow_name)

    def boundary(self) -> None:
        """Checks made before any new durable step: lease, drain, a command that differed from
        the journal, cancellation, deadline."""
        if self.lost:
            raise Stop("lease_lost")
        phase = self.phase
        if phase is not Phase.RUNNING and phase.value >= Phase.ENDING.value:
            # The workflow has ended and its outcome is written (a branch it never awaited
            # takes no step after that), or the executor parks the run or has let go of it
            # (workflow code that caught the cancellation it was given goes no further): the
            # next claim, if any, replays it.
            raise Stop("let_go")
        if self.diverged is not None:  # a branch's command differs from the journal (C4)
            raise copy.copy(self.diverged)  # a fresh one: the kept one holds no frames
        if self.cancel_requested:
            raise Stop("cancelled")
        if self.deadline_at is not None and self.now() >= self.deadline_at:
            raise Stop("deadline")
        if phase is Phase.DRAINING or phase is Phase.DRAIN_STOPPED:
            self.phase = Phase.DRAIN_STOPPED  # branches a task group now cancels are ours
            raise Stop("drain")

    def settle(self, verdict: matching.Verdict) -> Any:
        """What the journal says for a command at its position (``verdict.settle()``). A
        command that differs from it is remembered first, so that no branch of the run takes
        a new step after that (:meth:`boundary`), whichever branch issued it and whether or
        not workflow code waits for that branch."""
        if verdict.outcome is matching.Outcome.DIFFERS and self.diverged is None:
            self.diverged = copy.copy(verdict.error)  # before it is raised (no traceback)
        return verdict.settle()

    def stop_cancelled(self) -> NoReturn:
        raise Stop("cancelled")

    def stop_deadline(self) -> NoReturn:
        raise Stop("deadline")

    def stop_abandoned(self, op_id: int) -> NoReturn:
        raise Stop("abandoned", f"operation {op_id} was abandoned by an operator")

    # -- cancellation ------------------------------------------------------------------------

    def note_cancel(self) -> None:
        """A cancellation request reached this process (a write said so, or a NOTIFY)."""
        self.cancel_requested = True
        for wake in list(self._cancel_waiters):
            wake()

    async def race_cancellation(self, coro: Awaitable[Any], timeout: float | None,
                                signal: asyncio.Event) -> Verdict:
        """Await ``coro`` for at most ``timeout`` seconds unless the run is cancelled first.

        When it does not finish, ``signal`` is set (the callee's cancellation signal) and the
        callee is cancelled; the timer and the listener are cleaned up on every path. A
        coroutine (a tool's call, a policy stage) is driven in the calling task, in a context
        of its own (:func:`_drive`); any other awaitable is raced as a task of its own.
        """
        if not asyncio.iscoroutine(coro):
            return await self._race_task(coro, timeout, signal)
        task = asyncio.current_task(self.loop)
        assert task is not None
        if self.cancel_requested:  # never started, as a cancelled task's coroutine would be
            signal.set()
            coro.close()
            return Verdict(cancelled=True)
        requested = task.cancelling()  # cancellations asked of the calling task so far
        fired = False

        def wake(_: object = None) -> None:
            nonlocal fired
            if not fired:
                fired = True
                signal.set()
                task.cancel()  # the callee sees it at the await it is suspended at

        self._cancel_waiters.add(wake)
        timer = self.loop.call_later(timeout, wake) if timeout is not None else None
        # The callee's error is kept in a list emptied on the way out: a local holding it would
        # tie this frame (the run, its task), which its traceback holds, into a reference
        # cycle, and keep the executor until the cycle collector runs.
        value: Any = None
        error: list[BaseException] = []
        try:
            value = await _drive(coro)
        except (KeyboardInterrupt, SystemExit):
            raise
        except asyncio.CancelledError:
            if not fired and task.cancelling() <= requested:  # nobody asked: the callee did
                error.append(asyncio.CancelledError("the call cancelled itself"))
        except BaseException as exc:
            error.append(_without_our_frames(exc))
        finally:
            self._cancel_waiters.discard(wake)
            if timer is not None:
                timer.cancel()
        if fired:
            task.uncancel()  # ours is answered here, whatever the callee made of it
        if fired or task.cancelling() > requested:
            error.clear()
        if task.cancelling() > requested:
            # The caller was cancelled meanwhile (workflow code's own timeout around the call,
            # the executor letting the run go): that cancellation goes on, even when the
            # callee swallowed it and returned.
            signal.set()
            raise asyncio.CancelledError()
        if fired:
            cancelled = self.cancel_requested
            return Verdict(cancelled=cancelled, timed_out=not cancelled)
        return Verdict(error=error.pop()) if error else Verdict(value=value)

    async def _race_task(self, awaitable: Awaitable[Any], timeout: float | None,
                         signal: asyncio.Event) -> Verdict:
        """:meth:`race_cancellation` of an awaitable that is not a coroutine: raced as a task
        (or future) of its own, which the caller waits on through one future."""
        loop = self.loop
        task = asyncio.ensure_future(awaitable)
        woken: asyncio.Future[None] = loop.create_future()

        def wake(_: object = None) -> None:
            if not woken.done():
                woken.set_result(None)

        task.add_done_callback(wake)
        self._cancel_waiters.add(wake)
        timer = loop.call_later(timeout, wake) if timeout is not None else None
        if self.cancel_requested:
            wake()
        try:
            await woken
        except BaseException:
            signal.set()
            task.cancel()
            raise
        finally:
            self._cancel_waiters.discard(wake)
            task.remove_done_callback(wake)
            if timer is not None:
                timer.cancel()
        if task.done():
            if task.cancelled():
                return Verdict(error=asyncio.CancelledError("the call cancelled itself"))
            error = task.exception()
            return Verdict(error=error) if error is not None else Verdict(value=task.result())
        signal.set()
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        cancelled = self.cancel_requested
        return Verdict(cancelled=cancelled, timed_out=not cancelled)

    async def until_cancelled(self) -> NoReturn:
        """Wait until the calling task is cancelled (``CancelledError``) or the run is
        (``Stop``): for the replay of a call that workflow code withdrew."""
        await self.race_cancellation(self.loop.create_future(), None, asyncio.Event())
        self.stop_cancelled()


async def _drive(coro: Coroutine[Any, Any, Any]) -> Any:
    """Run ``coro`` to its end in the calling task, as a task of its own would run it, but
    without one: every step of it runs in a copy of the caller's context (context variables
    it sets stay its own), each future it waits on is waited on here, and what that future
    ends with (its result, its exception, a cancellation of the calling task) is handed back
    to it. A task of its own cost a task, a future and two turns of the event loop; a tool's
    call is on every step's path.

    Unlike in a task of its own, ``asyncio.current_task()`` inside ``coro`` is the caller's.
    """
    context = contextvars.copy_context()
    send, throw = coro.send, coro.throw
    # What to throw into it next (nothing: send None). A list emptied as it is thrown, not a
    # local: the exception's traceback holds this frame, which must not hold it back.
    thrown: list[BaseException] = []
    try:
        while True:
            try:
                yielded = context.run(throw, thrown.pop()) if thrown else context.run(send, None)
            except StopIteration as stop:
                return stop.value
            try:
                if yielded is None:  # a bare yield: one turn of the event loop
                    await asyncio.sleep(0)
                elif getattr(yielded, "_asyncio_future_blocking", False):
                    yielded._asyncio_future_blocking = False
                    await yielded  # its outcome is read by the coroutine, or thrown into it
                else:
                    thrown.append(RuntimeError(f"a coroutine yielded {yielded!r}, which is not "
                                               "an asyncio future (yield used instead of await?)"))
            except GeneratorExit:
                raise
            except BaseException as exc:  # noqa: BLE001 - handed to the coroutine, as a task would
                thrown.append(exc)
            yielded = None
    finally:
        coro.close()  # a no-op once it has ended; otherwise it must not outlive this


def _without_our_frames(exc: BaseException) -> BaseException:
    """``exc`` with the frames of :meth:`RunState.race_cancellation` and :func:`_drive` taken
    out of its traceback, which keeps the callee's. A callee that keeps the exception in a
    reference cycle of its own (a future it awaited, held by its frame) would otherwise pull
    the run and its task into that cycle."""
    ours = _OUR_CODE
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code in ours:
        tb = tb.tb_next
    head = tb
    while tb is not None:
        after = tb.tb_next
        while after is not None and after.tb_frame.f_code in ours:
            after = after.tb_next
        tb.tb_next = after
        tb = after
    exc.__traceback__ = head
    return exc


_OUR_CODE = frozenset({RunState.race_cancellation.__code__, _drive.__code__})
