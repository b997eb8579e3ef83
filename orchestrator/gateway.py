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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import traceback
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any, NoReturn

from orchestrator import canonical, faults
from orchestrator.context import PolicyContext, ToolContext
from orchestrator.db import operations as ops_db
from orchestrator.db.database import Conn
from orchestrator.db.events import incident_record
from orchestrator.errors import InvalidRequest, ToolError, ToolFailed, new_incident_ref
from orchestrator.recovery import Classification, Decision, decide, parse_retry_after
from orchestrator.registry import Tool
from orchestrator.replay import SCHEMA_VERSION, Nondeterminism
from orchestrator.text import storable

log = logging.getLogger("orchestrator.worker")

if TYPE_CHECKING:
    from orchestrator.executor import Event, RunExecutor


def next_step_after_uncertain(effect: str, attempts: int, max_attempts: int) -> str:
    """What may follow an attempt whose outcome is unknown (CONTRACT C5). Pure.

    Returns ``"resend"`` (same idempotency key), ``"new_attempt"`` or ``"reconcile"``.
    """
    if faults.UNSAFE_REDISPATCH and effect == "consequential":
        return "new_attempt"  # the guard disabled on purpose by the chaos suite's self-test
    if attempts >= max_attempts or effect == "consequential":
        return "reconcile"
    return "resend" if effect == "idempotent" else "new_attempt"


@dataclass
class Attempt:
    """Where a call stands: the attempt to run next and what it reuses."""

    number: int = 1
    key: str | None = None  # an idempotent re-send reuses the uncertain attempt's key
    pending_op: int | None = None  # an intent recorded before a crash, stages not yet passed


