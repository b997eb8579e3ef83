"""The fence of every hot write (``runs.revision`` moved under the lease token, and
``updated_at``) stays a HOT update: PostgreSQL updates a row in place, without an entry in each
of the runs table's indexes, only while no index names a column the update changes, in its
keys or in its predicate (docs/architecture.md, "The write path"). A partial index whose
predicate read ``revision`` turned every step's fence into an update of every index of
``runs``: 1.14× the server's CPU per step in K=3 drains."""

from __future__ import annotations

import re

import psycopg

FENCE_COLUMNS = ("revision", "updated_at")


def test_no_index_of_runs_names_a_column_the_fence_changes(sql) -> None:
    rows = sql("SELECT indexrelid::regclass::text AS name, pg_get_indexdef(indexrelid) AS def "
               "FROM pg_index WHERE indrelid = 'orchestrator.runs'::regclass")
    assert rows
    naming = {row["name"]: column for row in rows for column in FENCE_COLUMNS
              if re.search(rf"\b{column}\b", row["def"])}
    assert naming == {}, naming


def test_the_fence_of_a_run_is_a_heap_only_update(migrated_database_url) -> None:
    """The same, asked of PostgreSQL: a run's fence moved twice is updated in place, twice."""
    with psycopg.connect(migrated_database_url) as conn:
        (run_id,) = conn.execute(
            "INSERT INTO orchestrator.runs (id, tenant, principal, workflow_name, "
            "workflow_version, input, request_digest) "
            "VALUES (gen_random_uuid(), 't', 'p', 'w', '1', '{}', 'd') RETURNING id").fetchone()
        conn.commit()
        for _ in range(2):
            conn.execute("UPDATE orchestrator.runs SET revision = revision + 1, "
                         "updated_at = now() WHERE id = %s", (run_id,))
        (hot,) = conn.execute("SELECT pg_stat_get_xact_tuples_hot_updated("
                              "'orchestrator.runs'::regclass)").fetchone()
        assert hot == 2
