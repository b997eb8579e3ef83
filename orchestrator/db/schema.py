"""The schema, as SQLAlchemy Core tables. Migrations are checked against these definitions.

Everything lives in the PostgreSQL schema ``orchestrator`` so that a host application can share
a database without name collisions; Alembic's version table is ``orchestrator.alembic_version``.

States are named CHECK constraints rather than PostgreSQL enums so that a later state is an
ordinary migration. Operation state transitions are additionally enforced by a trigger (see the
initial migration): an UPDATE that moves an operation along an arrow not in CONTRACT C5 fails
inside the database, whatever the Python code does.
"""

from __future__ import annotations

from datetime import datetime

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    Column,
    DateTime,
    Float,
    ForeignKey,
    Identity,
    Index,
    Integer,
    MetaData,
    SmallInteger,
    Table,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID

SCHEMA = "orchestrator"

NAMING_CONVENTION = {
    "ix": "ix_%(table_name)s_%(column_0_N_name)s",
    "uq": "uq_%(table_name)s_%(column_0_N_name)s",
    "ck": "ck_%(table_name)s_%(constraint_name)s",
    "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
    "pk": "pk_%(table_name)s",
}

metadata = MetaData(schema=SCHEMA, naming_convention=NAMING_CONVENTION)

VIEWS = ("journal",)
"""The schema's views, made by the migrations and not declared here: ``journal``, a run's
entries in one sequence, stored and on its operations (migration 0019)."""

RUN_STATUSES = (
    "queued",  # ready to be claimed at available_at
    "running",  # claimed: a worker holds the lease
    "waiting",  # timer, event, child or retry; claimable again at available_at (NULL: not yet)
    "needs_reconciliation",  # blocked on an operation whose outcome is unknown
    "succeeded",
    "failed",
    "cancelled",
)
TERMINAL_STATUSES = ("succeeded", "failed", "cancelled")

OPERATION_STATES = (
    "pending",
    "submitted",
    "committed",
    "failed",
    "unknown",
    "not_applied",
    "abandoned",
    "cancelled",
)
EFFECT_CLASSES = ("consequential", "idempotent", "read")
RECONCILIATION_STATES = ("open", "operator", "resolved")


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


def _ts(name: str, *, nullable: bool = True, default_now: bool = False) -> Column[datetime]:
    return Column(
        name,
        DateTime(timezone=True),
        nullable=nullable,
        server_default=text("now()") if default_now else None,
    )


# Tables whose rows are rewritten while a run goes on keep room on each page for the next
# versions (migration 0006): a new version then stays on its row's page instead of dirtying
# whatever old page the free-space map offers. SQLAlchemy cannot state storage parameters on a
# table; the migrations test compares this with the database.
FILLFACTOR = {"runs": 70, "operations": 50}
# Indexes of runs whose leaf pages are split half full (migration 0037): the claim's and the
# end's non-HOT updates add a run's next entries beside its first.
INDEX_FILLFACTOR = {"pk_runs": 50, "ix_runs_created": 50, "ix_runs_owner_created": 50}

_READY = "status IN ('queued', 'waiting') AND available_at IS NOT NULL"

