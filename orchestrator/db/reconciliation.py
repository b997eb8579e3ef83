"""Statements on the reconciliation queue and the resolution of unknown operations (C8).

A resolution happens while the run is parked in ``needs_reconciliation``: no worker holds it,
so the resolving transaction locks the run's row and appends to its journal at the next
revision itself. Every step is guarded and its row count checked.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from orchestrator.db.database import DEFAULT_QUEUE_NEWS, Conn
from orchestrator.db.journal import journal_insert_held
from orchestrator.db.runs import run_news, run_wake
from orchestrator.db.schema import SCHEMA as S
from orchestrator.errors import OperationInProgress, ResolutionConflict

_ITEM_COLUMNS = f"""
i.id AS item_id, i.operation_id, i.run_id, i.reason, i.state AS item_state, i.lookup_attempts,
i.next_attempt_at, i.claimed_by, i.claimed_until, i.resolution, i.evidence, i.created_at,
i.resolved_at, o.position, o.attempt, o.tool_name, o.tool_version, o.effect_class, o.tenant,
o.principal, o.intent_digest, o.arguments, o.idempotency_key, o.state AS operation_state,
o.receipt, o.receipt_digest, o.submitted_at, o.worker_id, o.error->>'then' AS then,
(SELECT status FROM {S}.runs r WHERE r.id = i.run_id) AS run_status
"""

# What the reconciler claims: the arguments as their JSON text, decoded per item, so that no
# item's content can fail the claim of the others (see the worker's claim).
_CLAIMED_COLUMNS = _ITEM_COLUMNS.replace("o.arguments,", "o.arguments::text AS arguments_text,")
assert _CLAIMED_COLUMNS != _ITEM_COLUMNS


async def recon_claim_due(
    conn: Conn, *, claimer: str, limit: int, ttl: float, tools: list[str] | None = None,
    unserved_grace: float = 0.0
) -> list[dict[str, Any]]:
    """Claim open items whose next lookup is due (and whose run no worker is driving); each
    item's arguments come as text (``arguments_text``), with its run's stored ``traceparent``
    (docs/tracing.md).

    ``tools``: the tools the claimer registers (None: every tool). An item of another tool is
    left for a reconciler that has it, until it has waited ``unserved_grace`` seconds with no
    reconciler taking it: since it was due, or since the last claim on it lapsed, whichever is
    later. Then it is claimed too, to be handed to operators; ``unserved_for`` says for how
    many seconds it waited so (None for an item of ``tools``)."""
    cur = await conn.execute(
        f"""
        WITH picked AS (
            SELECT i.id,
                   CASE WHEN %(tools)s::text[] IS NOT NULL
                             AND o.tool_name <> ALL(%(tools)s::text[])
                        THEN extract(epoch FROM now() - GREATEST(i.next_attempt_at,
                                                                 i.claimed_until))::float8
                   END AS unserved_for
            FROM {S}.reconciliation_items i
            JOIN {S}.operations o ON o.id = i.operation_id
            JOIN {S}.runs r ON r.id = i.run_id
            WHERE i.state = 'open' AND i.next_attempt_at <= now()
              AND (i.claimed_until IS NULL OR i.claimed_until < now())
              AND o.state = 'unknown' AND r.status <> 'running'
              AND (%(tools)s::text[] IS NULL OR o.tool_name = ANY(%(tools)s::text[])
                   OR GREATEST(i.next_attempt_at, i.claimed_until)
                      <= now() - make_interval(secs => %(grace)s::float8))
            ORDER BY i.next_attempt_at
            LIMIT %(limit)s
            FOR UPDATE OF i SKIP LOCKED
        )
        UPDATE {S}.reconciliation_items AS i
        SET claimed_by = %(claimer)s, claimed_until = now() + make_interval(secs => %(ttl)s)
        FROM picked, {S}.operations o
        WHERE i.id = picked.id AND o.id = i.operation_id
        RETURNING {_CLAIMED_COLUMNS},
                  (SELECT r.traceparent FROM {S}.runs r WHERE r.id = i.run_id) AS traceparent,
                  picked.unserved_for
        """,
        {"claimer": claimer, "limit": limit, "ttl": ttl, "tools": tools,
         "grace": unserved_grace},
    )
    return await cur.fetchall()


async def recon_claim_renew(conn: Conn, *, item_id: int, claimer: str, ttl: float) -> bool:
    """Extend ``claimer``'s claim on an open item by ``ttl`` seconds from now, just before its
    lookup; False when the claim is gone (it lapsed and another reconciler claimed the item,
    or the item was settled meanwhile): the lookup is not made then."""
    cur = await conn.execute(
        f"""
        UPDATE {S}.reconciliation_items
        SET claimed_until = now() + make_interval(secs => %(ttl)s)
        WHERE id = %(item_id)s AND state = 'open' AND claimed_by = %(claimer)s
        """,
        {"item_id": item_id, "claimer": claimer, "ttl": ttl},
    )
    return cur.rowcount == 1


async def recon_claim_release(conn: Conn, *, item_ids: list[int], claimer: str) -> int:
    """Give up ``claimer``'s claims on open items it will not look up (a stopping
    reconciler's rest of a batch), so that another reconciler claims them at once rather than
    when they lapse; the number released. An item claimed by another reconciler (``claimer``'s
    claim lapsed and it was taken) or settled meanwhile is left as it is."""
    cur = await conn.execute(
        f"""
        UPDATE {S}.reconciliation_items SET claimed_by = NULL, claimed_until = NULL
        WHERE id = ANY(%(ids)s) AND state = 'open' AND claimed_by = %(claimer)s
        """,
        {"ids": item_ids, "claimer": claimer},
    )
    return cur.rowcount


async def recon_record_lookup(
    conn: Conn, *, item_id: int, claimer: str, answer: str, detail: str,
    retry_in: float | None
) -> str:
    """Keep one lookup attempt in the item's history; schedule the next one or hand the item
    to operators (``retry_in`` None). Returns the item's new state, or ``lost`` when
    ``claimer`` no longer holds the open item (its claim lapsed and another reconciler took
    it, or it was settled): the lookup is kept in the history all the same, under its own
    attempt number, and the item is left as it is, its answer not to be acted on."""
    cur = await conn.execute(
        f"""
        UPDATE {S}.reconciliation_items
        SET lookup_attempts = lookup_attempts + 1, claimed_by = NULL, claimed_until = NULL,
            state = CASE WHEN %(retry_in)s::float8 IS NULL THEN 'operator' ELSE state END,
            next_attempt_at = now() + make_interval(secs => COALESCE(%(retry_in)s::float8, 0))
        WHERE id = %(item_id)s AND state = 'open' AND claimed_by = %(claimer)s
        RETURNING state, lookup_attempts
        """,
        {"item_id": item_id, "claimer": claimer, "retry_in": retry_in},
    )
    row = await cur.fetchone()
    state = "lost" if row is None else str(row["state"])
    if row is None:  # a late answer: numbered in turn, the item otherwise left as it is
        cur = await conn.execute(
            f"""UPDATE {S}.reconciliation_items SET lookup_attempts = lookup_attempts + 1
                WHERE id = %s RETURNING state, lookup_attempts""", (item_id,))
        row = await cur.fetchone()
    if row is not None:
        await conn.execute(
            f"""
            INSERT INTO {S}.reconciliation_lookups (item_id, attempt, answer, detail)
            VALUES (%(item_id)s, %(attempt)s, %(answer)s, %(detail)s::jsonb)
            """,
            {"item_id": item_id, "attempt": row["lookup_attempts"], "answer": answer,
             "detail": detail},
        )
    return state


async def recon_to_operator(conn: Conn, *, item_id: int, claimer: str, note: str) -> bool:
    """Hand an item this reconciler holds to operators at once (the tool has no lookup here, no
    running reconciler has the tool, or its arguments cannot be decoded). False, and nothing
    changed, when its claim lapsed (another reconciler holds it now) or it was settled
    meanwhile."""
    cur = await conn.execute(
        f"""
        UPDATE {S}.reconciliation_items
        SET state = 'operator', claimed_by = NULL, claimed_until = NULL,
            evidence = evidence || jsonb_build_array(jsonb_build_object('note', %(note)s::text))
        WHERE id = %(item_id)s AND state = 'open' AND claimed_by = %(claimer)s
        """,
        {"item_id": item_id, "claimer": claimer, "note": note},
    )
    return cur.rowcount == 1


# Which items a filter selects: ``ops list`` shows them, ``ops resolve-many`` and
# ``abandon-many`` act on them. Each filter is off when its parameter is NULL; ``ids`` keeps
# the operations an operator ticked one by one; ``tenants`` keeps another tenant's items out
# entirely (C9); ``after_at`` and ``after_id`` begin a page after an item (a list's cursor).
_ITEM_FILTER = f"""
WHERE (%(states)s::text[] IS NULL OR i.state = ANY(%(states)s))
  AND (%(tool)s::text IS NULL OR o.tool_name = %(tool)s)
  AND (%(older)s::float8 IS NULL
       OR i.created_at < now() - make_interval(secs => %(older)s::float8))
  AND (%(key)s::text IS NULL OR o.idempotency_key = %(key)s)
  AND (%(run_id)s::uuid IS NULL OR i.run_id = %(run_id)s)
  AND (%(workflow)s::text IS NULL OR EXISTS (
       SELECT 1 FROM {S}.runs r WHERE r.id = i.run_id AND r.workflow_name = %(workflow)s))
  AND (%(ids)s::bigint[] IS NULL OR i.operation_id = ANY(%(ids)s))
  AND (%(tenants)s::text[] IS NULL OR o.tenant = ANY(%(tenants)s))
  AND (%(after_at)s::timestamptz IS NULL
       OR (i.created_at, i.id) > (%(after_at)s::timestamptz, %(after_id)s::bigint))
