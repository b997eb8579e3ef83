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

- a run's calls without an outcome (a run may not finish with one, C5; retention prunes no
  run with one): the unique index's prefix ``run_id``, with the state read from the row; a
  run's calls are few, and the check runs once when the run ends, and once a run for
  ``orchestrator.prune_runs``, whose check is now a subquery per run (``OFFSET 0``, below);
- the operations whose outcome is unknown, across runs (the exporter's gauges, the console's
  overview): ``ix_operations_unknown_tool`` on the new column ``unknown_tool``, the tool's
  name while the call is unknown, else NULL. It changes only when a call becomes unknown or
  leaves unknown, so only those updates (rare) are not HOT;
- a tool's calls in flight, which its concurrency limit counts (docs/flow.md):
  ``ix_operations_in_flight`` on the new column ``in_flight_tool``: the tool's name, written
  by the write that admits a call under its tool's concurrency limit (in the transaction of
  ``orchestrator.tool_admit``), while the call is ``submitted`` or ``unknown``; else NULL.
  Calls of tools without a concurrency limit never have it, so their settle is HOT; a limited
  call's settle is not (its column clears). ``orchestrator.tool_admit`` counts with it.

The guard trigger ``operations_guard`` (migration 0035) keeps both columns: whatever a
statement writes, ``unknown_tool`` is the tool's name exactly while the call is unknown, and
``in_flight_tool`` is NULL once the call has left ``submitted`` and ``unknown``, so every
path that settles a call (the worker's, the reconciler's, an operator's) releases its place
and leaves the unknown ones. Its one-expression fast path, for the rows the hot statements
write, also requires the new row's two columns NULL (and the old row's ``in_flight_tool``)
and neither state unknown; any other row takes the slow path, which sets the columns before
its rules. The trigger now fires
on updates of the two columns and of ``tool_name`` too. (Stored generated columns did the same
with no trigger, but computing them cost about 25,000 instructions per step, 6 % of the
server's, on every insert and update.)

Calls in flight when the database is upgraded (``submitted`` or ``unknown``) are all given
``in_flight_tool``, of whatever tool: the count a limit makes of them stays what it was (it
counted every call of the tool in flight), and a tool without limits never asks for it.
Nothing is rewritten: the two columns are added empty, and only the calls in flight are
updated. The table is analyzed at the end, so that the planner knows the new columns are
mostly NULL (without statistics it would scan the table for the gauges); not when it has no
rows, since statistics saying it is empty would make the plans kept by the workers scan it.

Measured: server instructions per step of the engine's writes, ``python -m bench.bare
--instructions --ways engine --batch 16 --runs 1152 --runs-small 640``: 449,903 before, 410,095
after (0.912x; 402,709 with the three indexes dropped and nothing in their place). How many
settles stay on their page depends on the room the page has for the settled version (the
receipt makes it longer): in a two-worker drain of 3,000 runs of three calls (``n_tup_hot_upd``
of ``operations``, 9,000 updates), 79 % were HOT with the table's fillfactor at 50, 58 % at 60,
42 % at 70 (0006's), 6 % at 100, and none with the three indexes; the table took 7.5 MB at 50
and 7.6 MB at 70 (a HOT page prunes its dead versions itself).

Revision ID: 0039
Revises: 0038
Create Date: 2026-12-07 21:00:00
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op

revision = "0039"
down_revision = "0038"
branch_labels = None
depends_on = None

S = "orchestrator"
FILLFACTOR = 50
"""Of ``operations`` (0006 set 70): room on its pages for the settled versions of the calls
inserted there (above)."""

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
"""What migration 0012's function counted; ``COUNT`` is what it counts now."""


def _module(name: str) -> ModuleType:
    path = Path(__file__).with_name(name)
    spec = importlib.util.spec_from_file_location(f"orchestrator_migration_{name[:4]}", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _admits() -> tuple[str, str]:
    """``tool_admit`` as migration 0012 made it (nothing replaced it since), and this
    migration's: the same but for what it counts."""
    text: str = _module("0012_queues.py").ADMIT_SQL  # its text is that revision's, for ever
    text = text.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
    assert text.count(COUNT_0012) == 1, "migration 0012's tool_admit is not as expected"
    return text, text.replace(COUNT_0012, COUNT)


_KEPT = """
    -- The columns the indexes of unknown and of limited calls read (migration 0039), for a row
    -- the fast path above did not return: the tool's name while the call is unknown; the
    -- tool's name, as its admission wrote it, while a limited call is in flight.
    NEW.unknown_tool := CASE WHEN NEW.state = 'unknown' THEN NEW.tool_name END;
    NEW.in_flight_tool := CASE WHEN NEW.in_flight_tool IS NOT NULL
                                    AND NEW.state IN ('submitted', 'unknown')
                               THEN NEW.tool_name END;"""


def _guards() -> tuple[str, str, str, str]:
    """Migration 0035's guard function and trigger, and this migration's."""
    m = _module("0035_operations_one_guard.py")  # its text is that revision's, for ever
    sql: str = m.UPGRADE_SQL
    function = sql[sql.index("CREATE FUNCTION"):sql.index("$$;\n") + len("$$;\n")]
    trigger = sql[sql.index("CREATE TRIGGER operations_guard"):]
    parts = (
        (f"""        IF {m._CREATE_OK}
           AND {m._CHECKS_OK}
        THEN""",
         f"""        IF {m._CREATE_OK}
           AND {m._CHECKS_OK}
           AND NEW.unknown_tool IS NULL AND NEW.in_flight_tool IS NULL
        THEN"""),
        (f"""           AND {m._CHECKS_OK}
        THEN
            RETURN NEW;
        END IF;
    END IF;
""",
         f"""           AND {m._CHECKS_OK}
           AND OLD.state <> 'unknown' AND NEW.state <> 'unknown'
           AND OLD.in_flight_tool IS NULL AND NEW.in_flight_tool IS NULL
           AND NEW.unknown_tool IS NULL
        THEN
            RETURN NEW;
        END IF;
    END IF;{_KEPT}
"""),
    )
    new = function.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
    for old, replacement in parts:
        assert new.count(old) == 1, "migration 0035's operations_guard is not as expected"
        new = new.replace(old, replacement)
    old_function = function.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
    columns = ", ".join(m._COLUMNS)
    assert f"UPDATE OF {columns}\n" in trigger
    new_trigger = trigger.replace(f"UPDATE OF {columns}\n",
                                  f"UPDATE OF {columns}, tool_name, in_flight_tool, "
                                  "unknown_tool\n")
    drop = f"DROP TRIGGER operations_guard ON {S}.operations;\n"
    return old_function, drop + trigger, new, drop + new_trigger


UNSETTLED = """    AND NOT EXISTS (SELECT 1 FROM orchestrator.operations op
                    WHERE op.run_id = r.id AND op.state IN ('pending', 'submitted', 'unknown'))"""
UNSETTLED_PER_RUN = """    AND NOT EXISTS (SELECT 1 FROM orchestrator.operations op
                    WHERE op.run_id = r.id AND op.state IN ('pending', 'submitted', 'unknown')
                    OFFSET 0)"""
"""A prunable run has no call without an outcome. Without the index of unsettled calls the
planner joined the runs with a scan of every operation for their states (their statistics say
few are unsettled). Over 300,000 finished runs of 3 calls (``bench.scale.fill``), a batch of
500 took 300-320 ms, against 21-27 ms with the index; with ``OFFSET 0``, which keeps the check
a subquery per run through the unique index, 46-71 ms (its selection alone 9 ms, against 2);
a dry run, which counts every prunable run, 1.9 s against 0.7 s."""


def _prunes() -> tuple[str, str]:
    """``prune_runs`` as migration 0019 left it, and this migration's."""
    m = _module("0019_calls_in_the_ledger.py")  # its text is that revision's, for ever
    before: str = m._prune(m.ENTRIES)
    assert before.count(UNSETTLED) == 2, "migration 0019's prune_runs is not as expected"
    return before, before.replace(UNSETTLED, UNSETTLED_PER_RUN)


def upgrade() -> None:
    _, _, guard, trigger = _guards()
    op.execute(f"LOCK TABLE {S}.operations IN ACCESS EXCLUSIVE MODE")
    op.execute(f"""ALTER TABLE {S}.operations ADD COLUMN in_flight_tool text,
                   ADD COLUMN unknown_tool text, SET (fillfactor = {FILLFACTOR})""")
    op.execute(guard)
    op.execute(trigger)
    op.execute(f"""UPDATE {S}.operations SET in_flight_tool = tool_name, unknown_tool = tool_name
                   WHERE state IN ('submitted', 'unknown')""")
    op.execute(f"""CREATE INDEX ix_operations_in_flight ON {S}.operations
                   (in_flight_tool, submitted_at) WHERE in_flight_tool IS NOT NULL""")
    op.execute(f"""CREATE INDEX ix_operations_unknown_tool ON {S}.operations (unknown_tool)
                   WHERE unknown_tool IS NOT NULL""")
    op.execute(f"DROP INDEX {S}.ix_operations_unknown")
    op.execute(f"DROP INDEX {S}.ix_operations_unsettled")
    op.execute(f"DROP INDEX {S}.ix_operations_tool_inflight")
    op.execute(_admits()[1])
    op.execute(_prunes()[1])
    # Not on a table with no rows: its statistics would then say it is empty, for good, and
    # the plans the workers keep, made on it, would scan it (test_group_commit).
    if op.get_bind().execute(sa.text(f"SELECT EXISTS (SELECT FROM {S}.operations)")).scalar():
        op.execute(f"ANALYZE {S}.operations")


def downgrade() -> None:
    guard, trigger, _, _ = _guards()
    op.execute(f"""CREATE INDEX ix_operations_unknown ON {S}.operations (updated_at)
                   WHERE state = 'unknown'""")
    op.execute(f"""CREATE INDEX ix_operations_unsettled ON {S}.operations (run_id)
                   WHERE state IN ('pending', 'submitted', 'unknown')""")
    op.execute(f"""CREATE INDEX ix_operations_tool_inflight ON {S}.operations
                   (tool_name, submitted_at) WHERE state IN ('submitted', 'unknown')""")
    op.execute(_admits()[0])
    op.execute(_prunes()[0])
    op.execute(f"DROP INDEX {S}.ix_operations_in_flight")
    op.execute(f"DROP INDEX {S}.ix_operations_unknown_tool")
    op.execute(guard)
    op.execute(trigger)
    op.execute(f"""ALTER TABLE {S}.operations DROP COLUMN in_flight_tool,
                   DROP COLUMN unknown_tool, SET (fillfactor = 70)""")