runs = Table(
    "runs",
    metadata,
    Column("id", UUID(as_uuid=True), primary_key=True),
    Column("tenant", Text, nullable=False),
    Column("principal", Text, nullable=False),
    Column("workflow_name", Text, nullable=False),
    Column("workflow_version", Text, nullable=False),
    Column("input", JSONB, nullable=False),
    Column("options", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("request_digest", Text, nullable=False),
    Column("idempotency_key", Text),
    Column("parent_run_id", UUID(as_uuid=True), ForeignKey("runs.id", ondelete="CASCADE")),
    Column("parent_position", Integer),
    Column("status", Text, nullable=False, server_default=text("'queued'")),
    Column("outcome_code", Text),
    Column("result", JSONB),
    Column("error", JSONB),
    Column("waiting_for", Text),
    _ts("deadline_at"),
    _ts("available_at"),
    Column("lease_owner", Text),
    Column("lease_token", BigInteger, nullable=False, server_default=text("0")),
    _ts("lease_expires_at"),
    Column("revision", BigInteger, nullable=False, server_default=text("0")),
    _ts("cancel_requested_at"),
    _ts("created_at", nullable=False, default_now=True),
    _ts("updated_at", nullable=False, default_now=True),
    _ts("finished_at"),
    # The W3C traceparent of the span that submitted the run (migration 0010), or NULL.
    Column("traceparent", Text),
    # Flow control (migration 0012, docs/flow.md): the run's queue (NULL: the default queue),
    # its priority and concurrency key there, and when a queue's claim first started it.
    Column("queue", Text),
    Column("priority", Integer, nullable=False, server_default=text("0")),
    Column("concurrency_key", Text),
    _ts("started_at"),
    # Retention (migration 0013, docs/retention.md): when the run was pruned (its journal,
    # events, input and result deleted; the row kept as a tombstone for its submission key).
    _ts("pruned_at"),
    # Restarts (migration 0014): the run this one restarts, and the run that restarted this
    # one (the authoritative one).
    Column("restarted_from", UUID(as_uuid=True)),
    Column("superseded_by", UUID(as_uuid=True)),
    # Continuations (migration 0015): the run this one continues (ctx.continue_as_new).
    Column("continued_from", UUID(as_uuid=True)),
    # The tool whose turn the run is parked for (migration 0018, docs/flow.md), by its exact
    # name: what a call of the tool ending wakes. NULL unless the run waits for a turn;
    # ``waiting_for`` says the same in words.
    Column("waiting_tool", Text),
    # When the run became due (migration 0032): the start its submission held it back to,
    # else its creation; written once by the insert, read by the claims (what a worker counts
    # the queue wait and the duration from, docs/metrics.md). NULL for a run that had finished
    # before the migration (no claim reads it again).
    _ts("due_at", default_now=True),
    CheckConstraint(_in("status", RUN_STATUSES), name="status"),
    CheckConstraint("revision >= 0 AND lease_token >= 0", name="counters"),
    CheckConstraint(
        "status <> 'running' OR (lease_owner IS NOT NULL AND lease_expires_at IS NOT NULL)",
        name="running_has_lease",
    ),
    CheckConstraint(
        "(status IN ('succeeded', 'failed', 'cancelled')) = (finished_at IS NOT NULL)",
        name="finished_iff_terminal",
    ),
    # A submission key is unique per owner; keyless runs are not in the index (migration 0036:
    # every update of a run that cannot be HOT wrote an entry for them too).
    Index(
        "uq_runs_tenant_principal_idempotency_key",
        "tenant", "principal", "idempotency_key",
        unique=True,
        postgresql_where=text("idempotency_key IS NOT NULL"),
    ),
    # Claiming: only unfinished, claimable runs are in this index, so it stays small however
    # many finished runs pile up.
    # Only the default queue's runs: a queue's backlog costs the default claim nothing.
    Index(
        "ix_runs_claimable",
        "available_at",
        postgresql_where=text(f"{_READY} AND queue IS NULL"),
    ),
    # A queue's claim (orchestrator.queue_claim): its ready runs by priority and by age, the
    # slots held, the starts in its rate window, each key's runs not started yet.
    Index("ix_runs_queue_priority", "queue", "priority", "available_at",
          postgresql_where=text(f"{_READY} AND queue IS NOT NULL")),
    Index("ix_runs_queue_ready", "queue", "available_at",
          postgresql_where=text(f"{_READY} AND queue IS NOT NULL")),
    # A key's counts are its tenant's (migration 0028): the tenant leads the key.
    Index("ix_runs_queue_held", "queue", "tenant", "concurrency_key",
          postgresql_where=text(
              "queue IS NOT NULL AND started_at IS NOT NULL AND finished_at IS NULL")),
    Index("ix_runs_queue_started", "queue", "started_at",
          postgresql_where=text("queue IS NOT NULL AND started_at IS NOT NULL")),
    # Runs parked for the turn of a tool, longest waiting first: a call of the tool ending
    # wakes them (migration 0018).
    Index("ix_runs_turn_waiters", "waiting_tool", "available_at",
          postgresql_where=text("status = 'waiting' AND waiting_tool IS NOT NULL")),
    Index("ix_runs_queue_key_unstarted", "queue", "tenant", "concurrency_key", "created_at",
          postgresql_where=text("queue IS NOT NULL AND concurrency_key IS NOT NULL AND "
                                "started_at IS NULL AND status = 'queued'")),
    Index("ix_runs_lease_expiry", "lease_expires_at", postgresql_where=text("status = 'running'")),
    # Runs that never started and carry a deadline: the sweep ends those whose deadline
    # passed while their queue held them back (migration 0033).
    Index("ix_runs_unstarted_deadline", "deadline_at",
          postgresql_where=text("status = 'queued' AND deadline_at IS NOT NULL")),
    Index("ix_runs_owner_created", "tenant", "principal", "created_at"),
    # The console's pages of runs, newest first across owners (migration 0009).
    Index("ix_runs_created", "created_at", "id"),
    Index("ix_runs_parent", "parent_run_id", postgresql_where=text("parent_run_id IS NOT NULL")),
    # What prune_runs and expire_evidence walk, oldest first (migration 0013).
    Index("ix_runs_prunable", "finished_at",
          postgresql_where=text("finished_at IS NOT NULL AND pruned_at IS NULL")),
    Index("ix_runs_pruned", "finished_at", postgresql_where=text("pruned_at IS NOT NULL")),
)

# The journal's stored entries: every kind but a call's ``call.submitted`` and
# ``call.completed`` entries written by the engine's step statements, which are the operation
# row itself (``operations.seq``, ``completed_seq``; migration 0019). The view
# ``orchestrator.journal`` (the migration's, not declared here) reads both as one sequence.
journal_entries = Table(
    "journal_entries",
    metadata,
    # No foreign key (migration 0036): every insert reads the run's row in its own statement,
    # and the trigger ``runs_delete_ledger`` deletes a deleted run's entries.
    Column("run_id", UUID(as_uuid=True), primary_key=True),
    Column("seq", BigInteger, primary_key=True),
    Column("kind", Text, nullable=False),
    Column("position", Integer),
    Column("name", Text),
    Column("schema_version", SmallInteger, nullable=False),
    Column("payload", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    # The lease token the writer held: along seq it never decreases (one history per lease).
    Column("lease_token", BigInteger, nullable=False),
    _ts("created_at", nullable=False, default_now=True),
    CheckConstraint("seq >= 1", name="seq_positive"),
)

operations = Table(
    "operations",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    # No foreign key (migration 0036), as for ``journal_entries.run_id``.
    Column("run_id", UUID(as_uuid=True), nullable=False),
    Column("position", Integer, nullable=False),
    Column("attempt", Integer, nullable=False),
    Column("tool_name", Text, nullable=False),
    Column("tool_version", Text, nullable=False),
    Column("effect_class", Text, nullable=False),
    Column("tenant", Text, nullable=False),
    Column("principal", Text, nullable=False),
    Column("intent_digest", Text, nullable=False),
    Column("arguments", JSONB, nullable=False),
    Column("idempotency_key", Text, nullable=False),
    Column("state", Text, nullable=False),
    Column("receipt", JSONB),
    Column("receipt_digest", Text),
    Column("error", JSONB),
    Column("worker_id", Text),
    Column("lease_token", BigInteger),
    _ts("created_at", nullable=False, default_now=True),
    _ts("submitted_at"),
    _ts("finished_at"),
    _ts("updated_at", nullable=False, default_now=True),
    # The call's journal entries on this row (migration 0019): its ``call.submitted`` entry at
    # ``seq``, its ``call.completed`` entry at ``completed_seq``, both of schema version
    # ``entry_version``; NULL where the entry is a stored row of ``journal_entries`` instead.
    Column("seq", BigInteger),
    Column("completed_seq", BigInteger),
    Column("entry_version", SmallInteger),
    # What the indexes of unknown calls and of a limited tool's calls in flight read (migration
    # 0039), kept by the guard trigger: the tool's name while the call is unknown; the tool's
    # name, written by the admission of a call under the tool's concurrency limit, while the
    # call is submitted or unknown. No index of operations reads ``state``, so a settle that
    # changes neither (every settle of a call of a tool without a concurrency limit, unless
    # the call was unknown) is a HOT update.
    Column("in_flight_tool", Text),
    Column("unknown_tool", Text),
    # Its rules (states and their arrows, C5; a committed receipt; a call's entries) are the
    # trigger operations_guard and its CHECK-like rules ck_operations_state, _entry,
    # _effect_class, _identity, _committed_receipt (migration 0035: compiled once per
    # connection, not once per statement), and operations_entry_append_only (migration 0022).
    UniqueConstraint("run_id", "position", "attempt"),
    # A tool's calls in flight: what its concurrency limit counts (migration 0039).
    Index("ix_operations_in_flight", "in_flight_tool", "submitted_at",
          postgresql_where=text("in_flight_tool IS NOT NULL")),
    # The calls whose outcome is unknown, across runs (the gauges, the console's overview).
    Index("ix_operations_unknown_tool", "unknown_tool",
          postgresql_where=text("unknown_tool IS NOT NULL")),
)

reconciliation_items = Table(
    "reconciliation_items",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    Column("operation_id", BigInteger, ForeignKey("operations.id", ondelete="CASCADE"),
           nullable=False, unique=True),
    Column("run_id", UUID(as_uuid=True), ForeignKey("runs.id", ondelete="CASCADE"),
           nullable=False),
    Column("reason", Text, nullable=False),
    Column("state", Text, nullable=False, server_default=text("'open'")),
    Column("lookup_attempts", Integer, nullable=False, server_default=text("0")),
    _ts("next_attempt_at", nullable=False, default_now=True),
    Column("claimed_by", Text),
    _ts("claimed_until"),
    Column("resolution", Text),
    Column("evidence", JSONB, nullable=False, server_default=text("'[]'::jsonb")),
    _ts("created_at", nullable=False, default_now=True),
    _ts("resolved_at"),
    CheckConstraint(_in("state", RECONCILIATION_STATES), name="state"),
    Index(
        "ix_reconciliation_items_due", "next_attempt_at", postgresql_where=text("state = 'open'")
    ),
    # A run's unresolved items: what keeps it from being pruned (migration 0013).
    Index("ix_reconciliation_items_run_unresolved", "run_id",
          postgresql_where=text("state <> 'resolved'")),
)

reconciliation_lookups = Table(
    "reconciliation_lookups",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    Column("item_id", BigInteger, ForeignKey("reconciliation_items.id", ondelete="CASCADE"),
           nullable=False, index=True),
    Column("attempt", Integer, nullable=False),
    Column("answer", Text, nullable=False),
    Column("detail", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    _ts("created_at", nullable=False, default_now=True),
)

external_events = Table(
    "external_events",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    Column("run_id", UUID(as_uuid=True), ForeignKey("runs.id", ondelete="CASCADE"),
           nullable=False),
    Column("name", Text, nullable=False),
    Column("event_key", Text),
    Column("payload", JSONB, nullable=False),
    Column("consumed_position", Integer),
    _ts("created_at", nullable=False, default_now=True),
    UniqueConstraint("run_id", "event_key"),
    Index("ix_external_events_run_name", "run_id", "name", "id"),
)

operator_audit = Table(
    "operator_audit",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    _ts("created_at", nullable=False, default_now=True),
    Column("operator", Text, nullable=False),
    Column("action", Text, nullable=False),
    Column("target_kind", Text, nullable=False),
    Column("target_id", Text, nullable=False),
    # The tenant of the target (an operation's owner), kept in the row so that the audit
    # stays scoped after the operation it names is pruned (migration 0008). NULL: no tenant
    # (rows written before 0008 whose operation was gone), seen only without operator scopes.
    Column("tenant", Text),
    Column("evidence", Text, nullable=False),
    Column("before", JSONB),
    Column("after", JSONB),
    Index("ix_operator_audit_target", "target_kind", "target_id"),
    Index("ix_operator_audit_tenant", "tenant", "id"),
)

incidents = Table(
    "incidents",
    metadata,
    Column("ref", Text, primary_key=True),
    _ts("created_at", nullable=False, default_now=True),
    Column("code", Text, nullable=False),
    Column("run_id", UUID(as_uuid=True)),
    Column("operation_id", BigInteger),
    Column("phase", Text),
    Column("cause", Text),
    Column("upstream_status", Integer),
    Column("detail", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Index("ix_incidents_run", "run_id"),
)

workers = Table(
    "workers",
    metadata,
    Column("id", Text, primary_key=True),
    Column("hostname", Text, nullable=False),
    Column("pid", Integer, nullable=False),
    Column("workflows", ARRAY(Text), nullable=False),
    Column("concurrency", Integer, nullable=False),
    # A session-level advisory lock the worker holds while it lives: when its connection
    # drops (the process died), other workers re-queue its runs without waiting for leases.
    Column("lock_key", BigInteger),
    # Whether it takes that lock (migration 0034): false behind a transaction pooler without a
    # listen_url. One that does, heartbeating without lock_key, claims nothing: ``waiting``.
    Column("lock_wanted", Boolean, nullable=False, server_default=text("false")),
    _ts("started_at", nullable=False, default_now=True),
    _ts("heartbeat_at", nullable=False, default_now=True),
    # When it was told to stop and began to drain (it claims nothing more); null before.
    _ts("draining_since"),
    Index("ix_workers_heartbeat", "heartbeat_at"),
)


OVERLAP_POLICIES = ("skip", "buffer_one", "buffer_all", "cancel_other", "allow_all")

# Schedules (migration 0011, docs/schedules.md): each schedule's definition and its place; what
# became of each slot handled one by one; ranges of slots recorded at once.
schedules = Table(
    "schedules",
    metadata,
    Column("id", Text, primary_key=True),
    Column("workflow_name", Text, nullable=False),
    Column("workflow_version", Text, nullable=False),
    Column("cron", Text, nullable=False),
    Column("timezone", Text, nullable=False),
    Column("overlap", Text, nullable=False),
    Column("catchup_seconds", Float, nullable=False),
    Column("input", JSONB, nullable=False),
    Column("tenant", Text, nullable=False),
    Column("principal", Text, nullable=False),
    Column("declared", Boolean, nullable=False, server_default=text("false")),
    Column("paused", Boolean, nullable=False, server_default=text("false")),
    _ts("paused_at"),
    _ts("next_slot"),
    _ts("last_slot"),
    Column("last_run_id", UUID(as_uuid=True)),
    Column("buffered", Integer, nullable=False, server_default=text("0")),
    _ts("created_at", nullable=False, default_now=True),
    _ts("updated_at", nullable=False, default_now=True),
    # The queue its runs wait in, NULL: the default queue (migration 0027).
    Column("queue", Text),
    CheckConstraint(_in("overlap", OVERLAP_POLICIES), name="overlap"),
    CheckConstraint("buffered >= 0 AND catchup_seconds > 0", name="counters"),
    Index("ix_schedules_next_slot", "next_slot", postgresql_where=text("NOT paused")),
)

schedule_slots = Table(
    "schedule_slots",
    metadata,
    Column("schedule_id", Text, ForeignKey("schedules.id", ondelete="CASCADE"),
           primary_key=True),
    Column("slot", DateTime(timezone=True), primary_key=True),
    Column("kind", Text, primary_key=True),
    Column("state", Text, nullable=False),
    Column("reason", Text),
    Column("overlap", Text, nullable=False),
    Column("run_id", UUID(as_uuid=True)),
    _ts("recorded_at", nullable=False, default_now=True),
    # The idempotency key a trigger was sent with (migration 0027).
    Column("trigger_key", Text),
    CheckConstraint("kind IN ('cron', 'backfill', 'trigger')", name="kind"),
    CheckConstraint("state IN ('fired', 'skipped', 'buffered')", name="state"),
    CheckConstraint("(state = 'fired') = (run_id IS NOT NULL)", name="fired_has_run"),
    CheckConstraint("trigger_key IS NULL OR kind = 'trigger'", name="trigger_key"),
    Index("ix_schedule_slots_buffered", "schedule_id", "slot",
          postgresql_where=text("state = 'buffered'")),
    # What prune_schedule_slots walks, oldest first (migration 0016).
    Index("ix_schedule_slots_recorded", "recorded_at",
          postgresql_where=text("state <> 'buffered'")),
    Index("ux_schedule_slots_trigger_key", "schedule_id", "trigger_key", unique=True,
          postgresql_where=text("trigger_key IS NOT NULL")),
)

schedule_gaps = Table(
    "schedule_gaps",
    metadata,
    Column("id", BigInteger, Identity(), primary_key=True),
    Column("schedule_id", Text, ForeignKey("schedules.id", ondelete="CASCADE"), nullable=False),
    _ts("first_slot", nullable=False),
    _ts("last_slot", nullable=False),
    Column("reason", Text, nullable=False),
    _ts("recorded_at", nullable=False, default_now=True),
    CheckConstraint("reason IN ('missed', 'paused')", name="reason"),
    CheckConstraint("first_slot <= last_slot", name="range"),
    Index("ix_schedule_gaps_schedule_id", "schedule_id"),
)

# Queues (migration 0012, docs/flow.md): each queue's limits in force, what the code declared,
# which limits were set at run time, and its pause.
queues = Table(
    "queues",
    metadata,
    Column("name", Text, primary_key=True),
    Column("concurrency", Integer),
    Column("worker_concurrency", Integer),
    Column("key_concurrency", Integer),
    Column("rate_limit", Integer),
    Column("rate_seconds", Float),
    Column("priority", Boolean, nullable=False, server_default=text("false")),
    Column("priority_aging_seconds", Float, nullable=False, server_default=text("60")),
    Column("count_parked", Boolean, nullable=False, server_default=text("true")),
    Column("paused", Boolean, nullable=False, server_default=text("false")),
    _ts("paused_at"),
    Column("declared", JSONB, nullable=False, server_default=text("'{}'::jsonb")),
    Column("overridden", ARRAY(Text), nullable=False, server_default=text("'{}'::text[]")),
    _ts("created_at", nullable=False, default_now=True),
    _ts("updated_at", nullable=False, default_now=True),
    CheckConstraint(
        "(concurrency IS NULL OR concurrency > 0) AND (worker_concurrency IS NULL OR "
        "worker_concurrency > 0) AND (key_concurrency IS NULL OR key_concurrency > 0) AND "
        "priority_aging_seconds > 0", name="limits"),
    CheckConstraint(
        "(rate_limit IS NULL) = (rate_seconds IS NULL) AND (rate_limit IS NULL OR "
        "(rate_limit > 0 AND rate_seconds > 0))", name="rate"),
)

# Tool limits (migration 0012, docs/flow.md): a tool's shared back-off after a provider's 429 or
# 503 with a Retry-After, and each dispatch of a rate-limited tool inside its window.
tool_limits = Table(
    "tool_limits",
    metadata,
    Column("name", Text, primary_key=True),
    _ts("backoff_until"),
    _ts("updated_at", nullable=False, default_now=True),
)

tool_dispatches = Table(
    "tool_dispatches",
    metadata,
    Column("tool", Text, primary_key=True),
    Column("operation_id", BigInteger, primary_key=True),
    _ts("at", nullable=False),
    Index("ix_tool_dispatches_tool_at", "tool", "at"),
)