"""


def _filter_params(*, states: list[str] | None, tool: str | None, older_than: float | None,
                   key: str | None, run_id: uuid.UUID | None, workflow: str | None,
                   tenants: list[str] | None, limit: int, ids: list[int] | None = None,
                   after: tuple[datetime, int] | None = None) -> dict[str, Any]:
    return {"states": states, "tool": tool, "older": older_than, "key": key, "run_id": run_id,
            "workflow": workflow, "ids": ids, "tenants": tenants, "limit": limit,
            "after_at": None if after is None else after[0],
            "after_id": None if after is None else after[1]}


async def recon_list(
    conn: Conn, *, states: list[str] | None, tool: str | None, older_than: float | None,
    tenants: list[str] | None, limit: int, key: str | None = None,
    run_id: uuid.UUID | None = None, workflow: str | None = None,
    after: tuple[datetime, int] | None = None
) -> list[dict[str, Any]]:
    """Items in any of ``states`` (None: every item), oldest first; ``key`` is an
    operation's idempotency key, ``workflow`` its run's workflow name; ``after``, an item's
    ``(created_at, id)``: only the items listed after it (the next page)."""
    return await _select_items(conn, _ITEM_COLUMNS, _filter_params(
        states=states, tool=tool, older_than=older_than, key=key, run_id=run_id,
        workflow=workflow, tenants=tenants, limit=limit, after=after))


async def recon_match(
    conn: Conn, *, states: list[str] | None, tool: str | None, older_than: float | None,
    key: str | None, run_id: uuid.UUID | None, workflow: str | None,
    tenants: list[str] | None, limit: int, ids: list[int] | None = None
) -> list[dict[str, Any]]:
    """The items :func:`recon_list` would list, oldest first, without their arguments or
    receipts: what a bulk action needs to name and act on each one (no item's stored content
    can fail the selection of the others). ``ids``: only these operations' items."""
    return await _select_items(conn, _MATCH_COLUMNS, _filter_params(
        states=states, tool=tool, older_than=older_than, key=key, run_id=run_id,
        workflow=workflow, tenants=tenants, limit=limit, ids=ids))


