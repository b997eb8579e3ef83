"""The privileges the engine's runtime role needs, granting them, and checking them.

Every statement in this package was read for what it asks of the server; :data:`RUNTIME` is
the result, object by object (``docs/security.md`` explains each line). The runtime role is the
one workers, reconcilers, submitting applications and the operator CLI connect as. It never
owns the schema (the migration role does) and it holds no UPDATE, DELETE or TRUNCATE on the
journal or the operator audit: for this role both are append-only by grant (the journal's
trigger also refuses UPDATE, for every role; the audit has no trigger).

Nothing here needs a grant on a sequence: every generated key is an identity column, whose
sequence PostgreSQL advances for an INSERT without checking privileges on it. The trigger
functions (``operations_guard``, ``journal_append_only``,
``reconciliation_items_guard`` …) need none either: a trigger's function is checked when the
trigger is created, not when it fires. What the role can still write that no grant can keep
from it (an audit row under any operator name) is in ``docs/security.md``.

:func:`grant_statements` builds the statements (no connection needed, for ``--print``),
:func:`grant_runtime` applies them in one transaction and refuses to leave the role with a
privilege it must not have, and :func:`privileges_missing` is the one query a worker and a
reconciler run when they start.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from orchestrator.db.config import DatabaseTarget
from orchestrator.db.database import Conn, translate_errors
from orchestrator.db.schema import SCHEMA
from orchestrator.errors import ConfigurationError, InvalidRequest
from orchestrator.text import check_identifier

ROLE_NAME_MAX_BYTES = 63
"""PostgreSQL truncates longer identifiers (NAMEDATALEN - 1): a longer name is refused rather
than granted to a role with another name."""


@dataclass(frozen=True)
class Grant:
    """Privileges on one object. ``kind`` is ``schema``, ``table`` or ``function``; ``name``
    is the object as the ``has_*_privilege`` functions take it (functions with their argument
    types); ``columns`` makes a column-level grant."""

    kind: str
    name: str
    privileges: tuple[str, ...]
    columns: tuple[str, ...] = ()

    def describe(self, privilege: str, column: str | None = None) -> str:
        """``DELETE on orchestrator.workers``: one privilege (on one column), in words."""
        kind = "" if self.kind == "table" else f"{self.kind} "
        on = f" ({column})" if column else ""
        return f"{privilege}{on} on {kind}{self.name}"


def _table(name: str, *privileges: str) -> Grant:
    return Grant("table", f"{SCHEMA}.{name}", privileges)


INCIDENT_SUMMARY = ("ref", "created_at", "code", "run_id", "operation_id", "phase", "cause",
                    "upstream_status")
"""The columns of ``orchestrator.incidents`` that carry no upstream text: what ``ops show``
lists, and what ``INSERT … ON CONFLICT (ref)`` reads. ``detail`` (the upstream message, the
exception and its traceback) is read only by ``orchestrator incidents show``."""

_TABLES = (
    _table("runs", "SELECT", "INSERT", "UPDATE"),
    _table("journal_entries", "SELECT", "INSERT"),
    _table("journal", "SELECT"),  # the view (migration 0019)
    _table("operations", "SELECT", "INSERT", "UPDATE"),
    _table("reconciliation_items", "SELECT", "INSERT", "UPDATE"),
    _table("reconciliation_lookups", "SELECT", "INSERT"),
    _table("external_events", "SELECT", "INSERT", "UPDATE"),
    _table("operator_audit", "SELECT", "INSERT"),
    _table("workers", "SELECT", "INSERT", "UPDATE", "DELETE"),
    _table("schedules", "SELECT", "INSERT", "UPDATE", "DELETE"),
    _table("schedule_slots", "SELECT", "INSERT", "UPDATE"),
    _table("schedule_gaps", "SELECT", "INSERT"),
    _table("queues", "SELECT", "INSERT", "UPDATE"),
    _table("tool_limits", "SELECT", "INSERT", "UPDATE"),
    _table("tool_dispatches", "SELECT", "INSERT", "DELETE"),
    _table("alembic_version", "SELECT"),
)

_FUNCTIONS = (
    Grant("function", f"{SCHEMA}.runs_ready(text[], integer)", ("EXECUTE",)),
    Grant("function", f"{SCHEMA}.batch_rows(jsonb)", ("EXECUTE",)),
    Grant("function", f"{SCHEMA}.row_applied(boolean, text)", ("EXECUTE",)),
    Grant("function",
          f"{SCHEMA}.queue_claim(text, text[], text, integer, double precision)", ("EXECUTE",)),
    Grant("function", f"{SCHEMA}.tool_admit(text, integer, integer, double precision, "
                      "double precision)", ("EXECUTE",)),
    # Pruning (migration 0013): only the journals of settled, finished runs, through the
    # function's own checks; expire_evidence (which deletes evidence) is not granted.
    Grant("function", f"{SCHEMA}.prune_runs(double precision, text[], double precision[], "
                      "integer, boolean)", ("EXECUTE",)),
    # The slot records of schedules, with the runs they fired (migration 0016).
    Grant("function", f"{SCHEMA}.prune_schedule_slots(double precision, integer, boolean)",
          ("EXECUTE",)),
)


def runtime_grants(*, incident_details: bool = True) -> tuple[Grant, ...]:
    """The runtime role's privileges. Without ``incident_details`` the role may write
    incidents and read their summary, not their ``detail``: give ``incidents show`` a role of
    its own then (docs/security.md)."""
    incidents: tuple[Grant, ...]
    if incident_details:
        incidents = (_table("incidents", "SELECT", "INSERT"),)
    else:
        incidents = (_table("incidents", "INSERT"),
                     Grant("table", f"{SCHEMA}.incidents", ("SELECT",), INCIDENT_SUMMARY))
    return (Grant("schema", SCHEMA, ("USAGE",)), *_TABLES, *incidents, *_FUNCTIONS)


RUNTIME = runtime_grants()
OWNER_ONLY = (f"{SCHEMA}.expire_evidence(double precision, integer, boolean)",)
"""Functions granted to no role on purpose: only the schema's owner (the migration role) runs
them. ``expire_evidence`` deletes the ledger's evidence past its retention period."""

