"""Statements on ``orchestrator.runs`` (and the fenced journal append that moves a run's revision).

Every worker-side write is fenced: it only matches while the run is ``running`` under the
caller's lease token (and, for journal appends, at the revision the caller expects). Callers
check the row count and stop working on the run when it is zero (CONTRACT C3, C6).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from orchestrator.canonical import JsonLimits, request_digest
from orchestrator.db.database import (
    CANCEL_CHANNEL,
    DEFAULT_QUEUE_NEWS,
    RECONCILE_CHANNEL,
    RUNS_CHANNEL,
    Conn,
)
from orchestrator.db.events import incident_record
from orchestrator.db.journal import journal_insert_held
from orchestrator.db.schema import SCHEMA as S
from orchestrator.errors import LeaseLost, error_json, new_incident_ref
from orchestrator.flow import Start
from orchestrator.ids import new_run_id
from orchestrator.journal import EventKind, entry
from orchestrator.models import Owner

NEWS_OF = f"coalesce(queue, '{DEFAULT_QUEUE_NEWS}')"
"""The payload on RUNS_CHANNEL that names a run's queue (a row of ``runs``): the queue's name,
or DEFAULT_QUEUE_NEWS for a run outside every queue. Every sender names the queues of the runs
it made claimable, so a worker claims from those alone (docs/flow.md)."""


async def run_news(conn: Conn, queues: Sequence[str]) -> None:
    """News on RUNS_CHANNEL of each of ``queues`` (payloads of :data:`NEWS_OF`), one NOTIFY
    each, in one statement; nothing for none."""
    if queues:
        await conn.execute(f"SELECT pg_notify('{RUNS_CHANNEL}', q) FROM unnest(%s::text[]) q",
                           (sorted(set(queues)),))


def _moved(update: str) -> str:
    """``update`` (an UPDATE of runs ending in ``RETURNING queue``) as the runs it moved per
    queue: one row per queue's news, with how many (a sweep may move thousands)."""
    return f"WITH moved AS ({update}) SELECT {NEWS_OF} AS news, count(*) AS n FROM moved GROUP BY 1"


async def _moved_news(conn: Conn, update: str, params: Any = None) -> int:
    """Run :func:`_moved` ``update``, tell the workers of each queue it touched; how many
    runs it moved."""
    rows = await (await conn.execute(_moved(update), params)).fetchall()
    await run_news(conn, [row["news"] for row in rows])
    return sum(int(row["n"]) for row in rows)

CONTINUED = "CONTINUED_AS_NEW"
"""The outcome code of a run that ended by continuing as a new run (``ctx.continue_as_new``,
migration 0015, docs/versioning.md#long-runs)."""

def run_row(workflow_name: str, workflow_version: str, input: Any, *, limits: JsonLimits,
            owner: Owner, idempotency_key: str | None, deadline: float | None,
            run_id: uuid.UUID | None = None,
            parent: tuple[uuid.UUID, int] | None = None,
            start: Start | None = None, queue: str | None = None, priority: int = 0,
            concurrency_key: str | None = None) -> dict[str, Any]:
    """A new run's row for :func:`run_insert`, its input held to ``limits``. Raises before
    anything is written (a submission's and a child's alike). ``start``: a held-back start;
    ``queue``, ``priority``, ``concurrency_key``: where it waits for its turn (docs/flow.md);
    all part of the request its idempotency key names."""
    input_text = limits.text(input, "$.input")
    options: dict[str, Any] = {}
    if deadline is not None:
        options["deadline_seconds"] = deadline
    if start is not None:
        options.update(start.option())
    if queue is not None:
        options["queue"] = queue
    if priority:
        options["priority"] = priority
    if concurrency_key is not None:
        options["concurrency_key"] = concurrency_key
    return {
        "id": run_id or new_run_id(),
        "tenant": owner.tenant,
        "principal": owner.principal,
        "workflow_name": workflow_name,
        "workflow_version": workflow_version,
        "input": input_text,
        "options": json.dumps(options),
        "request_digest": request_digest(workflow_name, workflow_version, input, options),
        "idempotency_key": idempotency_key,
        "parent_run_id": parent[0] if parent else None,
        "parent_position": parent[1] if parent else None,
        "deadline_seconds": deadline,
        "start_at": start.at if start is not None else None,
        "delay_seconds": start.delay_seconds if start is not None else None,
        "traceparent": None,  # the submitter's span, set by the caller (docs/tracing.md)
        "queue": queue,
        "priority": priority,
        "concurrency_key": concurrency_key,
    }


_START = """(CASE WHEN %(start_at)s::timestamptz IS NOT NULL
              THEN greatest(now(), %(start_at)s::timestamptz)
              WHEN %(delay_seconds)s::float8 IS NOT NULL
              THEN now() + make_interval(secs => %(delay_seconds)s::float8)
              ELSE now() END)"""
"""When a new run may start: now, or held back (:class:`~orchestrator.flow.Start`). Also when
it is due (``due_at``, written once here): what the queue wait and the duration a worker
observes count from (docs/metrics.md); a later wait (a retry, a sleep) makes it ready, not due."""

