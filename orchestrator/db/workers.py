"""Statements on ``orchestrator.workers``: which workers are alive and what they can run."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import psycopg

from orchestrator.db.database import Conn
from orchestrator.db.schema import SCHEMA as S

DEAD_AFTER = 1.0  # seconds without a heartbeat (and without its lock) before a worker is dead


async def worker_register(
    conn: Conn, *, worker_id: str, hostname: str, pid: int, workflows: Sequence[str],
    concurrency: int, lock_key: int | None = None, draining: bool = False,
    lock_wanted: bool = False
) -> None:
    """The worker's row, made (or made again after it was lost: ``draining`` keeps a drain
    that had begun, from now, and an existing row keeps the time it recorded).
    ``lock_wanted``: it takes a liveness lock (it has a place to hold one); without
    ``lock_key`` it holds none yet and claims nothing (``workers list`` says ``waiting``)."""
    await conn.execute(
        f"""
        INSERT INTO {S}.workers (id, hostname, pid, workflows, concurrency, lock_key,
                                 draining_since, lock_wanted)
        VALUES (%s, %s, %s, %s, %s, %s, CASE WHEN %s THEN now() END, %s)
        ON CONFLICT (id) DO UPDATE SET heartbeat_at = now(), workflows = EXCLUDED.workflows,
                                       lock_key = EXCLUDED.lock_key,
                                       lock_wanted = EXCLUDED.lock_wanted,
                                       draining_since = coalesce({S}.workers.draining_since,
                                                                 EXCLUDED.draining_since)
        """,
        (worker_id, hostname, pid, list(workflows), concurrency, lock_key, draining,
         lock_wanted),
    )


class LivenessLock:
    """A dedicated connection holding a session-level advisory lock for a worker's lifetime.

    PostgreSQL releases the lock the moment that connection ends, which is when the worker's
    process dies: other workers then re-queue its runs at once (:func:`run_release_orphaned`)
    instead of waiting for leases to expire. A paused worker keeps its lock and is handled by
    lease expiry and fencing as usual.

    ``url`` is where the lock's session lives (the target's ``session_url``: the database
    itself, or its ``listen_url`` behind a transaction pooler). None means there is no such
    place: a transaction pooler would leave the lock on a server session that outlives the
    worker (held for ever, or by whichever client runs there next). No lock is taken then
    (:attr:`key` is None, and the worker registers none): the worker counts as alive for
    :func:`run_release_orphaned`, so its runs are re-queued only when their leases expire.
    """

    def __init__(self, url: str | None, key: int, *,
                 options: dict[str, Any] | None = None) -> None:
        self.url = url
        self._options = options or {}  # the connection's own (its connect timeout)
        self.key: int | None = key if url is not None else None
        self._conn: psycopg.AsyncConnection[Any] | None = None
        self._closed = False  # for good: the worker stopped
        self.taken = 0  # how many times the lock was taken (a new session each time)

    async def ensure(self) -> bool:
        """Hold the lock, reconnecting if the connection was lost; True when held (always,
        without a place to hold it: there is nothing to hold)."""
        if self.url is None:
            return True
        if self._conn is not None and not self._conn.closed:
            try:
                await self._conn.execute("SELECT 1")
                return True
            except psycopg.Error:
                await self._drop()
        if self._closed:
            return False
        # Not pg_advisory_lock: the session this one replaces may outlive its connection on
        # the server (until its keepalives give up) and keep the lock meanwhile; waiting for
        # it would stop the worker's heartbeat and lease renewals. Tried again next beat.
        conn: psycopg.AsyncConnection[Any] | None = None
        try:
            conn = await psycopg.AsyncConnection.connect(self.url, autocommit=True,
                                                         **self._options)
            cur = await conn.execute("SELECT pg_try_advisory_lock(%s)", (self.key,))
            row = await cur.fetchone()
            if row is not None and row[0] and not self._closed:
                self._conn = conn
                self.taken += 1
                return True
        except psycopg.Error:
            pass
        if conn is not None:
            with contextlib.suppress(psycopg.Error):
                await conn.close()
        return False

    @property
    def held(self) -> bool:
        return self.url is None or (self._conn is not None and not self._conn.closed)

    async def close(self) -> None:
        """Let the lock go, for good. A check still waiting on the connection (a dropped
        network path) then fails at once instead of waiting for the kernel."""
        self._closed = True
        await self._drop()

    async def _drop(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(psycopg.Error):
                await self._conn.close()
            self._conn = None


async def worker_forget_dead(conn: Conn, *, older_than_seconds: float = 3600.0) -> int:
    """Delete registrations whose heartbeat stopped long ago (their runs were re-queued)."""
    cur = await conn.execute(
        f"DELETE FROM {S}.workers WHERE heartbeat_at < now() - make_interval(secs => %s)",
        (older_than_seconds,))
    return cur.rowcount


async def worker_heartbeat(conn: Conn, worker_id: str, *, lock_key: int | None) -> bool:
    """The worker is alive; ``lock_key`` is its liveness lock while it holds it, else None.
    False when the worker has no row any more (forgotten by :func:`worker_forget_dead` after
    a long silence, or deleted by hand): the caller registers again."""
    cur = await conn.execute(
        f"UPDATE {S}.workers SET heartbeat_at = now(), lock_key = %s WHERE id = %s",
        (lock_key, worker_id))
    return cur.rowcount == 1


async def worker_mark_draining(conn: Conn, worker_id: str) -> bool:
    """The worker was told to stop and claims nothing more: its row says since when. False
    when its row is gone (deleted by hand) or says so already (the first time counts)."""
    cur = await conn.execute(
        f"UPDATE {S}.workers SET draining_since = now() "
        "WHERE id = %s AND draining_since IS NULL", (worker_id,))
    return cur.rowcount == 1


async def worker_unregister(conn: Conn, worker_id: str) -> None:
    await conn.execute(f"DELETE FROM {S}.workers WHERE id = %s", (worker_id,))


async def worker_list_live(conn: Conn, *, within_seconds: float) -> list[dict[str, Any]]:
    """Workers whose heartbeat is recent; older rows are left by workers that died. With the
    database's time (``db_now``), to tell their heartbeats' ages by."""
    cur = await conn.execute(
        f"""
        SELECT id, hostname, pid, workflows, concurrency, started_at, heartbeat_at,
               now() AS db_now
        FROM {S}.workers
        WHERE heartbeat_at > now() - make_interval(secs => %s)
        ORDER BY started_at
        """,
        (within_seconds,),
    )
    return await cur.fetchall()


LOCK_HELD = """CASE WHEN w.lock_key IS NULL THEN NULL ELSE EXISTS (
                   SELECT 1 FROM pg_locks l
                   WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
                     AND l.database = (SELECT oid FROM pg_database
                                       WHERE datname = current_database())
                     AND l.classid::bigint = ((w.lock_key >> 32) & 4294967295)
                     AND l.objid::bigint = (w.lock_key & 4294967295)) END AS lock_held"""
"""Whether the liveness lock of worker ``w`` (a row of ``workers``) is held now, as the column
``lock_held`` (None when it registered none): the test of :func:`worker_lease_holder` and the
console's worker list."""


