"""Transaction ids, to tell after a lost COMMIT whether it applied.

The storage layer (:class:`~orchestrator.db.database.Database`) runs a unit of work again when
its connection is lost during the COMMIT. If that COMMIT did apply, the second run sees the
world after the first one's writes: an insert finds its row taken, a delete finds nothing, a
guarded transition finds its state moved on. Work whose answer depends on that records the id
of the transaction that wrote (:func:`xact_current`) and, when it is run again, asks
:func:`xact_committed` about it first, then answers with what that transaction did.
"""

from __future__ import annotations

from orchestrator.db.database import Conn


async def xact_current(conn: Conn) -> int:
    """The id of the caller's transaction (given one now if it has none yet), to ask
    :func:`xact_committed` about it after its COMMIT was lost."""
    row = await (await conn.execute("SELECT txid_current() AS xid")).fetchone()
    assert row is not None
    return int(row["xid"])


async def xact_committed(conn: Conn, xid: int) -> bool:
    """Whether the transaction ``xid`` (:func:`xact_current`) committed: after a connection lost
    during its COMMIT, the only way to know whether it applied. One whose COMMIT is still under
    way on the server is not committed yet: asked after waiting for a row lock that transaction
    held (or for the unique index entry it wrote), the answer is final."""
    row = await (await conn.execute("SELECT txid_status(%s) AS status", (xid,))).fetchone()
    return row is not None and row["status"] == "committed"
