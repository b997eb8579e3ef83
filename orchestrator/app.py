"""The public entry point: :class:`Orchestrator` (a run's handle is in :mod:`orchestrator.handle`).

Sync callers (scripts, WSGI apps) use the plain methods; async callers use the ``*_async``
twins. The sync methods run their async twin on a private event loop thread, so both share one
implementation; called on an event loop where a worker or a reconciler of this process runs
(tool code, a program running its worker in its own loop), where waiting would stop them, they
are refused with ``INVALID_REQUEST`` naming the twin to await.

The application holds the settings and the registrations and builds the services it delegates
to, each handed only what it uses: :mod:`orchestrator.submission` (runs submitted, events
delivered, journals read), :class:`~orchestrator.queues.QueueAdmin`,
:class:`~orchestrator.scheduler.ScheduleAdmin`, :class:`~orchestrator.operators.Operators`, the
worker and the reconciler (a frozen :class:`~orchestrator.engine.config.EngineConfig`), and
:mod:`orchestrator.serving` (running one of those until a signal).
"""

from __future__ import annotations

import dataclasses
import logging
import uuid
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Mapping,
    Sequence,
)
from datetime import datetime, timedelta
from functools import partial
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, overload

from opentelemetry import context as otel_context
from typing_extensions import TypeVar

from orchestrator import admin, canonical
from orchestrator import handle as waiting
from orchestrator._portal import Portal
from orchestrator.admission import check_queue_name
from orchestrator.context import ToolContext, WorkflowContext
from orchestrator.db import runs as runs_db
from orchestrator.db.config import DatabaseTarget, check_pooler, resolve_database
from orchestrator.db.database import Conn, Database
from orchestrator.engine.config import EngineConfig
from orchestrator.errors import (
    AccessDenied,
    ConfigurationError,
    InvalidRequest,
)
from orchestrator.flow import RateLimit, Start
from orchestrator.handle import DENIED, H, RunHandle
from orchestrator.metrics import Metrics
from orchestrator.models import (
    JournalEntry,
    Owner,
    RunInfo,
    check_run_filters,
    parse_run_cursor,
)
from orchestrator.operators import Operators, check_readers, check_scopes
from orchestrator.queues import (
    DEFAULT_PRIORITY_AGING,
    Queue,
    QueueAdmin,
    Queues,
    check_limit,
    check_rate,
)
from orchestrator.queues import declare as declare_queue
from orchestrator.reconcile import PRUNE_INTERVAL, UNSERVED_GRACE, Reconciler
from orchestrator.recovery import DEFAULT_POLICIES, RetryPolicy
from orchestrator.registry import (
    EFFECT_CLASSES,
    EffectClass,
    Registry,
    Tool,
    Workflow,
    check_async,
    check_decorator_use,
    check_name,
    check_signature,
    check_timeout,
    registered_name,
    resolve_workflow,
)
from orchestrator.retention import DUTY, Pruner, PruneReport, Retention
from orchestrator.scheduler import (
    Declared,
    ScheduleAdmin,
    Scheduler,
    Schedules,
    definition,
)
from orchestrator.schedules import DEFAULT_CATCHUP
from orchestrator.serving import catch_early_sigterm as catch_early_sigterm
from orchestrator.serving import event_loop_choice, listen_at, run_until_stopped
from orchestrator.stream import RunStreams, check_kept
from orchestrator.submission import (
    Submission,
    SubmissionConfig,
    as_run_id,
    resolve_owner,
)
from orchestrator.text import check_operator, check_prose
from orchestrator.tracing import (
    PARENT_MODES,
    ParentMode,
    Tracing,
)
from orchestrator.waiting import RunWaits
from orchestrator.worker import Worker

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider
    from prometheus_client import CollectorRegistry

log = logging.getLogger("orchestrator.app")

# Always inferred from a function or a workflow, so without defaults (mypy does not match a
# decorator factory's ParamSpec that has one).
P = ParamSpec("P")
I = TypeVar("I")  # noqa: E741 - a workflow's input
R = TypeVar("R")
T = TypeVar("T")

