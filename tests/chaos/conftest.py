"""Fixtures for the chaos suite.

One private PostgreSQL cluster per test session (the harness restarts it; it never restarts a
server it did not start), with a migrated template database; each test gets a fresh
orchestrator database cloned from it and a fresh effect sink on the ordinary test server.

The long profile (marked ``chaos_long``) is skipped unless selected with ``-m chaos_long``;
``make chaos`` runs it from the command line instead (``python -m tests.chaos``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.chaos import environment
from tests.chaos.cluster import PrivateCluster
from tests.chaos.harness import Config, Harness, Result


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if "chaos_long" in (config.getoption("-m") or ""):
        return
    skip = pytest.mark.skip(reason="the long chaos profile: `make chaos` or -m chaos_long")
    for item in items:
        if item.get_closest_marker("chaos_long") is not None:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def chaos_cluster() -> Iterator[tuple[PrivateCluster | None, str | None]]:
    with environment.private_cluster() as found:
        yield found


@pytest.fixture
def chaos_env(pg_admin_url: str, chaos_cluster: tuple[PrivateCluster | None, str | None]
              ) -> Iterator[environment.Environment]:
    cluster, template = chaos_cluster
    with environment.databases(pg_admin_url, cluster, template) as env:
        yield env


def run_chaos(cfg: Config, env: environment.Environment, log_dir: Path) -> Result:
    """Run the harness once; the report is printed (``pytest -s`` shows it as it goes)."""
    harness = Harness(cfg, db_url=env.db_url, sink_url=env.sink_url, log_dir=log_dir,
                      cluster=env.cluster, out=lambda line: print(line, flush=True))
    return asyncio.run(harness.run())
