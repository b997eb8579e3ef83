"""Statements on ``orchestrator.journal``.

The entries themselves (kinds, payloads, schema version) are defined in
:mod:`orchestrator.journal`; this module writes and reads them. Two ways in (the others that
insert journal rows are the hot steps' set-based statements in :mod:`orchestrator.db.steps`
and a restart's copy, :func:`orchestrator.db.chains.run_journal_carry`):

- :func:`journal_append`: the fenced append that moves a run's revision (the general path of
  every worker write);
- :func:`journal_insert_held`: an append by a caller that already holds the run's row in its
  transaction (a guarded ``UPDATE`` of the run, or its lock), numbered from the revision it
  read.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

from orchestrator.canonical import canonical_json
from orchestrator.db.database import Conn
from orchestrator.db.schema import SCHEMA as S
from orchestrator.errors import LeaseLost
from orchestrator.journal import RUN_ENDS, Entry, EventKind

_INSERT = (f"INSERT INTO {S}.journal_entries (run_id, seq, kind, position, name, schema_version, "
           "payload, lease_token)")
"""The head of both inserts; the rows follow as a SELECT."""

_FROM_JSON = """jsonb_to_recordset(%(events)s::jsonb)
         AS e(seq bigint, kind text, position int, name text, v smallint, payload jsonb)"""

_APPEND = f"""
WITH fence AS (
    UPDATE {S}.runs SET revision = revision + %(n)s, updated_at = now()
    WHERE id = %(run_id)s AND lease_token = %(token)s AND status = 'running'
      AND revision = %(expected)s
    RETURNING id, cancel_requested_at
), ins AS (
    {_INSERT}
    SELECT fence.id, e.seq, e.kind, e.position, e.name, e.v, e.payload, %(token)s
    FROM fence, {_FROM_JSON}
    RETURNING 1
)
SELECT (SELECT count(*) FROM ins) AS inserted,
       (SELECT cancel_requested_at FROM fence) AS cancel_requested_at,
       EXISTS (SELECT 1 FROM fence) AS fenced
"""

_INSERT_HELD = f"""
{_INSERT}
SELECT %(run_id)s, e.seq, e.kind, e.position, e.name, e.v, e.payload, %(token)s
FROM {_FROM_JSON}
"""


def encode_events(expected: int, events: Sequence[Entry]) -> str:
    """Number new events from ``expected + 1`` and encode them for an insert."""
    return canonical_json([{"seq": expected + i, **e} for i, e in enumerate(events, start=1)])


async def journal_append(
    conn: Conn,
    *,
    run_id: uuid.UUID,
    token: int,
    expected: int,
    events: Sequence[Entry],
) -> datetime | None:
    """Append ``events`` after revision ``expected`` under lease ``token``.

    Each event is an :func:`orchestrator.journal.entry`. Returns the run's
    ``cancel_requested_at``. Raises :class:`LeaseLost` when the run is not running under this
    token at this revision: nothing is written then.
    """
    cur = await conn.execute(
        _APPEND,
        {"run_id": run_id, "token": token, "expected": expected, "n": len(events),
         "events": encode_events(expected, events)},
    )
    row = await cur.fetchone()
    assert row is not None
    if not row["fenced"] or row["inserted"] != len(events):
        raise LeaseLost(f"run {run_id} is no longer held under lease {token} at {expected}")
    cancel_requested_at: datetime | None = row["cancel_requested_at"]
    return cancel_requested_at


async def journal_insert_held(conn: Conn, *, run_id: uuid.UUID, token: int | None,
                              revision: int, events: Sequence[Entry]) -> None:
    """Insert ``events`` after ``revision`` for a caller whose transaction already holds the
    run's row and moved (or checked) its revision itself."""
    await conn.execute(_INSERT_HELD, {"run_id": run_id, "token": token,
                                      "events": encode_events(revision, events)})


async def journal_read(conn: Conn, run_id: uuid.UUID) -> list[Entry]:
    cur = await conn.execute(
        f"""
        SELECT seq, kind, position, name, schema_version, payload, lease_token, created_at
        FROM {S}.journal WHERE run_id = %s ORDER BY seq
        """,
        (run_id,),
    )
    return list(await cur.fetchall())


_READ_FOR_REPLAY = f"""
SELECT seq, kind, position, name, schema_version, payload
FROM {S}.journal WHERE run_id = %s ORDER BY seq
"""


async def journal_read_for_replay(conn: Conn, run_id: uuid.UUID) -> list[Entry]:
    """A run's entries, oldest first, as ``orchestrator replay`` checks them and ``runs
    export`` writes them (without the lease token and time of each)."""
    cur = await conn.execute(_READ_FOR_REPLAY, (run_id,))
    return list(await cur.fetchall())


_COLUMNS = "seq, kind, position, name, schema_version, payload, lease_token, created_at"

_READ_AFTER = f"""
SELECT {_COLUMNS} FROM {S}.journal
WHERE run_id = %(run_id)s AND seq > %(after)s
ORDER BY seq LIMIT %(limit)s
"""

