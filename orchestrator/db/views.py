"""Read-only statements behind the operator console (``orchestrator.console``): pages of runs,
incidents and audit rows, the overview's counts, every registered worker.

Nothing here writes. Each statement takes ``tenants``, the operator's scope (None: every
tenant), and applies it in SQL, so that another tenant's rows are never read (C9). Pages are
keyset pages, newest first: a page ends with the key of its last row, and the next page
starts strictly after it, so rows committed meanwhile never shift a page.
"""

from __future__ import annotations

import uuid
from datetime import datetime, timedelta
from typing import Any

from orchestrator.db.database import Conn
from orchestrator.db.runs import _SUMMARY_COLUMNS
from orchestrator.db.schema import SCHEMA as S
from orchestrator.db.workers import LOCK_HELD

_RUN_PAGE = f"""
SELECT {_SUMMARY_COLUMNS} FROM {S}.runs
WHERE (%(tenants)s::text[] IS NULL OR tenant = ANY(%(tenants)s))
  AND (%(status)s::text IS NULL OR status = %(status)s)
  AND (%(workflow)s::text IS NULL OR workflow_name = %(workflow)s)
  AND (%(version)s::text IS NULL OR workflow_version = %(version)s)
  AND (%(skey)s::text IS NULL OR idempotency_key = %(skey)s)
  AND (%(parent)s::uuid IS NULL OR parent_run_id = %(parent)s)
  AND (%(tenant)s::text IS NULL OR tenant = %(tenant)s)
  AND (%(principal)s::text IS NULL OR principal = %(principal)s)
  AND (%(created_from)s::timestamptz IS NULL OR created_at >= %(created_from)s)
  AND (%(created_to)s::timestamptz IS NULL OR created_at < %(created_to)s)
  AND (%(contains)s::jsonb IS NULL OR input @> %(contains)s::jsonb)
  AND (%(before_at)s::timestamptz IS NULL
       OR (created_at, id) < (%(before_at)s::timestamptz, %(before_id)s::uuid))
ORDER BY created_at DESC, id DESC
LIMIT %(limit)s
"""


async def run_page(conn: Conn, *, tenants: list[str] | None, status: str | None = None,
                   workflow: str | None = None, version: str | None = None,
                   submission_key: str | None = None, parent: uuid.UUID | None = None,
                   tenant: str | None = None, principal: str | None = None,
                   created_from: datetime | None = None, created_to: datetime | None = None,
                   contains: str | None = None,
                   before: tuple[datetime, uuid.UUID] | None = None, limit: int = 50
                   ) -> list[dict[str, Any]]:
    """Runs newest first (``created_at``, then ``id``), each filter off when None; ``before``
    is the key of the last row of the previous page. ``tenant`` and ``principal`` name the
    owner (within ``tenants``, the scope); ``created_from`` (inclusive) and ``created_to``
    (exclusive) bound ``created_at``; ``contains`` is a JSON document the input must contain
    (``jsonb @>``: ``{"customer": "c1"}`` for the input condition ``customer = c1``)."""
    before_at, before_id = before if before is not None else (None, None)
    cur = await conn.execute(_RUN_PAGE, {
        "tenants": tenants, "status": status, "workflow": workflow, "version": version,
        "skey": submission_key, "parent": parent, "tenant": tenant, "principal": principal,
        "created_from": created_from, "created_to": created_to, "contains": contains,
        "before_at": before_at, "before_id": before_id, "limit": limit})
    return await cur.fetchall()


async def run_input(conn: Conn, run_id: uuid.UUID) -> Any:
    """A run's input (the caller has checked that the operator may see the run)."""
    cur = await conn.execute(f"SELECT input FROM {S}.runs WHERE id = %s", (run_id,))
    row = await cur.fetchone()
    return None if row is None else row["input"]


