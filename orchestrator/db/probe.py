"""A quick, synchronous connectivity check used before anything else touches the database.

Command-line tools call :func:`ping` first so that a wrong host, a closed port or a bad password
fails within a few seconds with one line that names the problem, instead of a driver traceback
or a long hang. The driver's own error text is never shown: it can echo parts of the connection
string. The message is built from the masked URL and a reason chosen from a fixed list; the
original exception stays chained for diagnostics.
"""

from __future__ import annotations

import psycopg

from orchestrator.db.config import DatabaseTarget
from orchestrator.errors import ConfigurationError, DatabaseError

DEFAULT_CONNECT_TIMEOUT = 5.0
"""Seconds to wait for a server to answer. libpq rounds this to whole seconds, minimum 2."""

_NO_DATABASE = ("the database does not exist (create it, e.g. with `createdb`, then run "
                "`orchestrator db upgrade`)")

# SQLSTATE codes a server sends back while refusing a connection.
_SQLSTATE_REASONS = {
    "28P01": "authentication failed (wrong password?)",
    "28000": "the server rejected the user or client (authentication failed)",
    "3D000": _NO_DATABASE,
    "53300": "the server has too many connections",
    "57P03": "the server is starting up or shutting down",
    "42501": "the user may not connect to that database",
}

# Fragments of libpq messages for failures that happen before or during the start-up handshake
# (the server sends no SQLSTATE then). Checked in order; the first entry whose fragments all
# occur wins. Only the reason on the right is ever shown.
_TEXT_REASONS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("connection refused",), "connection refused (is a server listening on that host and port?)"),
    (("timeout expired",), "no answer from the server within the connect timeout"),
    (("timed out",), "no answer from the server within the connect timeout"),
    (("could not translate host name",), "the host name cannot be resolved"),
    (("failed to resolve host",), "the host name cannot be resolved"),
    (("name or service not known",), "the host name cannot be resolved"),
    (("no route to host",), "no route to the host"),
    (("network is unreachable",), "the network is unreachable"),
    (("no such file or directory",), "no server is listening on that Unix socket"),
    (("password authentication failed",), "authentication failed (wrong password?)"),
    (("no password supplied",), "the server requires a password and none was given"),
    (("authentication failed",), "authentication failed"),
    (("role", "does not exist"), "the user (role) does not exist"),
    (("database", "does not exist"), _NO_DATABASE),
    (("too many",), "the server has too many connections"),
    (("starting up",), "the server is starting up or shutting down"),
    (("shutting down",), "the server is starting up or shutting down"),
    (("invalid response to ssl negotiation",), "what answered there is not a PostgreSQL server"),
    (("ssl",), "the SSL negotiation failed"),
)


def connection_failure_reason(exc: psycopg.Error) -> str:
    """A short, controlled description of why a connection attempt failed."""
    sqlstate = getattr(exc, "sqlstate", None)
    if sqlstate in _SQLSTATE_REASONS:
        return _SQLSTATE_REASONS[sqlstate]
    text = str(exc).lower()
    for fragments, reason in _TEXT_REASONS:
        if all(fragment in text for fragment in fragments):
            return reason
    return f"the connection failed ({type(exc).__name__})"


def ping(target: DatabaseTarget, *, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> None:
    """Connect to ``target`` once and run ``SELECT 1``.

    Raises :class:`DatabaseError` (``DATABASE_UNAVAILABLE``) when the server cannot be reached
    or refuses the connection, and :class:`ConfigurationError` when libpq cannot make sense of
    the URL at all. Both carry one line that names the database (password masked) and the reason.
    """
    seconds = max(2, round(timeout))
    try:
        with psycopg.connect(target.url, connect_timeout=seconds, autocommit=True) as conn:
            conn.execute("SELECT 1")
    except psycopg.OperationalError as exc:
        raise DatabaseError(
            f"cannot connect to {target.masked}: {connection_failure_reason(exc)}"
        ) from exc
    except psycopg.ProgrammingError as exc:
        # libpq rejected the connection string itself (an unknown query parameter, bad
        # percent-encoding). Its text may quote the URL, so it is not repeated here.
        raise ConfigurationError(
            "the database URL is not accepted by libpq; check its query parameters "
            "and percent-encoding"
        ) from exc
    except psycopg.Error as exc:
        raise DatabaseError(
            f"cannot use {target.masked}: {connection_failure_reason(exc)}"
        ) from exc
