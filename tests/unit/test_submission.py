"""The submission service's pure parts, without a database: the journal's schema check, the
owner a call acts for, the workflow a submission names."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from orchestrator.errors import InvalidRequest, SchemaUnsupported, UnknownWorkflow
from orchestrator.journal import SCHEMA_VERSION
from orchestrator.models import Owner
from orchestrator.registry import Registry, Workflow, resolve_workflow
from orchestrator.submission import check_journal, resolve_owner

OWNER = Owner(tenant="acme", principal="alice")


def _event(seq: int, schema_version: int = SCHEMA_VERSION) -> dict[str, Any]:
    return {"seq": seq, "kind": "run.started", "created_at": datetime(2026, 1, 1, tzinfo=UTC),
            "position": None, "name": None, "payload": {}, "schema_version": schema_version,
            "lease_token": 1}


def test_a_journal_this_code_understands_is_read_oldest_first() -> None:
    entries = check_journal([_event(1), _event(2)])
    assert [e.seq for e in entries] == [1, 2]


def test_an_entry_from_newer_code_is_refused_naming_it() -> None:
    with pytest.raises(SchemaUnsupported, match="journal event 2 has schema version") as info:
        check_journal([_event(1), _event(2, SCHEMA_VERSION + 1)])
    assert info.value.code == "SCHEMA_UNSUPPORTED"


def test_the_owner_is_the_one_given_else_the_default() -> None:
    other = Owner(tenant="acme", principal="bob")
    assert resolve_owner(other, OWNER) is other
    assert resolve_owner(None, OWNER) is OWNER
    with pytest.raises(InvalidRequest) as missing:
        resolve_owner(None, None)
    assert missing.value.path == "owner"
    with pytest.raises(InvalidRequest, match="orchestrator.Owner"):
        resolve_owner("alice", OWNER)  # type: ignore[arg-type]


def test_a_workflow_by_name_is_the_registered_one() -> None:
    async def fn(ctx: Any, data: Any) -> Any:
        return data

    registry = Registry()
    wf: Workflow[Any, Any] = Workflow(name="wf", version="1", fn=fn)
    registry.add_workflow(wf)
    assert resolve_workflow(registry, "wf") is wf
    assert resolve_workflow(registry, wf) is wf
    with pytest.raises(UnknownWorkflow, match="workflow 'wf' version '2'"):
        resolve_workflow(registry, "wf", "2")


def test_a_workflow_named_wrongly_is_refused_saying_what_was_wrong() -> None:
    """A blank or non-text ``version`` is bad input naming ``version`` (it was reported as
    ``workflow 'wf' is not registered``, which it is); the function under the decorator,
    rather than what ``@app.workflow()`` returned, is refused saying to pass that or the
    name (it was ``workflow <function wf at 0x…> is not registered``); an owner that is not
    an ``Owner`` names ``owner``."""
    async def fn(ctx: Any, data: Any) -> Any:
        return data

    registry = Registry()
    wf: Workflow[Any, Any] = Workflow(name="wf", version="1", fn=fn)
    registry.add_workflow(wf)
    for version in ("", " 1", 1):
        for given in ("wf", wf):
            with pytest.raises(InvalidRequest) as bad:
                resolve_workflow(registry, given, version)  # type: ignore[arg-type]
            assert bad.value.code == "INVALID_REQUEST" and bad.value.path == "version"
            assert "not registered" not in bad.value.message
    for thing in (fn, 5, None):
        with pytest.raises(UnknownWorkflow, match="a workflow is what @app.workflow") as raw:
            resolve_workflow(registry, thing)  # type: ignore[arg-type]
        assert raw.value.code == "UNKNOWN_WORKFLOW" and raw.value.path == "workflow"
    with pytest.raises(UnknownWorkflow, match="got function fn: pass the object "
                       r"@app.workflow\(\) returned"):
        resolve_workflow(registry, fn)  # type: ignore[arg-type]
    with pytest.raises(InvalidRequest) as owner:
        resolve_owner("alice", OWNER)  # type: ignore[arg-type]
    assert owner.value.path == "owner"


async def _echo(ctx: Any, data: Any) -> Any:
    return data


def test_a_workflow_given_as_an_object_is_not_started_at_another_version() -> None:
    """``submit(report_v1, input, version="2")`` names two versions at once: starting the
    object's would quietly ignore the one asked for, so a version that is not the object's
    own is refused."""
    registry = Registry()
    v1: Workflow[Any, Any] = Workflow(name="report", version="1", fn=_echo)
    v2: Workflow[Any, Any] = Workflow(name="report", version="2", fn=_echo)
    registry.add_workflow(v1)
    registry.add_workflow(v2)
    assert resolve_workflow(registry, v1, "1") is v1
    for other in ("2", "3"):
        with pytest.raises(InvalidRequest, match="version 1") as refused:
            resolve_workflow(registry, v1, other)
        assert refused.value.code == "INVALID_REQUEST" and refused.value.path == "version"


def test_versions_that_order_the_same_are_not_registered_side_by_side() -> None:
    """"1.0" and "1.00" (or "7" and "07") are the same place in the natural order: with both
    registered, the version a submission by name starts would depend on which was registered
    first. The second is refused, naming the first."""
    for first, second in (("1.0", "1.00"), ("7", "07"), ("v2", "v002")):
        registry = Registry()
        registry.add_workflow(Workflow(name="report", version=first, fn=_echo))
        with pytest.raises(InvalidRequest, match=f"{second}.*{first}") as refused:
            registry.add_workflow(Workflow(name="report", version=second, fn=_echo))
        assert refused.value.code == "INVALID_REQUEST" and refused.value.path == "version"
        registry.add_workflow(Workflow(name="other", version=second, fn=_echo))  # another name
        assert registry.choose("report") is registry.workflow("report", first)
