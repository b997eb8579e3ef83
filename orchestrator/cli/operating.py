"""What the ``ops`` commands share: who acts (``--operator``, ``--app``), the queue filters,
a resolution's receipt, and the :class:`~orchestrator.operators.Operators` they act through."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from orchestrator.cli.common import database_target
from orchestrator.cli.options import one_of
from orchestrator.cli.worker import load_app
from orchestrator.db.database import Database
from orchestrator.errors import InvalidRequest
from orchestrator.operators import UNRESOLVED, Operators
from orchestrator.reconcile import THEN
from orchestrator.text import check_operator

T = TypeVar("T")
DEFAULT_OPERATOR = "operator"
"""The name ``ops list`` and ``ops show`` act under without ``--app`` and ``--operator``."""
_DURATION = re.compile(r"(\d+(?:\.\d+)?)([smhd]?)")
_UNITS = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def operator_options(parser: argparse.ArgumentParser, *, operator_required: bool) -> None:
    """``--operator`` and ``--app``: who acts, under which application's scopes. An action
    (``operator_required``) records the operator in the audit log; a command that only reads
    does not, and says so."""
    parser.add_argument("--operator", required=operator_required, default=None, metavar="NAME",
                        help="who acts (recorded in the audit log); required with --app"
                             if operator_required else
                             "whose operator scopes apply with --app (this command only "
                             "reads: nothing is recorded); required with --app (without it: "
                             f"{DEFAULT_OPERATOR!r})")
    parser.add_argument("--app", default=None, metavar="MODULE:ATTR",
                        help="the application, for its operator scopes (then "
                             "--operator is required)")


def filters(parser: argparse.ArgumentParser) -> None:
    """The queue filters ``list`` and the bulk commands share (all applied in SQL)."""
    parser.add_argument("--tool", help="the tool's name")
    parser.add_argument("--older-than", metavar="AGE", help="queued longer ago than AGE: "
                        "e.g. 90s, 10m, 2h, 1d")
    parser.add_argument("--key", metavar="KEY", help="the operation's idempotency key")
    parser.add_argument("--run", metavar="RUN_ID", help="the operations of one run")
    parser.add_argument("--workflow", help="the name of the operation's run's workflow")


def filter_of(args: argparse.Namespace) -> dict[str, Any]:
    """The filter options as :meth:`Operators.list_items` keywords (checked there)."""
    return {"tool": args.tool, "older_than": parse_age(args.older_than), "key": args.key,
            "run_id": args.run, "workflow": args.workflow}


def described(args: argparse.Namespace, *, default_state: str = UNRESOLVED) -> str:
    """The filter options given, as they were typed (for "nothing matches" lines)."""
    return " ".join(f"--{flag} {value}" for flag, value in (
        ("state", None if args.state == default_state else args.state), ("tool", args.tool),
        ("older-than", args.older_than), ("key", args.key), ("run", args.run),
        ("workflow", args.workflow)) if value)


def parse_age(text: str | None) -> float | None:
    if text is None:
        return None
    match = _DURATION.fullmatch(text.strip())
    if match is None:
        raise InvalidRequest(f"--older-than {text!r}: use a number with s, m, h or d")
    return float(match.group(1)) * _UNITS[match.group(2)]


def operator_of(args: argparse.Namespace) -> str:
    """Who acts: ``--operator``, required with ``--app`` (whose scopes name the operators);
    without ``--app``, :data:`DEFAULT_OPERATOR`. The name is checked like any other."""
    if args.operator is None:
        if args.app:
            raise InvalidRequest("--app applies the application's operator scopes: pass "
                                 "--operator NAME", path="operator")
        return check_operator(DEFAULT_OPERATOR)
    return check_operator(args.operator)


def with_operators(args: argparse.Namespace,
                    fn: Callable[[Operators, str], Awaitable[T]]) -> T:
    operator = operator_of(args)
    app = load_app(args.app, args.database_url) if args.app else None

    async def main() -> T:
        db = Database(database_target(args), max_pool_size=2)
        try:
            if app is None:
                return await fn(Operators(db), operator)
            return await fn(Operators(db, app.operator_scopes,
                                      incident_readers=app.incident_readers,
                                      json_limits=app.json_limits), operator)
        finally:
            await db.close()

    return asyncio.run(main())


def receipt_of(args: argparse.Namespace) -> Any:
    """``--receipt`` decoded: required with ``--committed``, refused without it."""
    if not args.committed:
        if args.receipt is not None:
            raise InvalidRequest("--receipt goes only with --committed")
        return None
    if args.receipt is None:
        raise InvalidRequest("--committed needs --receipt JSON (what the tool returned)")
    try:
        return json.loads(args.receipt)
    except (ValueError, RecursionError):
        raise InvalidRequest("--receipt is not valid JSON (or is nested too deep)",
                             path="receipt") from None


def then_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--then", choices=THEN, type=one_of("--then", THEN), default=None,
        help="with --not-applied: resend (the default) sends the call again as a new attempt "
             "with a new key, outside the tool's retry budget; fail makes the call fail with "
             "TOOL_FAILED in the workflow")


def then_of(args: argparse.Namespace) -> str | None:
    """``--then``, checked against the resolution (INVALID_REQUEST with ``--committed``)."""
    if args.then is not None and not args.not_applied:
        raise InvalidRequest("--then goes only with --not-applied", path="then")
    return (args.then or "resend") if args.not_applied else None