_MATCH_COLUMNS = """i.operation_id, i.run_id, i.state AS item_state, i.reason, i.created_at,
       o.tool_name, o.tenant, o.principal, o.idempotency_key, o.state AS operation_state"""


async def _select_items(conn: Conn, columns: str, params: dict[str, Any]
                        ) -> list[dict[str, Any]]:
    """The items matching :data:`_ITEM_FILTER` (``params`` from :func:`_filter_params`), oldest
    first, with ``columns``."""
    cur = await conn.execute(
        f"""
        SELECT {columns} FROM {S}.reconciliation_items i
        JOIN {S}.operations o ON o.id = i.operation_id
        {_ITEM_FILTER}
        ORDER BY i.created_at, i.id
        LIMIT %(limit)s
        """,
        params,
    )
    return await cur.fetchall()


async def recon_read_snapshot(conn: Conn) -> None:
    """Make the transaction just begun on ``conn`` one read-only snapshot: an operation, its
    attempts, incidents, lookups, journal and audit read in it agree with each other, even when
    an operator resolves it or a worker moves its run on between the reads."""
    await conn.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")


async def recon_get(conn: Conn, operation_id: int, *, lock: bool = False,
                    tenants: list[str] | None = None) -> dict[str, Any] | None:
    """The item of an operation; with ``tenants``, only one of theirs: another tenant's is
    not read at all, so it answers exactly as a missing one (C9)."""
    cur = await conn.execute(
        f"""
        SELECT {_ITEM_COLUMNS} FROM {S}.reconciliation_items i
        JOIN {S}.operations o ON o.id = i.operation_id
        WHERE i.operation_id = %(op)s
          AND (%(tenants)s::text[] IS NULL OR o.tenant = ANY(%(tenants)s))
        {"FOR UPDATE OF i, o" if lock else ""}
        """,
        {"op": operation_id, "tenants": tenants},
    )
    return await cur.fetchone()


