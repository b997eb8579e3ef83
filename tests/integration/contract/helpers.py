"""What the contract tests share: reading a run's state and its operations, tools, and the
ways they slow down or watch the group writer and drain a worker."""

from __future__ import annotations

import asyncio

from orchestrator.engine.control import Phase
from tests.integration.conftest import never_answers, wait_for


def run_status(sql, run):  # type: ignore[no-untyped-def]
    return sql("SELECT status, outcome_code FROM orchestrator.runs WHERE id = %s",
               (run.id,))[0]


def operations(sql):  # type: ignore[no-untyped-def]
    return sql("SELECT id, attempt, tool_name, state FROM orchestrator.operations ORDER BY id")


def parked(sql, run):  # type: ignore[no-untyped-def]
    return lambda: run_status(sql, run)["status"] == "needs_reconciliation"


class Tools:
    """``charge`` (``effect`` as given) and ``notify``; ``called`` lists their calls in order."""

    def __init__(self, app, effect="consequential"):  # type: ignore[no-untyped-def]
        self.called: list[str] = []

        @app.tool(effect=effect)
        async def charge(ctx):  # type: ignore[no-untyped-def]
            self.called.append("charge")
            return {"charged": True}

        @app.tool()
        async def notify(ctx):  # type: ignore[no-untyped-def]
            self.called.append("notify")
            return {"sent": True}

        self.charge, self.notify = charge, notify


def watch_writes(monkeypatch):  # type: ignore[no-untyped-def]
    """Events set as the worker's group writer gets the first and the second write (they stay
    set: a replay writes nothing at those points)."""
    from orchestrator.db.writer import GroupWriter

    writes: list[asyncio.Event] = [asyncio.Event(), asyncio.Event()]
    enqueue = GroupWriter.enqueue

    def spy(self, work):  # type: ignore[no-untyped-def]
        for written in writes:
            if not written.is_set():
                written.set()
                break
        return enqueue(self, work)

    monkeypatch.setattr(GroupWriter, "enqueue", spy)
    return writes


def slow_write(monkeypatch, nth=1, delay=None):  # type: ignore[no-untyped-def]
    """The ``nth`` write through the group writer commits at once, but its caller hears of it
    late, so that the write holds the run's write lock meanwhile: until the task that made
    the write has been cancelled (by workflow code's timeout, or by its task group), or, with
    ``delay``, that many seconds after it landed."""
    from orchestrator.db.writer import GroupWriter, Landing

    enqueue = GroupWriter.enqueue
    count: list[int] = []

    def slow(self, work):  # type: ignore[no-untyped-def]
        landing = enqueue(self, work)
        count.append(1)
        if len(count) != nth:
            return landing
        loop = asyncio.get_running_loop()
        caller = asyncio.current_task()
        assert caller is not None
        late = Landing(loop=loop)

        def hand_over() -> None:
            exc = landing.exception()
            if exc is not None:
                late.set_exception(exc)
            else:
                late.set_result(landing.result())

        async def once_cancelled() -> None:
            try:
                await wait_for(lambda: landing.done() and caller.cancelling(),
                               what="the caller of the slow write was cancelled")
            finally:
                hand_over()  # also when that never came: the test then fails on its own terms

        if delay is None:
            later.append(loop.create_task(once_cancelled()))
        else:
            landing.add_done_callback(lambda _: loop.call_later(delay, hand_over))
        return late

    later: list[asyncio.Task[None]] = []  # keeps the hand-over tasks referenced
    monkeypatch.setattr(GroupWriter, "enqueue", slow)


class DrainTools:
    """Tools for the drain tests: ``slow`` (sets ``slow_started``, returns once
    ``slow_release`` is set), ``fast``, and the idempotent ``ship``, ``label`` and ``pack``
    (its first call runs until it is cancelled); ``called`` lists the calls in order."""

    def __init__(self, app):  # type: ignore[no-untyped-def]
        self.called: list[str] = []
        self.slow_started = asyncio.Event()
        self.slow_release = asyncio.Event()

        @app.tool()
        async def slow(ctx):  # type: ignore[no-untyped-def]
            self.called.append("slow")
            self.slow_started.set()
            await self.slow_release.wait()
            return "slow"

        @app.tool()
        async def fast(ctx):  # type: ignore[no-untyped-def]
            self.called.append("fast")
            return "fast"

        def idempotent(name, result):  # type: ignore[no-untyped-def]
            @app.tool(name=name, effect="idempotent")
            async def tool(ctx):  # type: ignore[no-untyped-def]
                self.called.append(name)
                return result

            return tool

        ship, label = idempotent("ship", "shipped"), idempotent("label", "labelled")

        @app.tool(effect="idempotent")
        async def pack(ctx):  # type: ignore[no-untyped-def]
            self.called.append("pack")
            if self.called.count("pack") == 1:
                await never_answers()  # still running when a sibling stops for the drain
            return "packed"

        self.slow, self.fast, self.ship, self.label = slow, fast, ship, label
        self.pack = pack

    def branches(self, app, *others):  # type: ignore[no-untyped-def]
        """A workflow whose task group runs ``a`` (``slow``, then ``fast``: the drain stops it
        there) and one branch per tool of ``others``, in that order; it returns their results
        in the same order."""
        @app.workflow()
        async def wf(ctx, data):  # type: ignore[no-untyped-def]
            # Commands take their positions when called: these in program order, every time.
            slow_call, *calls = ctx.call(self.slow), *(ctx.call(tool) for tool in others)

            async def a():  # type: ignore[no-untyped-def]
                return [await slow_call, await ctx.call(self.fast)]

            async def one(call):  # type: ignore[no-untyped-def]
                return await call

            async with asyncio.TaskGroup() as group:
                tasks = [group.create_task(a()), *(group.create_task(one(c)) for c in calls)]
            return [task.result() for task in tasks]

        return wf

    async def drain_during_slow(self, app, wf):  # type: ignore[no-untyped-def]
        """Submit ``wf`` and drain a worker once ``slow`` runs; ``slow`` returns once the
        drain has begun (:func:`drain_once`)."""
        return await drain_once(app, wf, self.slow_started, then=self.slow_release)


def draining(worker):  # type: ignore[no-untyped-def]
    """The worker's drain has begun: every run it holds is told to stop at its next step."""
    executors = [h.executor for h in worker._running.values() if h.executor is not None]
    return bool(executors) and all(ex.run.phase is not Phase.RUNNING for ex in executors)


async def drain_once(app, wf, started, then=None):  # type: ignore[no-untyped-def]
    """Submit ``wf``, start a worker, and stop it (a drain) once ``started`` is set; set
    ``then`` (if given) once the drain has begun. Returns the run once the worker stopped."""
    run = await app.submit_async(wf, {})
    worker = app.create_worker(poll_interval=0.2)
    working = asyncio.ensure_future(worker.run())
    await asyncio.wait_for(started.wait(), 10)
    worker.request_stop()
    if then is not None:
        await wait_for(lambda: draining(worker))
        then.set()
    await asyncio.wait_for(working, 20)
    return run


def lease_lapsed(sql):  # type: ignore[no-untyped-def]
    """Every lease of the test's runs has expired by the database's clock."""
    return sql("SELECT bool_and(lease_expires_at < clock_timestamp()) AS lapsed "
               "FROM orchestrator.runs")[0]["lapsed"]