async def worker_lock_seen(conn: Conn, lock_key: int) -> bool:
    """Whether the liveness lock ``lock_key`` is held as seen from ``conn``'s database, by the
    test every sweep and ``workers list`` make (:data:`LOCK_HELD`): a worker checks that the
    lock it took on its ``listen_url`` counts here before it registers."""
    cur = await conn.execute(
        f"SELECT {LOCK_HELD} FROM (SELECT %s::bigint AS lock_key) AS w", (lock_key,))
    row = await cur.fetchone()
    return row is not None and bool(row["lock_held"])


async def worker_lease_holder(conn: Conn, worker_id: str) -> dict[str, Any]:
    """How the worker holding a lease looks from here: the database's ``now``, and, if it is
    still registered (``registered``), its last heartbeat, the seconds since
    (``heartbeat_age``), whether its liveness lock is held (``lock_held``; None when it
    registered none), whether it takes one (``lock_wanted``) and when it began to drain
    (``draining_since``; None if it was not told to stop). A dead worker's runs are
    re-queued by :func:`run_release_orphaned`'s rule: lock gone and heartbeat stale."""
    cur = await conn.execute(
        f"""
        SELECT now() AS db_now, w.id IS NOT NULL AS registered, w.heartbeat_at,
               EXTRACT(EPOCH FROM now() - w.heartbeat_at)::float8 AS heartbeat_age,
               w.draining_since, w.lock_wanted, {LOCK_HELD}
        FROM (SELECT 1) AS one LEFT JOIN {S}.workers w ON w.id = %s
        """,
        (worker_id,),
    )
    row = await cur.fetchone()
    assert row is not None
    return row