_INSERT = f"""
INSERT INTO {S}.runs (id, tenant, principal, workflow_name, workflow_version, input, options,
                      request_digest, idempotency_key, parent_run_id, parent_position, status,
                      available_at, deadline_at, traceparent, queue, priority,
                      concurrency_key, cancel_requested_at, due_at)
VALUES (%(id)s, %(tenant)s, %(principal)s, %(workflow_name)s, %(workflow_version)s,
        %(input)s::jsonb, %(options)s::jsonb, %(request_digest)s, %(idempotency_key)s,
        %(parent_run_id)s, %(parent_position)s, 'queued', {_START},
        CASE WHEN %(deadline_seconds)s::float8 IS NULL THEN NULL
             ELSE {_START} + make_interval(secs => %(deadline_seconds)s::float8) END,
        %(traceparent)s, %(queue)s, %(priority)s, %(concurrency_key)s,
        (SELECT p.cancel_requested_at FROM {S}.runs p WHERE p.id = %(parent_run_id)s
         FOR KEY SHARE),
        {_START})
ON CONFLICT DO NOTHING
RETURNING id
"""
"""A child run (``parent_run_id``) inherits its parent's cancellation request: a parent whose
cancellation committed while it was starting the child (past its last check, before its
write) leaves no child running. The parent's row is read ``FOR KEY SHARE`` (the lock the
foreign key's check takes anyway), so a cancellation that holds it (``FOR UPDATE``:
:func:`orchestrator.admin.cancel_locked`) is waited for, and then seen. For a run without a
parent the sub-select's key is NULL: PostgreSQL answers it without reading a page or locking a
row, so one statement serves both."""

_BY_KEY = f"""
SELECT id, request_digest FROM {S}.runs
WHERE (tenant = %(tenant)s AND principal = %(principal)s
       AND idempotency_key = %(idempotency_key)s)
   OR id = %(id)s
ORDER BY id = %(id)s DESC
LIMIT 1
"""
"""The run that holds the submission's key, or the submission's own run: its id is chosen
before the first attempt, so an attempt repeated after a lost connection finds the run that
the first one committed instead of creating a second."""


_SUBMIT = f"""
WITH ins AS ({_INSERT})
SELECT id, (SELECT count(*) FROM (
               SELECT pg_notify('{RUNS_CHANNEL}', coalesce(%(queue)s, '{DEFAULT_QUEUE_NEWS}'))
           ) AS n) AS notified
FROM ins
"""


async def run_insert(conn: Conn, row: dict[str, Any]) -> tuple[uuid.UUID, bool, str | None]:
    """Insert a queued run and wake the workers, or find the run that already holds its
    idempotency key.

    The insert and its NOTIFY are one statement: on an autocommit connection that is one round
    trip, atomic on its own; in a transaction the NOTIFY goes out when it commits. Returns
    ``(run_id, created, existing_digest)``; ``existing_digest`` is set when the key was already
    taken, so the caller can tell a replay from a conflict (CONTRACT C1).

    Running it again with the same row (a retry after a lost connection) is safe, keyed or
    not: the row's id already exists, nothing is inserted, and the run is reported created,
    as the first attempt did create it.
    """
    cur = await conn.execute(_SUBMIT, row)
    inserted = await cur.fetchone()
    if inserted is not None:
        return inserted["id"], True, None
    cur = await conn.execute(_BY_KEY, row)
    existing = await cur.fetchone()
    if existing is None:  # pragma: no cover - ON CONFLICT only skips when the row exists
        raise RuntimeError("a submission conflict without an existing run")
    if existing["id"] == row["id"]:
        return existing["id"], True, None
    return existing["id"], False, existing["request_digest"]


# A run's summary: not its input or result, which no list needs, so that a list stays readable
# whatever a run holds. One run, read by its owner or an operator, comes with its result.
_SUMMARY_COLUMNS = """
id, tenant, principal, workflow_name, workflow_version, options, status, outcome_code,
error, waiting_for, deadline_at, available_at, lease_owner, lease_token,
lease_expires_at, revision, cancel_requested_at, created_at, updated_at, finished_at,
parent_run_id, parent_position, idempotency_key, queue, priority, concurrency_key, started_at,
pruned_at, restarted_from, superseded_by, continued_from
"""
_RUN_COLUMNS = _SUMMARY_COLUMNS + ", result"


_OWNED = """id = %(id)s AND (%(tenant)s::text IS NULL
                              OR (tenant = %(tenant)s AND principal = %(principal)s))"""
"""A run by id, and with ``owner`` only if it is that owner's: a run of another owner is not
read at all (nothing of it is decoded), so it answers exactly as a missing one (C9)."""


def _owned(run_id: uuid.UUID, owner: tuple[str, str] | None) -> dict[str, Any]:
    tenant, principal = owner if owner is not None else (None, None)
    return {"id": run_id, "tenant": tenant, "principal": principal}


async def run_get(conn: Conn, run_id: uuid.UUID, *, owner: tuple[str, str] | None = None,
                  result: bool = True) -> dict[str, Any] | None:
    """A run (``owner``: only if it is that ``(tenant, principal)``'s); ``result=False``
    leaves its result out (a summary)."""
    columns = _RUN_COLUMNS if result else _SUMMARY_COLUMNS
    cur = await conn.execute(f"SELECT {columns} FROM {S}.runs WHERE {_OWNED}",
                             _owned(run_id, owner))
    return await cur.fetchone()


