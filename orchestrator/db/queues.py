"""Queues in the database (migration 0012, docs/flow.md).

A queue's limits are enforced by ``orchestrator.queue_claim`` (the migration says how): here
are its caller, the statements that declare, change, pause and read queues, and the reading of
why a queued run has not started.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from datetime import datetime
from typing import Any

from orchestrator.db.database import RUNS_CHANNEL, Conn
from orchestrator.db.schema import SCHEMA as S

LIMITS = ("concurrency", "worker_concurrency", "key_concurrency", "rate_limit", "rate_seconds",
          "priority", "priority_aging_seconds", "count_parked")
"""A queue's settings (what the code declares and ``queues set`` changes)."""

_TYPES = {"priority": "boolean", "count_parked": "boolean", "rate_seconds": "float8",
          "priority_aging_seconds": "float8", "concurrency": "integer",
          "worker_concurrency": "integer", "key_concurrency": "integer", "rate_limit": "integer"}

_COLUMNS = ", ".join(("name", *LIMITS, "paused", "paused_at", "declared", "overridden",
                      "created_at", "updated_at"))


async def queue_declare(conn: Conn, rows: Sequence[dict[str, Any]]) -> None:
    """Write the queues declared in code: created, or their declared settings replaced by the
    code's, except those set at run time (``overridden``); a pause is kept."""
    for row in rows:
        keep = ", ".join(
            f"{c} = CASE WHEN '{c}' = ANY(q.overridden) THEN q.{c} ELSE EXCLUDED.{c} END"
            for c in LIMITS)
        await conn.execute(
            f"""
            INSERT INTO {S}.queues AS q (name, {', '.join(LIMITS)}, declared)
            VALUES (%(name)s, {', '.join(f'%({c})s' for c in LIMITS)}, %(declared)s::jsonb)
            ON CONFLICT (name) DO UPDATE SET {keep}, declared = EXCLUDED.declared,
                updated_at = now()
            WHERE q.declared IS DISTINCT FROM EXCLUDED.declared
            """,
            {**row, "declared": json.dumps({c: row[c] for c in LIMITS}, sort_keys=True)},
        )


async def queue_names(conn: Conn) -> list[str]:
    """Every queue not paused (what a worker claims from)."""
    cur = await conn.execute(f"SELECT name FROM {S}.queues WHERE NOT paused ORDER BY name")
    return [row["name"] for row in await cur.fetchall()]


async def queue_stored(conn: Conn, names: Sequence[str]) -> set[str]:
    """Which of ``names`` are stored queues (paused or not): where a new run may wait."""
    cur = await conn.execute(f"SELECT name FROM {S}.queues WHERE name = ANY(%s)", (list(names),))
    return {row["name"] for row in await cur.fetchall()}


async def queue_claim(conn: Conn, *, queue: str, worker: str, workflows: Sequence[str],
                      limit: int, ttl: float) -> tuple[list[dict[str, Any]], float | None]:
    """Claim up to ``limit`` runs of ``queue`` that its limits admit (one transaction: the
    function's). Returns the claims (the columns of the default claim) and, when the queue's
    rate window is full, in how many seconds it next has room."""
    cur = await conn.execute(
        f"SELECT * FROM {S}.queue_claim(%(queue)s, %(workflows)s, %(worker)s, %(limit)s, "
        "%(ttl)s)",
        {"queue": queue, "workflows": list(workflows), "worker": worker, "limit": limit,
         "ttl": ttl})
    claims: list[dict[str, Any]] = []
    wake: float | None = None
    for row in await cur.fetchall():
        if row["id"] is None:
            wake = max(0.0, (row["wake_at"] - row["db_now"]).total_seconds())
        else:
            claims.append(row)
    return claims, wake


_STATS = f"""
SELECT q.{_COLUMNS.replace(', ', ', q.')},
       (SELECT count(*) FROM {S}.runs h
        WHERE h.queue = q.name AND h.started_at IS NOT NULL AND h.finished_at IS NULL
          AND (q.count_parked OR h.status <> 'waiting')) AS held,
       (SELECT count(*) FROM {S}.runs h
        WHERE h.queue = q.name AND h.started_at IS NOT NULL AND h.finished_at IS NULL
          AND h.status = 'running') AS running,
       (SELECT count(*) FROM {S}.runs h
        WHERE h.queue = q.name AND h.status IN ('queued', 'waiting')
          AND h.available_at IS NOT NULL AND h.available_at <= now()
          AND NOT (h.started_at IS NOT NULL AND (h.status = 'queued' OR q.count_parked))
       ) AS ready,
       (SELECT EXTRACT(EPOCH FROM now() - min(h.available_at))::float8 FROM {S}.runs h
        WHERE h.queue = q.name AND h.status IN ('queued', 'waiting')
          AND h.available_at IS NOT NULL AND h.available_at <= now()) AS oldest_seconds,
       (SELECT count(*) FROM {S}.runs h
        WHERE h.queue = q.name AND q.rate_limit IS NOT NULL
          AND h.started_at > now() - make_interval(secs => q.rate_seconds)) AS recent_starts
FROM {S}.queues q
"""