BUILTINS = (
    Grant("function", "pg_catalog.pg_try_advisory_lock(bigint)", ("EXECUTE",)),
    Grant("function", "pg_catalog.pg_try_advisory_xact_lock(integer, integer)", ("EXECUTE",)),
    Grant("function", "pg_catalog.pg_notify(text, text)", ("EXECUTE",)),
    Grant("table", "pg_catalog.pg_locks", ("SELECT",)),
)
"""What the engine uses of PostgreSQL's own: a worker's liveness lock (taken with
``pg_try_advisory_lock``, never waited for), a tool's admission lock (``tool_admit``), NOTIFY,
and the lock table that tells a dead worker from a live one. PostgreSQL grants these to
PUBLIC; they are checked, never granted here (only a superuser can grant them again after a
REVOKE)."""

REQUIRED = runtime_grants(incident_details=False) + BUILTINS
"""What a worker or a reconciler checks when it starts: every privilege the engine's own
statements use (``incidents show`` alone reads more)."""

APPEND_ONLY = (f"{SCHEMA}.journal_entries", f"{SCHEMA}.operator_audit")
FORBIDDEN = ("UPDATE", "DELETE", "TRUNCATE")
"""What the runtime role must not hold on the :data:`APPEND_ONLY` tables, by any route."""


def check_role_name(role: str) -> str:
    """``role`` if it can name a PostgreSQL role as given, else ``INVALID_REQUEST``."""
    role = check_identifier("role", role, max_length=ROLE_NAME_MAX_BYTES)
    if len(role.encode()) > ROLE_NAME_MAX_BYTES:
        raise InvalidRequest(
            f"a role name has at most {ROLE_NAME_MAX_BYTES} bytes (PostgreSQL would "
            "truncate it)", path="role")
    return role


