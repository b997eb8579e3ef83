"""Connecting: the connect timeout, the quick connectivity check and the one wording of a
connection that failed.

Command-line tools call :func:`ping` first, and the Python API (:mod:`orchestrator.db.database`)
calls :func:`ping_async` before it opens a pool, so that a wrong host, a closed port or a bad
password fails within a few seconds with one line that names the problem, instead of a driver
traceback, a pool's log lines or a long hang. Both say it the same way (:func:`connect_error`),
and ``retryable`` tells a problem that may pass (nothing listening yet, a server starting up or
shutting down, too many connections) from one that will not until someone changes something (a
missing database or role, a wrong password). The driver's own error text is never shown: it can
echo parts of the connection string. The message is built from the URL's display form and a
reason chosen from a fixed list; the original exception stays chained for diagnostics.
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from orchestrator.db.config import DatabaseTarget
from orchestrator.errors import ConfigurationError, DatabaseError, OrchestratorError

DEFAULT_CONNECT_TIMEOUT = 5.0
"""Seconds to wait for a server to answer. libpq rounds this to whole seconds, minimum 2."""

_NO_DATABASE = ("the database does not exist (create it, e.g. with `createdb`, then run "
                "`orchestrator db upgrade`)")
_REFUSED_AUTH = "authentication failed (wrong password?)"
_STARTING = "the server is starting up or shutting down"
_TOO_MANY = "the server has too many connections"

# SQLSTATE codes a server sends back while refusing a connection: (reason, retryable).
_SQLSTATE_REASONS = {
    "28P01": (_REFUSED_AUTH, False),
    "28000": ("the server rejected the user or client (authentication failed)", False),
    "3D000": (_NO_DATABASE, False),
    "53300": (_TOO_MANY, True),
    "57P03": (_STARTING, True),
    "42501": ("the user may not connect to that database", False),
}

# Fragments of libpq messages for failures that happen before or during the start-up handshake
# (the server sends no SQLSTATE then). Checked in order; the first entry whose fragments all
# occur wins. Only the reason on the right is ever shown.
_TEXT_REASONS: tuple[tuple[tuple[str, ...], str, bool], ...] = (
    (("connection refused",), "connection refused (is a server listening on that host and port?)",
     True),
    (("timeout expired",), "no answer from the server within the connect timeout", True),
    (("timed out",), "no answer from the server within the connect timeout", True),
    (("could not translate host name",), "the host name cannot be resolved", True),
    (("failed to resolve host",), "the host name cannot be resolved", True),
    (("name or service not known",), "the host name cannot be resolved", True),
    (("no route to host",), "no route to the host", True),
    (("network is unreachable",), "the network is unreachable", True),
    (("no such file or directory",), "no server is listening on that Unix socket", True),
    (("password authentication failed",), _REFUSED_AUTH, False),
    (("no password supplied",), "the server requires a password and none was given", False),
    (("authentication failed",), "authentication failed", False),
    (("role", "does not exist"), "the user (role) does not exist", False),
    (("database", "does not exist"), _NO_DATABASE, False),
    (("no such database",), "the pooler has no such database (add it to the pooler's own "
     "list, PgBouncer's [databases], or fix the database's name in the URL)", False),
    (("too many",), _TOO_MANY, True),
    (("starting up",), _STARTING, True),
    (("shutting down",), _STARTING, True),
    (("invalid response to ssl negotiation",), "what answered there is not a PostgreSQL server",
     False),
    (("ssl",), "the SSL negotiation failed", False),
)


def connection_failure(exc: psycopg.Error) -> tuple[str, bool]:
    """A short, controlled description of why a connection attempt failed, and whether
    trying again later may succeed without anyone changing anything. A failure nobody
    expected counts as one that may pass."""
    sqlstate = getattr(exc, "sqlstate", None)
    if sqlstate in _SQLSTATE_REASONS:
        return _SQLSTATE_REASONS[sqlstate]
    text = str(exc).lower()
    for fragments, reason, retryable in _TEXT_REASONS:
        if all(fragment in text for fragment in fragments):
            return reason, retryable
    return f"the connection failed ({type(exc).__name__})", True


def connection_failure_reason(exc: psycopg.Error) -> str:
    """The reason alone (see :func:`connection_failure`)."""
    return connection_failure(exc)[0]


def connect_error(target: DatabaseTarget, exc: psycopg.Error) -> OrchestratorError:
    """The public error for a connection attempt that failed: ``DATABASE_UNAVAILABLE`` with
    one line naming the database (no password) and the reason, or ``CONFIGURATION_ERROR``
    when libpq cannot make sense of the URL at all. The same words from the CLI and the API."""
    if isinstance(exc, psycopg.ProgrammingError):
        # libpq rejected the connection string itself (an unknown query parameter, bad
        # percent-encoding). Its text may quote the URL, so it is not repeated here.
        return ConfigurationError(
            "the database URL is not accepted by libpq; check its query parameters "
            "and percent-encoding"
        )
    reason, retryable = connection_failure(exc)
    verb = "connect to" if isinstance(exc, psycopg.OperationalError) else "use"
    return DatabaseError(f"cannot {verb} {target.display}: {reason}", retryable=retryable)


APPLICATION_NAME = "orchestrator"
"""What a connection of this package is called in ``pg_stat_activity.application_name`` unless
its process names it more closely (:func:`connection_name`) or the URL (or ``PGAPPNAME``) names
it itself."""


def connection_name(kind: str, ident: str) -> str:
    """The name of the connections of one worker or reconciler (``orchestrator worker
    host:pid:abc123``), so that a fleet's sessions can be told apart in ``pg_stat_activity``:
    printable ASCII, cut to the 63 bytes PostgreSQL keeps."""
    text = f"{APPLICATION_NAME} {kind} {ident}"
    return "".join(c if " " <= c <= "~" else "?" for c in text)[:63]


def connect_options(target: DatabaseTarget, timeout: float = DEFAULT_CONNECT_TIMEOUT,
                    *, name: str = APPLICATION_NAME) -> dict[str, Any]:
    """Keyword arguments for every connection this package opens: the connect timeout, unless
    the URL sets its own ``connect_timeout`` (which then wins), and ``name`` as libpq's
    ``fallback_application_name`` (an ``application_name`` of the URL, or ``PGAPPNAME``,
    wins)."""
    try:
        if "connect_timeout" in conninfo_to_dict(target.url):
            return {"fallback_application_name": name}
    except psycopg.Error:
        pass  # connecting reports the bad URL
    return {"connect_timeout": max(2, round(timeout)), "fallback_application_name": name}


LISTEN_KEEPALIVES: dict[str, int] = {
    "keepalives": 1, "keepalives_idle": 30, "keepalives_interval": 10, "keepalives_count": 3}
"""libpq's TCP keepalives for the listener's connection, which only waits and sends nothing:
without them a network path that dropped without a word (a host gone, a failover behind a
moved address) is never noticed, and the listener waits for ever on a dead connection. With
them the kernel gives up on it within about a minute of silence (30 s idle, then 3 probes
10 s apart), and the listener reconnects."""


def keepalive_options(url: str) -> dict[str, Any]:
    """:data:`LISTEN_KEEPALIVES`, less those ``url`` sets itself (its own win)."""
    try:
        own = conninfo_to_dict(url)
    except psycopg.Error:
        own = {}  # connecting reports the bad URL
    return {key: value for key, value in LISTEN_KEEPALIVES.items() if key not in own}


def ping(target: DatabaseTarget, *, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> None:
    """Connect to ``target`` once and run ``SELECT 1``.

    Raises :class:`DatabaseError` (``DATABASE_UNAVAILABLE``) when the server cannot be reached
    or refuses the connection, and :class:`ConfigurationError` when libpq cannot make sense of
    the URL at all (see :func:`connect_error`).
    """
    try:
        with psycopg.connect(target.url, autocommit=True,
                             **connect_options(target, timeout)) as conn:
            conn.execute("SELECT 1")
    except psycopg.Error as exc:
        raise connect_error(target, exc) from exc


async def ping_async(target: DatabaseTarget, *, timeout: float = DEFAULT_CONNECT_TIMEOUT
                     ) -> None:
    """:func:`ping` for a running event loop."""
    try:
        conn = await psycopg.AsyncConnection.connect(target.url, autocommit=True,
                                                     **connect_options(target, timeout))
        async with conn:
            await conn.execute("SELECT 1")
    except psycopg.Error as exc:
        raise connect_error(target, exc) from exc
