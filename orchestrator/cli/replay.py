"""``orchestrator replay``: check new workflow code against stored journals, offline.

Nothing is dispatched, written or waited for: each run's journal answers the code's commands
(orchestrator.replay). Exit status 0 when every run checked replays, 1 when one does not (a
``NONDETERMINISM``, or a run whose workflow version the code no longer has), 2 on bad usage.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

from orchestrator import replay as checks
from orchestrator.cli import records
from orchestrator.cli.common import database_target, json_option, parse_time
from orchestrator.cli.options import whole
from orchestrator.cli.tables import render
from orchestrator.cli.worker import load_app
from orchestrator.db.database import Database
from orchestrator.errors import InvalidRequest
from orchestrator.models import check_workflow_filter, parse_run_id
from orchestrator.replay import RecordedRun, Verdict

EXIT_DIFFERS = 1
LAST_MAX = 100_000


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "replay", help="check workflow code against stored journals (dispatches nothing)",
        description="Re-execute the workflow code of --app against the journals of stored runs "
        "(or of files written by `orchestrator runs export`) without dispatching, writing or "
        "waiting for anything, and print per run `ok` or the first NONDETERMINISM: its "
        "position, the command the journal recorded and the one the code issued. Exit status "
        "1 if any run differs (or names a workflow version the code does not register).")
    parser.add_argument("--app", required=True, metavar="MODULE:ATTR",
                        help="the Orchestrator with the code to check, e.g. shop.flows:app")
    parser.add_argument("--workflow", help="only runs of this workflow (its name)")
    parser.add_argument("--version", help="only runs of this version of it")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--last", type=whole("--last", low=1, high=LAST_MAX), default=100,
                       metavar="N",
                       help="the newest N runs the filters select (default 100)")
    which.add_argument("--run", metavar="RUN_ID", help="this run only")
    which.add_argument("--from-file", action="append", metavar="FILE", type=Path,
                       help="runs exported by `orchestrator runs export` (a document, an "
                       "array of them or JSON lines; repeatable): no database is read")
    parser.add_argument("--since", metavar="T",
                        help="only runs created at or after T (ISO 8601 with its offset)")
    parser.add_argument("--in-flight", action="store_true",
                        help="only runs that have not ended (those workers will replay)")
    json_option(parser)
    parser.set_defaults(func=cmd_replay, help_parser=parser)


def _from_files(paths: list[Path]) -> list[RecordedRun]:
    runs: list[RecordedRun] = []
    for path in paths:
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as exc:
            raise InvalidRequest(f"cannot read {path}: {exc.strerror}",
                                 path="from_file") from None
        runs.extend(checks.read_documents(text, source=str(path)))
    return runs


def cmd_replay(args: argparse.Namespace) -> int:
    if args.workflow is not None:
        check_workflow_filter(args.workflow)
    run_id = None if args.run is None else parse_run_id(args.run)
    since = None if args.since is None else parse_time(args.since, "since")
    app = load_app(args.app, args.database_url)

    async def main() -> list[Verdict]:
        if args.from_file:
            runs = [r for r in _from_files(args.from_file)
                    if (args.workflow is None or r.workflow == args.workflow)
                    and (args.version is None or r.version == args.version)]
        else:
            db = Database(database_target(args), max_pool_size=1)
            try:
                async with db.connection() as conn:
                    runs = await checks.load_runs(
                        conn, run_id=run_id, workflow=args.workflow, version=args.version,
                        since=since, last=args.last, finished=not args.in_flight)
            finally:
                await db.close()
        return await checks.check_runs(runs, app.registry, app.arguments_text)

    verdicts = asyncio.run(main())
    failing = [v for v in verdicts if not v.ok]
    if args.json:
        records.emit({"runs": [v.as_dict() for v in verdicts], "count": len(verdicts),
                      "ok": len(verdicts) - len(failing), "differ": len(failing)})
    elif not verdicts:
        print("no runs to check")
    else:
        print(render(["RUN", "WORKFLOW", "VERDICT", "COMMANDS", "POS", "RECORDED", "ISSUED"],
                     [[v.run_id, v.workflow, v.verdict, v.commands, v.position, v.recorded,
                       v.issued] for v in verdicts]))
        for v in failing:
            print(f"\n{v.run_id}: {v.message}", file=sys.stdout)
        print(f"\n{len(verdicts)} run(s) checked: {len(verdicts) - len(failing)} ok, "
              f"{len(failing)} differ")
    return EXIT_DIFFERS if failing else 0
