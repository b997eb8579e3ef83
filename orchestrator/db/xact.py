"""A unit of work that answers once, though its COMMIT's answer was lost.

The storage layer (:class:`~orchestrator.db.database.Database`) runs a unit of work again when
its connection is lost during the COMMIT. If that COMMIT did apply, the second run sees the
world after the first one's writes: an insert finds its row taken, a delete finds nothing, a
guarded transition finds its state moved on, and an audit row would be written twice.
:func:`answered_once` wraps such work: each attempt records the id of its transaction
(:func:`xact_current`) with its answer, and the next attempt first asks the database whether
that transaction committed (:func:`xact_committed`, which waits for a COMMIT still under way
on the server to end) and, if so, answers as it did, writing nothing.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from orchestrator.db.database import Conn
from orchestrator.errors import DatabaseError

T = TypeVar("T")

SETTLE_WAIT = 10.0
"""Seconds :func:`xact_committed` waits for a transaction whose COMMIT is still under way."""


async def xact_current(conn: Conn) -> int:
    """The id of the caller's transaction (given one now if it has none yet), to ask
    :func:`xact_committed` about it after its COMMIT was lost."""
    row = await (await conn.execute("SELECT txid_current() AS xid")).fetchone()
    assert row is not None
    return int(row["xid"])


async def xact_committed(conn: Conn, xid: int) -> bool:
    """Whether the transaction ``xid`` (:func:`xact_current`) committed: after a connection lost
    during its COMMIT, the only way to know whether it applied. A COMMIT still under way on
    the server (its session has not noticed the lost connection yet) is waited for, up to
    :data:`SETTLE_WAIT` seconds; after that the outcome is unknown (``DATABASE_UNAVAILABLE``,
    as the storage layer says of work it cannot run again)."""
    give_up = time.monotonic() + SETTLE_WAIT
    while True:
        row = await (await conn.execute("SELECT txid_status(%s) AS status",
                                        (xid,))).fetchone()
        status = None if row is None else row["status"]
        if status != "in progress":
            return status == "committed"
        if time.monotonic() >= give_up:
            raise DatabaseError(f"the connection was lost during a COMMIT still under way after "
                                f"{SETTLE_WAIT:g} s: it may or may not have been applied, and "
                                "it is not safe to repeat blindly", retryable=False)
        await asyncio.sleep(0.01)


def answered_once(work: Callable[[Conn], Awaitable[T]]) -> Callable[[Conn], Awaitable[T]]:
    """``work`` for :meth:`~orchestrator.db.database.Database.run_in_transaction` that, run
    again after a connection lost during a COMMIT that applied, answers as that attempt did
    (the schedule it made, the run it cancelled and what it reached, the rows it pruned)
    rather than with the world its own writes left, and writes nothing more."""
    done: list[tuple[int, T]] = []  # the last attempt that ran to its end: its xid, answer

    async def once(conn: Conn) -> T:
        if done and await xact_committed(conn, done[0][0]):
            return done[0][1]
        done.clear()
        answer = await work(conn)
        done.append((await xact_current(conn), answer))
        return answer

    return once
