"""Schedules in the database (migration 0011, docs/schedules.md).

A ticker handles a schedule only inside a transaction that holds its row
(:func:`schedule_lock_due`, ``FOR UPDATE SKIP LOCKED``): every decision about its slots is
made and written under that lock, with the runs the slots fire, so that two tickers never
handle one slot and a crash in between leaves nothing half done.
"""

from __future__ import annotations

import json
from datetime import datetime
from typing import Any

from orchestrator.db import runs as runs_db
from orchestrator.db.database import Conn
from orchestrator.db.schema import SCHEMA as S

DEFINITION = ("workflow_name", "workflow_version", "cron", "timezone", "overlap",
              "catchup_seconds", "input", "tenant", "principal", "queue")
"""What a schedule is, as opposed to where it is (its slots, its pause)."""

_COLUMNS = """id, workflow_name, workflow_version, cron, timezone, overlap, catchup_seconds,
input, tenant, principal, declared, paused, paused_at, next_slot, last_slot, last_run_id,
buffered, created_at, updated_at, queue"""


def _params(row: dict[str, Any]) -> dict[str, Any]:
    return {**row, "input": json.dumps(row["input"])}


async def schedule_declare(conn: Conn, row: dict[str, Any]) -> str:
    """Write a schedule declared in code: created, or its definition replaced by the code's
    (its pause and its place kept; its next slot computed again, ``next_slot`` in ``row``,
    when its timing changed). Returns ``created``, ``changed`` or ``same``."""
    cur = await conn.execute(
        f"""
        INSERT INTO {S}.schedules AS s (id, workflow_name, workflow_version, cron, timezone,
            overlap, catchup_seconds, input, tenant, principal, queue, declared, next_slot)
        VALUES (%(id)s, %(workflow_name)s, %(workflow_version)s, %(cron)s, %(timezone)s,
            %(overlap)s, %(catchup_seconds)s, %(input)s::jsonb, %(tenant)s, %(principal)s,
            %(queue)s, true, %(next_slot)s)
        ON CONFLICT (id) DO UPDATE SET
            workflow_name = EXCLUDED.workflow_name, workflow_version = EXCLUDED.workflow_version,
            cron = EXCLUDED.cron, timezone = EXCLUDED.timezone, overlap = EXCLUDED.overlap,
            catchup_seconds = EXCLUDED.catchup_seconds, input = EXCLUDED.input,
            tenant = EXCLUDED.tenant, principal = EXCLUDED.principal, queue = EXCLUDED.queue,
            declared = true,
            next_slot = CASE WHEN (s.cron, s.timezone) = (EXCLUDED.cron, EXCLUDED.timezone)
                             THEN s.next_slot ELSE EXCLUDED.next_slot END,
            updated_at = now()
        WHERE (s.workflow_name, s.workflow_version, s.cron, s.timezone, s.overlap,
               s.catchup_seconds, s.input, s.tenant, s.principal, s.queue, s.declared)
              IS DISTINCT FROM
              (EXCLUDED.workflow_name, EXCLUDED.workflow_version, EXCLUDED.cron,
               EXCLUDED.timezone, EXCLUDED.overlap, EXCLUDED.catchup_seconds, EXCLUDED.input,
               EXCLUDED.tenant, EXCLUDED.principal, EXCLUDED.queue, true)
        RETURNING (xmax = 0) AS created
        """,
        _params(row),
    )
    found = await cur.fetchone()
    if found is None:
        return "same"
    return "created" if found["created"] else "changed"


async def schedule_create(conn: Conn, row: dict[str, Any]) -> bool:
    """Create a schedule at run time; False if one with that id exists."""
    cur = await conn.execute(
        f"""
        INSERT INTO {S}.schedules (id, workflow_name, workflow_version, cron, timezone,
            overlap, catchup_seconds, input, tenant, principal, queue, declared, paused,
            paused_at, next_slot)
        VALUES (%(id)s, %(workflow_name)s, %(workflow_version)s, %(cron)s, %(timezone)s,
            %(overlap)s, %(catchup_seconds)s, %(input)s::jsonb, %(tenant)s, %(principal)s,
            %(queue)s, false, %(paused)s, CASE WHEN %(paused)s THEN now() END, %(next_slot)s)
        ON CONFLICT (id) DO NOTHING
        RETURNING id
        """,
        _params(row),
    )
    return await cur.fetchone() is not None


async def schedule_update(conn: Conn, schedule_id: str, row: dict[str, Any],
                          *, timing_changed: bool) -> dict[str, Any] | None:
    """Replace the definition of a schedule created at run time, whose row ``conn`` holds
    locked (read with :func:`schedule_get`, ``lock=True``, in this transaction: what the new
    definition keeps of the old one was read there). The row afterwards; None for one
    declared in code, which is never changed here, or a missing one."""
    cur = await conn.execute(
        f"""
        UPDATE {S}.schedules SET workflow_name = %(workflow_name)s,
            workflow_version = %(workflow_version)s, cron = %(cron)s, timezone = %(timezone)s,
            overlap = %(overlap)s, catchup_seconds = %(catchup_seconds)s,
            input = %(input)s::jsonb, tenant = %(tenant)s, principal = %(principal)s,
            queue = %(queue)s,
            next_slot = CASE WHEN %(timing_changed)s THEN %(next_slot)s ELSE next_slot END,
            updated_at = now()
        WHERE id = %(id)s AND NOT declared
        RETURNING {_COLUMNS}
        """,
        {**_params(row), "id": schedule_id, "timing_changed": timing_changed},
    )
    return await cur.fetchone()