async def run_statuses(conn: Conn, runs: Sequence[tuple[uuid.UUID, str, str]]
                       ) -> dict[tuple[uuid.UUID, str, str], tuple[str, uuid.UUID]]:
    """The status of each ``(run_id, tenant, principal)`` that names that owner's run, and
    the id of the run its chain is at, in one statement whatever their number (what ``wait``
    reads of its runs); a run of another owner is left out, as a missing one is (C9). A run
    that continued as new (``ctx.continue_as_new``) or was restarted has the status and the id
    of the last run of its chain; any other run, its own."""
    cur = await conn.execute(
        f"""
        WITH RECURSIVE chain AS (
            SELECT r.id AS start, r.tenant, r.principal, r.id AS at, r.status,
                   r.outcome_code, r.superseded_by, 0 AS depth
            FROM unnest(%s::uuid[], %s::text[], %s::text[]) AS w(id, tenant, principal)
            JOIN {S}.runs AS r
              ON r.id = w.id AND r.tenant = w.tenant AND r.principal = w.principal
            UNION ALL
            SELECT c.start, c.tenant, c.principal, n.id, n.status, n.outcome_code,
                   n.superseded_by, c.depth + 1
            FROM chain c JOIN {S}.runs AS n ON n.id = c.superseded_by
        )
        SELECT DISTINCT ON (start) start AS id, tenant, principal, status, at
        FROM chain ORDER BY start, depth DESC
        """,
        ([r[0] for r in runs], [r[1] for r in runs], [r[2] for r in runs]),
    )
    return {(row["id"], row["tenant"], row["principal"]): (row["status"], row["at"])
            for row in await cur.fetchall()}


async def run_finished(conn: Conn, runs: Sequence[tuple[uuid.UUID, str, str]]
                       ) -> set[uuid.UUID]:
    """Of the ``(run_id, tenant, principal)`` given, the ids of the runs that are terminal
    (``succeeded``, ``failed``, ``cancelled``), and of those that are not that owner's run
    (missing, or another owner's: C9), in one statement by the primary key however many
    there are; the answer is as small as what finished (what the result waits poll:
    ``orchestrator.waiting``). A run that continued as new is ``succeeded``: its waiter
    follows the chain itself."""
    cur = await conn.execute(
        f"""
        SELECT w.id FROM unnest(%s::uuid[], %s::text[], %s::text[]) AS w(id, tenant, principal)
        LEFT JOIN {S}.runs AS r
          ON r.id = w.id AND r.tenant = w.tenant AND r.principal = w.principal
        WHERE r.id IS NULL OR r.status IN ('succeeded', 'failed', 'cancelled')
        """,
        ([r[0] for r in runs], [r[1] for r in runs], [r[2] for r in runs]),
    )
    return {row["id"] for row in await cur.fetchall()}


async def run_read_snapshot(conn: Conn) -> None:
    """Make the transaction just begun on ``conn`` one read-only snapshot: every run read in
    it is seen as of its first read (``orchestrator.testing`` judges a family of runs idle
    so, never from rows read at different moments)."""
    await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")


async def run_revisions(conn: Conn, run_ids: Sequence[uuid.UUID]
                        ) -> dict[uuid.UUID, dict[str, Any]]:
    """The ``revision`` and ``status`` of each of ``run_ids`` that exists, by the primary key
    in one statement however many there are (what a stream follower polls; no owner check:
    its callers checked the owner when they began)."""
    cur = await conn.execute(
        f"SELECT id, revision, status FROM {S}.runs WHERE id = ANY(%s::uuid[])",
        (list(run_ids),))
    return {row["id"]: row for row in await cur.fetchall()}


async def run_list(
    conn: Conn,
    *,
    tenant: str | None,
    principal: str | None,
    status: str | None,
    workflow: str | None,
    limit: int,
    parent: uuid.UUID | None = None,
    submission_key: str | None = None,
    before: tuple[datetime, uuid.UUID] | None = None,
) -> list[dict[str, Any]]:
    """Newest first (``created_at``, then ``id``). ``tenant``/``principal`` None means every
    owner (operators only); ``parent`` keeps the child runs of that run; ``submission_key``
    the runs submitted with that idempotency key (one per owner at most); ``before`` the runs
    after that key (the last run of the previous page) in this order."""
    before_at, before_id = before if before is not None else (None, None)
    cur = await conn.execute(
        f"""
        SELECT {_SUMMARY_COLUMNS} FROM {S}.runs
        WHERE (%(tenant)s::text IS NULL OR tenant = %(tenant)s)
          AND (%(principal)s::text IS NULL OR principal = %(principal)s)
          AND (%(status)s::text IS NULL OR status = %(status)s)
          AND (%(workflow)s::text IS NULL OR workflow_name = %(workflow)s)
          AND (%(parent)s::uuid IS NULL OR parent_run_id = %(parent)s)
          AND (%(skey)s::text IS NULL OR idempotency_key = %(skey)s)
          AND (%(before_at)s::timestamptz IS NULL
               OR (created_at, id) < (%(before_at)s::timestamptz, %(before_id)s::uuid))
        ORDER BY created_at DESC, id DESC
        LIMIT %(limit)s
        """,
        {"tenant": tenant, "principal": principal, "status": status, "workflow": workflow,
         "limit": limit, "parent": parent, "skey": submission_key, "before_at": before_at,
         "before_id": before_id},
    )
    return await cur.fetchall()


# The oldest ready runs of these workflows, locked, read in the order of ix_runs_claimable
# (migration 0007 says why a function: a plain SELECT here sorted the whole backlog). The
# function's statement reads with a snapshot a moment younger than the UPDATE's: a run that
# became ready in between is locked but not claimed, and stays ready; the NOTIFY that made it
# ready comes after this claim began, so the worker claims again. ``before`` is the row as the
# statement's snapshot has it, before this UPDATE: its status says what the claim is (a first
# start or a replay from ``queued``, a resume from ``waiting``), for the metrics.
_CLAIM = f"""
WITH picked AS (
    SELECT {S}.runs_ready(%(workflows)s, %(limit)s) AS id
)
UPDATE {S}.runs AS r
SET status = 'running', lease_owner = %(worker)s, lease_token = r.lease_token + 1,
    lease_expires_at = now() + make_interval(secs => %(ttl)s), waiting_for = NULL,
    waiting_tool = NULL, available_at = NULL, updated_at = now()
FROM picked JOIN {S}.runs AS before ON before.id = picked.id
WHERE r.id = picked.id
RETURNING r.id, r.tenant, r.principal, r.workflow_name, r.workflow_version,
          r.input::text AS input_text, r.deadline_at, r.lease_token, r.revision,
          r.cancel_requested_at, r.parent_run_id, r.traceparent, now() AS db_now,
          r.due_at, before.status AS claimed_from
"""


