"""The runtime role's grants against the migrated schema itself, and the seam's translation of
a missing privilege (docs/security.md)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
from psycopg import sql as pg_sql

from orchestrator.db import events as events_db
from orchestrator.db import grants
from orchestrator.db import workers as workers_db
from orchestrator.db.config import DatabaseTarget, validate_url
from orchestrator.db.database import Database
from orchestrator.errors import ConfigurationError


def test_every_object_the_migrations_create_has_its_decision(sql):
    """A table or function a migration adds is granted (or left out on purpose) here."""
    tables = {r["name"] for r in sql(
        "SELECT 'orchestrator.' || relname AS name FROM pg_class c "
        "JOIN pg_namespace n ON n.oid = c.relnamespace "
        "WHERE n.nspname = 'orchestrator' AND c.relkind IN ('r', 'p', 'v', 'm')")}
    assert tables == {g.name for g in grants.RUNTIME if g.kind == "table"}
    functions = {r["name"].replace(" ", "") for r in sql(
        "SELECT p.oid::regprocedure::text AS name FROM pg_proc p "
        "JOIN pg_namespace n ON n.oid = p.pronamespace "
        "WHERE n.nspname = 'orchestrator' AND p.prorettype <> 'trigger'::regtype")}
    assert functions == {g.name.replace(" ", "") for g in grants.RUNTIME if g.kind == "function"
                         } | {name.replace(" ", "") for name in grants.OWNER_ONLY}
    # Every generated key is an identity column: no sequence needs a grant.
    assert sql("SELECT a.attrelid::regclass::text AS t FROM pg_attribute a "
               "JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum "
               "JOIN pg_class c ON c.oid = a.attrelid "
               "JOIN pg_namespace n ON n.oid = c.relnamespace "
               "WHERE n.nspname = 'orchestrator' "
               "AND pg_get_expr(d.adbin, d.adrelid) LIKE 'nextval%%'") == []


def _database(url: str) -> Database:
    return Database(DatabaseTarget(validate_url(url), "argument"), max_pool_size=1)


async def test_a_missing_privilege_is_a_configuration_error_naming_it(make_role):
    role = make_role()
    role.sql("""GRANT USAGE ON SCHEMA orchestrator TO {role};
                GRANT SELECT, INSERT, UPDATE ON orchestrator.workers TO {role};
                REVOKE EXECUTE ON FUNCTION orchestrator.runs_ready(text[], integer)
                    FROM PUBLIC""")
    db = _database(role.url)
    try:
        async with db.connection() as conn:
            who, missing = await grants.privileges_missing(conn)
        assert who == role.name
        assert "DELETE on orchestrator.workers" in missing
        assert "INSERT on orchestrator.journal_entries" in missing
        assert "SELECT on orchestrator.journal" in missing  # the view
        assert "EXECUTE on function orchestrator.runs_ready(text[], integer)" in missing
        assert "SELECT (ref) on orchestrator.incidents" in missing
        assert "SELECT on orchestrator.workers" not in missing
        assert not [m for m in missing if "pg_catalog" in m]  # PUBLIC has those

        with pytest.raises(ConfigurationError) as refused:
            async with db.connection() as conn:
                await grants.require_privileges(conn, "worker")
        assert refused.value.code == "CONFIGURATION_ERROR"
        assert "lacks privileges a worker needs: " in refused.value.message
        assert f"orchestrator db grant --role {role.name}" in refused.value.message

        with pytest.raises(ConfigurationError) as denied:
            async with db.connection() as conn:
                await workers_db.worker_forget_dead(conn)
        assert "permission denied for table workers" in denied.value.message
        assert "orchestrator db grant" in denied.value.message
        assert isinstance(denied.value.__cause__, Exception)
    finally:
        await db.close()


async def test_without_incident_details_the_engine_runs_and_only_details_are_refused(
        make_role, migrated_database_url):
    role = make_role()
    admin = DatabaseTarget(validate_url(migrated_database_url), "argument")
    grants.grant_runtime(admin, role.name, incident_details=False)
    run_id = role.sql("""INSERT INTO orchestrator.runs (id, tenant, principal, workflow_name,
                                                        workflow_version, input, request_digest)
                         VALUES (gen_random_uuid(), 't', 'p', 'w', '1', '{{}}', 'd')
                         RETURNING id""")[0]["id"]
    db = _database(role.url)
    try:
        async with db.connection() as conn:
            assert (await grants.privileges_missing(conn))[1] == []
            row = {"ref": "inc_1", "code": "TOOL_ERROR", "run_id": run_id, "operation_id": 7,
                   "phase": "call", "cause": "KeyError", "upstream_status": None,
                   "detail": '{"message": "token=secret"}'}
            await events_db.incident_record(conn, row)
            await events_db.incident_record(conn, row)  # ON CONFLICT (ref) reads ref only
            listed = await events_db.incidents_of_operations(conn, run_id, [7])
            assert [r["ref"] for r in listed] == ["inc_1"]
        with pytest.raises(ConfigurationError, match="permission denied for table incidents"):
            async with db.connection() as conn:
                await events_db.incident_get(conn, "inc_1")
    finally:
        await db.close()


def _admin(url: str) -> DatabaseTarget:
    return DatabaseTarget(validate_url(url), "argument")


def test_db_grant_takes_expire_evidence_back_from_a_role_given_every_function(
        make_role, migrated_database_url):
    """A deployment that once gave its role every function of the schema: after `db grant`
    it keeps none of the owner's, so it cannot delete the audit it may only append to."""
    role = make_role()
    role.sql("GRANT EXECUTE ON ALL FUNCTIONS IN SCHEMA orchestrator TO {role}")
    grants.grant_runtime(_admin(migrated_database_url), role.name)
    role.sql("""INSERT INTO orchestrator.operator_audit (operator, action, target_kind,
                                                        target_id, evidence)
                VALUES ('alice', 'note', 'run', 'r1', 'a test')""")
    with psycopg.connect(role.url, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.InsufficientPrivilege):
            conn.execute("SELECT * FROM orchestrator.expire_evidence(0, 1000, false)")
    assert role.sql("SELECT count(*) AS n FROM orchestrator.operator_audit") == [{"n": 1}]


