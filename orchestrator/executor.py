"""Driving one claimed run: replay, commands, parking and the terminal outcome.

A :class:`RunExecutor` lives as long as its worker holds the run's lease. It runs the workflow
coroutine once from the top, feeding recorded results from the journal (replay) and executing
new commands, and keeps the coroutine in memory while the run makes progress, so a run with *n*
steps costs *n* steps, not *n²*. When every branch of the workflow waits on something durable
(a timer, an event, a child run, an unknown operation) the executor *parks* the run in the
database and drops the coroutine; the next claim replays it.

Every write is fenced by the lease token and the expected revision; a rejected write means the
lease is gone and the executor stops touching the run.

A call's receipt rides with the run's next write (:meth:`RunExecutor.defer_receipt`): the next
call's write-ahead ``submitted`` or the run's success commits it in the same fenced row, and the
run's park or any other end in the same transaction, so an effect step costs one write, not
two. Any other write of the run writes it first, and so does the moment the workflow awaits
anything but a write or a park; until then the operation is ``submitted``, exactly as if the
worker had died before the receipt's commit.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
import traceback
import uuid
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING, Any, NoReturn, TypeVar

from orchestrator import canonical, faults
from orchestrator.context import WorkflowContext
from orchestrator.db import operations as ops_db
from orchestrator.db import runs as runs_db
from orchestrator.db.database import Conn, load_json
from orchestrator.db.events import event_take, incident_record
from orchestrator.db.writer import Landing, Statement
from orchestrator.errors import (
    ConfigurationError,
    DatabaseError,
    InvalidRequest,
    JournalFull,
    LeaseLost,
    OrchestratorError,
    RunFailed,
    RunUnreadable,
    SchemaUnsupported,
    UnknownWorkflow,
    WorkflowError,
    new_incident_ref,
)
from orchestrator.gateway import call_tool
from orchestrator.models import Owner
from orchestrator.registry import Tool, Workflow
from orchestrator.replay import SCHEMA_VERSION, JournalIndex, Nondeterminism
from orchestrator.text import storable

if TYPE_CHECKING:
    from orchestrator.worker import Worker

T = TypeVar("T")
Event = dict[str, Any]
log = logging.getLogger("orchestrator.worker")

# Journal room kept free by new work for its outcomes: the call's result and the run's end.
JOURNAL_RESERVE = 3

# Timers this short are waited for in memory (the timer is still journaled) rather than
# parking the run and paying for a replay.
IN_MEMORY_SLEEP = 1.0


class Stop(BaseException):  # noqa: N818 - a control-flow signal, not an error
    """Unwinds workflow code when the run must stop here (BaseException: not caught by
    ``except Exception`` in user code)."""

    def __init__(self, reason: str, detail: str = "") -> None:
        super().__init__(reason)
        self.reason = reason  # cancelled | deadline | abandoned | lease_lost | drain
        self.detail = detail


@dataclass
class Verdict:
    """How an awaited step ended when raced against cancellation and a time budget."""

    value: Any = None
    error: BaseException | None = None
    timed_out: bool = False
    cancelled: bool = False


@dataclass
class Wait:
    """Why a branch of the workflow cannot proceed without the database's help."""

    kind: str  # timer | event | child | blocked
    position: int
    wake_at: datetime | None = None
    name: str | None = None
    operation_id: int | None = None


def event(kind: str, position: int | None, name: str | None, payload: Any) -> Event:
    return {"kind": kind, "position": position, "name": name, "v": SCHEMA_VERSION,
            "payload": payload}


def as_seconds(value: timedelta | float | None) -> float | None:
    if value is None:
        return None
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if seconds != seconds or seconds < 0:
        raise InvalidRequest(f"a duration must be a non-negative number, got {value!r}")
    return seconds


