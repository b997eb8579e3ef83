"""Statements on external events (``orchestrator.external_events``) and incidents."""

from __future__ import annotations

import uuid
from typing import Any, Literal

from orchestrator.db.database import EVENTS_CHANNEL, Conn
from orchestrator.db.schema import SCHEMA as S


async def event_insert(
    conn: Conn, *, run_id: uuid.UUID, name: str, event_key: str | None, payload: str
) -> bool:
    """Store an event for a run; False when an event with this key was already delivered."""
    cur = await conn.execute(
        f"""
        INSERT INTO {S}.external_events (run_id, name, event_key, payload)
        VALUES (%s, %s, %s, %s::jsonb)
        ON CONFLICT (run_id, event_key) DO NOTHING
        """,
        (run_id, name, event_key, payload),
    )
    return cur.rowcount == 1


async def event_announce(conn: Conn, *, run_id: uuid.UUID, name: str) -> None:
    """Tell the worker that holds the run, if one does, that an event ``name`` was stored for
    it (on commit): a branch waiting for it takes it in place, while other branches keep the
    run in that worker. Without a listener it is taken at the run's next park and claim."""
    await conn.execute("SELECT pg_notify(%s, %s)", (EVENTS_CHANNEL, f"{run_id}\t{name}"))


async def event_pending_count(conn: Conn, *, run_id: uuid.UUID, cap: int) -> int:
    """How many events wait for the run to consume them, counted up to ``cap`` (a bounded
    scan whatever the backlog)."""
    cur = await conn.execute(
        f"""
        SELECT count(*) AS n FROM (
            SELECT 1 FROM {S}.external_events
            WHERE run_id = %s AND consumed_position IS NULL LIMIT %s) AS waiting
        """,
        (run_id, cap))
    row = await cur.fetchone()
    assert row is not None
    return int(row["n"])


SEEN_GENERATIONS = 16
"""How many runs of a chain of continuations (``ctx.continue_as_new``) a keyed event's key is
looked for in: the run and the 15 it continues, newest first."""


async def event_seen(conn: Conn, *, run_id: uuid.UUID, event_key: str, name: str,
                     payload: str) -> Literal["same", "different"] | None:
    """Whether an event with this key was delivered to the run, or to one of the last runs
    it continues or restarts (:data:`SEEN_GENERATIONS`): a sender's retry that comes after
    the run went on as a new one is still recognised. None: never; ``same``: with this name
    and an equal payload (JSON equality: key order does not count); ``different``: with
    another name or payload, a reuse of the key for another event."""
    cur = await conn.execute(
        f"""
        WITH RECURSIVE chain AS (
            SELECT id, coalesce(continued_from, restarted_from) AS before, 1 AS depth
            FROM {S}.runs WHERE id = %(run)s
            UNION ALL
            SELECT r.id, coalesce(r.continued_from, r.restarted_from), c.depth + 1
            FROM chain c JOIN {S}.runs r ON r.id = c.before
            WHERE c.depth < %(depth)s
        )
        SELECT e.name = %(name)s AND e.payload = %(payload)s::jsonb AS same
        FROM {S}.external_events e JOIN chain c ON e.run_id = c.id
        WHERE e.event_key = %(key)s LIMIT 1
        """, {"run": run_id, "key": event_key, "depth": SEEN_GENERATIONS, "name": name,
              "payload": payload})
    row = await cur.fetchone()
    if row is None:
        return None
    return "same" if row["same"] else "different"


async def event_take(
    conn: Conn, *, run_id: uuid.UUID, name: str, position: int
) -> dict[str, Any] | None:
    """Consume the oldest undelivered event ``name`` for the command at ``position``.

    Must run in the same transaction as the fenced journal append that records it, so that a
    rejected append leaves the event undelivered.
    """
    cur = await conn.execute(
        f"""
        UPDATE {S}.external_events SET consumed_position = %(position)s
        WHERE id = (SELECT id FROM {S}.external_events
                    WHERE run_id = %(run_id)s AND name = %(name)s AND consumed_position IS NULL
                    ORDER BY id LIMIT 1 FOR UPDATE)
        RETURNING id, payload, event_key
        """,
        {"run_id": run_id, "name": name, "position": position},
    )
    return await cur.fetchone()


async def incident_record(conn: Conn, row: dict[str, Any]) -> None:
    """Store protected diagnostics under an incident reference (CONTRACT C10)."""
    await conn.execute(
        f"""
        INSERT INTO {S}.incidents (ref, code, run_id, operation_id, phase, cause,
                                   upstream_status, detail)
        VALUES (%(ref)s, %(code)s, %(run_id)s, %(operation_id)s, %(phase)s, %(cause)s,
                %(upstream_status)s, %(detail)s::jsonb)
        ON CONFLICT (ref) DO NOTHING
        """,
        row,
    )


async def incidents_of_operations(conn: Conn, run_id: uuid.UUID, operation_ids: list[int]
                                  ) -> list[dict[str, Any]]:
    """The incident references kept for some operations of a run, oldest first, with their
    summary (never ``detail``: a role granted only the summary may read this)."""
    cur = await conn.execute(
        f"""SELECT ref, code, operation_id, phase, cause, upstream_status, created_at
            FROM {S}.incidents
            WHERE run_id = %s AND operation_id = ANY(%s) ORDER BY created_at, ref""",
        (run_id, operation_ids))
    return await cur.fetchall()


async def incident_reasons(conn: Conn, run_id: uuid.UUID, refs: list[str]) -> dict[str, str]:
    """What lookups said (a ``NotApplied``'s or ``StillUnknown``'s reason), by the reference
    of the ``LOOKUP`` incident that keeps it: tool text, read from ``detail`` (a role granted
    only the incidents' summary is refused, ``CONFIGURATION_ERROR``)."""
    cur = await conn.execute(
        f"""SELECT ref, detail->>'reason' AS reason FROM {S}.incidents
            WHERE run_id = %s AND ref = ANY(%s) AND code = 'LOOKUP'""",
        (run_id, refs))
    return {row["ref"]: row["reason"] for row in await cur.fetchall()
            if row["reason"] is not None}


async def incident_get(conn: Conn, ref: str) -> dict[str, Any] | None:
    """An incident with the tenant it belongs to (``tenant``): its run's, or None for an
    incident without a run or whose run is gone."""
    cur = await conn.execute(
        f"""SELECT i.*, r.tenant FROM {S}.incidents i LEFT JOIN {S}.runs r ON r.id = i.run_id
            WHERE i.ref = %s""",
        (ref,))
    return await cur.fetchone()
