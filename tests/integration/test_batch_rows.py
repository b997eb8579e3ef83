"""What a hot statement reads from a row is what the worker put in it (orchestrator.db.steps).

Each hot write is one row of a set-based statement: the worker writes the row as a JSON array
of the statement's columns in order (``row_text``), and the statement's CTE ``x`` reads each
value back by its position and casts it to the column's type (``batch_x``). A row built with
one more or one fewer value, or values in another order, would still parse and would write
the wrong columns; so for each of the three statements, rows built by the same functions the
engine calls are read back through the statement's own ``x`` on a real PostgreSQL and compared
value by value, for values drawn by hypothesis: text with quotes, backslashes and any
character PostgreSQL's text can hold, integers at the edges of their columns, JSON values
including ``null`` (which a ``jsonb`` column reads as SQL NULL, as ``jsonb_to_record`` did).
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from orchestrator.canonical import canonical_json
from orchestrator.db.steps import (
    Receipt,
    Statement,
    operation_begin_fast,
    receipt_commit_fast,
    run_succeed_fast,
)

TEXT = st.text(st.characters(exclude_categories=("Cs",), exclude_characters="\x00"),
               max_size=40)
BIGINT = st.integers(-(2**63), 2**63 - 1)
INT = st.integers(-(2**31), 2**31 - 1)
SMALLINT = st.integers(-(2**15), 2**15 - 1)
JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | TEXT
    | st.floats(allow_nan=False, allow_infinity=False),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
    max_leaves=8)
RECEIPTS = st.none() | st.builds(
    Receipt, op_id=BIGINT, position=INT, name=TEXT, text=JSON.map(canonical_json),
    digest=TEXT)


def _x_of(statement: Statement) -> str:
    """The statement's own CTE ``x``, selected alone."""
    head, sep, _ = statement.sql.partition("), fence AS")
    assert sep, "the statement's CTE x is followed by its fence"
    return head + ")\nSELECT * FROM x"


def _read(conn: psycopg.Connection[Any], statement: Statement) -> dict[str, Any]:
    with conn.cursor(row_factory=psycopg.rows.dict_row) as cur:
        cur.execute(_x_of(statement), ("[" + statement.row + "]",))
        rows = cur.fetchall()
    assert len(rows) == 1 and rows[0]["i"] == 1
    return rows[0]


def _receipt_read(got: dict[str, Any], receipt: Receipt | None) -> None:
    if receipt is None:
        assert [got[c] for c in ("prev_op", "prev_position", "prev_name", "digest",
                                 "receipt")] == [None] * 5
        return
    assert (got["prev_op"], got["prev_position"], got["prev_name"], got["digest"]) == (
        receipt.op_id, receipt.position, receipt.name, receipt.digest)
    assert got["receipt"] == json.loads(receipt.text)  # JSON null: SQL NULL, read as None


@pytest.fixture
def conn(migrated_database_url: str) -> Any:
    with psycopg.connect(migrated_database_url, autocommit=True) as c:
        yield c


SETTINGS = settings(max_examples=150, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])


@SETTINGS
@given(run_id=st.uuids(), token=BIGINT, expected=BIGINT, position=INT, attempt=INT,
       texts=st.lists(TEXT, min_size=8, max_size=8), key=st.none() | TEXT, v=SMALLINT,
       arguments=st.dictionaries(TEXT, JSON, max_size=3), receipt=RECEIPTS)
def test_a_begin_row_is_read_as_written(conn: Any, run_id: uuid.UUID, token: int,
                                        expected: int, position: int, attempt: int,
                                        texts: list[str], key: str | None, v: int,
                                        arguments: dict[str, Any],
                                        receipt: Receipt | None) -> None:
    tool_name, tool_version, effect_class, tenant, principal, digest, worker, _ = texts
    row = {"run_id": run_id, "token": token, "position": position, "attempt": attempt,
           "tool_name": tool_name, "tool_version": tool_version, "effect_class": effect_class,
           "tenant": tenant, "principal": principal, "intent_digest": digest,
           "idempotency_key": key, "worker_id": worker, "arguments": canonical_json(arguments)}
    got = _read(conn, operation_begin_fast(row, expected=expected, v=v, receipt=receipt))
    assert got == {**got, **{k: row[k] for k in row if k != "arguments"},
                   "expected": expected, "v": v, "arguments": arguments}
    _receipt_read(got, receipt)


@SETTINGS
@given(run_id=st.uuids(), token=BIGINT, expected=BIGINT, v=SMALLINT, receipt=RECEIPTS)
def test_a_receipt_row_is_read_as_written(conn: Any, run_id: uuid.UUID, token: int,
                                          expected: int, v: int,
                                          receipt: Receipt | None) -> None:
    if receipt is None:  # a lone receipt always carries one
        receipt = Receipt(op_id=1, position=0, name="t", text="null", digest="d")
    got = _read(conn, receipt_commit_fast(receipt, run_id=run_id, token=token,
                                          expected=expected, v=v))
    assert (got["run_id"], got["token"], got["expected"], got["v"]) == (run_id, token,
                                                                         expected, v)
    _receipt_read(got, receipt)


@SETTINGS
@given(run_id=st.uuids(), token=BIGINT, expected=BIGINT, v=SMALLINT, result=JSON,
       receipt=RECEIPTS)
def test_a_success_row_is_read_as_written(conn: Any, run_id: uuid.UUID, token: int,
                                          expected: int, v: int, result: Any,
                                          receipt: Receipt | None) -> None:
    got = _read(conn, run_succeed_fast(run_id=run_id, token=token, expected=expected,
                                       result=canonical_json(result), v=v, receipt=receipt))
    assert (got["run_id"], got["token"], got["expected"], got["v"]) == (run_id, token,
                                                                         expected, v)
    assert got["result"] == result  # JSON null: SQL NULL, read as None
    _receipt_read(got, receipt)