class RunExecutor:
    """One claimed run. See the module docstring."""

    def __init__(self, worker: Worker, claim: dict[str, Any], journal: list[Event]) -> None:
        self.worker = worker
        self.app = worker.app
        # The worker's loop. Kept: asyncio's own lookup of the running loop makes a getpid()
        # system call each time on Python 3.11, and this is on every step's path.
        self.loop = asyncio.get_running_loop()
        self.db = worker.app.database
        self.run_id: uuid.UUID = claim["id"]
        self.run_text = str(self.run_id)  # UUID.__str__ is slow Python; keys use it per call
        # Stored names are not checked again: a run written under older rules still runs.
        self.owner = Owner.model_construct(tenant=claim["tenant"], principal=claim["principal"])
        self.owner_text = canonical.canonical_json(self.owner.as_dict())
        self.token: int = claim["lease_token"]
        self.revision: int = claim["revision"]
        self.deadline_at: datetime | None = claim["deadline_at"]
        self.cancel_requested = claim["cancel_requested_at"] is not None
        self._cancel_waiters: set[Callable[[], None]] = set()  # races to end on a cancel
        self.input = load_json(claim["input_text"])  # may raise RunUnreadable
        self.workflow_key = f"{claim['workflow_name']}@{claim['workflow_version']}"
        self.skew = (claim["db_now"] - datetime.now(UTC)).total_seconds()
        self.index = JournalIndex(journal)  # may raise SchemaUnsupported
        self.lost = False
        self.draining = False
        self.drain_stopped = False  # boundary() stopped a branch for the drain
        self.ending = False  # its final write (outcome, park, release) is under way
        self._position = 0
        self._buffer: list[Event] = []
        # Receipts known here but not yet written: each rides with the run's next write (or is
        # written alone as soon as the workflow waits on anything else); see defer_receipt.
        self._receipts: list[tuple[ops_db.Receipt, Any]] = []
        self._settle_scheduled = False
        self._task: asyncio.Task[Any] | None = None
        self._settler: asyncio.Task[None] | None = None  # a lone receipt write (kept referenced)
        self._write_lock = asyncio.Lock()
        # Tasks cancelled while a write of theirs was in flight: the cancellation is delivered
        # once the write has landed and been accounted for (see _landed).
        self._held: set[asyncio.Task[Any]] = set()
        self._active = 0
        self._active_depth: dict[int, int] = {}
        self._waits: dict[int, Wait] = {}
        self._parked: list[asyncio.Future[None]] = []
        self._changed = asyncio.Event()
        self.parking = False

    # -- time, positions, boundaries ---------------------------------------------------------

    def lose_lease(self, where: str) -> None:
        """The fence rejected us (or a heartbeat did): stop writing for this run."""
        if not self.lost:
            self.lost = True
            self.worker.metrics.incr("lease_losses")
            log.warning("run %s: lease %d lost (%s); this worker stops working on it",
                        self.run_id, self.token, where)

    def now(self) -> datetime:
        """The database's clock, as seen from this process."""
        return datetime.fromtimestamp(time.time() + self.skew, UTC)

    def note_cancel(self) -> None:
        """A cancellation request reached this process (a write said so, or a NOTIFY)."""
        self.cancel_requested = True
        for wake in list(self._cancel_waiters):
            wake()

    def stop_cancelled(self) -> NoReturn:
        raise Stop("cancelled")

    def stop_deadline(self) -> None:
        raise Stop("deadline")

    def stop_abandoned(self, op_id: int) -> None:
        raise Stop("abandoned", f"operation {op_id} was abandoned by an operator")

    async def race_cancellation(self, coro: Awaitable[Any], timeout: float | None,
                                signal: asyncio.Event) -> Verdict:
        """Await ``coro`` for at most ``timeout`` seconds unless the run is cancelled first.

        When it does not finish, ``signal`` is set (the callee's cancellation signal) before it
        is cancelled; the timer and the listener are cleaned up on every path. (One task and
        one future per call: this is on every step's path.)
        """
        loop = self.loop
        task = loop.create_task(coro) if asyncio.iscoroutine(coro) else asyncio.ensure_future(coro)
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

    def next_position(self) -> int:
        position = self._position
        self._position += 1
        return position

    def boundary(self) -> None:
        """Checks made before any new durable step: lease, drain, cancellation, deadline."""
        if self.lost:
            raise Stop("lease_lost")
        if self.cancel_requested:
            raise Stop("cancelled")
        if self.deadline_at is not None and self.now() >= self.deadline_at:
            raise Stop("deadline")
        if self.draining:
            self.drain_stopped = True  # branches a task group now cancels are the engine's
            raise Stop("drain")

    def remaining(self) -> float | None:
        if self.deadline_at is None:
            return None
        return max((self.deadline_at - self.now()).total_seconds(), 0.0)

    def active(self, position: int | None = None) -> _Active:
        """Marks in-flight work (``with executor.active():``): the run is not parked while any
        is going on."""
        return _Active(self, position)

    # -- writes ------------------------------------------------------------------------------

    def check_room(self, events: int) -> None:
        """Refuse new work that would leave no room in the journal for its outcomes (C2)."""
        if self.revision + events + JOURNAL_RESERVE > self.app.max_journal_events:
            raise JournalFull(f"run {self.run_id} reached its journal cap of "
                              f"{self.app.max_journal_events} events")

    def buffer(self, ev: Event) -> None:
        """Queue an event that needs no commit of its own; it rides with the next write."""
        self.check_room(len(self._buffer) + 1)
        self._buffer.append(ev)

    async def write(self, work: Callable[[Conn], Awaitable[tuple[T, list[Event]]]] | None,
                    *, new_work: bool = False, hold: bool = False,
                    finish: bool = False) -> T | None:
        """One fenced transaction: ``work`` (if any), then the buffered and new events appended.
        Receipts still riding go first, in the same transaction (each ``submitted →
        committed`` with its ``call.completed`` ahead of the other events), so the journal
        keeps the order in which things happened and a call followed by anything else still
        costs one commit. If that transaction fails for any reason, the receipts are written
        alone (that path says what is wrong with them) and then the write without them.

        ``new_work`` writes (a call beginning, a child starting) are refused with
        ``JOURNAL_FULL`` unless they leave room for their own outcome and the run's; outcome
        writes are never refused, so nothing accepted loses its record. Raises :class:`Stop`
        ("lease_lost") if the fence rejects it: nothing was written then.

        A cancellation of the caller while the write is in flight does not abandon it (the
        group writer commits it all the same): it is delivered once the write has landed and
        been accounted for, or, with ``hold``, left for the caller to take
        (:meth:`take_held_cancel`). ``finish``: the write records what already happened (a
        receipt); see :meth:`_locked`.
        """
        with self._delivering(hold):
            async with self._locked(finish):
                riding = [] if self.lost else list(self._receipts)
                if riding:
                    try:
                        return await self._write_locked(work, new_work=new_work, riding=riding)
                    except (Exception, Stop):  # noqa: BLE001 - retried below, receipts alone
                        pass
                await self._settle_locked()
                return await self._write_locked(work, new_work=new_work)

    async def _write_locked(self, work: Callable[[Conn], Awaitable[tuple[T, list[Event]]]] | None,
                            *, new_work: bool = False, with_buffer: bool = True,
                            riding: Sequence[tuple[ops_db.Receipt, Any]] = ()) -> T | None:
        if self.lost:
            raise Stop("lease_lost")
        pending = list(self._buffer) if with_buffer else []

        async def tx(conn: Conn) -> tuple[T | None, list[Event], datetime | None]:
            result: T | None = None
            events = await self._commit_riding(conn, riding) + pending
            if work is not None:
                result, more = await work(conn)
                events += more
            cancel_at = None
            if events:
                cancel_at = await runs_db.journal_append(
                    conn, run_id=self.run_id, token=self.token, expected=self.revision,
                    events=events)
            return result, events, cancel_at

        if new_work:
            self.check_room(len(riding) + len(pending) + 1)
        try:
            outcome: tuple[T | None, list[Event], datetime | None]
            outcome = await self._landed(self.worker.writer.enqueue(tx))
            result, written, cancel_at = outcome
        except LeaseLost:
            if riding:  # maybe the work's own guard: the receipts alone, then the work, tell
                raise
            self.lose_lease("write rejected")
            raise Stop("lease_lost") from None
        except DatabaseError:
            # The database keeps failing this write: stop here without guessing; the run
            # is recovered from its journal once the lease lapses.
            self.lose_lease("database unavailable")
            raise Stop("lease_lost") from None
        del self._buffer[: len(pending)]
        self.revision += len(written)
        if cancel_at is not None:
            self.note_cancel()
        if (held := self._riding_written(riding)) is not None:
            await held
        return result

    async def write_direct(self, make: Callable[[int, ops_db.Receipt | None], Statement],
                           *, new_work: bool = False, hold: bool = False) -> Any:
        """A write whose one statement fences the run and appends its own event (the hot path
        of a call): ``make(expected revision, riding receipt)`` builds it under the run's write
        lock. A receipt still riding goes in the same statement (the statement writes its
        ``call.completed`` first). Raises ``FastPathMiss`` when events are buffered (nothing
        written) or when the statement did not apply (after writing the riding receipt alone);
        the caller then takes the general path. A cancellation meanwhile is handled as in
        :meth:`write`."""
        with self._delivering(hold):
            return await self._write_direct(make, new_work)

    async def _write_direct(self, make: Callable[[int, ops_db.Receipt | None], Statement],
                            new_work: bool) -> Any:
        async with self._locked():
            if self.lost:
                raise Stop("lease_lost")
            if self._buffer:  # buffered by another branch while this one waited for the lock
                raise ops_db.FastPathMiss("events are buffered: the general path writes them")
            if len(self._receipts) > 1:  # parallel branches: all but one go alone
                await self._settle_locked(keep=1)
            riding = self._receipts.pop(0) if self._receipts else None
            try:
                if new_work:
                    self.check_room(1 + (riding is not None))
                statement = make(self.revision, None if riding is None else riding[0])
                result, cancel_at = await self._landed(self.worker.writer.enqueue(statement))
            except BaseException as exc:
                if riding is not None:  # not written: it waits in line again
                    self._receipts.insert(0, riding)
                    if isinstance(exc, ops_db.FastPathMiss):
                        await self._settle_locked()  # alone, before the general path
                if isinstance(exc, DatabaseError):
                    self.lose_lease("database unavailable")
                    raise Stop("lease_lost") from None
                raise
            self.revision += 1 + (riding is not None)
            if cancel_at is not None:
                self.note_cancel()
            if riding is not None and (
                    held := faults.reach("after_receipt", riding[0].name)) is not None:
                await held
            return result

    def _locked(self, finish: bool = False) -> _WriteLock:
        """The run's write lock: one write of the run at a time. A caller that workflow code
        cancels while it waits for the lock (another branch's write is in flight) still makes
        its write: the cancellation is held as in :meth:`_landed`, so that what the caller was
        about to record (a call's intent, its receipt) is recorded and the cancellation then
        handled as for a write in flight (a withdrawn call; a receipt returned), the same on
        replay. When the executor itself lets go of the run (:meth:`letting_go`), the caller
        stops at once and writes nothing, unless it is to ``finish`` recording what already
        happened (a receipt), which is written all the same."""
        return _WriteLock(self, finish)

    async def _landed(self, landing: Landing) -> Any:
        """The outcome of a queued write, even if the caller is cancelled meanwhile.

        The group writer commits a queued write whether or not anyone still waits for it, so
        the caller's bookkeeping (the run's revision, a riding receipt) must follow the write,
        not the cancellation. A :class:`Landing` cannot be cancelled: a cancelled caller is
        woken once its write has landed; the cancellation is then held, the outcome returned
        for the bookkeeping, and :meth:`_delivering` delivers the cancellation. (Abandoning the
        write instead would leave the run's revision behind the database's: its next write
        would miss and the run be dropped as if its lease were lost.)"""
        try:
            return await landing
        except asyncio.CancelledError:
            if not landing.done():
                raise
        self._hold_cancel()
        return landing.result()

    def _hold_cancel(self) -> None:
        """The current task was cancelled while it wrote: keep that for
        :meth:`take_held_cancel` (the write goes on and is accounted for first)."""
        task = asyncio.current_task()
        if task is not None:
            self._held.add(task)

    def _delivering(self, hold: bool = False) -> _Delivering:
        """Deliver a cancellation that :meth:`_landed` held, once the write's bookkeeping is
        done: after a write that landed, and instead of the error of one that did not (the
        caller asked to stop; a :class:`Stop` of the run still wins). With ``hold`` a landed
        write returns normally and the caller takes the cancellation itself."""
        return _Delivering(self, hold=hold)

    @property
    def letting_go(self) -> bool:
        """The executor is giving up the run in this process (parking it, its lease lost, or a
        branch stopped for the worker's drain, whose task group cancels the others): a
        cancellation is then the executor's, not workflow code's. (A draining worker lets its
        runs go on until their next new step; their own cancellations are still theirs.)"""
        return self.parking or self.lost or self.drain_stopped

    def take_held_cancel(self) -> bool:
        """Whether the current task was cancelled while a write of its own was in flight (see
        :meth:`_landed`); the caller now owns that cancellation."""
        if not self._held:
            return False  # the common case, without asking asyncio for the current task
        task = asyncio.current_task()
        if task is not None and task in self._held:
            self._held.discard(task)
            return True
        return False

    # -- receipts that ride with the next write ----------------------------------------------

    def defer_receipt(self, receipt: ops_db.Receipt, value: Any) -> None:
        """Keep a call's receipt in memory until the run's next write carries it (CONTRACT C5:
        the operation stays ``submitted`` until then; after a crash it is ``unknown`` and goes
        to reconciliation, as for a crash before the receipt's own commit).

        A workflow usually goes straight on to its next call or to its end, and that write
        commits the receipt in the same statement: one fenced write per effect step instead of
        two. Whatever else the workflow does first, the receipt does not wait for it: when the
        workflow yields to the event loop with the receipt still unwritten (it awaits another
        branch, anything in memory), the receipt is written alone at once, unless every branch
        now waits on the database: then the park, which comes next, carries it. Every other
        write writes it first; parking and every end of the run carry it (_last_write)."""
        self._receipts.append((receipt, value))
        if not self._settle_scheduled:
            self._settle_scheduled = True
            self.loop.call_soon(self._settle_soon)

    def _settle_soon(self) -> None:
        self._settle_scheduled = False
        if not self._receipts or self.ending or self.parking:
            return  # carried already, or the end (or parking) under way writes it first
        if self._active == 0 and (self._waits or (self._task is not None and self._task.done())):
            return  # the workflow has just finished, or every branch waits on the database, and
            # nothing else is in flight: its end or its park, which comes next, carries the
            # receipt (_last_write; _drive writes it alone if the park does not happen). With a
            # branch in flight, that end would wait for the branch: the receipt goes now.
        self._settle_in_background()

    def _settle_in_background(self) -> None:
        """Write the riding receipts alone, in a task of their own (kept referenced)."""
        self._settler = self.loop.create_task(self._settle_holding_the_run())

    async def _settle_holding_the_run(self) -> None:
        with self.active():  # the run is not parked or ended while this is in flight
            await self.settle()

    async def settle(self, *, hold: bool = False) -> bool:
        """Write every receipt still riding; False when the lease is gone (the receipts are
        then kept as evidence on their operations, CONTRACT C8). A receipt the database itself
        refuses is dropped (see :meth:`_settle_locked`) and the others are still written.
        ``hold`` as for :meth:`write`."""
        with self._delivering(hold):
            async with self._locked(finish=True):
                while True:
                    try:
                        await self._settle_locked()
                        return True
                    except Stop:
                        return False
                    except Exception as exc:  # noqa: BLE001 - logged; the end strands the op
                        log.warning("run %s: a receipt could not be written (%s)", self.run_id,
                                    type(exc).__name__)

    async def _settle_locked(self, keep: int = 0) -> None:
        """Write riding receipts alone, oldest first, until ``keep`` are left. Under the write
        lock. Raises :class:`Stop` if the lease is gone."""
        while len(self._receipts) > keep:
            receipt, value = self._receipts[0]
            if self.lost:
                await self._keep_late_receipts()
                raise Stop("lease_lost")
            try:
                try:
                    _, cancel_at = await self._landed(self.worker.writer.enqueue(
                        ops_db.receipt_commit_fast(receipt, run_id=self.run_id, token=self.token,
                                                   expected=self.revision, v=SCHEMA_VERSION)))
                    self.revision += 1
                    if cancel_at is not None:
                        self.note_cancel()
                except ops_db.FastPathMiss:
                    await self._write_locked(self.commit_work(receipt, value),
                                             with_buffer=False)
            except DatabaseError:
                self.lose_lease("database unavailable")
                await self._keep_late_receipts()
                raise Stop("lease_lost") from None
            except Stop:
                await self._keep_late_receipts()
                raise
            except Exception:
                # Refused for what it holds, not for the lease or the connection: it cannot be
                # the recorded outcome. It leaves memory (so that it blocks no later write) and
                # the operation stays `submitted`: the run's end strands it as unknown, for
                # reconciliation, as any dispatched call without a recorded outcome.
                del self._receipts[0]
                raise
            if (held := self._riding_written(self._receipts[:1])) is not None:
                await held

    async def _commit_riding(self, conn: Conn, riding: Sequence[tuple[ops_db.Receipt, Any]]
                             ) -> list[Event]:
        """Commit receipts still riding in the caller's transaction (:meth:`commit_work` for
        each); returns their ``call.completed`` events, to be appended ahead of the others."""
        events: list[Event] = []
        for receipt, value in riding:
            events += (await self.commit_work(receipt, value)(conn))[1]
        return events

    def _riding_written(self, riding: Sequence[tuple[ops_db.Receipt, Any]]
                        ) -> Awaitable[None] | None:
        """Bookkeeping once a transaction carrying ``riding`` (the oldest receipts) landed;
        returns what an armed fault point holds the caller on (see :mod:`faults`), if any."""
        del self._receipts[: len(riding)]
        held = None
        for receipt, _ in riding:
            hold = faults.reach("after_receipt", receipt.name)
            held = held or hold
        return held

    def commit_work(self, receipt: ops_db.Receipt, value: Any
                     ) -> Callable[[Conn], Awaitable[tuple[None, list[Event]]]]:
        """The general path of a receipt's write (``submitted`` → ``committed`` and its
        ``call.completed`` event): the guarded transition says what is wrong."""
        async def work(conn: Conn) -> tuple[None, list[Event]]:
            await ops_db.operation_commit(conn, op_id=receipt.op_id, token=self.token,
                                          receipt=receipt.text, receipt_digest=receipt.digest)
            return None, [event("call.completed", receipt.position, receipt.name,
                                {"result": value, "op": receipt.op_id})]
        return work

    async def _keep_late_receipts(self) -> None:
        while self._receipts:
            receipt, value = self._receipts.pop(0)
            await self.keep_late_receipt(receipt.op_id, value, receipt.digest)

    async def keep_late_receipt(self, op_id: int, receipt: Any, digest: str) -> None:
        """The lease is gone: this receipt is not the outcome, but it is evidence (C8)."""
        evidence = canonical.canonical_json({"kind": "late_receipt",
                                             "worker": self.worker.worker_id,
                                             "receipt": receipt, "receipt_digest": digest})
        with contextlib.suppress(Exception):  # the database may be what failed
            async with self.db.connection() as conn:
                await ops_db.operation_attach_evidence(conn, op_id=op_id, evidence=evidence)

    async def read(self, query: Callable[[Conn], Awaitable[T]]) -> T:
        """A read on the command path, with the storage layer's transient retries; if the
        database stays unavailable the run stops here (it is replayed later), it never fails."""
        try:
            return await self.db.run_in_transaction(query)
        except DatabaseError:
            self.lose_lease("database unavailable")
            raise Stop("lease_lost") from None

    @property
    def has_buffer(self) -> bool:
        return bool(self._buffer)

    # -- commands ----------------------------------------------------------------------------

    def value(self, position: int, name: str) -> Any:
        recorded = self.index.expect(position, "value", name)
        if recorded:
            raw = recorded[0]["payload"]["value"]
        else:
            if name == "now":
                raw = self.now().isoformat()
            elif name == "uuid":
                raw = str(uuid.uuid4())
            else:
                raw = random.random()
            self.buffer(event("value", position, name, {"value": raw}))
        if name == "now":
            return datetime.fromisoformat(raw)
        if name == "uuid":
            return uuid.UUID(raw)
        return float(raw)

    async def call(self, position: int, tool: Tool | str, arguments: dict[str, Any]) -> Any:
        resolved = self._tool(tool)
        with self.active(position):
            return await call_tool(self, position, resolved, arguments)

    async def sleep(self, position: int, duration: timedelta | float) -> None:
        recorded = self.index.expect(position, "sleep", "sleep")
        if recorded:
            until = datetime.fromisoformat(recorded[0]["payload"]["until"])
        else:
            seconds = as_seconds(duration) or 0.0
            self.boundary()
            until = self.now() + timedelta(seconds=seconds)
            self.buffer(event("timer", position, "sleep", {"until": until.isoformat()}))
        left = (until - self.now()).total_seconds()
        if left <= 0:
            return
        if left <= IN_MEMORY_SLEEP:
            with self.active():
                await asyncio.sleep(left)
            return
        await self.park(Wait("timer", position, wake_at=until))

    async def wait_for_event(
        self, position: int, name: str, timeout: timedelta | float | None
    ) -> Any:
        if not isinstance(name, str) or not name:
            raise InvalidRequest("an event name must be a non-empty string")
        recorded = self.index.expect(position, "event", name)
        if recorded:
            outcome = self.index.last(position, ("event.received", "event.timeout"))
            if outcome is not None:
                if outcome["kind"] == "event.timeout":
                    raise TimeoutError(f"event {name!r} did not arrive in time")
                return outcome["payload"]["payload"]
            raw = recorded[0]["payload"]["timeout_at"]
            timeout_at = None if raw is None else datetime.fromisoformat(raw)
        else:
            seconds = as_seconds(timeout)
            self.boundary()
            timeout_at = None if seconds is None else self.now() + timedelta(seconds=seconds)
            self.buffer(event("event.wait", position, name, {
                "timeout_at": None if timeout_at is None else timeout_at.isoformat()}))

        async def take(conn: Conn) -> tuple[Any, list[Event]]:
            got = await event_take(conn, run_id=self.run_id, name=name, position=position)
            if got is None:
                return None, []
            return got, [event("event.received", position, name,
                               {"payload": got["payload"], "event_id": got["id"]})]

        with self.active():
            got = await self.write(take)
        if got is not None:
            return got["payload"]
        if timeout_at is not None and self.now() >= timeout_at:
            await self._append(event("event.timeout", position, name, {}))
            raise TimeoutError(f"event {name!r} did not arrive in time")
        await self.park(Wait("event", position, wake_at=timeout_at, name=name))

    async def run_child(self, position: int, workflow: Workflow | str, input: Any) -> Any:
        wf = self._workflow(workflow)
        recorded = self.index.expect(position, "child", wf.name)
        if recorded:
            child_id = uuid.UUID(recorded[0]["payload"]["run_id"])
            outcome = self.index.last(position, ("child.completed", "child.failed"))
            if outcome is not None:
                return self._child_outcome(child_id, outcome)
        else:
            self.boundary()
            child_id = uuid.uuid5(self.run_id, f"child:{position}")
            row = self.app.new_run_row(
                wf, input, owner=self.owner, idempotency_key=None,
                deadline=self.remaining(), run_id=child_id, parent=(self.run_id, position))

            async def start(conn: Conn) -> tuple[None, list[Event]]:
                await runs_db.run_insert(conn, row)
                return None, [event("child.started", position, wf.name,
                                    {"run_id": str(child_id), "version": wf.version})]

            with self.active():
                await self.write(start, new_work=True)
        with self.active():
            rows = await self.read(
                lambda conn: runs_db.run_children_status(conn, self.run_id, [position]))
        if rows and rows[0]["status"] in ("succeeded", "failed", "cancelled"):
            child = rows[0]
            if child["status"] == "succeeded":
                outcome = event("child.completed", position, wf.name, {"result": child["result"]})
            else:
                outcome = event("child.failed", position, wf.name, {
                    "code": child["outcome_code"], "message": (child["error"] or {}).get(
                        "message", "the child run failed")})
            await self._append(outcome)
            return self._child_outcome(child_id, outcome)
        await self.park(Wait("child", position))

    def _child_outcome(self, child_id: uuid.UUID, outcome: Event) -> Any:
        if outcome["kind"] == "child.completed":
            return outcome["payload"]["result"]
        raise RunFailed(outcome["payload"]["message"], code=outcome["payload"]["code"],
                        run_id=str(child_id))

    async def _append(self, ev: Event) -> None:
        async def work(conn: Conn) -> tuple[None, list[Event]]:
            return None, [ev]

        with self.active():
            await self.write(work)

    def _tool(self, tool: Tool | str) -> Tool:
        name = tool if isinstance(tool, str) else tool.name
        found = self.app.registry.tools.get(name)
        if found is None:
            raise UnknownWorkflow(f"tool {name!r} is not registered with this orchestrator")
        return found

    def _workflow(self, workflow: Workflow | str) -> Workflow:
        if isinstance(workflow, str):
            matches = [w for w in self.app.registry.workflows.values() if w.name == workflow]
            if len(matches) != 1:
                raise UnknownWorkflow(f"workflow {workflow!r} is not registered (or ambiguous)")
            return matches[0]
        return workflow

    # -- parking -----------------------------------------------------------------------------

    async def park(self, wait: Wait) -> Any:
        """Wait for the database's help: never returns in this process.

        The executor parks the run once no branch has work in flight; the next claim replays.
        """
        if wait.kind != "blocked":
            self.boundary()
        self._waits[wait.position] = wait
        # A command may park from inside its own active() section (a call whose outcome became
        # unknown): while parked it is not work in flight.
        depth = self._active_depth.get(wait.position, 0)
        self._active -= depth
        self._changed.set()
        parked: asyncio.Future[None] = self.loop.create_future()
        self._parked.append(parked)
        try:
            await parked  # cancelled when the run is parked
        finally:
            self._active += depth

    async def drive(self, workflow: Workflow) -> None:
        """Run the workflow until it finishes or parks; record the outcome."""
        ctx = WorkflowContext(self)
        task: asyncio.Task[Any] = asyncio.ensure_future(workflow.fn(ctx, self.input))
        self._task = task
        task.add_done_callback(lambda _: self._changed.set())
        try:
            await self._drive(task)
        finally:  # whatever happened, nothing of this run keeps running in this process
            self.parking = True
            task.cancel()
            # A workflow's exception holds its frames, and they hold the context and so this
            # executor: kept, the task would leave the executor in a cycle, in memory until the
            # cycle collector runs.
            self._task = None
            for parked in self._parked:
                parked.cancel()
            if self._receipts:
                # Every end of the run writes them first; this is the backstop, also for a run
                # cancelled by a drain that ran out of time: what is known is still written.
                with contextlib.suppress(Exception):
                    await asyncio.shield(self.settle())

    async def _drive(self, task: asyncio.Task[Any]) -> None:
        while True:
            await self._changed.wait()
            self._changed.clear()
            if task.done():
                break
            if self._active == 0 and self._waits:
                for _ in range(4):  # let callbacks that are already due run first
                    await asyncio.sleep(0)
                if task.done():
                    break
                if self._active == 0 and self._waits and not self._changed.is_set():
                    self.parking = True
                    task.cancel()
                    with contextlib.suppress(BaseException):
                        await task
                    await self._park_run()
                    return
                if self._receipts and not task.done():  # no park after all: see _settle_soon
                    self._settle_in_background()
        while self._active:  # other branches still have work in flight: let it land
            await self._changed.wait()
            self._changed.clear()
        await self._finish(task)

    async def _park_run(self) -> None:
        self.ending = True
        waits = list(self._waits.values())
        blocked = [w for w in waits if w.kind == "blocked"]
        if blocked:
            ops = ", ".join(str(w.operation_id) for w in blocked)
            await self._flush_then(lambda conn: runs_db.run_block_for_reconciliation(
                conn, run_id=self.run_id, token=self.token,
                waiting_for=f"reconciliation of operation {ops}"))
            return
        wakes = [w.wake_at for w in waits if w.wake_at is not None]
        wake_at = min(wakes) if wakes else None  # the earliest timer; other waits re-park
        names = sorted({w.name for w in waits if w.kind == "event" and w.name})
        children = [w.position for w in waits if w.kind == "child"]
        parts = []
        if any(w.kind == "timer" for w in waits):
            parts.append("timer")
        parts += [f"event {n!r}" for n in names]
        if children:
            parts.append("child run")
        await self._flush_then(lambda conn: runs_db.run_suspend(
            conn, run_id=self.run_id, token=self.token, wake_at=wake_at,
            waiting_for=", ".join(parts), event_names=names, child_positions=children))

    async def _strand(self) -> bool:
        """The run was about to end with operations still unsettled (dispatched without an
        outcome, or unknown). It must not end yet: those become unknown, go to the
        reconciliation queue, and the run waits for them (C5, C8). Returns False when nothing
        is unknown after all (only never-dispatched intents were left: now cancelled)."""
        async def work(conn: Conn) -> tuple[bool, list[Event]]:
            stranded = await ops_db.operation_strand(conn, run_id=self.run_id, token=self.token)
            events = [event("call.unknown", op["position"], op["tool_name"],
                            {"op": op["id"], "reason": "OUTCOME_UNRECORDED",
                             "next": "reconcile"}) for op in stranded]
            unknown = await ops_db.operation_count_unknown(conn, run_id=self.run_id)
            return unknown > 0, events

        try:
            blocked = await self.write(work)
        except Stop:
            return True
        if not blocked:
            return False
        await self._flush_then(lambda conn: runs_db.run_block_for_reconciliation(
            conn, run_id=self.run_id, token=self.token,
            waiting_for="reconciliation of operations whose outcome is not recorded"))
        return True

    async def _flush_then(self, final: Callable[[Conn], Awaitable[Any]]) -> None:
        async def last(conn: Conn, events: list[Event]) -> None:
            if events:
                await runs_db.journal_append(conn, run_id=self.run_id, token=self.token,
                                             expected=self.revision, events=events)
            await final(conn)

        try:
            await self._last_write(last)
        except LeaseLost:
            self.lose_lease("parking rejected")

    async def _last_write(self, final: Callable[[Conn, list[Event]], Awaitable[None]]) -> bool:
        """The run's last write in this process (parking it, or an end other than the fast
        success): ``final(conn, events)`` appends ``events`` and writes the run's new state.

        Receipts still riding go in the same transaction, first (each ``submitted →
        committed`` with its ``call.completed`` ahead of the buffered events), so a run that
        parks right after a call commits once, not twice. If that transaction fails for any
        reason, the receipts are written alone first, as anywhere else (that path tells what
        is wrong with them), and then the write without them. False when the lease is gone
        (nothing more written)."""
        async def tx(conn: Conn, riding: list[tuple[ops_db.Receipt, Any]]) -> None:
            await final(conn, await self._commit_riding(conn, riding) + self._buffer)

        riding = [] if self.lost else list(self._receipts)
        if riding:
            try:
                await self.worker.writer.run_in_transaction(lambda conn: tx(conn, riding))
            except Exception:  # noqa: BLE001, S110 - retried below, receipts first and alone
                pass
            else:
                if (held := self._riding_written(riding)) is not None:
                    await held
                return True
        if not await self.settle():
            return False
        await self.worker.writer.run_in_transaction(lambda conn: tx(conn, []))
        return True

    # -- outcomes ----------------------------------------------------------------------------

    async def _finish(self, task: asyncio.Task[Any]) -> None:
        self.ending = True
        exc = task.exception()
        if isinstance(exc, BaseExceptionGroup):  # asyncio.TaskGroup in workflow code
            exc = _engine_error_in(exc) or exc  # as it would end without the group
        if isinstance(exc, Stop) and exc.reason in ("lease_lost", "drain", "deadline"):
            await self._stop(exc)  # out of time: unknown operations stay listed for operators
            return
        if any(w.kind == "blocked" for w in self._waits.values()):
            # Another branch is blocked on an operation whose outcome is unknown: the run
            # cannot end before that is known (it ends the same way after a replay).
            await self._park_run()
            return
        if isinstance(exc, Stop):
            await self._stop(exc)
            return
        if exc is None:
            await self._succeed(task.result())
            return
        await self._fail_from(exc)

    async def _succeed(self, result: Any) -> None:
        try:
            text = self.app.json_limits.text(result, "$.result")
        except InvalidRequest as exc:
            await self._fail("WORKFLOW_FAILED", "the workflow's result is not a JSON value "
                             "within the size cap; see the incident",
                             incident_detail=self._detail(exc))
            return
        if self.index.max_position >= self._position:
            await self._fail("NONDETERMINISM", "the workflow finished before reaching commands "
                             "recorded in its journal")
            return
        if not self._buffer and not self.lost:
            try:
                await self.write_direct(lambda expected, receipt: runs_db.run_succeed_fast(
                    run_id=self.run_id, token=self.token, expected=expected, result=text,
                    v=SCHEMA_VERSION, receipt=receipt))
                self.worker.metrics.incr("runs_succeeded")
                return
            except (ops_db.FastPathMiss, Stop):
                pass  # the general path below finds out why, and acts on it
        await self._terminal("succeeded", None, text, None,
                             event("run.completed", None, None, {"result": result}))

    async def _fail_from(self, exc: BaseException) -> None:
        if isinstance(exc, DatabaseError | ConfigurationError):
            # Infrastructure (the database, or a grant it lacks), not the workflow: never an
            # outcome. Stop here; the lease lapses and another claim replays the run.
            self.lose_lease(f"{exc.code}: the run goes back to the queue")
            return
        if isinstance(exc, Nondeterminism):
            await self._fail("NONDETERMINISM", str(exc))
        elif isinstance(exc, RunUnreadable):
            await self._fail(exc.code, exc.message, incident_detail=self._detail(exc))
        elif isinstance(exc, WorkflowError):
            await self._fail("WORKFLOW_FAILED", str(exc) or "the workflow failed")
        elif isinstance(exc, OrchestratorError):
            await self._fail("WORKFLOW_FAILED", f"the workflow stopped on {exc.code}",
                             incident_detail=self._detail(exc))
        else:
            await self._fail("WORKFLOW_FAILED",
                             "the workflow raised an exception; see the incident for details",
                             incident_detail=self._detail(exc))

    def _detail(self, exc: BaseException) -> dict[str, Any]:
        return {"type": type(exc).__name__, "message": storable(str(exc)),
                "traceback": storable("".join(traceback.format_exception(exc))[-20000:])}

    async def _stop(self, stop: Stop) -> None:
        if not await self.settle():
            return  # the lease is gone: write nothing more
        if stop.reason == "cancelled":
            await self._terminal("cancelled", "CANCELLED", None,
                                 _error_json("CANCELLED", "the run was cancelled", None),
                                 event("run.cancelled", None, None, {}))
        elif stop.reason == "abandoned":
            await self._fail("OPERATION_ABANDONED", stop.detail)
        elif stop.reason == "deadline":
            self.worker.metrics.incr("deadline_exhausted")
            await self._fail("DEADLINE_EXCEEDED", "the run's deadline passed")
        elif stop.reason == "drain":
            async with self.db.connection() as conn:
                await runs_db.run_release(conn, run_id=self.run_id, token=self.token)
        # lease_lost: someone else owns the run now; write nothing.

    async def _fail(self, code: str, message: str,
                    incident_detail: dict[str, Any] | None = None) -> None:
        ref = new_incident_ref()
        error = _error_json(code, message, ref)
        ev = event("run.failed", None, None, {"code": code, "message": message, "incident": ref})

        async def diagnostics(conn: Conn) -> None:
            # Every failure's reference leads somewhere: at least to its code and message.
            detail = incident_detail or {"message": message}
            await incident_record(conn, {
                "ref": ref, "code": code, "run_id": self.run_id, "operation_id": None,
                "phase": "workflow", "cause": detail.get("type"),
                "upstream_status": None, "detail": json.dumps(detail)})

        await self._terminal("failed", code, None, error, ev, extra=diagnostics)

    async def _terminal(self, status: str, code: str | None, result: str | None,
                        error: str | None, ev: Event,
                        extra: Callable[[Conn], Awaitable[None]] | None = None) -> None:
        async def last(conn: Conn, events: list[Event]) -> None:
            if extra is not None:
                await extra(conn)
            await ops_db.operation_enqueue_unlisted(conn, run_id=self.run_id)
            await runs_db.journal_append(conn, run_id=self.run_id, token=self.token,
                                         expected=self.revision, events=[*events, ev])
            await runs_db.run_finish(conn, run_id=self.run_id, token=self.token, status=status,
                                     outcome_code=code, result=result, error=error)

        try:
            if not await self._last_write(last):
                return
        except runs_db.UnsettledOperations:
            if await self._strand():
                return
            # Only never-dispatched intents were left (now cancelled): end as intended.
            await self._terminal(status, code, result, error, ev, extra)
            return
        except (LeaseLost, DatabaseError):
            self.lose_lease("outcome rejected")
            return
        self.worker.metrics.incr(f"runs_{status}")


