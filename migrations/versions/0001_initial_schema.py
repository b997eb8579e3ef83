"""initial schema

Revision ID: 0001
Revises:
Create Date: 2026-11-29 17:18:57.712626

Besides the tables, two triggers put the contract into the database itself:
- ``operations_guard_transition`` allows only the state arrows of CONTRACT C5;
- ``journal_append_only`` refuses UPDATE of journal events (C3: the journal is append-only).
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = "0001"
down_revision = None
branch_labels = None
depends_on = None


# The arrows of CONTRACT C5. Staying in the same state is allowed (receipt evidence updates on
# an unknown operation, for example) but never leaving a final state.
TRANSITIONS_SQL = """
CREATE FUNCTION orchestrator.operations_guard_transition() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF TG_OP = 'INSERT' THEN
        IF NEW.state NOT IN ('pending', 'submitted') THEN
            RAISE EXCEPTION 'operation % cannot be created in state %', NEW.id, NEW.state
                USING ERRCODE = 'check_violation';
        END IF;
        RETURN NEW;
    END IF;
    IF NEW.state = OLD.state THEN
        IF OLD.state IN ('committed', 'failed', 'not_applied', 'abandoned', 'cancelled')
           AND (NEW.receipt IS DISTINCT FROM OLD.receipt) THEN
            RAISE EXCEPTION 'operation % is final (%); its receipt cannot change', OLD.id, OLD.state
                USING ERRCODE = 'check_violation';
        END IF;
        RETURN NEW;
    END IF;
    IF (OLD.state, NEW.state) IN (
        ('pending', 'submitted'), ('pending', 'cancelled'),
        ('submitted', 'committed'), ('submitted', 'failed'), ('submitted', 'unknown'),
        ('unknown', 'committed'), ('unknown', 'not_applied'), ('unknown', 'abandoned')
    ) THEN
        RETURN NEW;
    END IF;
    RAISE EXCEPTION 'operation % cannot move from % to %', OLD.id, OLD.state, NEW.state
        USING ERRCODE = 'check_violation';
END
$$;
CREATE TRIGGER operations_guard_transition
    BEFORE INSERT OR UPDATE OF state, receipt ON orchestrator.operations
    FOR EACH ROW EXECUTE FUNCTION orchestrator.operations_guard_transition();

CREATE FUNCTION orchestrator.journal_append_only() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    RAISE EXCEPTION 'the journal is append-only (run %, seq %)', OLD.run_id, OLD.seq
        USING ERRCODE = 'check_violation';
END
$$;
CREATE TRIGGER journal_append_only
    BEFORE UPDATE ON orchestrator.journal
    FOR EACH ROW EXECUTE FUNCTION orchestrator.journal_append_only();
