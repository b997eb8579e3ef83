"""Waiting for many runs: ``app.wait`` and ``app.as_completed`` (and their ``_async`` twins)
against a real worker. They share the event loop's poller with the result waits
(``orchestrator.waiting``): one statement per poll asks about every run awaited; handles
come back as their runs end; a timeout is ``RESULT_TIMEOUT`` naming the runs still pending, as
``result(timeout=)`` is, and changes nothing."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from orchestrator import (
    AccessDenied,
    DatabaseError,
    InvalidRequest,
    Orchestrator,
    ResultTimeout,
    RunFailed,
    WorkflowError,
)
from orchestrator.db import runs as runs_db
from orchestrator.handle import RunHandle
from orchestrator.waiting import BUSY_PAUSE, FEW, FIRST_PAUSE, LONGEST_PAUSE
from tests.integration.conftest import OTHER, running, wait_for


def _register(app: Orchestrator) -> tuple[Any, Any, Any]:
    @app.workflow()
    async def gate(ctx, n):  # type: ignore[no-untyped-def]
        await ctx.wait_for_event("go")
        return n

    @app.workflow()
    async def quick(ctx, n):  # type: ignore[no-untyped-def]
        return n * 2

    @app.workflow()
    async def broken(ctx, n):  # type: ignore[no-untyped-def]
        raise WorkflowError("broken on purpose")

    return gate, quick, broken


def _status(sql, run) -> str:  # type: ignore[no-untyped-def]
    return sql("SELECT status FROM orchestrator.runs WHERE id = %s", (run.id,))[0]["status"]


@pytest.fixture
def polls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """How many runs each read of ``wait`` asked about (a spy on the one statement it reads
    its runs with: when it begins, and when the shared poller found one of them ended)."""
    sizes: list[int] = []
    real = runs_db.run_statuses

    async def spy(conn, runs):  # type: ignore[no-untyped-def]
        sizes.append(len(runs))
        return await real(conn, runs)

    monkeypatch.setattr(runs_db, "run_statuses", spy)
    return sizes


async def test_wait_polls_every_pending_run_in_one_statement(app, sql, polls, monkeypatch):
    gate, _, broken = _register(app)
    single_reads: list[object] = []
    real_row = Orchestrator._row

    async def row_spy(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        single_reads.append(args[0])
        return await real_row(self, *args, **kwargs)

    async with running(app, concurrency=25):
        gates = [await app.submit_async(gate, i) for i in range(20)]
        failing = await app.submit_async(broken, 0)
        handles = [*gates, failing]
        await wait_for(lambda: all(_status(sql, h) == "waiting" for h in gates)
                       and _status(sql, failing) == "failed", 20)
        monkeypatch.setattr(Orchestrator, "_row", row_spy)
        poller = app._waits.poller()
        waiting = asyncio.ensure_future(app.wait_async(handles, timeout=30))
        await wait_for(lambda: poller.polls >= 3)
        assert not waiting.done()
        # read once when the wait began; since, the shared poller asked (orchestrator.waiting)
        assert polls == [21] and set(poller.waiting) == {
            (h.id, h.owner.tenant, h.owner.principal) for h in gates}
        for handle in gates:
            await app.send_event_async(handle.id, "go")
        done = await waiting
        monkeypatch.setattr(Orchestrator, "_row", real_row)
        assert done == handles and all(a is b for a, b in zip(done, handles, strict=True))
        assert single_reads == []  # no per-handle read while waiting
        # each read asks about every run still unfinished, in one statement: all 21 first,
        # then fewer as they end (never one statement per run); read again only when a poll
        # found one ended
        assert polls[0] == 21 and polls == sorted(polls, reverse=True)
        assert len(polls) <= 21
        assert [await h.result_async() for h in gates] == list(range(20))
        with pytest.raises(RunFailed) as failed:
            await failing.result_async()
        assert failed.value.code == "WORKFLOW_FAILED"


async def test_as_completed_yields_each_run_as_it_ends(app, sql):
    gate, _, _ = _register(app)
    async with running(app):
        a, b, c = [await app.submit_async(gate, name) for name in "abc"]
        await wait_for(lambda: all(_status(sql, h) == "waiting" for h in (a, b, c)))
        finished = app.as_completed_async([a, b, c], timeout=30)
        for handle in (c, a, b):
            await app.send_event_async(handle.id, "go")
            assert await anext(finished) is handle
            assert await handle.result_async() == {a: "a", b: "b", c: "c"}[handle]
        with pytest.raises(StopAsyncIteration):
            await anext(finished)


async def test_a_timeout_raises_result_timeout_naming_the_pending_runs(app, sql):
    gate, quick, _ = _register(app)
    async with running(app):
        blocked = await app.submit_async(gate, 1)
        done = await app.submit_async(quick, 2)
        await wait_for(lambda: _status(sql, blocked) == "waiting" and _status(sql, done)
                       == "succeeded")
        with pytest.raises(ResultTimeout) as timed_out:
            await app.wait_async([done, blocked], timeout=0.2)
        error = timed_out.value
        assert error.code == "RESULT_TIMEOUT" and error.retryable
        assert error.pending == (str(blocked.id),) and error.status == "waiting"
        assert "1 of 2 runs have not finished" in str(error)
        assert _status(sql, blocked) == "waiting"  # waiting changed nothing

        finished = app.as_completed_async([blocked, done], timeout=0.2)
        assert await anext(finished) is done
        with pytest.raises(ResultTimeout) as timed_out:
            await anext(finished)
        assert timed_out.value.pending == (str(blocked.id),)

        await app.send_event_async(blocked.id, "go")
        assert await app.wait_async([done, blocked], timeout=30) == [done, blocked]
        assert await app.wait_async([], timeout=0) == []


def _count_polls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From now on, each statement of the shared result poller appends how many runs it
    asked about to the list returned."""
    asked: list[int] = []
    real = runs_db.run_finished

    async def spy(conn, runs):  # type: ignore[no-untyped-def]
        asked.append(len(runs))
        return await real(conn, runs)

    monkeypatch.setattr(runs_db, "run_finished", spy)
    return asked


