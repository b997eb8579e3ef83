"""``orchestrator db``: which database is in use, its schema migrations, the runtime role's
grants and this user's embedded servers."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from orchestrator.cli import records
from orchestrator.cli.common import database_target, describe_source
from orchestrator.cli.tables import render
from orchestrator.db import embedded, grants, migrate
from orchestrator.db.config import (
    EMBEDDED_DATABASE,
    ENV_URL,
    configured_url,
    embedded_data_dir,
)
from orchestrator.errors import DatabaseError


def register(subparsers: Any) -> None:
    """Add the ``db`` group and its commands."""
    group = subparsers.add_parser("db", help="the database and its schema")
    commands = group.add_subparsers(title="db commands", metavar="COMMAND")
    group.set_defaults(func=None, help_parser=group)

    url = commands.add_parser("url", help="print which database is in use (password masked)")
    url.set_defaults(func=cmd_url)

    upgrade = commands.add_parser(
        "upgrade",
        help="bring the schema to this release's revision; several processes may run it at once",
    )
    upgrade.set_defaults(func=cmd_upgrade)

    check = commands.add_parser(
        "check",
        help="exit 0 when the schema matches this release, 1 when it is empty, behind or ahead",
    )
    check.set_defaults(func=cmd_check)

    grant = commands.add_parser(
        "grant",
        help="give a role the runtime's privileges, and nothing more (see docs/security.md); "
        "run it as the schema's owner after every upgrade",
        description="Leave ROLE with exactly the privileges workers, reconcilers, submitting "
        "applications and the operator CLI need on the orchestrator schema: no UPDATE, DELETE "
        "or TRUNCATE on the journal or the operator audit, whatever it was given before. "
        "Running it again changes nothing.")
    grant.add_argument("--role", required=True, metavar="NAME",
                       help="the runtime role (it must exist: CREATE ROLE NAME LOGIN ...)")
    grant.add_argument("--print", action="store_true", dest="print_only",
                       help="print the statements instead of running them (no connection)")
    grant.add_argument("--no-incident-details", action="store_false", dest="incident_details",
                       help="let the role write incidents and read their summary but not their "
                       "detail (upstream text, tracebacks): `incidents show` then needs a role "
                       "of its own")
    grant.set_defaults(func=cmd_grant)
    register_embedded(commands)


def register_embedded(commands: Any) -> None:
    """``db embedded status|stop|destroy``."""
    group = commands.add_parser(
        "embedded", help="this user's embedded PostgreSQL servers (the app's and the tests'): "
        "which run, stop them, remove their data",
        description="The embedded PostgreSQL is used when no database URL is configured (the "
        "app's, ORCHESTRATOR_EMBEDDED_DIR) and by the test suite when no other server answers "
        "(the tests', ORCHESTRATOR_TEST_EMBEDDED_DIR). A server is left running after the "
        "process that started it exits, so that the next start is instant.")
    sub = group.add_subparsers(title="embedded commands", metavar="COMMAND")
    group.set_defaults(func=None, help_parser=group)
    which = {"nargs": "?", "choices": ["app", "tests"], "metavar": "app|tests",
             "help": "only this one (default: both)"}

    status = sub.add_parser("status", help="each data directory: running (pid), size")
    status.add_argument("--json", action="store_true", help="one JSON object per server")
    status.set_defaults(func=cmd_embedded_status)

    stop = sub.add_parser("stop", help="stop the running servers (they start again on use)")
    stop.add_argument("name", **which)
    stop.set_defaults(func=cmd_embedded_stop)

    destroy = sub.add_parser("destroy", help="stop the servers and remove their data "
                             "directories (every database in them); asks first")
    destroy.add_argument("name", **which)
    destroy.add_argument("--yes", action="store_true", help="do not ask")
    destroy.set_defaults(func=cmd_embedded_destroy)


def cmd_url(args: argparse.Namespace) -> int:
    """Print the database URL in use (password masked) and where it came from; with none
    configured, the embedded server that is used and whether it runs, without starting it."""
    target = configured_url(args.database_url)
    if target is not None:
        print(f"{target.display} ({describe_source(target)})")
        return 0
    server = embedded.inspect("app", embedded_data_dir())
    state = (f"running (pid {server.pid})" if server.pid is not None
             else "stopped: the first command that needs it starts it" if server.created
             else "not created yet: the first command that needs it creates and starts it")
    print(f"embedded ({server.data_dir}), database {EMBEDDED_DATABASE}: no database URL is "
          f"configured (--database-url, {ENV_URL}); the server is {state}")
    return 0


def cmd_upgrade(args: argparse.Namespace) -> int:
    """Upgrade to the head revision; a database stamped by a newer release is refused."""
    target = database_target(args)
    status = migrate.upgrade(target)
    if not status.ok:  # pragma: no cover - upgrade either reaches head or raises
        print(status.describe(), file=sys.stderr)
        return 1
    print(f"{target.masked}: the schema is at revision {status.current} (head)")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """Compare the database's schema revision with the code's; never changes anything."""
    target = database_target(args)
    status = migrate.check(target)
    if status.ok:
        print(f"{target.masked}: {status.describe()}")
        return 0
    print(f"{target.masked}: {status.describe()}", file=sys.stderr)
    return 1


def cmd_grant(args: argparse.Namespace) -> int:
    """Apply (or print) the runtime role's grants; idempotent."""
    chosen = grants.runtime_grants(incident_details=args.incident_details)
    if args.print_only:
        print(grants.render(grants.grant_statements(args.role, chosen)), end="")
        return 0
    target = database_target(args)
    try:
        status: migrate.SchemaStatus | None = migrate.check(target)
    except DatabaseError:  # this user may not read the version: the grant says what it may do
        status = None
    if status is not None and not status.ok:
        # This release's grants name tables an older (or newer) schema lacks.
        raise migrate.schema_error(target, status)
    applied = grants.grant_runtime(target, args.role, incident_details=args.incident_details)
    print(f"{target.masked}: role {args.role!r} has the runtime's privileges "
          f"({len(applied)} statements; none to update or delete the journal or the audit)")
    return 0


