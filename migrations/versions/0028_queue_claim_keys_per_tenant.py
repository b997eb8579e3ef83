"""queue claim: a concurrency key is its tenant's own

``key_concurrency`` bounded the runs of one ``concurrency_key`` across every tenant: a
submitter of one tenant who named another tenant's key (``customer-42``, guessed or common)
took that tenant's slots, and with a backlog under that key held the other tenant's runs back
for as long as it lasted. Idempotency keys were already scoped by owner (C1); concurrency keys
were not scoped at all.

``orchestrator.queue_claim`` now counts, orders and passes over a key's runs per (tenant,
key): the keys whose slots are all held are (key, tenant) pairs, each key's free slots and its
oldest runs not yet started are its tenant's, and a key's runs start in submission order
within its tenant. Runs of different tenants never count against each other's keys; the runs
of one tenant's principals share its keys. Everything else the claim decides is unchanged.

The two indexes that serve a key's counts lead with the tenant after the queue, so that one
tenant's backlog under a key costs another tenant's claims of the same key nothing:
``ix_runs_queue_held`` (queue, tenant, concurrency_key) and ``ix_runs_queue_key_unstarted``
(queue, tenant, concurrency_key, created_at). Both are partial indexes of the runs started and
not finished, and of the runs of a key not started: small, built in the time the runs they
list take to read.

The exact test costs a claim that reads many runs of keys busy for some tenant a little: with
10,000 runs waiting over 200 keys, a third of them busy (``python -m bench.claim_cost --runs
10000 --revisions 0026,head``), a claim's median went from 6.4 to 7.4 ms.

Revision ID: 0028
Revises: 0027
Create Date: 2026-12-06 12:30:00
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

import sqlalchemy as sa
from alembic import op

revision = "0028"
down_revision = "0027"
branch_labels = None
depends_on = None

S = "orchestrator"

# Each part of migration 0024's function, and what it becomes: a key is (tenant, key). A busy
# key is kept as "key tenant", which names one pair only: a key holds no space (C1's rules).
# The windows test a run's key against the keys busy for some tenant first: that plain
# comparison the planner estimates from the column's statistics, so the windows stay index
# scans (tested against the pairs alone, the planner guessed, and read the queue's every
# ready run to sort them); the pairs then decide for a key busy for some tenant.
PARTS = (
    ("""    -- The keys whose slots are all held: none of their runs that needs a slot can start
    -- now, so the windows below pass them over (one key's backlog never hides the others).
""", """    -- The keys whose slots are all held, each its tenant's ("key tenant"), and the keys
    -- busy for some tenant: none of their runs that needs a slot can start now, so the
    -- windows below pass them over (one key's backlog never hides the others).
""", 1),
    ("""    busy text[] := '{}';
""", """    busy text[] := '{}';
    busy_keys text[] := '{}';
""", 1),
    ("""            SELECT h.concurrency_key FROM orchestrator.runs AS h
            WHERE h.queue = q AND h.concurrency_key IS NOT NULL
              AND h.started_at IS NOT NULL AND h.finished_at IS NULL
              AND (cfg.count_parked OR h.status <> 'waiting')
            GROUP BY h.concurrency_key
""", """            SELECT h.concurrency_key || ' ' || h.tenant FROM orchestrator.runs AS h
            WHERE h.queue = q AND h.concurrency_key IS NOT NULL
              AND h.started_at IS NOT NULL AND h.finished_at IS NULL
              AND (cfg.count_parked OR h.status <> 'waiting')
            GROUP BY h.concurrency_key, h.tenant
""", 1),
    ("""            HAVING count(*) >= cfg.key_concurrency);
""", """            HAVING count(*) >= cfg.key_concurrency);
        busy_keys := ARRAY(SELECT DISTINCT split_part(b.pair, ' ', 1)
                           FROM unnest(busy) AS b(pair));
""", 1),
    ("r.concurrency_key <> ALL(busy)",
     "r.concurrency_key <> ALL(busy_keys)\n"
     "                OR r.concurrency_key || ' ' || r.tenant <> ALL(busy)", 2),
    ("r.concurrency_key AS ckey,", "r.tenant AS ctenant, r.concurrency_key AS ckey,", 1),
    ("""        -- Per key of the candidates: the slots its holders leave free.
        SELECT k.ckey, cfg.key_concurrency - (
                   SELECT count(*) FROM orchestrator.runs AS h
                   WHERE h.queue = q AND h.concurrency_key = k.ckey
""", """        -- Per key of the candidates (a key is its tenant's): the slots its holders leave
        -- free.
        SELECT k.ctenant, k.ckey, cfg.key_concurrency - (
                   SELECT count(*) FROM orchestrator.runs AS h
                   WHERE h.queue = q AND h.tenant = k.ctenant AND h.concurrency_key = k.ckey
""", 1),
    ("FROM (SELECT DISTINCT ckey FROM ready", "FROM (SELECT DISTINCT ctenant, ckey FROM ready", 1),
    ("WHERE o.queue = q AND o.concurrency_key = f.ckey AND o.started_at IS NULL",
     "WHERE o.queue = q AND o.tenant = f.ctenant AND o.concurrency_key = f.ckey\n"
     "              AND o.started_at IS NULL", 1),
    ("PARTITION BY ready.ckey", "PARTITION BY ready.ctenant, ready.ckey", 1),
    ("LEFT JOIN key_free AS f ON f.ckey = ready.ckey",
     "LEFT JOIN key_free AS f\n"
     "             ON f.ctenant = ready.ctenant AND f.ckey = ready.ckey", 1),
)

HELD_WHERE = "queue IS NOT NULL AND started_at IS NOT NULL AND finished_at IS NULL"
UNSTARTED_WHERE = ("queue IS NOT NULL AND concurrency_key IS NOT NULL AND "
                   "started_at IS NULL AND status = 'queued'")


def _claim_0024() -> str:
    """The claim function as migration 0024 left it (its text is that revision's, for ever)."""
    path = Path(__file__).with_name("0024_queue_claim_free_keys_every_level.py")
    spec = importlib.util.spec_from_file_location("orchestrator_migration_0024", path)
    assert spec is not None and spec.loader is not None
    module: ModuleType = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    text: str = (module._claim_0020().replace(module.DECLARED_0020, module.DECLARED, 1)
                 .replace(module.WINDOWS_0020, module.WINDOWS, 1))
    for old, _, count in PARTS:
        assert text.count(old) == count, "migration 0024's queue_claim is not as expected"
    return text


def _indexes(tenant: bool) -> None:
    for name in ("ix_runs_queue_held", "ix_runs_queue_key_unstarted"):
        op.drop_index(name, table_name="runs", schema=S)
    lead = ["queue", "tenant"] if tenant else ["queue"]
    op.create_index("ix_runs_queue_held", "runs", [*lead, "concurrency_key"], schema=S,
                    postgresql_where=sa.text(HELD_WHERE))
    op.create_index("ix_runs_queue_key_unstarted", "runs",
                    [*lead, "concurrency_key", "created_at"], schema=S,
                    postgresql_where=sa.text(UNSTARTED_WHERE))


def upgrade() -> None:
    text = _claim_0024()
    for old, new, _ in PARTS:
        text = text.replace(old, new)
    op.execute(text)
    _indexes(tenant=True)


def downgrade() -> None:
    op.execute(_claim_0024())
    _indexes(tenant=False)