async def run_claim_ready(
    conn: Conn, *, worker: str, workflows: Sequence[str], limit: int, ttl: float
) -> list[dict[str, Any]]:
    """Claim up to ``limit`` ready runs of the given ``name@version`` workflows.

    ``FOR UPDATE SKIP LOCKED`` lets many workers claim at once without blocking each other;
    the lease token grows on every claim so that an older holder's writes are rejected.
    The input comes as its JSON text (``input_text``): each run's worker task decodes its own,
    so that no run's content can fail the claim of the others.
    """
    if limit <= 0:
        return []
    cur = await conn.execute(
        _CLAIM, {"worker": worker, "workflows": list(workflows), "limit": limit, "ttl": ttl}
    )
    return await cur.fetchall()


async def run_release_expired(conn: Conn) -> int:
    """Put runs whose lease expired back in the queue; the next claim raises the token."""
    return await _moved_news(
        conn,
        f"""
        UPDATE {S}.runs SET status = 'queued', available_at = now(), lease_owner = NULL,
               lease_expires_at = NULL, updated_at = now()
        WHERE id IN (SELECT id FROM {S}.runs
                     WHERE status = 'running' AND lease_expires_at < now()
                     FOR UPDATE SKIP LOCKED)
        RETURNING queue
        """
    )


_HELD = "r.lease_token = h.token AND r.status = 'running' AND r.lease_owner = %(worker)s"


async def run_heartbeat(
    conn: Conn, *, worker: str, leases: Sequence[tuple[uuid.UUID, int]], ttl: float
) -> set[uuid.UUID]:
    """Extend the leases still held; return the ids whose lease is still ours
    (:func:`run_leases_renew`, of which this is the first half)."""
    return (await run_leases_renew(conn, worker=worker, leases=leases, ttl=ttl))[0]


async def run_leases_renew(
    conn: Conn, *, worker: str, leases: Sequence[tuple[uuid.UUID, int]], ttl: float
) -> tuple[set[uuid.UUID], set[uuid.UUID]]:
    """Extend the leases still held; return the ids whose lease is still ours, and those of
    them that were extended now.

    A run whose row is locked at that moment (almost always by this worker's own write in
    flight) is skipped, not waited for: the renewal and the writer lock the same rows in no
    common order, and waiting would let them deadlock. Its lease still has two thirds of its
    time to run before the next renewal, and it counts as still ours (but not as extended)."""
    if not leases:
        return set(), set()
    cur = await conn.execute(
        f"""
        WITH h AS (
            SELECT * FROM unnest(%(ids)s::uuid[], %(tokens)s::bigint[]) AS h(id, token)
        ), ours AS (
            SELECT r.id FROM {S}.runs r JOIN h ON r.id = h.id WHERE {_HELD}
        ), free AS (  -- the same rows, locked; a locked row's quals are checked again
            SELECT r.id FROM {S}.runs r JOIN h ON r.id = h.id WHERE {_HELD}
            FOR NO KEY UPDATE OF r SKIP LOCKED
        ), renewed AS (
            UPDATE {S}.runs r SET lease_expires_at = now() + make_interval(secs => %(ttl)s)
            FROM free WHERE r.id = free.id
            RETURNING r.id
        )
        SELECT ours.id, renewed.id IS NOT NULL AS renewed
        FROM ours LEFT JOIN renewed ON renewed.id = ours.id
        """,
        {"ttl": ttl, "worker": worker, "ids": [i for i, _ in leases],
         "tokens": [t for _, t in leases]},
    )
    rows = await cur.fetchall()
    return {row["id"] for row in rows}, {row["id"] for row in rows if row["renewed"]}


async def run_lease_extend(conn: Conn, *, run_id: uuid.UUID, token: int, worker: str,
                           ttl: float) -> bool:
    """Extend one run's lease now, waiting for its row if a write of ours holds it; False if
    the lease is no longer ours. (One row and nothing else locked: no deadlock with the
    writer, whose transaction this one only waits for.)"""
    cur = await conn.execute(
        f"""
        UPDATE {S}.runs SET lease_expires_at = now() + make_interval(secs => %(ttl)s)
        WHERE id = %(run_id)s AND lease_token = %(token)s AND status = 'running'
          AND lease_owner = %(worker)s
        """,
        {"ttl": ttl, "run_id": run_id, "token": token, "worker": worker},
    )
    return cur.rowcount == 1


class UnsettledOperations(Exception):
    """A run may not end while an operation is pending, submitted or (but for running out of
    time) unknown: the outcome of its effects would be lost."""


