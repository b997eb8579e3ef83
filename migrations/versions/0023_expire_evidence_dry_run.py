"""expire_evidence: its dry run counts what a prune expires

The dry run of ``orchestrator.expire_evidence`` (migration 0013) named its CTE's rows ``e``
without the alias, so every ``prune --dry-run`` that looked at the evidence failed. It also
counted the pruned runs that still have a child row, which a batch leaves for a later one.
It now reads the runs a batch would pick (no child row left) and counts their operations and
incidents; the batch itself is unchanged.

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-06 09:00:00
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

from alembic import op

revision = "0023"
down_revision = "0022"
branch_labels = None
depends_on = None

DRY_0013 = """        WITH expiring AS (
            SELECT r.id FROM orchestrator.runs r
            WHERE r.pruned_at IS NOT NULL AND r.finished_at < cutoff)"""
DRY = """        WITH expiring AS (
            SELECT r.id FROM orchestrator.runs r
            WHERE r.pruned_at IS NOT NULL AND r.finished_at < cutoff
              AND NOT EXISTS (SELECT 1 FROM orchestrator.runs c
                              WHERE c.parent_run_id = r.id))"""
ALIAS_0013 = "(SELECT e.id FROM expiring)"
ALIAS = "(SELECT e.id FROM expiring e)"


def _expire_0013() -> str:
    """``expire_evidence`` as migration 0013 wrote it (its text is that revision's, for ever)."""
    path = Path(__file__).with_name("0013_retention.py")
    spec = importlib.util.spec_from_file_location("orchestrator_migration_0013", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text: str = module.EXPIRE_SQL
    return text.replace("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)


def _fixed() -> str:
    text = _expire_0013()
    assert text.count(DRY_0013) == 1 and text.count(ALIAS_0013) == 2, \
        "migration 0013's expire_evidence is not as expected"
    return text.replace(DRY_0013, DRY, 1).replace(ALIAS_0013, ALIAS)


def upgrade() -> None:
    op.execute(_fixed())


def downgrade() -> None:
    op.execute(_expire_0013())