async def test_result_waits_share_one_poll_and_one_that_times_out_leaves_nothing(
        app, sql, monkeypatch):
    """``result(timeout=)`` of many runs in one event loop: one statement per poll asks about
    all of them (orchestrator.waiting); a wait that times out is ``RESULT_TIMEOUT`` with the
    run's status and leaves the poller (the others wait on); another owner's handle is
    ``ACCESS_DENIED`` before it waits; once nobody waits, the poller stops."""
    gate, _, _ = _register(app)
    async with running(app, concurrency=15):
        gates = [await app.submit_async(gate, i) for i in range(10)]
        await wait_for(lambda: all(_status(sql, h) == "waiting" for h in gates), 20)
        asked = _count_polls(monkeypatch)
        waits = [asyncio.ensure_future(h.result_async(timeout=30)) for h in gates]
        with pytest.raises(ResultTimeout) as timed_out:
            await gates[0].result_async(timeout=0.3)  # a second wait of one run gives up
        assert timed_out.value.status == "waiting"
        poller = app._waits.poller()
        assert len(poller.waiting) == 10 and sum(map(len, poller.waiting.values())) == 10
        await wait_for(lambda: asked and asked[-1] == 10)  # (the 0.3 s may pass before)
        assert max(asked) == 10  # the two waits of one run: asked about once
        with pytest.raises(AccessDenied):
            await RunHandle(app, gates[1].id, OTHER).result_async(timeout=30)
        assert not any(w.done() for w in waits)
        for handle in gates:
            await app.send_event_async(handle.id, "go")
        assert await asyncio.gather(*waits) == list(range(10))
        assert poller.waiting == {}
        await wait_for(lambda: poller._task is None, 5, "the poller stopped")


async def test_the_sync_forms_wait_from_a_thread_while_runs_end(app, sql):
    gate, quick, _ = _register(app)
    async with running(app):
        gates = [await app.submit_async(gate, i) for i in range(3)]
        quicks = [await app.submit_async(quick, i) for i in range(3)]
        await wait_for(lambda: all(_status(sql, h) == "waiting" for h in gates))
        every = [*gates, *quicks]
        waiting = asyncio.ensure_future(asyncio.to_thread(app.wait, every, timeout=30))
        streaming = asyncio.ensure_future(asyncio.to_thread(
            lambda: list(app.as_completed(every, timeout=30))))
        for handle in gates:
            await app.send_event_async(handle.id, "go")
        assert await waiting == every
        streamed = await streaming
        assert sorted(h.id for h in streamed) == sorted(h.id for h in every)
        assert len(streamed) == len(every)

        # a sync caller may stop early: the iteration on the private loop is closed with it
        def first_then_close() -> object:
            finished = app.as_completed(every)
            first = next(finished)
            finished.close()
            return first

        assert await asyncio.to_thread(first_then_close) in every
        with pytest.raises(ResultTimeout):
            await asyncio.to_thread(app.wait, [await app.submit_async(gate, 9)], timeout=0)


