"""An operation's settle rewrites its row in place (a HOT update), and what the three partial
indexes on ``state`` answered is still answered (migration 0039).

Rows are fabricated with plain SQL, as in test_schema_guards; the counts of HOT updates are the
transaction's own (``pg_stat_xact_user_tables``), read before it commits.
"""

from __future__ import annotations

import itertools
import re
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg.types.json import Jsonb

from orchestrator.db import migrate
from orchestrator.db.config import DatabaseTarget, validate_url

Conn = psycopg.Connection[tuple[object, ...]]

SETTLE_WRITES = ("state", "receipt", "receipt_digest", "error", "finished_at", "updated_at",
                 "completed_seq")
"""The columns a settle writes (``submitted`` → ``committed`` or ``failed``; the call's
``call.completed`` entry on the row)."""

_positions = itertools.count()


@pytest.fixture
def conn(migrated_database_url: str) -> Iterator[Conn]:
    with psycopg.connect(migrated_database_url, autocommit=True) as connection:
        yield connection


def _run(conn: Conn) -> uuid.UUID:
    run_id = uuid.uuid4()
    conn.execute(
        """INSERT INTO orchestrator.runs
               (id, tenant, principal, workflow_name, workflow_version, input, request_digest)
           VALUES (%s, 't', 'p', 'wf', '1', %s, 'digest')""", (run_id, Jsonb({})))
    return run_id


def _call(conn: Conn, run_id: uuid.UUID, *, tool: str = "charge", limited: bool = False,
          state: str = "submitted") -> int:
    row = conn.execute(
        """INSERT INTO orchestrator.operations
               (run_id, position, attempt, tool_name, tool_version, effect_class, tenant,
                principal, intent_digest, arguments, idempotency_key, state, submitted_at,
                in_flight_tool)
           VALUES (%s, %s, 1, %s, '1', 'consequential', 't', 'p', 'intent', %s, 'key', %s,
                   now(), %s)
           RETURNING id""",
        (run_id, next(_positions), tool, Jsonb({"amount": 1}), state,
         tool if limited else None)).fetchone()
    assert row is not None
    return int(str(row[0]))


def _hot_updates(conn: Conn) -> tuple[int, int]:
    """(updates, HOT updates) of operations in the current transaction so far."""
    row = conn.execute(
        "SELECT n_tup_upd, n_tup_hot_upd FROM pg_stat_xact_user_tables "
        "WHERE relid = 'orchestrator.operations'::regclass").fetchone()
    return (0, 0) if row is None else (int(row[0]), int(row[1]))  # type: ignore[call-overload]


def _settle(conn: Conn, op_id: int, state: str = "committed") -> None:
    conn.execute(
        """UPDATE orchestrator.operations
           SET state = %s, receipt = %s, receipt_digest = 'r', finished_at = now(),
               updated_at = now()
           WHERE id = %s""",
        (state, Jsonb({"charge": "ch_1"}) if state == "committed" else None, op_id))


def _admit(conn: Conn, tool: str, concurrency: int, timeout: float = 60.0) -> float | None:
    row = conn.execute("SELECT orchestrator.tool_admit(%s, %s, NULL, NULL, %s)",
                       (tool, concurrency, timeout)).fetchone()
    assert row is not None
    return None if row[0] is None else float(row[0])  # type: ignore[arg-type]


def test_no_index_of_operations_reads_a_column_that_a_settle_writes(conn: Conn) -> None:
    """Any index naming such a column, in its key, an expression or its predicate, makes every
    settle a new version with new entries in every index (no HOT update)."""
    found = conn.execute(
        "SELECT indexrelid::regclass::text, pg_get_indexdef(indexrelid) FROM pg_index "
        "WHERE indrelid = 'orchestrator.operations'::regclass").fetchall()
    assert len(found) >= 4
    reading = {name: [c for c in SETTLE_WRITES if re.search(rf"\b{c}\b", str(text))]
               for name, text in found}
    assert {name: cols for name, cols in reading.items() if cols} == {}


def test_a_settle_stays_on_its_page(conn: Conn) -> None:
    run_id = _run(conn)
    ops = [_call(conn, run_id) for _ in range(3)]
    with conn.transaction():
        before = _hot_updates(conn)
        _settle(conn, ops[0])
        _settle(conn, ops[1], "failed")
        conn.execute("UPDATE orchestrator.operations SET state = 'unknown' WHERE id = %s",
                     (ops[2],))
        after = _hot_updates(conn)
    # The two settles are HOT; the call that became unknown changed ``unknown_tool``.
    assert (after[0] - before[0], after[1] - before[1]) == (3, 2)


