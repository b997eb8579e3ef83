"""Statements on the operation ledger (``orchestrator.operations``) and its reconciliation queue.

Every transition is a guarded UPDATE: it names the state it expects and requires that the
caller still holds the run's lease; the row count is checked. A trigger in the database also
rejects any arrow not in CONTRACT C5, whatever the statement says.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from orchestrator.db.database import TOOLS_CHANNEL, Conn
from orchestrator.db.schema import SCHEMA as S
from orchestrator.errors import LeaseLost, cancelled_error

_LEASE_HELD = f"""
o.run_id IS NOT DISTINCT FROM %(run_id)s AND EXISTS (SELECT 1 FROM {S}.runs r
        WHERE r.id = %(run_id)s AND r.lease_token = %(token)s AND r.status = 'running')
"""
"""The guard of every transition a worker makes on an operation: the operation is the writing
run's own, and that run is running under the writer's lease token (tokens count per run, so
the token alone does not name the run). Each use finds the operation by its id: the run is
checked as a filter (IS NOT DISTINCT FROM), never as a key, so a plan kept for a prepared
statement finds it by ``pk_operations`` and not among its run's calls."""


class OperationIdentityReused(Exception):
    """An operation identity (run, position, attempt) already exists in the ledger."""


_INSERT = f"""
INSERT INTO {S}.operations (run_id, position, attempt, tool_name, tool_version, effect_class,
                            tenant, principal, intent_digest, arguments, idempotency_key, state,
                            worker_id, lease_token, submitted_at, in_flight_tool)
SELECT %(run_id)s, %(position)s, %(attempt)s, %(tool_name)s, %(tool_version)s,
       %(effect_class)s, %(tenant)s, %(principal)s, %(intent_digest)s, %(arguments)s::jsonb,
       %(idempotency_key)s, %(state)s, %(worker_id)s, %(token)s,
       CASE WHEN %(state)s = 'submitted' THEN now() END,
       CASE WHEN %(state)s = 'submitted' AND %(limited)s THEN %(tool_name)s END
WHERE EXISTS (SELECT 1 FROM {S}.runs r WHERE r.id = %(run_id)s AND r.lease_token = %(token)s
              AND r.status = 'running'
              AND (%(state)s = 'pending' OR r.cancel_requested_at IS NULL)
              -- the run's row held until the commit, as a foreign key's check held it
              -- (migration 0036): no deletion of the run can commit between
              FOR KEY SHARE OF r)
ON CONFLICT (run_id, position, attempt) DO NOTHING
RETURNING id
"""


async def operation_begin(conn: Conn, row: dict[str, Any], *, pending: bool,
                          limited: bool = False) -> tuple[int, str]:
    """Record a new attempt; returns ``(operation id, state)``.

    With ``pending`` (the tool has policy stages) the intent is recorded as ``pending``.
    Otherwise the operation is recorded as ``submitted`` at once (write-ahead: before the tool
    is called), unless a cancellation was requested: then it is recorded ``pending`` and moved
    to ``cancelled`` in the same transaction, and the tool is never called.

    ``row`` holds run_id, position, attempt, tool_name, tool_version, effect_class, tenant,
    principal, intent_digest, arguments (canonical JSON text), idempotency_key, worker_id and
    token. Nothing is written unless the lease is held. ``limited``: the call was admitted
    under its tool's concurrency limit (``tool_admit``, in this transaction): recorded
    ``submitted``, it counts against the limit (``in_flight_tool``) until it settles.
    """
    params = {**row, "limited": limited}
    cur = await conn.execute(_INSERT, {**params, "state": "pending" if pending else "submitted"})
    got = await cur.fetchone()
    if got is not None:
        return int(got["id"]), "pending" if pending else "submitted"
    existing = await (await conn.execute(
        f"""SELECT id, intent_digest FROM {S}.operations
            WHERE run_id = %(run_id)s AND position = %(position)s AND attempt = %(attempt)s""",
        row,
    )).fetchone()
    if existing is not None:
        if existing["intent_digest"] != row["intent_digest"]:
            raise OperationIdentityReused(
                f"operation ({row['run_id']}, {row['position']}, {row['attempt']}) exists "
                "with another intent digest"
            )
        # The same intent under the same identity: an earlier attempt of this very write
        # committed (its acknowledgement was lost). The run has moved on; stop here.
        raise LeaseLost(f"operation {existing['id']} was already recorded")
    cur = await conn.execute(_INSERT, {**params, "state": "pending"})
    got = await cur.fetchone()
    if got is None:
        raise LeaseLost(f"run {row['run_id']} is no longer held under lease {row['token']}")
    await operation_cancel(conn, run_id=row["run_id"], op_id=int(got["id"]), token=row["token"],
                           error=cancelled_error("cancelled"))
    return int(got["id"]), "cancelled"


