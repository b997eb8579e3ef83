"""How a run leaves this process: its outcome (succeeded, failed, cancelled), a stop (its
lease lost, a drain, its deadline), or a park until the database wakes it (CONTRACT C5, C8,
C11)."""

from __future__ import annotations

import asyncio
import json
import logging
import traceback
from collections.abc import Awaitable, Callable, Collection
from typing import Any

from orchestrator import tracing
from orchestrator.context import ContinueAsNew
from orchestrator.db import chains as chains_db
from orchestrator.db import journal as journal_db
from orchestrator.db import operations as ops_db
from orchestrator.db import runs as runs_db
from orchestrator.db import steps as steps_db
from orchestrator.db.database import Conn
from orchestrator.db.events import incident_record, incidents_of_operations
from orchestrator.engine.causes import cause_of, headline, tool_story
from orchestrator.engine.control import Stop, Wait, engine_error_in
from orchestrator.engine.run import RunState
from orchestrator.engine.session import Session
from orchestrator.errors import (
    ConfigurationError,
    DatabaseError,
    InvalidRequest,
    LeaseLost,
    OrchestratorError,
    RunUnreadable,
    ToolFailed,
    WorkflowError,
    cancelled_error,
    error_json,
    new_incident_ref,
)
from orchestrator.ids import new_run_id
from orchestrator.journal import SCHEMA_VERSION, Entry, EventKind, Nondeterminism, entry
from orchestrator.logs import fields
from orchestrator.matching import code_ended
from orchestrator.text import storable

log = logging.getLogger("orchestrator.worker")


STRANDED_ERROR = cancelled_error("ended")
"""The error of an intent that the run's end left ``pending`` (never dispatched)."""


def strand_entries(settled: list[dict[str, Any]]) -> list[Entry]:
    """The journal's account of what ``ops_db.operation_strand`` settled, in order: an intent
    never dispatched is ``call.cancelled`` (``why``: ``ended``, the run ended before it was
    sent), as any other cancellation of an intent is journaled; one dispatched without an
    outcome is ``call.unknown``, for reconciliation."""
    return [entry(EventKind.CALL_CANCELLED, op["position"], op["tool_name"],
                  {"op": op["id"], "why": "ended"}) if op["state"] == "cancelled"
            else entry(EventKind.CALL_UNKNOWN, op["position"], op["tool_name"],
                       {"op": op["id"], "reason": "OUTCOME_UNRECORDED", "next": "reconcile"})
            for op in settled]


