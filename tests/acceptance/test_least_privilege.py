"""Least privilege (docs/security.md): the engine runs as a role that owns nothing, holds only
what ``orchestrator db grant`` gives it, and cannot rewrite or delete the journal or the
operator audit; a privilege it lacks is a CONFIGURATION_ERROR that names it, never INTERNAL."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.rows import dict_row

from orchestrator import Orchestrator, RunFailed
from tests.acceptance import flows
from tests.acceptance.conftest import ROOT, Workers
from tests.clitools import run_cli
from tests.roles import Role, create_role, drop_role

APP = "tests.acceptance.flows:app"

_SINK_GRANTS = """
GRANT SELECT, INSERT, UPDATE ON public.sink_calls, public.sink_effects TO {role};
GRANT USAGE ON SEQUENCE public.sink_calls_id_seq TO {role};
"""
"""The acceptance tools write to the test's own sink tables, with the runtime's URL."""


def _grant(admin_url: str, role: Role) -> None:
    done = run_cli(["db", "grant", "--role", role.name], database_url=admin_url)
    assert done.returncode == 0, done.stderr
    assert f"role {role.name!r} has the runtime's privileges" in done.stdout


def _runtime(migrated_database_url: str, make_role: Any) -> Role:
    role = make_role()
    role.sql(flows.SINK_DDL)
    role.sql(_SINK_GRANTS)
    _grant(migrated_database_url, role)
    return role


def _cli(role: Role, *args: str) -> tuple[int, str, str]:
    done = run_cli(["--database-url", role.url, *args], database_url=role.url)
    return done.returncode, done.stdout, done.stderr


def _start(role: Role, logs: Path, name: str, command: str, **env: str
           ) -> subprocess.Popen[bytes]:
    environ = {**os.environ, "ORCHESTRATOR_DATABASE_URL": role.url, "PYTHONPATH": str(ROOT),
               **env}
    with open(logs / f"{name}.log", "wb") as log:
        return subprocess.Popen([sys.executable, "-m", "orchestrator", command, "--app", APP],
                                cwd=ROOT, env=environ, stdout=log, stderr=subprocess.STDOUT)


def _stop(proc: subprocess.Popen[bytes]) -> int:
    proc.send_signal(signal.SIGTERM)
    return proc.wait(timeout=30)


def test_workers_reconcilers_clients_and_operators_run_as_the_runtime_role(
        migrated_database_url, make_role, tmp_path):
    role = _runtime(migrated_database_url, make_role)
    # Functions are PUBLIC's by default: not here, so that only the role's own grants count
    # (and the trigger functions need none: a trigger that fires checks no privilege).
    role.sql("REVOKE EXECUTE ON ALL FUNCTIONS IN SCHEMA orchestrator FROM PUBLIC")
    workers = Workers(role.url, tmp_path)  # its own connection is the runtime role's too
    client = Orchestrator(role.url, default_owner=flows.app.default_owner)
    client.registry = flows.app.registry
    reconciler = None
    try:
        lost = {}  # three calls whose worker died in flight: their outcome is unknown
        for name, tool, point in (("settle", "record", "after_submitted"),
                                  ("abandon", "record", "after_submitted"),
                                  ("lookup", "record_with_lookup", "after_tool_return")):
            crashing = workers.start(f"crash-{name}", ORCHESTRATOR_FAULT_POINT=point,
                                     ORCHESTRATOR_FAULT_TOOL=tool)
            lost[name] = client.submit(flows.one_call, {"tool": tool})
            assert crashing.wait(timeout=30) == -9, workers.log(f"crash-{name}")
        worker = workers.start("worker")
        reconciler = _start(role, tmp_path, "reconciler", "reconciler")
        plain = [client.submit(flows.three_steps, {"n": n}) for n in range(3)]
        plain.append(client.submit(flows.single, {"n": 9}))

        for run in plain:
            assert client.get_run(run.id).result(timeout=30)
        # The reconciler's lookup finds the effect: committed with the provider's receipt.
        assert lost["lookup"].result(timeout=30)["step"] == 1
        ops = {name: role.sql("SELECT id FROM orchestrator.operations WHERE run_id = %s "
                              "ORDER BY attempt LIMIT 1", (run.id,))[0]["id"]
               for name, run in lost.items()}
        workers.wait(lambda: len(role.sql(
            "SELECT 1 FROM orchestrator.reconciliation_items WHERE state = 'operator'")) == 2,
            "the reconciler to hand the calls without a lookup to operators")

        code, out, err = _cli(role, "ops", "list")
        assert code == 0, err
        assert str(ops["settle"]) in out and str(ops["abandon"]) in out
        code, out, err = _cli(role, "ops", "show", str(ops["settle"]))
        assert code == 0, err
        assert f"orchestrator ops resolve {ops['settle']} --committed" in out
        code, _, err = _cli(role, "ops", "resolve", str(ops["settle"]), "--committed",
                            "--receipt", '{"step": 1, "key": "by hand"}',
                            "--evidence", "the sink shows it", "--operator", "alice")
        assert code == 0, err
        assert lost["settle"].result(timeout=30) == {"step": 1, "key": "by hand"}
        code, _, err = _cli(role, "ops", "abandon", str(ops["abandon"]),
                            "--evidence", "refunded by hand", "--operator", "alice")
        assert code == 0, err
        with pytest.raises(RunFailed) as failed:
            lost["abandon"].result(timeout=30)
        assert failed.value.code == "OPERATION_ABANDONED"
        code, out, err = _cli(role, "incidents", "show", failed.value.incident,
                              "--operator", "alice")
        assert code == 0, err
        assert "refunded by hand" in out
        code, out, err = _cli(role, "runs", "show", str(lost["settle"].id))
        assert code == 0 and "succeeded" in out, err

        audit = role.sql("SELECT action, operator FROM orchestrator.operator_audit ORDER BY id")
        assert sorted(a["operator"] for a in audit) == ["alice", "alice", "reconciler"]
        assert _stop(worker) == 0  # the drain, the unregistration: all within the grants
        assert _stop(reconciler) == 0
        for name in ("worker", "reconciler"):
            log = (tmp_path / f"{name}.log").read_text()
            assert "failed" not in log and "permission denied" not in log, log
    finally:
        if reconciler is not None and reconciler.poll() is None:
            reconciler.kill()
            reconciler.wait()
        client.close()
        workers.close()


def _insert_run(conn: psycopg.Connection[Any]) -> str:
    row = conn.execute(
        """INSERT INTO orchestrator.runs (id, tenant, principal, workflow_name, workflow_version,
                                          input, request_digest)
           VALUES (gen_random_uuid(), 't', 'p', 'w', '1', '{}', 'd') RETURNING id""").fetchone()
    assert row is not None
    return str(row[0])


def test_the_journal_and_the_audit_are_append_only_by_grant(migrated_database_url,
                                                           make_role):
    role = make_role()
    # Someone gave the role everything; `db grant` takes back what it must not have.
    role.sql("GRANT ALL ON ALL TABLES IN SCHEMA orchestrator TO {role}")
    _grant(migrated_database_url, role)
    with psycopg.connect(role.url, autocommit=True) as conn:
        run_id = _insert_run(conn)
        conn.execute("""INSERT INTO orchestrator.journal_entries (run_id, seq, kind, schema_version,
                                                          lease_token)
                        VALUES (%s, 1, 'run.note', 1, 0)""", (run_id,))
        conn.execute("""INSERT INTO orchestrator.operator_audit (operator, action, target_kind,
                                                                target_id, evidence)
                        VALUES ('alice', 'note', 'run', %s, 'a test')""", (run_id,))
        assert conn.execute("SELECT count(*) FROM orchestrator.journal").fetchone() == (1,)
        assert conn.execute("SELECT count(*) FROM orchestrator.operator_audit").fetchone() == (1,)
        for statement in ("UPDATE orchestrator.journal_entries SET kind = 'x'",
                          "DELETE FROM orchestrator.journal_entries",
                          "TRUNCATE orchestrator.journal_entries",
                          "UPDATE orchestrator.operator_audit SET evidence = 'x'",
                          "DELETE FROM orchestrator.operator_audit",
                          "TRUNCATE orchestrator.operator_audit",
                          "DELETE FROM orchestrator.runs"):
            with pytest.raises(psycopg.errors.InsufficientPrivilege, match="permission denied"):
                conn.execute(statement)
    assert role.sql("SELECT count(*) AS n FROM orchestrator.journal") == [{"n": 1}]


def _grant_all_but_deletes(role: Role) -> None:
    """What a deployment might have given its role before docs/security.md existed: the
    tables without DELETE, the schema, the functions (PUBLIC has them anyway)."""
    role.sql("""GRANT USAGE ON SCHEMA orchestrator TO {role};
                GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA orchestrator TO {role}""")


def test_a_worker_without_delete_on_workers_refuses_to_start(migrated_database_url,
                                                             make_role, tmp_path):
    role = make_role()
    _grant_all_but_deletes(role)
    proc = _start(role, tmp_path, "worker", "worker")
    try:
        code = proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    out = (tmp_path / "worker.log").read_text()
    assert code == 2, out
    assert "orchestrator: error: CONFIGURATION_ERROR:" in out
    assert "DELETE on orchestrator.workers" in out and "orchestrator db grant" in out
    assert "INTERNAL" not in out
    code, _, err = _cli(role, "reconciler", "--app", APP)
    assert code == 2 and "CONFIGURATION_ERROR" in err and "DELETE on orchestrator.workers" in err


def test_a_worker_that_loses_a_privilege_keeps_working(migrated_database_url, make_role,
                                                       tmp_path):
    role = _runtime(migrated_database_url, make_role)
    workers = Workers(role.url, tmp_path)
    client = Orchestrator(role.url, default_owner=flows.app.default_owner)
    client.registry = flows.app.registry
    try:
        worker = workers.start("worker")
        role.sql("REVOKE DELETE ON orchestrator.workers FROM {role}")  # its sweep needs it
        workers.wait(lambda: "permission denied for table workers" in workers.log("worker"),
                     "the sweep to meet the missing privilege", proc=worker)
        assert client.submit(flows.single, {"n": 1}).result(timeout=30)["step"] == 1
        assert worker.poll() is None
        assert _stop(worker) == 0
        log = workers.log("worker")
        assert "lease sweep failed: CONFIGURATION_ERROR:" in log and "INTERNAL" not in log
    finally:
        client.close()
        workers.close()


def _privileges(role: Role) -> list[dict[str, Any]]:
    return role.sql(
        """SELECT c.relname AS object, a.privilege_type AS privilege
           FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace,
                aclexplode(c.relacl) a
           WHERE n.nspname = 'orchestrator' AND a.grantee = %(r)s::regrole
           UNION ALL
           SELECT p.oid::regprocedure::text, a.privilege_type
           FROM pg_proc p JOIN pg_namespace n ON n.oid = p.pronamespace,
                aclexplode(p.proacl) a
           WHERE n.nspname = 'orchestrator' AND a.grantee = %(r)s::regrole
           ORDER BY 1, 2""", {"r": role.name})


def test_db_grant_is_idempotent_and_refuses_what_it_cannot_do(migrated_database_url,
                                                              make_role):
    role = make_role()
    _grant(migrated_database_url, role)
    first = _privileges(role)
    assert {"object": "journal_entries", "privilege": "INSERT"} in first
    assert {"object": "journal", "privilege": "SELECT"} in first  # the view
    assert {"object": "journal", "privilege": "INSERT"} not in first
    assert {"object": "workers", "privilege": "DELETE"} in first
    assert not [p for p in first if p["object"] in ("journal_entries", "operator_audit")
                and p["privilege"] in ("UPDATE", "DELETE", "TRUNCATE")]
    _grant(migrated_database_url, role)
    assert _privileges(role) == first

    missing = run_cli(["db", "grant", "--role", role.name + "_nobody"],
                      database_url=migrated_database_url)
    assert missing.returncode == 2
    assert missing.stderr_lines == [
        f"orchestrator: error: CONFIGURATION_ERROR: role '{role.name}_nobody' does not exist; "
        f'create it first: CREATE ROLE "{role.name}_nobody" LOGIN']

    # The runtime role itself holds its privileges without the grant option: it may not grant.
    other = make_role("rt2")
    refused = run_cli(["--database-url", role.url, "db", "grant", "--role", other.name])
    assert refused.returncode == 2, refused.stdout
    assert "may not grant privileges" in refused.stderr and "nothing was changed" in refused.stderr
    assert _privileges(other) == []

    # A member of a role that may delete the journal would keep that through the membership.
    role.sql("GRANT DELETE ON orchestrator.journal_entries TO {role}")
    role.sql(sql.SQL("GRANT {} TO {}").format(sql.Identifier(role.name),
                                              sql.Identifier(other.name)))
    inherited = run_cli(["db", "grant", "--role", other.name], database_url=migrated_database_url)
    assert inherited.returncode == 2
    assert ("orchestrator.journal_entries: DELETE through PUBLIC or a role it is a member of"
            in inherited.stderr)
    assert _privileges(other) == []  # rolled back

    # A role that passed a privilege on (it had the grant option) cannot be reset silently.
    lender, borrower = make_role("lend"), make_role("borrow")
    lender.sql("GRANT USAGE ON SCHEMA orchestrator TO {role}; "
               "GRANT SELECT ON orchestrator.runs TO {role} WITH GRANT OPTION")
    with psycopg.connect(lender.url, autocommit=True) as conn:
        conn.execute(sql.SQL("GRANT SELECT ON orchestrator.runs TO {}").format(
            sql.Identifier(borrower.name)))
    lent = run_cli(["db", "grant", "--role", lender.name], database_url=migrated_database_url)
    assert lent.returncode == 2 and "passed some of its privileges on" in lent.stderr

    admin = role.sql("SELECT current_user AS u")[0]["u"]
    refused = run_cli(["db", "grant", "--role", admin], database_url=migrated_database_url)
    assert refused.returncode == 2 and "CONFIGURATION_ERROR" in refused.stderr


def test_a_migration_role_that_is_no_superuser_upgrades_and_grants(empty_database_url):
    admin = psycopg.connect(empty_database_url, autocommit=True, row_factory=dict_row)
    owner = create_role(admin, empty_database_url, "owner")
    runtime = create_role(admin, empty_database_url, "rt")
    try:
        # All the migration role needs: to create the schema (then it owns what is in it).
        owner.sql("GRANT CREATE ON DATABASE {db} TO {role}".replace(
            "{db}", sql.Identifier(admin.info.dbname).as_string(admin)))
        upgraded = run_cli(["db", "upgrade"], database_url=owner.url)
        assert upgraded.returncode == 0, upgraded.stderr
        granted = run_cli(["db", "grant", "--role", runtime.name], database_url=owner.url)
        assert granted.returncode == 0, granted.stderr
        checked = run_cli(["db", "check"], database_url=runtime.url)
        assert checked.returncode == 0, checked.stderr
    finally:
        for role in (runtime, owner):
            drop_role(role)
        admin.close()
