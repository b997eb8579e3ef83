"""Runs made from runs: a continuation's next generation (``ctx.continue_as_new``, migration
0015) and a restart's new run with the old one's journal carried (migration 0014). Each is
written in the caller's transaction, guarded, its row counts checked.
"""

from __future__ import annotations

import uuid

from orchestrator.db.database import DEFAULT_QUEUE_NEWS, RUNS_CHANNEL, Conn
from orchestrator.db.runs import CONTINUED, run_finish
from orchestrator.db.schema import SCHEMA as S
from orchestrator.errors import InvalidRequest, LeaseLost
from orchestrator.journal import EventKind

# -- continuations (migration 0015, docs/versioning.md#long-runs) -----------------------------

_CONTINUE_FROM = f"""
UPDATE {S}.runs AS r SET idempotency_key = NULL, parent_position = NULL,
       superseded_by = %(new)s
FROM (SELECT id, idempotency_key, parent_position FROM {S}.runs WHERE id = %(old)s
      FOR UPDATE) AS before
WHERE r.id = before.id AND r.superseded_by IS NULL AND r.status = 'succeeded'
  AND r.outcome_code = '{CONTINUED}'
RETURNING r.id, before.idempotency_key, before.parent_position
"""

_CONTINUE_AS = f"""
INSERT INTO {S}.runs (id, tenant, principal, workflow_name, workflow_version, input, options,
                      request_digest, idempotency_key, parent_run_id, parent_position, status,
                      available_at, deadline_at, traceparent, queue, priority,
                      concurrency_key, continued_from, cancel_requested_at, due_at)
SELECT %(new)s, o.tenant, o.principal, o.workflow_name, %(version)s, %(input)s::jsonb,
       o.options, o.request_digest, %(key)s, o.parent_run_id, %(parent_position)s, 'queued',
       now(), o.deadline_at, o.traceparent, o.queue, o.priority, o.concurrency_key, o.id,
       o.cancel_requested_at, now()
FROM {S}.runs AS o WHERE o.id = %(old)s
RETURNING (SELECT count(*) FROM (
              SELECT pg_notify('{RUNS_CHANNEL}', coalesce(queue, '{DEFAULT_QUEUE_NEWS}'))
          ) AS n) AS notified
"""


async def run_continue(conn: Conn, *, run_id: uuid.UUID, token: int, new_id: uuid.UUID,
                       version: str, input_text: str) -> None:
    """End ``run_id`` under its lease as continued (``succeeded``, ``CONTINUED_AS_NEW``,
    superseded by ``new_id``) and insert ``new_id``, queued, in its place: same owner,
    workflow, options, queue, priority, concurrency key, parent's link and deadline, this
    ``version`` and input; the submission's key and digest move to it (a submission with the
    key answers with it), and so do the events not consumed yet and a cancellation requested
    meanwhile. Guarded as :func:`run_finish` is (``LeaseLost``, ``UnsettledOperations``);
    every step's row count is checked."""
    await run_finish(conn, run_id=run_id, token=token, status="succeeded",
                     outcome_code=CONTINUED, result=None, error=None)
    cur = await conn.execute(_CONTINUE_FROM, {"old": run_id, "new": new_id})
    moved = await cur.fetchone()
    if moved is None:  # pragma: no cover - run_finish ended it under our lease just now
        raise LeaseLost(f"run {run_id} could not be continued: it changed meanwhile")
    cur = await conn.execute(_CONTINUE_AS, {
        "old": run_id, "new": new_id, "version": version, "input": input_text,
        "key": moved["idempotency_key"], "parent_position": moved["parent_position"]})
    if cur.rowcount != 1:  # pragma: no cover - the row is locked by this transaction
        raise LeaseLost(f"run {run_id} could not be continued: its row is gone")
    await run_events_hand_on(conn, old=run_id, new=new_id)


async def run_events_hand_on(conn: Conn, *, old: uuid.UUID, new: uuid.UUID) -> int:
    """Make the events delivered to ``old`` and not consumed yet ``new``'s (a continuation's
    next run, a restart's new run): nothing accepted is dropped. Returns how many moved."""
    cur = await conn.execute(f"UPDATE {S}.external_events SET run_id = %s "
                             "WHERE run_id = %s AND consumed_position IS NULL", (new, old))
    return cur.rowcount


# -- restarts (migration 0014, docs/retention.md#restarting-a-run) --------------------------

_COMMITTED_POSITIONS = f"""
SELECT DISTINCT position FROM {S}.journal
WHERE run_id = %(old)s AND kind = '{EventKind.CALL_COMPLETED}'
"""