async def operation_outside_queue(conn: Conn, operation_id: int) -> dict[str, Any] | None:
    """An operation that has no reconciliation item: its state, owner, run and run's status,
    and the attempt of the same call that is queued and not resolved, if one is
    (``queued``)."""
    cur = await conn.execute(
        f"""
        SELECT o.id, o.state, o.tenant, o.run_id,
               (SELECT r.status FROM {S}.runs r WHERE r.id = o.run_id) AS run_status,
               (SELECT q.id FROM {S}.operations q
                JOIN {S}.reconciliation_items i ON i.operation_id = q.id
                WHERE q.run_id = o.run_id AND q.position = o.position AND i.state <> 'resolved'
                ORDER BY q.attempt DESC LIMIT 1) AS queued
        FROM {S}.operations o WHERE o.id = %s
        """,
        (operation_id,),
    )
    return await cur.fetchone()


async def operation_unqueued(conn: Conn, operation_id: int) -> dict[str, Any] | None:
    """An operation that has no reconciliation item, with the columns of one that has (its
    item's all NULL): what ``ops show`` gives of a call still under way."""
    cur = await conn.execute(
        f"""
        SELECT NULL::bigint AS item_id, o.id AS operation_id, o.run_id, NULL::text AS reason,
               NULL::text AS item_state, NULL::int AS lookup_attempts,
               NULL::timestamptz AS next_attempt_at, NULL::text AS claimed_by,
               NULL::timestamptz AS claimed_until, NULL::text AS resolution,
               NULL::jsonb AS evidence, NULL::timestamptz AS created_at,
               NULL::timestamptz AS resolved_at, o.position, o.attempt, o.tool_name,
               o.tool_version, o.effect_class, o.tenant, o.principal, o.intent_digest,
               o.arguments, o.idempotency_key, o.state AS operation_state, o.receipt,
               o.receipt_digest, o.submitted_at, o.worker_id, NULL::text AS then,
               (SELECT status FROM {S}.runs r WHERE r.id = o.run_id) AS run_status
        FROM {S}.operations o WHERE o.id = %s
        """,
        (operation_id,),
    )
    return await cur.fetchone()


async def recon_lookups(conn: Conn, item_id: int) -> list[dict[str, Any]]:
    """An item's lookup history as operators see it: the answer, its attempt number, its time
    and the incident that keeps what the lookup said (``incident``, None if it said nothing).
    The lookup's own text is tool text and stays in that incident (protected diagnostics)."""
    cur = await conn.execute(
        f"""SELECT attempt, answer, detail->>'incident' AS incident, created_at
            FROM {S}.reconciliation_lookups WHERE item_id = %s ORDER BY attempt""",
        (item_id,),
    )
    return await cur.fetchall()


async def operation_attempts(conn: Conn, run_id: uuid.UUID, position: int
                             ) -> list[dict[str, Any]]:
    cur = await conn.execute(
        f"""SELECT id, attempt, state, idempotency_key, submitted_at, finished_at, worker_id,
                   error
            FROM {S}.operations WHERE run_id = %s AND position = %s ORDER BY attempt""",
        (run_id, position),
    )
    return await cur.fetchall()