def test_the_guard_keeps_the_two_columns_whatever_a_statement_writes(conn: Conn) -> None:
    run_id = _run(conn)
    plain, limited = _call(conn, run_id), _call(conn, run_id, limited=True)

    def columns(op_id: int) -> tuple[object, ...]:
        row = conn.execute("SELECT in_flight_tool, unknown_tool FROM orchestrator.operations "
                           "WHERE id = %s", (op_id,)).fetchone()
        assert row is not None
        return tuple(row)

    assert columns(plain) == (None, None)
    assert columns(limited) == ("charge", None)
    for op_id in (plain, limited):
        conn.execute("UPDATE orchestrator.operations SET state = 'unknown' WHERE id = %s",
                     (op_id,))
    assert columns(plain) == (None, "charge")
    assert columns(limited) == ("charge", "charge")
    # An operator's resolution settles it: the place and the unknown are both released.
    conn.execute("UPDATE orchestrator.operations SET state = 'not_applied', "
                 "finished_at = now() WHERE id = %s", (limited,))
    assert columns(limited) == (None, None)
    # Written directly, they still say only the truth.
    conn.execute("UPDATE orchestrator.operations SET in_flight_tool = 'other', "
                 "unknown_tool = 'other' WHERE id = ANY(%s)", ([plain, limited],))
    assert columns(plain) == ("charge", "charge")  # unknown: it may hold a place
    assert columns(limited) == (None, None)  # settled: it holds nothing
    other = _call(conn, run_id, tool="other", limited=True)
    conn.execute("UPDATE orchestrator.operations SET unknown_tool = 'x' WHERE id = %s", (other,))
    assert columns(other) == ("other", None)
    # A settle from submitted, limited or not (the fast path's rows are the plain ones).
    quick = _call(conn, run_id)
    for op_id in (quick, other):
        _settle(conn, op_id)
        assert columns(op_id) == (None, None)


def test_a_concurrency_limit_counts_the_limited_calls_in_flight(conn: Conn) -> None:
    run_id = _run(conn)
    tool = f"mail-{uuid.uuid4().hex[:8]}"
    _call(conn, run_id, tool=tool)  # dispatched without the limit (none then): not counted
    first = _call(conn, run_id, tool=tool, limited=True)
    assert _admit(conn, tool, 2) is None
    second = _call(conn, run_id, tool=tool, limited=True)
    assert _admit(conn, tool, 2) == -2.0
    _settle(conn, first)
    assert _admit(conn, tool, 2) is None
    # Unknown, it holds its place for the tool's timeout after it was sent, not after.
    conn.execute("UPDATE orchestrator.operations SET state = 'unknown', "
                 "submitted_at = now() - interval '2 minutes' WHERE id = %s", (second,))
    assert _admit(conn, tool, 1, timeout=600) == -2.0
    assert _admit(conn, tool, 1, timeout=60) is None


def test_the_indexes_answer_what_the_old_ones_did(conn: Conn) -> None:
    def plan(query: str, *args: object) -> str:
        with conn.transaction():
            conn.execute("SET LOCAL enable_seqscan = off")
            return "\n".join(str(r[0]) for r in conn.execute(f"EXPLAIN {query}", args))

    in_flight = plan("SELECT count(*) FROM orchestrator.operations o WHERE "
                     "o.in_flight_tool = %s AND (o.state = 'submitted' OR o.submitted_at > "
                     "now() - interval '1 minute')", "charge")
    assert "ix_operations_in_flight" in in_flight, in_flight
    unsettled = plan("SELECT 1 FROM orchestrator.operations o WHERE o.run_id = %s "
                     "AND o.state IN ('pending', 'submitted', 'unknown')", uuid.uuid4())
    assert "uq_operations_run_id_position_attempt" in unsettled, unsettled


def test_calls_in_flight_when_0039_runs_keep_their_places(empty_database_url: str) -> None:
    """Before 0039 a limit counted every call of its tool in flight; those calls still count
    after it, and settled ones never do."""
    target = DatabaseTarget(validate_url(empty_database_url), "argument")
    migrate.upgrade(target, revision="0038")
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        run_id = _run(conn)
        old = [conn.execute(
            """INSERT INTO orchestrator.operations
                   (run_id, position, attempt, tool_name, tool_version, effect_class, tenant,
                    principal, intent_digest, arguments, idempotency_key, state, submitted_at)
               VALUES (%s, %s, 1, 'sms', '1', 'consequential', 't', 'p', 'i', '{}', 'k',
                       'submitted', now()) RETURNING id""", (run_id, n)).fetchone()
            for n in range(3)]
        for row in old[1:]:
            assert row is not None
            conn.execute("UPDATE orchestrator.operations SET state = %s WHERE id = %s",
                         ("unknown" if row is old[1] else "failed", row[0]))
    migrate.upgrade(target)
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        got = conn.execute("SELECT state, in_flight_tool, unknown_tool FROM "
                           "orchestrator.operations ORDER BY position").fetchall()
        assert got == [("submitted", "sms", None), ("unknown", "sms", "sms"),
                       ("failed", None, None)]
        assert _admit(conn, "sms", 2) == -2.0
        assert _admit(conn, "sms", 3) is None
