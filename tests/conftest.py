"""Fixtures shared by every test: the PostgreSQL server and throw-away databases.

The server is chosen once per test session (see :mod:`tests.dbtools`):
``ORCHESTRATOR_TEST_DATABASE_URL`` if set, else ``127.0.0.1:5432`` if it answers, else the
embedded PostgreSQL. Set ``ORCHESTRATOR_TEST_EMBEDDED=1`` to force the embedded server even
when a local one is running, e.g. to check that the suite passes on a machine without one.

Fixtures:

- ``pg_admin_url`` (session): a libpq URL to an admin database on the chosen server;
- ``template_database`` (session): the *name* of a database migrated to head once per session,
  used as the template of every clone; dropped at the end;
- ``migrated_database_url`` (function): URL of a fresh clone of the template;
- ``empty_database_url`` (function): URL of a fresh empty database;
- ``make_role`` (function): ``make_role(kind)`` creates a login role for the test's migrated
  database (see :mod:`tests.roles`); every role it made is dropped after the test;
- ``pgbouncer`` (session): PgBouncer in transaction mode in front of the server (see
  :mod:`tests.pgbouncer`); ``pgbouncer.url(url)`` is a database's URL through it. Tests that
  use it skip, saying why, when the ``pgbouncer`` program cannot be had.

Function-scoped databases are dropped after the test, after terminating any connection the
test left open. Tests under ``tests/<kind>/`` get the ``<kind>`` marker automatically, so
``pytest -m "not acceptance"`` works without every module repeating it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.rows import dict_row

from orchestrator.db import migrate
from orchestrator.db.config import DatabaseTarget, validate_url
from tests import dbtools
from tests import pgbouncer as bouncers
from tests.roles import Role, create_role, drop_role

_DIRECTORY_MARKERS = ("unit", "integration", "acceptance", "migrations", "browser", "failover")
_TESTS_DIR = Path(__file__).parent


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        try:
            relative = item.path.relative_to(_TESTS_DIR)
        except ValueError:
            continue
        if relative.parts and relative.parts[0] in _DIRECTORY_MARKERS:
            item.add_marker(relative.parts[0])


@pytest.fixture(scope="session")
def pg_admin_url() -> str:
    """A libpq URL to an admin database on the server the tests use."""
    server = dbtools.choose_server()
    if not dbtools.can_connect(server.admin_url, timeout=10):
        pytest.fail(
            f"cannot connect to the test database server ({server.source}); "
            f"check {dbtools.ENV_TEST_URL}",
            pytrace=False,
        )
    return server.admin_url


@pytest.fixture(scope="session")
def template_database(pg_admin_url: str) -> Iterator[str]:
    """Name of a database migrated to head once per session; every clone copies it."""
    name = dbtools.unique_name("tpl")
    url = dbtools.create_database(pg_admin_url, name)
    try:
        status = migrate.upgrade(DatabaseTarget(validate_url(url), "argument"))
        assert status.ok, status.describe()
        yield name
    finally:
        dbtools.drop_database(pg_admin_url, name)


@pytest.fixture
def migrated_database_url(pg_admin_url: str, template_database: str) -> Iterator[str]:
    """URL of a fresh database with the current schema, dropped after the test."""
    name = dbtools.unique_name("mig")
    url = dbtools.create_database(pg_admin_url, name, template=template_database)
    try:
        yield url
    finally:
        dbtools.drop_database(pg_admin_url, name)


@pytest.fixture
def sql(migrated_database_url: str) -> Iterator[Callable[..., list[dict[str, Any]]]]:
    """Run one statement on the test database (autocommit) and return its rows."""
    conn = psycopg.connect(migrated_database_url, autocommit=True, row_factory=dict_row)

    def run(query: str, params: Any = None) -> list[dict[str, Any]]:
        cur = conn.execute(query, params)
        return cur.fetchall() if cur.description else []

    yield run
    conn.close()


@pytest.fixture
def empty_database_url(pg_admin_url: str) -> Iterator[str]:
    """URL of a fresh, empty database (no orchestrator schema), dropped after the test."""
    name = dbtools.unique_name("empty")
    url = dbtools.create_database(pg_admin_url, name)
    try:
        yield url
    finally:
        dbtools.drop_database(pg_admin_url, name)


@pytest.fixture
def make_role(migrated_database_url: str) -> Iterator[Any]:
    """``make_role(kind)``: a new login role for the test's database, dropped at the end."""
    admin = psycopg.connect(migrated_database_url, autocommit=True, row_factory=dict_row)
    made: list[Role] = []

    def make(kind: str = "rt") -> Role:
        made.append(create_role(admin, migrated_database_url, kind))
        return made[-1]

    try:
        yield make
    finally:
        for role in made:
            drop_role(role)
        admin.close()


@pytest.fixture(scope="session")
def pgbouncer(pg_admin_url: str) -> Iterator[bouncers.PgBouncer]:
    """PgBouncer in transaction mode in front of the test server, for the session."""
    if bouncers.binary() is None:
        pytest.skip("pgbouncer is not installed and could not be (apt-get install pgbouncer, "
                    "as root): the tests through a transaction pooler need it")
    with bouncers.running(pg_admin_url) as bouncer:
        yield bouncer