async def run_status_counts(conn: Conn, *, tenants: list[str] | None) -> dict[str, int]:
    """How many runs are in each status."""
    cur = await conn.execute(
        f"""SELECT status, count(*) AS n FROM {S}.runs
            WHERE %(tenants)s::text[] IS NULL OR tenant = ANY(%(tenants)s)
            GROUP BY status""",
        {"tenants": tenants})
    return {row["status"]: int(row["n"]) for row in await cur.fetchall()}


async def run_throughput(conn: Conn, *, tenants: list[str] | None, minutes: int = 60
                         ) -> tuple[datetime, list[dict[str, Any]]]:
    """Runs that finished in the last ``minutes`` minutes (the current one included), by
    minute and status: the database's current minute, and rows ``minute`` (the minute's
    start), ``status``, ``n``. There is no index on ``finished_at`` (it would cost every
    run's finishing write its HOT update), so this scans the runs, as the status counts do."""
    cur = await conn.execute("SELECT date_trunc('minute', now()) AS at")
    row = await cur.fetchone()
    assert row is not None
    current: datetime = row["at"]
    cur = await conn.execute(
        f"""SELECT date_trunc('minute', finished_at) AS minute, status, count(*) AS n
            FROM {S}.runs
            WHERE finished_at >= %(since)s
              AND (%(tenants)s::text[] IS NULL OR tenant = ANY(%(tenants)s))
            GROUP BY 1, 2""",
        {"tenants": tenants, "since": current - timedelta(minutes=minutes - 1)})
    return current, [{"minute": r["minute"], "status": r["status"], "n": int(r["n"])}
                     for r in await cur.fetchall()]


async def run_backlog(conn: Conn, *, tenants: list[str] | None) -> dict[str, Any]:
    """The queued runs that are due now: how many, and how long the oldest has waited
    (``oldest_age``, seconds; None when there are none)."""
    cur = await conn.execute(
        f"""SELECT count(*) AS queued,
                   EXTRACT(EPOCH FROM now() - min(available_at))::float8 AS oldest_age
            FROM {S}.runs
            WHERE status = 'queued' AND available_at <= now()
              AND (%(tenants)s::text[] IS NULL OR tenant = ANY(%(tenants)s))""",
        {"tenants": tenants})
    row = await cur.fetchone()
    assert row is not None
    return {"queued": int(row["queued"]), "oldest_age": row["oldest_age"]}


async def operation_unknown_by_tool(conn: Conn, *, tenants: list[str] | None
                                    ) -> list[dict[str, Any]]:
    """Operations whose outcome is unknown, by tool: how many, and for how long the oldest
    has been unknown (``oldest_age``, seconds), the oldest first."""
    cur = await conn.execute(
        f"""SELECT unknown_tool AS tool_name, count(*) AS unknown,
                   EXTRACT(EPOCH FROM now() - min(updated_at))::float8 AS oldest_age
            FROM {S}.operations
            WHERE unknown_tool IS NOT NULL
              AND (%(tenants)s::text[] IS NULL OR tenant = ANY(%(tenants)s))
            GROUP BY unknown_tool ORDER BY min(updated_at), unknown_tool""",
        {"tenants": tenants})
    return await cur.fetchall()


async def recon_waiting_for_operators(conn: Conn, *, tenants: list[str] | None) -> int:
    """How many queue items wait for a person (state ``operator``)."""
    cur = await conn.execute(
        f"""SELECT count(*) AS n FROM {S}.reconciliation_items i
            JOIN {S}.operations o ON o.id = i.operation_id
            WHERE i.state = 'operator'
              AND (%(tenants)s::text[] IS NULL OR o.tenant = ANY(%(tenants)s))""",
        {"tenants": tenants})
    row = await cur.fetchone()
    assert row is not None
    return int(row["n"])