@pytest.mark.parametrize(("privilege", "held"), [
    ("UPDATE (evidence) ON orchestrator.operator_audit", "operator_audit: UPDATE"),
    ("EXECUTE ON FUNCTION orchestrator.expire_evidence(float8, integer, boolean)",
     "expire_evidence(double precision, integer, boolean): EXECUTE"),
])
def test_db_grant_refuses_a_role_that_could_rewrite_the_audit_through_a_membership(
        make_role, migrated_database_url, privilege, held):
    """A grant on one column of the audit, or on the function that deletes it, held by a
    role the runtime role is a member of, would outlive `db grant`: it is refused."""
    group, role = make_role("grp"), make_role()
    group.sql(f"GRANT {privilege} TO {{role}}")
    role.sql(pg_sql.SQL("GRANT {} TO {}").format(pg_sql.Identifier(group.name),
                                                 pg_sql.Identifier(role.name)))
    with pytest.raises(ConfigurationError) as refused:
        grants.grant_runtime(_admin(migrated_database_url), role.name)
    assert held in refused.value.message
    assert "through PUBLIC or a role it is a member of" in refused.value.message
    assert role.sql("SELECT has_table_privilege(%s, 'orchestrator.runs', 'INSERT') AS granted",
                    (role.name,)) == [{"granted": False}]  # rolled back


def _settled_item(role: Any, *, resolution: str) -> tuple[int, int]:
    """An operation that went unknown and was settled as ``resolution``, and its resolved
    reconciliation item, written as the engine writes them (as the schema's owner). Returns
    (operation id, item id)."""
    (row,) = role.sql("""
        WITH run AS (
            INSERT INTO orchestrator.runs (id, tenant, principal, workflow_name,
                                           workflow_version, input, request_digest)
            VALUES (gen_random_uuid(), 't', 'p', 'w', '1', '{{}}', 'd') RETURNING id)
        INSERT INTO orchestrator.operations
            (run_id, position, attempt, tool_name, tool_version, effect_class, tenant,
             principal, intent_digest, arguments, idempotency_key, state, lease_token)
        SELECT id, 0, 1, 'charge', '1', 'consequential', 't', 'p', 'i', '{{}}', 'k',
               'submitted', 1 FROM run
        RETURNING id, run_id""")
    role.sql("UPDATE orchestrator.operations SET state = 'unknown' WHERE id = %s", (row["id"],))
    (item,) = role.sql("""INSERT INTO orchestrator.reconciliation_items (operation_id, run_id,
                                                                         reason)
                          VALUES (%s, %s, 'WORKER_LOST') RETURNING id""",
                       (row["id"], row["run_id"]))
    receipt = ("""receipt = '{{"charged": true}}', receipt_digest = 'd',"""
               if resolution == "committed" else "")
    role.sql(f"""UPDATE orchestrator.operations SET state = %s, {receipt} finished_at = now()
                 WHERE id = %s""", (resolution, row["id"]))
    role.sql("""UPDATE orchestrator.reconciliation_items SET state = 'resolved',
                       resolution = %s, resolved_at = now() WHERE id = %s""",
             (resolution, item["id"]))
    return row["id"], item["id"]


