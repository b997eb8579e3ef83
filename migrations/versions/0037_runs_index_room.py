"""room on the runs' index pages for a run's next versions: fillfactor 50 on three indexes

The claim and the end of a run are updates that cannot be HOT (they change columns that
partial indexes of ``runs`` read), so each adds a new entry for the run to every index of
``runs`` whose predicate holds, next to the run's entry of the submission: in ``pk_runs``,
``ix_runs_created`` and ``ix_runs_owner_created``, whose keys grow at the right (a submitted
run's id is a version 7 UUID, time first; a child run's is a name-based UUID, which lands
anywhere; ``ix_runs_owner_created`` grows at the right of each owner's range). PostgreSQL
fills such an index's right-hand leaf pages to its fillfactor (90 by default) when it
splits them, so the pages holding the runs just submitted had room for a tenth more
entries, and the claims' and ends' new entries met full pages: each such insertion first
ran a bottom-up deletion pass over the page (``_bt_delete_or_dedup_one_page``, which reads
the heap pages of the entries to find dead versions), 15 % of the server's instructions per
step at 16 rows a statement. With leaf pages
split at half full, a run's next versions find room beside it, and the dead ones go with the
next vacuum or the next pass.

Server instructions per step of the engine's writes (``python -m bench.bare --instructions
--ways engine,unguarded --batch 16 --runs 1152 --runs-small 640``, the change made alone to the
migrated database of the "unguarded" way; the engine's own figure varied 503,043-535,405
across the trials): these three indexes at 50 about 448,000-451,000 instructions a step, the
same at 70 486,402, the two unique indexes of ``operations`` at 50 alone 0.98x, deduplication
off on the five instead 0.91x. The price is the indexes' size: their right-hand pages half
full where they were nine tenths (about 1.6 times the pages for the runs written from now on;
a later ``REINDEX`` or rebuild fills every page to half). Only later splits are affected:
existing pages stay as they are, nothing is rebuilt, and the change takes a brief lock that
does not block reads or writes.

Revision ID: 0037
Revises: 0036
Create Date: 2026-12-07 14:30:00
"""

from __future__ import annotations

from alembic import op

revision = "0037"
down_revision = "0036"
branch_labels = None
depends_on = None

INDEXES = ("pk_runs", "ix_runs_created", "ix_runs_owner_created")
FILLFACTOR = 50


def upgrade() -> None:
    for index in INDEXES:
        op.execute(f"ALTER INDEX orchestrator.{index} SET (fillfactor = {FILLFACTOR})")


def downgrade() -> None:
    for index in INDEXES:
        op.execute(f"ALTER INDEX orchestrator.{index} RESET (fillfactor)")