async def recon_settle(
    conn: Conn,
    *,
    item: dict[str, Any],
    resolution: str,
    receipt: str | None,
    receipt_digest: str | None,
    events: list[dict[str, Any]],
    fail_run: str | None,
    error: str | None = None,
) -> None:
    """Apply a resolution inside the caller's transaction (its run is locked, then, unless it
    is running, its item and the operation: :func:`orchestrator.reconcile.resolve`).

    ``resolution`` is ``committed``, ``not_applied`` or ``abandoned``. The operation moves from
    ``unknown``, and so do earlier attempts at the same position that were re-sent with the same
    idempotency key (the provider made them one effect). If the run is parked on it, the run's
    journal gets ``events`` at its next revision and the run is failed (``fail_run``: its error,
    JSON) or, when nothing else it waits for is unknown, queued again. It waits for the
    operations in the queue only: an unknown one that no item lists is the run's own to settle
    (an idempotent re-send that was waiting out a retry delay when another branch blocked the
    run), and waiting for it would leave the run parked for ever. ``error`` (JSON) is kept on
    the settled operations: for ``not_applied``, who resolved it and what the operator chose
    next (``then``), which a run that was not parked on it reads from there. A run that
    already moved on or ended keeps its journal: only the ledger is settled. A run a worker
    is driving right now is not touched (``OPERATION_IN_PROGRESS``: try again in a moment).
    """
    run = await (await conn.execute(
        f"SELECT revision, lease_token, status, queue FROM {S}.runs WHERE id = %s FOR UPDATE",
        (item["run_id"],))).fetchone()
    assert run is not None
    if run["status"] == "running":
        raise OperationInProgress(
            f"run {item['run_id']} is running; resolve its operation once it has parked",
            status="running")
    cur = await conn.execute(
        f"""
        UPDATE {S}.operations
        SET state = %(state)s, receipt = COALESCE(%(receipt)s::jsonb, receipt),
            receipt_digest = COALESCE(%(digest)s, receipt_digest),
            error = COALESCE(%(error)s::jsonb, error), finished_at = now(), updated_at = now()
        WHERE state = 'unknown' AND (id = %(op_id)s OR (
              run_id = %(run_id)s AND position = %(position)s
              AND idempotency_key = %(key)s AND effect_class = 'idempotent'))
        RETURNING id
        """,
        {"state": resolution, "receipt": receipt, "digest": receipt_digest, "error": error,
         "op_id": item["operation_id"], "run_id": item["run_id"],
         "position": item["position"], "key": item["idempotency_key"]},
    )
    settled = [row["id"] for row in await cur.fetchall()]
    if item["operation_id"] not in settled:
        raise ResolutionConflict(f"operation {item['operation_id']} is no longer unknown")
    await conn.execute(
        f"""
        UPDATE {S}.reconciliation_items SET state = 'resolved', resolution = %(resolution)s,
               resolved_at = now(), claimed_by = NULL, claimed_until = NULL
        WHERE operation_id = ANY(%(ops)s) AND state <> 'resolved'
        """,
        {"ops": settled, "resolution": resolution},
    )
    if run["status"] == "needs_reconciliation":
        await _resume_parked(conn, item, run, events, fail_run)
    await run_news(conn, [run["queue"] or DEFAULT_QUEUE_NEWS])


async def _resume_parked(conn: Conn, item: dict[str, Any], run: dict[str, Any],
                         events: list[dict[str, Any]], fail_run: str | None
                         ) -> None:
    await journal_insert_held(conn, run_id=item["run_id"], token=run["lease_token"],
                              revision=run["revision"], events=events)
    if fail_run is not None:
        error = fail_run
        parent = await (await conn.execute(
            f"""
            UPDATE {S}.runs SET status = 'failed', outcome_code = 'OPERATION_ABANDONED',
                   error = %(error)s::jsonb, revision = revision + %(n)s, finished_at = now(),
                   updated_at = now(), waiting_for = NULL, waiting_tool = NULL,
                   available_at = NULL
            WHERE id = %(run_id)s AND status = 'needs_reconciliation'
            RETURNING parent_run_id
            """,
            {"run_id": item["run_id"], "n": len(events), "error": error})).fetchone()
        if parent is not None and parent["parent_run_id"] is not None:
            await run_wake(conn, parent["parent_run_id"])
        return
    # Still blocked on another unknown operation, the run says in words which ones are left.
    cur = await conn.execute(
        f"""
        UPDATE {S}.runs SET revision = revision + %(n)s, updated_at = now(),
               status = CASE WHEN still.n = 0 THEN 'queued' ELSE status END,
               available_at = CASE WHEN still.n = 0 THEN now() ELSE available_at END,
               waiting_for = CASE WHEN still.n = 0 THEN NULL
                             ELSE 'reconciliation of operation ' || still.ops END,
               waiting_tool = NULL
        FROM (SELECT count(*) AS n, string_agg(o.id::text, ', ' ORDER BY o.id) AS ops
              FROM {S}.operations o
              WHERE o.run_id = %(run_id)s AND o.state = 'unknown'
                AND EXISTS (SELECT 1 FROM {S}.reconciliation_items i
                            WHERE i.operation_id = o.id AND i.state <> 'resolved')) AS still
        WHERE id = %(run_id)s AND status = 'needs_reconciliation'
        """,
        {"run_id": item["run_id"], "n": len(events)},
    )
    if cur.rowcount != 1:  # pragma: no cover - the run is locked, its status read above
        raise RuntimeError(f"run {item['run_id']} changed under its lock")


