"""schedule history: pruning the slot records of schedules with the runs they fired

A schedule records every slot it handles in ``schedule_slots`` (migration 0011): one row a
slot, 86,400 a day for a schedule that fires every second, for ever. Retention now prunes them
with the runs: ``orchestrator.prune_schedule_slots(keep, lim, dry)`` deletes at most ``lim``
slot records older than ``keep`` seconds (the finished runs' period) that are ``skipped`` (no
run), or ``fired`` whose run was pruned or is gone; never a ``buffered`` slot (it has yet to
fire), never the record of a run that is not pruned. ``dry`` counts them and changes nothing.

Nothing depends on an old record for firing each slot once: the ticker goes forward from
``schedules.next_slot``, the overlap policies read ``schedules.last_run_id``, and a slot's run
keeps its submission key (``schedule:{id}:{slot}``) in its pruned row, so a backfill over a
pruned range answers with that run instead of starting another (docs/schedules.md).

SECURITY DEFINER (owned by the migration role, fixed search_path), so that the runtime role,
which may EXECUTE it (``orchestrator db grant``), deletes only what its checks allow and holds
no DELETE on the table. ``ix_schedule_slots_recorded`` is what it walks, oldest first.

Revision ID: 0016
Revises: 0015
Create Date: 2026-12-04 08:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0016"
down_revision = "0015"
branch_labels = None
depends_on = None

S = "orchestrator"

PRUNABLE = """
    sl.state <> 'buffered'
    AND sl.recorded_at < now() - make_interval(secs => keep)
    AND (sl.run_id IS NULL OR NOT EXISTS (
        SELECT 1 FROM orchestrator.runs r WHERE r.id = sl.run_id AND r.pruned_at IS NULL))
"""

PRUNE_SLOTS_SQL = f"""
CREATE FUNCTION orchestrator.prune_schedule_slots(keep float8, lim integer, dry boolean)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    n bigint;
BEGIN
    IF keep IS NULL OR keep < 0 OR lim IS NULL OR lim < 1 THEN
        RAISE EXCEPTION 'prune_schedule_slots: keep must be >= 0 and lim >= 1'
            USING ERRCODE = 'invalid_parameter_value';
    END IF;
    IF dry THEN
        SELECT count(*) INTO n FROM orchestrator.schedule_slots sl WHERE {PRUNABLE};
        RETURN n;
    END IF;
    WITH picked AS (
        SELECT sl.schedule_id, sl.slot, sl.kind FROM orchestrator.schedule_slots sl
        WHERE {PRUNABLE}
        ORDER BY sl.recorded_at LIMIT lim FOR UPDATE OF sl SKIP LOCKED
    ), gone AS (
        DELETE FROM orchestrator.schedule_slots d USING picked p
        WHERE d.schedule_id = p.schedule_id AND d.slot = p.slot AND d.kind = p.kind
          AND d.state <> 'buffered'
        RETURNING 1)
    SELECT count(*) INTO n FROM gone;
    RETURN n;
END
$$;
REVOKE ALL ON FUNCTION orchestrator.prune_schedule_slots(float8, integer, boolean) FROM PUBLIC;
"""


def upgrade() -> None:
    op.create_index("ix_schedule_slots_recorded", "schedule_slots", ["recorded_at"], schema=S,
                    postgresql_where=sa.text("state <> 'buffered'"))
    op.execute(PRUNE_SLOTS_SQL)


def downgrade() -> None:
    op.execute("DROP FUNCTION orchestrator.prune_schedule_slots(float8, integer, boolean)")
    op.drop_index("ix_schedule_slots_recorded", table_name="schedule_slots", schema=S)