async def queue_list(conn: Conn) -> list[dict[str, Any]]:
    """Every queue with its limits and what it holds now."""
    cur = await conn.execute(_STATS + " ORDER BY q.name")
    return await cur.fetchall()


async def queue_lock(conn: Conn, name: str) -> bool:
    """Lock a stored queue's row until the caller's transaction ends (an operator's change
    reads it, then writes it); False if there is no such queue."""
    cur = await conn.execute(f"SELECT 1 FROM {S}.queues WHERE name = %s FOR UPDATE", (name,))
    return await cur.fetchone() is not None


async def queue_get(conn: Conn, name: str) -> dict[str, Any] | None:
    cur = await conn.execute(_STATS + " WHERE q.name = %(name)s", {"name": name})
    return await cur.fetchone()


async def queue_keys(conn: Conn, name: str, limit: int = 20) -> list[dict[str, Any]]:
    """The busiest concurrency keys of a queue, each its tenant's: slots held and runs ready
    to start."""
    cur = await conn.execute(
        f"""
        SELECT tenant, concurrency_key AS key,
               count(*) FILTER (WHERE started_at IS NOT NULL) AS held,
               count(*) FILTER (WHERE started_at IS NULL) AS waiting
        FROM {S}.runs
        WHERE queue = %(name)s AND concurrency_key IS NOT NULL AND finished_at IS NULL
          AND status <> 'needs_reconciliation'
        GROUP BY tenant, concurrency_key
        ORDER BY count(*) DESC, tenant, concurrency_key
        LIMIT %(limit)s
        """, {"name": name, "limit": limit})
    return await cur.fetchall()


async def queue_set(conn: Conn, name: str, changes: dict[str, Any]) -> dict[str, Any] | None:
    """Set some limits of a queue at run time (they then outlive a declaration); wakes the
    workers, whose claims may now admit more. None: no such queue."""
    sets = ", ".join(f"{c} = %({c})s" for c in changes)
    cur = await conn.execute(
        f"""
        UPDATE {S}.queues SET {sets},
            overridden = ARRAY(SELECT DISTINCT unnest(overridden || %(names)s::text[])
                               ORDER BY 1),
            updated_at = now()
        WHERE name = %(name)s
        RETURNING name
        """, {**changes, "names": list(changes), "name": name})
    if await cur.fetchone() is None:
        return None
    await conn.execute("SELECT pg_notify(%s, %s)", (RUNS_CHANNEL, name))
    return await queue_get(conn, name)


async def queue_reset(conn: Conn, name: str) -> dict[str, Any] | None:
    """Back to what the code declared: every limit set at run time is dropped."""
    sets = ", ".join(f"{c} = CASE WHEN declared ? '{c}' THEN (declared->>'{c}')::{_TYPES[c]} "
                     f"ELSE {c} END" for c in LIMITS)
    cur = await conn.execute(
        f"""UPDATE {S}.queues SET {sets}, overridden = '{{}}', updated_at = now()
            WHERE name = %(name)s RETURNING name""", {"name": name})
    if await cur.fetchone() is None:
        return None
    await conn.execute("SELECT pg_notify(%s, %s)", (RUNS_CHANNEL, name))
    return await queue_get(conn, name)


async def queue_pause(conn: Conn, name: str, paused: bool) -> dict[str, Any] | None:
    """Pause (nothing new starts; running runs go on) or resume a queue."""
    cur = await conn.execute(
        f"""
        UPDATE {S}.queues SET paused = %(paused)s,
            paused_at = CASE WHEN %(paused)s THEN coalesce(paused_at, now()) END,
            updated_at = now()
        WHERE name = %(name)s RETURNING name
        """, {"name": name, "paused": paused})
    if await cur.fetchone() is None:
        return None
    if not paused:
        await conn.execute("SELECT pg_notify(%s, %s)", (RUNS_CHANNEL, name))
    return await queue_get(conn, name)


