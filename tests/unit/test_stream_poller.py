"""The run streams' revision poller with a stand-in database whose answers the test releases:
a follower that begins to wait while a poll is under way is not woken by that poll's answer,
which did not ask for its run (it used to be woken as if its run were gone, and read the run's
state again for nothing: one query per follower per poll with many followers); a follower is
handed the entries after its own cursor when the poll read all of them."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

from orchestrator.stream import PAGE, _RevisionPoller


def entry(seq: int) -> dict[str, Any]:
    return {"seq": seq, "kind": "value", "name": None}


class HeldDatabase:
    """``read`` answers what the test puts in ``answers``, one poll at a time; ``asked`` has
    the runs waited for when each poll began."""

    def __init__(self) -> None:
        self.answers: asyncio.Queue[Any] = asyncio.Queue()
        self.asked: list[list[uuid.UUID]] = []
        self.polled = asyncio.Event()
        self.poller: _RevisionPoller | None = None

    async def read(self, statement: Any) -> Any:
        assert self.poller is not None
        self.asked.append(list(self.poller.waiting))
        self.polled.set()
        return await self.answers.get()


async def test_a_follower_that_joins_during_a_poll_waits_for_the_next_one() -> None:
    db = HeldDatabase()
    poller = db.poller = _RevisionPoller(db)  # type: ignore[arg-type]
    first, second = uuid.uuid4(), uuid.uuid4()
    a = asyncio.ensure_future(poller.changed(first, 3))
    await db.polled.wait()  # the poll asks for the first run only …
    db.polled.clear()
    assert db.asked == [[first]]
    b = asyncio.ensure_future(poller.changed(second, 5))  # … while the second joins
    await asyncio.sleep(0)
    db.answers.put_nowait(({first: {"revision": 4, "status": "running"}},
                           {first: [entry(4)]}))
    assert await a == ({"revision": 4, "status": "running"}, [entry(4)])
    await asyncio.sleep(0)
    assert not b.done()  # not woken by an answer that did not ask for its run
    await db.polled.wait()  # the next poll asks for it
    assert db.asked[-1] == [second]
    db.answers.put_nowait(({second: {"revision": 5, "status": "running"}}, {}))
    await asyncio.sleep(0.01)
    assert not b.done()  # not past what it saw
    await db.polled.wait()
    db.answers.put_nowait(({second: {"revision": 6, "status": "succeeded"}},
                           {second: [entry(6)]}))
    assert await asyncio.wait_for(b, 5) == ({"revision": 6, "status": "succeeded"}, [entry(6)])
    await poller.close()


async def test_a_run_gone_wakes_its_followers_with_none() -> None:
    db = HeldDatabase()
    poller = db.poller = _RevisionPoller(db)  # type: ignore[arg-type]
    gone = uuid.uuid4()
    waiting = asyncio.ensure_future(poller.changed(gone, 1))
    await db.polled.wait()
    db.answers.put_nowait(({gone: None}, {}))  # asked for, not found: the run is gone
    assert await asyncio.wait_for(waiting, 5) == (None, None)
    await poller.close()


async def test_each_follower_gets_the_entries_after_its_own_cursor_when_all_were_read() -> None:
    db = HeldDatabase()
    poller = db.poller = _RevisionPoller(db)  # type: ignore[arg-type]
    run = uuid.uuid4()
    behind = asyncio.ensure_future(poller.changed(run, 2))
    ahead = asyncio.ensure_future(poller.changed(run, 4))
    await db.polled.wait()
    db.answers.put_nowait(({run: {"revision": 6, "status": "running"}},
                           {run: [entry(3), entry(4), entry(5), entry(6)]}))
    assert (await behind)[1] == [entry(3), entry(4), entry(5), entry(6)]
    assert (await ahead)[1] == [entry(5), entry(6)]
    await poller.close()


async def test_a_follower_reads_itself_when_the_poll_read_a_whole_page() -> None:
    db = HeldDatabase()
    poller = db.poller = _RevisionPoller(db)  # type: ignore[arg-type]
    run = uuid.uuid4()
    waiting = asyncio.ensure_future(poller.changed(run, 0))
    await db.polled.wait()
    full = [entry(seq) for seq in range(1, PAGE + 1)]  # there may be more after these
    db.answers.put_nowait(({run: {"revision": PAGE + 7, "status": "running"}}, {run: full}))
    assert await waiting == ({"revision": PAGE + 7, "status": "running"}, None)
    await poller.close()


async def test_a_run_absent_from_the_answer_did_not_move_and_its_followers_wait_on() -> None:
    db = HeldDatabase()
    poller = db.poller = _RevisionPoller(db)  # type: ignore[arg-type]
    quiet = uuid.uuid4()
    waiting = asyncio.ensure_future(poller.changed(quiet, 2))
    await db.polled.wait()
    db.polled.clear()
    db.answers.put_nowait(({}, {}))  # nothing moved
    await db.polled.wait()  # the next poll asks for it again
    assert not waiting.done() and db.asked[-1] == [quiet]
    db.answers.put_nowait(({quiet: {"revision": 3, "status": "running"}}, {quiet: [entry(3)]}))
    assert await asyncio.wait_for(waiting, 5) == ({"revision": 3, "status": "running"},
                                                  [entry(3)])
    await poller.close()


class QuietDatabase:
    """Every poll finds that nothing moved."""

    async def read(self, statement: Any) -> Any:
        return {}, {}


async def test_a_follower_with_a_heartbeat_is_woken_with_none_when_nothing_moved() -> None:
    poller = _RevisionPoller(QuietDatabase())  # type: ignore[arg-type]
    run = uuid.uuid4()
    loop = asyncio.get_running_loop()
    started = loop.time()
    beating = asyncio.ensure_future(poller.changed(run, 1, 0.3))
    silent = asyncio.ensure_future(poller.changed(run, 1))
    assert await asyncio.wait_for(beating, 5) is None
    assert 0.3 <= loop.time() - started < 1.0  # at the first poll after it was due
    assert not silent.done() and [w[0] for w in poller.waiting[run]] == [1]  # still waiting
    again = asyncio.ensure_future(poller.changed(run, 1, 0.3))  # waits again, beats again
    assert await asyncio.wait_for(again, 5) is None
    silent.cancel()
    await poller.close()
