"""operator_audit.tenant: the audit log is scoped by tenant like the operations it records

An operator restricted to some tenants (``operator_scopes``) reads only the audit rows of
operations in those tenants. Each row now keeps the tenant of the operation it acted on, so
that the scope holds without a join and after the operation is pruned (the audit's evidence is
kept longer than the runs it concerns). Existing rows take their operation's tenant; a row
whose operation is gone keeps NULL, which only an operator without scopes sees.

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-01 09:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0008"
down_revision = "0007"
branch_labels = None
depends_on = None

BACKFILL_SQL = """
UPDATE orchestrator.operator_audit a SET tenant = o.tenant
FROM orchestrator.operations o
WHERE a.target_kind = 'operation' AND a.target_id = o.id::text AND a.tenant IS NULL
"""


def upgrade() -> None:
    op.add_column("operator_audit", sa.Column("tenant", sa.Text(), nullable=True),
                  schema="orchestrator")
    op.execute(BACKFILL_SQL)
    op.create_index("ix_operator_audit_tenant", "operator_audit", ["tenant", "id"],
                    unique=False, schema="orchestrator")


def downgrade() -> None:
    op.drop_index("ix_operator_audit_tenant", table_name="operator_audit", schema="orchestrator")
    op.drop_column("operator_audit", "tenant", schema="orchestrator")
