"""The hot writes of a run's steps: a call's write-ahead begin, a receipt, a run's success.

Each is one set-based SQL statement that the group writer sends
(:class:`~orchestrator.db.writer.Statement`), written out below with a line saying what it
does (the riding receipt's two CTEs, the same in all three, once: :data:`_RIDING_RECEIPT`),
followed by the function that turns one write into a row of it. A miss (the lease, a
cancellation, a conflict) raises :class:`FastPathMiss` and the engine takes the general path
(operations.py, runs.py, journal.py), which writes the same rows in Python-driven steps and
says why. What the three statements have in common:

- **Input.** One parameter: a JSON array of rows, each row a JSON array of the statement's
  columns in order (:func:`batch_x`, :func:`row_text`), read as records ``x`` numbered ``i``
  (the row's 1-based position, by which the result rows answer) through
  ``orchestrator.batch_rows`` (migration 0005: ``jsonb_array_elements`` planned for one row, so
  that the cached plan probes runs by primary key at any table size), each value by its
  position.
- **The fence.** The run is running under the row's lease token at the revision it expects.
  Running is spelled ``r.status = (SELECT 'running')``: with the literal, the planner could prove
  the predicate of the partial index ``ix_runs_lease_expiry`` and scan it instead of probing the
  primary key. That index holds every running run and, until a vacuum, every dead version of
  one (each claim and lease renewal leaves one), so every statement would read the whole
  working set; a sub-select's value is not known when planning, which rules the index out.
- **A call's entries are its operation row** (migration 0019). The write-ahead inserts the
  operation with ``seq``, the position of its ``call.submitted`` entry in the run's journal;
  committing it writes ``completed_seq``, that of its ``call.completed`` entry. The view
  ``orchestrator.journal`` reads them among the stored entries (``journal_entries``) as one
  sequence, with the payloads of :data:`orchestrator.journal.PAYLOAD_FIELDS`. So a step writes
  the operation and the fence, not two journal rows besides (docs/architecture.md, "The write
  path").
- **A riding receipt.** A row may carry the receipt of the run's previous call (the columns
  ``prev_op`` … ``digest``, all NULL without one; see :class:`Receipt`). CTE ``done`` commits
  it (``submitted`` → ``committed``) once the fence held, its ``call.completed`` entry at
  ``expected + 1``: on the operation row when the row holds the call's ``call.submitted``
  entry under this same lease token (the entries of a row carry the row's token), else as a
  stored row (CTE ``kept``: a call begun by the general path, or begun under an earlier lease
  and sent under this one), so that along ``seq`` the tokens never go down. A row so appends
  ``(1 + (x.prev_op IS NOT NULL)::int)`` entries, its own last, and its fence moves the
  revision by as much.
- **Each part fed by the one before, never joined back.** The fence returns the rows it
  moved with all their columns (``RETURNING x.*``); ``done`` reads the fence, ``kept`` reads
  ``done``, the inserts read the fence. Every CTE is estimated at one row (``batch_rows``), so
  a join of two of them is a nested loop, which reads one CTE once per row of the other: the
  statements used to join the rows back to ``x`` by ``i`` or ``run_id`` at each part and at
  the end, five such joins per write-ahead, quadratic in the batch (about 31 % of the
  server's instructions per step at 64 rows a statement; docs/architecture.md, "The write
  path").
- **Every row checked, by counting.** ``orchestrator.row_applied(applied, what)`` raises
  (SQLSTATE ``OR001``) unless every row applied, so that its batch cannot commit (see
  :mod:`orchestrator.db.writer`): ``applied`` compares the rows each part wrote with the rows
  it had to write (as many fenced as given, a receipt committed for each row that carries one,
  a stored entry for each receipt not on its row). Each part writes at most one row per input
  row, and a statement never holds two rows of one run (the writer's ``key``), so equal counts
  are every row applied. The CTE ``checked`` (``MATERIALIZED``: evaluated once) is the outer
  side of the final select, so the check runs even when the fence matched nothing. A
  write-ahead's operation id comes back by its run (``ids``, an object built once from the
  insert's ``RETURNING``: an insert cannot return the input row's ``i``).

Theirs are the only journal entries not inserted by :mod:`orchestrator.db.journal`: the
operations' entries, and the ``run.completed`` entry of :data:`RUN_SUCCEED`, whose payload
follows :data:`orchestrator.journal.PAYLOAD_FIELDS` (a unit test holds it and the view's to
it).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from orchestrator.canonical import one_shot
from orchestrator.db.database import DEFAULT_QUEUE_NEWS, RUNS_CHANNEL
from orchestrator.db.schema import SCHEMA as S
from orchestrator.db.writer import Statement


class FastPathMiss(Exception):
    """A single-statement write did not apply (the lease, a cancellation or a conflict);
    the caller takes the general path, which says which."""


@dataclass(frozen=True)
class Receipt:
    """A call's receipt that is known in the worker but not yet written: it rides in the
    transaction of the run's next write (CONTRACT C5 still holds: the operation stays
    ``submitted`` until that transaction commits, and nothing that depends on the receipt
    leaves the process before then). ``text`` is its canonical JSON."""

    op_id: int
    position: int
    name: str
    text: str
    digest: str


_COMPACT = one_shot(json.JSONEncoder(separators=(",", ":")))

_RECEIPT_COLUMNS = "prev_op bigint, prev_position int, prev_name text, digest text"
"""The riding receipt's scalar columns, after a statement's own; its text is a row's last."""


