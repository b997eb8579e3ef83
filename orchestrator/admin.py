"""Operator views of runs across owners, and of the workers, for the CLI and for consoles a
host builds.

These functions do not check ownership: they are for operators, whom the host authorises
(:func:`operator_cancel` takes the operator's tenant scope, as the console passes it). The
owner-scoped API for applications is :class:`~orchestrator.Orchestrator`.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from orchestrator.admission import new_run
from orchestrator.db import chains as chains_db
from orchestrator.db import journal as journal_db
from orchestrator.db import operations as ops_db
from orchestrator.db import queues as queues_db
from orchestrator.db import runs as runs_db
from orchestrator.db import views as views_db
from orchestrator.db import workers as workers_db
from orchestrator.db.database import Conn, Database
from orchestrator.db.reconciliation import audit_record
from orchestrator.db.schema import TERMINAL_STATUSES
from orchestrator.db.workers import DEAD_AFTER
from orchestrator.db.xact import answered_once
from orchestrator.errors import (
    AccessDenied,
    InvalidRequest,
    OperationInProgress,
    OperationUncertain,
    RunPruned,
)
from orchestrator.journal import check_versions
from orchestrator.models import Owner, check_run_filters, held_until
from orchestrator.reconcile import check_evidence

LIVE_WORKER_SECONDS = 60.0


async def list_runs(db: Database, *, tenant: str | None = None, status: str | None = None,
                    workflow: str | None = None, parent: uuid.UUID | None = None,
                    submission_key: str | None = None, limit: int = 50
                    ) -> list[dict[str, Any]]:
    """Runs of every owner, newest first; ``parent`` keeps the child runs of that run,
    ``submission_key`` those submitted with that idempotency key (one per owner). Each row
    has ``blocked`` (why it has not started) and ``stalled`` (:func:`stalled`)."""
    check_run_filters(status=status, workflow=workflow, tenant=tenant, limit=limit,
                      submission_key=submission_key)
    async with db.connection() as conn:
        rows = await runs_db.run_list(conn, tenant=tenant, principal=None, status=status,
                                      workflow=workflow, limit=limit, parent=parent,
                                      submission_key=submission_key)
        blocked = await queues_db.run_blockers(
            conn, [r["id"] for r in rows if r["queue"] is not None])
        workers = await workers_db.worker_list_live(conn, within_seconds=LIVE_WORKER_SECONDS)
    now = datetime.now(UTC)
    runnable = served(workers)
    beating = {w["id"] for w in workers
               if (w["db_now"] - w["heartbeat_at"]).total_seconds() <= DEAD_AFTER}
    for row in rows:  # why a run ready in a queue, or held back, has not started
        row["stalled"] = stalled(row, beating)  # a running one, that nothing runs
        row["blocked"] = blocked.get(row["id"])
        start = held_until(row) if row["status"] == "queued" and not row["revision"] else None
        if row["blocked"] is None and start is not None and start > now:
            row["blocked"] = f"not before {utc_text(start)}"
        if row["blocked"] is None and _ready(row, now):
            row["blocked"] = unserved(row["workflow_name"], row["workflow_version"], runnable)
    return rows


def stalled(run: Mapping[str, Any], beating: set[str]) -> str | None:
    """Why a running run does not move when its lease holder is not among the workers
    ``beating`` (those that heartbeated within :data:`DEAD_AFTER`): ``runs list``'s DETAIL,
    which points to ``runs show`` for when the run is re-queued; else None."""
    owner = run["lease_owner"]
    if run["status"] != "running" or owner is None or owner in beating:
        return None
    return f"held by {owner}, silent or dead (see runs show)"


def served(workers: Sequence[Mapping[str, Any]]) -> frozenset[str]:
    """The workflow versions (``name@version``) that these live workers register."""
    return frozenset(key for worker in workers for key in worker["workflows"])


def unserved(workflow: str, version: str, served_by: frozenset[str]) -> str | None:
    """Why runs of ``workflow@version`` do not start when no live worker registers it (what
    ``runs list``, ``runs show`` and ``schedules list`` say), or None."""
    key = f"{workflow}@{version}"
    return None if key in served_by else f"no worker has {key}"


def _ready(run: dict[str, Any], now: datetime) -> bool:
    """Queued, or waiting with its wake time passed: a worker would claim it now."""
    due = run.get("available_at")
    return run["status"] == "queued" or (run["status"] == "waiting" and due is not None
                                         and due <= now)


HOLDER_STATES = ("live", "silent", "dead", "gone", "expired", "waiting")
"""How the worker holding a running run's lease looks (:class:`LeaseHolder`)."""