async def run_finish(
    conn: Conn,
    *,
    run_id: uuid.UUID,
    token: int,
    status: str,
    outcome_code: str | None,
    result: str | None,
    error: str | None,
) -> uuid.UUID | None:
    """Record a terminal outcome under the lease; wake the parent run if there is one.

    Guarded in SQL: never while an operation of the run is pending or submitted, nor unknown
    unless the run ran out of time (then the operation stays listed for operators).

    The parent's row is updated unconditionally (and so locked) so that a parent suspending
    concurrently either sees this child finished or is woken by this update.
    """
    cur = await conn.execute(
        f"""
        UPDATE {S}.runs SET status = %(status)s, outcome_code = %(outcome)s,
               result = %(result)s::jsonb, error = %(error)s::jsonb, finished_at = now(),
               updated_at = now(), lease_owner = NULL, lease_expires_at = NULL,
               available_at = NULL, waiting_for = NULL, waiting_tool = NULL
        WHERE id = %(run_id)s AND lease_token = %(token)s AND status = 'running'
          AND NOT EXISTS (
              SELECT 1 FROM {S}.operations o WHERE o.run_id = %(run_id)s
                AND (o.state IN ('pending', 'submitted')
                     OR (o.state = 'unknown' AND %(outcome)s IS DISTINCT FROM
                         'DEADLINE_EXCEEDED')))
        RETURNING parent_run_id, queue
        """,
        {"run_id": run_id, "token": token, "status": status, "outcome": outcome_code,
         "result": result, "error": error},
    )
    row = await cur.fetchone()
    if row is None:
        held = await (await conn.execute(
            f"SELECT 1 FROM {S}.runs WHERE id = %s AND lease_token = %s AND status = 'running'",
            (run_id, token))).fetchone()
        if held is None:
            raise LeaseLost(f"run {run_id} is no longer held under lease {token}")
        raise UnsettledOperations(f"run {run_id} has operations without a settled outcome")
    if row["queue"] is not None:  # a slot of its queue is free: the workers may claim
        await conn.execute("SELECT pg_notify(%s, %s)", (RUNS_CHANNEL, row["queue"]))
    parent: uuid.UUID | None = row["parent_run_id"]
    if parent is not None:
        await run_wake(conn, parent)
    return parent


async def run_wake(conn: Conn, run_id: uuid.UUID) -> None:
    """Make a waiting run claimable now; lock its row whatever its status (see run_finish);
    news of its queue."""
    row = await (await conn.execute(
        f"""
        UPDATE {S}.runs
        SET available_at = CASE WHEN status = 'waiting' THEN now() ELSE available_at END
        WHERE id = %s
        RETURNING {NEWS_OF} AS news
        """,
        (run_id,),
    )).fetchone()
    if row is not None:
        await run_news(conn, [row["news"]])


async def run_suspend(
    conn: Conn,
    *,
    run_id: uuid.UUID,
    token: int,
    wake_at: datetime | None,
    waiting_for: str,
    waiting_tool: str | None,
    event_names: Sequence[str],
    child_positions: Sequence[int],
) -> None:
    """Park a running run until ``wake_at`` (None: until woken) or its deadline.
    ``waiting_for`` says in words what it waits for; ``waiting_tool`` names the tool whose turn
    it waits for, if any (:func:`run_wake_turn` wakes it when a call of that tool ends).

    After the fenced update holds the row lock, a second statement (with a fresh snapshot)
    wakes the run at once if an awaited event or child already arrived, so no wake-up is lost.
    """
    cur = await conn.execute(
        f"""
        UPDATE {S}.runs SET status = 'waiting', waiting_for = %(waiting_for)s,
               waiting_tool = %(waiting_tool)s,
               available_at = CASE
                   WHEN %(wake_at)s::timestamptz IS NULL THEN deadline_at
                   WHEN deadline_at IS NULL THEN %(wake_at)s::timestamptz
                   ELSE LEAST(deadline_at, %(wake_at)s::timestamptz) END,
               lease_owner = NULL, lease_expires_at = NULL, updated_at = now()
        WHERE id = %(run_id)s AND lease_token = %(token)s AND status = 'running'
        RETURNING queue
        """,
        {"run_id": run_id, "token": token, "wake_at": wake_at, "waiting_for": waiting_for,
         "waiting_tool": waiting_tool},
    )
    parked = await cur.fetchone()
    if parked is None:
        raise LeaseLost(f"run {run_id} is no longer held under lease {token}")
    if parked["queue"] is not None:  # its slot may be free now (count_parked=False)
        await conn.execute("SELECT pg_notify(%s, %s)", (RUNS_CHANNEL, parked["queue"]))
    woken = await (await conn.execute(
        f"""
        UPDATE {S}.runs SET available_at = now()
        WHERE id = %(run_id)s AND (
            cancel_requested_at IS NOT NULL
            OR EXISTS (SELECT 1 FROM {S}.external_events
                       WHERE run_id = %(run_id)s AND consumed_position IS NULL
                         AND name = ANY(%(names)s))
            OR EXISTS (SELECT 1 FROM {S}.runs c
                       WHERE c.parent_run_id = %(run_id)s
                         AND c.parent_position = ANY(%(positions)s)
                         AND c.status IN ('succeeded', 'failed', 'cancelled')))
        RETURNING {NEWS_OF} AS news
        """,
        {"run_id": run_id, "names": list(event_names), "positions": list(child_positions)},
    )).fetchone()
    if woken is not None:
        await run_news(conn, [woken["news"]])


async def run_block_for_reconciliation(
    conn: Conn, *, run_id: uuid.UUID, token: int, waiting_for: str
) -> None:
    """Park a run on an unknown operation: nothing claims it until the operation is resolved."""
    cur = await conn.execute(
        f"""
        UPDATE {S}.runs SET status = 'needs_reconciliation', waiting_for = %(waiting_for)s,
               available_at = NULL, lease_owner = NULL, lease_expires_at = NULL,
               updated_at = now()
        WHERE id = %(run_id)s AND lease_token = %(token)s AND status = 'running'
        """,
        {"run_id": run_id, "token": token, "waiting_for": waiting_for},
    )
    if cur.rowcount != 1:
        raise LeaseLost(f"run {run_id} is no longer held under lease {token}")
    await conn.execute(f"SELECT pg_notify('{RECONCILE_CHANNEL}', '')")


