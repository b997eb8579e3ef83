"""Policy stages before a call is dispatched (CONTRACT C7): the application's and the tool's
``authorize`` and ``approve`` hooks, each under its time budget, with cancellation and the
deadline checked around each. The call's intent is ``pending`` meanwhile; it becomes
``submitted`` (or ``cancelled``) in one guarded statement."""

from __future__ import annotations

import asyncio
from typing import Any, NoReturn

from orchestrator.context import PolicyContext
from orchestrator.db import operations as ops_db
from orchestrator.db.database import Conn
from orchestrator.engine.config import EngineConfig
from orchestrator.engine.site import CallSite
from orchestrator.errors import cancelled_error, operation_error_json
from orchestrator.journal import Entry, EventKind
from orchestrator.matching import tool_failed
from orchestrator.registry import Tool

Stage = tuple[str, Any, float]  # name, hook, budget in seconds


def policy_stages(config: EngineConfig, tool: Tool) -> list[Stage]:
    """The stages a call of ``tool`` passes, in order (none for most tools)."""
    found = []
    for name, app_hook, tool_hook, budget in (
            ("authorize", config.authorize, tool.authorize_fn, tool.authorize_timeout),
            ("approve", config.approve, tool.approve_fn, tool.approve_timeout)):
        for hook in (app_hook, tool_hook):
            if hook is not None:
                found.append((name, hook, budget))
    return found


class Stages:
    """The policy stages of one attempt of one call."""

    def __init__(self, site: CallSite) -> None:
        self.site = site

    async def run(self, op_id: int, number: int, key: str, stages: list[Stage]) -> None:
        """Run each policy stage under its budget, checking cancellation around each; then
        move the intent to ``submitted`` (or ``cancelled``) in one guarded statement."""
        site, run = self.site, self.site.run
        pctx = PolicyContext(tool=site.tool.name, arguments=site.arguments, owner=run.owner,
                             run_id=run.run_id, position=site.position, attempt=number,
                             idempotency_key=key)
        for name, hook, budget in stages:
            await self.admissible(op_id)
            remaining = run.remaining()
            try:
                verdict = await run.race_cancellation(
                    hook(pctx), budget if remaining is None else min(budget, remaining),
                    pctx.cancelled)
            except asyncio.CancelledError:  # while the hook ran: the intent is still pending
                await site.withdraw(op_id, number, pending=True)
            if verdict.cancelled:
                await self.cancel_pending(op_id)
            if verdict.timed_out or verdict.error is not None or verdict.value is False:
                await self.admissible(op_id)  # out of run time is a deadline, not a denial
                cause = "policy_timeout" if verdict.timed_out else "denied"
                ref = await site.incident(op_id, name, verdict.error) if verdict.error else None
                await self.deny(op_id, name, cause, ref)
        await self.admissible(op_id)
        token, run_id = run.token, run.run_id

        rate = site.tool.rate

        async def submit(conn: Conn) -> tuple[str, list[Entry]]:
            status = await ops_db.operation_mark_submitted(
                conn, run_id=run_id, op_id=op_id, token=token,
                limited=site.tool.holds_place)
            if status == "cancelled":
                return status, [site.event(EventKind.CALL_CANCELLED,
                                           {"op": op_id, "why": "cancelled"})]
            if rate is not None:
                await ops_db.tool_dispatched(conn, tool=site.tool.name, op_id=op_id)
            return status, [site.event(EventKind.CALL_SUBMITTED,
                                       site.submitted_payload(number, op_id, key))]

        if site.config.back_offs:
            await site.before_dispatch()
        status = await site.admitted_write(submit)
        await site.written(op_id, number, status, pending=False)

    async def admissible(self, op_id: int) -> None:
        """Before and after each stage and just before dispatch: a cancelled run, or one whose
        deadline cannot hold the minimum attempt time, never dispatches (C7)."""
        run = self.site.run
        if run.cancel_requested:
            await self.cancel_pending(op_id)
        remaining = run.remaining()
        if remaining is not None and remaining * 1000 <= self.site.tool.policy.min_attempt_ms:
            await self.cancel_pending(op_id, stop="deadline")

    async def cancel_pending(self, op_id: int, stop: str = "cancelled") -> NoReturn:
        """pending → cancelled (never dispatched); the run stops (cancelled or out of time)."""
        site = self.site
        token, run_id = site.run.token, site.run.run_id

        async def work(conn: Conn) -> tuple[None, list[Entry]]:
            await ops_db.operation_cancel(conn, run_id=run_id, op_id=op_id, token=token,
                                          error=cancelled_error(stop))
            return None, [site.event(EventKind.CALL_CANCELLED, {"op": op_id, "why": stop})]

        await site.append(work)
        if stop == "deadline":
            site.run.stop_deadline()
        site.run.stop_cancelled()

    async def deny(self, op_id: int, stage: str, cause: str, ref: str | None) -> NoReturn:
        site = self.site
        error = operation_error_json("TOOL_DENIED", stage=stage, cause=cause, incident=ref)
        token, run_id = site.run.token, site.run.run_id

        async def work(conn: Conn) -> tuple[None, list[Entry]]:
            await ops_db.operation_cancel(conn, run_id=run_id, op_id=op_id, token=token,
                                          error=error)
            return None, [site.event(EventKind.CALL_DENIED, {"op": op_id, "stage": stage,
                                                             "cause": cause, "incident": ref})]

        await site.append(work)
        raise tool_failed(site.tool.name, EventKind.CALL_DENIED,
                          {"op": op_id, "stage": stage, "cause": cause, "incident": ref})
