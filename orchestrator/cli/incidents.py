"""``orchestrator incidents show REF``: protected diagnostics, for operators (CONTRACT C10).

A public error carries only a code, a controlled message and an incident reference; what went
wrong in detail (upstream text, the exception, its stack) is here. A host may restrict who
reads it with ``Orchestrator(incident_readers=[...])`` (give ``--app``); without that, any
operator may.
"""

from __future__ import annotations

import argparse
import asyncio
import json
from typing import Any

from orchestrator.cli.common import database_target
from orchestrator.cli.tables import cell
from orchestrator.cli.worker import load_app
from orchestrator.db.database import Database
from orchestrator.db.events import incident_get
from orchestrator.errors import AccessDenied, InvalidRequest


def register(subparsers: Any) -> None:
    group = subparsers.add_parser("incidents", help="protected diagnostics behind public errors")
    commands = group.add_subparsers(title="incidents commands", metavar="COMMAND")
    group.set_defaults(func=None, help_parser=group)
    show = commands.add_parser("show", help="what happened behind an incident reference")
    show.add_argument("ref")
    show.add_argument("--operator", required=True, help="who reads it")
    show.add_argument("--app", default=None, metavar="MODULE:ATTR",
                      help="the application, for its incident_readers")
    show.set_defaults(func=cmd_show)


async def read_incident(db: Database, ref: str, *, operator: str,
                        readers: list[str] | None) -> dict[str, Any]:
    """The incident, if ``operator`` may read it; ``ACCESS_DENIED`` otherwise or if missing."""
    if not operator.strip():
        raise InvalidRequest("an operator identity is required", path="operator")
    if readers is not None and operator not in readers:
        raise AccessDenied("the incident does not exist or is not accessible")
    async with db.connection() as conn:
        row = await incident_get(conn, ref)
    if row is None:
        raise AccessDenied("the incident does not exist or is not accessible")
    return row


def cmd_show(args: argparse.Namespace) -> int:
    readers = load_app(args.app, args.database_url).incident_readers if args.app else None

    async def main() -> dict[str, Any]:
        db = Database(database_target(args), max_pool_size=1)
        try:
            return await read_incident(db, args.ref, operator=args.operator, readers=readers)
        finally:
            await db.close()

    row = asyncio.run(main())
    for name in ("ref", "created_at", "code", "run_id", "operation_id", "phase", "cause",
                 "upstream_status"):
        if row.get(name) is not None:
            print(f"{name + ':':<16} {cell(row[name])}")
    detail = dict(row["detail"])
    trace = detail.pop("traceback", None)
    print("detail:")
    print(json.dumps(detail, indent=2, sort_keys=True))
    if isinstance(trace, str):
        print("traceback:")
        print(trace.rstrip())
    return 0