async def run_blockers(conn: Conn, run_ids: Sequence[Any]) -> dict[Any, str]:
    """Why each of these runs, ready and in a queue, has not started: its queue paused, the
    queue's concurrency full, its key busy (a key is its tenant's: only the runs of the run's
    tenant count), the rate window full, or (none of those) its turn not come yet. Runs that
    are not queued in a queue are left out."""
    if not run_ids:
        return {}
    cur = await conn.execute(
        f"""
        SELECT r.id, r.queue, r.concurrency_key, q.paused, q.concurrency, q.key_concurrency,
               q.rate_limit, q.rate_seconds, q.count_parked,
               (SELECT count(*) FROM {S}.runs h
                WHERE h.queue = r.queue AND h.started_at IS NOT NULL AND h.finished_at IS NULL
                  AND (q.count_parked OR h.status <> 'waiting')) AS held,
               (SELECT count(*) FROM {S}.runs h
                WHERE h.queue = r.queue AND h.tenant = r.tenant
                  AND h.concurrency_key = r.concurrency_key
                  AND h.started_at IS NOT NULL AND h.finished_at IS NULL
                  AND (q.count_parked OR h.status <> 'waiting')) AS key_held,
               (SELECT count(*) FROM {S}.runs h
                WHERE h.queue = r.queue AND q.rate_limit IS NOT NULL
                  AND h.started_at > now() - make_interval(secs => q.rate_seconds)
               ) AS recent,
               (SELECT count(*) FROM {S}.runs o
                WHERE o.queue = r.queue AND o.tenant = r.tenant
                  AND o.concurrency_key = r.concurrency_key
                  AND o.started_at IS NULL AND o.status = 'queued'
                  AND o.available_at IS NOT NULL AND o.available_at <= now()
                  AND (o.created_at, o.id) < (r.created_at, r.id)) AS key_ahead
        FROM {S}.runs r LEFT JOIN {S}.queues q ON q.name = r.queue
        WHERE r.id = ANY(%(ids)s::uuid[]) AND r.queue IS NOT NULL
          AND r.status IN ('queued', 'waiting') AND r.available_at IS NOT NULL
          AND r.available_at <= now()
        """, {"ids": list(run_ids)})
    return {row["id"]: blocker(row) for row in await cur.fetchall()}


async def runs_held_by_queue(conn: Conn, run_ids: Sequence[Any], now: datetime
                             ) -> set[Any]:
    """Of these runs, those ready to start (queued, never started) that their queue keeps
    from starting until something outside a worker happens: the queue is paused, or its
    concurrency (or the run's key's, within its tenant) is full and none of the runs holding
    those slots runs or is due by ``now`` (they wait for an event, a child, a timer later
    than ``now``, a reconciliation). A run held only by the rate window is not among them: it
    starts when the window has room."""
    if not run_ids:
        return set()
    cur = await conn.execute(
        f"""
        WITH holders AS (
            SELECT h.queue, h.tenant, h.concurrency_key,
                   (h.status = 'running' OR (h.status IN ('queued', 'waiting')
                        AND h.available_at IS NOT NULL AND h.available_at <= %(now)s)) AS moving
            FROM {S}.runs h JOIN {S}.queues q ON q.name = h.queue
            WHERE h.queue IS NOT NULL AND h.started_at IS NOT NULL AND h.finished_at IS NULL
              AND (q.count_parked OR h.status <> 'waiting')
        )
        SELECT r.id FROM {S}.runs r JOIN {S}.queues q ON q.name = r.queue
        WHERE r.id = ANY(%(ids)s::uuid[]) AND r.status = 'queued' AND r.started_at IS NULL
          AND (q.paused
               OR (q.concurrency IS NOT NULL
                   AND (SELECT count(*) FROM holders h WHERE h.queue = r.queue)
                       >= q.concurrency
                   AND NOT EXISTS (SELECT 1 FROM holders h
                                   WHERE h.queue = r.queue AND h.moving))
               OR (r.concurrency_key IS NOT NULL AND q.key_concurrency IS NOT NULL
                   AND (SELECT count(*) FROM holders h
                        WHERE h.queue = r.queue AND h.tenant = r.tenant
                          AND h.concurrency_key = r.concurrency_key) >= q.key_concurrency
                   AND NOT EXISTS (SELECT 1 FROM holders h
                                   WHERE h.queue = r.queue AND h.tenant = r.tenant
                                     AND h.concurrency_key = r.concurrency_key
                                     AND h.moving)))
        """, {"ids": list(run_ids), "now": now})
    return {row["id"] for row in await cur.fetchall()}


def blocker(row: dict[str, Any]) -> str:
    """The words for one row of :func:`run_blockers`."""
    queue = row["queue"]
    if row["paused"] is None:
        return f"queue {queue} is not declared by any worker yet"
    if row["paused"]:
        return f"queue {queue} is paused"
    if row["concurrency"] is not None and row["held"] >= row["concurrency"]:
        return (f"queue {queue}: concurrency full ({row['held']} of {row['concurrency']} "
                "slots held)")
    if row["concurrency_key"] is not None and row["key_concurrency"] is not None:
        if row["key_held"] >= row["key_concurrency"]:
            return (f"queue {queue}: key {row['concurrency_key']} busy ({row['key_held']} of "
                    f"{row['key_concurrency']})")
        if row["key_ahead"]:
            return (f"queue {queue}: key {row['concurrency_key']} has {row['key_ahead']} "
                    "earlier runs to start first")
    if row["rate_limit"] is not None and row["recent"] >= row["rate_limit"]:
        return (f"queue {queue}: rate window full ({row['recent']} starts in the last "
                f"{row['rate_seconds']:g} s, limit {row['rate_limit']})")
    return f"queue {queue}: waiting for a worker to claim it"
