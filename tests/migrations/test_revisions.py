"""The migrations build exactly the schema the table definitions describe, and walk back cleanly."""

from __future__ import annotations

import time
import uuid
from typing import Any

import psycopg
import pytest
from alembic.autogenerate import compare_metadata
from alembic.migration import MigrationContext
from alembic.script import Script, ScriptDirectory
from sqlalchemy import create_engine, pool

from orchestrator.db import migrate
from orchestrator.db.config import DatabaseTarget, validate_url
from orchestrator.db.schema import FILLFACTOR, INDEX_FILLFACTOR, SCHEMA, VIEWS, metadata
from orchestrator.errors import ConfigurationError


def _target(url: str) -> DatabaseTarget:
    return DatabaseTarget(validate_url(url), "argument")


def _revisions_oldest_first() -> list[Script]:
    script = ScriptDirectory(str(migrate.script_location()))
    return list(reversed(list(script.walk_revisions())))


def _schema_diff(target: DatabaseTarget) -> list[Any]:
    """What autogenerate would change to make the database match ``metadata``."""
    engine = create_engine(target.sqlalchemy_url, poolclass=pool.NullPool)
    try:
        with engine.connect() as conn:
            context = MigrationContext.configure(
                conn,
                opts={
                    "include_schemas": True,
                    "include_name": migrate.include_name,
                    "version_table": migrate.VERSION_TABLE,
                    "version_table_schema": SCHEMA,
                    "compare_type": True,
                    "compare_server_default": True,
                },
            )
            return list(compare_metadata(context, metadata))
    finally:
        engine.dispose()


