"""The console, its operators' API and the submitters' HTTP API while the database cannot be
used: 503 ``DATABASE_UNAVAILABLE`` says that the database is unavailable and whether to try
again, and 500 ``CONFIGURATION_ERROR`` (a database role without its privileges) that the server
is misconfigured, not where the database lives (its host, port, user, name or URL); the
console's log keeps that detail for operators, under the answer's incident reference."""

from __future__ import annotations

import logging
import uuid
from urllib.parse import urlsplit

import httpx
import pytest

from orchestrator import Orchestrator, Owner
from tests import dbtools
from tests.consoletools import GRANTS, OPERATOR_HEADER, from_header

OWNER = Owner(tenant="acme", principal="alice")


def _down_url(case: str, admin_url: str) -> str:
    """A database that cannot be used: nothing listens on the port, or the (real) server
    has no such database."""
    if case == "port":
        return "postgresql://hidden_role@127.0.0.1:1/hidden_db"
    return dbtools.url_for_database(admin_url, f"hidden_db_{uuid.uuid4().hex[:8]}")


@pytest.mark.parametrize(("case", "retryable"), [("port", True), ("database", False)])
async def test_a_503_does_not_say_where_the_database_lives(
        case: str, retryable: bool, pg_admin_url: str,
        caplog: pytest.LogCaptureFixture) -> None:
    url = _down_url(case, pg_admin_url)
    parts = urlsplit(url)
    where = [w for w in (parts.hostname, f":{parts.port}" if parts.port else None,
                         parts.username, parts.path.lstrip("/"), "postgresql://") if w]
    app = Orchestrator(url, default_owner=OWNER, operator_scopes={"alice": ["acme"]})
    console = app.console(from_header, GRANTS, authenticate_owner=lambda request: OWNER)
    caplog.set_level(logging.INFO)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=console),
                                     base_url="http://console.test",
                                     headers={OPERATOR_HEADER: "alice"}) as http:
            answers = {path: await http.get(path) for path in
                       (f"/api/runs/{uuid.uuid4()}",  # the submitters' API
                        "/api/runs",  # the operators' API
                        "/runs")}  # a console page
    finally:
        await app.database.close()
    for path, answer in answers.items():
        assert answer.status_code == 503, (path, answer.text)
        for told in where:
            assert told not in answer.text, (path, told, answer.text)
    body = answers["/api/runs"].json()
    assert body["code"] == "DATABASE_UNAVAILABLE" and body["retryable"] is retryable
    assert body["message"].startswith("the database is unavailable"), body["message"]
    # the log keeps the detail, under the incident reference the client was shown
    logged = [r.getMessage() for r in caplog.records
              if r.name == "orchestrator.console" and body["incident"] in r.getMessage()]
    assert logged and parts.hostname in logged[0], caplog.text


async def test_a_500_for_a_role_without_privileges_does_not_say_where_the_database_lives(
        make_role, caplog: pytest.LogCaptureFixture) -> None:  # type: ignore[no-untyped-def]
    """The runtime role lacks its grants (``orchestrator db grant`` was not run): the
    database refuses the statement, which is the deployment's error (``CONFIGURATION_ERROR``,
    500), and its message named the database (``the database at postgresql://role@host:port/db
    refused a statement …``) to any HTTP client."""
    role = make_role("nogrant")
    parts = urlsplit(role.url)
    where = [parts.hostname, f":{parts.port}", role.name, parts.path.lstrip("/"),
             "postgresql://"]
    app = Orchestrator(role.url, default_owner=OWNER, operator_scopes={"alice": ["acme"]})
    console = app.console(from_header, GRANTS, authenticate_owner=lambda request: OWNER)
    caplog.set_level(logging.INFO)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=console),
                                     base_url="http://console.test",
                                     headers={OPERATOR_HEADER: "alice"}) as http:
            answers = {path: await http.get(path) for path in
                       (f"/api/runs/{uuid.uuid4()}", "/api/runs", "/runs")}
    finally:
        await app.database.close()
    for path, answer in answers.items():
        assert answer.status_code == 500, (path, answer.text)
        for told in where:
            assert told not in answer.text, (path, told, answer.text)
    body = answers["/api/runs"].json()
    assert body["code"] == "CONFIGURATION_ERROR", body
    logged = [r.getMessage() for r in caplog.records
              if r.name == "orchestrator.console" and body["incident"] in r.getMessage()]
    assert logged and "permission denied" in logged[0], caplog.text
