"""Applying and checking the schema migrations.

``upgrade`` brings a database to the code's head revision; ``check`` says whether a database
matches the code. A database stamped with a revision this code does not know (written by a newer
release) is refused by both: it is never downgraded or overwritten.
"""

from __future__ import annotations

from typing import Any

from alembic import command
from alembic.config import Config
from sqlalchemy import create_engine, inspect, pool, text
from sqlalchemy.exc import SQLAlchemyError

from orchestrator.db.config import DatabaseTarget
from orchestrator.db.database import schema_error
from orchestrator.db.revisions import (
    SchemaStatus,
    head_revision,
    known_revisions,
    script_location,
    status_of,
)
from orchestrator.db.schema import SCHEMA
from orchestrator.errors import ConfigurationError, DatabaseError

__all__ = ["SchemaStatus", "check", "current_revision", "head_revision", "known_revisions",
           "schema_error", "script_location", "upgrade"]

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


def _refusal(exc: SQLAlchemyError) -> str | None:
    """What a migration's own check said when it refused the database as it found it (a
    ``RAISE EXCEPTION`` in its SQL, SQLSTATE P0001: its message, detail and hint), else None.
    Written by our migrations, it names our objects only."""
    diag = getattr(getattr(exc, "orig", None), "diag", None)
    if diag is None or getattr(diag, "sqlstate", None) != "P0001":
        return None
    parts = [diag.message_primary, diag.message_detail, diag.message_hint]
    return "; ".join(str(p) for p in parts if p)


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


def check(target: DatabaseTarget) -> SchemaStatus:
    return status_of(current_revision(target))


def upgrade(target: DatabaseTarget, revision: str = "head") -> SchemaStatus:
    """Upgrade to ``revision``; refuse a database stamped by a newer release."""
    status = check(target)
    if status.state == "ahead":
        raise DatabaseError(status.describe(), code="SCHEMA_MISMATCH", retryable=False)
    if status.state != "current" or revision != "head":
        try:
            command.upgrade(alembic_config(target), revision)
        except SQLAlchemyError as exc:
            refused = _refusal(exc)
            if refused is not None:
                raise ConfigurationError(
                    f"the upgrade of {target.display} stopped: {refused}") from exc
            raise DatabaseError(
                f"the upgrade of {target.display} failed: {_cause_name(exc)}"
            ) from exc
    return check(target)


def downgrade(target: DatabaseTarget, revision: str) -> None:
    """Downgrade to ``revision`` (used by the migration tests; not offered on the CLI)."""
    command.downgrade(alembic_config(target), revision)