async def test_handles_and_timeouts_are_checked_before_anything_is_read(app, make_app, polls):
    gate, _, _ = _register(app)
    other_app = make_app()
    other_gate, _, _ = _register(other_app)
    run = await app.submit_async(gate, 1)
    foreign = await other_app.submit_async(other_gate, 1)  # the same database, another app
    # a single handle where a list of them is meant, or None, is bad input too (not a
    # TypeError without a code)
    for bad in ([run, foreign], [run, "not a handle"], [run.id], run, None, 5):
        with pytest.raises(InvalidRequest) as refused:
            await app.wait_async(bad)  # type: ignore[arg-type]
        assert refused.value.code == "INVALID_REQUEST"
        with pytest.raises(InvalidRequest):
            app.as_completed_async(bad)  # type: ignore[arg-type]
    for timeout in (-1, float("nan"), "1", True):
        with pytest.raises(InvalidRequest):
            await app.wait_async([run], timeout=timeout)  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest):
            app.as_completed(iter([run]), timeout=timeout)  # type: ignore[arg-type]
    assert polls == []
    # a handle that names another owner's run is refused as a missing run is
    other = type(run)(app, run.id, OTHER)
    with pytest.raises(AccessDenied):
        await app.wait_async([run, other], timeout=0)


async def test_a_sync_method_in_async_code_is_refused_naming_its_async_twin(app):
    """A sync method waits in its caller's thread. Called in async code, it would block that
    thread's loop, and with it the worker running there: ``run.result()`` would wait for a run
    that could never finish. It is refused at once instead, naming what to await."""
    _, quick, _ = _register(app)
    async with running(app):
        run = await app.submit_async(quick, 1)
        refusals = [
            (lambda: run.result(timeout=5), r"await RunHandle\.result_async\(\)"),
            (lambda: app.submit(quick, 2), r"await Orchestrator\.submit_async\(\)"),
            (lambda: app.wait([run], timeout=5), r"await Orchestrator\.wait_async\(\)"),
            (lambda: app.as_completed([run], timeout=5),
             r"async for handle in Orchestrator\.as_completed_async\(\)"),
            (lambda: run.events_sync(), r"async for entry in RunHandle\.events\(\)"),
        ]
        for call, instead in refusals:
            with pytest.raises(InvalidRequest, match=f"{instead} instead") as refused:
                call()
            assert refused.value.code == "INVALID_REQUEST"
        assert await run.result_async(timeout=10) == 2
        assert len(await app.list_runs_async()) == 1  # the refused submission wrote nothing
        # from a thread of its own (no loop runs there) the same call waits as it should
        assert await asyncio.to_thread(run.result, 10) == 2


async def test_wait_and_as_completed_follow_a_chain_that_continued_as_new(app, sql):
    """A handle of a run that continued as new (``ctx.continue_as_new``) is finished when the
    last run of its chain is: its status is that run's while it waits, as ``result()`` has."""

    @app.workflow()
    async def twice(ctx, n):  # type: ignore[no-untyped-def]
        if n == 0:
            ctx.continue_as_new(1)
        return await ctx.wait_for_event("go")

    async with running(app):
        first = await app.submit_async(twice, 0)
        await wait_for(lambda: sql("SELECT count(*) AS n FROM orchestrator.runs WHERE "
                                   "status = 'waiting'")[0]["n"] == 1)
        assert _status(sql, first) == "succeeded"  # it continued; the chain waits
        with pytest.raises(ResultTimeout) as timed_out:
            await app.wait_async([first], timeout=0.2)
        assert timed_out.value.status == "waiting"
        assert timed_out.value.pending == (str(first.id),)
        waiting = asyncio.ensure_future(app.wait_async([first], timeout=30))
        finished = app.as_completed_async([first], timeout=30)
        first_done = asyncio.ensure_future(anext(finished))
        poller = app._waits.poller()
        polled = poller.polls
        await wait_for(lambda: poller.polls >= polled + 3)  # neither ends meanwhile
        assert not waiting.done() and not first_done.done()
        await app.send_event_async(first.id, "go", "done")  # follows the chain too
        assert await waiting == [first] and await first_done is first
        assert await first.result_async() == "done"


async def test_a_run_that_stops_being_the_owners_while_awaited_is_access_denied(app, sql):
    """A run whose owner no longer matches the handle's (here its row is rewritten, as a run
    gone from this owner's view) ends the wait with ``ACCESS_DENIED``, as a missing run."""
    gate, _, _ = _register(app)
    async with running(app):
        runs = [await app.submit_async(gate, i) for i in range(2)]
        await wait_for(lambda: all(_status(sql, h) == "waiting" for h in runs))
        waiting = asyncio.ensure_future(app.wait_async(runs, timeout=30))
        finished = app.as_completed_async(runs, timeout=30)
        first_done = asyncio.ensure_future(anext(finished))
        poller = app._waits.poller()
        await wait_for(lambda: poller.polls >= 2)
        assert not waiting.done() and not first_done.done()
        sql("UPDATE orchestrator.runs SET principal = 'someone-else' WHERE id = %s",
            (runs[1].id,))
        with pytest.raises(AccessDenied):
            await asyncio.wait_for(waiting, 10)
        with pytest.raises(AccessDenied):
            await asyncio.wait_for(first_done, 10)