class Orchestrator:
    """A durable workflow orchestrator bound to one database.

    ``database_url`` wins; else ``ORCHESTRATOR_DATABASE_URL``; else the embedded PostgreSQL.
    Behind a transaction pooler such as PgBouncer, pass ``pooler="transaction"`` and, for
    prompt wake-ups, ``listen_url`` (the database reached directly); else
    ``ORCHESTRATOR_POOLER`` and ``ORCHESTRATOR_LISTEN_URL`` (docs/operations.md); another
    ``pooler`` is a ``CONFIGURATION_ERROR`` here, as a bad value of the other options is.
    The database is resolved on first use, so defining workflows at import time costs nothing,
    and named then in one INFO line on the ``orchestrator`` logger. Create as many instances as
    you like; nothing is global.

    A database that cannot be reached fails a call within about the connect timeout with
    ``DATABASE_UNAVAILABLE`` and the reason (``retryable`` false for a missing database or
    role or a wrong password). A call whose connection is lost under it is run again where
    that is safe: every read; every submission (the run's id is chosen before the first
    attempt, so a repeated INSERT finds the run it made, keyed or not); an event with an
    ``event_key``. An unkeyed event whose COMMIT was lost raises ``DATABASE_UNAVAILABLE``
    (not retryable) saying it may or may not have been delivered.
    """

    def __init__(
        self,
        database_url: str | None = None,
        *,
        default_owner: Owner | None = None,
        max_record_bytes: int = canonical.DEFAULT_MAX_RECORD_BYTES,
        max_journal_events: int = 10_000,
        max_json_depth: int = canonical.DEFAULT_MAX_DEPTH,
        max_int_digits: int = canonical.DEFAULT_MAX_INT_DIGITS,
        max_pending_events: int = 1_000,
        lease_ttl: float = 30.0,
        pool_size: int = 10,
        operator_scopes: Mapping[str, Sequence[str]] | None = None,
        incident_readers: Sequence[str] | None = None,
        retry_policy: RetryPolicy | None = None,
        authorize: Callable[..., Awaitable[Any]] | None = None,
        approve: Callable[..., Awaitable[Any]] | None = None,
        stage_timeout: timedelta | float = timedelta(seconds=30),
        tool_timeout: timedelta | float = timedelta(minutes=5),
        receipts_ride: bool = True,
        trace_parent: ParentMode = "link",
        tracer_provider: TracerProvider | None = None,
        retention: Retention | None = None,
        pooler: str | None = None,
        listen_url: str | None = None,
    ) -> None:
        self._database_url = database_url
        # Behind a transaction pooler (docs/operations.md): no prepared statements, and the
        # sessions that must last (LISTEN, the liveness lock) on listen_url, direct to the
        # server, or none (polling; leases). Each else from its environment variable.
        # An argument is checked now, as the other options are; the variables on first use.
        self._pooler = None if pooler is None else check_pooler(pooler)
        self._listen_url = listen_url
        self.metrics = Metrics()
        self._database: Database | None = None
        # Checked now: every call that acts for it would otherwise fail on its first use.
        if default_owner is not None and not isinstance(default_owner, Owner):
            raise ConfigurationError(f"default_owner must be an orchestrator.Owner (or None), "
                                     f"got {type(default_owner).__name__}")
        self.default_owner = default_owner
        self.max_record_bytes = max_record_bytes
        # Every JSON value accepted (inputs, arguments, receipts, results, events) is held to
        # these caps before anything is written (C2).
        self.json_limits = canonical.JsonLimits(max_record_bytes, max_json_depth,
                                                max_int_digits)
        for name, cap in (("max_pending_events", max_pending_events),
                          ("max_journal_events", max_journal_events), ("pool_size", pool_size)):
            if type(cap) is not int or cap < 1:
                raise ConfigurationError(f"{name} must be a positive integer, got {cap!r}")
        self.max_pending_events = max_pending_events
        self.max_journal_events = max_journal_events
        self.lease_ttl = checked_lease_ttl(lease_ttl)
        self.pool_size = pool_size
        # Checked now, so that a name no operator could type (or a tenant given as a bare
        # string) is a CONFIGURATION_ERROR at start, not a scope that silently never matches.
        self.operator_scopes = check_scopes(operator_scopes)
        self.incident_readers = check_readers(incident_readers)
        if retention is not None and not isinstance(retention, Retention):
            raise ConfigurationError("retention must be an orchestrator.Retention")
        # How long finished runs and the evidence are kept (docs/retention.md); None: for
        # ever. The reconciler prunes by it in the background; so does `orchestrator prune`.
        self.retention = retention
        if retry_policy is not None and not isinstance(retry_policy, RetryPolicy):
            raise ConfigurationError(f"retry_policy must be an orchestrator.RetryPolicy (or "
                                     f"None), got {type(retry_policy).__name__}")
        self.retry_policy = retry_policy
        try:  # checked now: a worker would find out only with a call's `submitted` written
            for stage, hook in (("authorize", authorize), ("approve", approve)):
                if hook is not None:
                    check_async("policy stage", stage, hook)
                    check_signature("policy stage", stage, hook, takes=("ctx",))
            stage_budget = check_timeout("stage_timeout", stage_timeout)
            tool_budget = check_timeout("tool_timeout", tool_timeout)
        except InvalidRequest as exc:
            raise ConfigurationError(exc.message) from exc
        self.authorize = authorize  # app-wide policy stages, run before each tool's own
        self.approve = approve
        self.stage_timeout = stage_budget.total_seconds()
        self.tool_timeout = tool_budget  # for tools that set none: a hung call never holds
        # a run for ever; it ends as a timeout (outcome unknown)
        # A call's receipt is committed with the run's next write (the next call's write-ahead
        # `submitted`, the run's end) rather than in a transaction of its own before the
        # workflow goes on; False commits each receipt before the workflow sees it.
        if not isinstance(receipts_ride, bool):
            raise ConfigurationError(f"receipts_ride must be True or False, got "
                                     f"{receipts_ride!r}")
        self.receipts_ride = receipts_ride
        # Traces (docs/tracing.md): a run's span on a worker is linked to (or a child of) the
        # span that submitted it; spans go to ``tracer_provider``, else the global provider.
        if trace_parent not in PARENT_MODES:
            raise ConfigurationError(
                f"trace_parent must be one of {', '.join(PARENT_MODES)}, got {trace_parent!r}")
        self.tracing = Tracing(parent=trace_parent, provider=tracer_provider)
        self.registry = Registry()
        self._portal = Portal(finalizer=self._close_pools)
        self._run_streams: RunStreams | None = None
        self._run_waits: RunWaits | None = None
        # Schedules declared in code (@app.schedule): each worker writes them when it starts.
        self._declared_schedules: dict[str, Declared] = {}
        self._schedules: Schedules | None = None
        # Queues declared in code (app.queue): each worker writes them when it starts.
        self._declared_queues: dict[str, Queue] = {}
        self._queues: Queues | None = None

    # -- configuration -----------------------------------------------------------------------

    @property
    def database(self) -> Database:
        if self._database is None:
            self._database = Database(self.target, max_pool_size=self.pool_size)
            self._database.metrics = self.metrics
        return self._database

    @property
    def _streams(self) -> RunStreams:
        """The runs' streams (``RunHandle.events``), built on first use."""
        if self._run_streams is None:
            self._run_streams = RunStreams(self.database)
        return self._run_streams

    @property
    def _waits(self) -> RunWaits:
        """The result waits (``RunHandle.result``), built on first use."""
        if self._run_waits is None:
            self._run_waits = RunWaits(self.database)
        return self._run_waits

    @property
    def engine_config(self) -> EngineConfig:
        """The settings the engine (workers, reconcilers) runs with, taken now."""
        return EngineConfig(json_limits=self.json_limits,
                            max_journal_events=self.max_journal_events, lease_ttl=self.lease_ttl,
                            tool_timeout=self.tool_timeout, receipts_ride=self.receipts_ride,
                            authorize=self.authorize, approve=self.approve,
                            tracing=self.tracing, queues=frozenset(self._declared_queues))

    @property
    def target(self) -> DatabaseTarget:
        if self._database is not None:
            return self._database.target
        target = resolve_database(self._database_url, pooler=self._pooler,
                                  listen_url=self._listen_url)
        self._database = Database(target, max_pool_size=self.pool_size)
        self._database.metrics = self.metrics
        return target

    def workflow(
        self, decorated: None = None, /, *, version: str = "1", name: str | None = None,
        queue: str | None = None, default: bool = False,
    ) -> Callable[[Callable[[WorkflowContext, I], Awaitable[R]]], Workflow[I, R]]:
        """Register an async workflow ``fn(ctx, input)``; ``name`` defaults to the function's.
        ``queue``: the queue its runs (and its runs as children) wait in unless a submission
        names another; it must be declared with :meth:`queue` before a run is submitted.
        ``version``: several versions of one name may be registered side by side (a run keeps
        the version it started with); a submission by name alone starts the one marked
        ``default=True`` (at most one), else the highest (``"10"`` after ``"9"``); see
        docs/versioning.md.

        Returns a :class:`Workflow` typed by the function's input and result. Its options go
        by keyword: ``@app.workflow`` without ``()`` is ``INVALID_REQUEST`` saying so."""
        check_decorator_use("workflow", decorated)
        if queue is not None:
            check_queue_name(queue)
        if not isinstance(default, bool):  # "no" is true: never taken for its truth value
            raise InvalidRequest("default must be True or False", path="default")

        def register(fn: Callable[[WorkflowContext, I], Awaitable[R]]) -> Workflow[I, R]:
            wf_name = registered_name("workflow", name, fn)
            check_async("workflow", wf_name, fn)
            check_signature("workflow", wf_name, fn, takes=("ctx", "input"))
            wf = Workflow(name=wf_name,
                          version=check_name("version", str(version)), fn=fn, queue=queue,
                          default=default)
            self.registry.add_workflow(wf)
            return wf

        return register

    def tool(
        self,
        decorated: None = None,
        /,
        *,
        name: str | None = None,
        version: str = "1",
        effect: EffectClass = "consequential",
        timeout: timedelta | float | None = None,
        max_attempts: int | None = None,
        retry: RetryPolicy | None = None,
        authorize_timeout: timedelta | float | None = None,
        approve_timeout: timedelta | float | None = None,
        rate: RateLimit | str | None = None,
        concurrency: int | None = None,
        shared_backoff: bool = True,
    ) -> Callable[[Callable[Concatenate[ToolContext, P], Awaitable[R]]], Tool[P, R]]:
        """Register an async tool ``fn(ctx: ToolContext, **arguments)`` returning JSON.

        Returns a :class:`Tool` typed by the function's parameters after ``ctx`` and its
        return type, which ``ctx.call`` checks and returns.

        ``retry`` (a :class:`~orchestrator.recovery.RetryPolicy`) defaults to the app's, else
        to the effect class's: one attempt for ``consequential``, three for ``idempotent`` and
        ``read``. A policy given replaces that default whole (``RetryPolicy()`` allows one
        attempt whatever the effect class); ``max_attempts`` alone overrides just the attempt
        count.

        ``timeout`` (default: the app's ``tool_timeout``), ``authorize_timeout`` and
        ``approve_timeout`` (default: the app's ``stage_timeout``) are each a positive
        ``timedelta`` or a positive number of seconds (``timeout=5`` is
        ``timeout=timedelta(seconds=5)``; not a bool), of at most 36,600 days; ``fn`` (and
        the lookup and policy stages registered on the tool) must be ``async``: anything else
        is ``INVALID_REQUEST`` (``path``: the option's name) here, not a call that a worker
        finds it cannot make once its ``submitted`` is written.

        ``rate`` (``RateLimit(10, per=timedelta(seconds=1))`` or ``"10/s"``) and
        ``concurrency`` bound the tool's dispatches and its calls in flight across every
        worker; a call waiting for its turn parks its run, and the wait counts against the
        run's deadline. ``shared_backoff``: a provider's 429 or 503 with a Retry-After pauses
        the tool's dispatch for every run until then (docs/flow.md).

        The options go by keyword: ``@app.tool`` without ``()`` is ``INVALID_REQUEST`` saying
        so.
        """
        check_decorator_use("tool", decorated)
        tool_rate = check_rate(rate)
        tool_concurrency = check_limit(concurrency, "concurrency")
        if not isinstance(shared_backoff, bool):
            raise InvalidRequest("shared_backoff must be True or False", path="shared_backoff")
        if effect not in EFFECT_CLASSES:
            raise InvalidRequest(f"effect must be one of {', '.join(EFFECT_CLASSES)}",
                                 path="effect")
        call_timeout = None if timeout is None else check_timeout("timeout", timeout)
        authorize_budget, approve_budget = (
            None if value is None else check_timeout(budget, value)
            for budget, value in (("authorize_timeout", authorize_timeout),
                                  ("approve_timeout", approve_timeout)))
        if retry is not None and not isinstance(retry, RetryPolicy):
            # Checked now: a worker would find out at the call's first failure, with nothing
            # to decide by, and leave a call that may never have left uncertain.
            raise InvalidRequest(f"retry must be an orchestrator.RetryPolicy (e.g. "
                                 f"RetryPolicy(max_attempts=3)), got {type(retry).__name__}",
                                 path="retry")
        policy = retry or self.retry_policy or DEFAULT_POLICIES[effect]
        if max_attempts is not None:
            policy = dataclasses.replace(policy, max_attempts=max_attempts)

        def register(fn: Callable[Concatenate[ToolContext, P], Awaitable[R]]) -> Tool[P, R]:
            tool_name = registered_name("tool", name, fn)
            check_async("tool", tool_name, fn)
            check_signature("tool", tool_name, fn, takes=("ctx",), keywords=True)
            tool = Tool(name=tool_name,
                        version=check_name("version", str(version)), fn=fn, effect=effect,
                        timeout=call_timeout, policy=policy,
                        authorize_timeout=_seconds(authorize_budget, self.stage_timeout),
                        approve_timeout=_seconds(approve_budget, self.stage_timeout),
                        rate=tool_rate, concurrency=tool_concurrency,
                        shared_backoff=shared_backoff)
            self.registry.add_tool(tool)
            return tool

        return register

    def queue(self, name: str, *, concurrency: int | None = None,
              worker_concurrency: int | None = None, key_concurrency: int | None = None,
              rate: RateLimit | str | None = None, priority: bool = False,
              count_parked: bool = True,
              priority_aging: timedelta = DEFAULT_PRIORITY_AGING) -> Queue:
        """Declare a queue (docs/flow.md): ``concurrency`` runs of it started and not finished
        across every worker (parked runs keep their slot unless ``count_parked=False``),
        ``worker_concurrency`` on one worker, ``key_concurrency`` per ``concurrency_key``
        (a key's runs start in submission order), ``rate`` starts per window
        (``RateLimit(10, per=timedelta(seconds=1))`` or ``"10/s"``), ``priority``: lower
        numbers first, a waiting run gaining a level per ``priority_aging``. None is no limit.

        Every worker of this app writes the declaration when it starts; limits changed at run
        time (``orchestrator queues set``) are kept until ``queues reset``. ``INVALID_REQUEST``
        naming the field for a bad name or limit, or a name declared twice."""
        declared = declare_queue(name, concurrency=concurrency,
                                 worker_concurrency=worker_concurrency,
                                 key_concurrency=key_concurrency, rate=rate, priority=priority,
                                 count_parked=count_parked, priority_aging=priority_aging)
        if declared.name in self._declared_queues:
            raise InvalidRequest(f"queue {declared.name} is declared twice", path="name")
        self._declared_queues[declared.name] = declared
        return declared

    @property
    def queues(self) -> Queues:
        """Queues stored in the database: ``list``, ``get``, ``set``, ``reset``, ``pause``,
        ``resume`` (each with an ``_async`` twin); docs/flow.md."""
        if self._queues is None:
            self._queues = Queues(QueueAdmin(self.database), self._portal.call)
        return self._queues

    def schedule(
        self, id: str, *, cron: str, timezone: str = "UTC", overlap: str = "skip",
        catchup_window: timedelta = DEFAULT_CATCHUP, input: Any = None,
        owner: Owner | None = None,
    ) -> Callable[[Workflow[I, R]], Workflow[I, R]]:
        """Fire a workflow on a cron schedule (docs/schedules.md); put it above
        ``@app.workflow()``. Every worker of this app writes the schedule when it starts (the
        code's definition replaces the stored one; a pause is kept) and ticks every stored
        schedule: each slot fires once, with no leader. ``INVALID_REQUEST`` naming the field
        for a bad id, cron, time zone, overlap policy, catch-up window or input."""

        def register(wf: Workflow[I, R]) -> Workflow[I, R]:
            if not isinstance(wf, Workflow):
                raise InvalidRequest("@app.schedule goes above @app.workflow(): it schedules "
                                     "a registered workflow", path="workflow")
            # Registered here: another app's workflow would fire runs no worker of this one
            # runs (UNKNOWN_WORKFLOW, as app.schedules.create and submit say).
            resolve_workflow(self.registry, wf)
            row, when = definition(id, (wf.name, wf.version), cron=cron, timezone=timezone,
                                   overlap=overlap, catchup_window=catchup_window, input=input,
                                   owner=self._owner(owner), queue=wf.queue,
                                   json_limits=self.json_limits)
            if row["id"] in self._declared_schedules:
                raise InvalidRequest(f"schedule {row['id']} is declared twice", path="id")
            self._declared_schedules[row["id"]] = Declared(row, when)
            return wf

        return register

    @property
    def schedules(self) -> Schedules:
        """Schedules stored in the database: ``create``, ``update``, ``delete``, ``pause``,
        ``resume``, ``trigger``, ``backfill``, ``get``, ``list``, ``show`` (each with an
        ``_async`` twin); docs/schedules.md."""
        if self._schedules is None:
            admin = ScheduleAdmin(self.database, self.json_limits, self.metrics,
                                  workflows=self.registry.workflows,
                                  declared_here=self._declared_schedules)
            self._schedules = Schedules(
                admin, json_limits=self.json_limits, resolve=self._resolve_workflow,
                default_owner=self._owner, call=self._portal.call)
        return self._schedules

    def create_scheduler(self, *, interval: float = 1.0) -> Scheduler:
        """The schedules' ticker a worker of this app runs (for a host with its own loop)."""
        _check_seconds("interval", interval)
        return Scheduler(self.database, self.json_limits, self.metrics,
                         declared=tuple(self._declared_schedules.values()), interval=interval,
                         workflows=self.registry.workflows)

    # -- submission --------------------------------------------------------------------------

    @property
    def _submission(self) -> Submission:
        """The submission service, built with the settings as they are now."""
        config = SubmissionConfig(json_limits=self.json_limits,
                                  max_pending_events=self.max_pending_events,
                                  tracing=self.tracing, default_owner=self.default_owner)
        return Submission(config, lambda: self.database, self.registry, self.metrics,
                          self._declared_queues)

    def _owner(self, owner: Owner | None) -> Owner:
        return resolve_owner(owner, self.default_owner)

    def arguments_text(self, arguments: Any) -> str:
        """A tool call's arguments as the ledger's intent digest reads them (canonical JSON,
        held to this app's limits)."""
        return self.json_limits.text(arguments, "$.arguments")

    def _resolve_workflow(self, workflow: Workflow | str, version: str | None = None) -> Workflow:
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
        """Validate a submission and build its row. Raises before anything is written."""
        return self._submission.new_run_row(
            workflow, input, owner=owner, idempotency_key=idempotency_key, deadline=deadline,
            run_id=run_id, parent=parent, start=start, queue=queue, priority=priority,
            concurrency_key=concurrency_key)

    @overload
    async def submit_async(
        self,
        workflow: Workflow[I, R],
        input: I,
        *,
        owner: Owner | None = None,
        idempotency_key: str | None = None,
        deadline: timedelta | None = None,
        start_at: datetime | None = None,
        delay: timedelta | None = None,
        queue: str | None = None,
        priority: int = 0,
        concurrency_key: str | None = None,
        connection: Conn | None = None,
    ) -> RunHandle[R]: ...

    @overload
    async def submit_async(
        self,
        workflow: str,
        input: Any = None,
        *,
        version: str | None = None,
        owner: Owner | None = None,
        idempotency_key: str | None = None,
        deadline: timedelta | None = None,
        start_at: datetime | None = None,
        delay: timedelta | None = None,
        queue: str | None = None,
        priority: int = 0,
        concurrency_key: str | None = None,
        connection: Conn | None = None,
    ) -> RunHandle[Any]: ...

    async def submit_async(
        self,
        workflow: Workflow[Any, Any] | str,
        input: Any = None,
        *,
        version: str | None = None,
        owner: Owner | None = None,
        idempotency_key: str | None = None,
        deadline: timedelta | None = None,
        start_at: datetime | None = None,
        delay: timedelta | None = None,
        queue: str | None = None,
        priority: int = 0,
        concurrency_key: str | None = None,
        connection: Conn | None = None,
    ) -> RunHandle[Any]:
        """Submit a run; with ``idempotency_key``, at most one run per owner and key (C1).

        A workflow given by name starts ``version``, or without one the version registered
        with ``default=True``, else the highest (``"10"`` after ``"9"``; docs/versioning.md).

        ``start_at`` (a timezone-aware time) or ``delay`` (from now) hold the run back: no
        worker claims it before then, and its ``deadline`` counts from then (docs/flow.md).
        ``queue`` (else the workflow's), ``priority`` (lower first, in a queue declared with
        ``priority=True``) and ``concurrency_key`` (bounded by the queue's
        ``key_concurrency``) say where the run waits for its turn (docs/flow.md).

        With ``connection`` (a psycopg async connection in a transaction), the run is written
        in the caller's transaction: invisible until it commits, gone if it rolls back.
        """
        handle, _ = await self._submit_async(workflow, input, version=version, owner=owner,
                                             idempotency_key=idempotency_key,
                                             deadline=deadline, start_at=start_at,
                                             delay=delay, queue=queue, priority=priority,
                                             concurrency_key=concurrency_key,
                                             connection=connection)
        return handle

    async def _submit_async(
        self,
        workflow: Workflow[Any, Any] | str,
        input: Any = None,
        *,
        version: str | None = None,
        owner: Owner | None = None,
        idempotency_key: str | None = None,
        deadline: timedelta | None = None,
        start_at: datetime | None = None,
        delay: timedelta | None = None,
        queue: str | None = None,
        priority: int = 0,
        concurrency_key: str | None = None,
        connection: Conn | None = None,
    ) -> tuple[RunHandle[Any], bool]:
        """:meth:`submit_async`, and whether it created the run (False: the owner's key named
        an existing run of the same request). ``version`` picks a registered version of a
        workflow given by name (None: the default one, else the highest)."""
        who = self._owner(owner)
        run_id, created = await self._submission.submit(
            workflow, input, owner=who, version=version, idempotency_key=idempotency_key,
            deadline=deadline, start_at=start_at, delay=delay, queue=queue, priority=priority,
            concurrency_key=concurrency_key, connection=connection)
        return RunHandle(self, run_id, who), created

    @overload
    def submit(
        self,
        workflow: Workflow[I, R],
        input: I,
        *,
        owner: Owner | None = None,
        idempotency_key: str | None = None,
        deadline: timedelta | None = None,
        start_at: datetime | None = None,
        delay: timedelta | None = None,
        queue: str | None = None,
        priority: int = 0,
        concurrency_key: str | None = None,
        connection: Conn | None = None,
    ) -> RunHandle[R]: ...

    @overload
    def submit(
        self,
        workflow: str,
        input: Any = None,
        *,
        version: str | None = None,
        owner: Owner | None = None,
        idempotency_key: str | None = None,
        deadline: timedelta | None = None,
        start_at: datetime | None = None,
        delay: timedelta | None = None,
        queue: str | None = None,
        priority: int = 0,
        concurrency_key: str | None = None,
        connection: Conn | None = None,
    ) -> RunHandle[Any]: ...

    def submit(
        self,
        workflow: Workflow[Any, Any] | str,
        input: Any = None,
        *,
        version: str | None = None,
        owner: Owner | None = None,
        idempotency_key: str | None = None,
        deadline: timedelta | None = None,
        start_at: datetime | None = None,
        delay: timedelta | None = None,
        queue: str | None = None,
        priority: int = 0,
        concurrency_key: str | None = None,
        connection: Conn | None = None,
    ) -> RunHandle[Any]:
        """Sync twin of :meth:`submit_async`. The caller's current span (its thread's
        OpenTelemetry context) is the submission's parent, as in the async method."""
        submitted = partial(
            self._submit_async, workflow, input, version=version, owner=owner,
            idempotency_key=idempotency_key, deadline=deadline, start_at=start_at, delay=delay,
            queue=queue, priority=priority, concurrency_key=concurrency_key,
            connection=connection)
        return self._portal.call(_in_context(otel_context.get_current(), submitted),
                                 instead="await Orchestrator.submit_async()")[0]

    # -- reading and acting on runs ----------------------------------------------------------

    async def _row(self, run_id: uuid.UUID | str, owner: Owner | None, *,
                   result: bool = False) -> dict[str, Any]:
        """The owner's run (its summary; with ``result``, its result too), else
        ``ACCESS_DENIED``; ``INVALID_REQUEST`` (``path`` ``run_id``) for text that is not a
        run id."""
        who = self._owner(owner)
        rid = as_run_id(run_id)
        row = await self.database.read(lambda conn: runs_db.run_get(
            conn, rid, owner=(who.tenant, who.principal), result=result))
        if row is None:
            raise AccessDenied(DENIED)
        return row

    async def restart_async(self, run_id: uuid.UUID | str, *, reason: str,
                            from_position: int | None = None, operator: str | None = None,
                            owner: Owner | None = None) -> RunHandle[Any]:
        """Restart the owner's finished run as a new run that does not repeat its effects
        (docs/versioning.md, "Restarting a run"): its journal carries the old run's entries
        before ``from_position`` (default: where the old run went wrong) and every call that
        committed, whose receipt it returns; everything else runs anew, a call as a new
        operation with a new key. The two runs name each other (``restarted_from``,
        ``superseded_by``: the new run is the authoritative one: the submission's key moves to
        it, and the old run's handle follows it), and the restart is audited
        (``run.restart``, by ``operator``, default the owner's principal, with ``reason``).
        Refused with ``OPERATION_UNCERTAIN`` while an operation of the old run has no outcome
        (reconcile first), ``OPERATION_IN_PROGRESS`` for a run not finished, ``RUN_PRUNED``
        for a pruned one, ``INVALID_REQUEST`` for one restarted already."""
        who = self._owner(owner)
        # Named as this call names them: ``reason`` is the audit's evidence; an operator
        # given blank is refused, not replaced by the owner's principal.
        check_prose("reason", reason)
        if operator is not None:
            check_operator(operator)
        rid = as_run_id(run_id)
        done = await admin.restart_run(
            self.database, rid, operator=who.principal if operator is None else operator,
            evidence=reason,
            from_position=from_position, limits=self.json_limits,
            owner=(who.tenant, who.principal))
        return RunHandle(self, done.run_id, who)

    def restart(self, run_id: uuid.UUID | str, *, reason: str, from_position: int | None = None,
                operator: str | None = None, owner: Owner | None = None) -> RunHandle[Any]:
        """Sync twin of :meth:`restart_async`."""
        return self._portal.call(self.restart_async(
            run_id, reason=reason, from_position=from_position, operator=operator, owner=owner))

    async def get_run_async(self, run_id: uuid.UUID | str, *, owner: Owner | None = None
                            ) -> RunHandle[Any]:
        row = await self._row(run_id, owner)
        return RunHandle(self, row["id"], self._owner(owner))

    def get_run(self, run_id: uuid.UUID | str, *, owner: Owner | None = None
                ) -> RunHandle[Any]:
        """A handle to an existing run; ``ACCESS_DENIED`` if it is missing or not the owner's,
        ``INVALID_REQUEST`` (``path`` ``run_id``) for text that is not a run id, as the CLI and
        the HTTP API answer it."""
        return self._portal.call(self.get_run_async(run_id, owner=owner))

    async def list_runs_async(self, *, owner: Owner | None = None, status: str | None = None,
                              workflow: str | None = None, limit: int = 50,
                              before: str | None = None) -> list[RunInfo]:
        """The owner's runs, newest first, at most ``limit`` (1 to 1000); ``before``, the
        ``cursor`` of the last run of the previous page (``RunInfo.cursor``), gives the page
        after it (``INVALID_REQUEST`` for a text that is not a cursor)."""
        who = self._owner(owner)
        check_run_filters(status=status, workflow=workflow, limit=limit)
        after = parse_run_cursor(before)
        rows = await self.database.read(lambda conn: runs_db.run_list(
            conn, tenant=who.tenant, principal=who.principal, status=status,
            workflow=workflow, limit=limit, before=after))
        return [RunInfo.from_row(r) for r in rows]

    def list_runs(self, *, owner: Owner | None = None, status: str | None = None,
                  workflow: str | None = None, limit: int = 50,
                  before: str | None = None) -> list[RunInfo]:
        """The owner's runs, newest first (see :meth:`list_runs_async`)."""
        return self._portal.call(self.list_runs_async(owner=owner, status=status,
                                                      workflow=workflow, limit=limit,
                                                      before=before))

    async def send_event_async(self, run_id: uuid.UUID | str, name: str, payload: Any = None, *,
                               owner: Owner | None = None, event_key: str | None = None) -> bool:
        """Deliver an event to a run; with ``event_key``, delivered once however often sent.

        Returns False when an event with the same key, name and payload (equal JSON, key order
        aside) was already delivered, also once the run has finished (a retried send is not an
        error). The same key with another name or payload is ``IDEMPOTENCY_CONFLICT`` and
        stores nothing: a key names one event. A new event to a finished run is refused with
        ``INVALID_REQUEST``. A send whose COMMIT applied but whose
        answer was lost with its connection, keyed or not, is run again by the storage
        layer and returns True (it delivered the event, once).
        """
        return await self._submission.send_event(run_id, name, payload, owner=owner,
                                                 event_key=event_key)

    def send_event(self, run_id: uuid.UUID | str, name: str, payload: Any = None, *,
                   owner: Owner | None = None, event_key: str | None = None) -> bool:
        """Sync twin of :meth:`send_event_async`."""
        return self._portal.call(self.send_event_async(run_id, name, payload, owner=owner,
                                                       event_key=event_key))

    async def cancel_async(self, run_id: uuid.UUID | str, *, owner: Owner | None = None) -> str:
        """Request cancellation; returns the run's status afterwards (see
        :func:`orchestrator.admin.cancel_run` for the rules)."""
        row = await self._row(run_id, owner)
        done = await admin.cancel_run(self.database, row["id"])
        if done.before not in ("succeeded", "failed", "cancelled"):  # the chain's, if continued
            self.metrics.incr("cancellations", stage="requested")
        return done.after

    def cancel(self, run_id: uuid.UUID | str, *, owner: Owner | None = None) -> str:
        """Sync twin of :meth:`cancel_async`."""
        return self._portal.call(self.cancel_async(run_id, owner=owner))

    async def journal_async(self, run_id: uuid.UUID | str, *, owner: Owner | None = None
                            ) -> list[JournalEntry]:
        """The run's journal, oldest first. Reading it never dispatches anything (C3). A run
        that retention pruned has none left: ``RUN_PRUNED``, as its stream says, not an empty
        list."""
        row = await self._row(run_id, owner)
        check_kept(row, 0)
        return await self._submission.journal(row["id"])

    def journal(self, run_id: uuid.UUID | str, *, owner: Owner | None = None
                ) -> list[JournalEntry]:
        """Sync twin of :meth:`journal_async`."""
        return self._portal.call(self.journal_async(run_id, owner=owner))

    # -- waiting for many runs ---------------------------------------------------------------

    async def wait_async(self, handles: Iterable[H], *,
                         timeout: float | timedelta | None = None) -> list[H]:
        """Wait until every run is terminal; return the handles, in the order given.

        One statement reads every run still unfinished, however many there are, when the wait
        begins and whenever the poller that the waits of this event loop share (as
        :meth:`RunHandle.result_async` does: ``orchestrator.waiting``) found one ended. As
        ``result(timeout=)`` does, raises ``RESULT_TIMEOUT`` when ``timeout`` passes first,
        with ``pending`` (the ids not finished, in the order given) and ``status`` (the first
        one's); waiting changes nothing. A handle of another owner's run is ``ACCESS_DENIED``.
        Read each outcome with ``handle.result()``.
        """
        return await waiting.wait_all(self, handles, timeout)

    def wait(self, handles: Iterable[H], *,
             timeout: float | timedelta | None = None) -> list[H]:
        """Sync twin of :meth:`wait_async`."""
        return self._portal.call(self.wait_async(handles, timeout=timeout))

    def as_completed_async(self, handles: Iterable[H], *,
                           timeout: float | timedelta | None = None) -> AsyncIterator[H]:
        """Yield the handles as their runs become terminal (those found in one read in the
        order given), waiting as :meth:`wait_async` does; ``RESULT_TIMEOUT`` (with
        ``pending``) once ``timeout``, counted from this call, passes with runs still
        unfinished. The handles and the timeout are checked here, before any iteration."""
        return waiting.completing(self, handles, timeout)

    def as_completed(self, handles: Iterable[H], *,
                     timeout: float | timedelta | None = None) -> Iterator[H]:
        """Sync twin of :meth:`as_completed_async`: each wait runs on the private loop;
        the caller's thread waits between the handles it yields."""
        return waiting.completing_sync(self, handles, timeout)

    # -- workers -----------------------------------------------------------------------------

    @property
    def operators(self) -> Operators:
        """The operator API (async), scoped by ``operator_scopes`` and ``incident_readers``."""
        return Operators(self.database, self.operator_scopes, self.metrics,
                         incident_readers=self.incident_readers, json_limits=self.json_limits)

    def console(self, authenticate: Callable[..., Any] | None = None,
                grants: Mapping[str, Iterable[str]] | Callable[[str], Iterable[str]] | None = None,
                *, tokens: Mapping[str, str] | None = None,
                secret: bytes | None = None, heartbeat: float = 15.0,
                authenticate_owner: Callable[..., Any] | None = None) -> Any:
        """The operator console of this app: an ASGI application (Starlette) to mount in a
        host's web app (see docs/console.md and
        :func:`orchestrator.console.create_console`). ``authenticate(request)`` names the
        request's operator (or None); ``grants`` maps operators to what they may do (``read``,
        ``resolve``, ``cancel``, ``bulk``, ``incidents``, ``metrics``, ``queues``, or ``all``;
        None: read only); ``tokens`` are the bearer tokens of the standalone console. Tenant
        scopes and incident readers are this app's ``operator_scopes`` and
        ``incident_readers``. ``heartbeat``: seconds of silence after which a run's event
        stream sends a comment (proxies keep it open).
        ``authenticate_owner(request)`` names the :class:`Owner` a request acts for (or
        None): given, the same application serves the submitters' HTTP API (``POST
        /api/runs`` and the rest, docs/http-api.md) to clients in any language.

        Needs the ``console`` extra (``pip install 'orchestrator[console]'``), else
        ``CONFIGURATION_ERROR``."""
        try:
            from orchestrator.console import create_console
        except ImportError as exc:
            raise ConfigurationError("the console needs the console extra: pip install "
                                     "'orchestrator[console]'") from exc
        return create_console(self, authenticate=authenticate, grants=grants, tokens=tokens,
                              secret=secret, heartbeat=heartbeat,
                              authenticate_owner=authenticate_owner)

    def create_reconciler(self, *, max_lookups: int = 5, base_delay: float = 1.0,
                          max_delay: float = 300.0, batch: int = 10, poll_interval: float = 1.0,
                          lookup_timeout: float = 30.0,
                          prune_interval: float = PRUNE_INTERVAL,
                          unserved_grace: float = UNSERVED_GRACE) -> Reconciler:
        """A :class:`~orchestrator.reconcile.Reconciler` that uses this app's tool lookups
        and, with a ``retention``, prunes by it every ``prune_interval`` seconds. It takes the
        items of this app's tools; one of another tool is left for a reconciler that has it,
        and handed to operators once it has waited ``unserved_grace`` seconds (0 or more)
        with none taking it (docs/operations.md). Every setting is checked first
        (``CONFIGURATION_ERROR``), as the CLI checks its flags."""
        _check_reconciler(max_lookups=max_lookups, batch=batch, base_delay=base_delay,
                          max_delay=max_delay, poll_interval=poll_interval,
                          lookup_timeout=lookup_timeout, prune_interval=prune_interval,
                          unserved_grace=unserved_grace)
        return Reconciler(self.engine_config, self.registry, self.database, self.metrics,
                          max_lookups=max_lookups, base_delay=base_delay,
                          max_delay=max_delay, batch=batch, poll_interval=poll_interval,
                          lookup_timeout=lookup_timeout, retention=self.retention,
                          prune_interval=prune_interval, unserved_grace=unserved_grace)

    def run_reconciler(self, *, max_lookups: int = 5, base_delay: float = 1.0,
                       max_delay: float = 300.0, batch: int = 10, poll_interval: float = 1.0,
                       lookup_timeout: float = 30.0, prune_interval: float = PRUNE_INTERVAL,
                       unserved_grace: float = UNSERVED_GRACE,
                       metrics_port: int | None = None,
                       metrics_host: str = "127.0.0.1", event_loop: str | None = None) -> None:
        """Run the reconciler in this thread until SIGTERM/SIGINT. ``metrics_port``: serve
        ``/metrics`` and ``/healthz`` on ``metrics_host`` meanwhile (docs/metrics.md).
        ``event_loop``: ``auto`` (uvloop where installed, else asyncio's), ``uvloop`` or
        ``asyncio`` (default: ``ORCHESTRATOR_EVENT_LOOP``, else ``auto``). Its settings are
        checked before anything starts (``CONFIGURATION_ERROR``)."""
        _check_port(metrics_port)
        loop = event_loop_choice(event_loop)
        _check_reconciler(max_lookups=max_lookups, batch=batch, base_delay=base_delay,
                          max_delay=max_delay, poll_interval=poll_interval,
                          lookup_timeout=lookup_timeout, prune_interval=prune_interval,
                          unserved_grace=unserved_grace)
        run_until_stopped(lambda: self.create_reconciler(
            max_lookups=max_lookups, base_delay=base_delay, max_delay=max_delay, batch=batch,
            poll_interval=poll_interval, lookup_timeout=lookup_timeout,
            prune_interval=prune_interval, unserved_grace=unserved_grace),
            event_loop=loop, **self._serving(metrics_host, metrics_port))

    def create_worker(self, *, concurrency: int = 10, worker_id: str | None = None,
                      lease_ttl: float | None = None, poll_interval: float = 1.0,
                      drain_timeout: float = 30.0, schedules: bool = True) -> Worker:
        """A :class:`Worker` for this app; ``await worker.run()`` inside your own loop.
        ``schedules``: the worker also ticks the schedules (docs/schedules.md). Every setting
        is checked first (``CONFIGURATION_ERROR``), as the CLI checks its flags."""
        _check_worker(concurrency=concurrency, lease_ttl=lease_ttl,
                      poll_interval=poll_interval, drain_timeout=drain_timeout,
                      schedules=schedules)
        companions = [self.create_scheduler().run] if schedules else []
        for wf in self.registry.workflows.values():
            if wf.queue is not None and wf.queue not in self._declared_queues:
                raise ConfigurationError(f"workflow {wf.key} waits in queue {wf.queue}, which "
                                         f"is not declared: app.queue({wf.queue!r}, ...)")
        return Worker(self.engine_config, self.registry, self.database, self.metrics,
                      concurrency=concurrency, worker_id=worker_id, lease_ttl=lease_ttl,
                      poll_interval=poll_interval, drain_timeout=drain_timeout,
                      companions=companions,
                      queues=[q.row() for q in self._declared_queues.values()])

    def run_worker(self, *, concurrency: int = 10, worker_id: str | None = None,
                   lease_ttl: float | None = None, poll_interval: float = 1.0,
                   drain_timeout: float = 30.0, metrics_port: int | None = None,
                   metrics_host: str = "127.0.0.1", schedules: bool = True,
                   event_loop: str | None = None) -> None:
        """Run a worker in this thread until SIGTERM/SIGINT, then drain and return.
        ``metrics_port``: serve ``/metrics`` and ``/healthz`` on ``metrics_host`` until the
        drain is over (docs/metrics.md). ``schedules``: tick the schedules too.
        ``event_loop``: ``auto`` (uvloop where installed, else asyncio's), ``uvloop`` or
        ``asyncio`` (default: ``ORCHESTRATOR_EVENT_LOOP``, else ``auto``). Its settings are
        checked before anything starts (``CONFIGURATION_ERROR``)."""
        _check_port(metrics_port)
        loop = event_loop_choice(event_loop)
        _check_worker(concurrency=concurrency, lease_ttl=lease_ttl,
                      poll_interval=poll_interval, drain_timeout=drain_timeout,
                      schedules=schedules)
        run_until_stopped(lambda: self.create_worker(
            concurrency=concurrency, worker_id=worker_id, lease_ttl=lease_ttl,
            poll_interval=poll_interval, drain_timeout=drain_timeout, schedules=schedules),
            event_loop=loop, **self._serving(metrics_host, metrics_port))

    async def prune_async(self, *, dry_run: bool = False, batch: int = 500,
                          evidence: bool = True, duty: float = DUTY) -> PruneReport:
        """Prune by this app's ``retention`` now, in batches, until nothing is left
        (docs/retention.md); ``dry_run`` counts and changes nothing. Evidence past its period
        is expired too when the database role may (the migration role). ``duty``: the share
        of the time spent in batches (1: no pauses between them; docs/retention.md). An
        argument that is not one (``batch`` an int from 1 to 100000, ``duty`` more than 0 and
        at most 1, the flags True or False) is ``INVALID_REQUEST`` naming it, before anything
        is pruned."""
        if self.retention is None:
            raise ConfigurationError("this app has no retention: Orchestrator(retention="
                                     "Retention(finished_runs=timedelta(days=30)))")
        return await Pruner(self.database, self.retention, batch=batch, duty=duty).prune(
            dry_run=dry_run, evidence=evidence)

    def prune(self, *, dry_run: bool = False, batch: int = 500,
              evidence: bool = True, duty: float = DUTY) -> PruneReport:
        """Sync twin of :meth:`prune_async`."""
        return self._portal.call(self.prune_async(dry_run=dry_run, batch=batch,
                                                  evidence=evidence, duty=duty))

    def metrics_registry(self) -> CollectorRegistry:
        """A ``prometheus_client.CollectorRegistry`` with this app's metrics, for a host that
        exports its own (docs/metrics.md): the counters of this process (read when scraped)
        and gauges read from the database at scrape time. Expose it with
        ``prometheus_client.generate_latest`` (or OpenMetrics' encoder)."""
        from orchestrator import telemetry  # prometheus_client only where metrics are wanted

        return telemetry.metrics_registry(self.metrics, self.target)

    def _serving(self, host: str, port: int | None) -> dict[str, Any]:
        """How :func:`~orchestrator.serving.run_until_stopped` serves this app's metrics."""
        return {"database": self.database, "listen": listen_at(host, port),
                "registry": self.metrics_registry, "target": lambda: self.target}

    async def _close_pools(self) -> None:
        if self._run_streams is not None:
            await self._run_streams.close()
        if self._run_waits is not None:
            await self._run_waits.close()
        if self._database is not None:
            await self._database.close()

    def close(self) -> None:
        """Release the connections held for sync calls (also done at interpreter exit)."""
        self._portal.close()


