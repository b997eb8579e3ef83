"""Submission: idempotency keys, request digests, owners and validation (CONTRACT C1, C2)."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest

from orchestrator import IdempotencyConflict, InvalidRequest, Orchestrator, Owner
from orchestrator.errors import PayloadTooLarge, UnknownWorkflow
from tests.integration.conftest import OTHER, OWNER


def _app(make_app):  # type: ignore[no-untyped-def]
    app = make_app()

    @app.workflow(version="1")
    async def greet(ctx, data):  # type: ignore[no-untyped-def]
        return data

    @app.workflow(version="2", name="greet")
    async def greet_v2(ctx, data):  # type: ignore[no-untyped-def]
        return data

    return app, greet, greet_v2


def _count(sql) -> int:  # type: ignore[no-untyped-def]
    return int(sql("SELECT count(*) AS n FROM orchestrator.runs")[0]["n"])


@pytest.mark.parametrize("key", ["", "-abc", ".a", "a b", "ключ", "a" * 129, "a/b", "a\n"])
def test_bad_idempotency_keys_are_rejected_before_anything_is_written(make_app, sql, key):
    app, greet, _ = _app(make_app)
    with pytest.raises(InvalidRequest) as info:
        app.submit(greet, {"x": 1}, idempotency_key=key)
    assert info.value.code == "INVALID_REQUEST"
    assert _count(sql) == 0


@pytest.mark.parametrize("key", ["a", "A1", "9.x_y:z-w", "a" * 128])
def test_good_idempotency_keys_are_accepted(make_app, key):
    app, greet, _ = _app(make_app)
    assert app.submit(greet, {"x": 1}, idempotency_key=key).id


def test_same_owner_key_and_request_returns_the_same_run(make_app, sql):
    app, greet, _ = _app(make_app)
    first = app.submit(greet, {"a": 1, "b": [1, 2]}, idempotency_key="k-1")
    again = app.submit(greet, {"b": [1, 2], "a": 1}, idempotency_key="k-1")  # key order ignored
    assert again.id == first.id
    assert _count(sql) == 1


@pytest.mark.parametrize(
    "change",
    [
        {"input": {"a": 2, "b": [1, 2]}},
        {"input": {"a": 1, "b": [2, 1]}},  # array order matters
        {"input": {"a": 1, "b": [1, 2], "c": None}},
        {"deadline": timedelta(minutes=5)},
        {"version": "2"},
    ],
)
def test_same_key_with_a_different_request_is_a_conflict(make_app, sql, change):
    app, greet, greet_v2 = _app(make_app)
    app.submit(greet, {"a": 1, "b": [1, 2]}, idempotency_key="k-1")
    workflow = greet_v2 if change.get("version") == "2" else greet
    with pytest.raises(IdempotencyConflict) as info:
        app.submit(workflow, change.get("input", {"a": 1, "b": [1, 2]}),
                   idempotency_key="k-1", deadline=change.get("deadline"))
    assert info.value.code == "IDEMPOTENCY_CONFLICT"
    assert _count(sql) == 1


@pytest.mark.parametrize(
    ("change", "said"),
    [
        ({"input": {"a": 2}, "deadline": timedelta(hours=1)},
         ": another input with the same options"),
        ({"deadline": timedelta(minutes=5)}, ": the same input with other options (deadline)"),
        ({"input": {"a": 2}, "delay": timedelta(minutes=5), "deadline": timedelta(hours=2)},
         ": another input, and other options (deadline, delay)"),
    ],
)
def test_a_conflict_says_whether_the_input_or_the_options_differ(make_app, sql, change, said):
    """The same key with the same input but without the ``deadline=`` the first submission
    gave is another request (CONTRACT C1): the conflict says what differs, by name (never a
    value: the input is the owner's), and what to do."""
    app, greet, _ = _app(make_app)
    app.submit(greet, {"a": 1}, idempotency_key="k-1", deadline=timedelta(hours=1))
    with pytest.raises(IdempotencyConflict) as info:
        app.submit(greet, change.get("input", {"a": 1}), idempotency_key="k-1",
                   deadline=change.get("deadline"), delay=change.get("delay"))
    assert info.value.message == (
        "this idempotency key was already used by this owner for a different request"
        + said + " (a request is its workflow, version, input and options: to get that "
        "run again, submit it as it was; for a new run, use a new key)")
    assert "{" not in info.value.message and _count(sql) == 1


def test_keys_are_scoped_by_owner(make_app, sql):
    app, greet, _ = _app(make_app)
    mine = app.submit(greet, {"a": 1}, idempotency_key="shared", owner=OWNER)
    theirs = app.submit(greet, {"a": 1}, idempotency_key="shared", owner=OTHER)
    assert mine.id != theirs.id
    same_tenant_other_principal = app.submit(
        greet, {"a": 1}, idempotency_key="shared", owner=Owner(tenant="acme", principal="carol"))
    assert same_tenant_other_principal.id not in (mine.id, theirs.id)


def test_unkeyed_submissions_always_create_a_run(make_app, sql):
    app, greet, _ = _app(make_app)
    ids = {app.submit(greet, {"a": 1}).id for _ in range(3)}
    assert len(ids) == 3


async def test_concurrent_submissions_of_one_key_create_exactly_one_run(make_app, sql):
    app, greet, _ = _app(make_app)
    app.pool_size = 20
    handles = await asyncio.gather(
        *(app.submit_async(greet, {"n": 1}, idempotency_key="race") for _ in range(20)))
    assert len({h.id for h in handles}) == 1
    assert _count(sql) == 1
    await app.database.close()


def test_owner_is_required_without_a_default(make_app):
    app = make_app(default_owner=None)

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return data

    with pytest.raises(InvalidRequest):
        app.submit(wf, {})
    assert app.submit(wf, {}, owner=OWNER).owner == OWNER


@pytest.mark.parametrize(
    ("value", "path"),
    [
        ({"a": float("nan")}, "$.input.a"),
        ({"a": [1, {"b": b"x"}]}, "$.input.a[1].b"),
        ({"a": {1, 2}}, "$.input.a"),
        ({1: "x"}, "$.input"),
        ({"a": (1, 2)}, "$.input.a"),
    ],
)
def test_non_json_input_is_rejected_with_its_path(make_app, sql, value, path):
    app, greet, _ = _app(make_app)
    with pytest.raises(InvalidRequest) as info:
        app.submit(greet, value)
    assert info.value.code == "INVALID_REQUEST"
    assert info.value.path == path
    assert _count(sql) == 0


def test_oversized_input_is_rejected(make_app, sql):
    app = make_app(max_record_bytes=1000)

    @app.workflow()
    async def wf(ctx, data):  # type: ignore[no-untyped-def]
        return data

    with pytest.raises(PayloadTooLarge) as info:
        app.submit(wf, {"blob": "x" * 2000})
    assert info.value.code == "PAYLOAD_TOO_LARGE"
    assert _count(sql) == 0


def test_unknown_workflow_name_is_rejected(make_app):
    app: Orchestrator = make_app()
    with pytest.raises(UnknownWorkflow):
        app.submit("nope", {})


def test_a_workflow_another_app_registers_is_rejected(make_app, sql):
    """A workflow object registered on another ``Orchestrator`` (another module's app, a test's
    second app) is not one this application's workers run: ``UNKNOWN_WORKFLOW`` at submit,
    not a run queued for ever."""
    app, greet, _ = _app(make_app)
    other = make_app()

    @other.workflow(version="1")
    async def kid(ctx, data):  # type: ignore[no-untyped-def]
        return data

    @other.workflow(version="3", name="greet")
    async def greet_v3(ctx, data):  # type: ignore[no-untyped-def]
        return data

    for foreign in (kid, greet_v3):
        with pytest.raises(UnknownWorkflow, match=f"workflow '{foreign.name}' version "
                           f"'{foreign.version}' is not registered") as refused:
            app.submit(foreign, {})
        assert refused.value.code == "UNKNOWN_WORKFLOW"
    assert _count(sql) == 0
    assert app.submit(greet, {}).info().version == "1"


async def test_a_child_of_a_workflow_another_app_registers_is_refused_in_the_parent(make_app,
                                                                                     sql):
    """``ctx.run_child`` with a workflow object this application does not register raises
    ``UNKNOWN_WORKFLOW`` in the parent, which may catch it, instead of starting a child that
    no worker of the application runs and leaving the parent waiting for it for ever."""
    from tests.integration.conftest import running

    app, other = make_app(), make_app()

    @other.workflow()
    async def kid(ctx, data):  # type: ignore[no-untyped-def]
        return data

    @app.workflow()
    async def parent(ctx, data):  # type: ignore[no-untyped-def]
        try:
            return await ctx.run_child(kid, 3)
        except UnknownWorkflow as exc:
            return exc.code

    async with running(app):
        run = await app.submit_async(parent, {})
        assert await run.result_async(timeout=30) == "UNKNOWN_WORKFLOW"
    assert [r["workflow_name"] for r in sql("SELECT workflow_name FROM orchestrator.runs")] == [
        "parent"]


def test_submit_by_name_takes_the_highest_version_in_natural_order(make_app):
    from orchestrator.registry import version_order

    app = make_app()
    for version in ("9", "10", "1.10"):
        @app.workflow(name="report", version=version)
        async def report(ctx: Any, data: Any) -> Any:
            return data

    run = app.submit("report", {})
    assert run.info().version == "10"
    assert sorted(["1.10", "1.9", "10", "9", "2a", "2"], key=version_order) == [
        "1.9", "1.10", "2", "2a", "9", "10"]


@pytest.mark.parametrize("deadline", [timedelta(days=999_999_999), timedelta(days=400_000 * 365)])
def test_a_deadline_the_database_cannot_store_is_refused_before_anything_is_written(
        make_app, sql, deadline):
    app, greet, _ = _app(make_app)
    with pytest.raises(InvalidRequest) as info:
        app.submit(greet, {"x": 1}, deadline=deadline)
    assert info.value.code == "INVALID_REQUEST" and info.value.path == "deadline"
    assert _count(sql) == 0


def test_a_keyed_retry_that_names_no_version_after_a_deploy_is_a_conflict_that_says_why(
        make_app, sql):  # type: ignore[no-untyped-def]
    """The version is part of a request (CONTRACT C1): a keyed submit that names no version,
    sent again after a deploy made another version the default, is another request. Its
    conflict names both versions and what to do; naming the first version asks for that run."""

    def deployed(*versions: str) -> Orchestrator:
        app = make_app()
        for version in versions:
            @app.workflow(name="greet", version=version)
            async def greet(ctx, data):  # type: ignore[no-untyped-def]
                return data
        return app

    first = deployed("1").submit("greet", {"a": 1}, idempotency_key="k-1")
    after = deployed("1", "2")  # 2 the default now
    with pytest.raises(IdempotencyConflict) as conflict:
        after.submit("greet", {"a": 1}, idempotency_key="k-1")
    assert "greet@1" in conflict.value.message and "greet@2" in conflict.value.message
    assert "name its version, '1'" in conflict.value.message
    assert after.submit("greet", {"a": 1}, version="1", idempotency_key="k-1").id == first.id
    with pytest.raises(IdempotencyConflict) as other_input:  # same version: nothing to add
        after.submit("greet", {"a": 2}, version="1", idempotency_key="k-1")
    assert "@" not in other_input.value.message
    assert _count(sql) == 1
