"""Workers on many hosts: K=3 drains with one worker in each of 1, 2 and 4 network namespaces
(tests/hosts/net.py) against one private cluster that listens on every host's link.

Each worker runs under ``ip netns exec`` and reaches the server at its own host's address
over a veth pair; the driver submits, holds, releases and polls over 127.0.0.1 as in
:func:`bench.ours.throughput_once`. The server's CPU per step is measured as there (the
children of its postmaster), and so is the workers'. A drain with the workers in the root
namespace over loopback is measured beside them, so that what the veth links cost is seen.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

from bench.common import CpuMeter, Proc, log, migrate, spawn
from bench.ours import (
    Setup,
    cpu_per_step,
    drain,
    hold,
    submit_many,
    wait_registered,
    worker_args,
)
from tests import dbtools
from tests.hosts.net import Hosts, cluster_for, host_url, unavailable

__all__ = ["HostsBench", "unavailable"]


class HostsBench:
    """``count`` hosts and a cluster reachable from all of them, for several drains."""

    def __init__(self, count: int) -> None:
        self.count = count
        self.hosts: Hosts | None = None
        self.admin_url = ""
        self._stack = contextlib.ExitStack()

    def __enter__(self) -> HostsBench:
        try:
            self.hosts = self._stack.enter_context(Hosts(self.count))
            cluster = self._stack.enter_context(cluster_for(self.hosts))
        except BaseException:
            self._stack.close()
            raise
        self.admin_url = cluster.admin_url
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @contextlib.contextmanager
    def database(self) -> Iterator[str]:
        name = dbtools.unique_name("benchhosts")
        url = dbtools.create_database(self.admin_url, name)
        try:
            migrate(url)
            yield url
        finally:
            dbtools.drop_database(self.admin_url, name)

    async def _start(self, url: str, setup: Setup, namespaces: int) -> list[Proc]:
        assert self.hosts is not None
        procs = []
        for i in range(setup.workers):
            args = worker_args(setup.concurrency)
            env = {"ORCHESTRATOR_DATABASE_URL": url, "BENCH_POOL_SIZE": str(setup.pool_size)}
            if namespaces:
                host = self.hosts.hosts[i % namespaces]
                args = [*host.prefix(), *args]
                env["ORCHESTRATOR_DATABASE_URL"] = host_url(url, host.db_server)
            procs.append(await spawn(args, name=f"worker-{i}", env=env))
        return procs

    async def drain_once(self, *, k: int, n: int, namespaces: int, setup: Setup,
                         timeout: float = 600.0) -> dict[str, Any]:
        """Drain ``n`` held runs of K steps with ``setup.workers`` workers spread over
        ``namespaces`` hosts (0: the root namespace, over loopback)."""
        with self.database() as url:
            ids = await submit_many(url, f"k{k}", n)
            await hold(url, ids)
            procs = await self._start(url, setup, namespaces)
            try:
                await wait_registered(url, [p.pid for p in procs], procs)
                meter = CpuMeter()
                seconds, statuses = await drain(url, ids, procs, timeout=timeout, meter=meter)
            finally:
                await asyncio.gather(*(p.stop() for p in procs))
        ok = statuses.get("succeeded", 0)
        if ok != n:
            log(f"hosts k={k} namespaces={namespaces}: {n - ok} of {n} runs did not "
                f"succeed: {statuses}")
        return {"k": k, "runs": n, "namespaces": namespaces, "workers": setup.workers,
                "seconds": seconds, "runs_per_s": ok / seconds, "steps_per_s": ok * k / seconds,
                "statuses": statuses, **cpu_per_step(meter, n * k)}
