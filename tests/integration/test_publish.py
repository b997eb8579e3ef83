"""``ctx.publish`` (CONTRACT C14, C4): a workflow's own message in its run's stream, journaled
with the run's next write, found and checked on replay, never published twice, and held to the
caps of every record."""

from __future__ import annotations

import pytest

from orchestrator import OrchestratorError, RunFailed
from tests.integration.conftest import running, wait_for


def _status(sql, run):  # type: ignore[no-untyped-def]
    return sql("SELECT status FROM orchestrator.runs WHERE id = %s", (run.id,))[0]["status"]


async def test_a_published_message_is_journaled_once_and_not_published_again_on_replay(
        app, sql):
    live: list[bool] = []

    @app.workflow()
    async def reports(ctx, data):  # type: ignore[no-untyped-def]
        progress = {"done": 0}
        ctx.publish(progress)
        progress["done"] = 1  # changed after publishing: what was published stays
        live.append(ctx.log.replaying)
        await ctx.wait_for_event("go")  # parks: the run is replayed when the event comes
        ctx.publish(progress, topic="steps")
        return progress

    async with running(app):
        run = await app.submit_async(reports, {})
        await wait_for(lambda: _status(sql, run) == "waiting")
        await app.send_event_async(run.id, "go")
        assert await run.result_async(timeout=15) == {"done": 1}
        messages = [(e.position, e.name, e.payload) for e in await run.journal_async()
                    if e.kind == "message"]
    assert live == [False, True]  # the first publish ran again, replayed
    assert messages == [(0, "progress", {"value": {"done": 0}}),
                        (2, "steps", {"value": {"done": 1}})]


@pytest.mark.parametrize("change", ["value", "topic", "kind"])
async def test_another_message_at_a_recorded_position_is_nondeterminism(app, sql, change):
    drift = {"on": False}

    @app.workflow()
    async def drifting(ctx, data):  # type: ignore[no-untyped-def]
        if not drift["on"]:
            ctx.publish({"n": 1, "f": 1.0})
        elif change == "value":
            ctx.publish({"n": 1, "f": 1})  # an int where a float was: another value
        elif change == "topic":
            ctx.publish({"n": 1, "f": 1.0}, topic="other")
        else:
            ctx.now()
        drift["on"] = True
        await ctx.wait_for_event("go")
        return "done"

    async with running(app):
        run = await app.submit_async(drifting, {})
        await wait_for(lambda: _status(sql, run) == "waiting")
        await app.send_event_async(run.id, "go")
        with pytest.raises(RunFailed) as stopped:
            await run.result_async(timeout=15)
        kinds = [e.kind for e in await run.journal_async()]
    assert stopped.value.code == "NONDETERMINISM"
    assert kinds.count("message") == 1


async def test_the_same_value_with_its_keys_in_another_order_replays(app, sql):
    order = {"first": True}

    @app.workflow()
    async def reordered(ctx, data):  # type: ignore[no-untyped-def]
        value = {"a": 1, "b": [1.5, None]} if order["first"] else {"b": [1.5, None], "a": 1}
        order["first"] = False
        ctx.publish(value)
        await ctx.wait_for_event("go")
        return "done"

    async with running(app):
        run = await app.submit_async(reordered, {})
        await wait_for(lambda: _status(sql, run) == "waiting")
        await app.send_event_async(run.id, "go")
        assert await run.result_async(timeout=15) == "done"


async def test_a_message_is_held_to_the_record_cap_and_must_be_json(make_app, sql):
    app = make_app(max_record_bytes=1000)

    @app.workflow()
    async def oversized(ctx, data):  # type: ignore[no-untyped-def]
        refused = []
        for value, topic in (("x" * 2000, "progress"), ({1, 2}, "progress"),
                             (float("nan"), "progress"), ("fits", ""), ("fits", "a\nb"),
                             ("fits", 7)):
            try:
                ctx.publish(value, topic=topic)
            except OrchestratorError as exc:
                refused.append([exc.code, getattr(exc, "path", None)])
        ctx.publish("x" * 900)  # within the cap
        return refused

    async with running(app):
        run = await app.submit_async(oversized, {})
        refused = await run.result_async(timeout=15)
        messages = [e for e in await run.journal_async() if e.kind == "message"]
    assert refused == [["PAYLOAD_TOO_LARGE", "$.value"], ["INVALID_REQUEST", "$.value"],
                       ["INVALID_REQUEST", "$.value"], ["INVALID_REQUEST", "topic"],
                       ["INVALID_REQUEST", "topic"], ["INVALID_REQUEST", "topic"]]
    assert [e.payload["value"] for e in messages] == ["x" * 900]  # nothing of the refused


async def test_an_uncaught_refusal_fails_the_run(make_app):
    app = make_app(max_record_bytes=1000)

    @app.workflow()
    async def careless(ctx, data):  # type: ignore[no-untyped-def]
        ctx.publish("x" * 2000)

    async with running(app):
        run = await app.submit_async(careless, {})
        with pytest.raises(RunFailed) as failed:
            await run.result_async(timeout=15)
    assert failed.value.code == "WORKFLOW_FAILED"
    assert failed.value.cause is not None and failed.value.cause["code"] == "PAYLOAD_TOO_LARGE"
