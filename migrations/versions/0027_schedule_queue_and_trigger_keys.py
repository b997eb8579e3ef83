"""schedules.queue and schedule_slots.trigger_key: where a schedule's runs wait, and what a
keyed trigger did

``schedules.queue`` is the queue the schedule's runs wait in (NULL: the default queue), stored
with the schedule so that a process without the application's code (the CLI without
``--app``) fires into it too. It is written where the workflow is known: ``@app.schedule``'s
declaration, ``app.schedules.create`` and ``update``, and a ticker that fires the schedule
with the workflow registered (which keeps it true when the code moves the workflow to another
queue). Schedules stored before this revision have NULL until then: nothing here can read the
application's code.

``schedule_slots.trigger_key`` is the idempotency key a trigger was sent with (NULL: none, and
always NULL for other kinds): a trigger sent again with its key answers with that slot, and
its run, instead of firing again (docs/schedules.md). ``ux_schedule_slots_trigger_key`` makes
a key one slot per schedule.

Revision ID: 0027
Revises: 0026
Create Date: 2026-12-06 11:10:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0027"
down_revision = "0026"
branch_labels = None
depends_on = None

S = "orchestrator"


def upgrade() -> None:
    op.add_column("schedules", sa.Column("queue", sa.Text(), nullable=True), schema=S)
    op.add_column("schedule_slots", sa.Column("trigger_key", sa.Text(), nullable=True),
                  schema=S)
    op.create_check_constraint(op.f("ck_schedule_slots_trigger_key"), "schedule_slots",
                               "trigger_key IS NULL OR kind = 'trigger'", schema=S)
    op.create_index("ux_schedule_slots_trigger_key", "schedule_slots",
                    ["schedule_id", "trigger_key"], unique=True, schema=S,
                    postgresql_where=sa.text("trigger_key IS NOT NULL"))


def downgrade() -> None:
    op.drop_index("ux_schedule_slots_trigger_key", table_name="schedule_slots", schema=S)
    op.drop_constraint(op.f("ck_schedule_slots_trigger_key"), "schedule_slots", schema=S)
    op.drop_column("schedule_slots", "trigger_key", schema=S)
    op.drop_column("schedules", "queue", schema=S)
