"""schedules and schedule_slots: cron schedules that fire runs, with no leader

``schedules`` holds each schedule's definition (a workflow, a cron expression in a time zone,
an overlap policy, a catch-up window, an input and the owner its runs are submitted as) and its
place: ``next_slot`` (the next slot not handled yet), the last slot handled and the run it
fired, and how many slots wait for that run to end (``buffered``). Every worker's ticker locks
the due rows ``FOR UPDATE SKIP LOCKED`` and handles each in one transaction with the runs it
submits, whose idempotency key is the schedule id and the slot: a slot fires once however many
workers tick and whoever crashes (docs/schedules.md).

``schedule_slots`` says what became of each slot handled one by one (fired, skipped, buffered),
with its run; ``schedule_gaps`` records a range of slots at once (missed after downtime beyond
the catch-up window, or passed while the schedule was paused), however many slots it holds.

Revision ID: 0011
Revises: 0010
Create Date: 2026-12-03 08:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB, UUID

revision = "0011"
down_revision = "0010"
branch_labels = None
depends_on = None

S = "orchestrator"


def _ts(name: str, *, nullable: bool = True, now: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable,
                     server_default=sa.text("now()") if now else None)


def upgrade() -> None:
    op.create_table(
        "schedules",
        sa.Column("id", sa.Text(), nullable=False),
        sa.Column("workflow_name", sa.Text(), nullable=False),
        sa.Column("workflow_version", sa.Text(), nullable=False),
        sa.Column("cron", sa.Text(), nullable=False),
        sa.Column("timezone", sa.Text(), nullable=False),
        sa.Column("overlap", sa.Text(), nullable=False),
        sa.Column("catchup_seconds", sa.Float(), nullable=False),
        sa.Column("input", JSONB(), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("principal", sa.Text(), nullable=False),
        sa.Column("declared", sa.Boolean(), nullable=False, server_default=sa.text("false")),
        sa.Column("paused", sa.Boolean(), nullable=False, server_default=sa.text("false")),
        _ts("paused_at"),
        _ts("next_slot"),
        _ts("last_slot"),
        sa.Column("last_run_id", UUID(as_uuid=True), nullable=True),
        sa.Column("buffered", sa.Integer(), nullable=False, server_default=sa.text("0")),
        _ts("created_at", nullable=False, now=True),
        _ts("updated_at", nullable=False, now=True),
        sa.CheckConstraint(
            "overlap IN ('skip', 'buffer_one', 'buffer_all', 'cancel_other', 'allow_all')",
            name=op.f("ck_schedules_overlap")),
        sa.CheckConstraint("buffered >= 0 AND catchup_seconds > 0",
                           name=op.f("ck_schedules_counters")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_schedules")),
        schema=S,
    )
    op.create_index("ix_schedules_next_slot", "schedules", ["next_slot"], schema=S,
                    postgresql_where=sa.text("NOT paused"))
    op.create_table(
        "schedule_slots",
        sa.Column("schedule_id", sa.Text(), nullable=False),
        sa.Column("slot", sa.DateTime(timezone=True), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=True),
        sa.Column("overlap", sa.Text(), nullable=False),
        sa.Column("run_id", UUID(as_uuid=True), nullable=True),
        _ts("recorded_at", nullable=False, now=True),
        sa.CheckConstraint("kind IN ('cron', 'backfill', 'trigger')",
                           name=op.f("ck_schedule_slots_kind")),
        sa.CheckConstraint("state IN ('fired', 'skipped', 'buffered')",
                           name=op.f("ck_schedule_slots_state")),
        sa.CheckConstraint("(state = 'fired') = (run_id IS NOT NULL)",
                           name=op.f("ck_schedule_slots_fired_has_run")),
        sa.ForeignKeyConstraint(["schedule_id"], [f"{S}.schedules.id"], ondelete="CASCADE",
                                name=op.f("fk_schedule_slots_schedule_id_schedules")),
        sa.PrimaryKeyConstraint("schedule_id", "slot", "kind", name=op.f("pk_schedule_slots")),
        schema=S,
    )
    op.create_index("ix_schedule_slots_buffered", "schedule_slots", ["schedule_id", "slot"],
                    schema=S, postgresql_where=sa.text("state = 'buffered'"))
    op.create_table(
        "schedule_gaps",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("schedule_id", sa.Text(), nullable=False),
        sa.Column("first_slot", sa.DateTime(timezone=True), nullable=False),
        sa.Column("last_slot", sa.DateTime(timezone=True), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        _ts("recorded_at", nullable=False, now=True),
        sa.CheckConstraint("reason IN ('missed', 'paused')", name=op.f("ck_schedule_gaps_reason")),
        sa.CheckConstraint("first_slot <= last_slot", name=op.f("ck_schedule_gaps_range")),
        sa.ForeignKeyConstraint(["schedule_id"], [f"{S}.schedules.id"], ondelete="CASCADE",
                                name=op.f("fk_schedule_gaps_schedule_id_schedules")),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_schedule_gaps")),
        schema=S,
    )
    op.create_index("ix_schedule_gaps_schedule_id", "schedule_gaps", ["schedule_id"], schema=S)


def downgrade() -> None:
    op.drop_index("ix_schedule_gaps_schedule_id", table_name="schedule_gaps", schema=S)
    op.drop_table("schedule_gaps", schema=S)
    op.drop_index("ix_schedule_slots_buffered", table_name="schedule_slots", schema=S)
    op.drop_table("schedule_slots", schema=S)
    op.drop_index("ix_schedules_next_slot", table_name="schedules", schema=S)
    op.drop_table("schedules", schema=S)