def batch_x(columns: str) -> str:
    """The CTE ``x`` of a statement whose rows are JSON arrays of ``columns`` (``"name type,
    ..."``) in that order: each read by its position (``->>`` cast to the column's type; a
    ``jsonb`` column's JSON ``null`` is SQL NULL), numbered ``i``. Reading a value by
    position from an array costs the server less than looking it up by key in an object
    (``jsonb_to_record``), and an array's text has no keys to parse and sort (about half the
    server's instructions for the input; docs/architecture.md, "The write path")."""
    read = []
    for k, column in enumerate(c.strip() for c in columns.split(",")):
        name, kind = column.split()
        read.append(f"nullif(t.j -> {k}, 'null') AS {name}" if kind == "jsonb"
                    else f"(t.j ->> {k})::{kind} AS {name}")
    return (f"x AS (\n    SELECT t.i, {', '.join(read)}\n"
            f"    FROM {S}.batch_rows(%s::jsonb) WITH ORDINALITY AS t(j, i)\n)")


def row_text(scalars: list[Any], receipt: Receipt | None = None, *raw: str) -> str:
    """One row's JSON array text, in the order of its statement's columns (:func:`batch_x`):
    ``scalars`` (encoded), the receipt's columns (``NULL`` without one), ``raw`` (JSON texts
    already, spliced in, not encoded again) and the receipt's text last."""
    if receipt is None:
        text = _COMPACT([*scalars, None, None, None, None])
        return text[:-1] + "".join(f",{value}" for value in raw) + ",null]"
    text = _COMPACT([*scalars, receipt.op_id, receipt.position, receipt.name, receipt.digest])
    return text[:-1] + "".join(f",{value}" for value in raw) + f",{receipt.text}]"


