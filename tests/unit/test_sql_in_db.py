"""All SQL of the package is in ``orchestrator/db/``, and it names its schema once.

A database call, for these tests, is a call of an attribute named ``execute`` or
``executemany`` on anything (``conn.execute(...)``, ``cur.executemany(...)``, ``(await
x).execute(...)``): the names psycopg's connections and cursors use. Other names are not
database calls, even those that end in ``execute`` (the worker's ``self._execute(claim)``),
nor are plain function calls. The source is read with :mod:`ast`, so comments and strings
never count. Outside ``orchestrator/db/`` a module asks a store function there (which takes
a connection and never commits) instead.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "orchestrator"
DB = PACKAGE / "db"
DATABASE_CALLS = {"execute", "executemany"}


def _database_calls(path: Path) -> list[int]:
    tree = ast.parse(path.read_text(), filename=str(path))
    return [node.lineno for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
            and node.func.attr in DATABASE_CALLS]


def test_database_calls_are_made_in_db_only() -> None:
    found = [f"{path.relative_to(PACKAGE.parent)}:{line}"
             for path in sorted(PACKAGE.rglob("*.py")) if DB not in path.parents
             for line in _database_calls(path)]
    assert not found, f"SQL outside orchestrator/db/ (move it into a store function): {found}"


def test_the_rule_sees_database_calls_and_only_them() -> None:
    assert _database_calls(DB / "journal.py")  # the store itself is full of them
    assert not _database_calls(PACKAGE / "worker.py")  # self._execute(claim) is not one


def test_the_schema_is_named_once() -> None:
    """``SCHEMA`` in db/schema.py is the one name of the schema; statement modules import it
    (``from orchestrator.db.schema import SCHEMA as S``) rather than spell it again."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                    and node.value.value == "orchestrator"
                    and any(isinstance(t, ast.Name) and t.id in ("S", "SCHEMA")
                            for t in node.targets)):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert [where.split(":")[0] for where in found] == ["orchestrator/db/schema.py"], found
