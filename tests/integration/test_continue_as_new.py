"""``ctx.continue_as_new`` (docs/versioning.md, "Long runs"): a loop that goes on for ever in
generations of fresh runs stays under the journal cap and loses nothing; the submission key,
the handle's result, a parent, events and a cancellation follow the chain; a continuation
waits for an unknown outcome to be reconciled."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from typing import Any

import httpx
import pytest

from orchestrator import Orchestrator, RunFailed
from orchestrator.errors import InvalidRequest
from orchestrator.testing import replay
from tests.clitools import run_cli
from tests.consoletools import GRANTS, Client, Served, from_header
from tests.integration.conftest import OWNER, running, wait_for

GENERATIONS = 100
STEPS = 50
CAP = 3 * STEPS  # room for one generation's journal (two entries a step), far from 100 of them


def looping(app: Orchestrator, sink: Counter[tuple[int, int]]) -> Orchestrator:
    @app.tool()
    async def tick(ctx, *, generation, step):  # type: ignore[no-untyped-def]
        sink[(generation, step)] += 1  # the counting sink: every real call
        return step

    @app.workflow()
    async def loop(ctx, state):  # type: ignore[no-untyped-def]
        total = state["total"]
        for step in range(STEPS):
            total += await ctx.call(tick, generation=state["generation"], step=step)
        if state["generation"] + 1 < GENERATIONS:
            ctx.continue_as_new({"generation": state["generation"] + 1, "total": total})
        return {"generations": state["generation"] + 1, "total": total}

    @app.workflow()
    async def unbounded(ctx, state):  # type: ignore[no-untyped-def]
        for step in range(2 * STEPS):  # the same loop without continuing: two generations
            await ctx.call(tick, generation=-1, step=step)
        return "unreachable"

    return app


async def test_100_generations_of_a_50_step_loop_stay_under_the_journal_cap(
        make_app: Any, sql: Any) -> None:
    sink: Counter[tuple[int, int]] = Counter()
    app = looping(make_app(max_journal_events=CAP), sink)
    first_input = {"generation": 0, "total": 0}
    async with running(app, concurrency=4):
        handle = await app.submit_async("loop", first_input, idempotency_key="poller-1")
        result = await handle.result_async(timeout=240)  # the first handle follows the chain
        # Without continuing, the cap stops the loop within two generations' steps.
        alone = await app.submit_async("unbounded", {})
        with pytest.raises(RunFailed, match="JOURNAL_FULL"):
            await alone.result_async(timeout=60)
        # The submission key answers with the newest run, the same request is no conflict.
        again = await app.submit_async("loop", first_input, idempotency_key="poller-1")
    per_step = STEPS * (STEPS - 1) // 2
    assert result == {"generations": GENERATIONS, "total": GENERATIONS * per_step}
    # Nothing lost, nothing repeated: every step of every generation called exactly once.
    looped = {key: n for key, n in sink.items() if key[0] >= 0}
    assert len(looped) == GENERATIONS * STEPS and set(looped.values()) == {1}

    runs = sql("SELECT id, status, outcome_code, continued_from, superseded_by, "
               "idempotency_key, request_digest, "
               "(SELECT count(*) FROM orchestrator.journal j WHERE j.run_id = r.id) AS entries "
               "FROM orchestrator.runs r WHERE workflow_name = 'loop' ORDER BY created_at")
    assert len(runs) == GENERATIONS
    assert all(r["entries"] <= CAP for r in runs)
    assert {r["request_digest"] for r in runs} == {runs[0]["request_digest"]}
    chain = [runs[0]]
    by_id = {r["id"]: r for r in runs}
    while chain[-1]["superseded_by"] is not None:
        chain.append(by_id[chain[-1]["superseded_by"]])
    assert [r["id"] for r in chain] == [r["id"] for r in runs]  # one chain, in order
    assert all(later["continued_from"] == earlier["id"]
               for earlier, later in zip(chain, chain[1:], strict=False))
    assert all((r["status"], r["outcome_code"]) == ("succeeded", "CONTINUED_AS_NEW")
               for r in chain[:-1])
    assert (chain[-1]["status"], chain[-1]["outcome_code"]) == ("succeeded", None)
    assert [r["idempotency_key"] for r in runs] == [None] * (GENERATIONS - 1) + ["poller-1"]
    assert again.id == chain[-1]["id"]
    ends = sql("SELECT run_id, kind, payload FROM orchestrator.journal "
               "WHERE kind = 'run.continued'")
    assert len(ends) == GENERATIONS - 1
    assert all(by_id[e["run_id"]]["superseded_by"] == uuid.UUID(e["payload"]["run_id"])
               for e in ends)
    assert app.metrics.snapshot()["runs_continued"] == GENERATIONS - 1


async def test_a_continuation_waits_for_an_unknown_outcome_then_goes_on(
        make_app: Any, sql: Any) -> None:
    app = make_app()
    calls: Counter[str] = Counter()

    @app.tool(max_attempts=1)
    async def charge(ctx, *, order):  # type: ignore[no-untyped-def]
        calls[order] += 1
        raise ConnectionResetError("lost after sending")  # the outcome is unknown

    @app.workflow()
    async def billing(ctx, state):  # type: ignore[no-untyped-def]
        if state["round"] == 0:
            # A call in flight in another branch when the code continues.
            asyncio.ensure_future(ctx.call(charge, order="o-1"))
            await asyncio.sleep(0)
            ctx.continue_as_new({"round": 1})
        return "round 1"

    async with running(app):
        first = await app.submit_async("billing", {"round": 0})
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs WHERE id = %s",
                                   (first.id,))[0]["status"] == "needs_reconciliation",
                       timeout=30)
        # Not continued while the charge's outcome is unknown: no second run.
        assert sql("SELECT count(*) AS n FROM orchestrator.runs")[0]["n"] == 1
        (op,) = sql("SELECT id FROM orchestrator.operations WHERE state = 'unknown'")
        await app.operators.resolve_committed(op["id"], receipt={"charged": "o-1"},
                                              evidence="the provider's dashboard shows it",
                                              operator="ops")
        assert await first.result_async(timeout=30) == "round 1"
    assert calls == {"o-1": 1}  # never sent again
    rows = sql("SELECT outcome_code, superseded_by FROM orchestrator.runs WHERE id = %s",
               (first.id,))
    assert rows[0]["outcome_code"] == "CONTINUED_AS_NEW" and rows[0]["superseded_by"]


async def test_a_child_events_and_a_cancellation_follow_the_chain(make_app: Any,
                                                                   sql: Any) -> None:
    app = make_app()

    @app.workflow()
    async def counter(ctx, n):  # type: ignore[no-untyped-def]
        if n < 3:
            ctx.continue_as_new(n + 1)
        return n

    @app.workflow()
    async def parent(ctx, _):  # type: ignore[no-untyped-def]
        return await ctx.run_child(counter, 0)

    @app.workflow()
    async def listener(ctx, seen):  # type: ignore[no-untyped-def]
        got = await ctx.wait_for_event("ping")
        if got == "stop":
            return seen + [got]
        ctx.continue_as_new(seen + [got])

    @app.workflow()
    async def forever(ctx, n):  # type: ignore[no-untyped-def]
        await ctx.sleep(0.05)
        ctx.continue_as_new(n + 1)

    @app.workflow()
    async def careless(ctx, _):  # type: ignore[no-untyped-def]
        try:
            ctx.continue_as_new({"not": {1, 2}})  # a set is not JSON
        except InvalidRequest as exc:
            return exc.code

    async with running(app):
        # A child that continues: its parent gets the last run's result.
        assert await (await app.submit_async("parent", None)).result_async(timeout=30) == 3
        children = sql("SELECT parent_run_id, parent_position FROM orchestrator.runs "
                       "WHERE workflow_name = 'counter' ORDER BY created_at")
        assert len(children) == 4 and children[-1]["parent_position"] == 0
        assert [c["parent_position"] for c in children[:-1]] == [None] * 3

        # Events sent to the first run's id reach the run the chain is at; none is lost.
        listening = await app.submit_async("listener", [])
        for word in ("a", "b", "c", "stop"):
            assert await app.send_event_async(listening.id, "ping", word,
                                              event_key=f"k-{word}")
        assert await listening.result_async(timeout=30) == ["a", "b", "c", "stop"]
        # A sender's retry after the run went on is recognised: not delivered again.
        assert not await app.send_event_async(listening.id, "ping", "a", event_key="k-a")

        # Cancelling the first run's id cancels the chain where it is now.
        looping = await app.submit_async("forever", 0)
        await wait_for(lambda: sql("SELECT count(*) AS n FROM orchestrator.runs "
                                   "WHERE workflow_name = 'forever'")[0]["n"] >= 3, timeout=30)
        await looping.cancel_async()
        with pytest.raises(RunFailed) as cancelled:
            await looping.result_async(timeout=30)
        assert cancelled.value.code == "CANCELLED"
        # Counted as a cancellation asked of a run not finished: the chain's run was not.
        assert app.metrics.labelled("cancellations").get(("requested",)) == 1
        n = sql("SELECT count(*) AS n FROM orchestrator.runs WHERE workflow_name = 'forever'")
        await asyncio.sleep(0.3)
        assert sql("SELECT count(*) AS n FROM orchestrator.runs "
                   "WHERE workflow_name = 'forever'") == n  # it stopped going on

        # Bad input is refused where the code continues, before anything ends.
        assert await (await app.submit_async("careless", None)).result_async(
            timeout=30) == "INVALID_REQUEST"

        # A continued run is not restarted: the last run of the chain is.
        with pytest.raises(InvalidRequest, match="continued as run"):
            await looping.restart_async(reason="again")


async def test_cancelling_a_chain_by_its_first_runs_id_counts_the_request(
        make_app: Any, sql: Any) -> None:
    """``cancel_async`` with the first run's id reaches the run the chain is at, unfinished:
    a cancellation requested, counted once (``cancellations{stage="requested"}``); asked
    again once the chain is cancelled, it counts nothing."""
    app = make_app()

    @app.workflow()
    async def twice(ctx, n):  # type: ignore[no-untyped-def]
        if n == 0:
            ctx.continue_as_new(1)
        await ctx.wait_for_event("never")

    async with running(app):
        first = await app.submit_async("twice", 0)
        await wait_for(lambda: sql("SELECT status FROM orchestrator.runs "
                                   "WHERE continued_from = %s", (first.id,))
                       == [{"status": "waiting"}], timeout=30)
        assert await app.cancel_async(first.id) == "cancelled"
        assert app.metrics.labelled("cancellations") == {("requested",): 1}
        assert await first.cancel_async() == "cancelled"
    assert app.metrics.labelled("cancellations") == {("requested",): 1}


async def test_events_that_arrive_after_a_generations_last_wait_are_the_next_ones(
        make_app: Any, sql: Any) -> None:
    """Events delivered while a generation is past its last wait (here: in a call, after
    which it continues without waiting again) are moved to the new run in the continuation's
    transaction: the next generation receives each of them once, in the order sent, and the
    old run keeps none."""
    app = make_app()
    inside, release = asyncio.Event(), asyncio.Event()

    @app.tool(effect="read")
    async def slow_read(ctx):  # type: ignore[no-untyped-def]
        inside.set()
        await release.wait()
        return "read"

    @app.workflow()
    async def batcher(ctx, generation):  # type: ignore[no-untyped-def]
        if generation == 0:
            await ctx.call(slow_read)  # the events arrive during this call
            ctx.continue_as_new(1)
        return [await ctx.wait_for_event("item") for _ in range(3)]

    async with running(app):
        first = await app.submit_async("batcher", 0)
        await asyncio.wait_for(inside.wait(), timeout=30)
        for word in ("x", "y", "z"):
            assert await app.send_event_async(first.id, "item", word, event_key=f"i-{word}")
        held = sql("SELECT run_id FROM orchestrator.external_events")
        assert [e["run_id"] for e in held] == [first.id] * 3  # delivered to generation 0
        release.set()
        assert await first.result_async(timeout=30) == ["x", "y", "z"]
        (second,) = sql("SELECT id FROM orchestrator.runs WHERE continued_from = %s",
                        (first.id,))
        moved = sql("SELECT run_id, event_key, consumed_position "
                    "FROM orchestrator.external_events ORDER BY id")
        assert [(e["run_id"], e["event_key"]) for e in moved] == [
            (second["id"], "i-x"), (second["id"], "i-y"), (second["id"], "i-z")]
        assert all(e["consumed_position"] is not None for e in moved)
        # The senders' retries are recognised on the run the events went to.
        assert not await app.send_event_async(first.id, "item", "x", event_key="i-x")


def _continued_once(make_app: Any) -> tuple[Any, Any, Any]:
    """An app, and a finished run that continued as new once: (app, the first run's handle,
    the id of the run it went on as, which returned 1)."""
    app = make_app()

    @app.workflow()
    async def twice(ctx, n):  # type: ignore[no-untyped-def]
        if n == 0:
            ctx.continue_as_new(1)
        return n

    async def go() -> Any:
        async with running(app):
            handle = await app.submit_async("twice", 0)
            assert await handle.result_async(timeout=30) == 1
            return handle, (await handle.info_async()).superseded_by

    first, second = asyncio.run(go())
    return app, first, second


def test_runs_show_names_both_ends_of_a_continuation(make_app: Any,
                                                     migrated_database_url: str) -> None:
    app, first, second = _continued_once(make_app)
    shown = run_cli(["runs", "show", str(first.id)], database_url=migrated_database_url)
    assert shown.returncode == 0, shown.stderr
    assert f"superseded by:  {second} (continued as new" in shown.stdout
    # The timeline says what the number after the new run's id is: its workflow version.
    assert f"the run continued as run {second} (version 1)" in shown.stdout
    later = run_cli(["runs", "show", str(second), "--json"], database_url=migrated_database_url)
    assert json.loads(later.stdout)["run"]["continued_from"] == str(first.id)
    # The offline replay check reads a continuation as the code's end.
    verdicts = replay(app, [first.id, second])
    assert [v.verdict for v in verdicts] == ["ok", "ok"], verdicts


def test_runs_watch_of_a_continued_run_ends_naming_the_run_it_went_on_as(
        make_app: Any, migrated_database_url: str) -> None:
    """A continued run ended without a result of its own: `runs watch` ends with the run it
    went on as (follow that one next, docs/streams.md), not with `result null`."""
    _, first, second = _continued_once(make_app)
    watched = run_cli(["runs", "watch", str(first.id)], database_url=migrated_database_url)
    assert watched.returncode == 0, watched.stderr
    assert watched.stdout.splitlines()[-1] == (
        f"run {first.id} succeeded (CONTINUED_AS_NEW): it continued as run {second}")
    last = run_cli(["runs", "watch", str(second)], database_url=migrated_database_url)
    assert last.stdout.splitlines()[-1] == f"run {second} succeeded; result 1"


async def test_the_console_links_both_ends_of_a_continuation(make_app: Any) -> None:
    app = make_app()

    @app.workflow()
    async def twice(ctx, n):  # type: ignore[no-untyped-def]
        if n == 0:
            ctx.continue_as_new(1)
        return {"n": n}

    async with running(app):
        handle = await app.submit_async("twice", 0)
        assert await handle.result_async(timeout=30) == {"n": 1}
        second = (await handle.info_async()).superseded_by
        console = app.console(from_header, grants=GRANTS)
        async with Client(console, "alice") as alice:
            first_page = (await alice.get(f"/runs/{handle.id}")).text
            second_page = (await alice.get(f"/runs/{second}")).text
    assert "continued as" in first_page and f"/runs/{second}" in first_page
    assert "its result is that chain" in first_page
    assert "continues" in second_page and f"/runs/{handle.id}" in second_page
    assert "&#34;n&#34;: 1" in second_page or '"n": 1' in second_page


async def test_over_http_a_continued_run_names_its_successor_and_its_result_is_the_chains(
        make_app: Any) -> None:
    app = make_app()

    @app.workflow()
    async def countdown(ctx, n):  # type: ignore[no-untyped-def]
        if n > 0:
            ctx.continue_as_new(n - 1)
        return "done"

    @app.workflow()
    async def gives_up(ctx, n):  # type: ignore[no-untyped-def]
        if n == 0:
            ctx.continue_as_new(1)
        raise RuntimeError("the second generation fails")

    console = app.console(from_header, GRANTS, authenticate_owner=lambda request: OWNER)
    async with running(app):
        with Served(console) as server:
            async with httpx.AsyncClient(base_url=server.base, timeout=60) as http:
                made = (await http.post("/api/runs", json={"workflow": "countdown",
                                                           "input": 2})).json()
                answer = (await http.get(f"/api/runs/{made['id']}/result",
                                         params={"wait": 30})).json()
                assert (answer["done"], answer["result"]) == (True, "done")
                first = (await http.get(f"/api/runs/{made['id']}")).json()
                assert first["outcome_code"] == "CONTINUED_AS_NEW"
                second = (await http.get(f"/api/runs/{first['superseded_by']}")).json()
                assert second["continued_from"] == made["id"]
                failing = (await http.post("/api/runs", json={"workflow": "gives_up",
                                                              "input": 0})).json()
                failed = (await http.get(f"/api/runs/{failing['id']}/result",
                                         params={"wait": 30})).json()
                # The chain's end: failed, though the first run itself succeeded (continued).
                assert (failed["done"], failed["status"]) == (True, "failed")
                assert failed["error"]["code"] == "WORKFLOW_FAILED"
        handle = await app.get_run_async(made["id"])
        latest = await handle.latest_async()
        assert latest.id != handle.id and latest.status == "succeeded"
        assert latest.continued_from is not None and latest.outcome is None


async def test_a_version_that_is_not_a_name_is_refused_where_the_code_continues(
        make_app: Any, sql: Any) -> None:
    """``version`` is held to the rules a submission's version is held to, at
    ``ctx.continue_as_new``, before anything ends: a NUL character the database cannot store
    is ``INVALID_REQUEST`` there, not a write that fails the run's end on every claim, and a
    version with a space at its end does not queue a run that no worker can ever claim."""
    app = make_app()

    @app.workflow()
    async def careful(ctx, _):  # type: ignore[no-untyped-def]
        refused = []
        for version in ("1\x00", "1 ", "\u200b1", "9" * 201, "", 1):
            try:
                ctx.continue_as_new(None, version=version)
            except InvalidRequest as exc:
                refused.append([exc.code, exc.path])
        return refused

    async with running(app):
        run = await app.submit_async("careful", None)
        assert await run.result_async(timeout=30) == [["INVALID_REQUEST", "version"]] * 6
    rows = sql("SELECT status, outcome_code FROM orchestrator.runs")
    assert [(r["status"], r["outcome_code"]) for r in rows] == [("succeeded", None)]


async def test_a_version_this_app_does_not_register_is_refused_where_the_code_continues(
        make_app: Any, sql: Any) -> None:
    """A version no workflow of this name is registered at is ``UNKNOWN_WORKFLOW`` (path
    ``version``) at ``ctx.continue_as_new``, as a submission of it is: not a successor left
    queued for ever, that no worker of the application can run."""
    app = make_app()

    @app.workflow(version="1")
    async def careful(ctx, _):  # type: ignore[no-untyped-def]
        try:
            ctx.continue_as_new(None, version="2")
        except InvalidRequest as exc:
            return [exc.code, exc.path, exc.message]
        return "continued"

    async with running(app):
        run = await app.submit_async("careful", None)
        assert await run.result_async(timeout=30) == [
            "UNKNOWN_WORKFLOW", "version",
            "workflow 'careful' version '2' is not registered"]
    rows = sql("SELECT status, outcome_code FROM orchestrator.runs")
    assert [(r["status"], r["outcome_code"]) for r in rows] == [("succeeded", None)]


async def test_a_chain_whose_next_run_is_gone_answers_instead_of_spinning(
        make_app: Any, sql: Any) -> None:
    """Retention deletes each generation's row with its evidence by that generation's own
    age, so a generation kept longer (one with a child still running is never pruned) can
    outlive the run it continued as. Following the chain from it then ends there:
    ``result()`` and ``outcome()`` raise ``RUN_PRUNED`` at once, within their timeout,
    instead of reading the same row again for ever; ``latest()`` says the same."""
    from orchestrator import RunPruned

    app = make_app()

    @app.workflow()
    async def hop(ctx, n):  # type: ignore[no-untyped-def]
        if n < 1:
            ctx.continue_as_new(n + 1)
        return n

    async with running(app):
        first = await app.submit_async(hop, 0)
        assert await first.result_async(timeout=20) == 1
    # The next run's row deleted with its evidence (fabricated: the successor is gone).
    sql("UPDATE orchestrator.runs SET superseded_by = %s WHERE id = %s",
        (uuid.uuid4(), first.id))
    for ask in (lambda: first.result_async(timeout=1), first.outcome_async,
                first.latest_async):
        with pytest.raises(RunPruned) as info:
            await asyncio.wait_for(ask(), 5)
        assert (info.value.status, info.value.outcome) == ("succeeded", "CONTINUED_AS_NEW")
    assert await app.wait_async([first], timeout=1) == [first]  # it has ended: no wait
