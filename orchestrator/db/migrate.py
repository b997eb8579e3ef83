"""Applying and checking the schema migrations.

``upgrade`` brings a database to the code's head revision; ``check`` says whether a database
matches the code. A database stamped with a revision this code does not know (written by a newer
release) is refused by both: it is never downgraded or overwritten.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, inspect, pool, text
from sqlalchemy.exc import SQLAlchemyError

from orchestrator.db.config import DatabaseTarget
from orchestrator.db.database import schema_missing
from orchestrator.db.revisions import head_revision, known_revisions, script_location
from orchestrator.db.schema import SCHEMA
from orchestrator.errors import DatabaseError

VERSION_TABLE = "alembic_version"
# An arbitrary constant: the advisory lock key that serialises concurrent upgrades.
MIGRATION_LOCK_KEY = 7_202_611_290_001


def include_name(name: str | None, type_: str, parent_names: Any) -> bool:
    """Autogenerate filter: only our schema, and not Alembic's own version table."""
    if type_ == "schema":
        return name == SCHEMA
    if type_ == "table":
        return name != VERSION_TABLE
    return True


def _cause_name(exc: SQLAlchemyError) -> str:
    # Only DBAPI errors carry ``orig``; ArgumentError and friends do not.
    return type(getattr(exc, "orig", None) or exc).__name__


def alembic_config(target: DatabaseTarget) -> Config:
    cfg = Config()
    cfg.set_main_option("script_location", str(script_location()))
    cfg.set_main_option("sqlalchemy.url", target.sqlalchemy_url.replace("%", "%%"))
    return cfg


def current_revision(target: DatabaseTarget) -> str | None:
    """The revision the database is stamped with, or None for a database without our schema."""
    engine = create_engine(target.sqlalchemy_url, poolclass=pool.NullPool,
                           connect_args={"connect_timeout": 10})
    try:
        with engine.connect() as conn:
            if not inspect(conn).has_table(VERSION_TABLE, schema=SCHEMA):
                return None
            row = conn.execute(
                text(f'SELECT version_num FROM "{SCHEMA}"."{VERSION_TABLE}"')
            ).first()
            return None if row is None else str(row[0])
    except SQLAlchemyError as exc:
        raise DatabaseError(
            f"cannot read the schema version of {target.display}: {_cause_name(exc)}"
        ) from exc
    finally:
        engine.dispose()


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


def schema_error(target: DatabaseTarget, status: SchemaStatus) -> DatabaseError:
    """``SCHEMA_MISMATCH`` for a database that does not match the code, as a worker or a
    reconciler refuses to start on it: for a database without the schema, the very words of
    the Python API (:func:`~orchestrator.db.database.schema_missing`)."""
    if status.state == "empty":
        return schema_missing(target)
    return DatabaseError(f"{target.display}: {status.describe()}", code="SCHEMA_MISMATCH",
                         retryable=False)


def check(target: DatabaseTarget) -> SchemaStatus:
    current = current_revision(target)
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


_UNDEFINED = (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn,
              psycopg.errors.UndefinedFunction, psycopg.errors.InvalidSchemaName)
"""What a statement meets on a database whose schema is older than the code (or missing)."""


def mismatch_of(target: DatabaseTarget, exc: BaseException) -> DatabaseError | None:
    """``SCHEMA_MISMATCH`` in the words of :meth:`SchemaStatus.describe` (behind, empty or
    ahead, and what to run) when ``exc`` came from a table, column or function the database
    lacks and its schema does not match the code; None otherwise (a schema that matches, or
    one that cannot be read: the error stands as it is). The storage seam says which only for
    a missing table (a missing column or function could be a bug as well); a command line,
    which can afford one more look, says which for those too."""
    cause: BaseException | None = exc
    seen: set[int] = set()
    while cause is not None and id(cause) not in seen and not isinstance(cause, _UNDEFINED):
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    if not isinstance(cause, _UNDEFINED):
        return None
    try:
        status = check(target)
    except DatabaseError:
        return None
    return None if status.ok else schema_error(target, status)


def upgrade(target: DatabaseTarget, revision: str = "head") -> SchemaStatus:
    """Upgrade to ``revision``; refuse a database stamped by a newer release."""
    status = check(target)
    if status.state == "ahead":
        raise DatabaseError(status.describe(), code="SCHEMA_MISMATCH", retryable=False)
    if status.state != "current" or revision != "head":
        try:
            command.upgrade(alembic_config(target), revision)
        except SQLAlchemyError as exc:
            raise DatabaseError(
                f"the upgrade of {target.display} failed: {_cause_name(exc)}"
            ) from exc
    return check(target)


def downgrade(target: DatabaseTarget, revision: str) -> None:
    """Downgrade to ``revision`` (used by the migration tests; not offered on the CLI)."""
    command.downgrade(alembic_config(target), revision)
