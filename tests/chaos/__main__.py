"""``python -m tests.chaos``: the chaos harness from the command line (the long profile).

Example: ``python -m tests.chaos --runs 10000 --fault-interval 0.3 --seed 42``. Prints the
seed first and the invariant table at the end; exits 1 if any invariant broke.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
import tempfile
from pathlib import Path

from tests import dbtools
from tests.chaos import engine, environment
from tests.chaos.harness import Config, Harness


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.chaos", description=__doc__)
    parser.add_argument("--runs", type=int, default=1000, help="runs to submit (default 1000)")
    parser.add_argument("--duration", type=float, default=None,
                        help="seconds the fault phase lasts at least; submissions are spread "
                             "over it (default: as fast as the in-flight cap allows)")
    parser.add_argument("--seed", type=int, default=None, help="default: a random one, printed")
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--concurrency", type=int, default=8, help="runs per worker")
    parser.add_argument("--fault-interval", type=float, default=0.3,
                        help="mean seconds between faults (default 0.3)")
    parser.add_argument("--lease-ttl", type=float, default=3.0)
    parser.add_argument("--poison-runs", type=int, default=10,
                        help="runs planted with input no worker can decode, spread among the "
                             "others (default 10): each must fail alone, no worker may die")
    parser.add_argument("--max-in-flight", type=int, default=80)
    parser.add_argument("--no-postgres-restarts", action="store_true",
                        help="no private cluster: everything on the test server, no restarts")
    parser.add_argument("--unsafe-redispatch", action="store_true",
                        help="start workers with the test-only switch that disables the "
                             "no-redispatch guard (the harness must then report duplicates)")
    parser.add_argument("--log-dir", type=Path, default=None)
    parser.add_argument("--keep", action="store_true", help="keep the databases afterwards")
    parser.add_argument("--engine", metavar="REF", default=None,
                        help="run against this committed revision of orchestrator/ (exported "
                             "with git archive) instead of the work tree")
    args = parser.parse_args(argv)
    # The harness's own pool reconnects through every outage it causes; say so once, not
    # for every attempt.
    logging.getLogger("psycopg.pool").setLevel(logging.CRITICAL)
    if args.engine and not os.environ.get("CHAOS_ENGINE_DIR"):
        rest = list(sys.argv[1:] if argv is None else argv)
        at = rest.index("--engine") if "--engine" in rest else None
        if at is not None:
            del rest[at:at + 2]
        else:
            rest = [a for a in rest if not a.startswith("--engine=")]
        engine.reexec_with(args.engine, rest)
    import orchestrator

    print(f"chaos: engine from {Path(orchestrator.__file__).parent}"
          + (f" (commit {os.environ['CHAOS_ENGINE_COMMIT']})"
             if os.environ.get("CHAOS_ENGINE_COMMIT") else " (the work tree)"), flush=True)
    cfg = Config(runs=args.runs, seed=args.seed, workers=args.workers,
                 concurrency=args.concurrency, fault_interval=args.fault_interval,
                 duration=args.duration, lease_ttl=args.lease_ttl,
                 max_in_flight=args.max_in_flight, unsafe_redispatch=args.unsafe_redispatch,
                 poison_runs=args.poison_runs)
    seed = cfg.resolved_seed()
    print(f"chaos seed: {seed}", flush=True)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix=f"chaos-{seed}-"))
    admin_url = dbtools.choose_server().admin_url
    restarts = not args.no_postgres_restarts
    with environment.private_cluster(restarts, args.keep) as (cluster, template):
        if cluster is None and not args.no_postgres_restarts:
            print("chaos: no PostgreSQL binaries found; running without server restarts")
        with environment.databases(admin_url, cluster, template, keep=args.keep) as env:
            harness = Harness(cfg, db_url=env.db_url, sink_url=env.sink_url, log_dir=log_dir,
                              cluster=env.cluster, out=lambda s: print(s, flush=True))
            result = asyncio.run(harness.run())
            if args.keep:
                print(f"kept: orchestrator {env.db_url}, sink {env.sink_url}"
                      + (f", cluster {cluster.root} (stop: pg_ctl -D {cluster.data} stop)"
                         if cluster else ""))
    return 0 if result.ok else 1


if __name__ == "__main__":
    sys.exit(main())
