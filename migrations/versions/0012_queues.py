"""queues and tool limits: flow control enforced where work is admitted

``queues`` holds each queue's limits (global, per worker and per key concurrency, a start rate,
priorities, whether parked runs hold their slot) and its pause. The values in the columns are
the ones in force; ``declared`` keeps what the code declared and ``overridden`` names the
columns set at run time (``orchestrator queues set``), which a later declaration leaves alone.

``runs`` gains the queue it was submitted to (NULL: the default queue, unlimited), its
priority, its concurrency key and when it first started. The default claim
(``runs_ready``) and its index ``ix_runs_claimable`` now hold only runs of the default queue,
so a backlog held back by a queue's limits costs the default claim nothing.

``orchestrator.queue_claim(queue, workflows, worker, lim, ttl)`` claims from one queue: it
locks the queue's row (so the claims of one queue are serialised: each sees every start the
one before it committed), counts the slots held, this worker's runs and the starts in the rate
window with statements that each read a fresh snapshot, picks the runs those limits admit and
moves them to ``running`` in the same transaction, which releases the queue's row when it
commits. A limit can therefore never be exceeded by two workers claiming at once, and a crash
at any point leaves either the whole claim or nothing. The rules are in docs/flow.md.

Tools: ``orchestrator.tool_admit(tool, concurrency, rate, per)`` runs in the transaction that
records a call's operation as ``submitted`` (write-ahead, before dispatch), before the insert:
under a transaction-level advisory lock of the tool it counts the tool's operations in flight
(``submitted``, or ``unknown`` within the tool's timeout, through
``ix_operations_tool_inflight``) and its dispatches in the rate window
(``tool_dispatches``), and reads the tool's shared back-off (``tool_limits.backoff_until``, set
when the provider answered 429 or 503 with a Retry-After). The lock is only tried, never waited
for (writes of many runs share a transaction, so waiting could deadlock): a caller that does
not get it tries again a moment later. A fenced write (a zombie) rolls back with its
admission, so it never counts. Runs parked for the turn of a tool at its concurrency limit
(``ix_runs_turn_waiters``) are woken when a call of the tool ends.

Revision ID: 0012
Revises: 0011
Create Date: 2026-12-03 17:00:00
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import ARRAY, JSONB

revision = "0012"
down_revision = "0011"
branch_labels = None
depends_on = None

S = "orchestrator"

READY = "status IN ('queued', 'waiting') AND available_at IS NOT NULL"
TURN_WAITERS = "status = 'waiting' AND waiting_for LIKE '%the turn of tool %'"

CLAIM_SQL = """
CREATE FUNCTION orchestrator.queue_claim(q text, workflows text[], worker text, lim integer,
                                         ttl float8)
RETURNS TABLE (id uuid, tenant text, principal text, workflow_name text,
               workflow_version text, input_text text, deadline_at timestamptz,
               lease_token bigint, revision bigint, cancel_requested_at timestamptz,
               parent_run_id uuid, traceparent text, db_now timestamptz,
               created_at timestamptz, claimed_from text, wake_at timestamptz)
LANGUAGE plpgsql VOLATILE AS $$
#variable_conflict use_column
DECLARE
    cfg orchestrator.queues%ROWTYPE;
    at timestamptz;
    held integer := 0;
    mine integer := 0;
    recent integer := 0;
    gfree integer;
    rfree integer;
    take integer;
    scan integer;
    window_len interval;
    wake timestamptz;
    ids uuid[];
    froms text[];
