"""Every run creator goes through ``new_run`` (orchestrator/admission.py): a submission, a
child run, a schedule's firing and a restart are held to the same queue and priority rules,
and a run that breaks them is refused with the same error as a submission's, writing
nothing."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator import Orchestrator, RunFailed, WorkflowError
from orchestrator.errors import InvalidRequest
from tests.integration.conftest import running


def _count(sql: Any, table: str) -> int:
    return int(sql(f"SELECT count(*) AS n FROM orchestrator.{table}")[0]["n"])


async def test_a_child_in_a_queue_the_app_does_not_declare_is_refused_as_a_submission(
        make_app: Any, sql: Any) -> None:
    app = make_app()
    other = make_app()  # another application, which declares the queue its workflow uses
    other.queue("elsewhere")

    @other.workflow(queue="elsewhere")
    async def abroad(ctx, n):  # type: ignore[no-untyped-def]
        return n

    @app.workflow(name="abroad")  # registered here too (a workflow only another app registers
    async def abroad_here(ctx, n):  # type: ignore[no-untyped-def]  # is UNKNOWN_WORKFLOW)
        return n

    @app.workflow()
    async def parent(ctx, n):  # type: ignore[no-untyped-def]
        try:
            await ctx.run_child(abroad, n)
        except InvalidRequest as exc:
            return [exc.code, exc.path]
        return "started"

    with pytest.raises(InvalidRequest) as submitted:
        await app.submit_async(abroad, 1)
    async with running(app):
        run = await app.submit_async(parent, 1)
        said = await run.result_async(timeout=20)
    assert said == [submitted.value.code, submitted.value.path] == ["INVALID_REQUEST", "queue"]
    assert _count(sql, "runs") == 1  # the parent alone: no child row
    assert not sql("SELECT 1 FROM orchestrator.journal WHERE kind = 'child.started'")


async def _failed_run(app: Orchestrator) -> Any:
    app.queue("work")

    @app.workflow(queue="work")
    async def breaks(ctx, n):  # type: ignore[no-untyped-def]
        raise WorkflowError("broken")

    async with running(app):  # the worker stores the queue
        run = await app.submit_async(breaks, 1, priority=3)
        with pytest.raises(RunFailed):
            await run.result_async(timeout=20)
    return run


@pytest.mark.parametrize(("broken", "path"), [
    ("DELETE FROM orchestrator.queues WHERE name = 'work'", "queue"),
    ("UPDATE orchestrator.runs SET priority = 5000", "priority"),
])
async def test_a_restart_into_a_queue_not_stored_or_with_a_bad_priority_is_refused(
        make_app: Any, sql: Any, broken: str, path: str) -> None:
    app = make_app()
    run = await _failed_run(app)
    sql(broken)
    with pytest.raises(InvalidRequest) as submitted:
        await app.submit_async("breaks", 2, queue="nowhere" if path == "queue" else None,
                               priority=5000 if path == "priority" else 0)
    with pytest.raises(InvalidRequest) as restarted:
        await run.restart_async(reason="try again", from_position=0)
    assert (restarted.value.code, restarted.value.path) == (
        submitted.value.code, submitted.value.path) == ("INVALID_REQUEST", path)
    assert _count(sql, "runs") == 1  # nothing written: no new run, no audit row
    assert _count(sql, "operator_audit") == 0
    assert sql("SELECT superseded_by FROM orchestrator.runs")[0]["superseded_by"] is None


async def test_a_restart_into_a_stored_queue_keeps_its_place(make_app: Any, sql: Any) -> None:
    app = make_app()
    run = await _failed_run(app)
    new = await run.restart_async(reason="try again", from_position=0)
    (row,) = sql("SELECT queue, priority FROM orchestrator.runs WHERE id = %s", (new.id,))
    assert (row["queue"], row["priority"]) == ("work", 3)