async def schedule_delete(conn: Conn, schedule_id: str) -> bool:
    """Delete a schedule (its slots and gaps with it; the runs it fired stay)."""
    cur = await conn.execute(f"DELETE FROM {S}.schedules WHERE id = %s", (schedule_id,))
    return cur.rowcount == 1


async def schedule_get(conn: Conn, schedule_id: str, *, lock: bool = False
                       ) -> dict[str, Any] | None:
    cur = await conn.execute(
        f"SELECT {_COLUMNS} FROM {S}.schedules WHERE id = %s"
        + (" FOR UPDATE" if lock else ""), (schedule_id,))
    return await cur.fetchone()


async def schedule_list(conn: Conn) -> list[dict[str, Any]]:
    cur = await conn.execute(f"SELECT {_COLUMNS} FROM {S}.schedules ORDER BY id")
    return await cur.fetchall()


async def schedule_clock(conn: Conn) -> datetime:
    """The database's clock: one clock for every ticker, whatever their hosts' say."""
    cur = await conn.execute("SELECT now() AS now")
    row = await cur.fetchone()
    assert row is not None
    now: datetime = row["now"]
    return now


async def schedule_lock_due(conn: Conn, *, now: datetime, limit: int) -> list[dict[str, Any]]:
    """The schedules with something to do at ``now`` (a slot due, or a buffered slot whose
    previous run may have ended: a paused schedule's too, whose buffered triggers and
    backfills still fire), locked; those another ticker holds are skipped."""
    cur = await conn.execute(
        f"""
        SELECT {_COLUMNS} FROM {S}.schedules s
        WHERE (NOT paused AND (next_slot <= %(now)s OR buffered > 0))
           OR (paused AND buffered > 0 AND EXISTS (
                SELECT 1 FROM {S}.schedule_slots k
                WHERE k.schedule_id = s.id AND k.state = 'buffered' AND k.kind <> 'cron'))
        ORDER BY paused, next_slot NULLS LAST
        LIMIT %(limit)s
        FOR UPDATE SKIP LOCKED
        """,
        {"now": now, "limit": limit},
    )
    return await cur.fetchall()


async def schedule_set_place(conn: Conn, schedule_id: str, *, next_slot: datetime | None,
                             last_slot: datetime | None, last_run_id: Any, buffered: int,
                             queue: str | None) -> None:
    """Where a locked schedule stands after its slots were handled, and the queue its runs
    wait in (as the ticker that handled them knows it)."""
    cur = await conn.execute(
        f"""
        UPDATE {S}.schedules SET next_slot = %(next_slot)s, last_slot = %(last_slot)s,
            last_run_id = %(last_run_id)s, buffered = %(buffered)s, queue = %(queue)s,
            updated_at = now()
        WHERE id = %(id)s
        """,
        {"id": schedule_id, "next_slot": next_slot, "last_slot": last_slot,
         "last_run_id": last_run_id, "buffered": buffered, "queue": queue},
    )
    if cur.rowcount != 1:  # pragma: no cover - the row is locked by this transaction
        raise RuntimeError(f"schedule {schedule_id} vanished under its lock")


async def schedule_set_paused(conn: Conn, schedule_id: str, paused: bool, *,
                              next_slot: datetime | None) -> dict[str, Any]:
    """Pause or resume a schedule whose row ``conn`` holds locked; resuming sets the next slot
    (the first after now). The row afterwards."""
    cur = await conn.execute(
        f"""
        UPDATE {S}.schedules SET paused = %(paused)s,
            paused_at = CASE WHEN %(paused)s THEN COALESCE(paused_at, now()) END,
            next_slot = CASE WHEN %(paused)s OR NOT paused THEN next_slot
                             ELSE %(next_slot)s END,
            updated_at = now()
        WHERE id = %(id)s
        RETURNING {_COLUMNS}
        """,
        {"id": schedule_id, "paused": paused, "next_slot": next_slot},
    )
    row = await cur.fetchone()
    if row is None:  # pragma: no cover - the row is locked by this transaction
        raise RuntimeError(f"schedule {schedule_id} vanished under its lock")
    return row


