"""Through PgBouncer in transaction mode against direct (docs/operations.md, "Behind a
connection pooler"): K=3 drains and idle first-step latency, three arms in every repetition,
their order turning round from one repetition to the next:

- ``direct``: the workers on the server itself;
- ``listen_url``: the workers through PgBouncer (``pooler="transaction"``), notifications and
  liveness locks on a direct connection;
- ``polling``: through PgBouncer with no direct connection at all (the workers poll every
  second).

PgBouncer is Debian's, started as the tests start it (``tests/pgbouncer.py``) with as many
server sessions per database as one worker's pool. The driver submits, holds and releases on
the server directly in every arm (it is not what is measured).
"""

from __future__ import annotations

from dataclasses import replace
from statistics import median
from typing import Any

from bench import ours
from bench.common import Server, log, migrate

ARMS = ("direct", "listen_url", "polling")


def _env(arm: str, pooled: str, direct: str) -> dict[str, str]:
    if arm == "direct":
        return {}
    return {"ORCHESTRATOR_DATABASE_URL": pooled, "ORCHESTRATOR_POOLER": "transaction",
            "ORCHESTRATOR_LISTEN_URL": direct if arm == "listen_url" else ""}


async def measure(server: Server, *, runs: int, setup: ours.Setup, samples: int,
                  reps: int) -> dict[str, Any]:
    """Per arm: the drains' steps/s and the latency samples' percentiles (medians over
    ``reps``), and the ratio of each arm's steps/s to direct's, paired by repetition."""
    from tests import pgbouncer  # the launcher the tests use; the checkout's, not installed

    if pgbouncer.binary() is None:
        raise RuntimeError("pgbouncer is not installed (apt-get install pgbouncer)")
    drains: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    latency: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    with pgbouncer.running(server.admin_url, pool_size=setup.pool_size) as bouncer:
        for rep in range(reps):
            order = ARMS if rep % 2 == 0 else tuple(reversed(ARMS))
            for arm in order:
                log(f"pooler: {arm}, repetition {rep + 1}/{reps}")
                with server.database("pool") as url:
                    migrate(url)
                    arm_setup = replace(setup, env=_env(arm, bouncer.url(url), url))
                    drains[arm].append(await ours.throughput_once(
                        server, k=3, n=runs, setup=arm_setup, url=url))
                with server.database("poollat") as url:
                    migrate(url)
                    idle = ours.Setup(workers=1, concurrency=10, pool_size=4,
                                      env=_env(arm, bouncer.url(url), url))
                    latency[arm].append(await ours.latency_once(
                        server, samples=samples, url=url, setup=idle))
    out: dict[str, Any] = {}
    for arm in ARMS:
        paired = [r["steps_per_s"] / d["steps_per_s"]
                  for r, d in zip(drains[arm], drains["direct"], strict=True)]
        out[arm] = {
            "steps_per_s": median(r["steps_per_s"] for r in drains[arm]),
            "ratio_to_direct": median(paired),
            **{key: median(r[key] for r in latency[arm])
               for key in ("first_step_p50", "first_step_p99", "result_p50", "result_p99")},
            "drains": drains[arm], "latency": latency[arm]}
    return out
