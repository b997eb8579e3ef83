"""an operation's settle rewrites its row in place: no index of operations reads its state

PostgreSQL updates a row in place (a HOT update: the new version on the same page, no new
index entry) only when no column that an index reads has changed, and a partial index's
predicate counts as read. Three partial indexes of ``operations`` named ``state``:
``ix_operations_unknown`` (``state = 'unknown'``), ``ix_operations_unsettled`` (``state IN
('pending', 'submitted', 'unknown')``) and ``ix_operations_tool_inflight`` (``state IN
('submitted', 'unknown')``). So every settle of an operation, ``submitted`` to
``committed`` above all, wrote a new version with a new entry in both unique indexes, and
each insertion of a call ``submitted`` an entry in two of the partial ones: six index
insertions for every call. Now two (the call's insertion in ``pk_operations`` and
``uq_operations_run_id_position_attempt``), and the settle is HOT wherever its page has room.

What each index served, and what serves it now:

- a run's calls without an outcome (a run may not finish with one, C5): the unique index's
  prefix ``run_id``, with the state read from the row; a run's calls are few, and the check
  runs once when the run ends;
- the operations whose outcome is unknown, across runs (the exporter's gauges, ``ops
  stats``): ``ix_operations_unknown_tool`` on the stored generated column ``unknown_tool``
  (the tool's name while the call is unknown, else NULL). Its value changes only when a call
  becomes unknown or leaves unknown, so only those updates (rare) are not HOT;
- a tool's calls in flight, which its concurrency limit counts (docs/flow.md):
  ``ix_operations_in_flight`` on the stored generated column ``in_flight_tool``: the tool's
  name while a call admitted under a concurrency limit (new column ``limited``, set by the
  admission's own write) is ``submitted`` or ``unknown``, else NULL. Calls of tools without
  a concurrency limit never have it, so their settle is HOT; a limited call's settle is
  not (its column clears), which is what keeps the count right on every path that settles
  a call, the operator's included. ``orchestrator.tool_admit`` counts with it.

Calls in flight when the database is upgraded (``submitted`` or ``unknown``) are all marked
``limited``, of whatever tool: the count a limit makes of them stays what it was (it counted
every call of the tool in flight), and a tool without limits never asks for it.

Adding stored generated columns rewrites the table (an ``ACCESS EXCLUSIVE`` lock for the
time it takes: stop the workers first, as for every upgrade). Measured: server instructions
per step of the engine's writes, ``python -m bench.bare --instructions --ways engine --batch
16 --runs 1152 --runs-small 640``: 449,903 before, 402,709 with the three indexes gone
(0.895x). How many settles stay on their page depends on the room the page has for the
settled version (the receipt makes it longer): in a two-worker drain of 3,000 runs of three
calls (``n_tup_hot_upd`` of ``operations``, 9,000 updates), 79 % were HOT with the table's
fillfactor at 50, 58 % at 60, 42 % at 70 (0006's), 6 % at 100, and none with the three
indexes; the table took 7.5 MB at 50 and 7.6 MB at 70 (a HOT page prunes its dead versions
itself).

Revision ID: 0039
Revises: 0038
Create Date: 2026-12-07 21:15:00
"""

from __future__ import annotations

from alembic import op

revision = "0039"
down_revision = "0038"
branch_labels = None
depends_on = None

S = "orchestrator"
FILLFACTOR = 50
"""Of ``operations`` (0006 set 70): room on its pages for the settled versions of the calls
inserted there (above)."""