async def run_release(conn: Conn, *, run_id: uuid.UUID, token: int, delay: float = 0.0,
                      waiting_for: str | None = None) -> bool:
    """Give a run back to the queue, claimable after ``delay`` seconds (a draining worker
    uses 0); False if the lease was already gone."""
    released = await (await conn.execute(
        f"""
        UPDATE {S}.runs SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL,
               available_at = now() + make_interval(secs => %(delay)s),
               waiting_for = %(waiting_for)s, updated_at = now()
        WHERE id = %(run_id)s AND lease_token = %(token)s AND status = 'running'
        RETURNING {NEWS_OF} AS news
        """,
        {"run_id": run_id, "token": token, "delay": delay, "waiting_for": waiting_for},
    )).fetchone()
    if released is not None:
        await run_news(conn, [released["news"]])
    return released is not None


async def run_release_abandoned(
    conn: Conn, *, worker: str, leases: Sequence[tuple[uuid.UUID, int]]
) -> tuple[set[uuid.UUID], set[uuid.UUID]]:
    """Give back to the queue, at once, the runs a stopping worker abandoned (its drain timed
    out) that have no call in flight; returns the ids released and those kept because a call
    of theirs is ``submitted`` without an outcome (C6: such a run keeps its lease until it
    lapses, and the next holder finds the call ``submitted`` and makes it ``unknown``).
    ``worker`` gives up no run but its own, under the lease ``leases`` names. Run in one
    transaction: the rows are locked first, so the ledger is read after any write of the run
    that was still landing, and the release's row count is checked against them."""
    if not leases:
        return set(), set()
    held = {row["id"] for row in await (await conn.execute(
        f"""
        SELECT r.id FROM {S}.runs r
        JOIN unnest(%(ids)s::uuid[], %(tokens)s::bigint[]) AS h(id, token) ON r.id = h.id
        WHERE r.lease_token = h.token AND r.status = 'running' AND r.lease_owner = %(worker)s
        ORDER BY r.id
        FOR NO KEY UPDATE OF r
        """,
        {"ids": [i for i, _ in leases], "tokens": [t for _, t in leases], "worker": worker},
    )).fetchall()}
    if not held:
        return set(), set()
    in_flight = {row["run_id"] for row in await (await conn.execute(
        f"SELECT DISTINCT run_id FROM {S}.operations "
        "WHERE run_id = ANY(%s::uuid[]) AND state = 'submitted'", (sorted(held),))).fetchall()}
    free = held - in_flight
    if not free:
        return set(), in_flight
    tokens = dict(leases)
    released = await (await conn.execute(
        f"""
        UPDATE {S}.runs r SET status = 'queued', lease_owner = NULL, lease_expires_at = NULL,
               available_at = now(), waiting_for = NULL, updated_at = now()
        FROM unnest(%(ids)s::uuid[], %(tokens)s::bigint[]) AS h(id, token)
        WHERE r.id = h.id AND r.lease_token = h.token AND r.status = 'running'
        RETURNING r.id, {NEWS_OF} AS news
        """,
        {"ids": sorted(free), "tokens": [tokens[i] for i in sorted(free)]},
    )).fetchall()
    if len(released) != len(free):  # the rows are locked: nothing else can have moved them
        raise LeaseLost(f"{len(free) - len(released)} of the runs abandoned were not held any "
                        "more when they were released")
    await run_news(conn, [row["news"] for row in released])
    return {row["id"] for row in released}, in_flight


async def run_lock(conn: Conn, run_id: uuid.UUID, *, owner: tuple[str, str] | None = None
                   ) -> dict[str, Any] | None:
    """Lock a run's row for an API-side change (event delivery, cancellation); ``owner`` as
    for :func:`run_get`."""
    cur = await conn.execute(
        f"SELECT {_SUMMARY_COLUMNS} FROM {S}.runs WHERE {_OWNED} FOR UPDATE",
        _owned(run_id, owner))
    return await cur.fetchone()


_LAST = f"""
WITH RECURSIVE chain AS (
    SELECT id, outcome_code, superseded_by, 0 AS depth FROM {S}.runs WHERE {_OWNED}
    UNION ALL
    SELECT n.id, n.outcome_code, n.superseded_by, c.depth + 1
    FROM chain c JOIN {S}.runs AS n ON n.id = c.superseded_by
)
SELECT id FROM chain ORDER BY depth DESC LIMIT 1
"""


async def run_last_id(conn: Conn, run_id: uuid.UUID, *,
                      owner: tuple[str, str] | None = None) -> uuid.UUID | None:
    """The id of the last run of the chain of continuations (``ctx.continue_as_new``) and
    restarts that ``run_id`` begins or belongs to (each run's ``superseded_by``): ``run_id``
    itself for a run that was not superseded; None when the run is missing or not ``owner``'s
    (the runs that supersede it are the same owner's). One statement however long the
    chain."""
    cur = await conn.execute(_LAST, _owned(run_id, owner))
    row = await cur.fetchone()
    return None if row is None else row["id"]


async def run_lock_last(conn: Conn, run_id: uuid.UUID, *,
                        owner: tuple[str, str] | None = None) -> dict[str, Any] | None:
    """:func:`run_lock` of the last run of ``run_id``'s chain of continuations and restarts
    (what a cancellation or an event sent to the first run's id reaches); locked, it is
    checked again, as it may have continued meanwhile."""
    row = await run_lock(conn, run_id, owner=owner)  # one statement for a run not continued
    while row is not None and row["superseded_by"] is not None:
        last = await run_last_id(conn, row["superseded_by"], owner=owner)
        row = None if last is None else await run_lock(conn, last, owner=owner)
    return row


