"""Real worker processes behind PgBouncer in transaction mode (docs/operations.md): calls,
sleeps, events and a SIGKILLed worker's runs taken over, with notifications and liveness locks
on ``listen_url``, and without it (polling; leases)."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest

from orchestrator import Orchestrator
from tests.acceptance import flows
from tests.acceptance.conftest import Workers
from tests.pgbouncer import PgBouncer


@dataclass
class Through:
    """How the processes of a test reach the database: ``env`` for the workers, ``client``
    the submitting application of the test process, both through PgBouncer."""

    listen_url: str | None
    env: dict[str, str]
    client: Orchestrator


@pytest.fixture(params=["listen_url", "polling"])
def through(request: pytest.FixtureRequest, pgbouncer: PgBouncer,
            migrated_database_url: str) -> Iterator[Through]:
    pooled = pgbouncer.url(migrated_database_url)
    listen_url = migrated_database_url if request.param == "listen_url" else None
    env = {"ORCHESTRATOR_DATABASE_URL": pooled, "ORCHESTRATOR_POOLER": "transaction",
           "ORCHESTRATOR_LISTEN_URL": listen_url or ""}
    client = Orchestrator(pooled, pooler="transaction", listen_url=listen_url,
                          default_owner=flows.app.default_owner)
    client.registry = flows.app.registry
    yield Through(listen_url, env, client)
    client.close()


def _once_each(workers: Workers) -> None:
    repeated = workers.sql("SELECT run_id, step, count(*) AS n FROM public.sink_calls "
                           "GROUP BY run_id, step HAVING count(*) > 1")
    assert repeated == [], "a recorded call ran again"


def test_calls_sleeps_and_events_through_the_pooler(workers: Workers, through: Through) -> None:
    workers.start("a", **through.env)
    workers.start("b", **through.env)
    client = through.client
    parked = [client.submit(flows.sleeps_and_waits, {"sleep": 0.3}) for _ in range(6)]
    plain = [client.submit(flows.three_steps, {}) for _ in range(20)]
    for handle in parked:  # woken by its timer, then parked on its event: wake it with one
        workers.wait(lambda h=handle: workers.sql(
            "SELECT 1 FROM orchestrator.runs r JOIN orchestrator.journal j ON j.run_id = r.id "
            "WHERE r.id = %s AND r.status = 'waiting' AND j.kind = 'event.wait'", (h.id,)),
            "the run to wait for its event")
        assert client.send_event(handle.id, "go", {"from": "test"})
    for handle in parked:
        first, event, second = handle.result(timeout=60)
        assert (first["step"], event, second["step"]) == (1, {"from": "test"}, 2)
    for handle in plain:
        assert [r["step"] for r in handle.result(timeout=60)] == [1, 2, 3]
    _once_each(workers)
    registered = workers.sql("SELECT lock_key FROM orchestrator.workers")
    assert len(registered) == 2
    # A liveness lock only where it can live: on listen_url's direct session.
    assert all((w["lock_key"] is not None) == (through.listen_url is not None)
               for w in registered)


def test_a_killed_workers_runs_are_taken_over_through_the_pooler(
        workers: Workers, through: Through) -> None:
    # With listen_url a dead worker's lock goes with its process: its runs are taken over at
    # once, long before a 60 s lease would let them. Without it they wait for their leases.
    ttl = "60" if through.listen_url is not None else "3"
    a = workers.start("a", ACCEPTANCE_TOOL_DELAY="60", ACCEPTANCE_LEASE_TTL=ttl,
                      **through.env)
    run = through.client.submit(flows.two_steps, {})
    workers.wait(lambda: workers.sql("SELECT 1 FROM public.sink_calls WHERE step = 2"),
                 "step 2 to start in worker A")
    workers.start("b", ACCEPTANCE_LEASE_TTL=ttl, **through.env)
    a.send_signal(signal.SIGKILL)
    a.wait()
    killed = time.monotonic()
    result = through.client.get_run(run.id).result(timeout=40)
    assert [r["step"] for r in result] == [1, 2]
    assert time.monotonic() - killed < 20
    calls = workers.sql("SELECT step, pid FROM public.sink_calls ORDER BY id")
    assert [c["step"] for c in calls] == [1, 2, 2]  # step 2 re-sent (idempotent), 1 not rerun
    assert calls[0]["pid"] == calls[1]["pid"] == a.pid
    effects = workers.sql("SELECT step FROM public.sink_effects ORDER BY step")
    assert [e["step"] for e in effects] == [1, 2]
