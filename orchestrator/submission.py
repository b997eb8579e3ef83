"""Submission: creating runs, delivering events to them, and reading their journals checked
against the schema this code understands.

:class:`Submission` is what :class:`~orchestrator.app.Orchestrator` delegates to for
``submit``, ``send_event`` and ``journal``. It is handed a frozen :class:`SubmissionConfig`, the
database (a function: resolved on first use), the registry (to find a workflow by name), the
metrics and the application's declared queues; it knows nothing of the application itself,
and answers with run ids, which the application wraps in handles. Every run it creates goes through
:func:`orchestrator.admission.new_run`, as a child's, a schedule's and a restart's do.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from opentelemetry.trace import SpanKind

from orchestrator.admission import DECLARE_HINT, check_priority, check_queue_name, new_run
from orchestrator.canonical import JsonLimits, request_digest
from orchestrator.db import journal as journal_db
from orchestrator.db import runs as runs_db
from orchestrator.db.database import Conn, Database
from orchestrator.db.events import event_announce, event_insert, event_pending_count, event_seen
from orchestrator.db.xact import answered_once
from orchestrator.errors import (
    AccessDenied,
    EventBacklogFull,
    IdempotencyConflict,
    InvalidRequest,
)
from orchestrator.flow import MAX_DEADLINE, Start, check_start
from orchestrator.handle import DENIED, TERMINAL
from orchestrator.journal import check_versions, shown
from orchestrator.metrics import Metrics
from orchestrator.models import JournalEntry, Owner, parse_run_id, validate_idempotency_key
from orchestrator.registry import Registry, Workflow, resolve_workflow
from orchestrator.text import check_identifier
from orchestrator.tracing import Tracing, current_traceparent, format_traceparent, record_error


@dataclass(frozen=True)
class SubmissionConfig:
    """The application's settings submission needs, taken when the service is built."""

    json_limits: JsonLimits
    max_pending_events: int
    tracing: Tracing
    default_owner: Owner | None = None


_OPTION_NAMES = {"deadline_seconds": "deadline", "delay_seconds": "delay"}
"""The ``submit`` parameter each key of a run's stored ``options`` comes from, where the two
names differ (``start_at``, ``queue``, ``priority`` and ``concurrency_key`` are the same)."""


def resolve_owner(owner: Owner | None, default: Owner | None) -> Owner:
    """The owner a call acts for: the one given, else the application's default;
    ``INVALID_REQUEST`` when there is neither (or the one given is not an :class:`Owner`)."""
    if owner is not None:
        if not isinstance(owner, Owner):
            raise InvalidRequest("owner must be an orchestrator.Owner", path="owner")
        return owner
    if default is None:
        raise InvalidRequest("owner is required: pass owner=Owner(tenant=..., principal=...), "
                             "or configure Orchestrator(default_owner=Owner(...)) for a "
                             "single-tenant app", path="owner")
    return default


def as_run_id(value: uuid.UUID | str) -> uuid.UUID:
    """A run id given as a UUID or its text. Text that is not one is bad input,
    ``INVALID_REQUEST`` with ``path`` ``run_id``, in the words the CLI and the HTTP API use
    (:func:`~orchestrator.models.parse_run_id`): not ``ACCESS_DENIED``, which says that a
    well-formed id names no run this owner may see (C9)."""
    return parse_run_id(value)


def check_journal(events: Sequence[dict[str, Any]]) -> list[JournalEntry]:
    """A run's journal rows as entries, oldest first; ``SCHEMA_UNSUPPORTED`` for an entry
    written by newer code than this (its schema version is above :data:`SCHEMA_VERSION`)."""
    check_versions(events)
    return [JournalEntry.from_row(shown(e)) for e in events]