@pytest.mark.parametrize("change", [
    "resolution = 'not_applied'", "state = 'operator'", "state = 'open', resolution = NULL",
    "resolved_at = now() + interval '1 day'", "resolved_at = NULL",
    "evidence = '[{\"note\": \"rewritten\"}]'", "reason = 'OUTCOME_UNRECORDED'",
])
def test_a_resolved_reconciliation_item_cannot_be_rewritten_by_the_runtime_role(
        make_role, migrated_database_url, change):
    """The runtime role holds UPDATE on the reconciliation queue (claims, lookups, hand-overs),
    but once an item is resolved what it says was decided is fixed, for every role, as a
    final operation's receipt is (docs/security.md)."""
    role = make_role()
    grants.grant_runtime(_admin(migrated_database_url), role.name)
    _, item = _settled_item(role, resolution="committed")
    with psycopg.connect(role.url, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.CheckViolation, match="is resolved"):
            conn.execute(f"UPDATE orchestrator.reconciliation_items SET {change} "
                         "WHERE id = %s", (item,))
        # What the engine still does to a resolved item: a late lookup is numbered in turn,
        # a lapsed claim cleared.
        conn.execute("UPDATE orchestrator.reconciliation_items SET lookup_attempts = "
                     "lookup_attempts + 1, claimed_by = NULL, claimed_until = NULL "
                     "WHERE id = %s", (item,))
    with pytest.raises(psycopg.errors.CheckViolation, match="is resolved"):  # the owner too
        escaped = change.replace("{", "{{").replace("}", "}}")  # role.sql formats {role}
        role.sql(f"UPDATE orchestrator.reconciliation_items SET {escaped} WHERE id = %s",
                 (item,))
    assert role.sql("SELECT state, resolution, lookup_attempts FROM "
                    "orchestrator.reconciliation_items WHERE id = %s", (item,)) == [
        {"state": "resolved", "resolution": "committed", "lookup_attempts": 1}]


def test_an_item_is_resolved_only_as_its_operation_was_settled(make_role,
                                                                migrated_database_url):
    """A reconciliation item says what the ledger says: it cannot be resolved while its
    operation is still unknown, nor as anything but the state the operation was settled in,
    nor be written settled from the start."""
    role = make_role()
    grants.grant_runtime(_admin(migrated_database_url), role.name)
    op_id, _ = _settled_item(role, resolution="not_applied")
    other, _ = _settled_item(role, resolution="abandoned")
    role.sql("DELETE FROM orchestrator.reconciliation_items WHERE operation_id = %s", (other,))
    with psycopg.connect(role.url, autocommit=True) as conn:
        for resolution in ("committed", "not_applied"):  # the operation was abandoned
            with pytest.raises(psycopg.errors.CheckViolation, match="its operation is abandoned"):
                conn.execute("""INSERT INTO orchestrator.reconciliation_items
                                    (operation_id, run_id, reason, state, resolution,
                                     resolved_at)
                                SELECT id, run_id, 'x', 'resolved', %s, now()
                                FROM orchestrator.operations WHERE id = %s""",
                             (resolution, other))
    # An item whose operation is still unknown.
    (row,) = role.sql("""
        INSERT INTO orchestrator.operations
            (run_id, position, attempt, tool_name, tool_version, effect_class, tenant,
             principal, intent_digest, arguments, idempotency_key, state, lease_token)
        SELECT run_id, 1, 1, 'charge', '1', 'consequential', 't', 'p', 'i', '{{}}', 'k2',
               'submitted', 1 FROM orchestrator.operations WHERE id = %s
        RETURNING id, run_id""", (op_id,))
    role.sql("UPDATE orchestrator.operations SET state = 'unknown' WHERE id = %s", (row["id"],))
    (pending,) = role.sql("""INSERT INTO orchestrator.reconciliation_items
                                 (operation_id, run_id, reason)
                             VALUES (%s, %s, 'WORKER_LOST') RETURNING id""",
                          (row["id"], row["run_id"]))
    with psycopg.connect(role.url, autocommit=True) as conn:
        with pytest.raises(psycopg.errors.CheckViolation, match="its operation is unknown"):
            conn.execute("UPDATE orchestrator.reconciliation_items SET state = 'resolved', "
                         "resolution = 'committed', resolved_at = now() WHERE id = %s",
                         (pending["id"],))
    assert role.sql("SELECT state FROM orchestrator.reconciliation_items WHERE id = %s",
                    (pending["id"],)) == [{"state": "open"}]


@pytest.mark.parametrize("function", ["pg_try_advisory_lock(bigint)",
                                      "pg_try_advisory_xact_lock(integer, integer)"])
async def test_a_worker_checks_the_lock_functions_it_calls(make_role, migrated_database_url,
                                                           function):
    """A worker takes its liveness lock with ``pg_try_advisory_lock`` (never waiting for it),
    and ``tool_admit`` takes a tool's admission lock with ``pg_try_advisory_xact_lock``: a
    cluster that revoked one from PUBLIC leaves a worker that beats but never claims, or whose
    every limited call fails, so the check at start names each, not the blocking
    ``pg_advisory_lock`` that nothing calls."""
    role = make_role()
    grants.grant_runtime(DatabaseTarget(validate_url(migrated_database_url), "argument"),
                         role.name)
    role.sql(f"REVOKE EXECUTE ON FUNCTION pg_catalog.{function} FROM PUBLIC")
    db = _database(role.url)
    try:
        async with db.connection() as conn:
            _, missing = await grants.privileges_missing(conn)
        assert missing == [f"EXECUTE on function pg_catalog.{function}"]
    finally:
        await db.close()
