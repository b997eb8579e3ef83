"""Where a chaos run's databases live.

The orchestrator's database goes on a private cluster the harness starts (so that it may
restart it); the effect sink goes on the ordinary test server (``tests.dbtools``), which the
harness never restarts, so the "provider" stays up while the orchestrator's database does not.
Without PostgreSQL binaries, both go on the test server and server restarts are left out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

from orchestrator.db import migrate
from orchestrator.db.config import DatabaseTarget, validate_url
from tests import dbtools
from tests.chaos.cluster import PrivateCluster, start_private_cluster


@dataclass
class Environment:
    db_url: str
    sink_url: str
    cluster: PrivateCluster | None


def migrate_to_head(url: str) -> None:
    status = migrate.upgrade(DatabaseTarget(validate_url(url), "argument"))
    assert status.ok, status.describe()


@contextlib.contextmanager
def private_cluster(enabled: bool = True, keep: bool = False
                    ) -> Iterator[tuple[PrivateCluster | None, str | None]]:
    """A started private cluster with a migrated template database (its name), or
    (None, None) when disabled or no binaries are available. ``keep`` leaves it running."""
    cluster = start_private_cluster() if enabled else None
    if cluster is None:
        yield None, None
        return
    try:
        template = dbtools.unique_name("chaostpl")
        migrate_to_head(dbtools.create_database(cluster.admin_url, template))
        yield cluster, template
    finally:
        if not keep:
            cluster.destroy()


@contextlib.contextmanager
def databases(admin_url: str, cluster: PrivateCluster | None, template: str | None,
              keep: bool = False) -> Iterator[Environment]:
    """A fresh orchestrator database (on the cluster if there is one) and a fresh sink."""
    created: list[tuple[str, str]] = []
    try:
        if cluster is not None and template is not None:
            name = dbtools.unique_name("chaos")
            db_url = dbtools.create_database(cluster.admin_url, name, template=template)
            created.append((cluster.admin_url, name))
        else:
            name = dbtools.unique_name("chaos")
            db_url = dbtools.create_database(admin_url, name)
            created.append((admin_url, name))
            migrate_to_head(db_url)
        sink_name = dbtools.unique_name("chaossink")
        sink_url = dbtools.create_database(admin_url, sink_name)
        created.append((admin_url, sink_name))
        yield Environment(db_url, sink_url, cluster)
    finally:
        if not keep:
            for server, name in created:
                with contextlib.suppress(Exception):
                    dbtools.drop_database(server, name)