async def run_lock_children(conn: Conn, parents: Sequence[uuid.UUID]
                            ) -> list[dict[str, Any]]:
    """Lock the unfinished child runs of ``parents`` (the current run of a child that
    continued as new: the earlier ones have finished), in id order, for a cancellation that
    reaches them (:func:`run_lock`'s columns)."""
    cur = await conn.execute(
        f"""
        SELECT {_SUMMARY_COLUMNS} FROM {S}.runs
        WHERE parent_run_id = ANY(%s) AND status NOT IN ('succeeded', 'failed', 'cancelled')
        ORDER BY id FOR UPDATE
        """,
        (list(parents),))
    return await cur.fetchall()


async def run_request_cancel(conn: Conn, run_id: uuid.UUID) -> None:
    """Ask a run to cancel: a waiting run is claimable now (news of its queue), a running
    one's worker hears it on CANCEL_CHANNEL."""
    row = await (await conn.execute(
        f"""
        UPDATE {S}.runs SET cancel_requested_at = COALESCE(cancel_requested_at, now()),
               available_at = CASE WHEN status = 'waiting' THEN now() ELSE available_at END,
               updated_at = now()
        WHERE id = %s AND status NOT IN ('succeeded', 'failed', 'cancelled')
        RETURNING {NEWS_OF} AS news
        """,
        (run_id,),
    )).fetchone()
    if row is not None:
        await run_news(conn, [row["news"]])
    await conn.execute("SELECT pg_notify(%s, %s)", (CANCEL_CHANNEL, str(run_id)))


async def run_cancel_idle(conn: Conn, *, run_id: uuid.UUID, revision: int, error: str) -> bool:
    """Cancel a run that no worker holds (queued or waiting), appending ``run.cancelled``.

    Not when an operation of the run is unsettled (a worker died mid-call): then a worker must
    first replay it and record what is unknown; the cancellation request waits for that.

    The caller holds the row lock (:func:`run_lock`), so appending at ``revision + 1`` is safe.
    """
    cur = await conn.execute(
        f"""
        UPDATE {S}.runs SET status = 'cancelled', outcome_code = 'CANCELLED',
               error = %(error)s::jsonb, finished_at = now(), updated_at = now(),
               available_at = NULL, waiting_for = NULL, waiting_tool = NULL,
               revision = revision + 1,
               cancel_requested_at = COALESCE(cancel_requested_at, now())
        WHERE id = %(run_id)s AND status IN ('queued', 'waiting') AND revision = %(revision)s
          AND NOT EXISTS (SELECT 1 FROM {S}.operations o WHERE o.run_id = %(run_id)s
                          AND o.state IN ('pending', 'submitted', 'unknown'))
        RETURNING parent_run_id, lease_token, queue
        """,
        {"run_id": run_id, "revision": revision, "error": error},
    )
    row = await cur.fetchone()
    if row is None:
        return False
    if row["queue"] is not None:
        await conn.execute("SELECT pg_notify(%s, %s)", (RUNS_CHANNEL, row["queue"]))
    await journal_insert_held(conn, run_id=run_id, token=row["lease_token"], revision=revision,
                              events=[entry(EventKind.RUN_CANCELLED, None, None, {})])
    if row["parent_run_id"] is not None:
        await run_wake(conn, row["parent_run_id"])
    return True


DEADLINE_PASSED = "the run's deadline passed"


async def run_any_unstarted_expired(conn: Conn) -> bool:
    """Whether a run's deadline passed before it started (:func:`run_expire_unstarted` has
    work): one probe of the partial index, no lock, so that a sweep with nothing to end
    opens no transaction."""
    cur = await conn.execute(
        f"""
        SELECT 1 FROM {S}.runs
        WHERE status = 'queued' AND revision = 0 AND deadline_at IS NOT NULL
          AND deadline_at <= now()
        LIMIT 1
        """)
    return await cur.fetchone() is not None


async def run_expire_unstarted(conn: Conn, *, limit: int = 100) -> list[dict[str, Any]]:
    """End ``failed`` with ``DEADLINE_EXCEEDED`` the runs whose deadline passed before they
    ever started (queued, nothing written yet: held back by their queue's limits or its
    pause, or by the lack of a worker that serves them), at most ``limit``, each with its
    ``run.failed`` entry and an incident, as a worker ends a run whose deadline passed: a
    deadline is one wall-clock expiry, whatever keeps the run waiting (CONTRACT C7, C15).
    Their parents are woken and their queues told. Rows another transaction holds (a claim)
    are skipped. The runs ended: ``id``, ``workflow_name``, ``workflow_version``,
    ``incident``."""
    cur = await conn.execute(
        f"""
        SELECT id, lease_token, parent_run_id, queue, workflow_name, workflow_version
        FROM {S}.runs
        WHERE status = 'queued' AND revision = 0 AND deadline_at IS NOT NULL
          AND deadline_at <= now()
        ORDER BY deadline_at LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
        """, {"limit": limit})
    ended = []
    for row in await cur.fetchall():
        ref = new_incident_ref()
        ended_row = await conn.execute(
            f"""
            UPDATE {S}.runs SET status = 'failed', outcome_code = 'DEADLINE_EXCEEDED',
                   error = %(error)s::jsonb, finished_at = now(), updated_at = now(),
                   available_at = NULL, waiting_for = NULL, waiting_tool = NULL,
                   revision = revision + 1
            WHERE id = %(id)s AND status = 'queued' AND revision = 0
            """, {"id": row["id"], "error": error_json("DEADLINE_EXCEEDED", DEADLINE_PASSED, ref)})
        if ended_row.rowcount != 1:  # the row is locked: nothing else can have moved it
            raise RuntimeError(f"run {row['id']} moved under its lock while its deadline ended it")
        await journal_insert_held(conn, run_id=row["id"], token=row["lease_token"], revision=0,
                                  events=[entry(EventKind.RUN_FAILED, None, None, {
                                      "code": "DEADLINE_EXCEEDED", "message": DEADLINE_PASSED,
                                      "incident": ref})])
        await incident_record(conn, {
            "ref": ref, "code": "DEADLINE_EXCEEDED", "run_id": row["id"], "operation_id": None,
            "phase": "workflow", "cause": None, "upstream_status": None,
            "detail": json.dumps({"message": DEADLINE_PASSED, "started": False})})
        if row["queue"] is not None:
            await conn.execute("SELECT pg_notify(%s, %s)", (RUNS_CHANNEL, row["queue"]))
        if row["parent_run_id"] is not None:
            await run_wake(conn, row["parent_run_id"])
        ended.append({**row, "incident": ref})
    return ended