async def test_wait_as_completed_and_result_waits_share_one_poller(app, sql, monkeypatch):
    """``result(timeout=)``, ``wait`` and ``as_completed`` waiting in one event loop cost the
    database one statement per poll for all their runs together (orchestrator.waiting), not
    one per caller per round; each still gets its own answer, and once nobody waits the
    poller stops."""
    gate, _, _ = _register(app)
    async with running(app, concurrency=10):
        runs = [await app.submit_async(gate, i) for i in range(6)]
        await wait_for(lambda: all(_status(sql, h) == "waiting" for h in runs), 20)
        asked = _count_polls(monkeypatch)
        poller = app._waits.poller()
        result = asyncio.ensure_future(runs[0].result_async(timeout=30))
        waited = asyncio.ensure_future(app.wait_async(runs[1:3], timeout=30))
        finished = app.as_completed_async(runs[3:], timeout=30)
        first_done = asyncio.ensure_future(anext(finished))
        await wait_for(lambda: len(poller.waiting) == 6 and asked and asked[-1] == 6)
        polled, statements = poller.polls, len(asked)
        await wait_for(lambda: poller.polls >= polled + 3)
        # one statement per poll (give or take the one under way), each asking about the
        # runs of all three callers
        assert len(asked) - statements <= poller.polls - polled + 1
        assert set(asked[statements:]) == {6}
        assert not any(f.done() for f in (result, waited, first_done))
        for handle in reversed(runs):
            await app.send_event_async(handle.id, "go")
        assert await result == 0
        assert await waited == runs[1:3]
        done = [await first_done] + [h async for h in finished]
        assert sorted(h.id for h in done) == sorted(h.id for h in runs[3:])
        assert poller.waiting == {}
        await wait_for(lambda: poller._task is None, 5, "the poller stopped")


async def test_a_failing_poll_keeps_its_pause_long_while_the_waiters_read_their_runs(
        app, sql, monkeypatch):
    """The poller's statement fails while each waiter's own read of its run succeeds: every
    waiter reads, finds its run still open and waits again. Those arrivals must not bring the
    next poll back to FIRST_PAUSE (a storm of polls and reads): after a failed poll the pause
    stays LONGEST_PAUSE until a poll succeeds."""
    gate, _, _ = _register(app)
    handles = [await app.submit_async(gate, i) for i in range(3)]  # no worker: they stay open

    async def failing(conn, runs):  # type: ignore[no-untyped-def]
        raise DatabaseError("the poll failed on purpose")

    monkeypatch.setattr(runs_db, "run_finished", failing)
    poller = app._waits.poller()
    waits = [asyncio.ensure_future(h.result_async(timeout=30)) for h in handles]
    await wait_for(lambda: poller.polls >= 1)
    polled, started = poller.polls, asyncio.get_running_loop().time()
    await asyncio.sleep(1.0)
    elapsed = asyncio.get_running_loop().time() - started
    made = poller.polls - polled
    assert made <= elapsed / LONGEST_PAUSE + 2, (made, elapsed)
    assert not any(w.done() for w in waits)
    for wait in waits:
        wait.cancel()
    await asyncio.gather(*waits, return_exceptions=True)


async def test_a_few_waiters_are_asked_about_soon_and_many_less_often(app, sql):
    """A lone ``result()`` of a short run is answered by a poll FIRST_PAUSE (5 ms) after it
    arrives; while more than FEW runs are awaited, each poll asks about all of them, and an
    arrival brings the next poll no nearer than BUSY_PAUSE (20 ms)."""
    gate, _, _ = _register(app)
    gates = [await app.submit_async(gate, i) for i in range(FEW + 2)]
    keys = [(h.id, h.owner.tenant, h.owner.principal) for h in gates]
    loop = asyncio.get_running_loop()
    poller = app._waits.poller()
    lone = asyncio.ensure_future(poller.finished({keys[0]}, 30))
    await asyncio.sleep(0)  # it arrived
    assert 0 < poller._due - loop.time() <= FIRST_PAUSE
    many = asyncio.ensure_future(poller.finished(set(keys[1:-1]), 30))
    await asyncio.sleep(0)
    assert len(poller.waiting) == FEW + 1 and poller._shortest() == BUSY_PAUSE
    polled = poller.polls
    await wait_for(lambda: poller.polls > polled)  # the next one is BUSY_PAUSE away at least
    before = poller._due
    late = asyncio.ensure_future(poller.finished({keys[-1]}, 30))
    await asyncio.sleep(0)
    assert poller._due == before or poller._due - loop.time() > FIRST_PAUSE
    for waiting in (lone, many, late):
        waiting.cancel()
    await asyncio.gather(lone, many, late, return_exceptions=True)
    await wait_for(lambda: poller._task is None, 5, "the poller stopped")
