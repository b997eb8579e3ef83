"""The chaos suite's short profile (CONTRACT C5-C8 under faults), its self-test, and the long
profile (skipped unless selected; ``make chaos`` runs it from the command line).

Each profile run starts real workers and a reconciler, submits a mix of workflows, injects
faults at random from a printed seed, lets the system quiesce and fails if any invariant of the
printed table broke. Re-run a failure with ``python -m tests.chaos --seed SEED --runs N``.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests import dbtools, pgbouncer
from tests.chaos.conftest import run_chaos
from tests.chaos.environment import Environment, migrate_to_head
from tests.chaos.harness import Config
from tests.chaos.limits import LimitsConfig, run_profile

pytestmark = pytest.mark.chaos

FIXED_SEED = 20261129
SHORT = {"runs": 150, "workers": 3, "fault_interval": 0.5, "quiesce_timeout": 120.0,
         "max_tail": 60.0, "poison_runs": 3}


@pytest.mark.timeout(600)
def test_short_profile_with_the_fixed_seed(chaos_env: Environment, tmp_path: Path) -> None:
    result = run_chaos(Config(seed=FIXED_SEED, **SHORT), chaos_env, tmp_path / "logs")
    assert result.ok, result.text


@pytest.mark.timeout(600)
def test_short_profile_with_a_random_seed(chaos_env: Environment, tmp_path: Path) -> None:
    result = run_chaos(Config(seed=None, **SHORT), chaos_env, tmp_path / "logs")
    assert result.ok, result.text


@pytest.mark.timeout(600)
@pytest.mark.parametrize("listen", [True, False], ids=["listen_url", "polling"])
def test_short_profile_through_pgbouncer(chaos_env: Environment, tmp_path: Path,
                                         listen: bool) -> None:
    """The workers and reconcilers reach the database through PgBouncer in transaction mode
    (docs/operations.md), with notifications and liveness locks on a direct listen_url or with
    neither; backends are terminated and the server restarted under them as usual."""
    if pgbouncer.binary() is None:
        pytest.skip("pgbouncer is not installed and could not be (apt-get install pgbouncer)")
    with pgbouncer.running(chaos_env.db_url, pool_size=8) as bouncer:
        through = {"ORCHESTRATOR_DATABASE_URL": bouncer.url(chaos_env.db_url),
                   "ORCHESTRATOR_POOLER": "transaction",
                   "ORCHESTRATOR_LISTEN_URL": chaos_env.db_url if listen else ""}
        result = run_chaos(Config(seed=FIXED_SEED, **SHORT, process_env=through), chaos_env,
                           tmp_path / "logs")
    assert result.ok, result.text


@pytest.mark.timeout(600)
def test_the_harness_catches_duplicates_when_the_no_redispatch_guard_is_off(
        chaos_env: Environment, tmp_path: Path) -> None:
    """With ORCHESTRATOR_TEST_UNSAFE_REDISPATCH=1 a worker that finds a consequential call
    ``submitted`` without an outcome sends it again. Workers here die right after such a tool
    returned; the sink must show the second application and the verdict must be FAIL.
    A fault here replaces a worker with an armed one, which must then claim a run and reach
    the point: the runs are submitted over 20 s (``duration``), so that some arrive after
    armed workers are up, and one fault every 1.5 s leaves an armed worker (its start takes
    1.2-1.5 s) about 4.5 s before it is replaced in turn. With the 40 runs submitted at once
    and a fault every 0.4 s, fast workers had finished them all before an armed one claimed
    any, or armed ones were replaced before they could (81 replacements, none died)."""
    cfg = Config(seed=FIXED_SEED, runs=40, workers=3, fault_interval=1.5, duration=20.0,
                 unsafe_redispatch=True, tool_fault_rate=0.0, cancel_rate=0.0,
                 workflows={"checkout": 1}, fault_weights={"worker_fault_point": 1},
                 fault_points=("after_tool_return",), fault_tools=("pay",),
                 quiesce_timeout=90.0, max_tail=30.0)
    result = run_chaos(cfg, chaos_env, tmp_path / "logs")
    duplicates = result.first_verdict.row("duplicate consequential effects")
    assert result.faults["worker died at a fault point"] > 0, result.text
    assert duplicates.value > 0, result.text
    assert not result.ok
    assert "verdict: FAIL" in result.text


@pytest.mark.timeout(600)
def test_limits_profile_holds_every_limit_while_workers_die(pg_admin_url: str,
                                                             tmp_path: Path) -> None:
    """Queue and tool limits under worker kills and pauses, measured by the sink
    (tests/chaos/limits.py); ``python -m tests.chaos.limits`` runs it at full size."""
    import asyncio

    names = [dbtools.unique_name("limits"), dbtools.unique_name("limitssink")]
    db_url, sink_url = (dbtools.create_database(pg_admin_url, n) for n in names)
    try:
        migrate_to_head(db_url)
        result = asyncio.run(run_profile(LimitsConfig(seed=FIXED_SEED, fault_interval=0.8)
                                         .scaled(0.5), db_url=db_url, sink_url=sink_url,
                                         log_dir=tmp_path / "logs"))
    finally:
        for name in names:
            dbtools.drop_database(pg_admin_url, name)
    assert result.ok, result.text
    assert sum(result.faults.values()) > 0, result.text


@pytest.mark.chaos_long
@pytest.mark.timeout(0)
def test_long_profile(chaos_env: Environment, tmp_path: Path) -> None:
    """Thousands of runs; configure with CHAOS_RUNS, CHAOS_DURATION, CHAOS_SEED,
    CHAOS_FAULT_INTERVAL and CHAOS_WORKERS."""
    env = os.environ
    cfg = Config(runs=int(env.get("CHAOS_RUNS", "2000")),
                 duration=float(env["CHAOS_DURATION"]) if env.get("CHAOS_DURATION") else None,
                 seed=int(env["CHAOS_SEED"]) if env.get("CHAOS_SEED") else None,
                 fault_interval=float(env.get("CHAOS_FAULT_INTERVAL", "0.3")),
                 workers=int(env.get("CHAOS_WORKERS", "3")),
                 poison_runs=int(env.get("CHAOS_POISON_RUNS", "10")))
    result = run_chaos(cfg, chaos_env, tmp_path / "logs")
    assert result.ok, result.text
