"""``orchestrator console``: the operator console on its own (uvicorn), with bearer tokens
(docs/console.md).

Who may sign in is the token file's: each line ``TOKEN`` (for ``--operator``) or ``NAME
TOKEN``; blank lines and ``#`` comments are skipped. Without ``--token-file`` one token is
generated for ``--operator`` and printed once. What each may do is ``--grant NAME=GRANTS``
(``read``, ``resolve``, ``bulk``, ``cancel``, ``incidents`` or ``all``); an operator without
``--grant`` only reads. The application's operator scopes and incident readers apply.

It listens on loopback unless told; another address needs ``--token-file``: a token printed to
a terminal is fine for one person on this machine, not for a network.
"""

from __future__ import annotations

import argparse
import ipaddress
import secrets
import signal
from pathlib import Path
from typing import Any

from orchestrator.cli.options import MAX_PORT, whole
from orchestrator.cli.worker import load_app
from orchestrator.errors import AccessDenied, ConfigurationError, InvalidRequest
from orchestrator.serving import early_stop_requested
from orchestrator.text import check_operator

DEFAULT_OPERATOR = "operator"
STOP_GRACE = 3
"""Seconds a stop waits for open responses (event streams) before it cuts them."""


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "console", help="serve the operator console (pages and /api) with a bearer token",
        description="Serve the operator console of an application. Browsers sign in with a "
                    "token; scripts send it as 'Authorization: Bearer TOKEN'.")
    parser.add_argument("--app", default=None, metavar="MODULE:ATTR",
                        help="the application, for its operator scopes and incident readers "
                             "(without it: the database alone, no scopes)")
    parser.add_argument("--host", default="127.0.0.1",
                        help="the address to listen on (default 127.0.0.1; another than "
                             "loopback needs --token-file)")
    parser.add_argument("--port", type=whole("--port", low=0, high=MAX_PORT), default=8080,
                        help="default 8080")
    parser.add_argument("--token-file", metavar="FILE", type=Path, default=None,
                        help="the tokens: one per line, 'TOKEN' (for --operator) or "
                             "'NAME TOKEN'; without it one is generated and printed once")
    parser.add_argument("--operator", default=DEFAULT_OPERATOR,
                        help=f"whose token a one-word line or the generated token is "
                             f"(default {DEFAULT_OPERATOR!r})")
    parser.add_argument("--grant", action="append", default=[], metavar="NAME=GRANTS",
                        help="what an operator may do: e.g. alice=read,resolve or bob=all "
                             "(read, resolve, bulk, cancel, incidents); repeat per operator; "
                             "without it an operator only reads")
    parser.set_defaults(func=cmd_console, stops_on_sigterm=True)


def loopback(host: str) -> bool:
    """Whether ``host`` is a loopback address (or ``localhost``)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def read_tokens(path: Path, operator: str) -> dict[str, str]:
    """The token file as operator → token (``CONFIGURATION_ERROR`` naming a bad line)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigurationError(f"cannot read --token-file {str(path)!r}: "
                                 f"{type(exc).__name__}") from None
    tokens: dict[str, str] = {}
    for number, line in enumerate(lines, 1):
        words = line.split()
        if not words or words[0].startswith("#"):
            continue
        if len(words) > 2:
            raise ConfigurationError(f"--token-file line {number}: use 'TOKEN' or "
                                     "'NAME TOKEN'")
        name, token = (operator, words[0]) if len(words) == 1 else (words[0], words[1])
        if name in tokens:
            raise ConfigurationError(f"--token-file line {number}: a second token for "
                                     f"{name!r}")
        tokens[name] = token
    if not tokens:
        raise ConfigurationError(f"--token-file {str(path)!r} holds no token")
    return tokens


def grants_of(options: list[str]) -> dict[str, list[str]]:
    from orchestrator.console.grants import parse_grant_option

    grants: dict[str, list[str]] = {}
    for option in options:
        name, listed = parse_grant_option(option)
        grants.setdefault(name, []).extend(listed)
    return grants


def cmd_console(args: argparse.Namespace) -> int:
    try:
        import uvicorn

        from orchestrator.console import create_console
    except ImportError:
        raise ConfigurationError("the console needs the console extra: pip install "
                                 "'orchestrator[console]'") from None
    from orchestrator.app import Orchestrator

    try:
        check_operator(args.operator)
    except InvalidRequest as exc:
        raise ConfigurationError(f"--operator: {exc.message}") from None
    if not loopback(args.host) and args.token_file is None:
        raise ConfigurationError(
            f"refusing to listen on {args.host}, which is not a loopback address, without "
            "--token-file: give the console tokens you configured (and put it behind TLS)")
    generated = args.token_file is None
    tokens = ({args.operator: secrets.token_urlsafe(32)} if generated
              else read_tokens(args.token_file, args.operator))
    grants = grants_of(args.grant)
    app = load_app(args.app, args.database_url) if args.app else Orchestrator(
        args.database_url)
    _check_operators(app, tokens, grants)
    console = create_console(app, tokens=tokens, grants={name: grants.get(name, ["read"])
                                                        for name in tokens})
    shown = f"[{args.host}]" if ":" in args.host else args.host
    print(f"orchestrator console on http://{shown}:{args.port}/ for "
          f"{', '.join(sorted(tokens))}", flush=True)
    for name in sorted(tokens):
        hint = ("" if name in grants else
                f" (only reads; to resolve, cancel and more: --grant {name}=all)")
        print(f"  {name}: {', '.join(sorted(set(grants.get(name, ['read']))))}{hint}",
              flush=True)
    if generated:
        print(f"sign in with this token (shown once): {tokens[args.operator]}", flush=True)
    else:
        print(f"sign in with a token of {args.token_file}", flush=True)
    # Open event streams (GET /api/runs/{id}/events) would hold a stop for as long as their
    # runs last: after STOP_GRACE seconds uvicorn cuts what is still open.
    server = uvicorn.Server(uvicorn.Config(
        console, host=args.host, port=args.port, log_level="info", proxy_headers=True,
        server_header=False, timeout_graceful_shutdown=STOP_GRACE))

    def stop(_sig: int, _frame: object) -> None:
        server.should_exit = True

    # uvicorn stops on SIGTERM or SIGINT, then raises the signal again with the handler it
    # found: this one, so that a stop is a clean exit (0) rather than death by the signal. A
    # SIGTERM before uvicorn takes the signals (one that came while the process started, too)
    # stops it as soon as it has started.
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop)
    if early_stop_requested():
        server.should_exit = True
    server.run()
    return 0


def _check_operators(app: Any, tokens: dict[str, str], grants: dict[str, list[str]]) -> None:
    """Every operator with a token is one the application's scopes know, and every
    ``--grant`` names an operator with a token (a typo would grant nobody)."""
    operators = app.operators
    for name in tokens:
        try:
            operators.tenants_of(name)
        except (AccessDenied, InvalidRequest) as exc:
            raise ConfigurationError(f"the token's operator {name!r}: {exc.message}") from None
    strays = sorted(set(grants) - set(tokens))
    if strays:
        raise ConfigurationError(f"--grant names {', '.join(strays)}, who has no token")
