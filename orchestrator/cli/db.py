"""``orchestrator db``: which database is in use, and its schema migrations."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from orchestrator.cli.common import database_target, describe_source
from orchestrator.db import migrate


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


def cmd_url(args: argparse.Namespace) -> int:
    """Print the database URL in use (password masked) and where it came from."""
    target = database_target(args, reachable=False)
    print(f"{target.masked} ({describe_source(target)})")
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