BEGIN
    IF lim < 1 THEN
        RETURN;
    END IF;
    -- Serialise the claims of this queue: every count below is read after the claim before
    -- this one committed.
    SELECT * INTO cfg FROM orchestrator.queues AS qq WHERE qq.name = q FOR UPDATE;
    IF NOT FOUND OR cfg.paused THEN
        RETURN;
    END IF;
    at := clock_timestamp();
    IF cfg.concurrency IS NOT NULL THEN
        SELECT count(*) INTO held FROM orchestrator.runs AS h
        WHERE h.queue = q AND h.started_at IS NOT NULL AND h.finished_at IS NULL
          AND (cfg.count_parked OR h.status <> 'waiting');
    END IF;
    IF cfg.worker_concurrency IS NOT NULL THEN
        SELECT count(*) INTO mine FROM orchestrator.runs AS h
        WHERE h.queue = q AND h.started_at IS NOT NULL AND h.finished_at IS NULL
          AND h.status = 'running' AND h.lease_owner = worker;
    END IF;
    IF cfg.rate_limit IS NOT NULL THEN
        window_len := make_interval(secs => cfg.rate_seconds);
        SELECT count(*) INTO recent FROM orchestrator.runs AS h
        WHERE h.queue = q AND h.started_at > at - window_len;
    END IF;
    gfree := coalesce(cfg.concurrency - held, lim);
    rfree := coalesce(cfg.rate_limit - recent, lim);
    take := least(lim, coalesce(cfg.worker_concurrency - mine, lim));
    IF take < 1 THEN
        RETURN;
    END IF;
    -- Without keys the runs admitted are a prefix of the candidates in order, so reading
    -- ``take`` of them is enough; with keys, the ready runs of busy keys are passed over, so
    -- read further.
    scan := CASE WHEN cfg.key_concurrency IS NULL THEN take ELSE greatest(take * 50, 500) END;

    WITH scanned AS (
        -- The longest waiting and (with priorities) the best by priority, each read in index
        -- order: a run that waits long enough is among the candidates whatever its priority.
        (SELECT r.id FROM orchestrator.runs AS r
         WHERE r.queue = q AND r.status IN ('queued', 'waiting') AND r.available_at IS NOT NULL
           AND r.available_at <= now()
           AND r.workflow_name || '@' || r.workflow_version = ANY(workflows)
         ORDER BY r.available_at LIMIT scan)
        UNION
        (SELECT r.id FROM orchestrator.runs AS r
         WHERE cfg.priority AND r.queue = q AND r.status IN ('queued', 'waiting')
           AND r.available_at IS NOT NULL AND r.available_at <= now()
           AND r.workflow_name || '@' || r.workflow_version = ANY(workflows)
         ORDER BY r.priority, r.available_at LIMIT scan)
    ), ready AS (
        SELECT r.id, r.status, r.created_at, r.available_at, r.concurrency_key AS ckey,
               r.started_at IS NULL AS fresh,
               (r.started_at IS NOT NULL AND (r.status = 'queued' OR cfg.count_parked)) AS holds,
               CASE WHEN cfg.priority
                    THEN r.priority - floor(extract(epoch FROM now() - r.available_at)
                                            / cfg.priority_aging_seconds)
                    ELSE 0 END AS rank_priority
        FROM scanned JOIN orchestrator.runs AS r ON r.id = scanned.id
    ), key_free AS (
        -- Per key of the candidates: the slots its holders leave free.
        SELECT k.ckey, cfg.key_concurrency - (
                   SELECT count(*) FROM orchestrator.runs AS h
                   WHERE h.queue = q AND h.concurrency_key = k.ckey
                     AND h.started_at IS NOT NULL AND h.finished_at IS NULL
                     AND (cfg.count_parked OR h.status <> 'waiting')) AS free
        FROM (SELECT DISTINCT ckey FROM ready
              WHERE ckey IS NOT NULL AND NOT holds AND cfg.key_concurrency IS NOT NULL) AS k
    ), key_next AS (
        -- Per key: its oldest runs not yet started, as many as it has free slots; a key's
        -- runs start in submission order, so only these may start now.
        SELECT n.id FROM key_free AS f
        CROSS JOIN LATERAL (
            SELECT o.id FROM orchestrator.runs AS o
            WHERE o.queue = q AND o.concurrency_key = f.ckey AND o.started_at IS NULL
              AND o.status = 'queued' AND o.available_at IS NOT NULL
              AND o.available_at <= now()
            ORDER BY o.created_at, o.id
            LIMIT greatest(f.free, 0)) AS n
    ), keyed AS (
        SELECT ready.*,
               row_number() OVER (PARTITION BY ready.ckey
                                  ORDER BY ready.fresh, ready.created_at, ready.id) AS key_rank,
               f.free AS key_slots
        FROM ready LEFT JOIN key_free AS f ON f.ckey = ready.ckey
        WHERE ready.holds OR ready.ckey IS NULL OR cfg.key_concurrency IS NULL
           OR NOT ready.fresh OR ready.id IN (SELECT key_next.id FROM key_next)
    ), counted AS (
        SELECT keyed.*,
               count(*) FILTER (WHERE NOT holds) OVER w AS n_new,
               count(*) FILTER (WHERE fresh) OVER w AS n_fresh
        FROM keyed
        WHERE holds OR key_slots IS NULL OR key_rank <= key_slots
        WINDOW w AS (ORDER BY rank_priority, available_at, id)
    ), admitted AS (
        SELECT counted.id, counted.status, counted.rank_priority, counted.available_at
        FROM counted
        WHERE holds OR (n_new <= gfree AND (NOT fresh OR n_fresh <= rfree))
        ORDER BY rank_priority, available_at, id
        LIMIT take
    )
    SELECT array_agg(admitted.id), array_agg(admitted.status) INTO ids, froms FROM admitted;

    IF ids IS NOT NULL THEN
        RETURN QUERY
        UPDATE orchestrator.runs AS r
        SET status = 'running', lease_owner = worker, lease_token = r.lease_token + 1,
            lease_expires_at = now() + make_interval(secs => ttl), waiting_for = NULL,
            available_at = NULL, updated_at = now(),
            started_at = coalesce(r.started_at, clock_timestamp())
        FROM unnest(ids, froms) AS p(id, status)
        WHERE r.id = p.id AND r.status IN ('queued', 'waiting') AND r.available_at IS NOT NULL
        RETURNING r.id, r.tenant, r.principal, r.workflow_name, r.workflow_version,
                  r.input::text, r.deadline_at, r.lease_token, r.revision,
                  r.cancel_requested_at, r.parent_run_id, r.traceparent, now(), r.created_at,
                  p.status, NULL::timestamptz;
    END IF;

    IF cfg.rate_limit IS NOT NULL THEN
        -- When the window next has room: its oldest start ages out. Said only when it is
        -- full, so that the worker wakes then instead of at its next poll.
        SELECT min(h.started_at) + window_len INTO wake FROM orchestrator.runs AS h
        WHERE h.queue = q AND h.started_at > clock_timestamp() - window_len
        HAVING count(*) >= cfg.rate_limit;
        IF wake IS NOT NULL THEN
            RETURN QUERY SELECT NULL::uuid, NULL::text, NULL::text, NULL::text, NULL::text,
                NULL::text, NULL::timestamptz, NULL::bigint, NULL::bigint, NULL::timestamptz,
                NULL::uuid, NULL::text, now(), NULL::timestamptz, NULL::text, wake;
        END IF;
    END IF;