async def run_status_of(conn: Conn, operation_id: int, *, lock: bool = False,
                        tenants: list[str] | None = None) -> tuple[str, bool] | None:
    """The status of the run of ``operation_id`` and whether its cancellation was requested
    (None: no such operation, or with ``tenants`` one of another tenant, whose run is neither
    read nor locked). ``lock``: the run's row is locked (``FOR UPDATE``, as the resolution
    that reads it will lock it anyway), so that a cancellation cannot commit between this read
    and the resolution's write and make what it said untrue. A resolution takes this lock
    first, before its item's and operation's (see :func:`orchestrator.reconcile.resolve`)."""
    cur = await conn.execute(
        f"""
        SELECT r.status, r.cancel_requested_at IS NOT NULL AS cancel_requested
        FROM {S}.runs r JOIN {S}.operations o ON o.run_id = r.id WHERE o.id = %(op)s
          AND (%(tenants)s::text[] IS NULL OR o.tenant = ANY(%(tenants)s))
        {"FOR UPDATE OF r" if lock else ""}
        """,
        {"op": operation_id, "tenants": tenants},
    )
    row = await cur.fetchone()
    return None if row is None else (str(row["status"]), bool(row["cancel_requested"]))


async def run_still_waiting_on(conn: Conn, operation_id: int) -> list[int]:
    """The other operations whose outcome the run of ``operation_id`` still waits for: unknown,
    with a queue item not resolved (a run blocked on several resumes once all are settled)."""
    cur = await conn.execute(
        f"""
        SELECT o.id FROM {S}.operations o
        JOIN {S}.reconciliation_items i ON i.operation_id = o.id
        WHERE o.run_id = (SELECT run_id FROM {S}.operations WHERE id = %(op)s)
          AND o.id <> %(op)s AND o.state = 'unknown' AND i.state <> 'resolved'
        ORDER BY o.id
        """,
        {"op": operation_id},
    )
    return [int(row["id"]) for row in await cur.fetchall()]


async def audit_record(
    conn: Conn, *, operator: str, action: str, target_kind: str, target_id: str,
    tenant: str | None, evidence: str, before: str | None, after: str | None
) -> None:
    """One audit row; ``tenant`` is the tenant of the target (an operation's owner), which
    decides which operators may read the row (None: a target of every tenant, such as a
    queue; only operators without tenant scopes read it)."""
    await conn.execute(
        f"""
        INSERT INTO {S}.operator_audit (operator, action, target_kind, target_id, tenant,
                                        evidence, before, after)
        VALUES (%s, %s, %s, %s, %s, %s, %s::jsonb, %s::jsonb)
        """,
        (operator, action, target_kind, target_id, tenant, evidence, before, after),
    )


async def audit_list(conn: Conn, *, operation_id: int | None = None,
                     tenants: list[str] | None = None) -> list[dict[str, Any]]:
    """Audit rows, oldest first: of one operation (its kind and id: a queue or a schedule may
    have the same id) or all, of ``tenants`` only (None: every row, including those without
    a tenant)."""
    cur = await conn.execute(
        f"""SELECT id, created_at, operator, action, target_kind, target_id, tenant, evidence,
                   before, after FROM {S}.operator_audit
            WHERE (%(target)s::text IS NULL
                   OR (target_kind = 'operation' AND target_id = %(target)s))
              AND (%(tenants)s::text[] IS NULL OR tenant = ANY(%(tenants)s))
            ORDER BY id""",
        {"target": None if operation_id is None else str(operation_id), "tenants": tenants},
    )
    return await cur.fetchall()