def _error_json(code: str, message: str, incident: str | None) -> str:
    """A run's stored error; ``incident`` names its diagnostics (None: there are none, as for
    a cancellation)."""
    return json.dumps({"code": code, "message": message, "retryable": False,
                       "incident": incident})


__all__ = ["RunExecutor", "Stop", "Wait", "SchemaUnsupported", "event"]


def _engine_error_in(group: BaseExceptionGroup[BaseException]) -> BaseException | None:
    """What decides the end of a run whose workflow's task group collected ``group``, when the
    engine raised it: a :class:`Stop` (a lost lease first: nothing more can be written), else
    a :class:`DatabaseError` (never an outcome), else :class:`Nondeterminism`. None when the
    group holds only the workflow's own errors (the run fails with the group)."""
    ranked = [(rank, exc) for exc in _leaves(group) if (rank := _engine_rank(exc)) is not None]
    return min(ranked, key=lambda pair: pair[0])[1] if ranked else None  # the first of the best


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterator[BaseException]:
    """The exceptions of ``group`` and of the groups nested in it, in order."""
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc


def _engine_rank(exc: BaseException) -> int | None:
    """Which engine error decides first (lower first); None for the workflow's own."""
    if isinstance(exc, Stop):
        return 0 if exc.reason == "lease_lost" else 1
    if isinstance(exc, DatabaseError | ConfigurationError):
        return 2
    if isinstance(exc, Nondeterminism):
        return 3
    return None


