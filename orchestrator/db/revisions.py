"""The code's migrations as revisions: the folder they are in, the head, every revision they
know, and how a database's stamp compares with them (:class:`SchemaStatus`). Apart from
:mod:`orchestrator.db.migrate` so that the storage layer can say how a schema differs from the
code (:func:`orchestrator.db.database.schema_mismatch`) without importing the commands that
migrate."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from alembic.script import ScriptDirectory

from orchestrator.errors import DatabaseError

__all__ = ["SchemaStatus", "head_revision", "known_revisions", "script_location", "status_of"]


def script_location() -> Path:
    """The migrations folder, whether running from a checkout or an installed package.

    Installed (a wheel, or the link tree of ``make install``'s editable install), the folder is
    the package ``orchestrator._migrations``. A checkout imported as it is (the repository root
    on ``sys.path``, as the tests and ``python -m orchestrator`` from the root have it) has no
    such package: its ``migrations/`` folder, beside the package, is the same scripts.
    """
    try:
        return Path(str(resources.files("orchestrator._migrations")))
    except ModuleNotFoundError:
        checkout = Path(__file__).resolve().parents[2] / "migrations"
        if not (checkout / "env.py").is_file():
            raise
        return checkout


def head_revision() -> str:
    heads = ScriptDirectory(str(script_location())).get_heads()
    if len(heads) != 1:  # pragma: no cover - guarded by the migration tests
        raise DatabaseError(f"the migrations have {len(heads)} heads; expected exactly one")
    return heads[0]


def known_revisions() -> set[str]:
    script = ScriptDirectory(str(script_location()))
    return {rev.revision for rev in script.walk_revisions()}


@dataclass(frozen=True)
class SchemaStatus:
    """The outcome of comparing a database with the code's migrations."""

    current: str | None
    head: str
    state: str  # "current", "behind", "empty" or "ahead"

    @property
    def ok(self) -> bool:
        return self.state == "current"

    def describe(self) -> str:
        if self.state == "current":
            return f"the database schema is current (revision {self.head})"
        if self.state == "empty":
            return (
                f"the database has no orchestrator schema (code is at {self.head}); "
                "run `orchestrator db upgrade`"
            )
        if self.state == "behind":
            return (
                f"the database schema is at {self.current}, behind the code ({self.head}); "
                "run `orchestrator db upgrade`"
            )
        return (
            f"the database schema is at {self.current}, which this code does not know "
            f"(code is at {self.head}): it was written by a newer release; upgrade the code"
        )


def status_of(current: str | None) -> SchemaStatus:
    """How a database stamped ``current`` (None: no schema) compares with the code."""
    head = head_revision()
    if current is None:
        state = "empty"
    elif current == head:
        state = "current"
    elif current in known_revisions():
        state = "behind"
    else:
        state = "ahead"
    return SchemaStatus(current=current, head=head, state=state)
