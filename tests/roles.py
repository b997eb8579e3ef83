"""Throw-away database roles for the least-privilege tests.

Roles belong to the whole cluster, not to a test's database: each test creates its own, with a
unique name and a random password (so the URL works under trust and password authentication
alike), and drops it at the end, after taking back in the test's database whatever it owned or
was granted there.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlsplit, urlunsplit

import psycopg
from psycopg import sql

from tests import dbtools


@dataclass
class Role:
    """A login role on the test server, and an admin connection to the test's database."""

    name: str
    url: str  # the test's database, connecting as this role
    admin: psycopg.Connection[dict[str, Any]]

    def sql(self, query: str | sql.Composable, params: Any = None) -> list[dict[str, Any]]:
        """Run ``query`` as the admin; ``{role}`` in a string query is this role, quoted."""
        if isinstance(query, str):
            query = sql.SQL(query).format(role=sql.Identifier(self.name))  # type: ignore[arg-type]
        cur = self.admin.execute(query, params)
        return cur.fetchall() if cur.description else []


def url_as(url: str, user: str, password: str) -> str:
    """``url`` connecting as ``user`` with ``password`` (host, port, database and query kept)."""
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    if parts.port:
        netloc += f":{parts.port}"
    return urlunsplit(parts._replace(netloc=netloc))


def create_role(admin: psycopg.Connection[dict[str, Any]], url: str, kind: str) -> Role:
    name = dbtools.unique_name(kind)
    password = secrets.token_hex(12)
    admin.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
        sql.Identifier(name), sql.Literal(password)))
    return Role(name, url_as(url, name, password), admin)


def drop_role(role: Role) -> None:
    """End the role's sessions, take back what it owns or holds here, and drop it."""
    who = sql.Identifier(role.name)
    role.admin.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                       "WHERE usename = %s", (role.name,))
    role.admin.execute(sql.SQL("REASSIGN OWNED BY {} TO CURRENT_USER").format(who))
    role.admin.execute(sql.SQL("DROP OWNED BY {}").format(who))
    role.admin.execute(sql.SQL("DROP ROLE {}").format(who))