def _snapshot(url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Everything a migration can create in our schema, except Alembic's version table."""
    queries = {
        "columns": """
            SELECT table_name, column_name, data_type, is_nullable, column_default
            FROM information_schema.columns
            WHERE table_schema = %(s)s AND table_name <> %(v)s
            ORDER BY 1, 2""",
        "constraints": """
            SELECT rel.relname, con.conname, pg_get_constraintdef(con.oid)
            FROM pg_constraint con JOIN pg_class rel ON rel.oid = con.conrelid
            JOIN pg_namespace ns ON ns.oid = rel.relnamespace
            WHERE ns.nspname = %(s)s AND rel.relname <> %(v)s
            ORDER BY 1, 2""",
        "indexes": """
            SELECT tablename, indexname, indexdef FROM pg_indexes
            WHERE schemaname = %(s)s AND tablename <> %(v)s ORDER BY 1, 2""",
        "triggers": """
            SELECT rel.relname, tg.tgname, pg_get_triggerdef(tg.oid)
            FROM pg_trigger tg JOIN pg_class rel ON rel.oid = tg.tgrelid
            JOIN pg_namespace ns ON ns.oid = rel.relnamespace
            WHERE ns.nspname = %(s)s AND NOT tg.tgisinternal ORDER BY 1, 2""",
        "functions": """
            SELECT p.proname, p.prosrc FROM pg_proc p
            JOIN pg_namespace ns ON ns.oid = p.pronamespace
            WHERE ns.nspname = %(s)s ORDER BY 1""",
        "storage": """
            SELECT c.relname, c.reloptions FROM pg_class c
            JOIN pg_namespace ns ON ns.oid = c.relnamespace
            WHERE ns.nspname = %(s)s AND c.relkind = 'r' AND c.relname <> %(v)s
            ORDER BY 1""",
        "sequences": """
            SELECT sequencename FROM pg_sequences WHERE schemaname = %(s)s ORDER BY 1""",
        "types": """
            SELECT t.typname FROM pg_type t JOIN pg_namespace ns ON ns.oid = t.typnamespace
            WHERE ns.nspname = %(s)s AND t.typtype IN ('e', 'd', 'c')
              AND NOT EXISTS (SELECT 1 FROM pg_class c WHERE c.reltype = t.oid)
            ORDER BY 1""",
    }
    params = {"s": SCHEMA, "v": migrate.VERSION_TABLE}
    with psycopg.connect(url) as conn:
        return {name: conn.execute(q, params).fetchall() for name, q in queries.items()}


def test_exactly_one_head() -> None:
    script = ScriptDirectory(str(migrate.script_location()))
    assert len(script.get_heads()) == 1
    assert migrate.head_revision() == script.get_current_head()


def test_every_revision_has_a_downgrade_target_in_history() -> None:
    revisions = _revisions_oldest_first()
    assert revisions, "no migrations found"
    assert revisions[0].down_revision is None
    known = {r.revision for r in revisions}
    for rev in revisions[1:]:
        assert rev.down_revision in known


def test_upgrade_from_empty_reaches_head(empty_database_url: str) -> None:
    target = _target(empty_database_url)
    assert migrate.check(target).state == "empty"

    status = migrate.upgrade(target)

    assert status.ok
    assert status.current == migrate.head_revision()
    tables = {name for name, *_ in _snapshot(empty_database_url)["columns"]}
    assert tables == {table.name for table in metadata.sorted_tables} | set(VIEWS)


def test_migrated_schema_equals_table_definitions(migrated_database_url: str) -> None:
    assert _schema_diff(_target(migrated_database_url)) == []


def test_rewritten_tables_leave_room_on_their_pages(migrated_database_url: str) -> None:
    """Storage parameters are outside what autogenerate compares: checked here."""
    storage = dict(_snapshot(migrated_database_url)["storage"])
    for table in metadata.sorted_tables:
        want = FILLFACTOR.get(table.name)
        assert storage[table.name] == (None if want is None else [f"fillfactor={want}"])


def test_indexes_of_runs_split_their_leaf_pages_with_room_for_next_versions(
        migrated_database_url: str) -> None:
    """The indexes' storage parameters, outside what autogenerate compares (migration 0037)."""
    with psycopg.connect(migrated_database_url) as conn:
        got = dict(conn.execute(
            "SELECT c.relname, c.reloptions FROM pg_class c JOIN pg_namespace n "
            "ON n.oid = c.relnamespace WHERE n.nspname = %s AND c.relkind = 'i' "
            "AND c.reloptions IS NOT NULL", (SCHEMA,)).fetchall())
    assert got == {name: [f"fillfactor={want}"] for name, want in INDEX_FILLFACTOR.items()}


def test_upgrade_twice_is_a_no_op(migrated_database_url: str) -> None:
    target = _target(migrated_database_url)
    before = _snapshot(migrated_database_url)

    status = migrate.upgrade(target)

    assert status.ok
    assert _snapshot(migrated_database_url) == before


def test_up_down_up_for_every_revision(empty_database_url: str) -> None:
    target = _target(empty_database_url)
    for rev in _revisions_oldest_first():
        down = rev.down_revision
        assert down is None or isinstance(down, str), "merge revisions need their own walk"
        below = _snapshot(empty_database_url)

        migrate.upgrade(target, rev.revision)
        assert migrate.current_revision(target) == rev.revision
        above = _snapshot(empty_database_url)
        assert above != below, f"revision {rev.revision} changed nothing"

        migrate.downgrade(target, down or "base")
        assert migrate.current_revision(target) == down
        assert _snapshot(empty_database_url) == below, f"downgrade of {rev.revision} left things"

        migrate.upgrade(target, rev.revision)
        assert migrate.current_revision(target) == rev.revision
        assert _snapshot(empty_database_url) == above, f"re-upgrade to {rev.revision} differs"

    assert migrate.check(target).ok
    assert _schema_diff(target) == []


def test_schema_comparison_sees_our_tables(empty_database_url: str) -> None:
    # Guards the test above: a filter that hid everything would also report no difference.
    diff = _schema_diff(_target(empty_database_url))
    added = {entry[1].name for entry in diff if entry[0] == "add_table"}
    assert added == {table.name for table in metadata.sorted_tables}


def test_audit_rows_written_before_0008_take_their_operations_tenant(
        empty_database_url: str) -> None:
    target = _target(empty_database_url)
    migrate.upgrade(target, "0007")
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        conn.execute("""
            INSERT INTO orchestrator.runs (id, tenant, principal, workflow_name,
                                           workflow_version, input, request_digest)
            VALUES ('00000000-0000-0000-0000-000000000001', 'acme', 'alice', 'wf', '1',
                    '{}', 'd')""")
        conn.execute("""
            INSERT INTO orchestrator.operations (run_id, position, attempt, tool_name,
                tool_version, effect_class, tenant, principal, intent_digest, arguments,
                idempotency_key, state)
            VALUES ('00000000-0000-0000-0000-000000000001', 0, 1, 'charge', '1',
                    'consequential', 'acme', 'alice', 'i', '{}', 'k', 'pending')""")
        op_id = conn.execute("SELECT id FROM orchestrator.operations").fetchall()[0][0]
        for target_id in (str(op_id), "999"):  # the second's operation is gone
            conn.execute("""INSERT INTO orchestrator.operator_audit (operator, action,
                            target_kind, target_id, evidence) VALUES
                            ('alice', 'resolve.committed', 'operation', %s, 'seen')""",
                         (target_id,))
    migrate.upgrade(target)
    with psycopg.connect(empty_database_url) as conn:
        rows = conn.execute("SELECT target_id, tenant FROM orchestrator.operator_audit "
                            "ORDER BY id").fetchall()
    assert rows == [(str(op_id), "acme"), ("999", None)]


def test_runs_parked_for_a_turn_before_0018_take_their_tool(empty_database_url: str) -> None:
    """A run parked for a tool's turn when the database is upgraded is still woken by a call
    of that tool ending: its ``waiting_tool`` is read from its ``waiting_for``."""
    target = _target(empty_database_url)
    migrate.upgrade(target, "0017")
    parked = {
        "1": ("waiting", "the turn of tool payout"),
        "2": ("waiting", "timer, event 'paid', the turn of tool pay.v2-x, child run"),
        "3": ("waiting", "the turn of tool a, the turn of tool b"),
        "4": ("waiting", "event 'the turn of tool x'"),  # an event's name, no tool
        "5": ("waiting", "timer"),
        "6": ("queued", "a worker that understands its journal's schema version"),
    }
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        for n, (status, waiting_for) in parked.items():
            conn.execute("""
                INSERT INTO orchestrator.runs (id, tenant, principal, workflow_name,
                    workflow_version, input, request_digest, status, waiting_for, available_at)
                VALUES (%s, 'acme', 'alice', 'wf', '1', '{}', 'd', %s, %s,
                        now() + interval '1 hour')""",
                         (f"00000000-0000-0000-0000-00000000000{n}", status, waiting_for))
    migrate.upgrade(target)
    with psycopg.connect(empty_database_url) as conn:
        rows = conn.execute("SELECT right(id::text, 1), waiting_tool FROM orchestrator.runs "
                            "ORDER BY id").fetchall()
        assert rows == [("1", "payout"), ("2", "pay.v2-x"), ("3", "a"), ("4", None),
                        ("5", None), ("6", None)]
    # The wake's query (orchestrator.db.runs.run_wake_turn) can be answered by the index, in
    # its order (a table this small is read whole unless told otherwise). The upgrade built
    # the index after updating rows, so PostgreSQL keeps it from every transaction whose
    # snapshot is older than the upgrade's (pg_index.indcheckxmin): with another test's
    # transaction open on the same server that can last a moment, so each try is a new
    # transaction.
    deadline = time.monotonic() + 10
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        while True:
            with conn.transaction():
                conn.execute("SET LOCAL enable_seqscan = off")
                plan = "\n".join(line for line, in conn.execute("""
                    EXPLAIN SELECT id FROM orchestrator.runs
                    WHERE status = 'waiting' AND waiting_tool = %s AND available_at > now()
                    ORDER BY available_at LIMIT 2""", ("pay",)))
            if "ix_runs_turn_waiters" in plan or time.monotonic() > deadline:
                break
            time.sleep(0.05)
    assert "ix_runs_turn_waiters" in plan and "Sort" not in plan, plan


def test_runs_and_grants_from_before_0019_keep_their_journal(empty_database_url: str) -> None:
    """Migration 0019 moves the stored entries to ``journal_entries`` and makes ``journal`` a
    view: a run's entries from before read the same through it, and a role that could read
    and append to the journal still can, without a new grant."""
    target = _target(empty_database_url)
    migrate.upgrade(target, "0018")
    role = f"rt_{uuid.uuid4().hex[:8]}"
    run_id = uuid.uuid4()
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        conn.execute(f'CREATE ROLE "{role}"')
        conn.execute(f'GRANT USAGE ON SCHEMA orchestrator TO "{role}"')
        conn.execute(f'GRANT SELECT, INSERT ON orchestrator.journal TO "{role}"')
        conn.execute("""
            INSERT INTO orchestrator.runs (id, tenant, principal, workflow_name,
                workflow_version, input, request_digest, status, revision)
            VALUES (%s, 'acme', 'alice', 'wf', '1', '{}', 'd', 'waiting', 2)""", (run_id,))
        conn.execute("""
            INSERT INTO orchestrator.journal (run_id, seq, kind, position, name,
                schema_version, payload, lease_token)
            VALUES (%s, 1, 'call.submitted', 0, 't', 1, '{"op": 1}', 1),
                   (%s, 2, 'call.completed', 0, 't', 1, '{"op": 1, "result": 5}', 1)""",
                     (run_id, run_id))
    try:
        migrate.upgrade(target)
        with psycopg.connect(empty_database_url, autocommit=True) as conn:
            rows = conn.execute("SELECT seq, kind, payload FROM orchestrator.journal "
                                "WHERE run_id = %s ORDER BY seq", (run_id,)).fetchall()
            assert rows == [(1, "call.submitted", {"op": 1}),
                            (2, "call.completed", {"op": 1, "result": 5})]
            held = conn.execute(
                "SELECT has_table_privilege(%s, 'orchestrator.journal', 'SELECT'), "
                "has_table_privilege(%s, 'orchestrator.journal_entries', 'INSERT'), "
                "has_table_privilege(%s, 'orchestrator.journal_entries', 'UPDATE')",
                (role, role, role)).fetchone()
            assert held == (True, True, False)
    finally:
        with psycopg.connect(empty_database_url, autocommit=True) as conn:
            conn.execute(f'DROP OWNED BY "{role}"')
            conn.execute(f'DROP ROLE "{role}"')


def test_runs_in_flight_before_0032_say_when_they_were_due(empty_database_url: str) -> None:
    """The upgrade writes ``due_at`` for every run that has not finished, as the claims worked
    it out before (the hold its submission recorded in ``options``, else its creation; a
    continuation's creation), and a run whose hold was edited into no time does not fail it:
    that run is due when it was created. Finished runs keep NULL. A run inserted afterwards by
    code that does not write the column (a submitter not upgraded yet) is due at its insert."""
    target = _target(empty_database_url)
    migrate.upgrade(target, "0031")
    created = "2026-12-01 10:00:00+00"
    runs = {  # n: (status, options, continued_from)
        "1": ("queued", '{"start_at": "2026-12-01T12:00:00+00:00"}', None),
        "2": ("waiting", '{"delay_seconds": 90}', None),
        "3": ("running", "{}", None),
        "4": ("queued", '{"delay_seconds": 3600}', "00000000-0000-0000-0000-000000000009"),
        "5": ("queued", '{"start_at": "soon"}', None),
        "6": ("needs_reconciliation", '{"delay_seconds": "1e999"}', None),
        "7": ("succeeded", '{"delay_seconds": 60}', None),
    }
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        for n, (status, options, continued) in runs.items():
            conn.execute("""
                INSERT INTO orchestrator.runs (id, tenant, principal, workflow_name,
                    workflow_version, input, request_digest, status, options, continued_from,
                    created_at, lease_owner, lease_expires_at, finished_at)
                VALUES (%(id)s, 'acme', 'alice', 'wf', '1', '{}', 'd', %(status)s,
                        %(options)s, %(continued)s, %(created)s,
                        CASE WHEN %(status)s = 'running' THEN 'w' END,
                        CASE WHEN %(status)s = 'running' THEN now() END,
                        CASE WHEN %(status)s = 'succeeded' THEN now() END)""",
                         {"id": f"00000000-0000-0000-0000-00000000000{n}", "status": status,
                          "options": options, "continued": continued, "created": created})
    migrate.upgrade(target)
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        conn.execute("SET TIME ZONE 'UTC'")
        rows = dict(conn.execute("SELECT right(id::text, 1), due_at::text "
                                 "FROM orchestrator.runs ORDER BY id").fetchall())
        assert rows == {"1": "2026-12-01 12:00:00+00", "2": "2026-12-01 10:01:30+00",
                        "3": created, "4": created, "5": created, "6": created, "7": None}
        conn.execute("""
            INSERT INTO orchestrator.runs (id, tenant, principal, workflow_name,
                workflow_version, input, request_digest)
            VALUES ('00000000-0000-0000-0000-000000000008', 'acme', 'alice', 'wf', '1', '{}',
                    'd')""")
        (same,) = conn.execute("SELECT due_at = created_at FROM orchestrator.runs "
                               "WHERE right(id::text, 1) = '8'").fetchone() or (None,)
        assert same is True


def test_0036_takes_a_submission_key_index_built_beforehand_only_if_it_is_that_index(
        empty_database_url: str) -> None:
    """A large installation may build 0036's index first (``CREATE UNIQUE INDEX
    CONCURRENTLY uq_runs_keyed …``, as the migration's text says): the upgrade then renames it.
    An index under that name that is not that one (another definition, or an invalid one left
    by a concurrent build that failed) stops the upgrade, which changes nothing."""
    target = _target(empty_database_url)
    migrate.upgrade(target, "0035")
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        conn.execute("CREATE INDEX uq_runs_keyed ON orchestrator.runs "
                     "(tenant, principal, idempotency_key)")  # not unique, not partial
    with pytest.raises(ConfigurationError, match="is not the one migration 0036 builds.*drop it"):
        migrate.upgrade(target, "0036")
    assert migrate.current_revision(target) == "0035"
    with psycopg.connect(empty_database_url, autocommit=True) as conn:
        conn.execute("DROP INDEX orchestrator.uq_runs_keyed")
        conn.execute("CREATE UNIQUE INDEX CONCURRENTLY uq_runs_keyed ON orchestrator.runs "
                     "(tenant, principal, idempotency_key) WHERE idempotency_key IS NOT NULL")
    migrate.upgrade(target, "0036")
    with psycopg.connect(empty_database_url) as conn:
        names = {row[0] for row in conn.execute(
            "SELECT indexname FROM pg_indexes WHERE schemaname = 'orchestrator' "
            "AND tablename = 'runs' AND indexdef LIKE '%%idempotency_key%%'")}
    assert names == {"uq_runs_tenant_principal_idempotency_key"}
