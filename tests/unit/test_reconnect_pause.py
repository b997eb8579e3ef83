"""The connection pool's pause between attempts to connect after an outage
(orchestrator/db/database.py, RECONNECT_PAUSE)."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import psycopg_pool

from orchestrator.db.database import RECONNECT_PAUSE, _Reconnecting


def test_the_pause_between_attempts_to_connect_stays_about_a_second() -> None:
    # psycopg_pool doubles it from one second without a bound (1, 2, 4, 8 s …).
    attempt = _Reconnecting(timeout=300.0)
    pauses = []
    for now in range(10):
        attempt.update_delay(float(now))
        pauses.append(attempt.delay)
    assert all(0.0 < pause <= RECONNECT_PAUSE * 1.1 for pause in pauses), pauses
    # It still gives up after the pool's reconnect_timeout, counted from its first failure.
    assert not attempt.time_to_give_up(299.0)
    assert attempt.time_to_give_up(300.0)


def test_the_psycopg_pool_floor_has_what_the_pool_uses() -> None:
    # AsyncConnectionPool.drain() came in psycopg_pool 3.3; AttemptWithBackoff is named
    # ConnectionAttempt in 3.2.0, whose import would stop `import orchestrator`.
    project = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    floor = next(re.fullmatch(r"psycopg-pool>=(\d+)\.(\d+)(?:\.\d+)?", dep)
                 for dep in project["project"]["dependencies"] if dep.startswith("psycopg-pool"))
    assert floor is not None
    assert (int(floor[1]), int(floor[2])) >= (3, 3)
    assert hasattr(psycopg_pool.AsyncConnectionPool, "drain")
