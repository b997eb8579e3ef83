"""The external effect sink: a fake provider that the chaos harness owns.

It lives in its own database (by default on the test server, not on the cluster the harness
restarts), so duplicates are counted by what happened, not by what the orchestrator believes.

- ``chaos_calls``: one row per invocation of a tool function, written before anything else,
  with the operation's id, attempt and idempotency key, the fault the harness planned for it
  and, when the tool got that far, its outcome (NULL: it never finished, e.g. it was killed).
- ``chaos_keys``: the provider's view of idempotency keys: ``applied``, or ``void`` once a
  lookup (or the harness acting as operator) answered "not applied" for it. A voided key is
  refused forever, so a late request from a paused worker cannot apply after a lookup said it
  had not: that is what makes "not applied" a proof and not a guess.
- ``chaos_effects``: one row per application. A ``consequential`` provider does not
  deduplicate (a second request with a key it already applied is applied again, so a duplicate
  shows); an ``idempotent`` one returns the first receipt for a key it already applied.
- ``chaos_lookups``: every lookup and its answer.

Receipts are ``{"tool", "key", "effect"}``: the key and the id of the first effect row.
"""

from __future__ import annotations

import asyncio
import os
import weakref
from typing import Any

import psycopg
from psycopg.rows import dict_row
from psycopg_pool import AsyncConnectionPool

ENV_SINK_URL = "CHAOS_SINK_URL"
IN_FLIGHT_SECONDS = 3.0  # a lookup answers "still unknown" while a call with the key is this young

DDL = """
CREATE TABLE IF NOT EXISTS chaos_calls (
    id bigserial PRIMARY KEY, tool text NOT NULL, effect text NOT NULL, run_id uuid NOT NULL,
    position int NOT NULL, attempt int NOT NULL, op_id bigint NOT NULL, key text NOT NULL,
    pid int NOT NULL, fault text NOT NULL, outcome text,
    started_at timestamptz NOT NULL DEFAULT clock_timestamp(), finished_at timestamptz);
CREATE INDEX IF NOT EXISTS chaos_calls_key ON chaos_calls (key);
CREATE TABLE IF NOT EXISTS chaos_keys (
    key text PRIMARY KEY, tool text NOT NULL,
    state text NOT NULL CHECK (state IN ('applied', 'void')), first_effect bigint,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE TABLE IF NOT EXISTS chaos_effects (
    id bigserial PRIMARY KEY, tool text NOT NULL, effect text NOT NULL, key text NOT NULL,
    run_id uuid NOT NULL, position int NOT NULL, attempt int NOT NULL, op_id bigint NOT NULL,
    call_id bigint NOT NULL, pid int NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
CREATE INDEX IF NOT EXISTS chaos_effects_key ON chaos_effects (key);
CREATE TABLE IF NOT EXISTS chaos_lookups (
    id bigserial PRIMARY KEY, tool text NOT NULL, key text NOT NULL, op_id bigint NOT NULL,
    answer text NOT NULL, pid int NOT NULL,
    at timestamptz NOT NULL DEFAULT clock_timestamp());
"""


class Refused(Exception):
    """The provider refused the request (its key was voided): nothing was applied."""


def receipt(tool: str, key: str, effect_id: int) -> dict[str, Any]:
    return {"tool": tool, "key": key, "effect": effect_id}


_pools: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, AsyncConnectionPool] = (
    weakref.WeakKeyDictionary())


async def pool() -> AsyncConnectionPool:
    """One small pool per event loop (a worker or reconciler process has one loop)."""
    loop = asyncio.get_running_loop()
    found = _pools.get(loop)
    if found is None:
        found = AsyncConnectionPool(os.environ[ENV_SINK_URL], min_size=1, max_size=12,
                                    kwargs={"autocommit": True, "row_factory": dict_row},
                                    open=False, timeout=20)
        await found.open(wait=True, timeout=20)
        _pools[loop] = found
    return found


async def record_call(*, tool: str, effect: str, run_id: Any, position: int, attempt: int,
                      op_id: int, key: str, fault: str) -> int:
    async with (await pool()).connection() as conn:
        cur = await conn.execute(
            "INSERT INTO chaos_calls (tool, effect, run_id, position, attempt, op_id, key, pid,"
            " fault) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) RETURNING id",
            (tool, effect, run_id, position, attempt, op_id, key, os.getpid(), fault))
        row = await cur.fetchone()
        assert row is not None
        return int(row["id"])


async def finish_call(call_id: int, outcome: str) -> None:
    async with (await pool()).connection() as conn:
        await conn.execute(
            "UPDATE chaos_calls SET outcome = %s, finished_at = clock_timestamp() WHERE id = %s",
            (outcome, call_id))


