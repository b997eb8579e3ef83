"""Alembic environment for the orchestrator's schema.

Runs every migration in one transaction that first takes a transaction-level advisory lock, so
that several processes upgrading one database at once serialise: the first does the work, the
others wait, then find nothing left to do. The version table is ``orchestrator.alembic_version``
so that a host application's own Alembic history never collides with ours.
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import create_engine, pool, text

from orchestrator.db.migrate import MIGRATION_LOCK_KEY, VERSION_TABLE, include_name
from orchestrator.db.schema import SCHEMA, metadata

config = context.config


def _url() -> str:
    url = config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from orchestrator.db.config import resolve_database

    return resolve_database().sqlalchemy_url


def run_migrations_online() -> None:
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as connection:
        context.configure(
            connection=connection,
            target_metadata=metadata,
            version_table=VERSION_TABLE,
            version_table_schema=SCHEMA,
            include_schemas=True,
            include_name=include_name,
            compare_server_default=True,
        )
        with context.begin_transaction():
            connection.execute(text("SELECT pg_advisory_xact_lock(:key)"),
                               {"key": MIGRATION_LOCK_KEY})
            connection.execute(text(f'CREATE SCHEMA IF NOT EXISTS "{SCHEMA}"'))
            context.run_migrations()
    engine.dispose()


if context.is_offline_mode():  # pragma: no cover - offline SQL generation is not supported
    raise SystemExit("offline migrations are not supported; run `orchestrator db upgrade`")
run_migrations_online()
