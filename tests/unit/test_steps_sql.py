"""The journal entries that the hot steps write in SQL follow the entry definitions of
``orchestrator.journal``: the stored ``call.completed`` entry of a receipt that cannot go on
its operation row and the ``run.completed`` entry of a run's success
(``orchestrator/db/steps.py``), and the ``call.submitted`` and ``call.completed`` entries that
the view ``orchestrator.journal`` makes of an operation row (migration 0019). Each has the kinds
it should, and each payload exactly the fields its kind defines (the Python path builds the
same entries with ``entry``)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

from orchestrator.db import steps
from orchestrator.journal import EventKind, check_payload

# An entry in a statement: its kind as a literal, then its payload as jsonb_build_object(...)
# (whose arguments hold no parentheses).
_ENTRY = re.compile(r"'(?P<kind>[a-z]+\.[a-z_]+)',[^;]*?jsonb_build_object\((?P<args>[^()]*)\)")

_MIGRATION = Path(__file__).parents[2] / "migrations" / "versions" / "0019_calls_in_the_ledger.py"


def _view() -> str:
    spec = importlib.util.spec_from_file_location("migration_0019", _MIGRATION)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text: str = module.JOURNAL_VIEW
    return text


def _entries(sql: str) -> list[tuple[EventKind, list[str]]]:
    found = []
    for match in _ENTRY.finditer(sql):
        args = [a.strip() for a in match["args"].split(",")]
        fields = [name.strip("'") for name in args[0::2]]
        found.append((EventKind(match["kind"]), fields))
    return found


@pytest.mark.parametrize(("sql", "kinds"), [
    (steps.OPERATION_BEGIN, [EventKind.CALL_COMPLETED]),  # a receipt's stored entry (kept)
    (steps.RECEIPT_COMMIT, [EventKind.CALL_COMPLETED]),
    (steps.RUN_SUCCEED, [EventKind.CALL_COMPLETED, EventKind.RUN_COMPLETED]),
    (_view(), [EventKind.CALL_SUBMITTED, EventKind.CALL_COMPLETED]),
], ids=["begin", "commit", "succeed", "view"])
def test_each_statement_writes_its_entries_as_defined(sql: str, kinds: list[EventKind]) -> None:
    entries = _entries(sql)
    assert [kind for kind, _ in entries] == kinds
    for kind, fields in entries:
        check_payload(kind, dict.fromkeys(fields))  # raises on a missing or unknown field


def test_a_wrong_payload_is_seen() -> None:
    bad = _view().replace("'op', o.id)", "'operation', o.id)")
    ((_, _), (kind, fields)) = _entries(bad)
    with pytest.raises(ValueError, match="operation"):
        check_payload(kind, dict.fromkeys(fields))
