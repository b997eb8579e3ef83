"""The connection pool's own WARNING for each failed attempt to connect (psycopg_pool logs one
per attempt, and the pool tries about once a second while a database is down): one line, then
at most one every :data:`~orchestrator.db.database.POOL_FAILURES_EVERY` seconds, which says how
many it left out; a connection made ends the streak."""

from __future__ import annotations

import logging

from orchestrator.db.database import POOL_NAME, PoolFailuresOnce


def _record(msg: str, *args: object, level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord("psycopg.pool", level, "pool_async.py", 1, msg, args, None)


def test_a_streak_of_failed_attempts_is_said_once_then_at_most_once_a_period() -> None:
    clock = [100.0]
    once = PoolFailuresOnce(every=30.0, clock=lambda: clock[0])
    failed = "error connecting in %r: %s"
    first = _record(failed, POOL_NAME, "connection refused")
    assert once.filter(first)
    for _ in range(20):
        clock[0] += 1.0
        assert not once.filter(_record(failed, POOL_NAME, "connection refused"))
    clock[0] += 10.0  # 30 s after the first line
    again = _record(failed, POOL_NAME, "connection refused")
    assert once.filter(again)
    assert "20 more attempts failed since the last such line" in again.getMessage()


def test_a_connection_made_ends_the_streak() -> None:
    clock = [0.0]
    once = PoolFailuresOnce(every=30.0, clock=lambda: clock[0])
    failed = "error connecting in %r: %s"
    assert once.filter(_record(failed, POOL_NAME, "refused"))
    assert not once.filter(_record(failed, POOL_NAME, "refused"))
    assert once.filter(_record("adding new connection to the pool", level=logging.INFO))
    clock[0] += 1.0
    assert once.filter(_record(failed, POOL_NAME, "refused"))  # a new outage: said at once


def test_other_pools_and_other_lines_pass() -> None:
    once = PoolFailuresOnce(every=30.0, clock=lambda: 0.0)
    failed = "error connecting in %r: %s"
    assert once.filter(_record(failed, "theirs", "refused"))
    assert once.filter(_record(failed, "theirs", "refused"))
    assert once.filter(_record("discarding closed connection: %s", "x"))
    assert once.filter(_record("discarding closed connection: %s", "x"))