async def operation_mark_submitted(conn: Conn, *, run_id: uuid.UUID, op_id: int, token: int,
                                   limited: bool = False) -> str:
    """pending → submitted, unless cancellation was requested (then pending → cancelled).

    The check and the transition are one statement, so a cancellation either lands before
    dispatch (the tool is never called) or after it (the tool's signal is set). ``limited``:
    as for :func:`operation_begin`.
    """
    cur = await conn.execute(
        f"""
        UPDATE {S}.operations o SET state = 'submitted', submitted_at = now(), updated_at = now(),
               in_flight_tool = CASE WHEN %(limited)s THEN o.tool_name END
        WHERE o.id = %(op_id)s AND o.state = 'pending' AND o.run_id IS NOT DISTINCT FROM %(run_id)s
          AND EXISTS (SELECT 1 FROM {S}.runs r
                      WHERE r.id = %(run_id)s AND r.lease_token = %(token)s
                        AND r.status = 'running' AND r.cancel_requested_at IS NULL)
        """,
        {"op_id": op_id, "run_id": run_id, "token": token, "limited": limited},
    )
    if cur.rowcount == 1:
        return "submitted"
    await operation_cancel(conn, run_id=run_id, op_id=op_id, token=token,
                           error=cancelled_error("cancelled"))
    return "cancelled"


async def operation_cancel(conn: Conn, *, run_id: uuid.UUID, op_id: int, token: int,
                           error: str | None = None) -> None:
    """pending → cancelled: never dispatched (cancellation, or a policy stage said no)."""
    await _transition(
        conn,
        f"""
        UPDATE {S}.operations o SET state = 'cancelled', error = %(error)s::jsonb,
               finished_at = now(), updated_at = now()
        WHERE o.id = %(op_id)s AND o.state = 'pending' AND {_LEASE_HELD}
        """,
        {"op_id": op_id, "run_id": run_id, "token": token, "error": error},
        "cancellation",
    )


async def _transition(conn: Conn, sql: str, params: dict[str, Any], what: str) -> None:
    cur = await conn.execute(sql, params)
    if cur.rowcount != 1:
        raise LeaseLost(f"operation {params['op_id']}: {what} rejected (state or lease changed)")


async def operation_commit(
    conn: Conn, *, run_id: uuid.UUID, op_id: int, token: int, receipt: str, receipt_digest: str
) -> None:
    """submitted → committed, with the receipt, under the lease."""
    await _transition(
        conn,
        f"""
        UPDATE {S}.operations o SET state = 'committed', receipt = %(receipt)s::jsonb,
               receipt_digest = %(digest)s, finished_at = now(), updated_at = now()
        WHERE o.id = %(op_id)s AND o.state = 'submitted' AND {_LEASE_HELD}
        """,
        {"op_id": op_id, "run_id": run_id, "token": token, "receipt": receipt,
         "digest": receipt_digest},
        "commit",
    )