class Outcome:
    """The last write of a run in this process."""

    def __init__(self, run: RunState, session: Session) -> None:
        self.run = run
        self.session = session

    # -- parking -----------------------------------------------------------------------------

    async def park(self, waits: Collection[Wait]) -> None:
        """Every branch waits on the database: record what for, and let the run go."""
        run = self.run
        tracing.event("park", {"orchestrator.waits": ",".join(sorted({w.kind for w in waits}))})
        blocked = [w for w in waits if w.kind == "blocked"]
        if blocked:
            ops = ", ".join(str(w.operation_id) for w in blocked)
            unknown: list[dict[str, Any]] = []

            async def block(conn: Conn) -> None:
                await runs_db.run_block_for_reconciliation(
                    conn, run_id=run.run_id, token=run.token,
                    waiting_for=f"reconciliation of operation {ops}")
                # What the line below names (each call's tool and incident), in the same
                # transaction: the run is parked only on a rare path, an outcome unknown.
                unknown[:] = await journal_db.journal_unknown_calls(
                    conn, run.run_id, [w.position for w in blocked])

            if await self._flush_then(block):
                run.metrics.incr("run_parks")
                self._log_blocked([(w.operation_id, w.position) for w in blocked], unknown)
            return
        wakes = [w.wake_at for w in waits if w.wake_at is not None]
        wake_at = min(wakes) if wakes else None  # the earliest timer; other waits re-park
        names = sorted({w.name for w in waits if w.kind == "event" and w.name})
        children = [w.position for w in waits if w.kind == "child"]
        parts = []
        if any(w.kind == "timer" for w in waits):
            parts.append("timer")
        parts += [f"event {n!r}" for n in names]
        tools = sorted({w.name for w in waits if w.kind == "turn" and w.name})
        parts += [f"the turn of tool {n}" for n in tools]
        if children:
            parts.append("child run")
        # The tool a call of which ending wakes the run: of several (branches waiting for the
        # turns of different tools), the first by name; the others' waits end by their timers.
        tool = tools[0] if tools else None
        if await self._flush_then(lambda conn: runs_db.run_suspend(
                conn, run_id=run.run_id, token=run.token, wake_at=wake_at,
                waiting_for=", ".join(parts), waiting_tool=tool, event_names=names,
                child_positions=children)):
            run.metrics.incr("run_parks")

    async def _flush_then(self, final: Callable[[Conn], Awaitable[Any]]) -> bool:
        """The run's last write: what is buffered, then ``final``. False if the lease was
        lost (nothing written) or the database kept failing the write (the run is let go)."""
        run, session = self.run, self.session

        async def last(conn: Conn, events: list[Entry]) -> None:
            if events:
                await journal_db.journal_append(conn, run_id=run.run_id, token=run.token,
                                             expected=session.revision, events=events)
            await final(conn)

        try:
            return await session.last_write(last)
        except LeaseLost:
            run.lose_lease("parking rejected")
            return False
        except DatabaseError:
            # The database keeps failing the write: as for any other write, the run is let
            # go here and replayed from its journal once its lease lapses.
            run.lose_lease("database unavailable")
            return False

    def _log_blocked(self, blocked: list[tuple[int | None, int]],
                     unknown: list[dict[str, Any]]) -> None:
        """One INFO line per operation the parked run waits on: its tool and incident (the
        protected diagnostics of what went wrong, if anything was kept), never their text."""
        found = {row["position"]: row for row in unknown}
        for op_id, position in blocked:
            row = found.get(position, {})
            tool, incident = row.get("tool"), row.get("incident")
            self._log_reconciliation(op_id, tool, incident)

    def _log_reconciliation(self, op_id: int | None, tool: str | None,
                            incident: str | None) -> None:
        run = self.run
        what = f"operation {op_id}" if op_id is not None else "its unsettled operations"
        log.info("run %s (%s) needs reconciliation: it waits for the outcome of %s%s%s",
                 run.run_id, run.workflow_key, what, f" ({tool})" if tool else "",
                 f"; incident {incident}" if incident else "",
                 extra=fields(run_id=run.run_id, workflow=run.workflow_key,
                              operation_id=op_id, tool=tool, incident=incident))

    async def _strand(self) -> bool:
        """The run was about to end with operations still unsettled (dispatched without an
        outcome, or unknown). It must not end yet: those become unknown, go to the
        reconciliation queue, and the run waits for them (C5, C8). Returns False when nothing
        is unknown after all (only never-dispatched intents were left: now cancelled)."""
        run = self.run

        async def work(conn: Conn) -> tuple[list[dict[str, Any]] | None, list[Entry]]:
            settled = await ops_db.operation_strand(conn, run_id=run.run_id, token=run.token,
                                                    error=STRANDED_ERROR)
            stranded = [op for op in settled if op["state"] == "unknown"]
            unknown = await ops_db.operation_count_unknown(conn, run_id=run.run_id)
            return (stranded if unknown > 0 else None), strand_entries(settled)

        try:
            blocked = await self.session.write(work)
        except Stop:
            return True
        if blocked is None:
            return False
        if await self._flush_then(lambda conn: runs_db.run_block_for_reconciliation(
                conn, run_id=run.run_id, token=run.token,
                waiting_for="reconciliation of operations whose outcome is not recorded")):
            run.metrics.incr("run_parks")
            for op in blocked or [{"id": None, "tool_name": None}]:
                self._log_reconciliation(op["id"], op["tool_name"], None)
        return True

    # -- the end -----------------------------------------------------------------------------

    async def finish(self, task: asyncio.Task[Any], waits: Collection[Wait]) -> None:
        """The workflow's task is done: write what it came to."""
        exc: BaseException | None
        if task.cancelled():
            # A cancellation escaped the workflow (workflow code awaited a task of its own
            # that it cancelled): the workflow raised it, unless the executor is letting go
            # of the run, whose cancellation it then is.
            run = self.run
            exc = (Stop("lease_lost" if run.lost else "drain") if run.letting_go
                   else asyncio.CancelledError("the workflow's task was cancelled"))
        else:
            exc = task.exception()
        if isinstance(exc, BaseExceptionGroup):  # asyncio.TaskGroup in workflow code
            exc = engine_error_in(exc) or exc  # as it would end without the group
        if isinstance(exc, Stop) and exc.reason in ("lease_lost", "drain", "deadline"):
            await self._stop(exc)  # out of time: unknown operations stay listed for operators
            return
        if any(w.kind == "blocked" for w in waits):
            # Another branch is blocked on an operation whose outcome is unknown: the run
            # cannot end before that is known (it ends the same way after a replay).
            await self.park(waits)
            return
        if isinstance(exc, Stop):
            await self._stop(exc)
            return
        if self.run.diverged is not None:
            # A branch's command differed from the journal, whether or not the code waited
            # for that branch: never an outcome of the code that went on (C4).
            exc = self.run.diverged
        if exc is None:
            await self._succeed(task.result())
            return
        if isinstance(exc, ContinueAsNew):
            await self._continue(exc)
            return
        await self._fail_from(exc)

    async def _succeed(self, result: Any) -> None:
        run, session = self.run, self.session
        try:
            text = session.config.json_limits.text(result, "$.result")
        except InvalidRequest as exc:
            await self._fail("WORKFLOW_FAILED", "the workflow's result is not a JSON value "
                             "within the size cap; see the incident",
                             incident_detail=_detail(exc), cause=cause_of(exc),
                             log_cause=exc.code)
            return
        if (ended := code_ended(run.index, run.position)) is not None:
            await self._fail("NONDETERMINISM", str(ended))
            return
        if not session.buffered and not run.lost:
            try:
                await session.write_direct(lambda expected, receipt: steps_db.run_succeed_fast(
                    run_id=run.run_id, token=run.token, expected=expected, result=text,
                    v=SCHEMA_VERSION, receipt=receipt, run_text=run.run_text))
                run.metrics.incr("runs_succeeded")
                run.ended("succeeded")
                tracing.annotate("orchestrator.outcome", "succeeded")
                return
            except (steps_db.FastPathMiss, Stop):
                pass  # the general path below finds out why, and acts on it
        await self._terminal("succeeded", None, text, None,
                             entry(EventKind.RUN_COMPLETED, None, None, {"result": result}))

    async def _continue(self, to: ContinueAsNew) -> None:
        """``ctx.continue_as_new``: end the run ``CONTINUED_AS_NEW`` and queue the new run in
        the same transaction (``chains_db.run_continue``); while an operation is unsettled it
        waits for the reconciliation instead, as any end does (and continues on its replay)."""
        run = self.run
        if (ended := code_ended(run.index, run.position, "continued as new")) is not None:
            await self._fail("NONDETERMINISM", str(ended))
            return
        new_id = new_run_id()
        ev = entry(EventKind.RUN_CONTINUED, None, None,
                   {"run_id": str(new_id), "version": to.version})

        async def end(conn: Conn) -> None:
            await chains_db.run_continue(conn, run_id=run.run_id, token=run.token, new_id=new_id,
                                       version=to.version, input_text=to.input_text)

        if await self._terminal("succeeded", runs_db.CONTINUED, None, None, ev, end=end):
            log.debug("run %s (%s) continued as run %s", run.run_id, run.workflow_key, new_id)

    async def _fail_from(self, exc: BaseException) -> None:
        if isinstance(exc, DatabaseError | ConfigurationError):
            # Infrastructure (the database, or a grant it lacks), not the workflow: never an
            # outcome. Stop here; the lease lapses and another claim replays the run.
            self.run.lose_lease(f"{exc.code}: the run goes back to the queue")
            return
        if isinstance(exc, Nondeterminism):
            await self._fail("NONDETERMINISM", str(exc))
        elif isinstance(exc, RunUnreadable):
            await self._fail(exc.code, exc.message, incident_detail=_detail(exc))
        elif isinstance(exc, WorkflowError):
            await self._fail("WORKFLOW_FAILED", str(exc) or "the workflow failed")
        elif isinstance(exc, OrchestratorError):
            await self._fail_on(exc)
        else:
            await self._fail("WORKFLOW_FAILED",
                             "the workflow raised an exception; see the incident for details",
                             incident_detail=_detail(exc), log_cause=type(exc).__name__)

    async def _fail_on(self, exc: OrchestratorError) -> None:
        """Workflow code let an orchestrator error escape: the run fails ``WORKFLOW_FAILED``
        (the outcome codes stay as promised) and its error names that error as its ``cause``
        (controlled fields only). A failed call's incident keeps the call's story: its
        operations, their incidents (the tool's, the lookups') and its timeline."""
        cause, detail, operation = cause_of(exc), _detail(exc), None
        if isinstance(exc, ToolFailed) and exc.position is not None:
            run_id, position = self.run.run_id, exc.position

            async def story(conn: Conn) -> tuple[list[Entry], list[dict[str, Any]]]:
                entries = await journal_db.journal_read_position(conn, run_id, position)
                ops = sorted({e["payload"]["op"] for e in entries if "op" in e["payload"]})
                return entries, await incidents_of_operations(conn, run_id, ops)

            try:
                entries, incidents = await self.session.read(story)
            except Stop:
                return  # the database is gone and so is the lease: a later claim replays it
            cause, kept = tool_story(exc, entries, incidents)
            detail |= kept
            operation = kept["operation"]
        else:
            detail["cause"] = cause
        await self._fail("WORKFLOW_FAILED", headline(cause), incident_detail=detail,
                         cause=cause, operation_id=operation, log_cause=exc.code)

    async def _stop(self, stop: Stop) -> None:
        run = self.run
        if not await self.session.settle():
            return  # the lease is gone: write nothing more
        if stop.reason == "cancelled":
            await self._terminal("cancelled", "CANCELLED", None,
                                 error_json("CANCELLED", "the run was cancelled", None),
                                 entry(EventKind.RUN_CANCELLED, None, None, {}))
        elif stop.reason == "abandoned":
            await self._fail("OPERATION_ABANDONED", stop.detail)
        elif stop.reason == "deadline":
            run.metrics.incr("deadline_exhausted")
            await self._fail("DEADLINE_EXCEEDED", "the run's deadline passed")
        elif stop.reason == "drain":
            async with self.session.db.connection() as conn:
                await runs_db.run_release(conn, run_id=run.run_id, token=run.token)
        # lease_lost: someone else owns the run now; write nothing.

    async def _fail(self, code: str, message: str,
                    incident_detail: dict[str, Any] | None = None, *,
                    cause: dict[str, Any] | None = None,
                    operation_id: int | None = None, log_cause: str | None = None) -> None:
        """End the run ``failed`` with ``code`` (``cause``: the public cause, controlled
        fields only), and say so in one INFO line: its code, its incident and ``log_cause``
        (an exception's type name or an error's code), never the message's text beyond that
        (an exception's message stays in the incident)."""
        ref = new_incident_ref()
        error = error_json(code, message, ref, cause)
        payload: dict[str, Any] = {"code": code, "message": message, "incident": ref}
        if cause is not None:
            payload["cause"] = cause
        ev = entry(EventKind.RUN_FAILED, None, None, payload)
        run_id = self.run.run_id

        async def diagnostics(conn: Conn) -> None:
            # Every failure's reference leads somewhere: at least to its code and message.
            detail = incident_detail or {"message": message}
            await incident_record(conn, {
                "ref": ref, "code": code, "run_id": run_id, "operation_id": operation_id,
                "phase": "workflow", "cause": detail.get("type"),
                "upstream_status": None, "detail": json.dumps(detail)})

        if not await self._terminal("failed", code, None, error, ev, extra=diagnostics):
            return
        run = self.run
        log.info("run %s (%s) failed: %s (incident %s%s)", run_id, run.workflow_key, code, ref,
                 f"; cause {log_cause}" if log_cause else "",
                 extra=fields(run_id=run_id, workflow=run.workflow_key, code=code,
                              incident=ref, cause=log_cause))

    async def _terminal(self, status: str, code: str | None, result: str | None,
                        error: str | None, ev: Entry,
                        extra: Callable[[Conn], Awaitable[None]] | None = None,
                        end: Callable[[Conn], Awaitable[None]] | None = None) -> bool:
        """Write the run's end; False if it was not written (the lease is gone, or the run
        waits for the reconciliation of unsettled operations instead). ``end`` writes the
        run's row instead of ``run_finish`` (a continuation)."""
        run, session = self.run, self.session

        async def last(conn: Conn, events: list[Entry]) -> None:
            if extra is not None:
                await extra(conn)
            await ops_db.operation_enqueue_unlisted(conn, run_id=run.run_id)
            await journal_db.journal_append(conn, run_id=run.run_id, token=run.token,
                                         expected=session.revision, events=[*events, ev])
            if end is not None:
                await end(conn)
                return
            await runs_db.run_finish(conn, run_id=run.run_id, token=run.token, status=status,
                                     outcome_code=code, result=result, error=error)

        try:
            if not await session.last_write(last):
                return False
        except runs_db.UnsettledOperations:
            if await self._strand():
                return False
            # Only never-dispatched intents were left (now cancelled): end as intended.
            return await self._terminal(status, code, result, error, ev, extra, end)
        except (LeaseLost, DatabaseError):
            run.lose_lease("outcome rejected")
            return False
        if code == runs_db.CONTINUED:
            run.metrics.incr("runs_continued")
            run.ended("continued")
            tracing.annotate("orchestrator.outcome", "continued")
            return True
        run.metrics.incr(f"runs_{status}")
        run.ended(status)
        if status == "cancelled":
            run.metrics.incr("cancellations", stage="observed")
        tracing.annotate("orchestrator.outcome", status)
        if code is not None:
            tracing.annotate("orchestrator.code", code)
        if status == "failed":
            tracing.fail_current(code or "WORKFLOW_FAILED")
        return True


def _detail(exc: BaseException) -> dict[str, Any]:
    """What an incident keeps of an exception that failed a run (protected diagnostics)."""
    return {"type": type(exc).__name__, "message": storable(str(exc)),
            "traceback": storable("".join(traceback.format_exception(exc))[-20000:])}
