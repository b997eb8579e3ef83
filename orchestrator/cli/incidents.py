"""``orchestrator incidents show REF``: protected diagnostics, for operators (CONTRACT C10).

A public error carries only a code, a controlled message and an incident reference; what went
wrong in detail (upstream text, the exception, its stack, what a lookup said) is here. With
``--app`` the application's operator scopes and ``incident_readers`` apply (an incident belongs
to its run's tenant); without it, any operator may read any incident. The checks are
:meth:`orchestrator.operators.Operators.incident`'s, as for every console.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
from typing import Any

from orchestrator.cli import records
from orchestrator.cli.common import database_target, json_option
from orchestrator.cli.tables import cell, render
from orchestrator.cli.worker import load_app
from orchestrator.db.database import Database
from orchestrator.errors import InvalidRequest
from orchestrator.operators import Operators
from orchestrator.text import check_operator


def register(subparsers: Any) -> None:
    group = subparsers.add_parser("incidents", help="protected diagnostics behind public errors")
    commands = group.add_subparsers(title="incidents commands", metavar="COMMAND")
    group.set_defaults(func=None, help_parser=group)
    show = commands.add_parser("show", help="what happened behind an incident reference")
    show.add_argument("ref")
    show.add_argument("--operator", default=None,
                      help="who reads it (required: the name decides what may be read)")
    show.add_argument("--app", default=None, metavar="MODULE:ATTR",
                      help="the application, for its operator scopes and incident_readers")
    json_option(show)
    show.set_defaults(func=cmd_show)


def reader_of(args: argparse.Namespace) -> str:
    """``--operator``, or an ``INVALID_REQUEST`` that says why it is needed and what to run:
    an incident holds protected diagnostics, and which ones an operator may read depends on
    who they are (the application's operator scopes and incident readers)."""
    if args.operator is None:
        app = f" --app {shlex.quote(args.app)}" if args.app else ""
        raise InvalidRequest(
            "incidents show needs --operator NAME: an incident holds protected diagnostics "
            "(upstream text, tracebacks), and whether you may read it depends on who you are "
            "(the application's operator_scopes and incident_readers). Run: orchestrator "
            f"incidents show {shlex.quote(args.ref)} --operator NAME{app}", path="operator")
    return check_operator(args.operator)


def cmd_show(args: argparse.Namespace) -> int:
    operator = reader_of(args)
    app = load_app(args.app, args.database_url) if args.app else None

    async def main() -> dict[str, Any]:
        db = Database(database_target(args), max_pool_size=1)
        try:
            ops = (Operators(db) if app is None else
                   Operators(db, app.operator_scopes, incident_readers=app.incident_readers,
                             json_limits=app.json_limits))
            return await ops.incident(args.ref, operator=operator)
        finally:
            await db.close()

    row = asyncio.run(main())
    if args.json:
        records.emit(records.incident(row))
        return 0
    for name in ("ref", "created_at", "code", "run_id", "operation_id", "phase", "cause",
                 "upstream_status"):
        if row.get(name) is not None:
            print(f"{name + ':':<16} {cell(row[name])}")
    detail = dict(row["detail"])
    trace = detail.pop("traceback", None)
    related, timeline = detail.pop("incidents", None), detail.pop("timeline", None)
    print("detail:")
    print(json.dumps(detail, indent=2, sort_keys=True))
    if isinstance(related, list) and related:
        # A failed run's incident names the call's own (the tool's, the lookups'): open them
        # the same way.
        print("related incidents (orchestrator incidents show REF --operator NAME):")
        print(render(["REF", "CODE", "OP", "PHASE", "CAUSE"],
                     [[i.get("ref"), i.get("code"), i.get("operation_id"), i.get("phase"),
                       i.get("cause")] for i in related if isinstance(i, dict)]))
    if isinstance(timeline, list) and timeline:
        print("the call's timeline:")
        for e in timeline:
            if isinstance(e, dict):
                print(f"  {e.get('seq')}  {e.get('at')}  {e.get('kind')}  "
                      f"{json.dumps(e.get('payload'), sort_keys=True, default=str)}")
    if isinstance(trace, str):
        print("traceback:")
        print(trace.rstrip())
    return 0