async def operation_fail(conn: Conn, *, run_id: uuid.UUID, op_id: int, token: int,
                         error: str) -> None:
    """submitted → failed: the tool proved that nothing was applied."""
    await _transition(
        conn,
        f"""
        UPDATE {S}.operations o SET state = 'failed', error = %(error)s::jsonb,
               finished_at = now(), updated_at = now()
        WHERE o.id = %(op_id)s AND o.state = 'submitted' AND {_LEASE_HELD}
        """,
        {"op_id": op_id, "run_id": run_id, "token": token, "error": error},
        "failure",
    )


def _items_resolved_with(resolution: str) -> str:
    """A CTE ``resolved`` that closes the queue item, if any, of each operation in the CTE
    ``settled``: the engine settled it itself, so nothing is left to reconcile."""
    return f"""resolved AS (
        UPDATE {S}.reconciliation_items i
        SET state = 'resolved', resolution = '{resolution}', resolved_at = now(),
            claimed_by = NULL, claimed_until = NULL
        FROM settled WHERE i.operation_id = settled.id AND i.state <> 'resolved'
        RETURNING 1
    )"""


async def operation_mark_unknown(
    conn: Conn,
    *,
    run_id: uuid.UUID, op_id: int,
    token: int,
    reason: str,
    error: str | None = None,
    enqueue: bool = True,
    settle_read: bool = False,
) -> None:
    """submitted → unknown under the lease (CONTRACT C8).

    ``enqueue`` puts it in the reconciliation queue; it is False only when the effect class
    allows a re-send that will settle it. ``settle_read`` moves an uncertain read on to
    ``not_applied`` at once: a read changes nothing, and its repetition is a new attempt. A
    queue item the read already has (a late receipt kept as evidence queues its attempt) is
    resolved with it: nothing is left to reconcile.
    """
    await _transition(
        conn,
        f"""
        UPDATE {S}.operations o SET state = 'unknown', error = %(error)s::jsonb,
               updated_at = now()
        WHERE o.id = %(op_id)s AND o.state = 'submitted' AND {_LEASE_HELD}
        """,
        {"op_id": op_id, "run_id": run_id, "token": token, "error": error},
        "marking unknown",
    )
    if settle_read:
        await _transition(
            conn,
            f"""
            WITH settled AS (
                UPDATE {S}.operations SET state = 'not_applied', finished_at = now(),
                       updated_at = now()
                WHERE id = %(op_id)s AND state = 'unknown'
                RETURNING id
            ), {_items_resolved_with("not_applied")}
            SELECT id FROM settled
            """,
            {"op_id": op_id},
            "settling a read",
        )
    if enqueue:
        await conn.execute(
            f"""
            INSERT INTO {S}.reconciliation_items (operation_id, run_id, reason)
            SELECT id, run_id, %(reason)s FROM {S}.operations WHERE id = %(op_id)s
            ON CONFLICT (operation_id) DO UPDATE SET reason = EXCLUDED.reason
            """,
            {"op_id": op_id, "reason": reason},
        )


async def operation_enqueue(conn: Conn, *, op_id: int, reason: str) -> None:
    """Put an operation that is already unknown into the reconciliation queue."""
    await conn.execute(
        f"""
        INSERT INTO {S}.reconciliation_items (operation_id, run_id, reason)
        SELECT id, run_id, %(reason)s FROM {S}.operations
        WHERE id = %(op_id)s AND state = 'unknown'
        ON CONFLICT (operation_id) DO NOTHING
        """,
        {"op_id": op_id, "reason": reason},
    )


async def operation_settle_resent(
    conn: Conn, *, run_id: uuid.UUID, position: int, key: str, receipt: str,
    receipt_digest: str
) -> int:
    """Earlier unknown attempts re-sent with the same key share the receipt that settled them:
    the provider deduplicated them into one effect. A queue item one of them has (a late
    receipt kept as evidence queues its attempt) is resolved with it: nothing is left to
    reconcile."""
    cur = await conn.execute(
        f"""
        WITH settled AS (
            UPDATE {S}.operations SET state = 'committed', receipt = %(receipt)s::jsonb,
                   receipt_digest = %(digest)s, finished_at = now(), updated_at = now()
            WHERE run_id = %(run_id)s AND position = %(position)s
              AND idempotency_key = %(key)s AND state = 'unknown'
            RETURNING id
        ), {_items_resolved_with("committed")}
        SELECT (SELECT count(*) FROM settled) AS n
        """,
        {"run_id": run_id, "position": position, "key": key, "receipt": receipt,
         "digest": receipt_digest},
    )
    row = await cur.fetchone()
    return int(row["n"]) if row else 0