ADMIT = """
CREATE OR REPLACE FUNCTION orchestrator.tool_admit(t text, conc integer, rate integer,
                                                   per float8, timeout float8)
RETURNS float8 LANGUAGE plpgsql VOLATILE AS $$
-- NULL: admitted (the caller records its operation now, in this transaction); -1: another
-- transaction holds the tool's lock (try again in a moment); -2: the tool's concurrency is
-- full; a positive number: seconds until the rate window or the shared back-off has room.
DECLARE
    until timestamptz;
    moment timestamptz;
    n integer;
    oldest timestamptz;
    span interval;
BEGIN
    IF NOT pg_try_advisory_xact_lock(hashtext('orchestrator.tool_admit'), hashtext(t)) THEN
        RETURN -1;
    END IF;
    moment := clock_timestamp();
    SELECT l.backoff_until INTO until FROM orchestrator.tool_limits AS l WHERE l.name = t;
    IF until > moment THEN
        RETURN extract(epoch FROM until - moment);
    END IF;
    IF conc IS NOT NULL THEN
        -- In flight: sent and not settled, or unknown (its worker was lost, its call timed
        -- out) while the call may still be running at the provider, up to the tool's timeout.
COUNT_IN_FLIGHT
        IF n >= conc THEN
            RETURN -2;
        END IF;
    END IF;
    IF rate IS NOT NULL THEN
        -- The window is counted a little longer than it is (a tenth, at most a quarter of a
        -- second): a call reaches its provider a moment after its admission commits, and
        -- that moment varies, so without the margin a provider counting by its own clock
        -- could see a window with more than the rate.
        span := make_interval(secs => per + least(per * 0.1, 0.25));
        DELETE FROM orchestrator.tool_dispatches AS d WHERE d.tool = t AND d.at <= moment - span;
        SELECT count(*), min(d.at) INTO n, oldest FROM orchestrator.tool_dispatches AS d
        WHERE d.tool = t;
        IF n >= rate THEN
            RETURN greatest(0.001, extract(epoch FROM oldest + span - moment));
        END IF;
    END IF;
    RETURN NULL;
END
$$;
"""

COUNT = """
        -- ``in_flight_tool`` is the tool's name exactly while a call admitted under the
        -- limit is submitted or unknown (migration 0039).
        SELECT count(*) INTO n FROM orchestrator.operations AS o
        WHERE o.in_flight_tool = t
          AND (o.state = 'submitted'
               OR o.submitted_at > moment - make_interval(secs => timeout));"""
COUNT_0012 = """
        SELECT count(*) INTO n FROM orchestrator.operations AS o
        WHERE o.state IN ('submitted', 'unknown') AND o.tool_name = t
          AND (o.state = 'submitted'
               OR o.submitted_at > moment - make_interval(secs => timeout));"""
"""What migration 0012's function counted (the downgrade restores it)."""


def upgrade() -> None:
    op.execute(f"ALTER TABLE {S}.operations ADD COLUMN limited boolean")
    op.execute(f"UPDATE {S}.operations SET limited = true "
               "WHERE state IN ('submitted', 'unknown')")
    op.execute(f"""
        ALTER TABLE {S}.operations
        ADD COLUMN in_flight_tool text GENERATED ALWAYS AS (
            CASE WHEN limited AND state IN ('submitted', 'unknown') THEN tool_name END) STORED,
        ADD COLUMN unknown_tool text GENERATED ALWAYS AS (
            CASE WHEN state = 'unknown' THEN tool_name END) STORED,
        SET (fillfactor = {FILLFACTOR})""")
    op.execute(f"""CREATE INDEX ix_operations_in_flight ON {S}.operations
                   (in_flight_tool, submitted_at) WHERE in_flight_tool IS NOT NULL""")
    op.execute(f"""CREATE INDEX ix_operations_unknown_tool ON {S}.operations (unknown_tool)
                   WHERE unknown_tool IS NOT NULL""")
    op.execute(f"DROP INDEX {S}.ix_operations_unknown")
    op.execute(f"DROP INDEX {S}.ix_operations_unsettled")
    op.execute(f"DROP INDEX {S}.ix_operations_tool_inflight")
    op.execute(ADMIT.replace("COUNT_IN_FLIGHT", COUNT.lstrip("\n")))


def downgrade() -> None:
    op.execute(f"""CREATE INDEX ix_operations_unknown ON {S}.operations (updated_at)
                   WHERE state = 'unknown'""")
    op.execute(f"""CREATE INDEX ix_operations_unsettled ON {S}.operations (run_id)
                   WHERE state IN ('pending', 'submitted', 'unknown')""")
    op.execute(f"""CREATE INDEX ix_operations_tool_inflight ON {S}.operations
                   (tool_name, submitted_at) WHERE state IN ('submitted', 'unknown')""")
    op.execute(ADMIT.replace("COUNT_IN_FLIGHT", COUNT_0012.lstrip("\n")))
    op.execute(f"DROP INDEX {S}.ix_operations_in_flight")
    op.execute(f"DROP INDEX {S}.ix_operations_unknown_tool")
    op.execute(f"""ALTER TABLE {S}.operations DROP COLUMN in_flight_tool,
                   DROP COLUMN unknown_tool, DROP COLUMN limited, SET (fillfactor = 70)""")