MIN_LEASE_TTL = 0.5
"""The shortest lease a worker's heartbeat can keep: leases are renewed a third of their TTL
apart (every 0.05 s at the most often) and each renewal must land, through the pool, before
the lease runs out; at 0.5 s a renewal has a third of a second to spare for a round trip and
a busy event loop. Below it, a lease ran out between two renewals and another worker's sweep
took the run over again and again (its calls made unknown)."""


MAX_LEASE_TTL = 86400.0
"""The longest lease taken: a day. Where no liveness lock tells a worker's death (behind a
transaction pooler without a ``listen_url``) its runs wait this long for their leases; and a
TTL whose expiry the database cannot write (``1e308``) stopped a worker at its first claim."""


def checked_lease_ttl(value: float) -> float:
    """A lease's TTL as given, if it is a number of seconds a lease can last and a heartbeat
    can keep: a TTL of 0 or less hands out leases that have run out when they are granted
    (every write fenced, every call withheld), one that is not finite cannot be written as an
    expiry, one below :data:`MIN_LEASE_TTL` runs out between two renewals, and one above
    :data:`MAX_LEASE_TTL` is refused too."""
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not 0 < value < float("inf")):
        raise ConfigurationError(
            f"lease_ttl must be a finite number of seconds, more than 0, got {value!r}")
    if value < MIN_LEASE_TTL:
        raise ConfigurationError(
            f"lease_ttl must be at least {MIN_LEASE_TTL:g} s (a heartbeat renews a lease a "
            f"third of its TTL apart, and must land before it runs out), got {value!r}")
    if value > MAX_LEASE_TTL:
        raise ConfigurationError(
            f"lease_ttl must be at most {MAX_LEASE_TTL:g} s (a day: a dead worker's runs wait "
            f"that long for their leases where no liveness lock tells its death), got "
            f"{value!r}")
    return value


