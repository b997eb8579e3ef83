"""The effect gateway: every tool call is an operation in the ledger (CONTRACT C5, C7).

One attempt::

    pending (intent; only with policy stages) ─► authorize ─► approve ─┐
    submitted committed (write-ahead, fenced, unless cancelled) ◄───────┘
        ─► tool called ─► committed (receipt recorded with the run's next write, before
                          anything that follows from it; or at once: receipts_ride=False)
                       └► failed (proved not applied) ─► retry after a durable backoff, or stop
                       └► unknown ─► reconciliation (or a re-send its effect class allows)

A replayed call returns what the journal recorded and never calls the tool. A call found
``submitted`` without an outcome (its worker died) is never sent again unless its effect class
allows: ``idempotent`` tools are re-sent with the same idempotency key and ``read`` tools as a
new attempt, within the retry budget; ``consequential`` tools go to reconciliation.

The parts: :class:`Call` (this module) runs attempts and records receipts;
:mod:`~orchestrator.engine.stages` runs the policy stages; :mod:`~orchestrator.engine.aftermath`
decides what follows a failed or uncertain attempt; :mod:`~orchestrator.engine.site` holds
what they share.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from datetime import datetime
from typing import Any, NoReturn

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Tracer

from orchestrator import canonical, faults
from orchestrator.context import ToolContext
from orchestrator.db import operations as ops_db
from orchestrator.db import steps as steps_db
from orchestrator.db.database import Conn
from orchestrator.engine.aftermath import Aftermath
from orchestrator.engine.control import Stop
from orchestrator.engine.site import LOST, Attempt, CallSite, _Done
from orchestrator.engine.stages import Stage, Stages, policy_stages
from orchestrator.errors import (
    InvalidRequest,
    OrchestratorError,
    cancelled_error,
)
from orchestrator.failures import ToolError, public_cause
from orchestrator.journal import SCHEMA_VERSION, Entry, EventKind, Nondeterminism
from orchestrator.matching import NEW, Outcome, match_call
from orchestrator.recovery import parse_retry_after, refused_hint
from orchestrator.tracing import key_digest, record_error


class Call(CallSite):
    """One ``ctx.call`` at one journal position: its attempts, until a receipt or a failure."""

    async def perform(self) -> Any:
        """The call's receipt: recorded (a replay), or from its attempts now."""
        verdict = match_call(self.run.index, self.position, self.tool.name, self.intent)
        if verdict is NEW:
            state = Attempt()
        elif verdict.outcome is Outcome.WAITS:
            try:
                state = await self.resume(verdict.recorded)
            except _Done as done:
                return done.value
        elif verdict.outcome is Outcome.WITHDRAWN:
            # Workflow code cancelled this call before it was sent: the same code cancels it
            # again at this point (see withdraw); until then the call does not return.
            await self.run.until_cancelled()
        else:
            return self.run.settle(verdict)  # its receipt, its ToolFailed, or nondeterminism
        while True:
            try:
                outcome = await self.attempt(state)
            except _Done as done:  # an earlier attempt proven applied meanwhile (Aftermath)
                return done.value
            if isinstance(outcome, _Done):
                return outcome.value
            state = outcome

    async def resume(self, recorded: Sequence[Entry]) -> Attempt:
        """Continue from what the journal says about this call: recorded with this intent,
        not settled (:func:`~orchestrator.matching.match_call` says so)."""
        last = recorded[-1]
        kind, payload = last["kind"], last["payload"]
        begun = self.run.index.last(self.position,
                                    (EventKind.CALL_PENDING, EventKind.CALL_SUBMITTED))
        assert begun is not None
        number, op_id = begun["payload"]["attempt"], begun["payload"]["op"]
        for event in recorded:
            if event["kind"] == EventKind.CALL_RETRYING and "resend" in event["payload"]:
                if event["payload"]["resend"] == "lost":
                    self.resent_lost += 1
                else:
                    self.resent_by_operator += 1
        if kind == EventKind.CALL_CANCELLED:
            if payload.get("why") == "ended":
                # The run's end left it unsent (a branch the workflow did not wait for): the
                # replay goes no further here either, and the run's end does not wait for it.
                await self.branches.idle(self.position)
            raise Stop("deadline" if payload.get("why") == "deadline" else "cancelled")
        if kind == EventKind.CALL_PENDING:
            return Attempt(number, begun["payload"]["key"], pending_op=op_id)
        if kind == EventKind.CALL_RETRYING:
            await self.wait_until(datetime.fromisoformat(payload["not_before"]), op_id, number)
            return Attempt(number + 1, payload.get("key"), resend="resend" in payload)
        if kind == EventKind.CALL_NOT_APPLIED:  # reconciled: re-send, retry or fail (C8)
            return await Aftermath(self).not_applied(op_id, number, lost=_lost(recorded, op_id),
                                                     then=payload.get("then"))
        if kind == EventKind.CALL_UNKNOWN:
            step = payload.get("next", "reconcile")
            if step == "reconcile":
                return await self.after_reconciliation(payload["op"], number,
                                                       lost=payload["reason"] == LOST)
            if "not_before" in payload:  # the repetition's backoff (Aftermath.uncertain)
                await self.wait_until(datetime.fromisoformat(payload["not_before"]), op_id,
                                      number)
            return Attempt(number + 1, begun["payload"]["key"] if step == "resend" else None)
        # call.submitted without an outcome: the worker that sent it is gone
        step = self.uncertain_step(number)
        await self.record_unknown(op_id, LOST, step)
        if step == "reconcile":
            await self.park_blocked(op_id)
        return Attempt(number + 1, begun["payload"]["key"] if step == "resend" else None)

    async def after_reconciliation(self, op_id: int, number: int, *, lost: bool) -> Attempt:
        """The journal says this call waits for reconciliation; the ledger says whether it is
        still waiting. A resolution that landed while no worker held the run (it was queued
        between a dead worker's lease and the next claim) is only in the ledger: take it from
        there, and record it in the journal now."""
        run_id, position = self.run.run_id, self.position
        rows = await self.session.read(
            lambda conn: ops_db.operation_for_position(conn, run_id, position))
        row = next((r for r in rows if r["id"] == op_id), None)
        state = row["state"] if row else "unknown"
        if state == "committed":
            assert row is not None

            async def work(conn: Conn) -> tuple[None, list[Entry]]:
                return None, [self.event(EventKind.CALL_COMPLETED, {
                    "result": row["receipt"], "op": op_id, "resolved": True})]

            await self.append(work)
            raise _Done(row["receipt"])
        if state == "not_applied":
            assert row is not None
            then = (row["error"] or {}).get("then") if isinstance(row["error"], dict) else None
            return await Aftermath(self).not_applied(op_id, number, lost=lost, then=then)
        if state == "abandoned":
            self.run.stop_abandoned(op_id)
        await self.park_blocked(op_id)

    # -- one attempt -------------------------------------------------------------------------

    span: Span | None = None  # the current attempt's ``call`` span, while tracing
    said: str | None = None  # what the current attempt came to, for its span

    async def attempt(self, state: Attempt) -> Attempt | _Done:
        """Run one attempt: its receipt (:class:`_Done`), or the attempt to run next."""
        stages = policy_stages(self.config, self.tool)
        op_id, key = await self._intent(state, pending=bool(stages))
        tracer = self.run.tracer
        if tracer is None:
            outcome = await self._send(state, op_id, key, stages)
        else:
            outcome = await self._send_traced(tracer, state, op_id, key, stages)
        if self.tool.holds_place:  # its call ended: a parked one may go now
            await self.free_turn()
        return outcome

    async def _send_traced(self, tracer: Tracer, state: Attempt, op_id: int, key: str,
                           stages: list[Stage]) -> Attempt | _Done:
        """:meth:`_send` in the attempt's ``call {tool}`` span, current while it runs: the
        tool's own spans (an instrumented HTTP client) nest under it (docs/tracing.md). The
        span starts once the operation exists, with every attribute known then in one go: a
        span's attributes are most of what it costs a busy worker."""
        tool = self.tool
        span = self.span = tracer.start_span(f"call {tool.name}", kind=SpanKind.CLIENT,
                                             attributes={
            "orchestrator.tool": tool.name,
            "orchestrator.effect_class": tool.effect,
            "orchestrator.attempt": state.number,
            "orchestrator.operation_id": op_id,
            "orchestrator.idempotency_key_digest": key_digest(key)})
        self.said = None
        token = otel_context.attach(trace.set_span_in_context(span))
        try:
            outcome = await self._send(state, op_id, key, stages)
            if isinstance(outcome, _Done):
                self.said = "committed"
            return outcome
        except Stop as stop:
            record_error(span, stop.reason.upper())
            self.said = self.said or "stopped"
            raise
        except OrchestratorError as exc:
            record_error(span, exc.code)
            raise
        except BaseException as exc:
            record_error(span, type(exc).__name__)
            raise
        finally:
            span.set_attribute("orchestrator.outcome", self.said or "unfinished")
            self.span = None
            otel_context.detach(token)
            span.end()

    async def _intent(self, state: Attempt, *, pending: bool) -> tuple[int, str]:
        """The attempt's operation and idempotency key: its intent written now (write-ahead;
        ``pending`` when policy stages come first), or the pending operation a parked attempt
        left."""
        run, tool = self.run, self.tool
        run.boundary()
        remaining = run.remaining()
        if remaining is not None and remaining * 1000 <= tool.policy.min_attempt_ms:
            run.stop_deadline()  # not even the minimum attempt fits: never dispatch
        key = state.key or self.key_for(state.number)
        op_id = state.pending_op
        if op_id is None:
            run.new_attempt()
            if self.config.back_offs:
                await self.before_dispatch()
            op_id, status = await self.begin(state.number, key, pending=pending)
            if (held := faults.reach("after_intent", tool.name)) is not None:
                await held
            await self.written(op_id, state.number, status, pending=pending)
        return op_id, key

    async def _send(self, state: Attempt, op_id: int, key: str,
                    stages: list[Stage]) -> Attempt | _Done:
        """The attempt's policy stages (if any), then its dispatch."""
        run, tool = self.run, self.tool
        if stages or state.pending_op is not None:
            await Stages(self).run(op_id, state.number, key, stages)
        if (held := faults.reach("after_submitted", tool.name)) is not None:
            await held
        run.metrics.incr("operations_dispatched", tool=tool.name, attempt_kind=state.kind)
        if state.number > 1:
            run.metrics.incr("operations_retried", tool=tool.name)
        return await self.dispatch(op_id, state.number, key)

    async def begin(self, number: int, key: str, *, pending: bool) -> tuple[int, str]:
        """Record the attempt's intent: ``submitted`` (write-ahead), or ``pending`` when policy
        stages come first. One fenced statement in the common case."""
        run, session = self.run, self.session
        row = {
            "run_id": run.run_id, "position": self.position, "attempt": number,
            "tool_name": self.tool.name, "tool_version": self.tool.version,
            "effect_class": self.tool.effect, "tenant": run.owner.tenant,
            "principal": run.owner.principal, "intent_digest": self.intent,
            "arguments": self.args_text, "idempotency_key": key,
            "worker_id": run.worker_id, "token": run.token,
        }

        if not pending and not session.buffered and not run.cancel_requested \
                and not self.tool.limited:
            try:
                with self.branches.active():
                    op_id: int = await session.write_direct(
                        lambda expected, receipt: steps_db.operation_begin_fast(
                            row, expected=expected, v=SCHEMA_VERSION, receipt=receipt,
                            run_text=run.run_text),
                        new_work=True, hold=True)
                    return op_id, "submitted"
            except steps_db.FastPathMiss:
                pass  # cancelled, lease lost or a conflict: the general path tells which

        rate = self.tool.rate
        limited = self.tool.holds_place  # admitted under its limit in this transaction

        async def work(conn: Conn) -> tuple[tuple[int, str], list[Entry]]:
            op_id, status = await ops_db.operation_begin(conn, row, pending=pending,
                                                         limited=limited)
            kind = EventKind.CALL_SUBMITTED if status == "submitted" else EventKind.CALL_PENDING
            events = [self.event(kind, self.submitted_payload(number, op_id, key))]
            if status == "cancelled":
                events.append(self.event(EventKind.CALL_CANCELLED,
                                         {"op": op_id, "why": "cancelled"}))
            elif status == "submitted" and rate is not None:
                await ops_db.tool_dispatched(conn, tool=self.tool.name, op_id=op_id)
            return (op_id, status), events

        try:
            if pending or not self.tool.limited:
                with self.branches.active():
                    result = await session.write(work, new_work=True, hold=True)
            else:  # admitted against the tool's limits in the same transaction
                result = await self.admitted_write(work, new_work=True)
        except ops_db.OperationIdentityReused as exc:
            raise Nondeterminism(str(exc)) from None
        assert result is not None
        return result

    async def dispatch(self, op_id: int, number: int, key: str) -> Attempt | _Done:
        """Call the tool: its receipt (:class:`_Done`), or the attempt to run next."""
        run, tool = self.run, self.tool
        tctx = ToolContext(idempotency_key=key, run_id=run.run_id, position=self.position,
                           attempt=number, operation_id=op_id, owner=run.owner,
                           deadline=run.deadline_at)
        timeout = (tool.timeout or self.config.tool_timeout).total_seconds()
        await self.lease_for_dispatch(op_id)  # nothing awaited after it before the call
        if run.cancel_requested:  # immediately before dispatch (C7): the tool is not called
            await self.cancel_unsent(op_id)
        remaining = run.remaining()
        if remaining is not None:
            if remaining * 1000 <= tool.policy.min_attempt_ms:  # nor with no time left for it
                await self.cancel_unsent(op_id, why="deadline")
            timeout = min(timeout, remaining)
        began = time.monotonic()
        try:
            verdict = await run.race_cancellation(tool.fn(tctx, **self.arguments), timeout,
                                                  tctx.cancelled)
        except asyncio.CancelledError:
            run.metrics.observe("tool_call_duration_seconds", time.monotonic() - began,
                                tool.name, "cancelled")
            if run.letting_go:
                raise  # the executor is parking, dropping or draining the run: the journal decides
            # Workflow code cancelled the call (a timeout around ctx.call): the effect may have
            # happened. Record that, and block the run on it instead of letting it go on.
            self.said = "unknown"
            await asyncio.shield(self.record_unknown(op_id, "TOOL_OUTCOME_UNCERTAIN",
                                                     "reconcile"))
            await self.park_blocked(op_id)
        run.metrics.observe("tool_call_duration_seconds", time.monotonic() - began, tool.name,
                            "cancelled" if verdict.cancelled else "timed_out"
                            if verdict.timed_out else "raised" if verdict.error is not None
                            else "returned")
        if verdict.cancelled:
            run.metrics.incr("cancellations", stage="provider_aborted")
        if verdict.cancelled or verdict.timed_out:
            self.said = "unknown"
            what = "cancelled after dispatch" if verdict.cancelled else "timed out"
            ref = await self.incident(op_id, "dispatch", TimeoutError(f"the tool call {what}"))
            return await Aftermath(self).uncertain(op_id, number, key, "TOOL_OUTCOME_UNCERTAIN",
                                                   ref)
        if verdict.error is not None:
            return await self.failed(op_id, number, key, verdict.error)
        if (held := faults.reach("after_tool_return", tool.name)) is not None:
            await held
        receipt = verdict.value
        try:
            receipt_text = self.config.json_limits.text(receipt, "$.receipt")
        except InvalidRequest as exc:
            self.said = "unknown"
            ref = await self.incident(op_id, "receipt", exc)
            return await Aftermath(self).uncertain(op_id, number, key, "INVALID_RECEIPT", ref)
        receipt = canonical.as_stored(receipt)  # what a replay will read back (C4)
        if await self.commit(op_id, key, receipt, receipt_text) and (
                held := faults.reach("after_receipt", tool.name)) is not None:
            await held
        return _Done(receipt)

    async def cancel_unsent(self, op_id: int, why: str = "cancelled") -> NoReturn:
        """The run was cancelled (``why``: or ran out of time) after the attempt's
        ``submitted`` landed, before its tool was called; it will not be. Nothing was applied:
        ``submitted → failed``, the journal says the call was cancelled (a replay stops there
        too), and the run stops cancelled (or out of time)."""
        self.said = "cancelled"
        error = cancelled_error(why)
        token, run_id = self.run.token, self.run.run_id

        async def work(conn: Conn) -> tuple[None, list[Entry]]:
            await ops_db.operation_fail(conn, run_id=run_id, op_id=op_id, token=token,
                                        error=error)
            return None, [self.event(EventKind.CALL_CANCELLED, {"op": op_id, "why": why})]

        await self.append(work)
        if why == "deadline":
            self.run.stop_deadline()
        self.run.stop_cancelled()

    async def failed(self, op_id: int, number: int, key: str, exc: BaseException) -> Attempt:
        """The tool raised: a :class:`ToolError` that proves nothing was applied is retried
        under the policy or fails the call; anything else leaves the outcome unknown."""
        ref = await self.incident(op_id, "tool", exc)
        aftermath = Aftermath(self)
        self.said = "unknown"
        if isinstance(exc, ToolError):
            if exc.status in (429, 503) and exc.retry_after is not None:
                hint, _ = parse_retry_after(exc.retry_after, self.run.now())
                if hint:  # the provider asked every caller to wait: one pause for the tool
                    await self.back_off_shared(hint / 1000)
            cls = exc.classification()
            if cls.effects != "unknown":
                self.said = "failed"
                if self.span is not None:
                    self.span.set_attribute("orchestrator.cause", public_cause(cls.cause)
                                            or "tool_defined")
                upstream, invalid = parse_retry_after(exc.retry_after, self.run.now())
                decision = aftermath.decide(cls, number, (upstream, invalid))
                # The journal (which owners read) keeps only a cause word the orchestrator
                # knows; one the tool chose is tool text and stays in the incident (C10).
                hinted = upstream is not None and decision.delay_ms == upstream
                refused = (refused_hint(exc.retry_after, upstream, self.tool.policy.max_delay_ms)
                           if decision.detail == "upstream" and exc.retry_after is not None
                           else None)
                return await aftermath.definitive(
                    op_id, number, decision, public_cause(cls.cause) or "tool_defined", ref,
                    phase="tool", delay_class="retry_after" if hinted else "backoff",
                    refused=refused)
        return await aftermath.uncertain(op_id, number, key, "TOOL_OUTCOME_UNCERTAIN", ref)

    async def commit(self, op_id: int, key: str, receipt: Any, receipt_text: str) -> bool:
        """Record the receipt. The common case (a first attempt, nothing buffered) hands it to
        the session, which writes it with the run's next write (``receipts_ride``) or at once,
        and reaches the ``after_receipt`` fault point itself: False. Otherwise it is written
        here, with the re-sent attempts it settles: True."""
        run, session = self.run, self.session
        digest = canonical.text_digest(receipt_text)
        resent = key != self.key_for(1) or self.tool.effect == "idempotent"
        recorded = steps_db.Receipt(op_id=op_id, position=self.position, name=self.tool.name,
                                  text=receipt_text, digest=digest)
        if not resent and not session.buffered:
            session.rider.defer(recorded, receipt)
            # Written now, alone (or kept as evidence): when asked, and for a tool with a
            # concurrency limit, whose call counts as in flight until its receipt is written.
            if not self.config.receipts_ride or self.tool.holds_place:
                with self.branches.active():
                    settled = await session.settle(hold=True)
                if not settled:
                    session.take_held_cancel()
                    raise Stop("lease_lost")
                self.completed()
            return False
        commit = session.rider.commit_work(recorded, receipt)
        position = self.position

        async def work(conn: Conn) -> tuple[None, list[Entry]]:
            outcome = await commit(conn)
            if resent:
                await ops_db.operation_settle_resent(
                    conn, run_id=run.run_id, position=position, key=key,
                    receipt=receipt_text, receipt_digest=digest)
            return outcome

        try:
            with self.branches.active():
                await session.write(work, hold=True, finish=True)
        except Stop:
            await session.rider.keep_late(op_id, receipt, digest)
            raise
        self.completed()
        return True

    def completed(self) -> None:
        """After the receipt's own write, made with ``hold``. Workflow code that cancelled the
        call meanwhile (a timeout around ``ctx.call``, a task group aborting this branch) gets
        the receipt all the same and the cancellation request is dropped: the call completed
        and is recorded, and a replay returns that receipt at once, so a workflow that went the
        cancelled way the first time would take another path on replay. When the executor
        lets go of the run (``RunState.letting_go``) the cancellation is its own and goes on
        (the receipt is recorded all the same)."""
        if not self.session.take_held_cancel():
            return
        if self.run.letting_go:
            raise asyncio.CancelledError
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()


def _lost(recorded: Sequence[Entry], op_id: int) -> bool:
    """Whether the engine lost attempt ``op_id`` (its unknown outcome is ``WORKER_LOST``)."""
    return any(e["kind"] == EventKind.CALL_UNKNOWN and e["payload"]["op"] == op_id
               and e["payload"]["reason"] == LOST for e in recorded)
