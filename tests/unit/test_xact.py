"""``answered_once``: work run again after a lost COMMIT answers as its first attempt did when
that attempt committed, and runs again when it did not (a fake connection: what PostgreSQL's
``txid_status`` says is the only input)."""

from __future__ import annotations

from typing import Any

import pytest

from orchestrator.db import xact
from orchestrator.errors import DatabaseError


class _Conn:
    """Answers ``txid_current()`` with the next id, and ``txid_status`` from ``statuses``."""

    def __init__(self, statuses: list[str]) -> None:
        self.statuses = statuses
        self.asked = 0
        self.xid = 100

    async def execute(self, sql: str, params: Any = None) -> _Conn:
        if "txid_current" in sql:
            self.xid += 1
            self.row = {"xid": self.xid}
        else:
            self.asked += 1
            self.row = {"status": self.statuses.pop(0) if len(self.statuses) > 1
                        else self.statuses[0]}
        return self

    async def fetchone(self) -> dict[str, Any]:
        return self.row


async def test_a_retry_after_a_commit_that_applied_answers_as_the_first_attempt() -> None:
    ran: list[int] = []

    async def work(conn: Any) -> str:
        ran.append(1)
        return f"made {len(ran)}"

    once = xact.answered_once(work)
    conn = _Conn(["in progress", "in progress", "committed"])
    assert await once(conn) == "made 1"
    assert await once(conn) == "made 1"  # waited out the COMMIT under way, then answered
    assert ran == [1] and conn.asked == 3


async def test_a_retry_after_a_commit_that_did_not_apply_runs_the_work_again() -> None:
    ran: list[int] = []

    async def work(conn: Any) -> int:
        ran.append(1)
        return len(ran)

    once = xact.answered_once(work)
    conn = _Conn(["aborted"])
    assert await once(conn) == 1
    assert await once(conn) == 2  # the first attempt's writes are gone: this one's count
    assert ran == [1, 1]


async def test_a_commit_still_under_way_past_the_wait_is_an_unknown_outcome(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(xact, "SETTLE_WAIT", 0.05)

    async def work(conn: Any) -> str:
        return "made"

    once = xact.answered_once(work)
    conn = _Conn(["in progress"])
    await once(conn)
    with pytest.raises(DatabaseError, match="may or may not have been applied") as caught:
        await once(conn)
    assert caught.value.code == "DATABASE_UNAVAILABLE" and not caught.value.retryable