def _check_seconds(name: str, value: object, *, zero: bool = False) -> None:
    """A setting in seconds, checked before anything starts: a finite number, more than 0
    (``zero``: 0 or more)."""
    if (isinstance(value, bool) or not isinstance(value, int | float)
            or not (0 <= value if zero else 0 < value) or not value < float("inf")):
        raise ConfigurationError(
            f"{name} must be a finite number of seconds, {'0 or more' if zero else 'more than 0'}"
            f", got {value!r}")


def _check_count(name: str, value: object) -> None:
    if type(value) is not int or value < 1:
        raise ConfigurationError(f"{name} must be a positive integer, got {value!r}")


def _check_worker(*, concurrency: object, lease_ttl: float | None, poll_interval: object,
                  drain_timeout: object, schedules: object = True) -> None:
    """A worker's settings, as ``orchestrator worker`` checks its flags."""
    _check_count("concurrency", concurrency)
    if not isinstance(schedules, bool):  # "no" is true: never taken for its truth value
        raise ConfigurationError(f"schedules must be True or False, got {schedules!r}")
    if lease_ttl is not None:
        checked_lease_ttl(lease_ttl)
    _check_seconds("poll_interval", poll_interval)
    _check_seconds("drain_timeout", drain_timeout, zero=True)


def _check_reconciler(*, max_lookups: object, batch: object, unserved_grace: object,
                      **seconds: object) -> None:
    """A reconciler's settings, as ``orchestrator reconciler`` checks its flags."""
    _check_count("max_lookups", max_lookups)
    _check_count("batch", batch)
    _check_seconds("unserved_grace", unserved_grace, zero=True)
    for name, value in seconds.items():
        _check_seconds(name, value)


def _check_port(port: object) -> None:
    if port is not None and (type(port) is not int or not 0 <= port <= 65535):
        raise ConfigurationError(f"metrics_port must be between 0 and 65535, got {port!r}")


def _seconds(value: timedelta | None, default: float) -> float:
    return default if value is None else value.total_seconds()


async def _in_context(ctx: otel_context.Context, start: Callable[[], Awaitable[T]]) -> T:
    """Await ``start()`` with ``ctx`` as the current OpenTelemetry context: a sync method's
    coroutine runs on the portal's thread, whose context is not the caller's. (Started only
    here, so that a call the portal refuses leaves no coroutine behind.)"""
    token = otel_context.attach(ctx)
    try:
        return await start()
    finally:
        otel_context.detach(token)