_RIDING_RECEIPT = f""", done AS (
    UPDATE {S}.operations o SET state = 'committed', receipt = f.receipt,
           receipt_digest = f.digest, finished_at = now(), updated_at = now(),
           completed_seq = CASE WHEN o.seq IS NOT NULL AND o.lease_token = f.token
                                THEN f.expected + 1 END
    FROM fence f
    -- The run's own call, checked as a filter and not as a key (IS NOT DISTINCT FROM), so
    -- that a plan made while the table was empty finds the call by its id, not among its
    -- run's calls (migration 0039: no index of unsettled calls is left to take instead).
    WHERE o.id = f.prev_op AND o.state = 'submitted' AND o.run_id IS NOT DISTINCT FROM f.run_id
    RETURNING o.completed_seq IS NULL AS stored, f.run_id, f.token, f.expected, f.v,
              f.prev_op, f.prev_position, f.prev_name, f.receipt
), kept AS (
    INSERT INTO {S}.journal_entries (run_id, seq, kind, position, name, schema_version,
                                     payload, lease_token)
    SELECT d.run_id, d.expected + 1, 'call.completed', d.prev_position, d.prev_name, d.v,
           jsonb_build_object('result', d.receipt, 'op', d.prev_op), d.token
    FROM done d WHERE d.stored
    RETURNING run_id
)"""
"""The riding receipt's two CTEs, the same in the three statements: ``done`` commits the call the
fence's row names in ``prev_op`` (``submitted`` → ``committed``, its ``call.completed`` entry
at ``expected + 1`` on the row when the row's entries carry this lease token), ``kept`` stores
that entry as a row when it could not go on the operation's row."""


OPERATION_BEGIN = f"""
WITH {batch_x("run_id uuid, token bigint, expected bigint, position int, attempt int, "
              "tool_name text, tool_version text, effect_class text, tenant text, "
              "principal text, intent_digest text, idempotency_key text, worker_id text, "
              "v smallint, " + _RECEIPT_COLUMNS + ", arguments jsonb, receipt jsonb")}, fence AS (
    UPDATE {S}.runs r SET revision = r.revision + (1 + (x.prev_op IS NOT NULL)::int),
           updated_at = now()
    FROM x
    WHERE r.id = x.run_id AND r.lease_token = x.token AND r.status = (SELECT 'running')
      AND r.revision = x.expected AND r.cancel_requested_at IS NULL
    RETURNING x.*
){_RIDING_RECEIPT}, op AS (
    INSERT INTO {S}.operations (run_id, position, attempt, tool_name, tool_version,
                                effect_class, tenant, principal, intent_digest, arguments,
                                idempotency_key, state, worker_id, lease_token, submitted_at,
                                seq, entry_version)
    SELECT f.run_id, f.position, f.attempt, f.tool_name, f.tool_version, f.effect_class,
           f.tenant, f.principal, f.intent_digest, f.arguments, f.idempotency_key,
           'submitted', f.worker_id, f.token, now(),
           f.expected + (1 + (f.prev_op IS NOT NULL)::int), f.v
    FROM fence f
    ON CONFLICT (run_id, position, attempt) DO NOTHING
    RETURNING id, run_id
), checked AS MATERIALIZED (
    SELECT {S}.row_applied(o.n = a.n AND d.n = a.receipts AND k.n = d.stored, 'call begin')
               AS appended, o.ids
    FROM (SELECT count(*) AS n, count(x.prev_op) AS receipts FROM x) AS a,
         (SELECT count(*) AS n, jsonb_object_agg(op.run_id::text, op.id) AS ids FROM op) AS o,
         (SELECT count(*) AS n, count(*) FILTER (WHERE done.stored) AS stored FROM done) AS d,
         (SELECT count(*) AS n FROM kept) AS k
)
SELECT f.i, (c.ids ->> f.run_id::text)::bigint AS op_id, c.appended
FROM checked c LEFT JOIN fence f ON true
"""
"""A call's write-ahead: its operation recorded ``submitted`` with its ``call.submitted`` entry,
after committing the riding receipt; refused once a cancellation was requested."""


