"""Resolving unknown operations: the shared resolution step and the automatic reconciler (C8).

Both the reconciler and operators end in :func:`resolve`: one transaction that moves the
operation out of ``unknown``, appends the outcome to the run's journal, queues the run again
(or fails it for ``abandoned``), marks the queue item resolved and writes the audit log.
Resolving twice the same way is a no-op; differently, a ``RESOLUTION_CONFLICT``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import random
import secrets
import traceback
from dataclasses import dataclass
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind

from orchestrator import canonical
from orchestrator._portal import serving
from orchestrator.context import ToolContext
from orchestrator.db import grants as grants_db
from orchestrator.db import reconciliation as recon_db
from orchestrator.db import workers as workers_db
from orchestrator.db.config import display_url
from orchestrator.db.database import RECONCILE_CHANNEL, Conn, Database, load_json
from orchestrator.db.events import incident_record
from orchestrator.db.probe import connect_options, connection_name
from orchestrator.db.schema import TERMINAL_STATUSES
from orchestrator.db.xact import answered_once
from orchestrator.engine.config import EngineConfig
from orchestrator.errors import (
    AccessDenied,
    ConfigurationError,
    InvalidRequest,
    OperationInProgress,
    OrchestratorError,
    ResolutionConflict,
    RunUnreadable,
    error_json,
    new_incident_ref,
)
from orchestrator.ids import default_worker_id
from orchestrator.journal import Entry, EventKind, entry
from orchestrator.logs import fields
from orchestrator.lookups import Committed, NotApplied, StillUnknown
from orchestrator.metrics import Metrics
from orchestrator.models import Owner
from orchestrator.registry import Registry, Tool
from orchestrator.retention import Pruner, Retention
from orchestrator.text import check_operator, check_prose, storable
from orchestrator.tracing import key_digest, record_error

log = logging.getLogger("orchestrator.reconciler")
PRUNE_INTERVAL = 60.0
"""Seconds between two background prunes of a reconciler whose app has a retention."""
STOP_GRACE = 10.0
"""Seconds a stopping reconciler has, past its lookup's own ``lookup_timeout``, to record
the answer before the rest is cancelled (a container's stop grace period must cover both:
docker-compose.yml)."""
UNSERVED_GRACE = 300.0
"""Seconds an item of a tool a reconciler does not register is left for one that does (another
application on the same database, another release) before the reconciler hands it to
operators: counted from when it was due, or from when the last claim on it lapsed (its
reconciler died), whichever is later (``unserved_grace``; docs/operations.md)."""
LOOKUP_GRACE = 1.0
"""Seconds a lookup has to end once cancelled (its timeout, a stop); one that catches
``CancelledError`` and goes on is left behind then, not waited for."""
_LEFT_BEHIND: set[asyncio.Task[Any]] = set()  # such lookups, kept until they end
RESOLUTIONS = ("committed", "not_applied", "abandoned")
THEN = ("resend", "fail")
"""What follows an operator's ``not_applied``: the call is sent again (a new attempt, outside
the retry budget), or it fails (``TOOL_FAILED`` in the workflow)."""


@dataclass(frozen=True)
class Resolved:
    """What :func:`resolve` did: ``outcome`` ``resolved`` or ``noop`` (already so; nothing
    else is known then). For ``resolved``, read in its transaction: the run's status and
    whether its cancellation was requested, as they were before the resolution, and the other
    operations the run still waits for after it (:func:`next_step` words what follows)."""

    outcome: str
    run_status: str | None = None
    cancel_requested: bool = False
    waits_for: tuple[int, ...] = ()


NEXT_STEPS = ("resend", "fail", "policy", "resume", "run_failed", "waits", "cancelled", "ended")
"""What a resolution leads its run to (:func:`next_step`)."""


def next_step(resolution: str, then: str | None, done: Resolved) -> str | None:
    """What follows a resolution for its run, one of :data:`NEXT_STEPS` (None for a no-op),
    as ``ops resolve`` words it: ``ended`` (the run had already ended: only the ledger
    changed), ``run_failed`` (abandoned: the run fails ``OPERATION_ABANDONED``), ``waits``
    (the run still waits for ``done.waits_for``), ``cancelled`` (woken, it ends cancelled as
    was requested: nothing is sent again), else ``resume`` (committed: the call returns the
    receipt) or the not applied resolution's ``then`` (``resend``, ``fail``), or without one
    (a lookup's answer) ``policy``: the engine decides, an attempt it lost sent again outside
    the retry budget (up to ``max_engine_resends``), else as the tool's retry policy says."""
    if done.outcome != "resolved":
        return None
    if done.run_status in TERMINAL_STATUSES:
        return "ended"
    if resolution == "abandoned":
        return "run_failed"
    if done.waits_for:
        return "waits"
    if done.cancel_requested:
        return "cancelled"
    return "resume" if resolution == "committed" else (then or "policy")


def check_evidence(evidence: str, operator: str) -> None:
    """A resolution's operator name and evidence text, checked before anything is read or
    written (``INVALID_REQUEST`` with ``path`` ``operator`` or ``evidence``)."""
    check_operator(operator)
    check_prose("evidence", evidence)


IN_FLIGHT = {
    "pending": ("operation {op} is pending: its call has not been sent yet, so there is nothing "
                "to settle; wait: if its outcome becomes unknown it enters the reconciliation "
                "queue (`orchestrator ops list --run {run}`)"),
    "submitted": ("operation {op} is submitted: its call is in flight (or its worker was lost, "
                  "and the run's next worker marks its outcome unknown), so there is nothing to "
                  "settle yet; wait until it ends or enters the reconciliation queue "
                  "(`orchestrator ops list --run {run}`; `orchestrator runs show {run}` says who "
                  "holds the run)"),
}
"""What an operator is told on settling an operation whose call is still under way
(``OPERATION_IN_PROGRESS``, by its state): only an unknown one is theirs to settle."""

SENT_AGAIN = ("operation {op} is unknown, and its run sends the call again itself (an "
              "idempotent tool's re-send with the same key, or a read's new attempt, after the "
              "retry policy's backoff), so there is nothing to settle yet; wait: if those "
              "attempts are used up without an outcome, the call enters the reconciliation "
              "queue (`orchestrator ops list --run {run}`; `orchestrator runs show {run}` tells "
              "its story)")
"""What an operator is told on settling an unknown operation that no queue item lists while
its run goes on: the run's own to settle (``OPERATION_IN_PROGRESS``)."""


async def not_queued(conn: Conn, operation_id: int, tenants: list[str] | None
                     ) -> OrchestratorError:
    """The error for an operation without a reconciliation item this operator may see: one
    that does not exist or is another owner's looks the same (CONTRACT C9); one the operator
    may see but that is not queued (an earlier attempt left for a re-send, a settled call) says
    so, and names the queued attempt of the same call if there is one; one whose call is still
    under way (``pending``, ``submitted``) is ``OPERATION_IN_PROGRESS``, saying to wait
    (:data:`IN_FLIGHT`), and so is an unknown one that its unfinished run sends again itself
    (:data:`SENT_AGAIN`)."""
    op = await recon_db.operation_outside_queue(conn, operation_id)
    if op is None or (tenants is not None and op["tenant"] not in tenants):
        return AccessDenied("the operation does not exist or is not accessible")
    if op["state"] in IN_FLIGHT:
        said = IN_FLIGHT[op["state"]].format(op=operation_id, run=op["run_id"])
        return OperationInProgress(said, status=op["state"])
    if (op["state"] == "unknown" and op["queued"] is None
            and op["run_status"] not in TERMINAL_STATUSES):
        said = SENT_AGAIN.format(op=operation_id, run=op["run_id"])
        return OperationInProgress(said, status=op["state"])
    where = (f"; the queued attempt of the same call is operation {op['queued']}"
             if op["queued"] is not None else
             f": there is nothing to settle; `orchestrator runs show {op['run_id']}` shows its "
             "call and what came of it")
    return InvalidRequest(f"operation {operation_id} is {op['state']} and not in the "
                          f"reconciliation queue{where}", path="operation_id")


async def resolve(
    db: Database,
    *,
    operation_id: int,
    resolution: str,
    evidence: str,
    operator: str,
    receipt: Any = None,
    tenants: list[str] | None = None,
    limits: canonical.JsonLimits = canonical.DEFAULT_LIMITS,
    expect: str | None = None,
    then: str | None = None,
) -> Resolved:
    """Resolve an unknown operation; its :class:`Resolved` says whether it was
    (``outcome`` ``resolved``) or already was so (``noop``), and what it led the run to.

    ``then`` goes with ``not_applied`` only: ``resend`` or ``fail`` (:data:`THEN`), an
    operator's choice; None (a lookup's answer) lets the engine decide (CONTRACT C8).
    ``tenants`` restricts which owners' operations this operator may touch (None: all).
    ``expect`` is the item state the caller saw when it chose the item (a bulk action): an
    item found in another state, resolved included, is a ``RESOLUTION_CONFLICT`` and nothing
    is written (no no-op, no audit row).
    """
    if resolution not in RESOLUTIONS:
        raise InvalidRequest(f"resolution must be one of {', '.join(RESOLUTIONS)}")
    check_evidence(evidence, operator)
    receipt_text = digest = None
    if resolution == "committed":
        receipt_text = limits.text(receipt, "$.receipt")
        digest = canonical.text_digest(receipt_text)
    elif receipt is not None:
        raise InvalidRequest("a receipt goes only with a committed resolution", path="receipt")
    if then is not None and (resolution != "not_applied" or then not in THEN):
        raise InvalidRequest("then must be resend or fail, and goes only with a not_applied "
                             "resolution", path="then")
    error = None
    if resolution == "not_applied":
        error = json.dumps({"code": "NOT_APPLIED", "resolved_by": operator}
                           | ({"then": then} if then else {}))

    async def settle(conn: Conn) -> Resolved:
        # The run's row first, then the item and the operation, as the hot statements, a
        # cancellation and the lease sweeps take a run before anything of it: two resolutions
        # of one run (of two attempts of one call, each settling the other) meet on the run,
        # not on each other's operations. The general path of a worker's write takes the
        # operation and its item first and fences the run last, but only while the run is
        # running: then they are read without a lock (the answer is OPERATION_IN_PROGRESS, or
        # the no-op or conflict of an item resolved already, which nothing changes any more).
        run = await recon_db.run_status_of(conn, operation_id, lock=True, tenants=tenants)
        running = run is not None and run[0] == "running"
        item = await recon_db.recon_get(conn, operation_id, lock=not running, tenants=tenants)
        if item is None:
            raise await not_queued(conn, operation_id, tenants)
        before = ({"item": item["item_state"], "operation": item["operation_state"],
                   "resolution": item["resolution"]} | _attested(item["receipt_digest"])
                  | ({"then": item["then"]} if item["then"] else {}))
        if expect is not None and item["item_state"] != expect:
            raise ResolutionConflict(_changed(operation_id, expect, item))
        if item["item_state"] == "resolved":
            differs = _differs(item, resolution, digest, then)
            if differs is not None:
                raise ResolutionConflict(differs)
            await _audit(conn, operator, f"resolve.{resolution}.noop", item, evidence,
                         before, before)
            return Resolved("noop")
        if item["operation_state"] != "unknown":
            state = item["operation_state"]
            raise OperationInProgress(
                IN_FLIGHT[state].format(op=operation_id, run=item["run_id"]) if state in IN_FLIGHT
                else f"operation {operation_id} is {state}, not unknown yet", status=state)
        assert run is not None  # the operation is there: so is its run, locked above
        fail_run = None
        if resolution == "abandoned":  # the run fails; its error's reference leads here
            fail_run = await _abandonment(conn, item, operator, evidence)
        await recon_db.recon_settle(
            conn, item=item, resolution=resolution, receipt=receipt_text,
            receipt_digest=digest,
            events=_events(item, resolution, receipt, operator, fail_run, then),
            fail_run=fail_run, error=error)
        await _audit(conn, operator, f"resolve.{resolution}", item, evidence, before,
                     {"item": "resolved", "operation": resolution, "resolution": resolution}
                     | ({"then": then} if then else {}) | _attested(digest))
        waits = await recon_db.run_still_waiting_on(conn, operation_id)
        return Resolved("resolved", run[0], run[1], tuple(waits))

    return await db.run_in_transaction(answered_once(settle))


def _differs(item: dict[str, Any], resolution: str, digest: str | None, then: str | None
             ) -> str | None:
    """How a resolution differs from the one an item already has, in the words of its
    ``RESOLUTION_CONFLICT`` (None: it is the same one, a no-op): another resolution, the same
    one with another receipt (by digest), or ``not_applied`` followed by another choice."""
    op, done = item["operation_id"], item["resolution"]
    kept = (f"; a resolution is kept as first given (`orchestrator ops show {op}` shows it and "
            "who made it)")
    if done != resolution:
        return f"operation {op} was already resolved as {done}, not {resolution}{kept}"
    if resolution == "committed" and item["receipt_digest"] != digest:
        return (f"operation {op} was already resolved as committed with a different receipt "
                f"(the stored one's digest is {item['receipt_digest']}; `orchestrator ops show "
                f"{op}` shows it); a resolution is kept as first given")
    if resolution == "not_applied":
        chosen = item["then"]  # the operation's choice, read with its item
        if chosen != then:
            return (f"operation {op} was already resolved as not_applied {_then(chosen)}, not "
                    f"{_then(then)}{kept}")
    return None


def _attested(digest: str | None) -> dict[str, str]:
    """The audit's word on the receipt a committed resolution records: ``receipt_digest``,
    the SHA-256 of its canonical JSON (the operation's own), so that the audit row names
    exactly what was attested. Nothing for an operation without a receipt."""
    return {} if digest is None else {"receipt_digest": digest}


def _then(then: str | None) -> str:
    return f"then {then}" if then else "with what follows left to the retry policy"


def _changed(operation_id: int, expect: str, item: dict[str, Any]) -> str:
    if item["item_state"] == "resolved":
        return (f"operation {operation_id} was resolved as {item['resolution']} after it was "
                "selected")
    return (f"operation {operation_id}'s queue item is {item['item_state']} now, not "
            f"{expect} as when it was selected")


def _events(item: dict[str, Any], resolution: str, receipt: Any, operator: str,
            failed: str | None, then: str | None = None) -> list[Entry]:
    """The journal events of a resolution; ``failed`` is the failed run's error (JSON) for an
    abandonment (:func:`_abandonment`)."""
    position, tool, op = item["position"], item["tool_name"], item["operation_id"]
    if resolution == "committed":
        return [entry(EventKind.CALL_COMPLETED, position, tool,
                    {"result": receipt, "op": op, "resolved_by": operator})]
    if resolution == "not_applied":
        return [entry(EventKind.CALL_NOT_APPLIED, position, tool,
                      {"op": op, "resolved_by": operator} | ({"then": then} if then else {}))]
    assert failed is not None
    error = json.loads(failed)
    return [entry(EventKind.CALL_ABANDONED, position, tool, {"op": op, "resolved_by": operator}),
            entry(EventKind.RUN_FAILED, None, None, {key: error[key]
                                                     for key in ("code", "message", "incident")})]


async def _abandonment(conn: Conn, item: dict[str, Any], operator: str, evidence: str) -> str:
    """An abandoned operation fails its run: record the incident its error names (who gave
    up, and why) and return the run's error (JSON)."""
    ref = new_incident_ref()
    await incident_record(conn, {
        "ref": ref, "code": "OPERATION_ABANDONED", "run_id": item["run_id"],
        "operation_id": item["operation_id"], "phase": "reconciliation", "cause": "abandoned",
        "upstream_status": None, "detail": json.dumps({"operator": operator,
                                                       "evidence": evidence})})
    message = f"operation {item['operation_id']} was abandoned by an operator"
    return error_json("OPERATION_ABANDONED", message, ref)


async def _audit(conn: Conn, operator: str, action: str, item: dict[str, Any], evidence: str,
                 before: dict[str, Any], after: dict[str, Any]) -> None:
    await recon_db.audit_record(conn, operator=operator, action=action, target_kind="operation",
                                target_id=str(item["operation_id"]), tenant=item["tenant"],
                                evidence=evidence, before=json.dumps(before),
                                after=json.dumps(after))


class Reconciler:
    """Claims due queue items and asks each tool's ``lookup`` what happened, with backoff.

    After ``max_lookups`` inconclusive answers (or at once, for a tool without a lookup) the
    item goes to operators. Every lookup and its answer stays in the item's history.

    It claims the items of the tools its registry has; an item of another tool is left for a
    reconciler that has it (a fleet of several applications or releases on one database), and
    handed to operators only once it has waited ``unserved_grace`` seconds with no reconciler
    taking it (:data:`UNSERVED_GRACE`).
    """

    def __init__(self, config: EngineConfig, registry: Registry, database: Database,
                 metrics: Metrics, *, max_lookups: int = 5, base_delay: float = 1.0,
                 max_delay: float = 300.0, batch: int = 10, poll_interval: float = 1.0,
                 lookup_timeout: float = 30.0, retention: Retention | None = None,
                 prune_interval: float = PRUNE_INTERVAL,
                 unserved_grace: float = UNSERVED_GRACE) -> None:
        self.config = config
        # Retention (docs/retention.md): pruned in the background, every prune_interval.
        self.pruner = None if retention is None else Pruner(database, retention)
        self.prune_interval = prune_interval
        self.registry = registry
        self.db = database
        self.metrics = metrics
        self.max_lookups = max_lookups
        self.base_delay = base_delay
        self.max_delay = max_delay
        self.batch = batch
        self.poll_interval = poll_interval
        self.lookup_timeout = lookup_timeout
        self.unserved_grace = unserved_grace
        self.id = "reconciler:" + default_worker_id()
        self.db.application_name = connection_name("reconciler", self.id.removeprefix(
            "reconciler:"))  # its sessions, so named in pg_stat_activity
        self._stop = asyncio.Event()
        self._hurry = asyncio.Event()  # asked to stop again: the lookup under way is dropped
        self._wake = asyncio.Event()
        # What stopped it: a listen_url found to reach another database once it could be
        # reached (raised by run() after the stop).
        self._misconfigured: ConfigurationError | None = None

    def request_stop(self) -> None:
        """Stop (what SIGTERM and SIGINT do): the lookup under way may answer and its answer
        is recorded, within ``lookup_timeout`` plus :data:`STOP_GRACE`; no other begins, and
        the claims on the rest of its batch are released for another reconciler.
        Asked again meanwhile (a second Ctrl-C), stop now: the lookup is cancelled, nothing
        of it is recorded, and its item is looked up again once its claim lapses."""
        if self._stop.is_set():
            if not self._hurry.is_set():
                log.warning("%s: asked again to stop: stopping now, without waiting for the "
                            "lookup under way", self.id)
                self._hurry.set()
            return
        self._stop.set()
        self._wake.set()
        if self.pruner is not None:
            self.pruner.stop()

    @property
    def stop_timeout(self) -> float:
        """Seconds a stop waits for the lookup under way and the recording of its answer."""
        return self.lookup_timeout + STOP_GRACE

    async def run(self) -> None:
        """Reconcile until stopped; the app's sync methods are refused on this loop meanwhile
        (they would stop the reconciler to wait)."""
        with serving():
            await self._run()
        if self._misconfigured is not None:
            raise self._misconfigured

    async def _check_listen_url(self) -> bool:
        """The reconciler LISTENs on ``listen_url`` (docs/operations.md): one that reaches
        another database or server hears none of this database's notifications (a NOTIFY
        reaches the listeners of its own database only), and every unknown call would wait
        for the poll without a word. Refused as a worker's is: ``CONFIGURATION_ERROR``. The
        test is the workers' (an advisory lock taken there must show in this database's
        ``pg_locks``). False when ``listen_url`` cannot be reached yet (nothing to check)."""
        target = self.db.target
        if target.listen_url is None:
            return True
        probe = workers_db.LivenessLock(target.listen_url, secrets.randbits(62) + 1,
                                        options=connect_options(
                                            target, self.db.connect_timeout,
                                            name=self.db.application_name))
        try:
            if probe.key is None or not await probe.ensure():
                return False
            async with self.db.connection() as conn:
                seen = await workers_db.worker_lock_seen(conn, probe.key)
        finally:
            await probe.close()
        if not seen:
            raise ConfigurationError(
                f"listen_url {display_url(target.listen_url)} does not reach the database of "
                "the database URL: the reconciler's LISTEN there would hear none of that "
                "database's notifications, and every unknown operation would wait for the "
                "poll; give listen_url the same server and database, reached directly "
                "(docs/operations.md)")
        return True

    async def _check_listen_url_later(self) -> None:
        """A ``listen_url`` that could not be reached at start is checked once it can be
        (looked at every ``poll_interval``): one that reaches another database then stops
        the reconciler, and :meth:`run` raises the error."""
        while not self._stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.poll_interval)
            try:
                if self._stop.is_set() or await self._check_listen_url():
                    return
            except ConfigurationError as exc:
                log.error("%s stops: %s", self.id, exc.message)
                self._misconfigured = exc
                self.request_stop()
                return
            except OrchestratorError as exc:  # the check's read failed: tried again
                log.warning("%s: could not check listen_url: %s", self.id, exc.code)

    async def _run(self) -> None:
        async with self.db.connection() as conn:
            await grants_db.require_privileges(conn, "reconciler")
        checking = None
        if not await self._check_listen_url():
            log.warning("%s: listen_url %s cannot be reached yet: until it can, unknown "
                        "operations are found by polling (every %g s); it is checked to reach "
                        "the database URL's database then", self.id,
                        display_url(self.db.target.listen_url or ""), self.poll_interval)
            checking = asyncio.ensure_future(self._check_listen_url_later())
        listen_stop = asyncio.Event()
        listener = asyncio.ensure_future(
            self.db.listen([RECONCILE_CHANNEL], lambda _c, _p: self._wake.set(), listen_stop))
        pruning = None if self.pruner is None else asyncio.ensure_future(self._prune_forever())
        try:
            await self._until_stopped(asyncio.ensure_future(self._reconcile()))
        finally:
            listen_stop.set()
            if self._hurry.is_set():
                listener.cancel()  # not even the listener's reconnection is waited for
            if pruning is not None:
                pruning.cancel()
            if checking is not None:
                checking.cancel()
            with contextlib.suppress(BaseException):
                await listener
            for task in (pruning, checking):
                if task is not None:
                    with contextlib.suppress(BaseException):
                        await task

    async def _reconcile(self) -> None:
        while not self._stop.is_set():
            self._wake.clear()
            handled = await self.run_once()
            if handled:
                continue
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_interval)

    async def _until_stopped(self, work: asyncio.Future[Any]) -> None:
        """Await ``work`` (the reconciling loop); once a stop is requested it has
        :attr:`stop_timeout` to end, and a second request cancels it at once."""
        stopping: asyncio.Future[Any] = asyncio.ensure_future(self._stop.wait())
        hurry: asyncio.Future[Any] = asyncio.ensure_future(self._hurry.wait())
        try:
            await asyncio.wait([work, stopping], return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                await asyncio.wait([work, hurry], timeout=self.stop_timeout,
                                   return_when=asyncio.FIRST_COMPLETED)
                if not work.done() and not hurry.done():
                    log.warning("%s: the lookup under way did not end within %g s of the stop; "
                                "stopping without it", self.id, self.stop_timeout)
        finally:
            stopping.cancel()
            hurry.cancel()
            if not work.done():
                work.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await work
        if not work.cancelled():
            work.result()

    async def _prune_forever(self) -> None:
        """Prune by the app's retention now and every ``prune_interval`` seconds, in batches
        of one short transaction each; a failure is logged and tried again next time."""
        assert self.pruner is not None
        pruner = self.pruner
        if pruner.retention.evidence is not None and not await _quietly(pruner.may_expire()):
            log.info("retention: this reconciler's database role may not expire evidence; "
                     "it prunes finished runs only (evidence expiry: `orchestrator prune` as "
                     "the migration role, docs/retention.md)")
        while not self._stop.is_set():
            try:
                report = await pruner.prune()
            except OrchestratorError as exc:
                log.warning("retention: pruning failed: %s; trying again in %.0f s", exc.code,
                            self.prune_interval)
            else:
                if report.runs or report.evidence_runs or report.evidence_audit:
                    log.info("retention: pruned %d run(s) (%d journal rows), expired the "
                             "evidence of %d run(s) and %d audit row(s)", report.runs,
                             report.journal_rows, report.evidence_runs, report.evidence_audit)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stop.wait(), self.prune_interval)

    async def run_once(self) -> int:
        """Handle the items due now; return how many were handled."""
        try:
            async with self.db.connection() as conn:
                items = await recon_db.recon_claim_due(
                    conn, claimer=self.id, limit=self.batch, ttl=self.claim_ttl,
                    tools=list(self.registry.tools), unserved_grace=self.unserved_grace)
        except OrchestratorError as exc:
            log.warning("claiming reconciliation items failed: %s", exc.code)
            return 0
        for index, item in enumerate(items):
            if self._stop.is_set():  # another reconciler takes the rest at once
                await self._release(items[index:])
                break
            try:
                await self._handle(item)
            except OrchestratorError as exc:
                log.warning("run %s: operation %s: reconciliation step failed: %s",
                            item["run_id"], item["operation_id"], exc.code,
                            extra=_said(item, code=exc.code))
        return len(items)

    async def _release(self, items: list[dict[str, Any]]) -> None:
        """Give back the claims on ``items``, which this stopping reconciler will not look up;
        if the database fails meanwhile, they lapse after :attr:`claim_ttl` as before."""
        try:
            async with self.db.connection() as conn:
                released = await recon_db.recon_claim_release(
                    conn, item_ids=[i["item_id"] for i in items], claimer=self.id)
        except OrchestratorError as exc:
            log.warning("%s: stopping: could not release its claims on %d item(s) it did not "
                        "look up (%s); they lapse within %g s", self.id, len(items), exc.code,
                        self.claim_ttl)
            return
        log.info("%s: stopping: released its claims on %d item(s) it did not look up%s",
                 self.id, released, "" if released == len(items) else
                 f" ({len(items) - released} were another's or settled meanwhile)")

    @property
    def claim_ttl(self) -> float:
        """Seconds a claim on an item lasts: one lookup and the recording of its answer."""
        return self.lookup_timeout + 30

    @staticmethod
    def _lapsed(item: dict[str, Any]) -> None:
        log.info("run %s: operation %s not handed to operators: its claim lapsed (another "
                 "reconciler holds it, or it was settled)", item["run_id"],
                 item["operation_id"], extra=_said(item))

    async def _handle(self, item: dict[str, Any]) -> None:
        tool = self.registry.tools.get(item["tool_name"])
        if tool is None:  # claimed only because no reconciler that has it took it in time
            await self._unserved(item)
            return
        if tool.lookup_fn is None:
            await self._to_operators(
                item, f"tool {item['tool_name']} has no lookup here; an operator decides",
                f"tool {item['tool_name']} has no lookup here", logging.INFO)
            return
        # The items of a batch are looked up one after another: each claim is renewed as its
        # lookup begins, and an item whose claim lapsed meanwhile is another's now.
        async with self.db.connection() as conn:
            held = await recon_db.recon_claim_renew(conn, item_id=item["item_id"],
                                                    claimer=self.id, ttl=self.claim_ttl)
        if not held:
            log.info("run %s: operation %s not looked up: its claim lapsed (another reconciler "
                     "holds it, or it was settled)", item["run_id"], item["operation_id"],
                     extra=_said(item))
            return
        try:
            arguments = load_json(item["arguments_text"])
        except RunUnreadable:
            await self._to_operators(
                item, "its arguments cannot be decoded here (RUN_UNREADABLE); an operator "
                      "decides",
                "its stored arguments cannot be decoded (RUN_UNREADABLE)", logging.WARNING,
                code="RUN_UNREADABLE")
            return
        ctx = ToolContext(idempotency_key=item["idempotency_key"], run_id=item["run_id"],
                          position=item["position"], attempt=item["attempt"],
                          operation_id=item["operation_id"],
                          owner=Owner.model_construct(tenant=item["tenant"],
                                                      principal=item["principal"]),
                          deadline=None)
        tracer = self.config.tracing.tracer
        if tracer is None:
            answer, raised = await self._lookup(tool, ctx, arguments)
            await self._answered(item, tool, answer, raised)
            return
        # The lookup's span relates to the run's submitter as the run's own spans do, and is
        # current while its answer is recorded too: the lines logged about it name its trace.
        span = self.config.tracing.related_span(
            tracer, f"lookup {tool.name}", item.get("traceparent"), {
                "orchestrator.run_id": str(item["run_id"]),
                "orchestrator.tool": tool.name,
                "orchestrator.operation_id": item["operation_id"],
                "orchestrator.attempt": item["attempt"],
                "orchestrator.idempotency_key_digest": key_digest(item["idempotency_key"]),
                "orchestrator.lookup_attempt": item["lookup_attempts"] + 1}, SpanKind.CLIENT)
        with trace.use_span(span, end_on_exit=True, record_exception=False,
                            set_status_on_exception=False):
            answer, raised = await self._lookup(tool, ctx, arguments)
            span.set_attribute("orchestrator.outcome", _answer_word(answer))
            if raised is not None:
                record_error(span, type(raised).__name__)
            await self._answered(item, tool, answer, raised)

    async def _unserved(self, item: dict[str, Any]) -> None:
        """Hand to operators an item of a tool this reconciler does not register, claimed
        because it waited past ``unserved_grace`` with no reconciler that has the tool taking
        it (none runs, or none keeps up): counted in ``reconciliation_unserved``."""
        name = item["tool_name"]
        waited = item.get("unserved_for")
        since = "" if waited is None else f" for {waited:.0f} s"
        if await self._to_operators(
                item, f"no running reconciler has tool {name}: the item waited{since} (the grace "
                      f"is {self.unserved_grace:g} s) without one taking it, and this one's "
                      "application does not register the tool; an operator decides",
                f"no running reconciler has tool {name} (the item waited{since}, past the "
                f"{self.unserved_grace:g} s grace; this reconciler does not register it)",
                logging.WARNING):
            self.metrics.incr("reconciliation_unserved", tool=name)

    async def _to_operators(self, item: dict[str, Any], note: str, why: str, level: int,
                            **said: Any) -> bool:
        """Hand an item to operators without a lookup (``note`` is kept on the item, ``why``
        logged); an item whose claim lapsed meanwhile is another reconciler's and is left
        (False)."""
        async with self.db.connection() as conn:
            handed = await recon_db.recon_to_operator(
                conn, item_id=item["item_id"], claimer=self.id, note=note)
        if not handed:
            self._lapsed(item)
            return False
        log.log(level, "run %s: operation %s handed to operators: %s", item["run_id"],
                item["operation_id"], why, extra=_said(item, **said))
        return True

    async def _answered(self, item: dict[str, Any], tool: Tool, answer: Any,
                        raised: BaseException | None) -> None:
        """Record a lookup's answer: resolve the operation, or try again later, or hand it to
        operators."""
        self.metrics.incr("lookups", tool=tool.name,
                          answer="error" if raised is not None else _answer_word(answer))
        if isinstance(answer, Committed | NotApplied):
            kind = "committed" if isinstance(answer, Committed) else "not_applied"
            said = answer.evidence if isinstance(answer, NotApplied) else ""
            receipt = answer.receipt if isinstance(answer, Committed) else None
            state, ref = await self._record(item, kind, said, None, retry_in=self.base_delay)
            if state == "lost":
                await self._late(item, kind, receipt, ref)
                return
            try:
                done = await resolve(
                    self.db, operation_id=item["operation_id"], resolution=kind,
                    receipt=receipt, evidence=f"lookup of {tool.name} answered {kind}",
                    operator="reconciler", limits=self.config.json_limits)
            except ResolutionConflict:  # an operator settled it otherwise since the recording
                await self._late(item, kind, receipt, ref)
                return
            if done.outcome != "resolved":  # settled the same way meanwhile (an operator): no-op
                return
            self.metrics.incr(f"reconciliation_auto_{kind}")
            log.info("run %s: operation %s resolved by lookup: %s", item["run_id"],
                     item["operation_id"], kind, extra=_said(item))
            return
        said = answer.reason if isinstance(answer, StillUnknown) else "not a lookup answer"
        attempts = item["lookup_attempts"] + 1
        retry_in = None if attempts >= self.max_lookups else self.backoff(attempts)
        state, ref = await self._record(item, "still_unknown", said, raised, retry_in)
        if state == "lost":
            _lost(item, "still_unknown")
            return
        # What the lookup said is tool text (it may hold a URL with a key in it): the log
        # names the incident that keeps it, never the text.
        kept = f", its reason in incident {ref}" if ref else ""
        if state == "operator":
            log.info("run %s: operation %s handed to operators after %d lookups (the last: "
                     "still unknown%s)", item["run_id"], item["operation_id"], attempts, kept,
                     extra=_said(item, incident=ref))
        elif retry_in is not None:
            log.info("run %s: operation %s still unknown after lookup %d%s; next lookup in "
                     "%.1f s", item["run_id"], item["operation_id"], attempts, kept, retry_in,
                     extra=_said(item, incident=ref))

    async def _late(self, item: dict[str, Any], kind: str, receipt: Any,
                    said: str | None = None) -> None:
        """A conclusive answer that came after the claim on its item lapsed, or after an
        operator settled the item: the item is another reconciler's now, or settled, so it is
        kept in the history but not acted on. One that contradicts how the item was settled
        is the provider's word against the resolution: it is kept in an incident of the
        operation (its receipt and digest, the resolution that stands, ``said``: the incident
        that keeps what the lookup said), which ``ops show`` lists and the warning names.
        (The settled item itself is fixed once resolved: its evidence cannot grow.)"""
        async with self.db.connection() as conn:
            now = await recon_db.recon_get(conn, item["operation_id"])
        digest = None if receipt is None else canonical.text_digest(
            self.config.json_limits.text(receipt, "$.receipt"))
        if now is None or now["item_state"] != "resolved" or (
                now["resolution"] == kind and now["receipt_digest"] == digest):
            _lost(item, kind)
            return
        ref: str | None = new_incident_ref()
        detail = {"tool": item["tool_name"], "reconciler": self.id, "answer": kind,
                  "receipt": receipt, "receipt_digest": digest,
                  "resolution": now["resolution"], "lookup_incident": said}
        try:
            async with self.db.connection() as conn:
                await incident_record(conn, {
                    "ref": ref, "code": "LOOKUP", "run_id": item["run_id"],
                    "operation_id": item["operation_id"], "phase": "lookup",
                    "cause": "resolution_conflict", "upstream_status": None,
                    "detail": canonical.canonical_json(detail)})
        except OrchestratorError as exc:  # the warning below is then all that is left
            log.warning("run %s: operation %s: the conflicting lookup answer could not be "
                        "kept: %s", item["run_id"], item["operation_id"], exc.code,
                        extra=_said(item, code=exc.code))
            ref = None
        kept = f"; its answer kept in incident {ref}" if ref else ""
        log.warning("run %s: operation %s was resolved as %s, but its lookup answered %s "
                    "(RESOLUTION_CONFLICT); the resolution stands%s", item["run_id"],
                    item["operation_id"], now["resolution"], kind, kept,
                    extra=_said(item, code="RESOLUTION_CONFLICT", incident=ref))

    async def _lookup(self, tool: Tool, ctx: ToolContext, arguments: dict[str, Any]
                      ) -> tuple[Any, BaseException | None]:
        """The tool's lookup's answer (a raised or malformed one is still unknown), and what
        it raised, if anything."""
        assert tool.lookup_fn is not None
        raised: BaseException | None = None
        lookup = asyncio.ensure_future(tool.lookup_fn(ctx, **arguments))
        try:
            try:
                done, _ = await asyncio.wait([lookup], timeout=self.lookup_timeout)
            finally:
                if not lookup.done():  # its timeout, or the reconciler is being cancelled
                    await self._let_go(lookup, tool)
            if not done:
                raise TimeoutError
            answer = lookup.result()
        except asyncio.CancelledError as exc:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise  # the reconciler itself is being cancelled
            # The lookup's own CancelledError: as inconclusive as any other exception.
            answer, raised = StillUnknown("the lookup raised CancelledError"), exc
        except Exception as exc:  # noqa: BLE001 - an inconclusive lookup, recorded as such
            answer, raised = StillUnknown(f"the lookup raised {type(exc).__name__}"), exc
        if isinstance(answer, Committed):
            try:
                self.config.json_limits.check(answer.receipt, "$.receipt")
            except InvalidRequest:
                answer = StillUnknown("the lookup's receipt is not JSON")
        return answer, raised

    async def _let_go(self, lookup: asyncio.Task[Any], tool: Tool) -> None:
        """Cancel ``lookup`` and give it :data:`LOOKUP_GRACE` to end; one that does not (it
        catches ``CancelledError`` and goes on) is left behind: it must not hold every other
        item, nor a stop, for as long as it likes."""
        lookup.cancel()
        await asyncio.wait([lookup], timeout=LOOKUP_GRACE)
        if not lookup.done():
            log.warning("%s: the lookup of %s did not end when it was cancelled (it catches "
                        "CancelledError?): left running, its answer not awaited", self.id,
                        tool.name)
            _LEFT_BEHIND.add(lookup)
            lookup.add_done_callback(_LEFT_BEHIND.discard)

    def backoff(self, attempts: int) -> float:
        """A jittered exponential delay: between half and all of a window that doubles per
        attempt, capped at ``max_delay``."""
        window = min(self.max_delay, self.base_delay * 2 ** (attempts - 1))
        return random.uniform(window / 2, window)

    async def _record(self, item: dict[str, Any], answer: str, said: Any,
                      raised: BaseException | None, retry_in: float | None
                      ) -> tuple[str, str | None]:
        """Keep one lookup in the item's history; return the item's new state and the incident
        that keeps what the lookup said. That text (a ``NotApplied``'s or ``StillUnknown``'s
        reason, the exception a lookup raised) is the tool's and may hold secrets, so it goes
        to the operation's protected diagnostics, in the same transaction; the history keeps
        only the answer and the incident's reference. The state is ``lost`` when the claim on
        the item lapsed meanwhile: the lookup is kept, its answer is not to be acted on."""
        text = "" if said is None else str(said)
        ref = new_incident_ref() if text or raised is not None else None
        detail: dict[str, Any] = {"tool": item["tool_name"],
                                  "lookup": item["lookup_attempts"] + 1, "answer": answer,
                                  "reason": storable(text[:10_000])}
        if raised is not None:
            detail |= {"type": type(raised).__name__,
                       "message": storable(str(raised)[:10_000]),
                       "traceback": storable("".join(
                           traceback.format_exception(raised))[-20_000:])}

        async def tx(conn: Conn) -> str:
            if ref is not None:
                await incident_record(conn, {
                    "ref": ref, "code": "LOOKUP", "run_id": item["run_id"],
                    "operation_id": item["operation_id"], "phase": "lookup",
                    "cause": answer if raised is None else type(raised).__name__,
                    "upstream_status": None, "detail": json.dumps(detail)})
            return await recon_db.recon_record_lookup(
                conn, item_id=item["item_id"], claimer=self.id, answer=answer,
                detail=json.dumps({"incident": ref} if ref else {}), retry_in=retry_in)

        return await self.db.run_in_transaction(tx), ref


async def _quietly(check: Any) -> bool:
    try:
        return bool(await check)
    except OrchestratorError:
        return False


def _lost(item: dict[str, Any], answer: str) -> None:
    """A lookup answered after this reconciler's claim on its item had lapsed: the item is
    another reconciler's now (or settled), so the answer is kept but not acted on."""
    log.info("run %s: operation %s: its lookup answered %s after the claim on it lapsed; kept "
             "in its history, not acted on (another reconciler holds it, or it was settled)",
             item["run_id"], item["operation_id"], answer, extra=_said(item))


def _said(item: dict[str, Any], **more: Any) -> dict[str, Any]:
    """The fields of a reconciler's line about one queue item (docs/logging.md)."""
    return fields(run_id=item["run_id"], operation_id=item["operation_id"],
                  tool=item["tool_name"], **more)


def _answer_word(answer: Any) -> str:
    """A lookup's answer on its span: committed, not_applied or still_unknown."""
    if isinstance(answer, Committed):
        return "committed"
    return "not_applied" if isinstance(answer, NotApplied) else "still_unknown"