@dataclass(frozen=True)
class LeaseHolder:
    """The worker holding a running run's lease, as far as the database can tell.

    ``state``: ``live`` (it heartbeats); ``waiting`` (it heartbeats and keeps the run, but its
    liveness lock is not held: its lock's session ended and the lock cannot be taken again yet,
    so it claims nothing new, and were its process to die its runs would wait for their leases
    to expire; ``workers list`` says ``waiting`` too, and, as there, a draining one is
    ``live`` with ``draining_since``); ``silent`` (no heartbeat for longer than the
    dead-after threshold, but its liveness lock is held or it has none: paused, overloaded or
    partitioned); ``dead`` (no heartbeat and its liveness lock released: its process is gone);
    ``gone`` (it is not registered any more); ``expired`` (the lease itself has expired).
    ``reclaim``: ``sweep`` (the next sweep of a live worker re-queues the run: within about a
    second of one running), ``expiry`` (the run is re-queued when its lease expires at
    ``lease_expires_at``), or None (the holder is live and keeps it).
    ``draining_since``: when the holder was told to stop (None: it was not, or it is not
    registered). A ``live`` holder that drains keeps the run only until its next durable
    point, then releases it for another worker; the state stays ``live`` because whether it
    heartbeats decides what happens to the lease.
    """

    worker_id: str
    state: str
    lease_expires_at: datetime | None
    heartbeat_at: datetime | None
    heartbeat_age: float | None
    reclaim: str | None
    checked_at: datetime
    """The database's time when this was judged."""
    draining_since: datetime | None = None


@dataclass
class Worker:
    """A registered worker and how it looks: ``live`` (it heartbeats), ``draining`` (it
    heartbeats, but was told to stop: it claims nothing more and waits for its runs to reach a
    durable point), ``waiting`` (it heartbeats, but holds no liveness lock yet, so it claims
    nothing: its ``listen_url`` cannot be reached), ``silent`` (no recent heartbeat, its
    liveness lock held or never taken) or ``dead`` (neither). ``row`` is
    :func:`~orchestrator.db.views.worker_list_all`'s."""

    row: dict[str, Any]
    state: str


def worker_state(row: Mapping[str, Any]) -> str:
    """A registered worker's state by :func:`lease_holder`'s rule: dead after
    :data:`DEAD_AFTER` seconds without a heartbeat and without its liveness lock. Whether it
    heartbeats comes first: a draining worker that stopped heartbeating is silent or dead.
    One that heartbeats and takes a liveness lock (``lock_wanted``) but holds none is
    ``waiting`` (a worker behind a transaction pooler without a listen_url takes none, and is
    ``live``)."""
    age = row["heartbeat_age"]
    if age is not None and age > DEAD_AFTER and row["lock_held"] is False:
        return "dead"
    if age is not None and age > DEAD_AFTER:
        return "silent"
    if row.get("draining_since") is not None:
        return "draining"
    return "waiting" if row.get("lock_wanted") and not row["lock_held"] else "live"


async def list_workers(db: Database) -> list[Worker]:
    """Every registered worker, newest first, with its state: what ``orchestrator workers
    list`` and the console's workers page show. It reads ``pg_locks``, so it must run on the
    primary (on a replica every liveness lock looks released)."""
    async with db.connection() as conn:
        return [Worker(w, worker_state(w)) for w in await views_db.worker_list_all(conn)]


@dataclass
class RunDetail:
    """Everything ``runs show`` prints about one run."""

    run: dict[str, Any]
    journal: list[dict[str, Any]]
    operations: list[dict[str, Any]]
    note: str | None = None
    live_workers: list[dict[str, Any]] = field(default_factory=list)
    holder: LeaseHolder | None = None


