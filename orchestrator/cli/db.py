"""``orchestrator db``: which database is in use, its schema migrations and the runtime
role's grants."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from orchestrator.cli.common import database_target, describe_source
from orchestrator.db import grants, migrate


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


def cmd_url(args: argparse.Namespace) -> int:
    """Print the database URL in use (password masked) and where it came from."""
    target = database_target(args, reachable=False)
    if target.source == "embedded":
        print(target.display)  # embedded (<data dir>)
    else:
        print(f"{target.display} ({describe_source(target)})")
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
    applied = grants.grant_runtime(target, args.role, incident_details=args.incident_details)
    print(f"{target.masked}: role {args.role!r} has the runtime's privileges "
          f"({len(applied)} statements; none to update or delete the journal or the audit)")
    return 0
