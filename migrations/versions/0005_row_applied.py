"""set-based writes: row_applied() refuses a row that missed, batch_rows() feeds the rows, and
an index of unsettled operations

The worker's hot writes are set-based statements: one statement fences, writes and journals
the rows of many runs. Each row used to be checked by the worker after the statement returned,
so the transaction had to stay open for that check (a round trip) before COMMIT could be sent.
Now the statement itself calls ``orchestrator.row_applied(applied, what)`` for every row; a row
that did not apply raises SQLSTATE ``OR001`` and the transaction can never commit with it. The
worker can then send BEGIN, the statements and COMMIT together and wait once.

``orchestrator.batch_rows(rows)`` unpacks a statement's JSON array of rows, like
``jsonb_array_elements``, but tells the planner to expect one row (``ROWS 1``) where the built-in
says a hundred. The statements are prepared once per connection and their generic plan is kept;
planned for a hundred rows, the fence would hash-join the batch against all of ``runs`` (a
sequential scan, or the partial index of running runs with every dead version it still holds)
and keep doing so as the table grows. Planned for a few rows, it probes the primary key once
per row, which is right at every size.

``ix_operations_unsettled`` indexes a run's operations that have no outcome yet. A run may not
succeed while it has one, and the success write checks that per row; the index stays as small
as the work in flight, so that check is a probe of a few entries however long the history
(without it, a plan made while ``operations`` was small scans the whole table for every run).

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-29 23:50:00
"""

from __future__ import annotations

from alembic import op

revision = "0005"
down_revision = "0004"
branch_labels = None
depends_on = None

UPGRADE_SQL = """
CREATE FUNCTION orchestrator.row_applied(applied boolean, what text) RETURNS boolean
LANGUAGE plpgsql VOLATILE AS $$
BEGIN
    IF applied IS NOT TRUE THEN
        RAISE EXCEPTION 'a % row did not apply', what USING ERRCODE = 'OR001';
    END IF;
    RETURN true;
END
$$;

CREATE FUNCTION orchestrator.batch_rows(rows jsonb) RETURNS SETOF jsonb
LANGUAGE plpgsql STABLE STRICT ROWS 1 AS $$
BEGIN
    RETURN QUERY SELECT e FROM jsonb_array_elements(rows) AS e;
END
$$;

CREATE INDEX ix_operations_unsettled ON orchestrator.operations (run_id)
    WHERE state IN ('pending', 'submitted', 'unknown');
"""

DOWNGRADE_SQL = """
DROP INDEX orchestrator.ix_operations_unsettled;
DROP FUNCTION orchestrator.batch_rows(jsonb);
DROP FUNCTION orchestrator.row_applied(boolean, text);
"""


def upgrade() -> None:
    op.execute(UPGRADE_SQL)


def downgrade() -> None:
    op.execute(DOWNGRADE_SQL)
