"""The fenced session of one run: every write of the run, under its lease and revision, one
at a time (:class:`Session`), and the receipts that ride with the next of them
(:class:`Rider`).

Every write is fenced by the lease token and the expected revision; a rejected write means the
lease is gone and the session stops touching the run (``Stop("lease_lost")``).

A call's receipt rides with the run's next write (:meth:`Rider.defer`): the next call's
write-ahead ``submitted`` or the run's success commits it in the same fenced row, and the run's
park or any other end in the same transaction, so an effect step costs one write, not two. Any
other write of the run writes it first, and so does the moment the workflow awaits anything but
a write or a park; until then the operation is ``submitted``, exactly as if the worker had died
before the receipt's commit (CONTRACT C5, C8). This is the one place that explains it; other
docstrings say "riding receipt" and mean this.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractContextManager
from datetime import datetime
from typing import Any, TypeVar

from orchestrator import canonical, faults
from orchestrator.db import journal as journal_db
from orchestrator.db import operations as ops_db
from orchestrator.db import steps as steps_db
from orchestrator.db.database import Conn, Database
from orchestrator.db.writer import GroupWriter, Landing, Statement
from orchestrator.engine.config import EngineConfig
from orchestrator.engine.control import Stop
from orchestrator.engine.run import RunState
from orchestrator.errors import DatabaseError, JournalFull, LeaseLost
from orchestrator.journal import SCHEMA_VERSION, Entry, EventKind, entry

T = TypeVar("T")
Work = Callable[[Conn], Awaitable[tuple[T, list[Entry]]]]
Riding = Sequence[tuple[steps_db.Receipt, Any]]
log = logging.getLogger("orchestrator.worker")

# Journal room kept free by new work for its outcomes: the call's result and the run's end.
JOURNAL_RESERVE = 3


class Session:
    """The run's writes: fenced, one at a time, each accounted for even if its caller is
    cancelled while it is in flight."""

    def __init__(self, run: RunState, revision: int, *, config: EngineConfig,
                 database: Database, writer: GroupWriter) -> None:
        self.run = run
        self.revision = revision
        self.config = config
        self.db = database
        self.writer = writer
        self.buffered: list[Entry] = []
        self._write_lock = asyncio.Lock()
        # Tasks cancelled while a write of theirs was in flight: the cancellation is delivered
        # once the write has landed and been accounted for (see _landed).
        self._held: set[asyncio.Task[Any]] = set()
        self._settler: asyncio.Task[None] | None = None  # a lone receipt write (kept referenced)
        # Set by the branch scheduler: marks a write in flight (the run is not parked meanwhile)
        self.holding: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext
        self.rider = Rider(run, database)
        self.rider.settle_now = self.settle_in_background

    def detach(self) -> None:
        """The run has left this process: drop the scheduler's callbacks (no reference cycle
        keeps the executor in memory after its run)."""
        self.holding = contextlib.nullcontext
        self.rider.detach()

    # -- room and buffering ------------------------------------------------------------------

    def check_room(self, events: int) -> None:
        """Refuse new work that would leave no room in the journal for its outcomes (C2)."""
        cap = self.config.max_journal_events
        if self.revision + events + JOURNAL_RESERVE > cap:
            raise JournalFull(f"run {self.run.run_id} reached its journal cap of {cap} events")

    def buffer(self, ev: Entry) -> None:
        """Queue an event that needs no commit of its own; it rides with the next write."""
        self.check_room(len(self.buffered) + 1)
        self.buffered.append(ev)

    # -- writes ------------------------------------------------------------------------------

    async def write(self, work: Work[T] | None, *, new_work: bool = False, hold: bool = False,
                    finish: bool = False) -> T | None:
        """One fenced transaction: ``work`` (if any), then the buffered and new events appended.
        Riding receipts go first, in the same transaction, so the journal keeps the order in
        which things happened and a call followed by anything else still costs one commit. If
        that transaction fails for any reason, the receipts are written alone (that path says
        what is wrong with them) and then the write without them.

        ``new_work`` writes (a call beginning, a child starting) are refused with
        ``JOURNAL_FULL`` unless they leave room for their own outcome and the run's; outcome
        writes are never refused, so nothing accepted loses its record. Raises :class:`Stop`
        ("lease_lost") if the fence rejects it: nothing was written then.

        A cancellation of the caller while the write is in flight does not abandon it (the
        group writer commits it all the same): it is delivered once the write has landed and
        been accounted for, or, with ``hold``, left for the caller to take
        (:meth:`take_held_cancel`). ``finish``: the write records what already happened (a
        receipt); see :meth:`locked`.
        """
        with _Delivering(self, hold):
            async with self.locked(finish):
                riding = [] if self.run.lost else list(self.rider.receipts)
                if riding:
                    try:
                        return await self.write_locked(work, new_work=new_work, riding=riding)
                    except (Exception, Stop):  # noqa: BLE001 - retried below, receipts alone
                        pass
                await self.settle_locked()
                return await self.write_locked(work, new_work=new_work)

    async def write_locked(self, work: Work[T] | None, *, new_work: bool = False,
                           with_buffer: bool = True, riding: Riding = ()) -> T | None:
        """:meth:`write` under the write lock, with the given ``riding`` receipts only."""
        run = self.run
        if run.lost:
            raise Stop("lease_lost")
        pending = list(self.buffered) if with_buffer else []

        async def tx(conn: Conn) -> tuple[T | None, list[Entry], datetime | None]:
            result: T | None = None
            events = await self.rider.commit_riding(conn, riding) + pending
            if work is not None:
                result, more = await work(conn)
                events += more
            cancel_at = None
            if events:
                cancel_at = await journal_db.journal_append(
                    conn, run_id=run.run_id, token=run.token, expected=self.revision,
                    events=events)
            return result, events, cancel_at

        if new_work:
            self.check_room(len(riding) + len(pending) + 1)
        try:
            outcome: tuple[T | None, list[Entry], datetime | None]
            outcome = await self.landed(self.writer.enqueue(tx))
            result, written, cancel_at = outcome
        except LeaseLost:
            if riding:  # maybe the work's own guard: the receipts alone, then the work, tell
                raise
            run.lose_lease("write rejected")
            raise Stop("lease_lost") from None
        except DatabaseError:
            # The database keeps failing this write: stop here without guessing; the run
            # is recovered from its journal once the lease lapses.
            run.lose_lease("database unavailable")
            raise Stop("lease_lost") from None
        del self.buffered[: len(pending)]
        self.revision += len(written)
        if cancel_at is not None:
            run.note_cancel()
        if (held := self.rider.written(riding)) is not None:
            await held
        return result

    async def write_direct(self, make: Callable[[int, steps_db.Receipt | None], Statement],
                           *, new_work: bool = False, hold: bool = False) -> Any:
        """A write whose one statement fences the run and appends its own event (the hot path
        of a call): ``make(expected revision, riding receipt)`` builds it under the run's write
        lock. A riding receipt goes in the same statement (the statement writes its
        ``call.completed`` first). Raises ``FastPathMiss`` when events are buffered (nothing
        written) or when the statement did not apply (after writing the riding receipt alone);
        the caller then takes the general path. A cancellation meanwhile is handled as in
        :meth:`write`."""
        with _Delivering(self, hold):
            return await self._write_direct(make, new_work)

    async def _write_direct(self, make: Callable[[int, steps_db.Receipt | None], Statement],
                            new_work: bool) -> Any:
        run, rider = self.run, self.rider
        async with self.locked():
            if run.lost:
                raise Stop("lease_lost")
            if self.buffered:  # buffered by another branch while this one waited for the lock
                raise steps_db.FastPathMiss("events are buffered: the general path writes them")
            if len(rider.receipts) > 1:  # parallel branches: all but one go alone
                await self.settle_locked(keep=1)
            riding = rider.receipts.pop(0) if rider.receipts else None
            try:
                if new_work:
                    self.check_room(1 + (riding is not None))
                statement = make(self.revision, None if riding is None else riding[0])
                result, cancel_at = await self.landed(self.writer.enqueue(statement))
            except BaseException as exc:
                if riding is not None:  # not written: it waits in line again
                    rider.receipts.insert(0, riding)
                    if isinstance(exc, steps_db.FastPathMiss):
                        await self.settle_locked()  # alone, before the general path
                if isinstance(exc, DatabaseError):
                    run.lose_lease("database unavailable")
                    raise Stop("lease_lost") from None
                raise
            self.revision += 1 + (riding is not None)
            if cancel_at is not None:
                run.note_cancel()
            if riding is not None and (
                    held := faults.reach("after_receipt", riding[0].name)) is not None:
                await held
            return result

    async def last_write(self, final: Callable[[Conn, list[Entry]], Awaitable[None]]) -> bool:
        """The run's last write in this process (parking it, or an end other than the fast
        success): ``final(conn, events)`` appends ``events`` and writes the run's new state.

        Riding receipts go in the same transaction, first, so a run that parks right after a
        call commits once, not twice. If that transaction fails for any reason, the receipts
        are written alone first, as anywhere else, and then the write without them. False when
        the lease is gone (nothing more written)."""
        async def tx(conn: Conn, riding: Riding) -> None:
            await final(conn, await self.rider.commit_riding(conn, riding) + self.buffered)

        riding = [] if self.run.lost else list(self.rider.receipts)
        if riding:
            try:
                await self.writer.run_in_transaction(lambda conn: tx(conn, riding))
            except Exception:  # noqa: BLE001, S110 - retried below, receipts first and alone
                pass
            else:
                if (held := self.rider.written(riding)) is not None:
                    await held
                return True
        if not await self.settle():
            return False
        await self.writer.run_in_transaction(lambda conn: tx(conn, []))
        return True

    async def read(self, query: Callable[[Conn], Awaitable[T]]) -> T:
        """A read on the command path, with the storage layer's transient retries, waiting out
        a database that cannot be reached as patiently as the run's writes do
        (:meth:`GroupWriter.patiently`); if the database stays unavailable the run stops here
        (it is replayed later), it never fails. A query the database rejects is raised at
        once."""
        try:
            return await self.writer.patiently(lambda: self.db.run_in_transaction(query))
        except DatabaseError:
            self.run.lose_lease("database unavailable")
            raise Stop("lease_lost") from None

    # -- riding receipts written alone -------------------------------------------------------

    def settle_in_background(self) -> None:
        """Write the riding receipts alone, in a task of their own (kept referenced)."""
        self._settler = self.run.loop.create_task(self._settle_holding_the_run())

    async def _settle_holding_the_run(self) -> None:
        with self.holding():  # the run is not parked or ended while this is in flight
            await self.settle()

    async def settle(self, *, hold: bool = False) -> bool:
        """Write every riding receipt; False when the lease is gone (the receipts are then kept
        as evidence on their operations, CONTRACT C8). A receipt the database itself refuses
        is dropped (see :meth:`settle_locked`) and the others are still written. ``hold`` as
        for :meth:`write`."""
        with _Delivering(self, hold):
            async with self.locked(finish=True):
                while True:
                    try:
                        await self.settle_locked()
                        return True
                    except Stop:
                        return False
                    except Exception as exc:  # noqa: BLE001 - logged; the end strands the op
                        log.warning("run %s: a receipt could not be written (%s)",
                                    self.run.run_id, type(exc).__name__)

    async def settle_locked(self, keep: int = 0) -> None:
        """Write riding receipts alone, oldest first, until ``keep`` are left. Under the write
        lock. Raises :class:`Stop` if the lease is gone."""
        run, rider = self.run, self.rider
        while len(rider.receipts) > keep:
            receipt, value = rider.receipts[0]
            if run.lost:
                await self.rider.keep_all_late()
                raise Stop("lease_lost")
            try:
                try:
                    _, cancel_at = await self.landed(self.writer.enqueue(
                        steps_db.receipt_commit_fast(receipt, run_id=run.run_id, token=run.token,
                                                   expected=self.revision, v=SCHEMA_VERSION,
                                                   run_text=run.run_text)))
                    self.revision += 1
                    if cancel_at is not None:
                        run.note_cancel()
                except steps_db.FastPathMiss:
                    await self.write_locked(rider.commit_work(receipt, value), with_buffer=False)
            except DatabaseError:
                run.lose_lease("database unavailable")
                await self.rider.keep_all_late()
                raise Stop("lease_lost") from None
            except Stop:
                await self.rider.keep_all_late()
                raise
            except Exception:
                # Refused for what it holds, not for the lease or the connection: it cannot be
                # the recorded outcome. It leaves memory (so that it blocks no later write) and
                # the operation stays `submitted`: the run's end strands it as unknown, for
                # reconciliation, as any dispatched call without a recorded outcome.
                del rider.receipts[0]
                raise
            if (held := rider.written(rider.receipts[:1])) is not None:
                await held

    # -- the write lock and cancellations in flight ------------------------------------------

    def locked(self, finish: bool = False) -> _WriteLock:
        """The run's write lock: one write of the run at a time. A caller that workflow code
        cancels while it waits for the lock (another branch's write is in flight) still makes
        its write: the cancellation is held as in :meth:`landed`, so that what the caller was
        about to record (a call's intent, its receipt) is recorded and the cancellation then
        handled as for a write in flight (a withdrawn call; a receipt returned), the same on
        replay. When the executor itself lets go of the run (``RunState.letting_go``), the
        caller stops at once and writes nothing, unless it is to ``finish`` recording what
        already happened (a receipt), which is written all the same."""
        return _WriteLock(self, finish)

    async def landed(self, landing: Landing) -> Any:
        """The outcome of a queued write, even if the caller is cancelled meanwhile.

        The group writer commits a queued write whether or not anyone still waits for it, so
        the caller's bookkeeping (the run's revision, a riding receipt) must follow the write,
        not the cancellation. A :class:`Landing` cannot be cancelled: a cancelled caller is
        woken once its write has landed; the cancellation is then held, the outcome returned
        for the bookkeeping, and :class:`_Delivering` delivers the cancellation. (Abandoning
        the write instead would leave the run's revision behind the database's: its next write
        would miss and the run be dropped as if its lease were lost.)"""
        try:
            return await landing
        except asyncio.CancelledError:
            if not landing.done():
                raise
        self.hold_cancel()
        return landing.result()

    def hold_cancel(self) -> None:
        """The current task was cancelled while it wrote: keep that for
        :meth:`take_held_cancel` (the write goes on and is accounted for first)."""
        task = asyncio.current_task()
        if task is not None:
            self._held.add(task)

    def take_held_cancel(self) -> bool:
        """Whether the current task was cancelled while a write of its own was in flight (see
        :meth:`landed`); the caller now owns that cancellation."""
        if not self._held:
            return False  # the common case, without asking asyncio for the current task
        task = asyncio.current_task()
        if task is not None and task in self._held:
            self._held.discard(task)
            return True
        return False


class Rider:
    """The receipts known in this process but not yet written (see the module docstring).
    It holds no link back to the session: the scheduler's callbacks are set by the session and
    the branch scheduler, and cleared by :meth:`detach` when the run leaves the process (no
    reference cycle keeps an executor in memory)."""

    def __init__(self, run: RunState, database: Database) -> None:
        self.run = run
        self.db = database
        self.receipts: list[tuple[steps_db.Receipt, Any]] = []
        self._scheduled = False
        # Whether the run's end or park comes next (and will carry the receipts); how to write
        # them alone now.
        self.last_write_next: Callable[[], bool] = _no
        self.settle_now: Callable[[], None] = _nothing

    def detach(self) -> None:
        self.last_write_next = _no
        self.settle_now = _nothing

    def defer(self, receipt: steps_db.Receipt, value: Any) -> None:
        """Keep a call's receipt until the run's next write carries it. Whatever else the
        workflow does first, the receipt does not wait for it: when the workflow yields to the
        event loop with the receipt still unwritten, it is written alone at once, unless every
        branch now waits on the database: then the park, which comes next, carries it."""
        self.receipts.append((receipt, value))
        if not self._scheduled:
            self._scheduled = True
            self.run.loop.call_soon(self._settle_soon)

    def _settle_soon(self) -> None:
        self._scheduled = False
        if not self.receipts or self.run.ending:
            return  # carried already, or the end (or parking) under way writes it first
        if self.last_write_next():
            return  # the workflow has just finished, or every branch waits on the database,
            # and nothing else is in flight: its end or its park carries the receipt
        self.settle_now()

    async def commit_riding(self, conn: Conn, riding: Riding) -> list[Entry]:
        """Commit ``riding`` receipts in the caller's transaction (:meth:`commit_work` for
        each); returns their ``call.completed`` events, to be appended ahead of the others."""
        events: list[Entry] = []
        for receipt, value in riding:
            events += (await self.commit_work(receipt, value)(conn))[1]
        return events

    def written(self, riding: Riding) -> Awaitable[None] | None:
        """Bookkeeping once a transaction carrying ``riding`` (the oldest receipts) landed;
        returns what an armed fault point holds the caller on (see :mod:`faults`), if any."""
        del self.receipts[: len(riding)]
        held = None
        for receipt, _ in riding:
            hold = faults.reach("after_receipt", receipt.name)
            held = held or hold
        return held

    def commit_work(self, receipt: steps_db.Receipt, value: Any) -> Work[None]:
        """The general path of a receipt's write (``submitted`` → ``committed`` and its
        ``call.completed`` event): the guarded transition says what is wrong."""
        token, run_id = self.run.token, self.run.run_id

        async def work(conn: Conn) -> tuple[None, list[Entry]]:
            await ops_db.operation_commit(conn, run_id=run_id, op_id=receipt.op_id, token=token,
                                          receipt=receipt.text, receipt_digest=receipt.digest)
            return None, [entry(EventKind.CALL_COMPLETED, receipt.position, receipt.name,
                                {"result": value, "op": receipt.op_id})]
        return work

    async def keep_all_late(self) -> None:
        """The lease is gone: every riding receipt leaves memory as evidence (:meth:`keep_late`)."""
        receipts = self.receipts
        while receipts:
            receipt, value = receipts.pop(0)
            await self.keep_late(receipt.op_id, value, receipt.digest)

    async def keep_late(self, op_id: int, receipt: Any, digest: str) -> None:
        """The lease is gone: this receipt is not the outcome, but it is evidence (C8)."""
        evidence = canonical.canonical_json({"kind": "late_receipt",
                                             "worker": self.run.worker_id,
                                             "receipt": receipt, "receipt_digest": digest})
        with contextlib.suppress(Exception):  # the database may be what failed
            async with self.db.connection() as conn:
                await ops_db.operation_attach_evidence(conn, op_id=op_id, evidence=evidence)


def _no() -> bool:
    return False


def _nothing() -> None:
    pass


class _Delivering:
    """``with _Delivering(session, hold):`` delivers a cancellation that
    :meth:`Session.landed` held, once the write's bookkeeping is done: after a write that
    landed, and instead of the error of one that did not (the caller asked to stop; a
    :class:`Stop` of the run still wins). With ``hold`` a landed write returns normally and the
    caller takes the cancellation itself. (A plain class, not a generator-based context
    manager: every write of every step goes through it.)"""

    __slots__ = ("session", "hold")

    def __init__(self, session: Session, hold: bool) -> None:
        self.session = session
        self.hold = hold

    def __enter__(self) -> None:
        pass

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        session = self.session
        if kind is None:
            if not self.hold and session.take_held_cancel():
                raise asyncio.CancelledError
        elif issubclass(kind, Stop):
            session.take_held_cancel()  # the run stops: that wins over the caller's cancellation
        elif session.take_held_cancel():
            raise asyncio.CancelledError from exc


class _WriteLock:
    """``async with session.locked(finish)``: a plain class, not a generator-based context
    manager, because every write of every step goes through it (the generator cost four times
    the lock itself)."""

    __slots__ = ("session", "finish")

    def __init__(self, session: Session, finish: bool) -> None:
        self.session = session
        self.finish = finish

    async def __aenter__(self) -> None:
        session, held = self.session, False
        while True:
            try:
                await session._write_lock.acquire()
                break
            except asyncio.CancelledError:
                if session.run.letting_go and not self.finish:
                    raise
                held = True
        if held:
            session.hold_cancel()

    async def __aexit__(self, *exc: object) -> None:
        self.session._write_lock.release()
