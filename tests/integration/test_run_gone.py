"""A run's ledger rows and its row in ``runs`` go together, without foreign keys (migration 0036).

``operations.run_id`` and ``journal_entries.run_id`` have no foreign key: every statement that
inserts those rows reads the run's row itself (the fence, or ``WHERE EXISTS`` the run under the
writer's lease), and the trigger ``runs_delete_ledger`` deletes a deleted run's rows, as the
keys' ``ON DELETE CASCADE`` did. These tests hold both halves: no writer leaves a row for a run
that is not there, and no deletion leaves a row of a run that is gone.
"""

from __future__ import annotations

import uuid
from typing import Any

import psycopg
import pytest

from orchestrator import Orchestrator, canonical
from orchestrator.db import journal as journal_db
from orchestrator.db import operations as ops_db
from orchestrator.db import runs as runs_db
from orchestrator.db import steps as steps_db
from orchestrator.db.writer import GroupWriter
from orchestrator.errors import LeaseLost
from orchestrator.journal import SCHEMA_VERSION, EventKind, entry
from tests.integration.conftest import running

TOOL, VERSION = "charge", "1"


def _begin_row(run_id: uuid.UUID, token: int) -> dict[str, Any]:
    arguments = canonical.canonical_json({"amount": 1})
    return {"run_id": run_id, "position": 0, "attempt": 1, "tool_name": TOOL,
            "tool_version": VERSION, "effect_class": "consequential", "tenant": "t",
            "principal": "p", "intent_digest": "intent", "arguments": arguments,
            "idempotency_key": f"{run_id}:0:1", "worker_id": "w", "token": token}


def _rows_of(url: str, run_id: uuid.UUID) -> tuple[int, int]:
    with psycopg.connect(url) as conn:
        ops = conn.execute("SELECT count(*) FROM orchestrator.operations WHERE run_id = %s",
                           (run_id,)).fetchone()
        entries = conn.execute("SELECT count(*) FROM orchestrator.journal_entries "
                               "WHERE run_id = %s", (run_id,)).fetchone()
    assert ops is not None and entries is not None
    return int(ops[0]), int(entries[0])


async def test_no_writer_leaves_a_row_for_a_run_that_is_not_there(
        app: Orchestrator, migrated_database_url: str) -> None:
    gone = uuid.uuid4()
    writer = GroupWriter(app.database)
    with pytest.raises(steps_db.FastPathMiss):
        await writer.run_statement(steps_db.operation_begin_fast(
            _begin_row(gone, 1), expected=0, v=SCHEMA_VERSION))
    with pytest.raises(steps_db.FastPathMiss):
        await writer.run_statement(steps_db.run_succeed_fast(
            run_id=gone, token=1, expected=0, result="1", v=SCHEMA_VERSION))
    async with app.database.connection() as conn:
        with pytest.raises(LeaseLost):  # the general form: no run holds that lease
            await ops_db.operation_begin(conn, _begin_row(gone, 1), pending=False)
    async with app.database.connection() as conn:
        with pytest.raises(LeaseLost):
            await journal_db.journal_append(
                conn, run_id=gone, token=1, expected=0,
                events=[entry(EventKind.VALUE, 0, "now", {"value": 1.0})])
    assert _rows_of(migrated_database_url, gone) == (0, 0)


async def test_deleting_a_run_deletes_its_operations_entries_and_reconciliation_items(
        app: Orchestrator, migrated_database_url: str) -> None:
    @app.tool(name=TOOL)
    async def charge(ctx: Any, *, amount: int) -> dict[str, int]:
        return {"charged": amount}

    @app.workflow(name="pay")
    async def pay(ctx: Any, data: Any) -> Any:
        await ctx.call(charge, amount=data["amount"])
        ctx.now()
        return data["amount"]

    async with running(app):
        handle = await app.submit_async(pay, {"amount": 3})
        kept = await app.submit_async(pay, {"amount": 4})
        assert await handle.result_async(timeout=30) == 3
        assert await kept.result_async(timeout=30) == 4
    ops, entries = _rows_of(migrated_database_url, handle.id)
    assert ops == 1 and entries >= 2  # the call; the clock's entry and the run's end
    with psycopg.connect(migrated_database_url) as conn:
        op_id = conn.execute("SELECT id FROM orchestrator.operations WHERE run_id = %s",
                             (handle.id,)).fetchone()
        assert op_id is not None
        conn.execute("INSERT INTO orchestrator.reconciliation_items (operation_id, run_id, "
                     "reason) VALUES (%s, %s, 'test')", (op_id[0], handle.id))
        conn.execute("DELETE FROM orchestrator.runs WHERE id = %s", (handle.id,))
        items = conn.execute("SELECT count(*) FROM orchestrator.reconciliation_items "
                             "WHERE operation_id = %s", (op_id[0],)).fetchone()
    assert items == (0,)
    assert _rows_of(migrated_database_url, handle.id) == (0, 0)
    assert _rows_of(migrated_database_url, kept.id)[0] == 1  # another run's rows stay


def test_keyless_runs_have_no_entry_in_the_submission_keys_index(
        migrated_database_url: str) -> None:
    with psycopg.connect(migrated_database_url, autocommit=True) as conn:
        insert = ("INSERT INTO orchestrator.runs (id, tenant, principal, workflow_name, "
                  "workflow_version, input, request_digest, idempotency_key) "
                  "VALUES (gen_random_uuid(), 't', 'p', 'wf', '1', '{}', 'd', %s)")
        for _ in range(50):
            conn.execute(insert, (None,))
        conn.execute(insert, ("k1",))
        conn.execute(insert, ("k2",))
        with pytest.raises(psycopg.errors.UniqueViolation):
            conn.execute(insert, ("k1",))
        conn.execute("VACUUM orchestrator.runs")
        row = conn.execute("SELECT reltuples FROM pg_class WHERE oid = "
                           "'orchestrator.uq_runs_tenant_principal_idempotency_key'::regclass"
                           ).fetchone()
    assert row == (2,)


async def test_a_run_cannot_be_deleted_while_a_call_of_it_is_being_recorded(
        app: Orchestrator, migrated_database_url: str) -> None:
    """The general form's insert holds the run's row (``FOR KEY SHARE``) until it commits, as
    the foreign key's check did: a deletion of the run waits for it, and then deletes the new
    operation with the run."""
    @app.workflow(name="pay")
    async def pay(ctx: Any, data: Any) -> Any:
        return data

    run = await app.submit_async(pay, {})
    async with app.database.connection() as conn:
        (claim,) = await runs_db.run_claim_ready(conn, worker="w", workflows=["pay@1"],
                                                 limit=1, ttl=60)
    async with app.database.connection() as conn, conn.transaction():
        await ops_db.operation_begin(conn, _begin_row(run.id, claim["lease_token"]),
                                     pending=False)
        with psycopg.connect(migrated_database_url) as other:
            other.execute("SET lock_timeout = '200ms'")
            with pytest.raises(psycopg.errors.LockNotAvailable):
                other.execute("DELETE FROM orchestrator.runs WHERE id = %s", (run.id,))
    with psycopg.connect(migrated_database_url) as other:
        other.execute("DELETE FROM orchestrator.runs WHERE id = %s", (run.id,))
    assert _rows_of(migrated_database_url, run.id) == (0, 0)
