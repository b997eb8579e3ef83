"""The queries behind the exporter's database gauges (docs/metrics.md).

Each is read at scrape time, on a connection of its own (the exporter's thread has no event
loop), under a short ``statement_timeout``, and is driven by a partial index so that it stays
cheap however many finished runs and settled operations the tables hold:

- unknown operations and the operator queue: ``ix_operations_unknown_tool`` (on
  ``unknown_tool``, the tool's name while the call is unknown, migration 0039); an item waits
  for an operator only while its operation is unknown, so the queue is found from the unknown
  operations through the items' unique ``operation_id``;
- queued runs: ``ix_runs_claimable`` (the default queue's claimable runs only) and
  ``ix_runs_queue_ready`` (the queues' ready runs, docs/flow.md).
"""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg.rows import dict_row

from orchestrator.db.config import DatabaseTarget
from orchestrator.db.probe import connect_options
from orchestrator.db.schema import SCHEMA as S
from orchestrator.errors import DatabaseError

STATEMENT_TIMEOUT_MS = 2000
"""Milliseconds one gauge query may take before the server cancels it."""
_TIMEOUT = f"SET LOCAL statement_timeout = {STATEMENT_TIMEOUT_MS}"
"""In the transaction of the queries it bounds: behind a transaction pooler (docs/operations.md)
a plain ``SET`` would stay with a server session that other clients use next, and the queries
after it could run on another session without it."""
CONNECT_TIMEOUT = 2.0
"""Seconds to wait for the server when connecting for a scrape (libpq's minimum is 2)."""

UNKNOWN_BY_TOOL = f"""
SELECT o.unknown_tool AS tool, count(*) AS unknown,
       EXTRACT(EPOCH FROM now() - min(o.updated_at))::float8 AS unknown_oldest,
       count(*) FILTER (WHERE i.state = 'operator') AS operator,
       EXTRACT(EPOCH FROM now() - min(i.created_at) FILTER (WHERE i.state = 'operator')
       )::float8 AS operator_oldest
FROM {S}.operations o
LEFT JOIN {S}.reconciliation_items i ON i.operation_id = o.id
WHERE o.unknown_tool IS NOT NULL
GROUP BY o.unknown_tool"""

QUEUED_BY_WORKFLOW = f"""
SELECT workflow, sum(queued)::bigint AS queued, max(oldest) AS oldest FROM (
    SELECT workflow_name AS workflow, count(*) AS queued,
           EXTRACT(EPOCH FROM now() - min(available_at))::float8 AS oldest
    FROM {S}.runs
    WHERE status = 'queued' AND available_at IS NOT NULL AND available_at <= now()
      AND queue IS NULL
    GROUP BY workflow_name
    UNION ALL
    SELECT workflow_name, count(*),
           EXTRACT(EPOCH FROM now() - min(available_at))::float8
    FROM {S}.runs
    WHERE status = 'queued' AND available_at IS NOT NULL AND available_at <= now()
      AND queue IS NOT NULL
    GROUP BY workflow_name
) AS parts
GROUP BY workflow"""


def read_gauges(target: DatabaseTarget) -> dict[str, list[dict[str, Any]]]:
    """The rows of every gauge query: ``unknown`` (per tool: unknown operations, queue items
    waiting for an operator, and the age of the oldest of each, in seconds) and ``queued``
    (per workflow: runs ready to start that no worker has claimed yet, and the age of the
    oldest). Raises :class:`DatabaseError` when the database cannot be reached or a query
    fails or times out; the caller reports the database as down."""
    try:
        with (psycopg.connect(target.url, autocommit=True, row_factory=dict_row,
                              **connect_options(target, CONNECT_TIMEOUT)) as conn,
              conn.transaction()):
            conn.execute(_TIMEOUT)
            unknown = conn.execute(UNKNOWN_BY_TOOL).fetchall()
            queued = conn.execute(QUEUED_BY_WORKFLOW).fetchall()
    except psycopg.Error as exc:
        raise DatabaseError(f"the metrics of {target.display} could not be read "
                            f"({type(exc).__name__})") from exc
    return {"unknown": unknown, "queued": queued}


def database_reachable(target: DatabaseTarget) -> bool:
    """Whether ``SELECT 1`` answers within the connect timeout (for ``/healthz``)."""
    try:
        with (psycopg.connect(target.url, autocommit=True,
                              **connect_options(target, CONNECT_TIMEOUT)) as conn,
              conn.transaction()):
            conn.execute(_TIMEOUT)
            conn.execute("SELECT 1")
    except psycopg.Error:
        return False
    return True