async def run_journal_carry(conn: Conn, *, old: uuid.UUID, new: uuid.UUID,
                            before: int) -> int:
    """Copy into the new run's journal the old run's entries at positions before ``before``
    and, at every position, those of a call that committed (never repeated) and the patch
    markers (the path of each ``ctx.patched`` the run took: without its marker where a
    carried call comes later, the new run would take the old path, and its commands would
    take other positions than the journal's); renumbered from 1, in the old order. Returns
    how many entries were copied."""
    cur = await conn.execute(
        f"""
        INSERT INTO {S}.journal_entries (run_id, seq, kind, position, name, schema_version, payload,
                                 lease_token, created_at)
        SELECT %(new)s, row_number() OVER (ORDER BY j.seq), j.kind, j.position, j.name,
               j.schema_version, j.payload, 0, j.created_at
        FROM {S}.journal j
        WHERE j.run_id = %(old)s AND j.position IS NOT NULL
          AND (j.position < %(before)s OR j.kind = '{EventKind.PATCH}'
               OR j.position IN ({_COMMITTED_POSITIONS}))
        ORDER BY j.seq
        """, {"old": old, "new": new, "before": before})
    return cur.rowcount


async def run_children_adopt(conn: Conn, *, old: uuid.UUID, new: uuid.UUID,
                             before: int) -> int:
    """Make the new run the parent of the old run's children whose start its journal carries
    (positions before ``before``) and whose end the old run never recorded: the new run
    replays those starts, waits for those children and is woken when they end. Returns how
    many children it adopted."""
    cur = await conn.execute(
        f"""
        UPDATE {S}.runs AS c SET parent_run_id = %(new)s, updated_at = now()
        WHERE c.parent_run_id = %(old)s AND c.parent_position < %(before)s
          AND NOT EXISTS (
              SELECT 1 FROM {S}.journal j
              WHERE j.run_id = %(old)s AND j.position = c.parent_position
                AND j.kind IN ('{EventKind.CHILD_COMPLETED}', '{EventKind.CHILD_FAILED}'))
        """, {"old": old, "new": new, "before": before})
    return cur.rowcount


async def run_mark_restarted(conn: Conn, run_id: uuid.UUID, *, restarted_from: uuid.UUID,
                             revision: int) -> bool:
    """Mark the new run ``run_id``, still at revision 0, as the restart of ``restarted_from``,
    at ``revision``: the entries carried into its journal (:func:`run_journal_carry`) are its
    revisions, so that its next write follows them. False if the run was not at revision 0
    (the row count says)."""
    cur = await conn.execute(f"UPDATE {S}.runs SET restarted_from = %s, revision = %s "
                             "WHERE id = %s AND revision = 0", (restarted_from, revision, run_id))
    return cur.rowcount == 1


async def run_failed_position(conn: Conn, run_id: uuid.UUID) -> int:
    """Where a run went wrong: the first position whose last entry is not a success (a call
    that failed, was denied, cancelled or abandoned; an event that timed out; a child that
    failed), or of a child that failed, was cancelled or is being cancelled though the run
    never recorded it (one cancelled with it: a restart starts it anew rather than wait for
    it), else the position after its last one."""
    cur = await conn.execute(
        f"""
        SELECT coalesce(least(
                   min(position) FILTER (WHERE kind IN (
                       '{EventKind.CALL_FAILED}', '{EventKind.CALL_DENIED}',
                       '{EventKind.CALL_CANCELLED}', '{EventKind.CALL_ABANDONED}',
                       '{EventKind.EVENT_TIMEOUT}', '{EventKind.CHILD_FAILED}')),
                   (SELECT min(c.parent_position) FROM {S}.runs c
                    WHERE c.parent_run_id = %(run)s
                      AND (c.status IN ('failed', 'cancelled')
                           OR (c.cancel_requested_at IS NOT NULL
                               AND c.status <> 'succeeded')))),
               max(position) + 1, 0) AS at
        FROM {S}.journal WHERE run_id = %(run)s AND position IS NOT NULL
        """, {"run": run_id})
    row = await cur.fetchone()
    return int(row["at"]) if row else 0


_SUPERSEDE = f"""
UPDATE {S}.runs AS r SET superseded_by = %(new)s, idempotency_key = NULL, updated_at = now()
FROM (SELECT id, idempotency_key, request_digest FROM {S}.runs WHERE id = %(old)s
      FOR UPDATE) AS before
WHERE r.id = before.id AND r.superseded_by IS NULL
RETURNING before.idempotency_key, before.request_digest
"""


async def run_supersede(conn: Conn, *, old: uuid.UUID, new: uuid.UUID) -> bool:
    """Mark ``old`` superseded by ``new`` (a restart) unless it already is (the row count
    says); the submission's key and digest move to ``new``, as a continuation's do, so that
    a submission with the key answers with the run that restarts it."""
    cur = await conn.execute(_SUPERSEDE, {"old": old, "new": new})
    moved = await cur.fetchone()
    if moved is None:
        return False
    if moved["idempotency_key"] is not None:
        cur = await conn.execute(
            f"UPDATE {S}.runs SET idempotency_key = %s, request_digest = %s "
            "WHERE id = %s AND idempotency_key IS NULL",
            (moved["idempotency_key"], moved["request_digest"], new))
        if cur.rowcount != 1:
            raise InvalidRequest(f"run {new} changed before it took over run {old}'s "
                                 "submission key", path="run_id")
    return True
