"""Operator identities, scopes and evidence are checked before anything is looked up (C9, C17):
a configuration no operator could match is refused when the application is built, and text
PostgreSQL cannot store is INVALID_REQUEST, never a driver error."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator import Orchestrator
from orchestrator.errors import AccessDenied, ConfigurationError, InvalidRequest
from orchestrator.operators import Operators
from orchestrator.reconcile import check_evidence
from orchestrator.text import storable


@pytest.mark.parametrize("scopes", [
    {"opA ": ["acme"]},            # a name with a space at the end
    {"op A": ["acme"]},            # whitespace inside
    {"opA\u200b": ["acme"]},       # a zero-width space
    {"": ["acme"]},
    {"opA": "acme"},               # one string, not a list of tenants
    {"opA": ["acme", "bad\x00tenant"]},
    {"opA": [" acme"]},
    {"opA": [""]},
])
def test_unusable_operator_scopes_are_refused_when_the_app_is_built(scopes: Any) -> None:
    with pytest.raises(ConfigurationError) as info:
        Orchestrator("postgresql://localhost/unused", operator_scopes=scopes)
    assert "operator_scopes" in str(info.value)


@pytest.mark.parametrize("readers", [["alice "], ["al\u200bice"], "alice", [""]])
def test_unusable_incident_readers_are_refused_when_the_app_is_built(readers: Any) -> None:
    with pytest.raises(ConfigurationError) as info:
        Orchestrator("postgresql://localhost/unused", incident_readers=readers)
    assert "incident_readers" in str(info.value)


def test_good_scopes_and_readers_are_kept() -> None:
    app = Orchestrator("postgresql://localhost/unused",
                       operator_scopes={"opA": ("acme",), "ops@example.com": []},
                       incident_readers=("opA",))
    assert app.operator_scopes == {"opA": ["acme"], "ops@example.com": []}
    assert app.incident_readers == ["opA"]
    assert app.operators.incident_readers == ["opA"]


LOOK_ALIKES = ["opA ", " opA", "opA\u200b", "op\u202eA", "opA\n", "op A", "opA\x00", "\ud800"]


@pytest.mark.parametrize("name", LOOK_ALIKES)
def test_a_name_that_only_looks_like_an_operator_is_invalid(name: str) -> None:
    ops = Operators(None, {"opA": ["acme"]})  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest) as info:
        ops.tenants_of(name)
    assert info.value.path == "operator"


@pytest.mark.parametrize("name", ["OPA", "opa", "nobody", "operator"])
def test_with_scopes_an_unlisted_operator_may_do_nothing(name: str) -> None:
    ops = Operators(None, {"opA": ["acme"], "opB": ["globex"]})  # type: ignore[arg-type]
    with pytest.raises(AccessDenied) as info:
        ops.tenants_of(name)
    assert "not configured" in str(info.value)
    assert "opB" not in str(info.value) and "opA" not in str(info.value)  # lists nobody
    assert ops.tenants_of("opA") == ["acme"]


def test_without_scopes_a_valid_operator_may_act_on_every_tenant() -> None:
    ops = Operators(None)  # type: ignore[arg-type]
    assert ops.tenants_of("anyone") is None
    with pytest.raises(InvalidRequest):
        ops.tenants_of("any one")


@pytest.mark.parametrize(("evidence", "operator", "path"), [
    ("seen at the PSP\x00", "alice", "evidence"),
    ("seen \ud800 at the PSP", "alice", "evidence"),
    ("   ", "alice", "evidence"),
    ("seen", "ali\x00ce", "operator"),
    ("seen", "alice\udfff", "operator"),
    ("seen", "alice ", "operator"),
    ("seen", "", "operator"),
])
def test_evidence_and_operator_that_cannot_be_stored_are_invalid(
        evidence: str, operator: str, path: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        check_evidence(evidence, operator)
    assert info.value.path == path


def test_evidence_may_span_lines() -> None:
    check_evidence("PSP shows ch_1\n\tsettled at 10:02", "alice")


@pytest.mark.parametrize("evidence", ["\u200b", " \u200b\u200d\n", "\ufeff", "\u2060\t"])
def test_evidence_that_shows_nothing_is_blank(evidence: str) -> None:
    """Evidence of nothing but whitespace and invisible format characters (zero-width
    spaces and joiners, a BOM: what a paste can leave) reads as blank in every log and page:
    it is refused as blank text is."""
    with pytest.raises(InvalidRequest, match="evidence text is required") as info:
        check_evidence(evidence, "alice")
    assert info.value.path == "evidence"


def test_evidence_may_hold_format_characters_beside_text() -> None:
    check_evidence("PSP shows \u200fch_1\u200f (\U0001F468\u200d\U0001F4BB checked)", "alice")


def test_tool_text_is_kept_storable() -> None:
    assert storable("a\x00b\ud800c") == "a\\x00b\\ud800c"
    assert storable("plain é text\n") == "plain é text\n"
    assert "\x00" not in storable("\x00") and storable("\ud800").encode()
