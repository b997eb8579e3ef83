"""The database itself enforces the operation state machine (C5) and the append-only journal (C3).

Rows are fabricated with plain SQL: whatever the Python code does, these statements must be
refused by the schema.
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from psycopg.types.json import Jsonb

from orchestrator.db.schema import OPERATION_STATES

# CONTRACT C5, drawn as (from, to).
ARROWS = {
    ("pending", "submitted"),
    ("pending", "cancelled"),
    ("submitted", "committed"),
    ("submitted", "failed"),
    ("submitted", "unknown"),
    ("unknown", "committed"),
    ("unknown", "not_applied"),
    ("unknown", "abandoned"),
}

# A legal way to reach each state from 'pending'.
PATHS = {
    "pending": [],
    "submitted": ["submitted"],
    "committed": ["submitted", "committed"],
    "failed": ["submitted", "failed"],
    "unknown": ["submitted", "unknown"],
    "not_applied": ["submitted", "unknown", "not_applied"],
    "abandoned": ["submitted", "unknown", "abandoned"],
    "cancelled": ["cancelled"],
}
FINAL_STATES = ("committed", "failed", "not_applied", "abandoned", "cancelled")


@pytest.fixture
def conn(migrated_database_url: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    with psycopg.connect(migrated_database_url, autocommit=True) as connection:
        yield connection


def _insert_run(conn: psycopg.Connection[tuple[object, ...]]) -> uuid.UUID:
    run_id = uuid.uuid4()
    conn.execute(
        """INSERT INTO orchestrator.runs
               (id, tenant, principal, workflow_name, workflow_version, input, request_digest)
           VALUES (%s, 't', 'p', 'wf', '1', %s, 'digest')""",
        (run_id, Jsonb({})),
    )
    return run_id


_positions = itertools.count()


def _insert_operation(
    conn: psycopg.Connection[tuple[object, ...]], run_id: uuid.UUID, state: str = "pending"
) -> int:
    row = conn.execute(
        """INSERT INTO orchestrator.operations
               (run_id, position, attempt, tool_name, tool_version, effect_class, tenant,
                principal, intent_digest, arguments, idempotency_key, state)
           VALUES (%s, %s, 1, 'charge', '1', 'consequential', 't', 'p', 'intent', %s, 'key', %s)
           RETURNING id""",
        (run_id, next(_positions), Jsonb({"amount": 1}), state),
    ).fetchone()
    assert row is not None
    return int(row[0])


def _move(conn: psycopg.Connection[tuple[object, ...]], op_id: int, state: str) -> None:
    if state == "committed":
        conn.execute(
            """UPDATE orchestrator.operations
               SET state = %s, receipt = coalesce(receipt, %s), receipt_digest = 'r'
               WHERE id = %s""",
            (state, Jsonb({"charge": "ch_1"}), op_id),
        )
    else:
        conn.execute(
            "UPDATE orchestrator.operations SET state = %s WHERE id = %s", (state, op_id)
        )


def _state(conn: psycopg.Connection[tuple[object, ...]], op_id: int) -> str:
    row = conn.execute(
        "SELECT state FROM orchestrator.operations WHERE id = %s", (op_id,)
    ).fetchone()
    assert row is not None
    return str(row[0])


def test_every_transition_is_allowed_exactly_when_the_contract_draws_it(
    conn: psycopg.Connection[tuple[object, ...]],
) -> None:
    run_id = _insert_run(conn)
    wrong: list[str] = []
    for old, new in itertools.product(OPERATION_STATES, repeat=2):
        op_id = _insert_operation(conn, run_id)
        for step in PATHS[old]:
            _move(conn, op_id, step)
        assert _state(conn, op_id) == old

        allowed = old == new or (old, new) in ARROWS
        try:
            _move(conn, op_id, new)
        except psycopg.errors.CheckViolation:
            if allowed:
                wrong.append(f"{old} -> {new} was refused")
            assert _state(conn, op_id) == old
        else:
            if not allowed:
                wrong.append(f"{old} -> {new} was accepted")
    assert wrong == []


def test_a_submitted_operation_cannot_go_back_to_pending(
    conn: psycopg.Connection[tuple[object, ...]],
) -> None:
    op_id = _insert_operation(conn, _insert_run(conn), "submitted")

    with pytest.raises(psycopg.errors.CheckViolation):
        _move(conn, op_id, "pending")

    assert _state(conn, op_id) == "submitted"


def test_a_committed_operation_cannot_become_unknown(
    conn: psycopg.Connection[tuple[object, ...]],
) -> None:
    op_id = _insert_operation(conn, _insert_run(conn), "submitted")
    _move(conn, op_id, "committed")

    with pytest.raises(psycopg.errors.CheckViolation):
        _move(conn, op_id, "unknown")

    assert _state(conn, op_id) == "committed"


@pytest.mark.parametrize("state", ["committed", "failed", "unknown", "cancelled"])
def test_operations_start_pending_or_submitted(
    conn: psycopg.Connection[tuple[object, ...]], state: str
) -> None:
    with pytest.raises(psycopg.errors.CheckViolation):
        _insert_operation(conn, _insert_run(conn), state)


@pytest.mark.parametrize("state", FINAL_STATES)
def test_a_final_operations_receipt_cannot_change(
    conn: psycopg.Connection[tuple[object, ...]], state: str
) -> None:
    op_id = _insert_operation(conn, _insert_run(conn))
    for step in PATHS[state]:
        _move(conn, op_id, step)

    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute(
            "UPDATE orchestrator.operations SET receipt = %s WHERE id = %s",
            (Jsonb({"forged": True}), op_id),
        )


def test_a_committed_operation_needs_a_receipt(
    conn: psycopg.Connection[tuple[object, ...]],
) -> None:
    op_id = _insert_operation(conn, _insert_run(conn), "submitted")

    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute(
            "UPDATE orchestrator.operations SET state = 'committed' WHERE id = %s", (op_id,)
        )


def test_journal_rows_can_be_appended_but_never_updated(
    conn: psycopg.Connection[tuple[object, ...]],
) -> None:
    run_id = _insert_run(conn)
    for seq in (1, 2):
        conn.execute(
            """INSERT INTO orchestrator.journal_entries
                   (run_id, seq, kind, schema_version, lease_token, payload)
               VALUES (%s, %s, 'started', 1, 1, %s)""",
            (run_id, seq, Jsonb({"n": seq})),
        )

    with pytest.raises(psycopg.errors.CheckViolation):
        conn.execute(
            "UPDATE orchestrator.journal_entries SET payload = %s WHERE run_id = %s AND seq = 1",
            (Jsonb({"n": 99}), run_id),
        )

    rows = conn.execute(
        "SELECT seq, payload FROM orchestrator.journal WHERE run_id = %s ORDER BY seq",
        (run_id,),
    ).fetchall()
    assert rows == [(1, {"n": 1}), (2, {"n": 2})]


def test_journal_sequence_numbers_are_unique_per_run(
    conn: psycopg.Connection[tuple[object, ...]],
) -> None:
    run_id = _insert_run(conn)
    insert = """INSERT INTO orchestrator.journal_entries
                    (run_id, seq, kind, schema_version, lease_token)
                VALUES (%s, 1, 'started', 1, 1)"""
    conn.execute(insert, (run_id,))

    with pytest.raises(psycopg.errors.UniqueViolation):
        conn.execute(insert, (run_id,))


def test_a_calls_entries_on_its_operation_row_are_append_only(
    conn: psycopg.Connection[tuple[object, ...]],
) -> None:
    """A call's ``call.submitted`` and ``call.completed`` entries are its operation row
    (migration 0019): the view shows them in the run's sequence, and once written neither its
    position in the journal nor what the entry says can change (C3: append-only)."""
    run_id = _insert_run(conn)
    (op_id,) = conn.execute(  # as the engine's write-ahead writes it
        """INSERT INTO orchestrator.operations
               (run_id, position, attempt, tool_name, tool_version, effect_class, tenant,
                principal, intent_digest, arguments, idempotency_key, state, lease_token,
                submitted_at, seq, entry_version)
           VALUES (%s, 0, 1, 'charge', '1', 'consequential', 't', 'p', 'intent', '{}', 'key',
                   'submitted', 7, now(), 1, 1)
           RETURNING id""", (run_id,)).fetchone()
    conn.execute("UPDATE orchestrator.operations SET state = 'committed', receipt = %s, "
                 "receipt_digest = 'd', finished_at = now(), completed_seq = 2 WHERE id = %s",
                 (Jsonb({"ok": True}), op_id))
    journal = conn.execute(
        "SELECT seq, kind, payload, lease_token FROM orchestrator.journal WHERE run_id = %s "
        "ORDER BY seq", (run_id,)).fetchall()
    assert [(seq, kind) for seq, kind, _, _ in journal] == [
        (1, "call.submitted"), (2, "call.completed")]
    assert journal[1][2] == {"result": {"ok": True}, "op": op_id}
    assert {token for *_, token in journal} == {7}

    other_run = _insert_run(conn)
    for change in ("seq = 3", "completed_seq = 5", "completed_seq = NULL", "intent_digest = 'x'",
                   "attempt = 2", "tool_version = '2'", "lease_token = 8", "entry_version = 2",
                   "finished_at = now() + interval '1 day'", "finished_at = NULL",
                   "position = 9", "id = id + 1000", "idempotency_key = 'k2'",
                   "effect_class = 'read'", "submitted_at = now() + interval '1 day'",
                   f"run_id = '{other_run}'", "tool_name = 'refund'"):
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute(f"UPDATE orchestrator.operations SET {change} WHERE id = %s", (op_id,))
    with pytest.raises(psycopg.errors.CheckViolation):  # a receipt's entry needs its receipt
        other = _insert_operation(conn, run_id, state="submitted")
        conn.execute("UPDATE orchestrator.operations SET completed_seq = 3, entry_version = 1 "
                     "WHERE id = %s", (other,))
    with pytest.raises(psycopg.errors.CheckViolation):  # no call.completed without its call
        stored = _insert_operation(conn, run_id, state="submitted")
        conn.execute("UPDATE orchestrator.operations SET state = 'committed', receipt = '1', "
                     "receipt_digest = 'd', completed_seq = 4, entry_version = 1 "
                     "WHERE id = %s", (stored,))
    # An operation whose entries are stored rows never gets them on the row later: not its
    # call.submitted, and not its call.completed once it is final.
    stored = _insert_operation(conn, run_id, state="submitted")
    conn.execute("UPDATE orchestrator.operations SET state = 'committed', receipt = '1', "
                 "receipt_digest = 'd' WHERE id = %s", (stored,))
    for change in ("seq = 5, entry_version = 1", "completed_seq = 6"):
        with pytest.raises(psycopg.errors.CheckViolation):
            conn.execute(f"UPDATE orchestrator.operations SET {change} WHERE id = %s",
                         (stored,))
    with pytest.raises(psycopg.errors.ObjectNotInPrerequisiteState):  # the view is read-only
        conn.execute("INSERT INTO orchestrator.journal (run_id, seq, kind, schema_version, "
                     "lease_token) VALUES (%s, 9, 'timer', 1, 1)", (run_id,))


def test_a_statement_writing_operations_compiles_no_stored_condition(
    conn: psycopg.Connection[tuple[object, ...]],
) -> None:
    """PostgreSQL reads a table's CHECK constraints and a fired trigger's WHEN condition back
    from their stored node text and compiles them once per statement, whatever its number of
    rows (migrations 0022, 0035). The rules of ``operations`` that the engine's writes meet are
    one PL/pgSQL trigger, compiled once per connection: no CHECK constraint, no WHEN condition
    on a trigger that an INSERT or a receipt's commit fires. (``operations_entry_append_only``
    keeps its condition: it fires only for an UPDATE that sets a column of a call's identity,
    which no write of the engine does.)"""
    checks = conn.execute("""
        SELECT conname FROM pg_constraint
        WHERE conrelid = 'orchestrator.operations'::regclass AND contype = 'c'""").fetchall()
    assert checks == []
    fired = conn.execute("""
        SELECT t.tgname, t.tgqual IS NOT NULL
        FROM pg_trigger t
        WHERE t.tgrelid = 'orchestrator.operations'::regclass AND NOT t.tgisinternal
          AND (t.tgtype & 4 = 4  -- an INSERT trigger
               OR (t.tgtype & 16 = 16  -- an UPDATE trigger of a column a commit sets
                   AND EXISTS (SELECT 1 FROM unnest(t.tgattr) AS a(n)
                               JOIN pg_attribute c ON c.attrelid = t.tgrelid AND c.attnum = a.n
                               WHERE c.attname IN ('state', 'receipt', 'receipt_digest',
                                                   'finished_at', 'updated_at',
                                                   'completed_seq'))))
        ORDER BY 1""").fetchall()
    assert fired == [("operations_guard", False)]


@pytest.mark.parametrize(("column", "value", "constraint"), [
    ("state", "bogus", "ck_operations_state"),
    ("effect_class", "maybe", "ck_operations_effect_class"),
    ("attempt", 0, "ck_operations_identity"),
    ("position", -1, "ck_operations_identity"),
    ("seq", 0, "ck_operations_entry"),
])
def test_the_former_check_constraints_still_refuse_a_row_and_are_named(
    conn: psycopg.Connection[tuple[object, ...]], column: str, value: object, constraint: str,
) -> None:
    """The CHECK constraints became the guard's rules (migration 0035): the same rows are
    refused, with the same SQLSTATE and the constraint's name in the error, and nothing is
    written."""
    run_id = _insert_run(conn)
    op_id = _insert_operation(conn, run_id, "submitted")
    if column == "seq":  # set once, at the insert (after that the entry is append-only)
        with pytest.raises(psycopg.errors.CheckViolation) as refused:
            conn.execute("""
                INSERT INTO orchestrator.operations
                    (run_id, position, attempt, tool_name, tool_version, effect_class, tenant,
                     principal, intent_digest, arguments, idempotency_key, state, seq,
                     entry_version)
                VALUES (%s, 999, 1, 'charge', '1', 'consequential', 't', 'p', 'intent', '{}',
                        'key', 'submitted', %s, 1)""", (run_id, value))
        assert conn.execute("SELECT count(*) FROM orchestrator.operations WHERE run_id = %s",
                            (run_id,)).fetchone() == (1,)
    else:
        with pytest.raises(psycopg.errors.CheckViolation) as refused:
            conn.execute(f"UPDATE orchestrator.operations SET {column} = %s WHERE id = %s",
                         (value, op_id))
    if column != "state":  # a bogus state is first an arrow C5 does not draw
        assert refused.value.diag.constraint_name == constraint
    row = conn.execute("SELECT state, effect_class, attempt, position FROM "
                       "orchestrator.operations WHERE id = %s", (op_id,)).fetchone()
    assert row == ("submitted", "consequential", 1, row[3]) and row[3] >= 0


def test_a_replication_session_skips_the_former_triggers_rules_not_the_constraints(
    conn: psycopg.Connection[tuple[object, ...]],
) -> None:
    """A session with ``session_replication_role = replica`` skips ordinary triggers and never
    skipped a CHECK constraint. The guard that took their place (migration 0035) keeps both:
    such a session may create an operation in a final state or move it against C5, as the
    bulk loads of bench/scale.py and bench/console_seed.py (and a logical replication
    subscriber's initial copy) do, and the former CHECK constraints still refuse its rows."""
    run_id = _insert_run(conn)
    conn.execute("SET session_replication_role = replica")
    try:
        conn.execute("""
            INSERT INTO orchestrator.operations
                (run_id, position, attempt, tool_name, tool_version, effect_class, tenant,
                 principal, intent_digest, arguments, idempotency_key, state, receipt,
                 receipt_digest)
            VALUES (%s, 0, 1, 'charge', '1', 'consequential', 't', 'p', 'intent', '{}', 'key',
                    'committed', '{}', 'r')""", (run_id,))
        op_id = _insert_operation(conn, run_id, "submitted")
        conn.execute("UPDATE orchestrator.operations SET state = 'pending' WHERE id = %s",
                     (op_id,))
        with pytest.raises(psycopg.errors.CheckViolation) as refused:
            _insert_operation(conn, run_id, "bogus")
        assert refused.value.diag.constraint_name == "ck_operations_state"
        with pytest.raises(psycopg.errors.CheckViolation) as refused:
            conn.execute("UPDATE orchestrator.operations SET state = 'committed' WHERE id = %s",
                         (op_id,))
        assert refused.value.diag.constraint_name == "ck_operations_committed_receipt"
        with pytest.raises(psycopg.errors.CheckViolation) as refused:
            conn.execute("UPDATE orchestrator.operations SET state = 'bogus', attempt = 0 "
                         "WHERE id = %s", (op_id,))
        assert refused.value.diag.constraint_name == "ck_operations_identity"
    finally:
        conn.execute("RESET session_replication_role")
    assert conn.execute("SELECT state FROM orchestrator.operations WHERE run_id = %s "
                        "ORDER BY position", (run_id,)).fetchall() == [("committed",),
                                                                      ("pending",)]


@pytest.mark.parametrize(("change", "constraint"), [
    ("state = 'committed', position = -1", "ck_operations_committed_receipt"),
    ("state = 'committed', receipt_digest = 'r', completed_seq = 7, effect_class = 'maybe'",
     "ck_operations_effect_class"),
    ("state = 'committed', receipt_digest = 'r', completed_seq = 7, attempt = 0",
     "ck_operations_entry"),
])
def test_a_row_that_breaks_two_former_constraints_names_the_first_by_name(
    conn: psycopg.Connection[tuple[object, ...]], change: str, constraint: str,
) -> None:
    """PostgreSQL checks a table's CHECK constraints in the order of their names and names
    the first one a row breaks; the guard's rules that replaced them (migration 0035) do the
    same."""
    op_id = _insert_operation(conn, _insert_run(conn), "submitted")
    with pytest.raises(psycopg.errors.CheckViolation) as refused:
        conn.execute(f"UPDATE orchestrator.operations SET {change} WHERE id = %s", (op_id,))
    assert refused.value.diag.constraint_name == constraint


@pytest.mark.parametrize("change", [
    "attempt = 0, tool_name = NULL",
    "effect_class = 'maybe', arguments = NULL",
    "state = 'committed', attempt = NULL",
])
def test_a_null_in_a_not_null_column_is_refused_as_such_before_a_former_constraint(
    conn: psycopg.Connection[tuple[object, ...]], change: str,
) -> None:
    """PostgreSQL checks NOT NULL before CHECK constraints: a row with both a NULL where none
    may be and a former constraint broken is refused with ``not_null_violation``, as before
    migration 0035."""
    run_id = _insert_run(conn)
    op_id = _insert_operation(conn, run_id, "submitted")
    with pytest.raises(psycopg.errors.NotNullViolation):
        conn.execute(f"UPDATE orchestrator.operations SET {change} WHERE id = %s", (op_id,))
    with pytest.raises(psycopg.errors.NotNullViolation):
        conn.execute("""
            INSERT INTO orchestrator.operations
                (run_id, position, attempt, tool_name, tool_version, effect_class, tenant,
                 principal, intent_digest, arguments, idempotency_key, state)
            VALUES (%s, 1, 0, 'charge', '1', 'consequential', 't', 'p', 'intent', '{}', 'key',
                    NULL)""", (run_id,))
