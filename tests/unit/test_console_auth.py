"""The console's grants, sessions and CSRF tokens, and the standalone command's options, as
pure logic (the HTTP side is in tests/integration/test_console_api.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from starlette.requests import Request

from orchestrator.cli.console import loopback, read_tokens
from orchestrator.console.grants import GRANTS, Access, check_grants, parse_grant_option
from orchestrator.console.web import CSRF_HEADER, NONCE_COOKIE, NONCE_STATE, SESSION_TTL, Guard
from orchestrator.errors import ConfigurationError, Forbidden

TOKEN = "t" * 32


def guard(tokens: dict[str, str] | None = None, secret: bytes = b"s" * 32) -> Guard:
    return Guard(authenticate=None, tokens=tokens if tokens is not None else {TOKEN: "alice"},
                 grants_of=check_grants(None), known=lambda name: None, secret=secret)


def test_grants_default_to_reading_and_every_grant_implies_read() -> None:
    assert check_grants(None)("anyone") == {"read"}
    table = check_grants({"alice": ["resolve"], "bob": ["all"], "carol": []})
    assert table("alice") == {"read", "resolve"}
    assert table("bob") == set(GRANTS)
    assert table("carol") == set() and table("nobody") == set()
    asked = check_grants(lambda name: ["incidents"] if name == "reader" else [])
    assert asked("reader") == {"read", "incidents"} and asked("other") == set()


@pytest.mark.parametrize("grants", [{"alice": ["read", "admin"]}, {"alice": "read"},
                                    {"alice ": ["read"]}, ["alice"]])
def test_a_grant_table_that_could_not_mean_what_it_says_is_refused(grants: Any) -> None:
    with pytest.raises(ConfigurationError):
        check_grants(grants)


def test_a_grant_function_is_checked_when_it_answers() -> None:
    with pytest.raises(ConfigurationError):
        check_grants(lambda name: ["root"])("alice")


def test_the_grant_option() -> None:
    assert parse_grant_option("alice=read, resolve") == ("alice", ["read", "resolve"])
    for bad in ("alice", "=read", "alice="):
        with pytest.raises(ConfigurationError):
            parse_grant_option(bad)


def test_access_names_the_grant_it_lacks() -> None:
    access = Access("viewer", frozenset({"read"}), "host")
    access.need("read")
    with pytest.raises(Forbidden, match="lacks the 'resolve' grant"):
        access.need("read", "resolve")


def test_a_session_is_signed_bound_to_its_token_and_expires(monkeypatch: Any) -> None:
    g = guard()
    cookie = g.new_session(TOKEN)
    assert g._session_operator(cookie) == "alice"
    name, issued, digest, mac = cookie.split(".")
    tampered = mac[:5] + ("B" if mac[5] == "A" else "A") + mac[6:]
    assert g._session_operator(".".join((name, issued, digest, tampered))) is None
    other_name = "Ym9i"  # "bob", with alice's signature
    assert g._session_operator(".".join((other_name, issued, digest, mac))) is None
    assert guard(secret=b"x" * 32)._session_operator(cookie) is None  # another secret
    assert guard(tokens={"u" * 32: "alice"})._session_operator(cookie) is None  # token gone
    later = float(issued) + SESSION_TTL + 1
    monkeypatch.setattr("orchestrator.console.web.time.time", lambda: later)
    assert g._session_operator(cookie) is None
    for junk in ("", "a.b.c", "a.b.c.d", "!!.1.x.y"):
        assert g._session_operator(junk) is None


def test_csrf_tokens_are_per_operator_and_per_binding() -> None:
    g = guard()
    one = g.csrf_token("alice", "nonce:n1")
    assert one == g.csrf_token("alice", "nonce:n1")
    assert len({one, g.csrf_token("bob", "nonce:n1"), g.csrf_token("alice", "nonce:n2")}) == 3


def _post(headers: dict[str, str], cookies: str = "") -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    if cookies:
        raw.append((b"cookie", cookies.encode()))
    return Request({"type": "http", "method": "POST", "path": "/api/operations/1/abandon",
                    "headers": raw, "state": {NONCE_STATE: "n" * 43}})


def test_a_script_without_its_csrf_token_is_told_where_to_get_it() -> None:
    """A bearer client has no page to reload: FORBIDDEN says to take ``csrf_token`` from
    ``GET /api/session`` and send it as ``X-CSRF-Token``; a browser is told to reload."""
    g = guard()
    bearer = {"Authorization": f"Bearer {TOKEN}"}
    script = Access("alice", frozenset({"read", "resolve"}), "bearer")
    for given in (None, "not-the-token"):
        with pytest.raises(Forbidden) as refused:
            g.check_csrf(_post(bearer), script, given)
        assert refused.value.code == "FORBIDDEN"
        message = str(refused.value)
        assert "csrf_token from GET /api/session" in message and CSRF_HEADER in message
        assert "reload the page" not in message
    g.check_csrf(_post(bearer), script, g.token_for(_post(bearer), script))  # accepted

    browser = Access("alice", frozenset({"read", "resolve"}), "session")
    with pytest.raises(Forbidden, match="no CSRF token: reload the page and try again"):
        g.check_csrf(_post({}, cookies=f"{NONCE_COOKIE}={'n' * 43}"), browser, None)


def test_a_token_is_found_in_constant_time_comparisons_only_when_equal() -> None:
    g = guard({TOKEN: "alice", "v" * 32: "viewer"})
    assert g.operator_of_token(TOKEN) == "alice"
    assert g.operator_of_token("v" * 32) == "viewer"
    assert g.operator_of_token(TOKEN[:-1]) is None and g.operator_of_token("") is None


def test_a_console_needs_a_way_to_identify_operators() -> None:
    with pytest.raises(ConfigurationError):
        guard(tokens={})


@pytest.mark.parametrize(("host", "expected"), [
    ("127.0.0.1", True), ("127.9.9.9", True), ("::1", True), ("[::1]", True),
    ("localhost", True), ("0.0.0.0", False), ("10.0.0.5", False), ("::", False),
    ("example.internal", False)])
def test_loopback(host: str, expected: bool) -> None:
    assert loopback(host) is expected


def test_the_token_file(tmp_path: Path) -> None:
    path = tmp_path / "tokens"
    path.write_text("# comment\n\nonlytoken\nbob   bobs-token\n")
    assert read_tokens(path, "operator") == {"operator": "onlytoken", "bob": "bobs-token"}
    for text in ("a b c\n", "x\ny\n", "# nothing\n"):
        path.write_text(text)
        with pytest.raises(ConfigurationError):
            read_tokens(path, "operator")
    with pytest.raises(ConfigurationError):
        read_tokens(tmp_path / "missing", "operator")