async def slot_record(conn: Conn, schedule_id: str, slot: datetime, *, kind: str, state: str,
                      overlap: str, reason: str | None = None, run_id: Any = None,
                      trigger_key: str | None = None) -> bool:
    """Record what became of one slot; False if that slot (of that kind) was recorded
    before, which then keeps its record (a backfill over slots already handled)."""
    cur = await conn.execute(
        f"""
        INSERT INTO {S}.schedule_slots (schedule_id, slot, kind, state, reason, overlap,
                                        run_id, trigger_key)
        VALUES (%(id)s, %(slot)s, %(kind)s, %(state)s, %(reason)s, %(overlap)s, %(run_id)s,
                %(trigger_key)s)
        ON CONFLICT DO NOTHING
        """,
        {"id": schedule_id, "slot": slot, "kind": kind, "state": state, "reason": reason,
         "overlap": overlap, "run_id": run_id, "trigger_key": trigger_key},
    )
    return cur.rowcount == 1


async def slot_by_trigger_key(conn: Conn, schedule_id: str, trigger_key: str
                              ) -> dict[str, Any] | None:
    """The slot a trigger sent with ``trigger_key`` recorded, if one did (read under the
    schedule's lock: a trigger with that key that holds it now has committed or not)."""
    cur = await conn.execute(
        f"""
        SELECT slot, state, overlap, run_id FROM {S}.schedule_slots
        WHERE schedule_id = %s AND trigger_key = %s
        """,
        (schedule_id, trigger_key),
    )
    return await cur.fetchone()


async def slots_handled(conn: Conn, schedule_id: str, first: datetime,
                        last: datetime) -> set[datetime]:
    """The slots in ``[first, last]`` the cron or a backfill already handled (a trigger's
    instants are its own)."""
    cur = await conn.execute(
        f"""
        SELECT slot FROM {S}.schedule_slots
        WHERE schedule_id = %s AND slot BETWEEN %s AND %s AND kind IN ('cron', 'backfill')
        """,
        (schedule_id, first, last),
    )
    return {row["slot"] for row in await cur.fetchall()}


async def slot_fire_buffered(conn: Conn, schedule_id: str, slot: datetime, kind: str,
                             run_id: Any) -> None:
    """A buffered slot fires: it names its run now."""
    cur = await conn.execute(
        f"""
        UPDATE {S}.schedule_slots SET state = 'fired', run_id = %(run_id)s,
            recorded_at = now()
        WHERE schedule_id = %(id)s AND slot = %(slot)s AND kind = %(kind)s
          AND state = 'buffered'
        """,
        {"id": schedule_id, "slot": slot, "kind": kind, "run_id": run_id},
    )
    if cur.rowcount != 1:  # pragma: no cover - read under the schedule's lock
        raise RuntimeError(f"schedule {schedule_id}: buffered slot {slot} vanished")


async def slot_oldest_buffered(conn: Conn, schedule_id: str, *, cron: bool = True
                               ) -> dict[str, Any] | None:
    """The oldest buffered slot; with ``cron`` false, the oldest kept by a trigger or a
    backfill (a paused schedule fires those, not the cron's)."""
    cur = await conn.execute(
        f"""
        SELECT slot, kind, overlap, trigger_key FROM {S}.schedule_slots
        WHERE schedule_id = %s AND state = 'buffered' AND (%s OR kind <> 'cron')
        ORDER BY slot, kind LIMIT 1
        """,
        (schedule_id, cron),
    )
    return await cur.fetchone()


async def gap_record(conn: Conn, schedule_id: str, first: datetime, last: datetime,
                     reason: str) -> None:
    await conn.execute(
        f"""
        INSERT INTO {S}.schedule_gaps (schedule_id, first_slot, last_slot, reason)
        VALUES (%s, %s, %s, %s)
        """,
        (schedule_id, first, last, reason),
    )


async def slots_recent(conn: Conn, schedule_id: str, limit: int) -> list[dict[str, Any]]:
    """The newest slots handled, with the status of the run each fired."""
    cur = await conn.execute(
        f"""
        SELECT sl.slot, sl.kind, sl.state, sl.reason, sl.overlap, sl.run_id, sl.recorded_at,
               r.status AS run_status
        FROM {S}.schedule_slots sl LEFT JOIN {S}.runs r ON r.id = sl.run_id
        WHERE sl.schedule_id = %s
        ORDER BY sl.slot DESC, sl.kind LIMIT %s
        """,
        (schedule_id, limit),
    )
    return await cur.fetchall()


async def gaps_recent(conn: Conn, schedule_id: str, limit: int) -> list[dict[str, Any]]:
    cur = await conn.execute(
        f"""
        SELECT first_slot, last_slot, reason, recorded_at FROM {S}.schedule_gaps
        WHERE schedule_id = %s ORDER BY first_slot DESC LIMIT %s
        """,
        (schedule_id, limit),
    )
    return await cur.fetchall()


async def run_status(conn: Conn, run_id: Any) -> str | None:
    """The status of ``run_id``, or, when it continued as new, of the last run of its chain
    (a schedule's run that loops with ``ctx.continue_as_new`` is still running)."""
    last = await runs_db.run_last_id(conn, run_id)
    if last is None:
        return None
    cur = await conn.execute(f"SELECT status FROM {S}.runs WHERE id = %s", (last,))
    row = await cur.fetchone()
    return None if row is None else str(row["status"])