class _Active:
    """``with executor.active(position):`` (a plain class, not a generator-based context
    manager: a step enters several, and the generator cost three times as much). Made per
    use: one kept on the executor would make a reference cycle, and an executor in a cycle
    outlives its run until the cycle collector runs."""

    __slots__ = ("ex", "position")

    def __init__(self, ex: RunExecutor, position: int | None) -> None:
        self.ex = ex
        self.position = position

    def __enter__(self) -> None:
        ex, position = self.ex, self.position
        ex._active += 1
        if position is not None:
            ex._active_depth[position] = ex._active_depth.get(position, 0) + 1

    def __exit__(self, *exc: object) -> None:
        ex, position = self.ex, self.position
        ex._active -= 1
        if position is not None:
            ex._active_depth[position] -= 1
        if ex._active == 0 and (ex._waits or (ex._task is not None and ex._task.done())):
            ex._changed.set()  # what _drive waits for: it may park or finish now


class _Delivering:
    """``with executor._delivering(hold):``; see :meth:`RunExecutor._delivering`."""

    __slots__ = ("ex", "hold")

    def __init__(self, ex: RunExecutor, *, hold: bool) -> None:
        self.ex = ex
        self.hold = hold

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        ex = self.ex
        if kind is None:
            if not self.hold and ex.take_held_cancel():
                raise asyncio.CancelledError
        elif issubclass(kind, Stop):
            ex.take_held_cancel()  # the run stops: that wins over the caller's cancellation
        elif ex.take_held_cancel():
            raise asyncio.CancelledError from exc


class _WriteLock:
    """``async with executor._locked(finish)``: a plain class, not a generator-based context
    manager, because every write of every step goes through it (the generator cost four times
    the lock itself)."""

    __slots__ = ("ex", "finish")

    def __init__(self, ex: RunExecutor, finish: bool) -> None:
        self.ex = ex
        self.finish = finish

    async def __aenter__(self) -> None:
        ex, held = self.ex, False
        while True:
            try:
                await ex._write_lock.acquire()
                break
            except asyncio.CancelledError:
                if ex.letting_go and not self.finish:
                    raise
                held = True
        if held:
            ex._hold_cancel()

    async def __aexit__(self, *exc: object) -> None:
        self.ex._write_lock.release()