class Submission:
    """Creates runs and delivers events, for one application (see the module's docstring)."""

    def __init__(self, config: SubmissionConfig, database: Callable[[], Database],
                 registry: Registry, metrics: Metrics, queues: Collection[str]) -> None:
        self.config = config
        # The application's database, resolved on first use: a request refused by the checks
        # never resolves (or starts) one.
        self.database = database
        self.registry = registry
        self.metrics = metrics
        self.queues = queues  # the application's declared queues: a run may wait in these

    def owner(self, owner: Owner | None) -> Owner:
        return resolve_owner(owner, self.config.default_owner)

    def resolve_workflow(self, workflow: Workflow | str, version: str | None = None
                         ) -> Workflow:
        return resolve_workflow(self.registry, workflow, version)

    def new_run_row(
        self,
        workflow: Workflow,
        input: Any,
        *,
        owner: Owner,
        idempotency_key: str | None,
        deadline: float | None,
        run_id: uuid.UUID | None = None,
        parent: tuple[uuid.UUID, int] | None = None,
        start: Start | None = None,
        queue: str | None = None,
        priority: int = 0,
        concurrency_key: str | None = None,
    ) -> dict[str, Any]:
        """Validate a submission and build its row (:func:`~orchestrator.admission.new_run`,
        the queue one the application declares). Raises before anything is written."""
        chosen = check_queue_name(queue) if queue is not None else workflow.queue
        if chosen is None:  # the default queue takes no limits: these would never be used
            if check_priority(priority) != 0:
                raise InvalidRequest(
                    "priority orders the runs of a queue; the default queue has none: "
                    "declare a queue with priority=True (app.queue) and submit to it",
                    path="priority")
            if concurrency_key is not None:
                raise InvalidRequest(
                    "concurrency_key bounds the runs of a queue with key_concurrency; the "
                    "default queue takes no limits: declare a queue (app.queue) and submit "
                    "to it", path="concurrency_key")
        return new_run(workflow.name, workflow.version, input, limits=self.config.json_limits,
                       owner=owner, queues=self.queues, hint=DECLARE_HINT,
                       idempotency_key=idempotency_key, deadline=deadline, run_id=run_id,
                       parent=parent, start=start, queue=chosen, priority=priority,
                       concurrency_key=concurrency_key)

    async def submit(
        self,
        workflow: Workflow[Any, Any] | str,
        input: Any = None,
        *,
        owner: Owner,
        version: str | None = None,
        idempotency_key: str | None = None,
        deadline: timedelta | None = None,
        start_at: datetime | None = None,
        delay: timedelta | None = None,
        queue: str | None = None,
        priority: int = 0,
        concurrency_key: str | None = None,
        connection: Conn | None = None,
    ) -> tuple[uuid.UUID, bool]:
        """Submit a run for ``owner`` (see ``Orchestrator.submit_async``): its id, and whether
        this call created it (False: the owner's key named an existing run of the same
        request)."""
        if idempotency_key is not None:
            validate_idempotency_key(idempotency_key)
        if version is not None:
            check_identifier("version", version)
        wf = self.resolve_workflow(workflow, version)
        seconds = None
        if deadline is not None:
            if not isinstance(deadline, timedelta) or not timedelta(0) < deadline <= MAX_DEADLINE:
                raise InvalidRequest(f"deadline must be a positive timedelta of at most "
                                     f"{MAX_DEADLINE.days} days", path="deadline")
            seconds = deadline.total_seconds()
        start = check_start(start_at, delay, datetime.now(UTC))
        row = self.new_run_row(wf, input, owner=owner, idempotency_key=idempotency_key,
                               deadline=seconds, start=start, queue=queue, priority=priority,
                               concurrency_key=concurrency_key)
        tracer = self.config.tracing.tracer
        if tracer is None:  # not tracing here: the caller's own span, if any, is the parent
            row["traceparent"] = current_traceparent()
            return await self._insert_run(row, connection)
        with tracer.start_as_current_span(
                f"submit {wf.name}", kind=SpanKind.PRODUCER, record_exception=False,
                set_status_on_exception=False, attributes={
                    "orchestrator.workflow": wf.name,
                    "orchestrator.workflow_version": wf.version,
                    "orchestrator.run_id": str(row["id"]),
                    "orchestrator.keyed": idempotency_key is not None}) as span:
            row["traceparent"] = format_traceparent(span.get_span_context())
            try:
                run_id, created = await self._insert_run(row, connection)
            except Exception as exc:
                record_error(span, getattr(exc, "code", None) or type(exc).__name__)
                raise
            span.set_attribute("orchestrator.created", created)
            if not created:  # an earlier submission's run: that one carries its trace
                span.set_attribute("orchestrator.run_id", str(run_id))
            return run_id, created

    async def _insert_run(self, row: dict[str, Any], connection: Conn | None
                          ) -> tuple[uuid.UUID, bool]:
        if connection is not None:
            run_id, created, digest = await runs_db.run_insert(connection, row)
        else:
            run_id, created, digest = await self.database().run_autocommit(
                lambda conn: runs_db.run_insert(conn, row))
        if not created and digest != row["request_digest"]:
            raise IdempotencyConflict(
                "this idempotency key was already used by this owner for a different request"
                + await self._what_differs(run_id, row, connection, digest))
        if created:
            self.metrics.incr("runs_submitted")
        return run_id, created

    async def _what_differs(self, run_id: uuid.UUID, row: dict[str, Any],
                             connection: Conn | None, stored_digest: str | None) -> str:
        """What a conflict's message adds: when the key's run is another version of the same
        workflow, both versions (the version is part of the request, CONTRACT C1, and a retry
        that names no version after a deploy changed the default meets exactly that); else
        whether the input or the options differ, the options by name (never a value: the
        input and the options are the owner's), as a retry that left out the ``deadline=``
        of the first submission meets."""
        async def read(conn: Conn) -> dict[str, Any] | None:
            return await runs_db.run_get(conn, run_id, result=False)

        stored = (await read(connection) if connection is not None
                  else await self.database().run_autocommit(read))
        if stored is None or stored["workflow_name"] != row["workflow_name"]:
            return ""
        name, then = row["workflow_name"], stored["workflow_version"]
        if then != row["workflow_version"]:
            return (f": it started {name}@{then}, and this request is "
                    f"{name}@{row['workflow_version']} (a version is part of the request: to "
                    f"ask for that run again, name its version, {then!r}; for a run of the new "
                    f"version, use a new key)")
        ours, theirs = json.loads(row["options"]), stored["options"] or {}
        other = sorted(_OPTION_NAMES.get(k, k) for k in ours.keys() | theirs.keys()
                       if ours.get(k) != theirs.get(k))
        same_input = request_digest(name, then, json.loads(row["input"]),
                                    theirs) == stored_digest
        if same_input and not other:  # not told apart from what the run keeps
            return ""
        said = ("the same input with other options" if same_input else
                "another input, and other options" if other else
                "another input with the same options")
        return (f": {said}{' (' + ', '.join(other) + ')' if other else ''} (a request is its "
                "workflow, version, input and options: to get that run again, submit it as it "
                "was; for a new run, use a new key)")

    async def send_event(self, run_id: uuid.UUID | str, name: str, payload: Any = None, *,
                         owner: Owner | None = None, event_key: str | None = None) -> bool:
        """See ``Orchestrator.send_event_async``."""
        check_identifier("name", name)
        if event_key is not None:
            validate_idempotency_key(event_key, "event_key")
        text = self.config.json_limits.text(payload, "$.payload")
        who = self.owner(owner)
        rid = as_run_id(run_id)
        cap = self.config.max_pending_events

        async def deliver(conn: Conn) -> bool:
            row = await runs_db.run_lock_last(conn, rid, owner=(who.tenant, who.principal))
            if row is None:
                raise AccessDenied(DENIED)
            target = row["id"]  # the last run of a chain of continuations
            seen = (await event_seen(conn, run_id=target, event_key=event_key, name=name,
                                     payload=text)
                    if event_key is not None else None)
            if seen == "different":
                raise IdempotencyConflict(
                    "this event_key was already used for an event to this run with another "
                    "name or payload; nothing was stored: send the same name and payload to "
                    "retry that event, or use a new event_key for a new event")
            if seen == "same":
                # A retry of an event the run received: delivered once, even when the run
                # has finished or the backlog is full now.
                return False
            if row["status"] in TERMINAL:
                raise InvalidRequest(f"the run is {row['status']}; it takes no more events")
            # The run's row is locked: no other sender counts at the same time (C15).
            if await event_pending_count(conn, run_id=target, cap=cap) >= cap:
                raise EventBacklogFull(
                    f"the run has {cap} events waiting to be consumed, its cap "
                    "(max_pending_events); nothing was stored")
            created = await event_insert(conn, run_id=target, name=name, event_key=event_key,
                                         payload=text)
            if created:
                await runs_db.run_wake(conn, target)
                await event_announce(conn, run_id=target, name=name)
            return created

        # Run again after a lost COMMIT that applied, it answers as then: delivered, once.
        return await self.database().run_in_transaction(answered_once(deliver))

    async def journal(self, run_id: uuid.UUID) -> list[JournalEntry]:
        """The run's journal, oldest first, checked by :func:`check_journal`. Reading it never
        dispatches anything (C3)."""
        events = await self.database().read(lambda conn: journal_db.journal_read(conn, run_id))
        return check_journal(events)