def _chosen(args: argparse.Namespace) -> list[embedded.EmbeddedServer]:
    return [server for server in embedded.servers()
            if getattr(args, "name", None) in (None, server.name)]


def _size(size: int | None) -> str:
    if size is None:
        return "-"
    if size < 1000:
        return f"{size} B"
    value, unit = size / 1000, "kB"
    for bigger in ("MB", "GB"):
        if value < 1000:
            break
        value, unit = value / 1000, bigger
    return f"{value:.1f} {unit}"


def cmd_embedded_status(args: argparse.Namespace) -> int:
    """Each embedded data directory: whether a server runs there (its pid) and its size."""
    found = embedded.servers()
    if args.json:  # one document, as every --json (docs/cli-json.md)
        records.emit({"count": len(found), "servers": [server.as_json() for server in found]})
        return 0
    print(render(["NAME", "STATE", "SIZE", "DATA DIRECTORY"],
                 [(s.name, s.state, _size(s.size_bytes), str(s.data_dir)) for s in found],
                 max_width=200))
    return 0


def cmd_embedded_stop(args: argparse.Namespace) -> int:
    """Stop the chosen servers that run; saying so of each."""
    for server in _chosen(args):
        if embedded.stop(server):
            print(f"{server.name}: stopped the server (pid {server.pid}) in {server.data_dir}")
        else:
            print(f"{server.name}: no server runs in {server.data_dir}")
    return 0


def cmd_embedded_destroy(args: argparse.Namespace) -> int:
    """Stop the chosen servers and remove their data directories, after asking."""
    doomed = [server for server in _chosen(args) if server.data_dir.exists()]
    if not doomed:
        print("no embedded data directory to remove")
        return 0
    if not args.yes:
        for server in doomed:
            print(f"{server.name}: {server.data_dir} ({server.state}, "
                  f"{_size(server.size_bytes)})")
        print("Remove these, with every database in them? [y/N] ", end="", flush=True)
        try:
            answer = input()
        except EOFError:
            answer = ""
        if answer.strip().lower() not in ("y", "yes"):
            print("nothing was removed", file=sys.stderr)
            return 1
    for server in doomed:
        embedded.destroy(server)
        print(f"{server.name}: removed {server.data_dir}")
    return 0