async def show_run(db: Database, run_id: uuid.UUID) -> RunDetail:
    async with db.connection() as conn:
        run = await runs_db.run_get(conn, run_id)
        if run is None:
            raise AccessDenied("the run does not exist or is not accessible")
        journal = await journal_db.journal_read(conn, run_id)
        check_versions(journal)  # as every reader of a journal refuses newer entries (C3)
        operations = await ops_db.operation_list_for_run(conn, run_id)
        workers = await workers_db.worker_list_live(conn, within_seconds=LIVE_WORKER_SECONDS)
        holder = None
        if run["status"] == "running" and run["lease_owner"] is not None:
            holder = lease_holder(run, await workers_db.worker_lease_holder(
                conn, run["lease_owner"]))
        run["blocked"] = (await queues_db.run_blockers(conn, [run_id])).get(run_id)
    if run["blocked"] is None and _ready(run, datetime.now(UTC)):
        run["blocked"] = unserved(run["workflow_name"], run["workflow_version"],
                                  served(workers))
    return RunDetail(run, journal, operations, _note(run, workers, holder), workers, holder)


def lease_holder(run: dict[str, Any], seen: dict[str, Any]) -> LeaseHolder:
    """Judge a lease holder by the worker's own rule (:data:`DEAD_AFTER` without a heartbeat
    and without its liveness lock is dead); ``seen`` is
    :func:`~orchestrator.db.workers.worker_lease_holder`'s row."""
    expires = run["lease_expires_at"]
    age = seen["heartbeat_age"]
    if expires is not None and expires <= seen["db_now"]:
        state, reclaim = "expired", "sweep"
    elif not seen["registered"]:
        state, reclaim = "gone", "expiry"
    elif age is not None and age > DEAD_AFTER and seen["lock_held"] is False:
        state, reclaim = "dead", "sweep"
    elif age is not None and age > DEAD_AFTER:
        state, reclaim = "silent", "expiry"
    elif (seen["draining_since"] is None and seen["lock_wanted"]
          and not seen["lock_held"]):  # worker_state's rule: a draining one is live here
        state, reclaim = "waiting", None
    else:
        state, reclaim = "live", None
    return LeaseHolder(worker_id=run["lease_owner"], state=state, lease_expires_at=expires,
                       heartbeat_at=seen["heartbeat_at"], heartbeat_age=age, reclaim=reclaim,
                       checked_at=seen["db_now"], draining_since=seen["draining_since"])


def _holder_note(holder: LeaseHolder, workers: list[dict[str, Any]]) -> str:
    who, until = holder.worker_id, holder.lease_expires_at
    expiry = utc_text(until) if until is not None else "(no expiry)"
    silence = ("" if holder.heartbeat_age is None
               else f"last heartbeat {holder.heartbeat_age:.0f} s ago")
    sweepers = [w for w in workers if w["id"] != who and (
        holder.checked_at - w["heartbeat_at"]).total_seconds() <= DEAD_AFTER]
    later = ("" if sweepers else
             "; no other live worker is registered now, so it happens once one runs")
    if holder.state == "expired":
        return (f"held by {who}, whose lease expired at {expiry}: the next sweep of a live "
                f"worker re-queues the run{later}")
    if holder.state == "gone":
        return (f"held by {who}, which is gone (no longer registered): the run is re-queued "
                f"when its lease expires at {expiry}{later}")
    if holder.state == "dead":
        return (f"held by {who}, which is dead ({silence}, its liveness lock released): the "
                f"next sweep of a live worker re-queues the run, at the latest when the lease "
                f"expires at {expiry}{later}")
    if holder.state == "silent":
        return (f"held by {who}, which is silent ({silence}; paused or overloaded with its "
                f"liveness lock still held, or, if it took none (behind a transaction pooler "
                f"without a listen_url), paused or dead, which the database cannot tell): the "
                f"run is re-queued when its lease expires at {expiry} unless the worker "
                f"heartbeats again{later}")
    if holder.state == "waiting":
        who = (f"{who}, which is waiting (it heartbeats and keeps the run, but its liveness "
               "lock is not held: it claims nothing new until it takes the lock again, and "
               "were it to die the run would wait for its lease to expire),")
    elif holder.draining_since is not None:
        since = holder.draining_since.astimezone(UTC)
        who = (f"{who}, which is draining since {since:%H:%M:%S}Z (told to stop: it releases "
               "the run for another worker at its next durable point),")
    return f"held by {who} until {expiry}" + (f" ({silence})" if silence else "")