def grant_statements(role: str, grants: tuple[Grant, ...] = RUNTIME) -> list[sql.Composed]:
    """The statements that leave ``role`` with exactly ``grants`` on the orchestrator's
    objects: each object's privileges are revoked first, so running them twice changes
    nothing and a role that was given ALL keeps only what it needs, and nothing at all on
    the :data:`OWNER_ONLY` functions."""
    who = sql.Identifier(check_role_name(role))
    out: list[sql.Composed] = []
    revoked: set[tuple[str, str]] = set()
    for grant in grants:
        kind = sql.SQL(grant.kind.upper())
        target = sql.SQL(grant.name) if grant.kind == "function" else _qualified(grant.name)
        if (grant.kind, grant.name) not in revoked:
            revoked.add((grant.kind, grant.name))
            out.append(sql.SQL("REVOKE ALL ON {} {} FROM {}").format(kind, target, who))
        privileges = sql.SQL(", ").join(sql.SQL(p) for p in grant.privileges)
        if grant.columns:
            columns = sql.SQL(", ").join(sql.Identifier(c) for c in grant.columns)
            privileges = sql.SQL("{} ({})").format(privileges, columns)
        out.append(sql.SQL("GRANT {} ON {} {} TO {}").format(privileges, kind, target, who))
    for name in OWNER_ONLY:  # ``GRANT ... ON ALL FUNCTIONS IN SCHEMA`` reaches them too
        out.append(sql.SQL("REVOKE ALL ON FUNCTION {} FROM {}").format(sql.SQL(name), who))
    return out


def _qualified(name: str) -> sql.Composable:
    return sql.SQL(".").join(sql.Identifier(part) for part in name.split("."))


def render(statements: list[sql.Composed]) -> str:
    """The statements as a script (identifiers quoted as the server would want them)."""
    return "".join(statement.as_string(None) + ";\n" for statement in statements)


def grant_runtime(target: DatabaseTarget, role: str, *, incident_details: bool = True
                  ) -> list[str]:
    """Apply the runtime role's grants to ``role`` in one transaction; return the statements.

    Refused (``CONFIGURATION_ERROR``, nothing changed) when the role does not exist, owns the
    schema or is a superuser, when the user running it may not grant (it must own the
    schema's objects: the migration role, or a superuser), and when the role would still
    hold UPDATE (on any column), DELETE or TRUNCATE on the journal or the audit, or EXECUTE
    on ``expire_evidence``, through PUBLIC or a role it belongs to. Run it after every
    ``orchestrator db upgrade``: a new table needs its grant.
    """
    grants = runtime_grants(incident_details=incident_details)
    statements = grant_statements(role, grants)
    with translate_errors(target), psycopg.connect(
            target.url, connect_timeout=10, autocommit=True) as conn:
        _check_grantee(conn, role)
        try:
            with conn.transaction():
                for statement in statements:
                    conn.execute(statement)
                _check_taken(conn, role, grants)
                _check_append_only(conn, role)
        except psycopg.errors.InsufficientPrivilege as exc:
            raise _not_grantor(conn) from exc
        except psycopg.errors.DependentObjectsStillExist as exc:
            raise ConfigurationError(
                f"role {role!r} passed some of its privileges on to other roles (it held them "
                "WITH GRANT OPTION); revoke those grants first (nothing was changed)") from exc
    return [statement.as_string(None) for statement in statements]


def _not_grantor(conn: psycopg.Connection[Any]) -> ConfigurationError:
    return ConfigurationError(
        f"the user {conn.info.user!r} may not grant privileges on the {SCHEMA} schema's "
        "objects; run this as their owner (the migration role) or a superuser (nothing was "
        "changed)")


def _check_taken(conn: psycopg.Connection[Any], role: str, grants: tuple[Grant, ...]) -> None:
    """A GRANT by a user that holds the privilege without the grant option only warns."""
    row = conn.execute(_MISSING, _checks(grants, role)).fetchone()
    if row is not None and row[1]:
        raise _not_grantor(conn)


def _check_grantee(conn: psycopg.Connection[Any], role: str) -> None:
    row = conn.execute(
        """SELECT r.rolsuper, r.rolname = pg_get_userbyid(n.nspowner) AS owns
           FROM pg_roles r LEFT JOIN pg_namespace n ON n.nspname = %s
           WHERE r.rolname = %s""", (SCHEMA, role)).fetchone()
    if row is None:
        create = sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(role)).as_string(None)
        raise ConfigurationError(f"role {role!r} does not exist; create it first: {create}")
    superuser, owns = row
    if superuser or owns:
        what = "is a superuser" if superuser else f"owns the {SCHEMA} schema"
        raise ConfigurationError(
            f"role {role!r} {what}: no grant can restrict it; the runtime needs a role of its "
            "own (docs/security.md)")