async def operation_attach_evidence(conn: Conn, *, op_id: int, evidence: str) -> None:
    """A late receipt from a worker that lost its lease: kept as evidence, not as outcome.

    The item is created if the new lease holder has not yet marked the operation unknown; it
    will find the item (and its evidence) when it does. An operation that is already settled
    needs no evidence: nothing is written then.
    """
    await conn.execute(
        f"""
        INSERT INTO {S}.reconciliation_items (operation_id, run_id, reason, evidence)
        SELECT id, run_id, 'WORKER_LOST', jsonb_build_array(%(evidence)s::jsonb)
        FROM {S}.operations WHERE id = %(op_id)s AND state IN ('submitted', 'unknown')
        ON CONFLICT (operation_id) DO UPDATE
        SET evidence = {S}.reconciliation_items.evidence || EXCLUDED.evidence
        """,
        {"op_id": op_id, "evidence": evidence},
    )


async def operation_for_position(
    conn: Conn, run_id: uuid.UUID, position: int
) -> list[dict[str, Any]]:
    """Every attempt recorded for one position of a run, oldest first."""
    cur = await conn.execute(
        f"""
        SELECT id, attempt, state, idempotency_key, intent_digest, receipt, error, effect_class
        FROM {S}.operations WHERE run_id = %s AND position = %s ORDER BY attempt
        """,
        (run_id, position),
    )
    return await cur.fetchall()


async def operation_list_for_run(conn: Conn, run_id: uuid.UUID) -> list[dict[str, Any]]:
    cur = await conn.execute(
        f"""
        SELECT id, position, attempt, tool_name, tool_version, effect_class, state,
               idempotency_key, worker_id, receipt, error, created_at, submitted_at,
               finished_at
        FROM {S}.operations WHERE run_id = %s ORDER BY position, attempt
        """,
        (run_id,),
    )
    return await cur.fetchall()


async def operation_strand(conn: Conn, *, run_id: uuid.UUID, token: int, error: str
                           ) -> list[dict[str, Any]]:
    """Settle what a run is about to leave behind: ``pending`` operations (never dispatched)
    become ``cancelled`` with ``error``; ``submitted`` ones (dispatched, no outcome) become
    ``unknown`` and enter the reconciliation queue. Returns both, each with its new
    ``state``, in the order of their positions, for the journal."""
    held = f"""EXISTS (SELECT 1 FROM {S}.runs r WHERE r.id = %(run_id)s
                  AND r.lease_token = %(token)s AND r.status = 'running')"""
    params = {"run_id": run_id, "token": token, "error": error}
    cur = await conn.execute(
        f"""UPDATE {S}.operations SET state = 'cancelled', error = %(error)s::jsonb,
                   finished_at = now(), updated_at = now()
            WHERE run_id = %(run_id)s AND state = 'pending' AND {held}
            RETURNING id, position, tool_name, state""", params)
    cancelled = await cur.fetchall()
    cur = await conn.execute(
        f"""UPDATE {S}.operations SET state = 'unknown', updated_at = now()
            WHERE run_id = %(run_id)s AND state = 'submitted' AND {held}
            RETURNING id, position, tool_name, state""", params)
    stranded = await cur.fetchall()
    for op in stranded:
        await conn.execute(
            f"""INSERT INTO {S}.reconciliation_items (operation_id, run_id, reason)
                VALUES (%s, %s, 'OUTCOME_UNRECORDED') ON CONFLICT (operation_id) DO NOTHING""",
            (op["id"], run_id))
    await operation_enqueue_unlisted(conn, run_id=run_id)
    return sorted([*cancelled, *stranded], key=lambda op: (op["position"], op["id"]))