def operation_begin_fast(row: dict[str, Any], *, expected: int, v: int,
                         receipt: Receipt | None = None, run_text: str | None = None) -> Statement:
    """The common case of :func:`~orchestrator.db.operations.operation_begin` plus its
    ``call.submitted`` journal entry (``tool_version``, ``intent``, ``attempt``, ``op``,
    ``key``, ``effect``), fenced, as one row of :data:`OPERATION_BEGIN`; its value is
    ``(operation id, None)``. It raises :class:`FastPathMiss` when it did not apply (its
    transaction must then roll back: the general path decides why). ``row["arguments"]`` is
    canonical JSON text; ``run_text``, when given, is ``str(row["run_id"])`` (kept by the
    caller: ``UUID.__str__`` is slow Python).

    With ``receipt``, the run's previous call is committed in the same row first (its
    ``call.completed`` entry at ``expected + 1``, this call's ``call.submitted`` after it): one
    fenced write for two steps of the ledger."""

    def check(got: dict[str, Any] | None) -> tuple[int, None]:
        if got is None or got["op_id"] is None or not got["appended"]:
            raise FastPathMiss("begin")
        return int(got["op_id"]), None

    text = row_text([
        run_text or str(row["run_id"]), row["token"], expected, row["position"],
        row["attempt"], row["tool_name"], row["tool_version"], row["effect_class"],
        row["tenant"], row["principal"], row["intent_digest"], row["idempotency_key"],
        row["worker_id"], v], receipt, row["arguments"])
    return Statement(OPERATION_BEGIN, text, row["run_id"], check)


RECEIPT_COMMIT = f"""
WITH {batch_x("run_id uuid, token bigint, expected bigint, v smallint, " + _RECEIPT_COLUMNS
              + ", receipt jsonb")}, fence AS (
    UPDATE {S}.runs r SET revision = r.revision + 1, updated_at = now()
    FROM x
    WHERE r.id = x.run_id AND r.lease_token = x.token AND r.status = (SELECT 'running')
      AND r.revision = x.expected
    RETURNING x.*, r.cancel_requested_at
){_RIDING_RECEIPT}, checked AS MATERIALIZED (
    SELECT {S}.row_applied(d.n = a.n AND k.n = d.stored, 'receipt') AS appended
    FROM (SELECT count(*) AS n FROM x) AS a,
         (SELECT count(*) AS n, count(*) FILTER (WHERE done.stored) AS stored FROM done) AS d,
         (SELECT count(*) AS n FROM kept) AS k
)
SELECT f.i, c.appended, f.cancel_requested_at
FROM checked c LEFT JOIN fence f ON true
"""
"""A receipt written alone: its operation ``submitted`` → ``committed`` with its
``call.completed`` entry; returns the run's ``cancel_requested_at``."""


def receipt_commit_fast(receipt: Receipt, *, run_id: uuid.UUID, token: int, expected: int,
                        v: int, run_text: str | None = None) -> Statement:
    """A :class:`Receipt` written alone, fenced, as one row of :data:`RECEIPT_COMMIT` (its
    ``call.completed`` entry is ``{"result": receipt, "op": op_id}``). Its value is
    ``(None, the run's cancel_requested_at)``; :class:`FastPathMiss` if it did not apply."""

    def check(got: dict[str, Any] | None) -> tuple[None, Any]:
        if got is None or not got["appended"]:
            raise FastPathMiss("commit")
        return None, got["cancel_requested_at"]

    text = row_text([run_text or str(run_id), token, expected, v], receipt)
    return Statement(RECEIPT_COMMIT, text, run_id, check)


def operation_commit_fast(*, run_id: uuid.UUID, token: int, expected: int, op_id: int,
                          position: int, name: str, receipt: str, digest: str, v: int
                          ) -> Statement:
    """:func:`receipt_commit_fast` from the receipt's parts (``receipt`` is its canonical
    JSON text)."""
    return receipt_commit_fast(
        Receipt(op_id=op_id, position=position, name=name, text=receipt, digest=digest),
        run_id=run_id, token=token, expected=expected, v=v)