async def worker_list_all(conn: Conn) -> list[dict[str, Any]]:
    """Every registered worker, newest first, with the seconds since its heartbeat
    (``heartbeat_age``), whether its liveness lock is held (``lock_held``; None when it
    registered none), whether it takes one (``lock_wanted``: false behind a transaction pooler
    without a listen_url), how many running runs it holds the lease of (``runs_held``), when
    it began to drain (``draining_since``, null before) and the database's time (``db_now``).
    The lock test is :func:`~orchestrator.db.workers.worker_lease_holder`'s."""
    cur = await conn.execute(
        f"""
        SELECT w.id, w.hostname, w.pid, w.workflows, w.concurrency, w.started_at,
               w.heartbeat_at, w.draining_since, w.lock_wanted, now() AS db_now,
               EXTRACT(EPOCH FROM now() - w.heartbeat_at)::float8 AS heartbeat_age,
               {LOCK_HELD},
               (SELECT count(*) FROM {S}.runs r
                WHERE r.status = 'running' AND r.lease_owner = w.id) AS runs_held
        FROM {S}.workers w
        ORDER BY w.started_at DESC, w.id
        """)
    return await cur.fetchall()


_INCIDENT_PAGE = f"""
SELECT i.ref, i.created_at, i.code, i.run_id, i.operation_id, i.phase, i.cause,
       i.upstream_status, r.tenant
FROM {S}.incidents i LEFT JOIN {S}.runs r ON r.id = i.run_id
WHERE (%(tenants)s::text[] IS NULL OR r.tenant = ANY(%(tenants)s))
  AND (%(run_id)s::uuid IS NULL OR i.run_id = %(run_id)s)
  AND (%(before_at)s::timestamptz IS NULL
       OR (i.created_at, i.ref) < (%(before_at)s::timestamptz, %(before_ref)s::text))
ORDER BY i.created_at DESC, i.ref DESC
LIMIT %(limit)s
"""


async def incident_page(conn: Conn, *, tenants: list[str] | None,
                        run_id: uuid.UUID | None = None,
                        before: tuple[datetime, str] | None = None, limit: int = 50
                        ) -> list[dict[str, Any]]:
    """Incidents newest first, with their summary and tenant (never ``detail``). An
    incident belongs to its run's tenant; one without a run is listed only when ``tenants``
    is None (as :meth:`orchestrator.operators.Operators.incident` reads it)."""
    before_at, before_ref = before if before is not None else (None, None)
    cur = await conn.execute(_INCIDENT_PAGE, {
        "tenants": tenants, "run_id": run_id, "before_at": before_at,
        "before_ref": before_ref, "limit": limit})
    return await cur.fetchall()


_AUDIT_PAGE = f"""
SELECT id, created_at, operator, action, target_kind, target_id, tenant, evidence, before,
       after
FROM {S}.operator_audit
WHERE (%(tenants)s::text[] IS NULL OR tenant = ANY(%(tenants)s))
  AND (%(operator)s::text IS NULL OR operator = %(operator)s)
  AND (%(action)s::text IS NULL OR action = %(action)s
       OR starts_with(action, %(action)s || '.'))
  AND (%(target)s::text IS NULL OR target_id = %(target)s)
  AND (%(kind)s::text IS NULL OR target_kind = %(kind)s)
  AND (%(before)s::bigint IS NULL OR id < %(before)s)
ORDER BY id DESC
LIMIT %(limit)s
"""


async def audit_page(conn: Conn, *, tenants: list[str] | None, operator: str | None = None,
                     action: str | None = None, target: str | None = None,
                     kind: str | None = None, before: int | None = None, limit: int = 50
                     ) -> list[dict[str, Any]]:
    """Audit rows newest first; ``action`` matches itself and the actions under it
    (``resolve`` matches ``resolve.committed``); ``target`` is the target's id (an
    operation's, a run's, a queue's or a schedule's), ``kind`` its ``target_kind``."""
    cur = await conn.execute(_AUDIT_PAGE, {
        "tenants": tenants, "operator": operator, "action": action, "target": target,
        "kind": kind, "before": before, "limit": limit})
    return await cur.fetchall()