def _check_append_only(conn: psycopg.Connection[Any], role: str) -> None:
    """What ``role`` holds through PUBLIC or a membership that would let it rewrite or
    delete the journal or the audit: a forbidden privilege on an :data:`APPEND_ONLY` table
    (UPDATE of a single column is enough), or EXECUTE on an :data:`OWNER_ONLY` function
    (``expire_evidence`` deletes audit rows)."""
    cur = conn.execute(
        """SELECT name FROM (
               SELECT t.name || ': ' || string_agg(p.privilege, ', ' ORDER BY p.privilege)
               FROM unnest(%(tables)s::text[]) AS t(name),
                    unnest(%(forbidden)s::text[]) AS p(privilege)
               WHERE CASE WHEN p.privilege = 'UPDATE'
                          THEN has_any_column_privilege(%(role)s, t.name, 'UPDATE')
                          ELSE has_table_privilege(%(role)s, t.name, p.privilege) END
               GROUP BY t.name
               UNION ALL
               SELECT f.name || ': EXECUTE' FROM unnest(%(functions)s::text[]) AS f(name)
               WHERE has_function_privilege(%(role)s, f.name, 'EXECUTE')) AS held(name)
           ORDER BY name""",
        {"tables": list(APPEND_ONLY), "forbidden": list(FORBIDDEN),
         "functions": list(OWNER_ONLY), "role": role})
    held = [str(row[0]) for row in cur.fetchall()]
    if held:
        raise ConfigurationError(
            f"role {role!r} would still hold {'; '.join(held)} through PUBLIC or a role it is "
            "a member of; revoke it there and run this again (nothing was changed)")


_MISSING = """
WITH u AS (SELECT COALESCE(%(role)s::name, current_user) AS who)
SELECT u.who, ARRAY(
    SELECT p.what
    FROM unnest(%(kinds)s::text[], %(names)s::text[], %(columns)s::text[],
                %(privileges)s::text[], %(whats)s::text[]) WITH ORDINALITY
         AS p(kind, name, col, privilege, what, n)
    WHERE NOT CASE
        WHEN p.kind = 'schema' THEN has_schema_privilege(u.who, p.name, p.privilege)
        WHEN p.kind = 'function' THEN has_function_privilege(u.who, p.name, p.privilege)
        WHEN p.col IS NOT NULL THEN has_column_privilege(u.who, p.name, p.col, p.privilege)
        ELSE has_table_privilege(u.who, p.name, p.privilege) END
    ORDER BY p.n) AS missing
FROM u
"""
"""Which of a list of privileges a role (NULL: the current user) lacks, in the list's order."""


def _checks(grants: tuple[Grant, ...], role: str | None) -> dict[str, Any]:
    rows: list[tuple[str, str, str | None, str, str]] = []
    for grant in grants:
        for privilege in grant.privileges:
            for column in grant.columns or (None,):
                rows.append((grant.kind, grant.name, column, privilege,
                             grant.describe(privilege, column)))
    keys = ("kinds", "names", "columns", "privileges", "whats")
    params: dict[str, Any] = {key: [row[i] for row in rows] for i, key in enumerate(keys)}
    params["role"] = role
    return params


async def privileges_missing(conn: Conn, grants: tuple[Grant, ...] = REQUIRED
                             ) -> tuple[str, list[str]]:
    """The current user and every privilege of ``grants`` it lacks, in one query."""
    row = await (await conn.execute(_MISSING, _checks(grants, None))).fetchone()
    assert row is not None
    return str(row["who"]), list(row["missing"])


async def require_privileges(conn: Conn, what: str) -> None:
    """Refuse to start ``what`` (a worker, a reconciler) without every privilege it uses:
    ``CONFIGURATION_ERROR`` naming each one, instead of a failure at the first statement
    that needs it."""
    who, missing = await privileges_missing(conn)
    if missing:
        raise ConfigurationError(
            f"the database user {who!r} lacks privileges a {what} needs: "
            f"{', '.join(missing)}; grant them with `orchestrator db grant --role {who}` "
            "(see docs/security.md)")