END
$$;
"""

ADMIT_SQL = """
CREATE FUNCTION orchestrator.tool_admit(t text, conc integer, rate integer, per float8,
                                        timeout float8)
RETURNS float8 LANGUAGE plpgsql VOLATILE AS $$
-- NULL: admitted (the caller records its operation now, in this transaction); -1: another
-- transaction holds the tool's lock (try again in a moment); -2: the tool's concurrency is
-- full; a positive number: seconds until the rate window or the shared back-off has room.
DECLARE
    until timestamptz;
    moment timestamptz;
    n integer;
    oldest timestamptz;
    span interval;
BEGIN
    IF NOT pg_try_advisory_xact_lock(hashtext('orchestrator.tool_admit'), hashtext(t)) THEN
        RETURN -1;
    END IF;
    moment := clock_timestamp();
    SELECT l.backoff_until INTO until FROM orchestrator.tool_limits AS l WHERE l.name = t;
    IF until > moment THEN
        RETURN extract(epoch FROM until - moment);
    END IF;
    IF conc IS NOT NULL THEN
        -- In flight: sent and not settled, or unknown (its worker was lost, its call timed
        -- out) while the call may still be running at the provider, up to the tool's timeout.
        SELECT count(*) INTO n FROM orchestrator.operations AS o
        WHERE o.state IN ('submitted', 'unknown') AND o.tool_name = t
          AND (o.state = 'submitted'
               OR o.submitted_at > moment - make_interval(secs => timeout));
        IF n >= conc THEN
            RETURN -2;
        END IF;
    END IF;
    IF rate IS NOT NULL THEN
        -- The window is counted a little longer than it is (a tenth, at most a quarter of a
        -- second): a call reaches its provider a moment after its admission commits, and
        -- that moment varies, so without the margin a provider counting by its own clock
        -- could see a window with more than the rate.
        span := make_interval(secs => per + least(per * 0.1, 0.25));
        DELETE FROM orchestrator.tool_dispatches AS d WHERE d.tool = t AND d.at <= moment - span;
        SELECT count(*), min(d.at) INTO n, oldest FROM orchestrator.tool_dispatches AS d
        WHERE d.tool = t;
        IF n >= rate THEN
            RETURN greatest(0.001, extract(epoch FROM oldest + span - moment));
        END IF;
    END IF;
    RETURN NULL;