_READ_MESSAGES_AFTER = f"""
SELECT {_COLUMNS} FROM {S}.journal
WHERE run_id = %(run_id)s AND seq > %(after)s
  AND ((kind = '{EventKind.MESSAGE}' AND name = ANY(%(topics)s)) OR kind = ANY(%(ends)s))
ORDER BY seq LIMIT %(limit)s
"""


async def journal_read_after(conn: Conn, run_id: uuid.UUID, *, after: int, limit: int,
                             topics: Sequence[str] | None = None) -> list[Entry]:
    """At most ``limit`` entries of a run after ``seq`` ``after``, oldest first (a stream's
    next page, by the primary key); with ``topics``, only the ``message`` entries of those
    topics and the run's terminal entry."""
    params = {"run_id": run_id, "after": after, "limit": limit}
    if topics is None:
        cur = await conn.execute(_READ_AFTER, params)
    else:
        cur = await conn.execute(_READ_MESSAGES_AFTER, {
            **params, "topics": list(topics), "ends": [kind.value for kind in RUN_ENDS]})
    return list(await cur.fetchall())


_POLL = f"""
WITH asked AS (
    SELECT * FROM unnest(%(run_ids)s::uuid[], %(afters)s::bigint[]) AS a(run_id, after)),
moved AS (
    SELECT a.run_id, a.after, r.revision, r.status
    FROM asked a LEFT JOIN {S}.runs r ON r.id = a.run_id
    WHERE r.id IS NULL OR r.revision > a.after)
SELECT m.run_id, m.revision AS run_revision, m.status AS run_status, j.seq, j.kind, j.position,
       j.name, j.schema_version, j.payload, j.lease_token, j.created_at
FROM moved m LEFT JOIN LATERAL (
    SELECT {_COLUMNS} FROM {S}.journal
    WHERE run_id = m.run_id AND seq > m.after
    ORDER BY seq LIMIT %(limit)s) j ON true
ORDER BY m.run_id, j.seq
"""

Polled = tuple[dict[uuid.UUID, "dict[str, Any] | None"], dict[uuid.UUID, list[Entry]]]
"""What :func:`journal_poll` found: the runs that moved past their cursor (their ``revision``
and ``status``) or are gone (None), and the entries read after each moved run's cursor."""


async def journal_poll(conn: Conn, afters: Mapping[uuid.UUID, int], *, limit: int) -> Polled:
    """Of the runs of ``afters``, those whose ``revision`` (their last ``seq``) is past their
    cursor, with at most ``limit`` of their entries after it, oldest first, and those that no
    longer exist: what a stream's poller asks for every followed run at each pause, in one
    statement and one snapshot however many runs (by primary keys). A run that did not move is
    absent, so a poll of many quiet runs returns nothing. (The ids and cursors go as array
    literals, which cost less to send than lists adapted element by element.)"""
    cur = await conn.execute(_POLL, {
        "run_ids": "{" + ",".join(map(str, afters)) + "}",
        "afters": "{" + ",".join(map(str, afters.values())) + "}",
        "limit": limit})
    revisions: dict[uuid.UUID, dict[str, Any] | None] = {}
    entries: dict[uuid.UUID, list[Entry]] = {}
    for row in await cur.fetchall():
        run_id, revision, status = row.pop("run_id"), row.pop("run_revision"), row.pop(
            "run_status")
        if run_id not in revisions:
            revisions[run_id] = (None if revision is None
                                 else {"revision": revision, "status": status})
        if row["seq"] is not None:
            entries.setdefault(run_id, []).append(row)
    return revisions, entries


async def journal_unknown_calls(conn: Conn, run_id: uuid.UUID, positions: Sequence[int]
                                ) -> list[dict[str, Any]]:
    """The last ``call.unknown`` entry at each of ``positions`` of a run: its ``position``,
    ``operation_id``, ``tool`` and ``incident`` (None when the outcome became unknown without
    one, e.g. its worker was lost)."""
    cur = await conn.execute(
        f"""
        SELECT DISTINCT ON (position) position, name AS tool,
               (payload->>'op')::bigint AS operation_id, payload->>'incident' AS incident
        FROM {S}.journal WHERE run_id = %s AND position = ANY(%s) AND kind = %s
        ORDER BY position, seq DESC
        """,
        (run_id, list(positions), EventKind.CALL_UNKNOWN.value),
    )
    return list(await cur.fetchall())


async def journal_read_position(conn: Conn, run_id: uuid.UUID, position: int) -> list[Entry]:
    """The entries of one command position of a run, oldest first (a failed call's story)."""
    cur = await conn.execute(
        f"""
        SELECT seq, kind, position, name, schema_version, payload, lease_token, created_at
        FROM {S}.journal WHERE run_id = %s AND position = %s ORDER BY seq
        """,
        (run_id, position),
    )
    return list(await cur.fetchall())
