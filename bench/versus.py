"""Engines against each other, interleaved: the same K-step drain on each committed revision
named, one after the other in every round (the order alternating), each compared with the
first engine's drain of the same round.

    python -m bench.versus e51559e HEAD:k3q --runs 15000 --rounds 8

An engine is ``REF`` or ``REF:WORKFLOW`` (a workflow of bench/app.py with K steps: ``k3``,
``k3q`` for the same in a queue whose limit never binds, ...; default ``k{K}``). Each drain runs
in its own process on the engine's snapshot (bench.common.snapshot_engine), on a fresh
database, with 2 workers × 32 (``--workers``, ``--concurrency``). The table prints each
engine's median steps/s and the median over rounds of its drain ÷ the first engine's drain
of the same round: what a change costs, with the machine's drift shared by both sides.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import Any

from bench.common import Table, fx, log, median, run_in_snapshot, snapshot_engine


def _arm(text: str, k: int) -> tuple[str, str]:
    ref, _, workflow = text.partition(":")
    return ref, workflow or f"k{k}"


def _drain_in(folder: str, sha: str, args: argparse.Namespace, workflow: str) -> dict[str, Any]:
    return run_in_snapshot(folder, sha, "bench.versus", [
        "--one", workflow, "--k", str(args.k), "--runs", str(args.runs),
        "--workers", str(args.workers), "--concurrency", str(args.concurrency)], "a drain")


async def _one(args: argparse.Namespace) -> None:
    from bench import ours
    from bench.common import Server

    setup = ours.Setup(workers=args.workers, concurrency=args.concurrency, pool_size=16)
    r = await ours.throughput_once(Server.find(None), k=args.k, n=args.runs, setup=setup,
                                   workflow=args.one)
    print(json.dumps({key: r.get(key) for key in (
        "steps_per_s", "worker_cpu_us_per_step", "server_cpu_us_per_step",
        "worker_sys_us_per_step", "server_sys_us_per_step", "machine_busy")}))


def _paired(found: list[dict[str, Any]], base: list[dict[str, Any]], key: str) -> str:
    """The median over rounds of ``key`` ÷ the baseline's in the same round."""
    ratios = [d[key] / b[key] for d, b in zip(found, base, strict=True) if d[key] and b[key]]
    return fx(median(ratios)) if ratios else "—"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.versus", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("engines", nargs="*", metavar="REF[:WORKFLOW]",
                        help="the first is the baseline (default: HEAD~1 HEAD)")
    parser.add_argument("--k", type=int, default=3, help="steps per run (default 3)")
    parser.add_argument("--runs", type=int, default=15_000, help="runs per drain")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # one drain, in a snapshot
    args = parser.parse_args(argv)
    if args.one:
        asyncio.run(_one(args))
        return 0
    texts = args.engines or ["HEAD~1", "HEAD"]
    if len(texts) < 2:
        parser.error("name at least two engines")
    arms = [_arm(t, args.k) for t in texts]
    snapshots = {ref: snapshot_engine(ref) for ref, _ in arms}
    drains: list[list[dict[str, Any]]] = [[] for _ in arms]
    for i in range(args.rounds):
        order = list(range(len(arms))) if i % 2 == 0 else list(reversed(range(len(arms))))
        for a in order:
            ref, workflow = arms[a]
            folder, sha = snapshots[ref]
            log(f"round {i + 1}/{args.rounds}: {ref} ({sha[:10]}) {workflow}")
            drains[a].append(_drain_in(str(folder), sha, args, workflow))
    table = Table(f"versus: K={args.k} drains of {args.runs:,} runs, {args.workers} workers × "
                  f"concurrency {args.concurrency}, {args.rounds} rounds interleaved",
                  ["engine", "commit", "steps/s", "min–max", "÷ first (paired median)",
                   "paired ratios", "worker µs/step", "of it system", "÷ first",
                   "server µs/step", "of it system", "÷ first"])
    base = [d["steps_per_s"] for d in drains[0]]
    for (ref, workflow), found in zip(arms, drains, strict=True):
        steps = [d["steps_per_s"] for d in found]
        ratios = [s / b for s, b in zip(steps, base, strict=True)]
        first = found is drains[0]
        table.add(f"{ref}:{workflow}", snapshots[ref][1][:10], median(steps),
                  f"{min(steps):,.0f}–{max(steps):,.0f}",
                  "—" if first else fx(median(ratios)),
                  "" if first else ", ".join(f"{r:.2f}" for r in ratios),
                  median([d["worker_cpu_us_per_step"] or 0 for d in found]),
                  median([d.get("worker_sys_us_per_step") or 0 for d in found]),
                  "—" if first else _paired(found, drains[0], "worker_cpu_us_per_step"),
                  median([d["server_cpu_us_per_step"] or 0 for d in found]),
                  median([d.get("server_sys_us_per_step") or 0 for d in found]),
                  "—" if first else _paired(found, drains[0], "server_cpu_us_per_step"))
    table.notes.append("each drain on a fresh database, the engines' order alternating by "
                       "round; CPU per step: user + system time of the workers and of the "
                       "server's processes during the drain, and the system (kernel) part of "
                       "it (on loopback TCP a send() does the receiving side's work as well); "
                       "÷ first: the median over rounds of the CPU per step ÷ the first "
                       "engine's in the same round")
    table.print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
