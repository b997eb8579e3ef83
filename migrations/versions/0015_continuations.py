"""continuations: a run that continued as a new run (``ctx.continue_as_new``) names it

``runs.continued_from``: the run this one continues (its previous generation). The previous
run ends ``succeeded`` with ``outcome_code = 'CONTINUED_AS_NEW'`` and names the new one in
``runs.superseded_by`` (migration 0014); the submission key, the parent's link and the
deadline move to the new run in the transaction that ends the old one (docs/versioning.md).

Revision ID: 0015
Revises: 0014
Create Date: 2026-12-04 04:30:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import UUID

revision = "0015"
down_revision = "0014"
branch_labels = None
depends_on = None

S = "orchestrator"


def upgrade() -> None:
    op.add_column("runs", sa.Column("continued_from", UUID(as_uuid=True), nullable=True),
                  schema=S)


def downgrade() -> None:
    op.drop_column("runs", "continued_from", schema=S)
