"""How the group writer splits a batch into statements (pure: no database)."""

from __future__ import annotations

from typing import Any

from orchestrator.db.writer import Statement, _group


def _statement(sql: str, key: object) -> tuple[Statement, Any]:
    return Statement(sql, "{}", key, lambda got: got), None


def test_a_run_never_has_two_rows_in_one_statement() -> None:
    """The hot statements check their rows by counting what each part wrote (db/steps.py):
    equal counts mean every row applied only if no statement holds two rows of one run."""
    batch = [_statement("A", "run1"), _statement("A", "run2"), _statement("A", "run1"),
             _statement("B", "run1"), _statement("A", "run3")]
    groups = _group(batch)
    for group in groups:
        keys = [w.key for w, _ in group]
        assert len(keys) == len(set(keys)), keys
    assert [[(w.sql, w.key) for w, _ in g] for g in groups] == [
        [("A", "run1"), ("A", "run2")], [("A", "run1"), ("A", "run3")], [("B", "run1")]]
