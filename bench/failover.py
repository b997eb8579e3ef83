"""Failover, measured: ``python -m bench.failover [--reps N] [--modes sync,async]``.

A primary and a streaming standby (two private clusters on loopback, the standby made with
``pg_basebackup -R``; synchronous: named in ``synchronous_standby_names``; asynchronous: not),
two worker processes and a reconciler started once with the multi-host URL
(``…@127.0.0.1:P1,127.0.0.1:P2/db?target_session_attrs=read-write``), runs of three calls
(``pay``, a 0.3 s durable sleep, ``ship``, ``notify``) submitted at a steady rate; two seconds
in, every process of the primary is SIGKILLed and the standby promoted at once with ``pg_ctl
promote`` (no failover manager's detection delay is added). Printed per mode, median of the
repetitions:

- promote: seconds from the kill until the standby accepts writes;
- first step: seconds from the kill to the first journal entry committed on the new primary;
- in flight again: seconds from the kill until every run that was running at the kill (as the
  promoted standby has it) has a journal entry on the new primary: all of them moving again;
- lost / repeated: acknowledged runs missing after the failover, and consequential effects
  applied more than once at the provider (both 0 with a synchronous standby; an asynchronous
  one may lose the last commits, see docs/operations.md).

The harness is the failover tests' own (``tests/failover``), run from the repository root.
Figures are appended to ``bench/results/results.jsonl`` as section ``failover``.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import Server, Table, append_result, machine_info, median
from tests.chaos import sink
from tests.failover import app as failover_app
from tests.failover.pair import ReplicatedPair, unavailable_reason
from tests.failover.scenario import Scenario, environment, last_replicated, timings

KILL_AFTER = 2.0


def once(admin_url: str, *, synchronous: bool, rate: float, duration: float
         ) -> dict[str, Any]:
    with environment(admin_url, synchronous=synchronous) as (pair, sink_url), \
            tempfile.TemporaryDirectory(prefix="bench-failover-") as logs:
        scenario = Scenario(pair, sink_url, Path(logs))
        try:
            scenario.start(workers=2)
            acked: dict[str, uuid.UUID] = {}
            before: set[uuid.UUID] = set()

            def submit() -> None:
                for i in range(int(rate * duration)):
                    acked[f"r{i}"] = scenario.submit(failover_app.order, {"n": i}, f"r{i}")
                    time.sleep(1 / rate)

            thread = threading.Thread(target=submit)
            thread.start()
            time.sleep(KILL_AFTER)
            before = set(acked.values())
            killed_at = pair.kill_primary()
            promote = pair.promote()
            replicated = last_replicated(pair)
            in_flight = [r["id"] for r in ReplicatedPair.query(
                pair.standby, "SELECT id FROM orchestrator.runs WHERE status = 'running'",
                database="orchestrator")]
            thread.join(180)
            present = scenario.statuses(list(acked.values()))
            scenario.wait_finished(list(present), timeout=180)
            measured = timings(scenario, killed_at, in_flight, replicated)
            effects = Counter((e["run_id"], e["tool"]) for e in sink.load(sink_url)["effects"]
                              if e["tool"] in ("pay", "ship"))
            return {"promote": promote, **measured,
                    "acknowledged_before_kill": len(before),
                    "lost": sum(1 for run in acked.values() if run not in present),
                    "repeated": sum(n - 1 for n in effects.values() if n > 1),
                    "workers_restarted": sum(1 for ok in scenario.alive().values() if not ok)}
        finally:
            scenario.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--modes", default="sync,async")
    parser.add_argument("--rate", type=float, default=20.0, help="runs submitted per second")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds of submission")
    args = parser.parse_args(argv)
    logging.getLogger("psycopg.pool").setLevel(logging.CRITICAL)  # the outage, as expected
    reason = unavailable_reason()
    if reason is not None:
        print(f"failover: skipped: {reason}")
        return 0
    server = Server.find()
    table, results = measure(server.admin_url, modes=args.modes, reps=args.reps,
                             rate=args.rate, duration=args.duration)
    table.print()
    append_result("failover", {"results": results, "rate": args.rate,
                               "duration": args.duration}, {"machine": machine_info(server)})
    return 0


def measure(admin_url: str, *, modes: str = "sync,async", reps: int = 3, rate: float = 20.0,
            duration: float = 5.0) -> tuple[Table, dict[str, list[dict[str, Any]]]]:
    """The failover table (``modes``: ``sync``, ``async`` or both, each repeated ``reps``
    times) and every repetition's figures; blocking. ``bench.run --sections hosts`` prints it
    too, after the hosts' scaling and the pooler's comparison."""
    table = Table(f"failover: primary SIGKILLed {KILL_AFTER:g} s into a load of "
                  f"{rate:g} runs/s (K = 3), standby promoted at once; seconds from the kill",
                  ["standby", "promote", "first step", "in flight again", "in flight",
                   "lost", "repeated", "workers restarted"])
    results: dict[str, list[dict[str, Any]]] = {}
    for mode in [m.strip() for m in modes.split(",") if m.strip()]:
        done = [once(admin_url, synchronous=mode == "sync", rate=rate, duration=duration)
                for _ in range(reps)]
        results[mode] = done

        def med(key: str, done: list[dict[str, Any]] = done) -> float | None:
            values = [r[key] for r in done if r[key] is not None]
            return median(values) if values else None

        table.add("synchronous" if mode == "sync" else "asynchronous",
                  f"{med('promote'):.2f}", f"{med('first_step'):.2f}",
                  f"{med('all_in_flight_again'):.2f}", f"{med('in_flight'):.0f}",
                  str(sum(r["lost"] for r in done)), str(sum(r["repeated"] for r in done)),
                  str(sum(r["workers_restarted"] for r in done)))
    table.notes.append(f"median of {reps}; lost, repeated and restarted are totals over "
                       "the repetitions; the lease is 3 s")
    return table, results


if __name__ == "__main__":
    raise SystemExit(main())