async def operation_enqueue_unlisted(conn: Conn, *, run_id: uuid.UUID) -> int:
    """Queue every unknown operation of a run that no reconciliation item lists yet (an
    attempt left for a re-send that never came: the run was cancelled or ran out of time)."""
    cur = await conn.execute(
        f"""
        INSERT INTO {S}.reconciliation_items (operation_id, run_id, reason)
        SELECT o.id, o.run_id, 'RESEND_NOT_MADE' FROM {S}.operations o
        WHERE o.run_id = %s AND o.state = 'unknown'
          AND NOT EXISTS (SELECT 1 FROM {S}.reconciliation_items i
                          WHERE i.operation_id = o.id)
        ON CONFLICT (operation_id) DO NOTHING
        """,
        (run_id,),
    )
    return cur.rowcount


async def operation_count_unknown(conn: Conn, *, run_id: uuid.UUID) -> int:
    cur = await conn.execute(
        f"SELECT count(*) AS n FROM {S}.operations WHERE run_id = %s AND state = 'unknown'",
        (run_id,))
    row = await cur.fetchone()
    return int(row["n"]) if row else 0


# -- tool limits (migration 0012, docs/flow.md) ----------------------------------------------

ADMIT_BUSY = -1.0
"""``tool_admit``: another transaction is admitting a call of the tool; try again shortly."""
ADMIT_FULL = -2.0
"""``tool_admit``: the tool's concurrency is full; try again once a call of it has ended."""


async def tool_admit(conn: Conn, *, tool: str, concurrency: int | None, rate: int | None,
                     per: float | None, timeout: float) -> float | None:
    """Whether a call of ``tool`` may be dispatched now (None: yes, and the caller records its
    operation ``submitted`` in this same transaction), else :data:`ADMIT_BUSY`,
    :data:`ADMIT_FULL` or the seconds until the rate window or the tool's back-off has room.
    ``timeout``: the tool's, for how long an unknown call may still be in flight."""
    cur = await conn.execute(f"SELECT {S}.tool_admit(%s, %s, %s, %s, %s) AS wait",
                             (tool, concurrency, rate, per, timeout))
    row = await cur.fetchone()
    assert row is not None
    wait = row["wait"]
    return None if wait is None else float(wait)


async def tool_dispatched(conn: Conn, *, tool: str, op_id: int) -> None:
    """Count a dispatch of a rate-limited tool in its window (with its admission)."""
    await conn.execute(
        f"INSERT INTO {S}.tool_dispatches (tool, operation_id, at) "
        "VALUES (%s, %s, clock_timestamp())", (tool, op_id))


async def tool_back_off(conn: Conn, *, tool: str, seconds: float) -> datetime:
    """Pause ``tool``'s dispatch for every run for ``seconds`` from now (or longer, if a
    pause already runs past that); tell every worker. Returns the end of the pause."""
    cur = await conn.execute(
        f"""
        INSERT INTO {S}.tool_limits AS l (name, backoff_until)
        VALUES (%(tool)s, now() + make_interval(secs => %(seconds)s))
        ON CONFLICT (name) DO UPDATE
        SET backoff_until = greatest(coalesce(l.backoff_until, EXCLUDED.backoff_until),
                                     EXCLUDED.backoff_until),
            updated_at = now()
        RETURNING backoff_until
        """, {"tool": tool, "seconds": seconds})
    row = await cur.fetchone()
    assert row is not None
    until: datetime = row["backoff_until"]
    await conn.execute("SELECT pg_notify(%s, %s)",
                       (TOOLS_CHANNEL, f"{tool}\t{until.timestamp()}"))
    return until


async def tool_back_offs(conn: Conn) -> dict[str, datetime]:
    """The tools whose dispatch is paused now, and until when."""
    cur = await conn.execute(
        f"SELECT name, backoff_until FROM {S}.tool_limits WHERE backoff_until > now()")
    return {row["name"]: row["backoff_until"] for row in await cur.fetchall()}
