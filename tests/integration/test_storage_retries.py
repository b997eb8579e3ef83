"""Database-level transient failures are retried inside the storage layer only (C7)."""

from __future__ import annotations

import psycopg
import pytest

from orchestrator.db.config import DatabaseTarget
from orchestrator.db.database import Database


async def test_serialisation_failures_are_retried_and_others_are_not(migrated_database_url):
    db = Database(DatabaseTarget(migrated_database_url, "argument"))
    calls = {"transient": 0, "bug": 0}

    async def flaky(conn):  # type: ignore[no-untyped-def]
        calls["transient"] += 1
        if calls["transient"] < 3:
            raise psycopg.errors.SerializationFailure("could not serialize access")
        return "done"

    async def broken(conn):  # type: ignore[no-untyped-def]
        calls["bug"] += 1
        raise psycopg.errors.UniqueViolation("duplicate key")

    assert await db.run_in_transaction(flaky) == "done"
    assert calls["transient"] == 3
    with pytest.raises(psycopg.errors.UniqueViolation):
        await db.run_in_transaction(broken)
    assert calls["bug"] == 1  # not transient: never retried
    await db.close()
