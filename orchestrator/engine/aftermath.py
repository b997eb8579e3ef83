"""What follows an attempt that did not return a receipt (CONTRACT C5, C7, C8): a durable
backoff and the next attempt, a definitive failure raised into the workflow, or an unknown
outcome that goes to reconciliation (or is re-sent, where the effect class allows)."""

from __future__ import annotations

import random
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, NoReturn

from orchestrator.db import operations as ops_db
from orchestrator.db.database import Conn
from orchestrator.engine.site import Attempt, CallSite, _Done
from orchestrator.errors import operation_error_json
from orchestrator.failures import Classification
from orchestrator.journal import Entry, EventKind
from orchestrator.matching import tool_failed
from orchestrator.recovery import Decision, decide, resend_delay_ms

NOT_APPLIED = Classification("not_applied", "none", True)
"""A reconciliation's answer that the attempt was not applied: retried under the policy."""


class Aftermath:
    """After one failed or uncertain attempt of one call."""

    def __init__(self, site: CallSite) -> None:
        self.site = site

    def decide(self, cls: Classification, number: int,
               upstream: tuple[int | None, bool] | None) -> Decision:
        """The retry policy's decision after attempt ``number`` (re-sends outside the budget
        not counted)."""
        remaining = self.site.run.remaining()
        wait, invalid = upstream if upstream is not None else (None, False)
        return decide(transient=cls.transient, effects=cls.effects, visible=False,
                      attempts=self.site.charged(number), policy=self.site.tool.policy,
                      jitter=random.random(),
                      remaining_ms=None if remaining is None else int(remaining * 1000),
                      upstream_wait_ms=wait, upstream_invalid=invalid)

    async def not_applied(self, op_id: int, number: int, *, lost: bool,
                          then: str | None) -> Attempt:
        """Reconciliation proved the attempt was not applied (CONTRACT C8).

        ``lost``: the engine lost that attempt (its unknown outcome is ``WORKER_LOST``), not
        the tool. ``then`` is an operator's choice (``resend`` or ``fail``; None for a
        lookup's answer). What follows:

        - ``fail``: the call fails (``TOOL_FAILED``, cause ``not_applied``, reason
          ``operator``);
        - a lost attempt, fewer than ``max_engine_resends`` lost ones re-sent so far: sent
          again as a new attempt with a new key, outside the retry budget;
        - an operator's ``resend`` otherwise: sent again all the same (the operator decided);
        - a lookup's answer otherwise: the retry policy decides, the attempt counted against
          ``max_attempts``; when that stops the call after the re-send cap was reached, the
          reason says ``resend_limit``.
        """
        site = self.site
        site.run.boundary()  # a cancellation that waited for the reconciliation wins now
        if then == "fail":
            return await self.definitive(op_id, number, Decision.stop("cause"), "not_applied",
                                         None, record_failure=False, reason="operator")
        cap = site.tool.policy.max_engine_resends
        if lost and site.resent_lost < cap:
            return await self.resend(op_id, number, "lost")
        if then == "resend":
            return await self.resend(op_id, number, "operator")
        decision = self.decide(NOT_APPLIED, number, None)
        capped = lost and cap > 0
        return await self.definitive(
            op_id, number, decision, "worker_lost" if capped else "not_applied", None,
            record_failure=False,
            reason="resend_limit" if capped and decision.action == "stop" else None)

    async def resend(self, op_id: int, number: int, why: str) -> Attempt:
        """Send the call again at once, as attempt ``number + 1`` with a new key; ``why`` is
        ``lost`` or ``operator`` (the journal keeps it: why this attempt exists)."""
        site = self.site
        if why == "lost":
            site.resent_lost += 1
        else:
            site.resent_by_operator += 1
        return await self.definitive(op_id, number, Decision.retry(0), "not_applied", None,
                                     record_failure=False, resend=why)

    async def definitive(self, op_id: int, number: int, decision: Decision, cause: str,
                         ref: str | None, *, record_failure: bool = True,
                         reason: str | None = None, resend: str | None = None,
                         phase: str = "reconciliation", delay_class: str = "backoff",
                         refused: dict[str, Any] | None = None) -> Attempt:
        """This attempt applied nothing: back off durably and return the next attempt, or stop
        with ToolFailed. But if an earlier attempt at this position is still unknown (it was
        re-sent with the same key), this answer says nothing about that one: the next attempt
        keeps its key, and instead of failing the call goes to reconciliation.

        ``reason`` overrides the decision's stop reason; ``resend`` marks a retry as a re-send
        outside the retry budget (:meth:`resend`). ``phase`` (``tool``: the tool said so;
        ``reconciliation``: a lookup or an operator proved it) and ``delay_class`` (of a retry's
        delay: ``backoff`` or ``retry_after``) label the metrics. ``refused``: the tool's
        Retry-After hint that stopped the call (``orchestrator.recovery.refused_hint``), which
        its ``call.failed`` entry keeps so that its error names it."""
        site = self.site
        metrics = site.run.metrics
        if resend != "lost":  # an attempt the engine lost is not the tool's failure
            metrics.incr("tool_failures", tool=site.tool.name, phase=phase, cause=cause)
        if decision.action == "retry" and resend is None:  # a re-send goes at once
            metrics.observe("retry_delay_seconds", decision.delay_ms / 1000, delay_class)
        elif decision.detail == "deadline":  # no retry: its delay would outlast the deadline
            metrics.observe("retry_delay_seconds", site.run.remaining() or 0.0,
                            "deadline_capped")
        others = await self._other_attempts(op_id)
        applied = next((r for r in others if r["state"] == "committed"), None)
        if applied is not None:
            await self._settle_applied(op_id, applied, cause, ref, record_failure)
        earlier = [r for r in others if r["state"] == "unknown"]
        key = earlier[0]["idempotency_key"] if earlier else None
        if decision.action == "retry":
            not_before = site.run.now() + timedelta(milliseconds=decision.delay_ms)
            payload = {"op": op_id, "attempt": number, "cause": cause, "incident": ref,
                       "delay_ms": decision.delay_ms, "not_before": not_before.isoformat(),
                       "key": key}
            if resend is not None:
                payload["resend"] = resend
                site.run.metrics.incr("operations_resent", tool=site.tool.name)
            await self._fail(op_id, cause, ref, record_failure, EventKind.CALL_RETRYING, payload)
            if decision.delay_ms:
                await site.wait_until(not_before, op_id, number)
            return Attempt(number + 1, key, resend=resend is not None)
        if earlier:
            await self._reconcile_earlier(op_id, earlier[0]["id"], cause, ref, record_failure)
        reason = reason or decision.reason or "cause"
        failed: dict[str, Any] = {"op": op_id, "attempt": number, "cause": cause,
                                  "reason": reason, "incident": ref}
        if refused is not None:
            failed["retry_after"] = refused
        await self._fail(op_id, cause, ref, record_failure, EventKind.CALL_FAILED, failed)
        if decision.detail == "deadline":
            site.run.stop_deadline()  # the next attempt cannot fit before the run's deadline
        raise tool_failed(site.tool.name, EventKind.CALL_FAILED, failed)

    async def uncertain(self, op_id: int, number: int, key: str, reason: str,
                        incident: str | None = None) -> Attempt:
        """The effect may or may not have happened: never guess (C5, C8). ``incident`` is the
        reference of the diagnostics kept for it, if any (its event names it for operators).
        Returns the next attempt where the effect class allows one, after the policy's
        backoff as for a retry (a provider that timed out is not asked again at once); the
        wait is durable and counts against the run's deadline."""
        site, run = self.site, self.site.run
        step = site.uncertain_step(number)
        delay_ms, not_before = 0, None
        if step != "reconcile" and not run.cancel_requested:
            remaining = run.remaining()
            delay_ms = resend_delay_ms(site.tool.policy, site.charged(number), random.random(),
                                       None if remaining is None else int(remaining * 1000))
            if delay_ms:
                not_before = run.now() + timedelta(milliseconds=delay_ms)
                run.metrics.observe("retry_delay_seconds", delay_ms / 1000, "backoff")
        await site.record_unknown(op_id, reason, step, incident, delay_ms=delay_ms,
                                  not_before=not_before)
        if run.remaining() == 0:
            run.stop_deadline()  # the effect stays unknown and listed; the run is out of time
        if run.cancel_requested and step != "reconcile":
            run.metrics.incr("cancellations", stage="effect_resolved")
            run.stop_cancelled()  # an uncertain read settles as not applied; nothing is unknown
        if step == "reconcile":
            await site.park_blocked(op_id)
        if not_before is not None:
            await site.wait_until(not_before, op_id, number)
        return Attempt(number + 1, key if step == "resend" else None)

    async def _other_attempts(self, current: int) -> list[dict[str, Any]]:
        """The other attempts at this position, as the ledger has them now: one still
        ``unknown`` was re-sent with the same key; one ``committed`` was proven applied by a
        lookup or an operator while this attempt was out."""
        site = self.site
        rows = await site.session.read(
            lambda conn: ops_db.operation_for_position(conn, site.run.run_id, site.position))
        return [r for r in rows if r["id"] != current]

    async def _settle_applied(self, op_id: int, applied: dict[str, Any], cause: str,
                              ref: str | None, record_failure: bool) -> NoReturn:
        """An earlier attempt at this position was proven committed while this one was out (a
        lookup answered for it as a re-send of its key met a "not applied"): its receipt is the
        call's outcome, whatever this attempt came to, as :meth:`Call.after_reconciliation`
        takes a resolution. Another attempt, under a new key, would apply the effect again."""
        await self._fail(op_id, cause, ref, record_failure, EventKind.CALL_COMPLETED, {
            "result": applied["receipt"], "op": applied["id"], "resolved": True})
        raise _Done(applied["receipt"])

    async def _reconcile_earlier(self, op_id: int, earlier: int, cause: str, ref: str | None,
                                 record_failure: bool) -> NoReturn:
        """Stop retrying, but do not fail: the earlier, re-sent attempt may have applied."""
        await self._fail(op_id, cause, ref, record_failure, EventKind.CALL_UNKNOWN, {
            "op": earlier, "reason": "RESEND_NOT_APPLIED", "next": "reconcile"},
            also=lambda conn: ops_db.operation_enqueue(conn, op_id=earlier,
                                                       reason="RESEND_NOT_APPLIED"))
        await self.site.park_blocked(earlier)

    async def _fail(self, op_id: int, cause: str, ref: str | None, record_failure: bool,
                    kind: EventKind, payload: dict[str, Any],
                    also: Callable[[Conn], Awaitable[Any]] | None = None) -> None:
        """In one transaction: this attempt ``failed`` with ``cause`` (unless
        ``record_failure`` is false: recorded already), ``also`` if given, and the call's
        ``kind`` entry that says what follows."""
        site = self.site
        error = operation_error_json("TOOL_FAILED", cause=cause, incident=ref)
        token, run_id = site.run.token, site.run.run_id

        async def work(conn: Conn) -> tuple[None, list[Entry]]:
            if record_failure:
                await ops_db.operation_fail(conn, run_id=run_id, op_id=op_id, token=token,
                                            error=error)
            if also is not None:
                await also(conn)
            return None, [site.event(kind, payload)]

        await site.append(work)
