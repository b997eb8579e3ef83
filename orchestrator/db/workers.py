"""Statements on ``orchestrator.workers``: which workers are alive and what they can run."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from orchestrator.db.database import Conn

S = "orchestrator"


async def worker_register(
    conn: Conn, *, worker_id: str, hostname: str, pid: int, workflows: Sequence[str],
    concurrency: int
) -> None:
    await conn.execute(
        f"""
        INSERT INTO {S}.workers (id, hostname, pid, workflows, concurrency)
        VALUES (%s, %s, %s, %s, %s)
        ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), workflows = EXCLUDED.workflows
        """,
        (worker_id, hostname, pid, list(workflows), concurrency),
    )


async def worker_heartbeat(conn: Conn, worker_id: str) -> None:
    await conn.execute(f"UPDATE {S}.workers SET heartbeat_at = now() WHERE id = %s",
                       (worker_id,))


async def worker_unregister(conn: Conn, worker_id: str) -> None:
    await conn.execute(f"DELETE FROM {S}.workers WHERE id = %s", (worker_id,))


async def worker_list_live(conn: Conn, *, within_seconds: float) -> list[dict[str, Any]]:
    """Workers whose heartbeat is recent; older rows are left by workers that died."""
    cur = await conn.execute(
        f"""
        SELECT id, hostname, pid, workflows, concurrency, started_at, heartbeat_at
        FROM {S}.workers
        WHERE heartbeat_at > now() - make_interval(secs => %s)
        ORDER BY started_at
        """,
        (within_seconds,),
    )
    return await cur.fetchall()
