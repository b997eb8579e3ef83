"""``orchestrator prune`` and ``orchestrator evidence export``: retention (docs/retention.md).

``prune`` deletes the journals, events, inputs and results of runs finished longer ago than a
period, in batches of one short transaction each, showing its progress; then, as the migration
role, the evidence past its own period. ``evidence export`` writes the evidence as JSON lines
for an archive, before it is deleted.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

from orchestrator import retention
from orchestrator.cli import records
from orchestrator.cli.common import database_target, json_option, parse_time
from orchestrator.cli.options import number, whole
from orchestrator.cli.worker import load_app
from orchestrator.db.database import Database
from orchestrator.errors import InvalidRequest
from orchestrator.retention import Pruner, PruneReport, Retention, parse_period


def register(subparsers: Any) -> None:
    prune = subparsers.add_parser(
        "prune", help="delete finished runs' journals past their retention, then old evidence",
        description="Prune runs finished longer ago than --older-than (or the --app's "
        "retention, with its per-workflow periods): their journals, events, inputs and results "
        "are deleted in batches of one short transaction each; each run's row stays as a "
        "tombstone, so its submission key still answers with it. A run with an operation "
        "without an outcome, an unresolved reconciliation item, or an unfinished parent or "
        "child is never pruned. Then, if the database role may (the migration role), the "
        "evidence (operations, reconciliation items and lookups, incidents, operator audit) "
        "older than --evidence-older-than is deleted with the tombstones; export it first "
        "with `orchestrator evidence export`.")
    prune.add_argument("--app", metavar="MODULE:ATTR",
                       help="take the periods from this app's Orchestrator(retention=...)")
    prune.add_argument("--older-than", metavar="PERIOD",
                       help="prune runs finished longer ago than this (30d, 12h, 90m, 45s)")
    prune.add_argument("--evidence-older-than", metavar="PERIOD",
                       help="expire evidence of runs finished longer ago than this (default: "
                       "the app's retention.evidence; without either, evidence is kept)")
    prune.add_argument("--batch", type=whole("--batch", low=1, high=retention.MAX_BATCH),
                       default=retention.BATCH, metavar="N",
                       help=f"runs per transaction (default {retention.BATCH})")
    prune.add_argument("--duty", type=number("--duty", "a number more than 0 and at most 1",
                                             lambda share: 0 < share <= 1),
                       default=retention.DUTY, metavar="F",
                       help="the share of the time spent pruning: after each batch it rests "
                       f"so that batches take F of the time (default {retention.DUTY}; 1: no "
                       "rest), leaving the database to the workers")
    prune.add_argument("--dry-run", action="store_true",
                       help="count what would be pruned and expired; change nothing")
    prune.add_argument("--quiet", action="store_true", help="no progress lines on stderr")
    json_option(prune)
    prune.set_defaults(func=cmd_prune, help_parser=prune)

    evidence = subparsers.add_parser("evidence", help="the ledger's evidence, for archives")
    commands = evidence.add_subparsers(title="evidence commands", metavar="COMMAND")
    evidence.set_defaults(func=None, help_parser=evidence)
    export = commands.add_parser(
        "export", help="write the evidence created or changed in a period as JSON lines",
        description="Write every operation (with its run's workflow and submission key, its "
        "intent digest, arguments, idempotency key, state and receipt), reconciliation item, "
        "lookup, operator audit row and incident summary created in [--since, --until) as "
        "JSON lines, one object per row with its kind in `type`; an operation or a "
        "reconciliation item by its last change instead, so that one settled after an "
        "earlier period's export is written again, as it ended. Incident details (upstream "
        "text) are not exported: `orchestrator incidents show` reads them.")
    export.add_argument("--since", required=True, metavar="T",
                        help="ISO 8601 time with its offset, e.g. 2026-01-01T00:00:00Z")
    export.add_argument("--until", metavar="T", help="ISO 8601 time with its offset (default: "
                        "the time the evidence is read, or the start of the oldest "
                        "transaction then open, if earlier; printed, for the next --since)")
    export.add_argument("--output", "-o", metavar="FILE", type=Path,
                        help="write to FILE instead of stdout")
    export.add_argument("--json", action="store_true",
                        help="with --output: print the period and the counts as one JSON "
                        "document (fields: docs/cli-json.md)")
    export.set_defaults(func=cmd_export)


def _retention(args: argparse.Namespace) -> Retention:
    app_retention = None
    if args.app:
        app_retention = load_app(args.app, args.database_url).retention
        if app_retention is None and args.older_than is None:
            raise InvalidRequest(f"{args.app} has no retention: give --older-than, or "
                                 "Orchestrator(retention=Retention(...))", path="older_than")
    elif args.older_than is None:
        raise InvalidRequest("give --older-than PERIOD (e.g. 30d), or --app with a retention",
                             path="older_than")
    runs = (parse_period(args.older_than, "older_than") if args.older_than is not None
            else app_retention.finished_runs if app_retention is not None else timedelta(0))
    evidence = (parse_period(args.evidence_older_than, "evidence_older_than")
                if args.evidence_older_than is not None
                else app_retention.evidence if app_retention is not None else None)
    workflows = dict(app_retention.workflows) if app_retention is not None else {}
    if args.older_than is not None:
        workflows = {}  # the period given here wins for every workflow
    return Retention(finished_runs=runs, evidence=evidence, workflows=workflows)


def _progress(quiet: bool) -> Callable[[PruneReport], None] | None:
    if quiet:
        return None

    def show(report: PruneReport) -> None:
        line = f"prune: {report.runs:,} runs pruned ({report.journal_rows:,} journal rows)"
        if report.schedule_slots:
            line += f"; {report.schedule_slots:,} schedule slot records"
        if report.evidence_checked:
            line += (f"; evidence expired: {report.evidence_runs:,} runs, "
                     f"{report.evidence_operations:,} operations, "
                     f"{report.evidence_audit:,} audit rows")
        print(line, file=sys.stderr, flush=True)

    return show


def cmd_prune(args: argparse.Namespace) -> int:
    rules = _retention(args)
    target = database_target(args)

    async def main() -> PruneReport:
        db = Database(target, max_pool_size=2)
        try:
            pruner = Pruner(db, rules, batch=args.batch, duty=args.duty)
            return await pruner.prune(dry_run=args.dry_run, progress=_progress(args.quiet))
        finally:
            await db.close()

    report = asyncio.run(main())
    if args.json:
        records.emit(report.as_dict())
        return 0
    verb = "would prune" if report.dry_run else "pruned"
    print(f"{verb} {report.runs:,} finished run(s)" + (
        "" if report.dry_run else
        f" ({report.journal_rows:,} journal rows, {report.events:,} events, "
        f"{report.batches} batch(es), {report.seconds:.1f} s)"))
    print(f"{verb} {report.schedule_slots:,} schedule slot record(s) (slots that fired no run "
          "or whose run is pruned)")
    if rules.evidence is None:
        print("evidence: kept (no evidence period given)")
    elif not report.evidence_checked:
        print("evidence: not expired: this database role may not (run `orchestrator prune` "
              "as the migration role; docs/retention.md)")
    else:
        verb = "would expire" if report.dry_run else "expired"
        print(f"evidence {verb}: {report.evidence_runs:,} run(s) with "
              f"{report.evidence_operations:,} operation(s), {report.evidence_audit:,} audit "
              f"row(s), {report.evidence_incidents:,} incident(s)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    since = parse_time(args.since, "since")
    until = parse_time(args.until, "until") if args.until else None
    if args.json and args.output is None:
        raise InvalidRequest("--json prints its document on stdout, where the evidence goes "
                             "without --output: give -o FILE", path="json")
    target = database_target(args)

    def progress(kind: str, written: int) -> None:
        if args.output is not None and not args.json:
            print(f"evidence: {written:,} {kind} row(s)", file=sys.stderr, flush=True)

    async def main(out: TextIO) -> retention.EvidenceExport:
        db = Database(target, max_pool_size=1)
        try:
            return await retention.export_evidence(db, out, since=since, until=until,
                                                   progress=progress)
        finally:
            await db.close()

    if args.output is None:
        done = asyncio.run(main(sys.stdout))
    else:
        with open(args.output, "w", encoding="utf-8") as out:
            done = asyncio.run(main(out))
    if args.json:
        records.emit({**done.as_dict(), "output": str(args.output)})
        return 0
    period = done.as_dict()
    print("evidence: " + ", ".join(f"{n:,} {kind}" for kind, n in done.counts.items())
          + f" written to {args.output or 'stdout'}, created or changed in "
          f"[{period['since']}, {period['until']}); next period: --since {period['until']}",
          file=sys.stderr)
    return 0