async def run_children_status(
    conn: Conn, parent_id: uuid.UUID, positions: Sequence[int]
) -> list[dict[str, Any]]:
    cur = await conn.execute(
        f"""
        SELECT id, parent_position, status, outcome_code, result, error FROM {S}.runs
        WHERE parent_run_id = %s AND parent_position = ANY(%s)
        """,
        (parent_id, list(positions)),
    )
    return await cur.fetchall()


async def run_release_orphaned(conn: Conn, *, stale: float) -> int:
    """Re-queue runs held by workers that died: their liveness lock is gone *and* their
    heartbeat is older than ``stale`` seconds. (A live worker whose lock connection merely
    blipped keeps heartbeating and re-takes its lock; its runs stay with it.) A server that
    restarted ended every lock: a heartbeat from before its start counts from the start, so
    each worker has ``stale`` seconds from it to reconnect, heartbeat and take its lock again
    (the first worker back, reconnecting within a second, swept the others' runs, and its
    own, as dead: their calls in flight went to reconciliation)."""
    return await _moved_news(
        conn,
        f"""
        UPDATE {S}.runs SET status = 'queued', available_at = now(), lease_owner = NULL,
               lease_expires_at = NULL, updated_at = now()
        WHERE id IN (
            SELECT r.id FROM {S}.runs r JOIN {S}.workers w ON w.id = r.lease_owner
            WHERE r.status = 'running' AND w.lock_key IS NOT NULL
              AND greatest(w.heartbeat_at, pg_postmaster_start_time())
                  < now() - make_interval(secs => %(stale)s)
              AND NOT EXISTS (
                  SELECT 1 FROM pg_locks l
                  WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
                    AND l.database = (SELECT oid FROM pg_database
                                      WHERE datname = current_database())
                    AND l.classid::bigint = ((w.lock_key >> 32) & 4294967295)
                    AND l.objid::bigint = (w.lock_key & 4294967295))
            FOR UPDATE OF r SKIP LOCKED)
        RETURNING queue
        """,
        {"stale": stale},
    )


async def run_wake_turn(conn: Conn, tool: str, count: int) -> int:
    """Wake the ``count`` runs parked longest for the turn of ``tool`` (a call of it ended, so
    its concurrency has room): they claim again and ask for admission (docs/flow.md). The
    tool's exact name, read in ``ix_runs_turn_waiters``: the runs waiting for another tool
    stay parked, whatever its name."""
    return await _moved_news(
        conn,
        f"""
        UPDATE {S}.runs SET available_at = now()
        WHERE id IN (SELECT id FROM {S}.runs
                     WHERE status = 'waiting' AND waiting_tool = %(tool)s
                       AND available_at > now()
                     ORDER BY available_at LIMIT %(count)s
                     FOR UPDATE SKIP LOCKED)
        RETURNING queue
        """, {"tool": tool, "count": count})


_READ_FOR_REPLAY = f"""
SELECT id, workflow_name, workflow_version, status, tenant, principal, input, created_at,
       outcome_code, pruned_at
FROM {S}.runs
WHERE (%(run_id)s::uuid IS NULL OR id = %(run_id)s::uuid)
  AND (%(run_id)s::uuid IS NOT NULL OR pruned_at IS NULL)
  AND (%(workflow)s::text IS NULL OR workflow_name = %(workflow)s::text)
  AND (%(version)s::text IS NULL OR workflow_version = %(version)s::text)
  AND (%(since)s::timestamptz IS NULL OR created_at >= %(since)s::timestamptz)
  AND (%(all)s OR status NOT IN ('succeeded', 'failed', 'cancelled'))
ORDER BY created_at DESC, id DESC
LIMIT %(limit)s
"""


async def run_read_for_replay(conn: Conn, *, run_id: uuid.UUID | None, workflow: str | None,
                              version: str | None, since: datetime | None, last: int,
                              finished: bool) -> list[dict[str, Any]]:
    """The newest ``last`` runs the filters select, whatever their owner, for ``orchestrator
    replay`` (each with its workflow, status, owner and input); ``finished=False``: only those
    that have not ended. Runs that retention pruned (no journal, no input) are left out, but
    for the one ``run_id`` names (with its ``pruned_at``, for the caller to refuse)."""
    cur = await conn.execute(_READ_FOR_REPLAY, {
        "run_id": run_id, "workflow": workflow, "version": version, "since": since,
        "all": finished, "limit": last})
    return list(await cur.fetchall())