"""


def upgrade() -> None:
    op.create_table(
        "incidents",
        sa.Column("ref", sa.Text(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("code", sa.Text(), nullable=False),
        sa.Column("run_id", sa.UUID(), nullable=True),
        sa.Column("operation_id", sa.BigInteger(), nullable=True),
        sa.Column("phase", sa.Text(), nullable=True),
        sa.Column("cause", sa.Text(), nullable=True),
        sa.Column("upstream_status", sa.Integer(), nullable=True),
        sa.Column(
            "detail",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.PrimaryKeyConstraint("ref", name=op.f("pk_incidents")),
        schema="orchestrator",
    )
    op.create_index(
        "ix_incidents_run", "incidents", ["run_id"], unique=False, schema="orchestrator"
    )
    op.create_table(
        "operator_audit",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("operator", sa.Text(), nullable=False),
        sa.Column("action", sa.Text(), nullable=False),
        sa.Column("target_kind", sa.Text(), nullable=False),
        sa.Column("target_id", sa.Text(), nullable=False),
        sa.Column("evidence", sa.Text(), nullable=False),
        sa.Column("before", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("after", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_operator_audit")),
        schema="orchestrator",
    )
    op.create_index(
        "ix_operator_audit_target",
        "operator_audit",
        ["target_kind", "target_id"],
        unique=False,
        schema="orchestrator",
    )
    op.create_table(
        "runs",
        sa.Column("id", sa.UUID(), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("principal", sa.Text(), nullable=False),
        sa.Column("workflow_name", sa.Text(), nullable=False),
        sa.Column("workflow_version", sa.Text(), nullable=False),
        sa.Column("input", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column(
            "options",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("request_digest", sa.Text(), nullable=False),
        sa.Column("idempotency_key", sa.Text(), nullable=True),
        sa.Column("parent_run_id", sa.UUID(), nullable=True),
        sa.Column("parent_position", sa.Integer(), nullable=True),
        sa.Column(
            "status", sa.Text(), server_default=sa.text("'queued'"), nullable=False
        ),
        sa.Column("outcome_code", sa.Text(), nullable=True),
        sa.Column("result", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("error", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("waiting_for", sa.Text(), nullable=True),
        sa.Column("deadline_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("available_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("lease_owner", sa.Text(), nullable=True),
        sa.Column(
            "lease_token", sa.BigInteger(), server_default=sa.text("0"), nullable=False
        ),
        sa.Column("lease_expires_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "revision", sa.BigInteger(), server_default=sa.text("0"), nullable=False
        ),
        sa.Column("cancel_requested_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "(status IN ('succeeded', 'failed', 'cancelled')) = (finished_at IS NOT NULL)",
            name=op.f("ck_runs_finished_iff_terminal"),
        ),
        sa.CheckConstraint(
            "status <> 'running' OR (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)",
            name=op.f("ck_runs_running_has_lease"),
        ),
        sa.CheckConstraint(
            "status IN ('queued', 'running', 'waiting', 'needs_reconciliation', 'succeeded', 'failed', 'cancelled')",
            name=op.f("ck_runs_status"),
        ),
        sa.CheckConstraint(
            "revision >= 0 AND lease_token >= 0", name=op.f("ck_runs_counters")
        ),
        sa.ForeignKeyConstraint(
            ["parent_run_id"],
            ["orchestrator.runs.id"],
            name=op.f("fk_runs_parent_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_runs")),
        sa.UniqueConstraint(
            "tenant",
            "principal",
            "idempotency_key",
            name=op.f("uq_runs_tenant_principal_idempotency_key"),
        ),
        schema="orchestrator",
    )
    op.create_index(
        "ix_runs_claimable",
        "runs",
        ["available_at"],
        unique=False,
        schema="orchestrator",
        postgresql_where=sa.text(
            "status IN ('queued', 'waiting') AND available_at IS NOT NULL"
        ),
    )
    op.create_index(
        "ix_runs_lease_expiry",
        "runs",
        ["lease_expires_at"],
        unique=False,
        schema="orchestrator",
        postgresql_where=sa.text("status = 'running'"),
    )
    op.create_index(
        "ix_runs_owner_created",
        "runs",
        ["tenant", "principal", "created_at"],
        unique=False,
        schema="orchestrator",
    )
    op.create_index(
        "ix_runs_parent",
        "runs",
        ["parent_run_id"],
        unique=False,
        schema="orchestrator",
        postgresql_where=sa.text("parent_run_id IS NOT NULL"),
    )
    op.create_table(
        "external_events",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("run_id", sa.UUID(), nullable=False),
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("event_key", sa.Text(), nullable=True),
        sa.Column("payload", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("consumed_position", sa.Integer(), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["orchestrator.runs.id"],
            name=op.f("fk_external_events_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_external_events")),
        sa.UniqueConstraint(
            "run_id", "event_key", name=op.f("uq_external_events_run_id_event_key")
        ),
        schema="orchestrator",
    )
    op.create_index(
        "ix_external_events_run_name",
        "external_events",
        ["run_id", "name", "id"],
        unique=False,
        schema="orchestrator",
    )
    op.create_table(
        "journal",
        sa.Column("run_id", sa.UUID(), nullable=False),
        sa.Column("seq", sa.BigInteger(), nullable=False),
        sa.Column("kind", sa.Text(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=True),
        sa.Column("name", sa.Text(), nullable=True),
        sa.Column("schema_version", sa.SmallInteger(), nullable=False),
        sa.Column(
            "payload",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column("lease_token", sa.BigInteger(), nullable=False),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint("seq >= 1", name=op.f("ck_journal_seq_positive")),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["orchestrator.runs.id"],
            name=op.f("fk_journal_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("run_id", "seq", name=op.f("pk_journal")),
        schema="orchestrator",
    )
    op.create_table(
        "operations",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("run_id", sa.UUID(), nullable=False),
        sa.Column("position", sa.Integer(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("tool_name", sa.Text(), nullable=False),
        sa.Column("tool_version", sa.Text(), nullable=False),
        sa.Column("effect_class", sa.Text(), nullable=False),
        sa.Column("tenant", sa.Text(), nullable=False),
        sa.Column("principal", sa.Text(), nullable=False),
        sa.Column("intent_digest", sa.Text(), nullable=False),
        sa.Column("arguments", postgresql.JSONB(astext_type=sa.Text()), nullable=False),
        sa.Column("idempotency_key", sa.Text(), nullable=False),
        sa.Column("state", sa.Text(), nullable=False),
        sa.Column("receipt", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("receipt_digest", sa.Text(), nullable=True),
        sa.Column("error", postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column("worker_id", sa.Text(), nullable=True),
        sa.Column("lease_token", sa.BigInteger(), nullable=True),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("submitted_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column("finished_at", sa.DateTime(timezone=True), nullable=True),
        sa.Column(
            "updated_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.CheckConstraint(
            "effect_class IN ('consequential', 'idempotent', 'read')",
            name=op.f("ck_operations_effect_class"),
        ),
        sa.CheckConstraint(
            "state <> 'committed' OR receipt_digest IS NOT NULL",
            name=op.f("ck_operations_committed_receipt"),
        ),
        sa.CheckConstraint(
            "state IN ('pending', 'submitted', 'committed', 'failed', 'unknown', 'not_applied', 'abandoned', 'cancelled')",
            name=op.f("ck_operations_state"),
        ),
        sa.CheckConstraint(
            "attempt >= 1 AND position >= 0", name=op.f("ck_operations_identity")
        ),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["orchestrator.runs.id"],
            name=op.f("fk_operations_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_operations")),
        sa.UniqueConstraint(
            "run_id",
            "position",
            "attempt",
            name=op.f("uq_operations_run_id_position_attempt"),
        ),
        schema="orchestrator",
    )
    op.create_index(
        "ix_operations_unknown",
        "operations",
        ["updated_at"],
        unique=False,
        schema="orchestrator",
        postgresql_where=sa.text("state = 'unknown'"),
    )
    op.create_table(
        "reconciliation_items",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("operation_id", sa.BigInteger(), nullable=False),
        sa.Column("run_id", sa.UUID(), nullable=False),
        sa.Column("reason", sa.Text(), nullable=False),
        sa.Column("state", sa.Text(), server_default=sa.text("'open'"), nullable=False),
        sa.Column(
            "lookup_attempts", sa.Integer(), server_default=sa.text("0"), nullable=False
        ),
        sa.Column(
            "next_attempt_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("claimed_by", sa.Text(), nullable=True),
        sa.Column("claimed_until", sa.DateTime(timezone=True), nullable=True),
        sa.Column("resolution", sa.Text(), nullable=True),
        sa.Column(
            "evidence",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'[]'::jsonb"),
            nullable=False,
        ),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.Column("resolved_at", sa.DateTime(timezone=True), nullable=True),
        sa.CheckConstraint(
            "state IN ('open', 'operator', 'resolved')",
            name=op.f("ck_reconciliation_items_state"),
        ),
        sa.ForeignKeyConstraint(
            ["operation_id"],
            ["orchestrator.operations.id"],
            name=op.f("fk_reconciliation_items_operation_id_operations"),
            ondelete="CASCADE",
        ),
        sa.ForeignKeyConstraint(
            ["run_id"],
            ["orchestrator.runs.id"],
            name=op.f("fk_reconciliation_items_run_id_runs"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reconciliation_items")),
        sa.UniqueConstraint(
            "operation_id", name=op.f("uq_reconciliation_items_operation_id")
        ),
        schema="orchestrator",
    )
    op.create_index(
        "ix_reconciliation_items_due",
        "reconciliation_items",
        ["next_attempt_at"],
        unique=False,
        schema="orchestrator",
        postgresql_where=sa.text("state = 'open'"),
    )
    op.create_table(
        "reconciliation_lookups",
        sa.Column("id", sa.BigInteger(), sa.Identity(always=False), nullable=False),
        sa.Column("item_id", sa.BigInteger(), nullable=False),
        sa.Column("attempt", sa.Integer(), nullable=False),
        sa.Column("answer", sa.Text(), nullable=False),
        sa.Column(
            "detail",
            postgresql.JSONB(astext_type=sa.Text()),
            server_default=sa.text("'{}'::jsonb"),
            nullable=False,
        ),
        sa.Column(
            "created_at",
            sa.DateTime(timezone=True),
            server_default=sa.text("now()"),
            nullable=False,
        ),
        sa.ForeignKeyConstraint(
            ["item_id"],
            ["orchestrator.reconciliation_items.id"],
            name=op.f("fk_reconciliation_lookups_item_id_reconciliation_items"),
            ondelete="CASCADE",
        ),
        sa.PrimaryKeyConstraint("id", name=op.f("pk_reconciliation_lookups")),
        schema="orchestrator",
    )
    op.create_index(
        op.f("ix_reconciliation_lookups_item_id"),
        "reconciliation_lookups",
        ["item_id"],
        unique=False,
        schema="orchestrator",
    )

    op.execute(TRANSITIONS_SQL)


def downgrade() -> None:
    op.execute("DROP TRIGGER IF EXISTS journal_append_only ON orchestrator.journal")
    op.execute("DROP FUNCTION IF EXISTS orchestrator.journal_append_only()")
    op.execute(
        "DROP TRIGGER IF EXISTS operations_guard_transition ON orchestrator.operations"
    )
    op.execute("DROP FUNCTION IF EXISTS orchestrator.operations_guard_transition()")
    op.drop_index(
        op.f("ix_reconciliation_lookups_item_id"),
        table_name="reconciliation_lookups",
        schema="orchestrator",
    )
    op.drop_table("reconciliation_lookups", schema="orchestrator")
    op.drop_index(
        "ix_reconciliation_items_due",
        table_name="reconciliation_items",
        schema="orchestrator",
        postgresql_where=sa.text("state = 'open'"),
    )
    op.drop_table("reconciliation_items", schema="orchestrator")
    op.drop_index(
        "ix_operations_unknown",
        table_name="operations",
        schema="orchestrator",
        postgresql_where=sa.text("state = 'unknown'"),
    )
    op.drop_table("operations", schema="orchestrator")
    op.drop_table("journal", schema="orchestrator")
    op.drop_index(
        "ix_external_events_run_name",
        table_name="external_events",
        schema="orchestrator",
    )
    op.drop_table("external_events", schema="orchestrator")
    op.drop_index(
        "ix_runs_parent",
        table_name="runs",
        schema="orchestrator",
        postgresql_where=sa.text("parent_run_id IS NOT NULL"),
    )
    op.drop_index("ix_runs_owner_created", table_name="runs", schema="orchestrator")
    op.drop_index(
        "ix_runs_lease_expiry",
        table_name="runs",
        schema="orchestrator",
        postgresql_where=sa.text("status = 'running'"),
    )
    op.drop_index(
        "ix_runs_claimable",
        table_name="runs",
        schema="orchestrator",
        postgresql_where=sa.text(
            "status IN ('queued', 'waiting') AND available_at IS NOT NULL"
        ),
    )
    op.drop_table("runs", schema="orchestrator")
    op.drop_index(
        "ix_operator_audit_target", table_name="operator_audit", schema="orchestrator"
    )
    op.drop_table("operator_audit", schema="orchestrator")
    op.drop_index("ix_incidents_run", table_name="incidents", schema="orchestrator")
    op.drop_table("incidents", schema="orchestrator")