async def apply(*, call_id: int, tool: str, effect: str, run_id: Any, position: int,
                attempt: int, op_id: int, key: str) -> tuple[dict[str, Any], bool]:
    """Apply one request in one transaction; returns (receipt, deduplicated).

    Raises :class:`Refused` for a voided key.
    """
    async with (await pool()).connection() as conn, conn.transaction():
        cur = await conn.execute(
            "INSERT INTO chaos_keys (key, tool, state) VALUES (%s, %s, 'applied') "
            "ON CONFLICT (key) DO NOTHING RETURNING key", (key, tool))
        fresh = await cur.fetchone() is not None
        if not fresh:
            cur = await conn.execute(
                "SELECT state, first_effect FROM chaos_keys WHERE key = %s FOR UPDATE", (key,))
            row = await cur.fetchone()
            assert row is not None
            if row["state"] == "void":
                raise Refused(f"key {key} was voided")
            if effect == "idempotent":
                return receipt(tool, key, int(row["first_effect"])), True
        cur = await conn.execute(
            "INSERT INTO chaos_effects (tool, effect, key, run_id, position, attempt, op_id,"
            " call_id, pid) VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) RETURNING id",
            (tool, effect, key, run_id, position, attempt, op_id, call_id, os.getpid()))
        got = await cur.fetchone()
        assert got is not None
        effect_id = int(got["id"])
        if fresh:
            await conn.execute("UPDATE chaos_keys SET first_effect = %s WHERE key = %s",
                               (effect_id, key))
            return receipt(tool, key, effect_id), False
        cur = await conn.execute("SELECT first_effect FROM chaos_keys WHERE key = %s", (key,))
        first = await cur.fetchone()
        assert first is not None
        return receipt(tool, key, int(first["first_effect"])), False


async def lookup(*, tool: str, key: str, op_id: int) -> tuple[str, dict[str, Any] | None]:
    """What the provider knows about ``key``: ("committed", receipt), ("not_applied", None)
    (and the key is voided from now on) or ("in_flight", None)."""
    async with (await pool()).connection() as conn:
        async with conn.transaction():
            answer, found = await _lookup_tx(conn, tool, key)
        await conn.execute(
            "INSERT INTO chaos_lookups (tool, key, op_id, answer, pid) VALUES (%s, %s, %s, %s,"
            " %s)", (tool, key, op_id, answer, os.getpid()))
    return answer, found


async def _lookup_tx(conn: Any, tool: str, key: str) -> tuple[str, dict[str, Any] | None]:
    cur = await conn.execute(
        "SELECT state, first_effect FROM chaos_keys WHERE key = %s FOR UPDATE", (key,))
    row = await cur.fetchone()
    if row is None:
        cur = await conn.execute(
            "SELECT 1 FROM chaos_calls WHERE key = %s AND outcome IS NULL AND started_at > "
            "clock_timestamp() - make_interval(secs => %s)", (key, IN_FLIGHT_SECONDS))
        if await cur.fetchone() is not None:
            return "in_flight", None
        cur = await conn.execute(
            "INSERT INTO chaos_keys (key, tool, state) VALUES (%s, %s, 'void') "
            "ON CONFLICT (key) DO NOTHING RETURNING key", (key, tool))
        if await cur.fetchone() is not None:
            return "not_applied", None
        cur = await conn.execute(  # an application committed while we were deciding
            "SELECT state, first_effect FROM chaos_keys WHERE key = %s FOR UPDATE", (key,))
        row = await cur.fetchone()
        assert row is not None
    if row["state"] == "void":
        return "not_applied", None
    return "committed", receipt(tool, key, int(row["first_effect"]))


# -- synchronous access for the harness ---------------------------------------------------------


def create(url: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(DDL)


def operator_evidence(url: str, key: str, tool: str) -> tuple[str, dict[str, Any] | None]:
    """What an operator learns from the provider about ``key``: like a lookup, but at
    quiescence (no call can be in flight), so an unapplied key is voided and reported."""
    with psycopg.connect(url, autocommit=True, row_factory=dict_row) as conn:
        with conn.transaction():
            conn.execute(
                "INSERT INTO chaos_keys (key, tool, state) VALUES (%s, %s, 'void') "
                "ON CONFLICT (key) DO NOTHING", (key, tool))
            row = conn.execute("SELECT state, first_effect FROM chaos_keys WHERE key = %s",
                               (key,)).fetchone()
        assert row is not None
        if row["state"] == "void":
            return "not_applied", None
        return "committed", receipt(tool, key, int(row["first_effect"]))


def load(url: str) -> dict[str, list[dict[str, Any]]]:
    with psycopg.connect(url, autocommit=True, row_factory=dict_row) as conn:
        return {
            "calls": conn.execute("SELECT * FROM chaos_calls ORDER BY id").fetchall(),
            "effects": conn.execute("SELECT * FROM chaos_effects ORDER BY id").fetchall(),
            "keys": conn.execute("SELECT * FROM chaos_keys").fetchall(),
            "lookups": conn.execute("SELECT * FROM chaos_lookups ORDER BY id").fetchall(),
        }
