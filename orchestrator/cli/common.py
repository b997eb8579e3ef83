"""Helpers shared by the command groups."""

from __future__ import annotations

import argparse
import getpass
import os
from datetime import datetime

from orchestrator.db.config import DatabaseTarget, resolve_database
from orchestrator.db.probe import ping
from orchestrator.errors import InvalidRequest

SOURCE_LABELS = {
    "argument": "from --database-url",
    "environment": "from ORCHESTRATOR_DATABASE_URL",
    "embedded": "embedded PostgreSQL",
}


def database_target(args: argparse.Namespace, *, reachable: bool = True) -> DatabaseTarget:
    """The database chosen by ``--database-url``, the environment or the embedded server.

    With ``reachable`` (the default) the database is also connected to once, with a short
    timeout, so that a wrong host or port fails fast with one clear line.
    """
    target = resolve_database(args.database_url)
    if reachable:
        ping(target)
    return target


def describe_source(target: DatabaseTarget) -> str:
    """Where the database URL came from, in words."""
    return SOURCE_LABELS.get(target.source, target.source)


def json_option(parser: argparse.ArgumentParser) -> None:
    """``--json``: one JSON document on stdout instead of the table (docs/cli-json.md)."""
    parser.add_argument("--json", action="store_true",
                        help="print one JSON document (fields: docs/cli-json.md)")


def parse_time(value: str, path: str) -> datetime:
    """An option's ISO 8601 time with its offset (``INVALID_REQUEST`` naming ``--path``)."""
    try:
        when = datetime.fromisoformat(value)
    except ValueError:
        when = None
    if when is None or when.tzinfo is None:
        raise InvalidRequest(f"--{path} must be an ISO 8601 time with its offset, e.g. "
                             "2026-12-01T00:00:00Z", path=path)
    return when


def over_default_limits(exc: InvalidRequest, whose: str, action: str) -> InvalidRequest:
    """``exc`` (an input over a JSON limit, ``PAYLOAD_TOO_LARGE`` too) said again for a
    command run without ``--app``: the default limits held ``whose`` input, and what to pass
    to ``action`` under the application's own."""
    return type(exc)(f"{exc.message}; without --app {whose} input is held to the default JSON "
                     f"limits: pass --app MODULE:ATTR to {action} under its application's "
                     "limits", path=exc.path)


def is_input_limit(exc: InvalidRequest) -> bool:
    """Whether ``exc`` refuses a stored input (its path under ``$.input``)."""
    return (exc.path or "").startswith("$.input")


def login_name() -> str:
    """Who ran the command, for an audit row that was given no ``--operator``."""
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no login name for this uid (a bare container)
        return f"uid:{os.getuid()}"


def audit_options(parser: argparse.ArgumentParser, what: str) -> None:
    """``--operator`` and ``--evidence`` of a command whose action is audited. Optional, so
    that scripts written before the audit keep working: the row then names the login that ran
    the command and says that no reason was given (:func:`audited_as`)."""
    parser.add_argument("--operator", metavar="NAME",
                        help=f"who {what} (audited; default: your login name)")
    parser.add_argument("--evidence", metavar="TEXT",
                        help="why (kept in the audit row; default: says none was given)")


def audited_as(args: argparse.Namespace, command: str) -> dict[str, str]:
    """The audit row's operator and evidence: as given, else the login name and a text that
    says no reason was given (a blank one given is refused, as the console refuses it)."""
    operator = args.operator if args.operator is not None else login_name()
    evidence = (args.evidence if args.evidence is not None
                else f"none given (orchestrator {command})")
    return {"operator": operator, "evidence": evidence}