RUN_SUCCEED = f"""
WITH {batch_x("run_id uuid, token bigint, expected bigint, v smallint, " + _RECEIPT_COLUMNS
              + ", result jsonb, receipt jsonb")}, fence AS (
    UPDATE {S}.runs r SET status = 'succeeded', result = x.result, finished_at = now(),
           updated_at = now(), lease_owner = NULL, lease_expires_at = NULL,
           available_at = NULL, waiting_for = NULL, waiting_tool = NULL,
           revision = r.revision + (1 + (x.prev_op IS NOT NULL)::int)
    FROM x
    WHERE r.id = x.run_id AND r.lease_token = x.token AND r.status = (SELECT 'running')
      AND r.revision = x.expected
      AND NOT EXISTS (SELECT 1 FROM {S}.operations o WHERE o.run_id = x.run_id
                      AND o.state IN ('pending', 'submitted', 'unknown')
                      AND o.id IS DISTINCT FROM x.prev_op)
    RETURNING x.*, r.parent_run_id, r.queue
){_RIDING_RECEIPT}, ins AS (
    INSERT INTO {S}.journal_entries (run_id, seq, kind, position, name, schema_version,
                                     payload, lease_token)
    SELECT f.run_id, f.expected + (1 + (f.prev_op IS NOT NULL)::int), 'run.completed',
           NULL, NULL, f.v,
           jsonb_build_object('result', f.result), f.token
    FROM fence f
    RETURNING run_id
), wake AS (
    -- Whatever its status, the parent's row is updated (and so locked), as in run_finish.
    -- A parent finishing in this same statement is left out: no row is updated twice.
    UPDATE {S}.runs p
    SET available_at = CASE WHEN p.status = 'waiting' THEN now() ELSE p.available_at END
    FROM fence WHERE p.id = fence.parent_run_id AND p.id NOT IN (SELECT run_id FROM x)
    RETURNING coalesce(p.queue, '{DEFAULT_QUEUE_NEWS}') AS news
), checked AS MATERIALIZED (
    SELECT {S}.row_applied(e.n = a.n AND d.n = a.receipts AND k.n = d.stored, 'run success')
               AS appended,
           -- News of each woken parent's queue.
           (SELECT count(*) FROM (SELECT pg_notify('{RUNS_CHANNEL}', w.news)
                                  FROM (SELECT DISTINCT news FROM wake) AS w) AS n) AS woke,
           -- A run of a queue freed its slot: the workers may claim the next.
           (SELECT count(*) FROM (SELECT pg_notify('{RUNS_CHANNEL}', q.queue)
                                  FROM (SELECT DISTINCT queue FROM fence
                                        WHERE queue IS NOT NULL) AS q) AS n) AS freed
    FROM (SELECT count(*) AS n, count(x.prev_op) AS receipts FROM x) AS a,
         (SELECT count(*) AS n FROM ins) AS e,
         (SELECT count(*) AS n, count(*) FILTER (WHERE done.stored) AS stored FROM done) AS d,
         (SELECT count(*) AS n FROM kept) AS k
)
SELECT f.i, c.appended, c.woke, c.freed
FROM checked c LEFT JOIN fence f ON true
"""
"""A run's success: ``succeeded`` with its result and ``run.completed`` entry, after committing
the riding receipt, refused while another operation of the run is unsettled; wakes its parent
and tells the workers when it frees a queue's slot."""


def run_succeed_fast(*, run_id: uuid.UUID, token: int, expected: int, result: str, v: int,
                     receipt: Receipt | None = None, run_text: str | None = None) -> Statement:
    """The common end of a run as one row of :data:`RUN_SUCCEED`: fenced, guarded against
    unsettled operations, with its ``run.completed`` entry and its parent woken. ``result`` is
    the result's canonical JSON text. With ``receipt``, the run's last call is committed in the
    same row first (its ``call.completed`` entry at ``expected + 1``). Raises
    :class:`FastPathMiss` when it did not apply; the general path then says why."""

    def check(got: dict[str, Any] | None) -> tuple[None, None]:
        if got is None or not got["appended"]:
            raise FastPathMiss("succeed")
        return None, None

    text = row_text([run_text or str(run_id), token, expected, v], receipt, result)
    return Statement(RUN_SUCCEED, text, run_id, check)