def _note(run: dict[str, Any], workers: list[dict[str, Any]],
          holder: LeaseHolder | None = None) -> str | None:
    """Why a run that is not finished is not moving, in words."""
    key = f"{run['workflow_name']}@{run['workflow_version']}"
    if run["status"] == "queued":
        start = held_until(run)
        if start is not None and run["revision"] == 0 and start > datetime.now(UTC):
            return (f"not before {utc_text(start)}: submitted with a held-back start "
                    f"(start_at or delay)")
        able = [w for w in workers if key in w["workflows"]]
        if not able:
            return (f"no worker has {key}: waiting for a worker that has workflow "
                    f"{run['workflow_name']} version {run['workflow_version']} (no live "
                    "worker registers it)")
        if run.get("blocked"):
            return f"ready, not started: {run['blocked']}"
        live = [w for w in able
                if (w["db_now"] - w["heartbeat_at"]).total_seconds() <= DEAD_AFTER]
        quiet = len(able) - len(live)  # silent or dead (workers list), for up to a minute
        return f"ready; {len(live)} live worker(s) can run {key}" + (
            f" ({quiet} more registered it but stopped heartbeating: silent or dead, see "
            "`orchestrator workers list`)" if quiet else "")
    if run["status"] == "waiting":
        if run.get("blocked"):  # its wait is over; its queue has no room for it yet
            return f"ready to resume, not resumed: {run['blocked']}"
        when = run["available_at"]
        return f"waiting for {run['waiting_for']}" + (f" (wakes at {utc_text(when)})"
                                                       if when else "")
    if run["status"] == "needs_reconciliation":
        return f"blocked: {run['waiting_for']}; see `orchestrator ops list`"
    if run["status"] == "running":
        if holder is not None:
            return _holder_note(holder, workers)
        return f"held by {run['lease_owner']} until {utc_text(run['lease_expires_at'])}"
    return None


def utc_text(when: datetime) -> str:
    """A time as operators read it everywhere (UTC, ``Z``); a naive one is taken as UTC."""
    if when.tzinfo is not None:
        when = when.astimezone(UTC)
    return f"{when:%Y-%m-%d %H:%M:%S}Z"


@dataclass(frozen=True)
class Cancellation:
    """What a cancellation did: the run's status before and after, and how many of its
    unfinished child runs, at every depth, it reached (cancelled, or asked to stop)."""

    before: str
    after: str
    children: int


async def cancel_run(db: Database, run_id: uuid.UUID) -> Cancellation:
    """Cancel a run: its status before and after, and the child runs reached (no ownership
    check: callers do that).

    A queued or waiting run is cancelled at once; a running one at its next command; a run
    blocked on an unknown operation only after that operation is reconciled (C7). A run that
    continued as new (``ctx.continue_as_new``): the last run of its chain. The run's unfinished
    child runs, at every depth, are cancelled with it by the same rules
    (:func:`cancel_locked`). A cancellation whose COMMIT applied but whose answer was lost
    with its connection answers, when the storage layer runs it again, with what it did (the
    status before it, the children it reached), not with the run as it finds it.
    """

    async def cancel(conn: Conn) -> Cancellation:
        row = await runs_db.run_lock_last(conn, run_id)
        if row is None:
            raise AccessDenied("the run does not exist or is not accessible")
        after, children = await cancel_locked(conn, row)
        return Cancellation(str(row["status"]), after, children)

    return await db.run_in_transaction(answered_once(cancel))


