"""Retention in the database (migrations 0013 and 0016, docs/retention.md): the calls of
``orchestrator.prune_runs``, ``orchestrator.prune_schedule_slots`` and
``orchestrator.expire_evidence``, whose checks are the rules,
and the reading of the evidence for ``orchestrator evidence export``."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from orchestrator.db.database import Conn
from orchestrator.db.schema import SCHEMA as S

EXPIRE_FUNCTION = f"{S}.expire_evidence(double precision, integer, boolean)"


@dataclass(frozen=True)
class Pruned:
    """One batch of ``prune_runs`` (or, with ``dry``, what it would prune: ``runs`` alone)."""

    runs: int
    journal_rows: int
    events: int


@dataclass(frozen=True)
class Expired:
    """One batch of ``expire_evidence`` (or, with ``dry``, what it would delete)."""

    runs: int
    operations: int
    audit: int
    incidents: int


async def prune_batch(conn: Conn, *, keep: float, names: Sequence[str],
                      keeps: Sequence[float], limit: int, dry: bool = False) -> Pruned:
    cur = await conn.execute(
        f"SELECT runs, journal_rows, events FROM {S}.prune_runs("
        "%s::float8, %s::text[], %s::float8[], %s, %s)",
        (keep, list(names), list(keeps), limit, dry))
    row = await cur.fetchone()
    assert row is not None
    return Pruned(int(row["runs"]), int(row["journal_rows"] or 0), int(row["events"] or 0))


async def prune_slots(conn: Conn, *, keep: float, limit: int, dry: bool = False) -> int:
    """One batch of ``prune_schedule_slots`` (migration 0016): slot records of schedules older
    than ``keep`` seconds that fired no run or whose run was pruned (with ``dry``: how many
    there are)."""
    cur = await conn.execute(
        f"SELECT {S}.prune_schedule_slots(%s::float8, %s, %s) AS n", (keep, limit, dry))
    row = await cur.fetchone()
    assert row is not None
    return int(row["n"])


async def expire_batch(conn: Conn, *, keep: float, limit: int, dry: bool = False) -> Expired:
    cur = await conn.execute(
        f"SELECT runs, operations, audit, incidents FROM {S}.expire_evidence("
        "%s::float8, %s, %s)", (keep, limit, dry))
    row = await cur.fetchone()
    assert row is not None
    return Expired(int(row["runs"]), int(row["operations"]), int(row["audit"]),
                   int(row["incidents"]))


async def may_expire(conn: Conn) -> bool:
    """Whether this connection's role may expire evidence (the migration role may; the runtime
    role is not granted it)."""
    cur = await conn.execute("SELECT has_function_privilege(current_user, %s, 'EXECUTE') AS ok",
                             (EXPIRE_FUNCTION,))
    row = await cur.fetchone()
    return bool(row and row["ok"])


# -- the evidence, for an archive ----------------------------------------------------------
# An operation or a reconciliation item changes after it is created (a call's outcome, an
# operator's resolution, days later): each is read in the period of its last change
# (``updated_at``; ``resolved_at``, else ``created_at``), so that the exports of consecutive
# periods hold every row as it ended, the ones that changed since an earlier export again.
# Lookups, audit rows and incidents never change: they are read by ``created_at``.

_OPERATIONS = f"""
SELECT o.id, o.run_id, r.workflow_name, r.workflow_version, r.idempotency_key AS submission_key,
       o.position, o.attempt, o.tool_name, o.tool_version, o.effect_class, o.tenant,
       o.principal, o.intent_digest, o.arguments, o.idempotency_key, o.state, o.receipt,
       o.receipt_digest, o.error, o.created_at, o.submitted_at, o.finished_at, o.updated_at
FROM {S}.operations o JOIN {S}.runs r ON r.id = o.run_id
WHERE o.id > %(after)s AND o.updated_at >= %(since)s AND o.updated_at < %(until)s
ORDER BY o.id LIMIT %(limit)s
"""

_ITEMS = f"""
SELECT id, operation_id, run_id, reason, state, lookup_attempts, resolution, evidence,
       created_at, resolved_at
FROM {S}.reconciliation_items
WHERE id > %(after)s AND COALESCE(resolved_at, created_at) >= %(since)s
  AND COALESCE(resolved_at, created_at) < %(until)s
ORDER BY id LIMIT %(limit)s
"""

_LOOKUPS = f"""
SELECT l.id, l.item_id, i.operation_id, l.attempt, l.answer, l.detail, l.created_at
FROM {S}.reconciliation_lookups l JOIN {S}.reconciliation_items i ON i.id = l.item_id
WHERE l.id > %(after)s AND l.created_at >= %(since)s AND l.created_at < %(until)s
ORDER BY l.id LIMIT %(limit)s
"""

_AUDIT = f"""
SELECT id, created_at, operator, action, target_kind, target_id, tenant, evidence, before, after
FROM {S}.operator_audit
WHERE id > %(after)s AND created_at >= %(since)s AND created_at < %(until)s
ORDER BY id LIMIT %(limit)s
"""

_INCIDENTS = f"""
SELECT ref AS id, created_at, code, run_id, operation_id, phase, cause, upstream_status
FROM {S}.incidents
WHERE ref > %(after)s AND created_at >= %(since)s AND created_at < %(until)s
ORDER BY ref LIMIT %(limit)s
"""

EVIDENCE: tuple[tuple[str, str, Any], ...] = (
    ("operation", _OPERATIONS, 0), ("reconciliation_item", _ITEMS, 0),
    ("lookup", _LOOKUPS, 0), ("audit", _AUDIT, 0), ("incident", _INCIDENTS, ""))
"""Each kind of evidence: its ``type``, the page statement (keyset on ``id``) and the key
before the first."""


_CUTOFF = """
SELECT LEAST(statement_timestamp(), (
    SELECT min(xact_start) FROM pg_stat_activity
    WHERE datname = current_database() AND backend_type = 'client backend'
      AND pid <> pg_backend_pid())) AS cutoff
"""


async def evidence_cutoff(conn: Conn) -> datetime:
    """The default end of an export's period, read on ``conn`` just before its snapshot
    (outside a transaction): now, or the start of the oldest transaction then open in this
    database, if earlier. Rows are stamped with their transaction's start (``now()``), so a
    transaction open now may still commit rows stamped before now, after the snapshot; they
    are at or after this cutoff, in the next period. (A role sees the transactions of other
    roles only with ``pg_read_all_stats``; without it, only its own.)"""
    cur = await conn.execute(_CUTOFF)
    row = await cur.fetchone()
    assert row is not None
    cutoff: datetime = row["cutoff"]
    return cutoff


async def evidence_snapshot(conn: Conn) -> None:
    """Make the transaction just begun on ``conn`` one read-only snapshot: every page of every
    kind of evidence read in it sees the database as of its first read."""
    await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")


async def evidence_page(conn: Conn, statement: str, *, after: Any, since: datetime,
                        until: datetime, limit: int) -> list[dict[str, Any]]:
    cur = await conn.execute(statement, {"after": after, "since": since, "until": until,
                                         "limit": limit})
    return list(await cur.fetchall())
