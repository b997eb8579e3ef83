"""A multi-host URL whose first host is down reaches the second, on every path the package
connects by: migrations (SQLAlchemy), the schema check, the pooled connections and a run
submitted and read back. Needs only the ordinary test server."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from urllib.parse import urlsplit, urlunsplit

import pytest

from orchestrator import Orchestrator, Owner
from orchestrator.db import migrate
from orchestrator.db.config import DatabaseTarget, validate_url
from tests import dbtools


def _closed_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])  # closed again once the block ends


@pytest.fixture
def multi_host_url(pg_admin_url: str) -> Iterator[str]:
    name = dbtools.unique_name("multihost")
    url = dbtools.create_database(pg_admin_url, name)
    parts = urlsplit(url)
    if not parts.hostname or parts.hostname.startswith("/") or parts.port is None:
        dbtools.drop_database(pg_admin_url, name)
        pytest.skip("the test server is not reached over TCP")
    userinfo = parts.netloc.rpartition("@")[0]
    netloc = (f"{userinfo}@" if userinfo else "") + (
        f"127.0.0.1:{_closed_port()},{parts.hostname}:{parts.port}")
    query = "&".join(q for q in (parts.query, "target_session_attrs=read-write") if q)
    try:
        yield urlunsplit(parts._replace(netloc=netloc, query=query))
    finally:
        dbtools.drop_database(pg_admin_url, name)


def test_every_connection_path_takes_the_host_that_answers(multi_host_url: str) -> None:
    target = DatabaseTarget(validate_url(multi_host_url), "argument")

    assert migrate.upgrade(target).ok
    assert migrate.check(target).ok

    app = Orchestrator(multi_host_url, default_owner=Owner(tenant="t", principal="p"))

    @app.workflow()
    async def noop(ctx: object, data: int) -> int:
        return data

    handle = app.submit(noop, 7)
    assert handle.status() == "queued"
    assert app.get_run(handle.id).id == handle.id