class Call:
    """One ``ctx.call`` at one journal position."""

    def __init__(self, ex: RunExecutor, position: int, tool: Tool,
                 arguments: dict[str, Any]) -> None:
        self.ex = ex
        self.position = position
        self.tool = tool
        self.arguments = arguments
        self.args_text = ex.app.json_limits.text(arguments, "$.arguments")
        self.intent = canonical.intent_digest_text(tool.name, tool.version, ex.owner_text,
                                                   self.args_text)
        self.following = Attempt()  # set by each failed attempt: what to run next
        try:  # a call that cannot bind is a bug in the workflow: refuse it before any write
            tool.check_arguments(arguments)
        except TypeError as exc:
            raise InvalidRequest(f"tool {tool.name} does not take these arguments: {exc}",
                                 path="$.arguments") from None

    def event(self, kind: str, payload: dict[str, Any]) -> Event:
        from orchestrator.executor import event

        return event(kind, self.position, self.tool.name, payload)

    def key_for(self, attempt: int) -> str:
        return f"{self.ex.run_text}:{self.position}:{attempt}"

    # -- the whole call ----------------------------------------------------------------------

    async def run(self) -> Any:
        recorded = self.ex.index.expect(self.position, "call", self.tool.name)
        state = await self.resume(recorded) if recorded else Attempt()
        while True:
            outcome = await self.attempt(state)
            if outcome is not None:
                return outcome.value
            state = self.following

    async def resume(self, recorded: list[Event]) -> Attempt:
        """Continue from what the journal says about this call."""
        if recorded[0]["payload"]["intent"] != self.intent:
            raise Nondeterminism(
                f"position {self.position}: tool {self.tool.name!r} was recorded with other "
                "arguments (intent digest differs)")
        last = recorded[-1]
        kind, payload = last["kind"], last["payload"]
        begun = self.ex.index.last(self.position, ("call.pending", "call.submitted"))
        assert begun is not None
        number, op_id = begun["payload"]["attempt"], begun["payload"]["op"]
        if kind == "call.completed":
            raise _Done(payload["result"])
        if kind == "call.failed" and payload.get("reason") == "withdrawn":
            # Workflow code cancelled this call before it was sent: the same code cancels it
            # again at this point (see withdraw); until then the call does not return.
            await self.ex.until_cancelled()
        if kind in ("call.failed", "call.denied"):
            raise ToolFailed(f"tool {self.tool.name} failed", tool=self.tool.name,
                             cause=payload.get("cause"), reason=payload.get("reason"),
                             incident=payload.get("incident"))
        if kind == "call.cancelled":
            from orchestrator.executor import Stop

            raise Stop("deadline" if payload.get("why") == "deadline" else "cancelled")
        if kind == "call.pending":
            return Attempt(number, begun["payload"]["key"], pending_op=op_id)
        if kind == "call.retrying":
            await self.wait_until(datetime.fromisoformat(payload["not_before"]))
            return Attempt(number + 1, payload.get("key"))
        if kind == "call.not_applied":  # reconciled: continue under the retry policy
            self.ex.boundary()  # a cancellation that waited for the reconciliation wins now
            decision = self.decide(Classification("not_applied", "none", True), number, None)
            await self.after_definitive(op_id, number, decision, "not_applied", None,
                                        record_failure=False)
            return self.following
        if kind == "call.unknown":
            step = payload.get("next", "reconcile")
            if step == "reconcile":
                return await self.after_reconciliation(payload["op"], number)
            return Attempt(number + 1, begun["payload"]["key"] if step == "resend" else None)
        # call.submitted without an outcome: the worker that sent it is gone
        step = self.uncertain_step(number)
        await self.record_unknown(op_id, "WORKER_LOST", step)
        if step == "reconcile":
            await self.park_blocked(op_id)
        return Attempt(number + 1, begun["payload"]["key"] if step == "resend" else None)

    async def after_reconciliation(self, op_id: int, number: int) -> Attempt:
        """The journal says this call waits for reconciliation; the ledger says whether it is
        still waiting. A resolution that landed while no worker held the run (it was queued
        between a dead worker's lease and the next claim) is only in the ledger: take it from
        there, and record it in the journal now."""
        rows = await self.ex.read(
            lambda conn: ops_db.operation_for_position(conn, self.ex.run_id, self.position))
        row = next((r for r in rows if r["id"] == op_id), None)
        state = row["state"] if row else "unknown"
        if state == "committed":
            assert row is not None

            async def work(conn: Conn) -> tuple[None, list[Event]]:
                return None, [self.event("call.completed", {"result": row["receipt"],
                                                            "op": op_id, "resolved": True})]

            with self.ex.active():
                await self.ex.write(work)
            raise _Done(row["receipt"])
        if state == "not_applied":
            self.ex.boundary()
            decision = self.decide(Classification("not_applied", "none", True), number, None)
            await self.after_definitive(op_id, number, decision, "not_applied", None,
                                        record_failure=False)
            return self.following
        if state == "abandoned":
            self.ex.stop_abandoned(op_id)
        await self.park_blocked(op_id)
        raise AssertionError("unreachable")  # pragma: no cover - park never returns

    # -- one attempt -------------------------------------------------------------------------

    async def attempt(self, state: Attempt) -> _Done | None:
        """Run one attempt; return its receipt, or None with ``self.following`` set."""
        ex, tool = self.ex, self.tool
        ex.boundary()
        remaining = ex.remaining()
        if remaining is not None and remaining * 1000 <= tool.policy.min_attempt_ms:
            ex.stop_deadline()  # not even the minimum attempt fits: never dispatch
        key = state.key or self.key_for(state.number)
        op_id = state.pending_op
        stages = self.stages()
        if op_id is None:
            op_id, status = await self.begin(state.number, key, pending=bool(stages))
            if (held := faults.reach("after_intent", tool.name)) is not None:
                await held
            await self.written(op_id, state.number, status, pending=bool(stages))
        if stages or state.pending_op is not None:
            await self.run_stages(op_id, state.number, key, stages)
        if (held := faults.reach("after_submitted", tool.name)) is not None:
            await held
        ex.worker.metrics.incr("operations_dispatched")
        if state.number > 1:
            ex.worker.metrics.incr("operations_retried")
        return await self.dispatch(op_id, state.number, key)

    async def begin(self, number: int, key: str, *, pending: bool) -> tuple[int, str]:
        ex = self.ex
        row = {
            "run_id": ex.run_id, "position": self.position, "attempt": number,
            "tool_name": self.tool.name, "tool_version": self.tool.version,
            "effect_class": self.tool.effect, "tenant": ex.owner.tenant,
            "principal": ex.owner.principal, "intent_digest": self.intent,
            "arguments": self.args_text, "idempotency_key": key,
            "worker_id": ex.worker.worker_id, "token": ex.token,
        }

        if not pending and not ex.has_buffer and not ex.cancel_requested:
            try:
                with ex.active():
                    op_id: int = await ex.write_direct(
                        lambda expected, receipt: ops_db.operation_begin_fast(
                            row, expected=expected, v=SCHEMA_VERSION, receipt=receipt),
                        new_work=True, hold=True)
                    return op_id, "submitted"
            except ops_db.FastPathMiss:
                pass  # cancelled, lease lost or a conflict: the general path tells which

        async def work(conn: Conn) -> tuple[tuple[int, str], list[Event]]:
            op_id, status = await ops_db.operation_begin(conn, row, pending=pending)
            payload = {"tool_version": self.tool.version, "intent": self.intent,
                       "attempt": number, "op": op_id, "key": key, "effect": self.tool.effect}
            kind = "call.submitted" if status == "submitted" else "call.pending"
            events = [self.event(kind, payload)]
            if status == "cancelled":
                events.append(self.event("call.cancelled", {"op": op_id}))
            return (op_id, status), events

        try:
            with ex.active():
                result = await ex.write(work, new_work=True, hold=True)
        except ops_db.OperationIdentityReused as exc:
            raise Nondeterminism(str(exc)) from None
        assert result is not None
        return result

    async def written(self, op_id: int, number: int, status: str | None, *,
                      pending: bool) -> None:
        """After the write of a call's intent (``pending`` or ``submitted``), made with
        ``hold``: a cancelled run stops here (the operation is ``cancelled``), and a call that
        workflow code cancelled while the write was in flight is withdrawn."""
        withdrawn = self.ex.take_held_cancel()
        if status == "cancelled":
            self.ex.stop_cancelled()
        if withdrawn:
            await self.withdraw(op_id, number, pending=pending)

    async def withdraw(self, op_id: int, number: int, *, pending: bool) -> NoReturn:
        """The calling task was cancelled after the call's intent was written (while that write
        was in flight or a policy stage ran), before the tool was called; the tool will not be.

        By workflow code (a timeout around ``ctx.call``, a race it lost): the call is withdrawn.
        The operation is settled as never dispatched (``submitted → failed``, or ``pending →
        cancelled``: nothing was applied), the journal records the withdrawal, and the
        cancellation reaches the workflow. A replay finds the withdrawal and waits, at that
        point, for the same cancellation (:meth:`resume`).

        By the executor letting go of the run (parking, a lost lease, a draining worker, whose
        stop can cancel a task group's other branches): nothing more is recorded, the journal
        decides on the next claim as for a worker that died (a withdrawal there would make the
        replay wait for a cancellation that workflow code never makes)."""
        if self.ex.letting_go:
            raise asyncio.CancelledError
        error = json.dumps({"code": "CALL_WITHDRAWN", "cause": "cancelled",
                            "message": "workflow code cancelled the call before it was sent"})

        async def work(conn: Conn) -> tuple[None, list[Event]]:
            if pending:
                await ops_db.operation_cancel(conn, op_id=op_id, token=self.ex.token,
                                              error=error)
            else:
                await ops_db.operation_fail(conn, op_id=op_id, token=self.ex.token, error=error)
            return None, [self.event("call.failed", {"op": op_id, "attempt": number,
                                                     "cause": "cancelled",
                                                     "reason": "withdrawn", "incident": None})]

        with self.ex.active():
            await self.ex.write(work)
        raise asyncio.CancelledError

    def stages(self) -> list[tuple[str, Any, float]]:
        app, tool = self.ex.app, self.tool
        found = []
        for name, app_hook, tool_hook, budget in (
                ("authorize", app.authorize, tool.authorize_fn, tool.authorize_timeout),
                ("approve", app.approve, tool.approve_fn, tool.approve_timeout)):
            for hook in (app_hook, tool_hook):
                if hook is not None:
                    found.append((name, hook, budget))
        return found

    async def run_stages(self, op_id: int, number: int, key: str,
                         stages: list[tuple[str, Any, float]]) -> None:
        """Run each policy stage under its budget, checking cancellation around each; then
        move the intent to ``submitted`` (or ``cancelled``) in one guarded statement."""
        ex = self.ex
        pctx = PolicyContext(tool=self.tool.name, arguments=self.arguments, owner=ex.owner,
                             run_id=ex.run_id, position=self.position, attempt=number,
                             idempotency_key=key)
        for name, hook, budget in stages:
            await self.admissible(op_id)
            remaining = ex.remaining()
            try:
                verdict = await ex.race_cancellation(
                    hook(pctx), budget if remaining is None else min(budget, remaining),
                    pctx.cancelled)
            except asyncio.CancelledError:  # while the hook ran: the intent is still pending
                await self.withdraw(op_id, number, pending=True)
            if verdict.cancelled:
                await self.cancel_pending(op_id)
            if verdict.timed_out or verdict.error is not None or verdict.value is False:
                await self.admissible(op_id)  # out of run time is a deadline, not a denial
                cause = "policy_timeout" if verdict.timed_out else "denied"
                ref = await self.incident(op_id, name, verdict.error) if verdict.error else None
                await self.deny(op_id, name, cause, ref)
        await self.admissible(op_id)

        async def submit(conn: Conn) -> tuple[str, list[Event]]:
            status = await ops_db.operation_mark_submitted(conn, op_id=op_id, token=ex.token)
            if status == "cancelled":
                return status, [self.event("call.cancelled", {"op": op_id})]
            return status, [self.event("call.submitted", {
                "tool_version": self.tool.version, "intent": self.intent, "attempt": number,
                "op": op_id, "key": key, "effect": self.tool.effect})]

        with ex.active():
            status = await ex.write(submit, hold=True)
        await self.written(op_id, number, status, pending=False)

    async def admissible(self, op_id: int) -> None:
        """Before and after each stage and just before dispatch: a cancelled run, or one whose
        deadline cannot hold the minimum attempt time, never dispatches (C7)."""
        if self.ex.cancel_requested:
            await self.cancel_pending(op_id)
        remaining = self.ex.remaining()
        if remaining is not None and remaining * 1000 <= self.tool.policy.min_attempt_ms:
            await self.cancel_pending(op_id, stop="deadline")

    async def cancel_pending(self, op_id: int, stop: str = "cancelled") -> None:
        """pending → cancelled (never dispatched); the run stops (cancelled or out of time)."""
        async def work(conn: Conn) -> tuple[None, list[Event]]:
            await ops_db.operation_cancel(conn, op_id=op_id, token=self.ex.token)
            return None, [self.event("call.cancelled", {"op": op_id, "why": stop})]

        with self.ex.active():
            await self.ex.write(work)
        if stop == "deadline":
            self.ex.stop_deadline()
        self.ex.stop_cancelled()

    async def deny(self, op_id: int, stage: str, cause: str, ref: str | None) -> None:
        error = json.dumps({"code": "TOOL_DENIED", "stage": stage, "cause": cause,
                            "incident": ref})

        async def work(conn: Conn) -> tuple[None, list[Event]]:
            await ops_db.operation_cancel(conn, op_id=op_id, token=self.ex.token, error=error)
            return None, [self.event("call.denied", {"op": op_id, "stage": stage,
                                                     "cause": cause, "incident": ref})]

        with self.ex.active():
            await self.ex.write(work)
        raise ToolFailed(f"tool {self.tool.name} was not allowed ({stage})", tool=self.tool.name,
                         code="TOOL_DENIED", cause=cause, reason="cause", incident=ref)

    async def dispatch(self, op_id: int, number: int, key: str) -> _Done | None:
        ex, tool = self.ex, self.tool
        tctx = ToolContext(idempotency_key=key, run_id=ex.run_id, position=self.position,
                           attempt=number, operation_id=op_id, owner=ex.owner,
                           deadline=ex.deadline_at)
        timeout = (tool.timeout or ex.app.tool_timeout).total_seconds()
        remaining = ex.remaining()
        if remaining is not None:
            timeout = min(timeout, remaining)
        try:
            verdict = await ex.race_cancellation(tool.fn(tctx, **self.arguments), timeout,
                                                 tctx.cancelled)
        except asyncio.CancelledError:
            if ex.letting_go:
                raise  # the executor is parking, dropping or draining the run: the journal decides
            # Workflow code cancelled the call (a timeout around ctx.call): the effect may have
            # happened. Record that, and block the run on it instead of letting it go on.
            await asyncio.shield(self.record_unknown(op_id, "TOOL_OUTCOME_UNCERTAIN",
                                                     "reconcile"))
            await self.park_blocked(op_id)
            raise
        if verdict.cancelled or verdict.timed_out:
            what = "cancelled after dispatch" if verdict.cancelled else "timed out"
            ref = await self.incident(op_id, "dispatch", TimeoutError(f"the tool call {what}"))
            await self.uncertain(op_id, number, key, "TOOL_OUTCOME_UNCERTAIN", ref)
            return None
        if verdict.error is not None:
            ref = await self.incident(op_id, "tool", verdict.error)
            exc = verdict.error
            if isinstance(exc, ToolError):
                cls: Classification = exc.classification()
                if cls.effects != "unknown":
                    upstream, invalid = parse_retry_after(exc.retry_after, ex.now())
                    decision = self.decide(cls, number, (upstream, invalid))
                    await self.after_definitive(op_id, number, decision, cls.cause, ref)
                    return None
            await self.uncertain(op_id, number, key, "TOOL_OUTCOME_UNCERTAIN", ref)
            return None
        if (held := faults.reach("after_tool_return", tool.name)) is not None:
            await held
        receipt = verdict.value
        try:
            receipt_text = ex.app.json_limits.text(receipt, "$.receipt")
        except InvalidRequest as exc:
            ref = await self.incident(op_id, "receipt", exc)
            await self.uncertain(op_id, number, key, "INVALID_RECEIPT", ref)
            return None
        receipt = canonical.as_stored(receipt)  # what a replay will read back (C4)
        if await self.commit(op_id, key, receipt, receipt_text):
            if (held := faults.reach("after_receipt", tool.name)) is not None:
                await held
        return _Done(receipt)

    async def commit(self, op_id: int, key: str, receipt: Any, receipt_text: str) -> bool:
        """Record the receipt. The common case (a first attempt, nothing buffered) hands it to
        the executor, which writes it with the run's next write (``receipts_ride``) or at once,
        and reaches the ``after_receipt`` fault point itself: False. Otherwise it is written
        here, with the re-sent attempts it settles: True."""
        from orchestrator.executor import Stop

        ex = self.ex
        digest = canonical.text_digest(receipt_text)
        resent = key != self.key_for(1) or self.tool.effect == "idempotent"
        recorded = ops_db.Receipt(op_id=op_id, position=self.position, name=self.tool.name,
                                  text=receipt_text, digest=digest)
        if not resent and not ex.has_buffer:
            ex.defer_receipt(recorded, receipt)
            if not ex.app.receipts_ride:  # written now, alone (or kept as evidence)
                with ex.active():
                    settled = await ex.settle(hold=True)
                if not settled:
                    ex.take_held_cancel()
                    raise Stop("lease_lost")
                self.completed()
            return False
        commit = ex.commit_work(recorded, receipt)

        async def work(conn: Conn) -> tuple[None, list[Event]]:
            outcome = await commit(conn)
            if resent:
                await ops_db.operation_settle_resent(
                    conn, run_id=ex.run_id, position=self.position, key=key,
                    receipt=receipt_text, receipt_digest=digest)
            return outcome

        try:
            with ex.active():
                await ex.write(work, hold=True, finish=True)
        except Stop:
            await ex.keep_late_receipt(op_id, receipt, digest)
            raise
        self.completed()
        return True

    def completed(self) -> None:
        """After the receipt's own write, made with ``hold``. Workflow code that cancelled the
        call meanwhile (a timeout around ``ctx.call``, a task group aborting this branch) gets
        the receipt all the same and the cancellation request is dropped: the call completed
        and is recorded, and a replay returns that receipt at once, so a workflow that went the
        cancelled way the first time would take another path on replay. When the executor
        lets go of the run (:attr:`RunExecutor.letting_go`) the cancellation is its own and
        goes on (the receipt is recorded all the same)."""
        if not self.ex.take_held_cancel():
            return
        if self.ex.letting_go:
            raise asyncio.CancelledError
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()

    # -- after a failure ---------------------------------------------------------------------

    def decide(self, cls: Classification, number: int,
               upstream: tuple[int | None, bool] | None) -> Decision:
        remaining = self.ex.remaining()
        wait, invalid = upstream if upstream is not None else (None, False)
        return decide(transient=cls.transient, effects=cls.effects, visible=False,
                      attempts=number, policy=self.tool.policy, jitter=random.random(),
                      remaining_ms=None if remaining is None else int(remaining * 1000),
                      upstream_wait_ms=wait, upstream_invalid=invalid)

    async def after_definitive(self, op_id: int, number: int, decision: Decision, cause: str,
                               ref: str | None, *, record_failure: bool = True) -> None:
        """This attempt applied nothing: back off durably and try again, or stop with
        ToolFailed. But if an earlier attempt at this position is still unknown (it was
        re-sent with the same key), this answer says nothing about that one: the next attempt
        keeps its key, and instead of failing the call goes to reconciliation."""
        ex = self.ex
        earlier = await self.unknown_attempts(op_id)
        key = earlier[0]["idempotency_key"] if earlier else None
        if decision.action == "retry":
            not_before = ex.now() + timedelta(milliseconds=decision.delay_ms)
            await self.fail(op_id, "call.retrying", {
                "op": op_id, "attempt": number, "cause": cause, "incident": ref,
                "delay_ms": decision.delay_ms, "not_before": not_before.isoformat(),
                "key": key}, record_failure)
            await self.wait_until(not_before)
            self.following = Attempt(number + 1, key)
            return
        if earlier:
            await self.reconcile_earlier(op_id, earlier[0]["id"], cause, ref, record_failure)
        reason = decision.reason or "cause"
        await self.fail(op_id, "call.failed", {"op": op_id, "attempt": number, "cause": cause,
                                               "reason": reason, "incident": ref},
                        record_failure)
        if decision.detail == "deadline":
            ex.stop_deadline()  # the next attempt cannot fit before the run's deadline
        raise ToolFailed(f"tool {self.tool.name} failed", tool=self.tool.name, cause=cause,
                         reason=reason, incident=ref)

    async def unknown_attempts(self, current: int) -> list[dict[str, Any]]:
        """Earlier attempts at this position whose outcome is still unknown (re-sent ones)."""
        rows = await self.ex.read(
            lambda conn: ops_db.operation_for_position(conn, self.ex.run_id, self.position))
        return [r for r in rows if r["state"] == "unknown" and r["id"] != current]

    async def reconcile_earlier(self, op_id: int, earlier: int, cause: str, ref: str | None,
                                record_failure: bool) -> None:
        """Stop retrying, but do not fail: the earlier, re-sent attempt may have applied."""
        error = json.dumps({"code": "TOOL_FAILED", "cause": cause, "incident": ref})

        async def work(conn: Conn) -> tuple[None, list[Event]]:
            if record_failure:
                await ops_db.operation_fail(conn, op_id=op_id, token=self.ex.token, error=error)
            await ops_db.operation_enqueue(conn, op_id=earlier, reason="RESEND_NOT_APPLIED")
            return None, [self.event("call.unknown", {"op": earlier,
                                                      "reason": "RESEND_NOT_APPLIED",
                                                      "next": "reconcile"})]

        with self.ex.active():
            await self.ex.write(work)
        await self.park_blocked(earlier)

    async def fail(self, op_id: int, kind: str, payload: dict[str, Any],
                   record_failure: bool) -> None:
        error = json.dumps({"code": "TOOL_FAILED", "cause": payload["cause"],
                            "incident": payload["incident"]})

        async def work(conn: Conn) -> tuple[None, list[Event]]:
            if record_failure:
                await ops_db.operation_fail(conn, op_id=op_id, token=self.ex.token, error=error)
            return None, [self.event(kind, payload)]

        with self.ex.active():
            await self.ex.write(work)

    async def wait_until(self, when: datetime) -> None:
        """A durable wait before the next attempt: the run is parked, not a process asleep."""
        from orchestrator.executor import Wait

        if when > self.ex.now():
            await self.ex.park(Wait("timer", self.position, wake_at=when))

    def uncertain_step(self, number: int) -> str:
        ex = self.ex
        step = next_step_after_uncertain(self.tool.effect, number, self.tool.max_attempts)
        if step != "reconcile" and (ex.cancel_requested or ex.remaining() == 0):
            step = "new_attempt" if self.tool.effect == "read" else "reconcile"
        return step

    async def uncertain(self, op_id: int, number: int, key: str, reason: str,
                        incident: str | None = None) -> None:
        """The effect may or may not have happened: never guess (C5, C8). ``incident`` is the
        reference of the diagnostics kept for it, if any (its event names it for operators)."""
        ex = self.ex
        step = self.uncertain_step(number)
        await self.record_unknown(op_id, reason, step, incident)
        if ex.remaining() == 0:
            ex.stop_deadline()  # the effect stays unknown and listed; the run is out of time
        if ex.cancel_requested and step != "reconcile":
            ex.stop_cancelled()  # an uncertain read settles as not applied; nothing is unknown
        if step == "reconcile":
            await self.park_blocked(op_id)
        self.following = Attempt(number + 1, key if step == "resend" else None)

    async def record_unknown(self, op_id: int, reason: str, step: str,
                             incident: str | None = None) -> None:
        payload: dict[str, Any] = {"op": op_id, "reason": reason, "next": step}
        if incident is not None:
            payload["incident"] = incident

        async def work(conn: Conn) -> tuple[None, list[Event]]:
            await ops_db.operation_mark_unknown(
                conn, op_id=op_id, token=self.ex.token, reason=reason,
                enqueue=step == "reconcile", settle_read=step == "new_attempt")
            return None, [self.event("call.unknown", payload)]

        with self.ex.active():
            await self.ex.write(work)
        self.ex.worker.metrics.incr("unknown_outcomes")
        log.warning("run %s: the outcome of operation %s (%s) is unknown (%s); next: %s%s",
                    self.ex.run_id, op_id, self.tool.name, reason, step,
                    f"; incident {incident}" if incident else "")

    async def park_blocked(self, op_id: int) -> None:
        from orchestrator.executor import Wait

        await self.ex.park(Wait("blocked", self.position, operation_id=op_id))

    async def incident(self, op_id: int, phase: str, exc: BaseException) -> str:
        """Keep what went wrong in protected diagnostics; return the incident reference."""
        ex = self.ex
        ref = new_incident_ref()
        detail = {"type": type(exc).__name__, "message": storable(str(exc)[:10000]),
                  "tool": self.tool.name,
                  "traceback": storable("".join(traceback.format_exception(exc))[-20000:])}
        status = getattr(exc, "status", None)
        with contextlib.suppress(Exception):
            async with ex.db.connection() as conn:
                await incident_record(conn, {
                    "ref": ref, "code": "TOOL_ERROR", "run_id": ex.run_id,
                    "operation_id": op_id, "phase": phase, "cause": type(exc).__name__,
                    "upstream_status": status if isinstance(status, int) else None,
                    "detail": json.dumps(detail)})
        return ref



class _Done(Exception):  # noqa: N818 - carries a recorded receipt out of resume()
    def __init__(self, value: Any) -> None:
        super().__init__("done")
        self.value = value


async def call_tool(ex: RunExecutor, position: int, tool: Tool, arguments: dict[str, Any]) -> Any:
    call = Call(ex, position, tool, arguments)
    try:
        return await call.run()
    except _Done as done:
        return done.value


__all__ = ["call_tool", "next_step_after_uncertain"]