async def cancel_locked(conn: Conn, row: dict[str, Any]) -> tuple[str, int]:
    """:func:`cancel_run` inside the caller's transaction, for a run whose row the caller
    locked (``row``: :func:`~orchestrator.db.runs.run_lock`'s). Its unfinished child runs, and
    theirs, are cancelled in the same transaction by the same rules (a cancelled parent leaves
    no work of its own running); a finished child is left as it is, and so are its children,
    and a finished run's cancellation changes nothing at all. Returns the run's status after,
    and how many child runs the cancellation reached."""
    if row["status"] in TERMINAL_STATUSES:
        return str(row["status"]), 0
    after = await _cancel_one(conn, row)
    reached, parents = 0, [row["id"]]
    # One level of the tree at a time, each child's row locked in id order. A child ending
    # meanwhile locks its row, then its parent's (run_finish wakes it): against this order the
    # database may find a deadlock; the cancellation, which waited first, is the one rolled
    # back, and tried again (by the storage layer: a transient error; a schedule's next tick).
    while parents:
        children = await runs_db.run_lock_children(conn, parents)
        for child in children:
            await _cancel_one(conn, child)
        reached += len(children)
        parents = [child["id"] for child in children]
    return after, reached


async def _cancel_one(conn: Conn, row: dict[str, Any]) -> str:
    """Cancel one locked, unfinished run (or ask it to stop); its status after."""
    run_id = row["id"]
    error = json.dumps({"code": "CANCELLED", "message": "the run was cancelled",
                        "retryable": False, "incident": None})
    if row["status"] in ("queued", "waiting") and await runs_db.run_cancel_idle(
            conn, run_id=run_id, revision=row["revision"], error=error):
        return "cancelled"
    await runs_db.run_request_cancel(conn, run_id)
    return str(row["status"])


async def operator_cancel(db: Database, run_id: uuid.UUID, *, operator: str, evidence: str,
                          tenants: list[str] | None) -> Cancellation:
    """An operator's cancellation (:func:`cancel_run`'s rules), audited in the same
    transaction: the operator, the evidence and the run's status before and after
    (``run.cancel``, target ``run``; ``children``: how many unfinished child runs it
    reached). ``tenants`` is the operator's scope (None: all); a run outside it answers
    exactly as a missing one (C9). A cancellation whose COMMIT applied but whose answer was
    lost with its connection answers, when the storage layer runs it again, with what it did
    (as :func:`cancel_run` does), and is audited once."""
    check_evidence(evidence, operator)

    async def cancel(conn: Conn) -> Cancellation:
        row = await runs_db.run_lock_last(conn, run_id)
        if row is None or (tenants is not None and row["tenant"] not in tenants):
            raise AccessDenied("the run does not exist or is not accessible")
        before = str(row["status"])
        after, children = await cancel_locked(conn, row)
        await audit_record(
            conn, operator=operator, action="run.cancel", target_kind="run",
            target_id=str(run_id), tenant=row["tenant"], evidence=evidence,
            before=json.dumps({"status": before,
                               "cancel_requested": row["cancel_requested_at"] is not None}),
            after=json.dumps({"status": after, "cancel_requested": True,
                              "children": children}))
        return Cancellation(before, after, children)

    return await db.run_in_transaction(answered_once(cancel))


@dataclass(frozen=True)
class Restarted:
    """A restart: the new run, where its own history begins, and what it carries over."""

    run_id: uuid.UUID
    restarted_from: uuid.UUID
    from_position: int
    carried: int  # journal entries copied from the old run