END
$$;
"""

RUNS_READY_SQL = """
CREATE OR REPLACE FUNCTION orchestrator.runs_ready(workflows text[], lim integer)
RETURNS SETOF uuid
LANGUAGE sql VOLATILE STRICT ROWS 1 SET enable_sort = off AS $$
    SELECT id FROM orchestrator.runs
    WHERE status IN ('queued', 'waiting') AND available_at IS NOT NULL AND queue IS NULL
      AND available_at <= now()
      AND workflow_name || '@' || workflow_version = ANY(workflows)
    ORDER BY available_at
    LIMIT lim
    FOR UPDATE SKIP LOCKED
$$;
"""

RUNS_READY_0007 = """
CREATE OR REPLACE FUNCTION orchestrator.runs_ready(workflows text[], lim integer)
RETURNS SETOF uuid
LANGUAGE sql VOLATILE STRICT ROWS 1 SET enable_sort = off AS $$
    SELECT id FROM orchestrator.runs
    WHERE status IN ('queued', 'waiting') AND available_at IS NOT NULL
      AND available_at <= now()
      AND workflow_name || '@' || workflow_version = ANY(workflows)
    ORDER BY available_at
    LIMIT lim
    FOR UPDATE SKIP LOCKED
$$;
"""


def _ts(name: str, *, nullable: bool = True, now: bool = False) -> sa.Column:
    return sa.Column(name, sa.DateTime(timezone=True), nullable=nullable,
                     server_default=sa.text("now()") if now else None)


def upgrade() -> None:
    op.create_table(
        "queues",
        sa.Column("name", sa.Text(), nullable=False),
        sa.Column("concurrency", sa.Integer(), nullable=True),
        sa.Column("worker_concurrency", sa.Integer(), nullable=True),
        sa.Column("key_concurrency", sa.Integer(), nullable=True),
        sa.Column("rate_limit", sa.Integer(), nullable=True),
        sa.Column("rate_seconds", sa.Float(), nullable=True),
        sa.Column("priority", sa.Boolean(), nullable=False, server_default=sa.text("false")),
        sa.Column("priority_aging_seconds", sa.Float(), nullable=False,
                  server_default=sa.text("60")),
        sa.Column("count_parked", sa.Boolean(), nullable=False, server_default=sa.text("true")),
        sa.Column("paused", sa.Boolean(), nullable=False, server_default=sa.text("false")),
        _ts("paused_at"),
        sa.Column("declared", JSONB(), nullable=False, server_default=sa.text("'{}'::jsonb")),
        sa.Column("overridden", ARRAY(sa.Text()), nullable=False,
                  server_default=sa.text("'{}'::text[]")),
        _ts("created_at", nullable=False, now=True),
        _ts("updated_at", nullable=False, now=True),
        sa.CheckConstraint(
            "(concurrency IS NULL OR concurrency > 0) AND (worker_concurrency IS NULL OR "
            "worker_concurrency > 0) AND (key_concurrency IS NULL OR key_concurrency > 0) AND "
            "priority_aging_seconds > 0", name=op.f("ck_queues_limits")),
        sa.CheckConstraint(
            "(rate_limit IS NULL) = (rate_seconds IS NULL) AND (rate_limit IS NULL OR "
            "(rate_limit > 0 AND rate_seconds > 0))", name=op.f("ck_queues_rate")),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_queues")),
        schema=S,
    )
    op.add_column("runs", sa.Column("queue", sa.Text(), nullable=True), schema=S)
    op.add_column("runs", sa.Column("priority", sa.Integer(), nullable=False,
                                    server_default=sa.text("0")), schema=S)
    op.add_column("runs", sa.Column("concurrency_key", sa.Text(), nullable=True), schema=S)
    op.add_column("runs", _ts("started_at"), schema=S)
    op.drop_index("ix_runs_claimable", table_name="runs", schema=S)
    op.create_index("ix_runs_claimable", "runs", ["available_at"], schema=S,
                    postgresql_where=sa.text(f"{READY} AND queue IS NULL"))
    op.create_index("ix_runs_queue_priority", "runs", ["queue", "priority", "available_at"],
                    schema=S, postgresql_where=sa.text(f"{READY} AND queue IS NOT NULL"))
    op.create_index("ix_runs_queue_ready", "runs", ["queue", "available_at"], schema=S,
                    postgresql_where=sa.text(f"{READY} AND queue IS NOT NULL"))
    op.create_index("ix_runs_queue_held", "runs", ["queue", "concurrency_key"], schema=S,
                    postgresql_where=sa.text(
                        "queue IS NOT NULL AND started_at IS NOT NULL AND finished_at IS NULL"))
    op.create_index("ix_runs_queue_started", "runs", ["queue", "started_at"], schema=S,
                    postgresql_where=sa.text("queue IS NOT NULL AND started_at IS NOT NULL"))
    op.create_index("ix_runs_queue_key_unstarted", "runs",
                    ["queue", "concurrency_key", "created_at"], schema=S,
                    postgresql_where=sa.text(
                        "queue IS NOT NULL AND concurrency_key IS NOT NULL AND "
                        "started_at IS NULL AND status = 'queued'"))
    op.create_table(
        "tool_limits",
        sa.Column("name", sa.Text(), nullable=False),
        _ts("backoff_until"),
        _ts("updated_at", nullable=False, now=True),
        sa.PrimaryKeyConstraint("name", name=op.f("pk_tool_limits")),
        schema=S,
    )
    op.create_table(
        "tool_dispatches",
        sa.Column("tool", sa.Text(), nullable=False),
        sa.Column("operation_id", sa.BigInteger(), nullable=False),
        _ts("at", nullable=False),
        sa.PrimaryKeyConstraint("tool", "operation_id", name=op.f("pk_tool_dispatches")),
        schema=S,
    )
    op.create_index("ix_tool_dispatches_tool_at", "tool_dispatches", ["tool", "at"], schema=S)
    op.create_index("ix_operations_tool_inflight", "operations",
                    ["tool_name", "submitted_at"], schema=S,
                    postgresql_where=sa.text("state IN ('submitted', 'unknown')"))
    op.create_index("ix_runs_turn_waiters", "runs", ["available_at"], schema=S,
                    postgresql_where=sa.text(TURN_WAITERS))
    op.execute(RUNS_READY_SQL)
    op.execute(CLAIM_SQL)
    op.execute(ADMIT_SQL)


def downgrade() -> None:
    op.execute("DROP FUNCTION orchestrator.tool_admit(text, integer, integer, float8, float8)")
    op.execute("DROP FUNCTION orchestrator.queue_claim(text, text[], text, integer, float8)")
    op.drop_index("ix_runs_turn_waiters", table_name="runs", schema=S)
    op.drop_index("ix_operations_tool_inflight", table_name="operations", schema=S)
    op.drop_index("ix_tool_dispatches_tool_at", table_name="tool_dispatches", schema=S)
    op.drop_table("tool_dispatches", schema=S)
    op.drop_table("tool_limits", schema=S)
    op.execute(RUNS_READY_0007)
    for index in ("ix_runs_queue_key_unstarted", "ix_runs_queue_started", "ix_runs_queue_held",
                  "ix_runs_queue_ready", "ix_runs_queue_priority", "ix_runs_claimable"):
        op.drop_index(index, table_name="runs", schema=S)
    op.create_index("ix_runs_claimable", "runs", ["available_at"], schema=S,
                    postgresql_where=sa.text(READY))
    for column in ("started_at", "concurrency_key", "priority", "queue"):
        op.drop_column("runs", column, schema=S)
    op.drop_table("queues", schema=S)
