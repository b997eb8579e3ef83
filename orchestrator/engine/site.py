"""One tool call at one journal position, as every part of the gateway sees it: what is
called, with what intent, under which run, and the steps they share (withdrawing the call,
recording an unknown outcome, parking on it, keeping an incident)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import time
import traceback
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NoReturn, TypeVar, cast

from orchestrator import canonical, faults
from orchestrator.db import operations as ops_db
from orchestrator.db import runs as runs_db
from orchestrator.db.database import Conn
from orchestrator.db.events import incident_record
from orchestrator.engine.branches import Branches
from orchestrator.engine.config import EngineConfig
from orchestrator.engine.control import Stop, Wait
from orchestrator.engine.run import RunState
from orchestrator.engine.session import Session
from orchestrator.errors import (
    InvalidRequest,
    OrchestratorError,
    new_incident_ref,
    operation_error_json,
)
from orchestrator.failures import incident_cause
from orchestrator.journal import Entry, EventKind, entry
from orchestrator.logs import fields
from orchestrator.registry import Tool
from orchestrator.text import storable

log = logging.getLogger("orchestrator.worker")

T = TypeVar("T")


def next_step_after_uncertain(effect: str, attempts: int, max_attempts: int) -> str:
    """What may follow an attempt whose outcome is unknown (CONTRACT C5). Pure.

    Returns ``"resend"`` (same idempotency key), ``"new_attempt"`` or ``"reconcile"``.
    """
    if faults.UNSAFE_REDISPATCH and effect == "consequential":
        return "new_attempt"  # the guard disabled on purpose by the chaos suite's self-test
    if attempts >= max_attempts or effect == "consequential":
        return "reconcile"
    return "resend" if effect == "idempotent" else "new_attempt"


IN_PROCESS_TURN = 0.05
"""Seconds: a call whose turn comes sooner waits in its worker instead of parking its run
(parking and resuming cost more than that)."""
FULL_RECHECK = (0.2, 1.0)
"""Seconds (a random span) a run parks before a call of a tool at its concurrency limit asks
again."""


@dataclass(frozen=True)
class _Turn:
    """What the admission said instead of admitting: see ``ops_db.tool_admit``."""

    wait: float


@dataclass
class Attempt:
    """Where a call stands: the attempt to run next and what it reuses."""

    number: int = 1
    key: str | None = None  # an idempotent re-send reuses the uncertain attempt's key
    pending_op: int | None = None  # an intent recorded before a crash, stages not yet passed
    resend: bool = False  # sent again outside the retry budget, the last proven not applied

    @property
    def kind(self) -> str:
        """What this attempt is (:data:`orchestrator.metrics.ATTEMPT_KINDS`)."""
        if self.number == 1:
            return "initial"
        if self.resend:
            return "engine_resend"
        return "retry" if self.key is None else "idempotent_resend"


LOST = "WORKER_LOST"
"""The reason of an unknown outcome that the engine caused, not the tool: the attempt's worker
died, or lost its lease or its connection, between ``submitted`` and the receipt (or withheld
the dispatch, its lease too short to send safely)."""
UNKNOWN_CAUSES = (LOST, "TOOL_OUTCOME_UNCERTAIN", "INVALID_RECEIPT")
"""The reasons an outcome is unknown, as counted by ``unknown_outcomes`` (anything else counts
as ``other``, so that the metric's label stays bounded)."""


class _Done(Exception):  # noqa: N818 - carries a recorded receipt (raised out of resume)
    def __init__(self, value: Any) -> None:
        super().__init__("done")
        self.value = value


class CallSite:
    """``ctx.call(tool, **arguments)`` at one position of one run."""

    def __init__(self, run: RunState, session: Session, branches: Branches,
                 config: EngineConfig, position: int, tool: Tool,
                 arguments: dict[str, Any]) -> None:
        self.run = run
        self.session = session
        self.branches = branches
        self.config = config
        self.position = position
        self.tool = tool
        self.arguments = arguments
        self.args_text = config.json_limits.text(arguments, "$.arguments")
        # Attempts sent again outside the retry budget (C8): after the engine lost one that
        # reconciliation proved not applied ("lost"), or on an operator's word ("operator").
        # Counted from the journal on a replay; they do not count against max_attempts.
        self.resent_lost = 0
        self.resent_by_operator = 0
        self.intent = canonical.intent_digest_text(tool.name, tool.version, run.owner_text,
                                                   self.args_text)
        try:  # a call that cannot bind is a bug in the workflow: refuse it before any write
            tool.check_arguments(arguments)
        except TypeError as exc:
            raise InvalidRequest(f"tool {tool.name} does not take these arguments: {exc}",
                                 path="$.arguments") from None

    def event(self, kind: EventKind, payload: dict[str, Any]) -> Entry:
        return entry(kind, self.position, self.tool.name, payload)

    def key_for(self, attempt: int) -> str:
        return f"{self.run.run_text}:{self.position}:{attempt}"

    def submitted_payload(self, number: int, op_id: int, key: str) -> dict[str, Any]:
        """The payload of this call's ``call.pending`` / ``call.submitted`` entry."""
        return {"tool_version": self.tool.version, "intent": self.intent, "attempt": number,
                "op": op_id, "key": key, "effect": self.tool.effect}

    async def append(self, work: Any) -> Any:
        """A write of this call, marked in flight."""
        with self.branches.active():
            return await self.session.write(work)

    # -- steps the parts share ---------------------------------------------------------------

    async def written(self, op_id: int, number: int, status: str | None, *,
                      pending: bool) -> None:
        """After the write of a call's intent (``pending`` or ``submitted``), made with
        ``hold``: a cancelled run stops here (the operation is ``cancelled``), and a call that
        workflow code cancelled while the write was in flight is withdrawn."""
        withdrawn = self.session.take_held_cancel()
        if status == "cancelled":
            self.run.stop_cancelled()
        if withdrawn:
            await self.withdraw(op_id, number, pending=pending)

    async def withdraw(self, op_id: int, number: int, *, pending: bool,
                       settled: bool = False) -> NoReturn:
        """The calling task was cancelled after the call's intent was written (while that write
        was in flight or a policy stage ran), before the tool was called; the tool will not be.

        By workflow code (a timeout around ``ctx.call``, a race it lost): the call is withdrawn.
        The operation is settled as never dispatched (``submitted → failed``, or ``pending →
        cancelled``: nothing was applied), the journal records the withdrawal, and the
        cancellation reaches the workflow. A replay finds the withdrawal and waits, at that
        point, for the same cancellation. ``settled``: the call is given up between two
        attempts (during the backoff before the next one); attempt ``number`` keeps the
        outcome it has, and only the journal records the withdrawal.

        By the executor letting go of the run (parking, a lost lease, a draining worker, whose
        stop can cancel a task group's other branches): nothing more is recorded, the journal
        decides on the next claim as for a worker that died (a withdrawal there would make the
        replay wait for a cancellation that workflow code never makes)."""
        if self.run.letting_go:
            raise asyncio.CancelledError
        error = operation_error_json("CALL_WITHDRAWN", cause="cancelled",
                                     message="workflow code cancelled the call before it was "
                                             "sent")
        token, run_id = self.run.token, self.run.run_id

        async def work(conn: Conn) -> tuple[None, list[Entry]]:
            if pending:
                await ops_db.operation_cancel(conn, run_id=run_id, op_id=op_id, token=token,
                                              error=error)
            elif not settled:
                await ops_db.operation_fail(conn, run_id=run_id, op_id=op_id, token=token,
                                            error=error)
            return None, [self.event(EventKind.CALL_FAILED, {
                "op": op_id, "attempt": number, "cause": "cancelled", "reason": "withdrawn",
                "incident": None})]

        await self.append(work)
        raise asyncio.CancelledError

    def charged(self, number: int) -> int:
        """The attempts begun up to ``number`` that count against the tool's retry budget."""
        return number - self.resent_lost - self.resent_by_operator

    async def lease_for_dispatch(self, op_id: int) -> None:
        """Immediately before the tool is called: the lease must last at least the dispatch
        margin by this process's clock, counted from when its last renewal was sent (C6).
        If it may not, it is renewed now, once; if that fails too, the call is not sent: the
        run is let go with the operation ``submitted``, and the next holder finds it uncertain,
        as after a crash. A worker paused after ``submitted`` (a stop signal, a long collection,
        a starved host) therefore never sends once another worker may hold the run."""
        run = self.run
        if not run.lost:
            if run.lease_left() >= run.dispatch_margin:
                return
            sent = time.monotonic()
            try:
                async with self.session.db.connection() as conn:
                    kept = await runs_db.run_lease_extend(
                        conn, run_id=run.run_id, token=run.token, worker=run.worker_id,
                        ttl=run.lease.ttl)
            except OrchestratorError:
                kept = False
            if kept:
                run.lease.renewed(sent)
                if run.lease_left() >= run.dispatch_margin:
                    return
        run.metrics.incr("dispatches_withheld", tool=self.tool.name)
        log.warning("run %s: operation %s (%s) not sent: the lease may end before the call "
                    "does; the next holder finds it uncertain", run.run_id, op_id,
                    self.tool.name, extra=fields(run_id=run.run_id, workflow=run.workflow_key,
                                                 operation_id=op_id, tool=self.tool.name))
        run.lose_lease("a call withheld")
        raise Stop("lease_lost")

    def uncertain_step(self, number: int) -> str:
        run = self.run
        step = next_step_after_uncertain(self.tool.effect, self.charged(number),
                                         self.tool.max_attempts)
        if step != "reconcile" and (run.cancel_requested or run.remaining() == 0):
            step = "new_attempt" if self.tool.effect == "read" else "reconcile"
        return step

    async def record_unknown(self, op_id: int, reason: str, step: str,
                             incident: str | None = None, *, delay_ms: int = 0,
                             not_before: datetime | None = None) -> None:
        """submitted → unknown, and what comes next (``step``); a repetition that waits
        first has its ``delay_ms`` and ``not_before`` in the entry, so that a replay waits for
        the same moment. Workflow code that cancels the call while this is written (a timeout
        around ``ctx.call``) does not take the branch past the unknown outcome: the
        cancellation is held (:meth:`Session.take_held_cancel`) and the call's next step
        decides, as a replay would: a park until the reconciliation, or the next attempt,
        withdrawn before it is sent (:meth:`written`)."""
        payload: dict[str, Any] = {"op": op_id, "reason": reason, "next": step}
        if incident is not None:
            payload["incident"] = incident
        if not_before is not None:
            payload["delay_ms"], payload["not_before"] = delay_ms, not_before.isoformat()
        token, run_id = self.run.token, self.run.run_id

        async def work(conn: Conn) -> tuple[None, list[Entry]]:
            await ops_db.operation_mark_unknown(
                conn, run_id=run_id, op_id=op_id, token=token, reason=reason,
                enqueue=step == "reconcile", settle_read=step == "new_attempt")
            return None, [self.event(EventKind.CALL_UNKNOWN, payload)]

        with self.branches.active():
            await self.session.write(work, hold=True)
        self.run.metrics.incr("unknown_outcomes", tool=self.tool.name,
                              cause=reason if reason in UNKNOWN_CAUSES else "other")
        log.warning("run %s: the outcome of operation %s (%s) is unknown (%s); next: %s%s",
                    self.run.run_id, op_id, self.tool.name, reason, step,
                    f"; incident {incident}" if incident else "",
                    extra=fields(run_id=run_id, workflow=self.run.workflow_key,
                                 operation_id=op_id, tool=self.tool.name, code=reason,
                                 incident=incident))

    async def park_blocked(self, op_id: int) -> NoReturn:
        await self.branches.park(Wait("blocked", self.position, operation_id=op_id))
        raise AssertionError("unreachable")  # pragma: no cover - park never returns

    async def wait_until(self, when: datetime, op_id: int, number: int) -> None:
        """A durable wait before the next attempt: the run is parked, not a process asleep.
        Workflow code that gives up on the call meanwhile (another branch keeps the run in
        this process) withdraws it before that attempt is begun (:meth:`withdraw`; attempt
        ``number``, operation ``op_id``, keeps the outcome it has)."""
        if when > self.run.now():
            try:
                await self.branches.park(Wait("timer", self.position, wake_at=when))
            except asyncio.CancelledError:
                await self.withdraw(op_id, number, pending=False, settled=True)

    # -- the tool's limits (docs/flow.md) ------------------------------------------------------

    async def admitted_write(self, write: Callable[[Conn], Awaitable[tuple[T, list[Entry]]]],
                             *, new_work: bool = False) -> T:
        """``write`` (which records the attempt ``submitted``) in the transaction that admits
        the dispatch against the tool's limits; until they admit it, the call waits its turn
        (:meth:`wait_turn`). A tool without limits writes at once."""
        tool, rate = self.tool, self.tool.rate
        per = rate.per.total_seconds() if rate is not None else None
        timeout = (tool.timeout or self.config.tool_timeout).total_seconds()
        while True:
            async def work(conn: Conn) -> tuple[T | _Turn, list[Entry]]:
                wait = await ops_db.tool_admit(conn, tool=tool.name,
                                               concurrency=tool.concurrency,
                                               rate=rate.limit if rate else None, per=per,
                                               timeout=timeout)
                if wait is not None:
                    return _Turn(wait), []
                return await write(conn)

            with self.branches.active():
                result = await self.session.write(work if tool.limited else write,
                                                  new_work=new_work, hold=True)
            if not isinstance(result, _Turn):
                return cast(T, result)
            await self.wait_turn(result.wait)

    async def wait_turn(self, wait: float) -> None:
        """Wait for the tool's turn: a moment in this process when another transaction is
        admitting a call of it or the wait is shorter than parking costs; else the run is
        parked (it holds no worker slot) until the rate window or the back-off has room, or,
        when the tool's concurrency is full, for a while before it asks again."""
        self.run.metrics.incr("tool_turn_waits", tool=self.tool.name,
                              limit="busy" if wait == ops_db.ADMIT_BUSY
                              else "concurrency" if wait == ops_db.ADMIT_FULL else "rate")
        if wait == ops_db.ADMIT_BUSY:
            await asyncio.sleep(random.uniform(0.001, 0.005))  # noqa: S311 - jitter
            return
        if wait == ops_db.ADMIT_FULL:
            wait = random.uniform(*FULL_RECHECK)  # noqa: S311 - jitter
        if wait < IN_PROCESS_TURN:
            await asyncio.sleep(wait)
            return
        await self.branches.park(Wait("turn", self.position, name=self.tool.name,
                                      wake_at=self.run.now() + timedelta(seconds=wait)))

    async def back_off_shared(self, seconds: float) -> None:
        """The provider asked for a pause (429 or 503 with a Retry-After): pause the tool's
        dispatch for every run (a failure to record it is logged; this attempt's outcome is
        recorded all the same)."""
        if not self.tool.shared_backoff or seconds <= 0:
            return
        name = self.tool.name
        try:
            async with self.session.db.connection() as conn:
                until = await ops_db.tool_back_off(conn, tool=name, seconds=seconds)
        except OrchestratorError as exc:
            log.warning("tool %s: its back-off could not be shared: %s", name, exc.code)
            return
        self.config.back_offs[name] = until
        self.run.metrics.incr("tool_back_offs", tool=name)

    async def free_turn(self) -> None:
        """A call of the tool (which has a concurrency limit) has ended: wake as many runs
        parked for its turn as it admits at once (best effort: they also ask again on their
        own, :data:`FULL_RECHECK`)."""
        tool = self.tool
        assert tool.concurrency is not None
        with contextlib.suppress(OrchestratorError):
            async with self.session.db.connection() as conn:
                await runs_db.run_wake_turn(conn, tool.name, tool.concurrency)

    async def before_dispatch(self) -> None:
        """Wait out a back-off of the tool that a provider asked for (parked)."""
        until = self.config.back_offs.get(self.tool.name)
        if until is not None:
            left = (until - self.run.now()).total_seconds()
            if left > 0:
                await self.wait_turn(left)

    async def incident(self, op_id: int, phase: str, exc: BaseException) -> str:
        """Keep what went wrong in protected diagnostics; return the incident reference."""
        ref = new_incident_ref()
        detail = {"type": type(exc).__name__, "message": storable(str(exc)[:10000]),
                  "tool": self.tool.name,
                  "traceback": storable("".join(traceback.format_exception(exc))[-20000:])}
        status = getattr(exc, "status", None)
        cause, own_word = incident_cause(exc)
        if own_word is not None:
            detail["cause"] = storable(own_word[:1000])
        try:
            with contextlib.suppress(Exception):
                async with self.session.db.connection() as conn:
                    await incident_record(conn, {
                        "ref": ref, "code": "TOOL_ERROR", "run_id": self.run.run_id,
                        "operation_id": op_id, "phase": phase, "cause": cause,
                        "upstream_status": status if isinstance(status, int) else None,
                        "detail": json.dumps(detail)})
        except asyncio.CancelledError:
            if self.run.letting_go:
                raise
            # Workflow code gave up on the call meanwhile: held, as during a write, for what
            # the call records next (an unknown outcome must still block the branch).
            self.session.hold_cancel()
        return ref
