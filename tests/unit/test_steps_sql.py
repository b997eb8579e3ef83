"""The journal entries that the hot steps' statements (``orchestrator/db/steps.py``) write in
SQL follow the entry definitions of ``orchestrator.journal``: each statement's kinds are the
ones it should append, and each payload has exactly the fields its kind defines (the Python
path builds the same entries with ``entry``)."""

from __future__ import annotations

import re

import pytest

from orchestrator.db import steps
from orchestrator.journal import EventKind, check_payload

# An entry in a statement: its kind as a literal, then its payload as jsonb_build_object(...)
# (whose arguments hold no parentheses).
_ENTRY = re.compile(r"'(?P<kind>[a-z]+\.[a-z_]+)',[^;]*?jsonb_build_object\((?P<args>[^()]*)\)")


def _entries(sql: str) -> list[tuple[EventKind, list[str]]]:
    found = []
    for match in _ENTRY.finditer(sql):
        args = [a.strip() for a in match["args"].split(",")]
        fields = [name.strip("'") for name in args[0::2]]
        found.append((EventKind(match["kind"]), fields))
    return found


@pytest.mark.parametrize(("sql", "kinds"), [
    (steps.OPERATION_BEGIN, [EventKind.CALL_COMPLETED, EventKind.CALL_SUBMITTED]),
    (steps.RECEIPT_COMMIT, [EventKind.CALL_COMPLETED]),
    (steps.RUN_SUCCEED, [EventKind.CALL_COMPLETED, EventKind.RUN_COMPLETED]),
], ids=["begin", "commit", "succeed"])
def test_each_statement_writes_its_entries_as_defined(sql: str, kinds: list[EventKind]) -> None:
    entries = _entries(sql)
    assert [kind for kind, _ in entries] == kinds
    for kind, fields in entries:
        check_payload(kind, dict.fromkeys(fields))  # raises on a missing or unknown field


def test_a_wrong_payload_is_seen() -> None:
    bad = steps.RECEIPT_COMMIT.replace("'op', x.prev_op", "'operation', x.prev_op")
    ((kind, fields),) = _entries(bad)
    with pytest.raises(ValueError, match="operation"):
        check_payload(kind, dict.fromkeys(fields))