async def restart_run(db: Database, run_id: uuid.UUID, *, operator: str, evidence: str,
                      from_position: int | None = None, limits: Any,
                      tenants: list[str] | None = None,
                      owner: tuple[str, str] | None = None) -> Restarted:
    """Restart a finished run as a new run that does not repeat its effects (docs/versioning.md
    "Restarting a run"), audited as ``run.restart``. The new run's journal holds the old one's
    entries before ``from_position`` (default: where the old run went wrong) and, at every
    position, the calls that committed, whose receipts it replays; the rest runs anew, a call
    as a new operation with a new key; the events the old run never consumed are its. Refused
    while an operation of the old run has no outcome (``OPERATION_UNCERTAIN``: reconcile
    first), for a run not finished (``OPERATION_IN_PROGRESS``), pruned (``RUN_PRUNED``) or
    already restarted (``INVALID_REQUEST`` naming the run that superseded it). ``tenants``:
    the operator's scope; ``owner``: only that owner's run (the owner's API); either way
    another's is ACCESS_DENIED. A restart whose COMMIT applied but whose answer was lost with
    its connection answers, when the storage layer runs it again, with the run it made."""
    check_evidence(evidence, operator)
    if from_position is not None and (type(from_position) is not int or from_position < 0):
        raise InvalidRequest("from_position must be a position (0 or more)",
                             path="from_position")

    async def restart(conn: Conn) -> Restarted:
        row = await runs_db.run_lock(conn, run_id, owner=owner)
        if row is None or (tenants is not None and row["tenant"] not in tenants):
            raise AccessDenied("the run does not exist or is not accessible")
        if row["status"] not in TERMINAL_STATUSES:
            raise OperationInProgress(
                f"run {run_id} has not finished (status {row['status']}): only a finished run "
                "is restarted; cancel it first", status=row["status"])
        if row["superseded_by"] is not None and row["outcome_code"] == runs_db.CONTINUED:
            raise InvalidRequest(f"run {run_id} continued as run {row['superseded_by']} "
                                 "(ctx.continue_as_new): restart the last run of its chain",
                                 path="run_id")
        if row["superseded_by"] is not None:
            raise InvalidRequest(f"run {run_id} was already restarted as run "
                                 f"{row['superseded_by']}: restart that one", path="run_id")
        if row["pruned_at"] is not None:
            raise RunPruned(f"run {run_id} was pruned by retention: its journal and input are "
                            "gone, so it cannot be restarted", status=row["status"],
                            outcome=row["outcome_code"], pruned_at=row["pruned_at"])
        operations = await ops_db.operation_list_for_run(conn, run_id)
        open_ops = [o for o in operations if o["state"] in ("pending", "submitted", "unknown")]
        if open_ops:
            raise OperationUncertain(
                f"run {run_id} has {len(open_ops)} operation(s) whose outcome is not known "
                f"(operation {open_ops[0]['id']}, {open_ops[0]['state']}): reconcile them "
                "first (`orchestrator ops list --run`), so that nothing is sent twice",
                known_operations=[{"position": o["position"], "tool": o["tool_name"],
                                   "receipt": o["receipt"]}
                                  for o in operations if o["state"] == "committed"])
        at = (await chains_db.run_failed_position(conn, run_id) if from_position is None
              else from_position)
        input_value = await views_db.run_input(conn, run_id)
        options = row["options"] or {}
        stored = (await queues_db.queue_stored(conn, [row["queue"]])
                  if row["queue"] is not None else None)
        new = new_run(
            row["workflow_name"], row["workflow_version"], input_value, limits=limits,
            owner=Owner.model_construct(tenant=row["tenant"], principal=row["principal"]),
            queues=stored, deadline=options.get("deadline_seconds"),
            queue=row["queue"], priority=row["priority"] or 0,
            concurrency_key=row["concurrency_key"])
        new["traceparent"] = None
        await runs_db.run_insert(conn, new)
        carried = await chains_db.run_journal_carry(conn, old=run_id, new=new["id"], before=at)
        await chains_db.run_children_adopt(conn, old=run_id, new=new["id"], before=at)
        await chains_db.run_events_hand_on(conn, old=run_id, new=new["id"])
        if not await chains_db.run_mark_restarted(conn, new["id"], restarted_from=run_id,
                                                  revision=carried):
            raise InvalidRequest(f"run {new['id']} changed before its restart was recorded",
                                 path="run_id")
        if not await chains_db.run_supersede(conn, old=run_id, new=new["id"]):
            raise InvalidRequest(f"run {run_id} was restarted meanwhile", path="run_id")
        await audit_record(
            conn, operator=operator, action="run.restart", target_kind="run",
            target_id=str(run_id), tenant=row["tenant"], evidence=evidence,
            before=json.dumps({"status": row["status"], "superseded_by": None}),
            after=json.dumps({"superseded_by": str(new["id"]), "from_position": at,
                              "carried_entries": carried}))
        return Restarted(new["id"], run_id, at, carried)

    return await db.run_in_transaction(answered_once(restart))
