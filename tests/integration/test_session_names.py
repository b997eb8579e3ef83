"""A fleet's sessions can be told apart in ``pg_stat_activity``: every connection names itself
``orchestrator``, a worker's and a reconciler's after their ids, unless the URL names them."""

from __future__ import annotations

import psycopg

from orchestrator import Orchestrator
from orchestrator.db.probe import connection_name
from tests.integration.conftest import OWNER, running, wait_for


def _names(url: str) -> set[str]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT application_name FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()").fetchall()
    return {name for (name,) in rows}


async def test_a_workers_sessions_are_named_after_it(app, migrated_database_url):
    async with running(app) as worker:
        named = connection_name("worker", worker.worker_id)
        assert named.startswith("orchestrator worker ")
        await wait_for(lambda: named in _names(migrated_database_url))


async def test_a_reconcilers_sessions_are_named_after_it(app, migrated_database_url):
    reconciler = app.create_reconciler(poll_interval=0.1)
    named = connection_name("reconciler", reconciler.id.removeprefix("reconciler:"))
    await reconciler.db.read(lambda conn: conn.execute("SELECT 1"))
    try:
        assert named in _names(migrated_database_url)
    finally:
        await app.database.close()


async def test_a_urls_own_application_name_wins(migrated_database_url):
    url = migrated_database_url + ("&" if "?" in migrated_database_url else "?") + \
        "application_name=billing-fleet"
    app = Orchestrator(url, default_owner=OWNER, lease_ttl=5.0)
    try:
        async with running(app):
            await wait_for(lambda: "billing-fleet" in _names(migrated_database_url))
            names = _names(migrated_database_url)
        assert not any(name.startswith("orchestrator") for name in names), names
    finally:
        app.close()


def test_a_session_name_is_printable_ascii_and_fits_postgresqls_63_bytes():
    name = connection_name("worker", "hôst-" + "x" * 80)
    assert name.startswith("orchestrator worker h?st-") and len(name) == 63
    assert name.isascii() and name.isprintable()
