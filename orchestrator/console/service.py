"""What the console reads and does, for one operator at a time, with no HTTP in it: the API and
the pages both call this, so they show and allow exactly the same.

Every method takes the request's :class:`~orchestrator.console.grants.Access`, checks the grant
it needs (``FORBIDDEN``), and acts through :class:`~orchestrator.operators.Operators` or with
its tenant scope (``tenants_of``): an object outside the scope is ``ACCESS_DENIED`` exactly as
a missing one (C9), and every action is the CLI's, with its evidence check and audit row (C17).
What lookups said and the incidents themselves need the ``incidents`` grant and the
application's incident-reader grant (C10).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol

from orchestrator import admin
from orchestrator.admin import Worker, worker_state
from orchestrator.console.grants import Access
from orchestrator.db import runs as runs_db
from orchestrator.db import views
from orchestrator.db.config import DatabaseTarget
from orchestrator.errors import AccessDenied, Forbidden, InvalidRequest
from orchestrator.models import (
    check_run_filters,
    cursor_time,
    item_cursor,
    parse_run_cursor,
    parse_run_id,
    run_cursor,
    split_cursor,
)
from orchestrator.operators import (
    UNRESOLVED,
    BulkSummary,
    Operators,
    parse_operation_id,
)
from orchestrator.queues import QueueAdmin, QueueInfo
from orchestrator.reconcile import THEN, Resolved
from orchestrator.stream import TERMINAL, RunStreams, check_kept
from orchestrator.text import check_identifier

DENIED = "the run does not exist or is not accessible"
PAGE_MAX = 200
INPUT_SHOWN = 64 * 1024
"""Characters of a run's input a page shows (the API gives all of it)."""


class Host(Protocol):
    """What the console needs of an :class:`~orchestrator.Orchestrator`."""

    @property
    def operators(self) -> Operators: ...

    @property
    def target(self) -> DatabaseTarget: ...


def _limit(value: Any, default: int = 50) -> int:
    if value is None:
        return default
    if type(value) is not int or not 1 <= value <= PAGE_MAX:
        raise InvalidRequest(f"limit must be between 1 and {PAGE_MAX}", path="limit")
    return value


def _run_cursor(row: Mapping[str, Any]) -> str:
    """The key of a run in a page (``created_at`` and id): the next page's ``before``."""
    return run_cursor(row["created_at"], row["id"])


def parse_incident_cursor(text: str | None) -> tuple[datetime, str] | None:
    if text is None:
        return None
    when, ref = split_cursor(text, "incidents")
    return when, check_identifier("before", ref)


def parse_time(name: str, text: str | None) -> datetime | None:
    """A time filter: an ISO 8601 date (its midnight) or date and time, in UTC unless it names
    its zone (``INVALID_REQUEST`` naming ``name`` otherwise)."""
    if text is None:
        return None
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise InvalidRequest(f"{name} must be an ISO 8601 date or time, e.g. 2026-12-01 or "
                             "2026-12-01T09:30:00+01:00", path=name) from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


INPUT_CONDITION_MAX = 1000
_PATH_PART = re.compile(r"[^\s.=\x00-\x1f\x7f]+")


def input_condition(text: str | None) -> str | None:
    """A condition on a run's input, ``path = value``, as the JSON document the input must
    contain (``jsonb @>``), or None (no condition).

    ``path`` is one or more object keys joined by dots (``customer``, ``order.customer.id``);
    ``value`` is a JSON scalar (``500``, ``true``, ``null``, ``"c1"``) or, when it is not one,
    the text as a string (``c1``). So ``customer = c1`` keeps the runs whose input has
    ``"customer": "c1"`` at its top level, and ``cents = 500`` those with the number 500.
    Anything else is ``INVALID_REQUEST`` (path ``input``)."""
    if text is None:
        return None
    usage = ("input must be a condition path = value, e.g. customer = c1 or "
             "order.cents = 500")
    if len(text) > INPUT_CONDITION_MAX:
        raise InvalidRequest(f"input is longer than {INPUT_CONDITION_MAX} characters",
                             path="input")
    path, equals, given = text.partition("=")
    parts = [part.strip() for part in path.split(".")]
    if not equals or not all(_PATH_PART.fullmatch(part) for part in parts):
        raise InvalidRequest(usage, path="input")
    given = given.strip()
    if given.startswith("="):  # ``x == 1``: one sign separates the path from the value
        raise InvalidRequest(usage, path="input")
    try:
        value: Any = json.loads(given)
    except ValueError:
        value = given
    if isinstance(value, dict | list) or not given:
        raise InvalidRequest(usage + " (the value is a single number, string, true, false "
                             "or null)", path="input")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidRequest(usage, path="input")
    for name in [*parts, *([value] if isinstance(value, str) else [])]:
        check_identifier("input", name)
    document: Any = value
    for part in reversed(parts):
        document = {part: document}
    return json.dumps(document, ensure_ascii=False)


@dataclass
class Page:
    """One keyset page, in its list's order (newest first; the reconciliation queue oldest
    first); ``next`` is the cursor of the following one (None: this is the last)."""

    rows: list[dict[str, Any]]
    next: str | None


@dataclass
class RunView:
    """A run as the Run page and ``GET /api/runs/{id}`` show it."""

    detail: admin.RunDetail
    input: Any
    children: list[dict[str, Any]]
    queue: list[dict[str, Any]]
    incidents: list[dict[str, Any]] | None = None
    """The run's incidents (summaries), for an incident reader; None for anyone else."""


THROUGHPUT_MINUTES = 60
"""The minutes the overview's throughput chart covers, the current one last."""
ENDED = ("succeeded", "failed", "cancelled")


@dataclass
class Minute:
    """Runs that finished in one minute, by how they ended."""

    at: datetime
    succeeded: int = 0
    failed: int = 0
    cancelled: int = 0

    @property
    def total(self) -> int:
        return self.succeeded + self.failed + self.cancelled


def minutes(current: datetime, rows: list[dict[str, Any]],
            count: int = THROUGHPUT_MINUTES) -> list[Minute]:
    """``count`` minutes ending with ``current``, oldest first, with the finished runs of
    ``rows`` (:func:`~orchestrator.db.views.run_throughput`) in them; a minute nothing
    finished in is there with zeros."""
    shown = [Minute(current - timedelta(minutes=count - 1 - i)) for i in range(count)]
    index = {m.at: m for m in shown}
    for row in rows:
        minute = index.get(row["minute"])
        if minute is not None and row["status"] in ENDED:
            setattr(minute, row["status"], getattr(minute, row["status"]) + row["n"])
    return shown


@dataclass
class Overview:
    statuses: dict[str, int]
    backlog: dict[str, Any]
    unknown_by_tool: list[dict[str, Any]]
    waiting_for_operators: int
    workers: list[Worker] = field(default_factory=list)
    throughput: list[Minute] = field(default_factory=list)
    """Runs finished per minute over the last hour, oldest first."""

    @property
    def workers_alive(self) -> int:
        """Workers that heartbeat: ``live`` ones, ``draining`` ones (which still hold their
        runs' leases, but take no new work: :attr:`workers_draining` counts them apart) and
        ``waiting`` ones (no liveness lock yet: they claim nothing, :attr:`workers_waiting`)."""
        return sum(1 for w in self.workers if w.state in ("live", "draining", "waiting"))

    @property
    def workers_draining(self) -> int:
        """Of :attr:`workers_alive`, those told to stop: they claim nothing more."""
        return sum(1 for w in self.workers if w.state == "draining")

    @property
    def workers_waiting(self) -> int:
        """Of :attr:`workers_alive`, those without their liveness lock yet: they claim
        nothing (their listen_url cannot be reached)."""
        return sum(1 for w in self.workers if w.state == "waiting")


class ConsoleService:
    """The console's reads and actions on one application (see the module docstring)."""

    def __init__(self, operators: Operators) -> None:
        self.ops = operators
        self.db = operators.db
        self.streams = RunStreams(operators.db)

    # -- who may see what --------------------------------------------------------------------

    def tenants(self, access: Access) -> list[str] | None:
        access.need("read")
        return self.ops.tenants_of(access.operator)

    def reads_incidents(self, access: Access) -> bool:
        """The ``incidents`` grant and the application's incident-reader grant."""
        return access.may("incidents") and self.ops.may_read_incidents(access.operator)

    # -- overview, runs, workers -------------------------------------------------------------

    async def overview(self, access: Access) -> Overview:
        tenants = self.tenants(access)
        async with self.db.connection() as conn:
            current, finished = await views.run_throughput(conn, tenants=tenants,
                                                           minutes=THROUGHPUT_MINUTES)
            return Overview(
                statuses=await views.run_status_counts(conn, tenants=tenants),
                backlog=await views.run_backlog(conn, tenants=tenants),
                unknown_by_tool=await views.operation_unknown_by_tool(conn, tenants=tenants),
                waiting_for_operators=await views.recon_waiting_for_operators(
                    conn, tenants=tenants),
                workers=[Worker(w, worker_state(w)) for w in await views.worker_list_all(conn)],
                throughput=minutes(current, finished))

    async def runs(self, access: Access, *, status: str | None = None,
                   workflow: str | None = None, version: str | None = None,
                   submission_key: str | None = None, tenant: str | None = None,
                   principal: str | None = None, created_from: str | None = None,
                   created_to: str | None = None, input: str | None = None,
                   before: str | None = None, limit: int | None = None) -> Page:
        """Runs newest first, ``limit`` (1 to :data:`PAGE_MAX`, default 50) at a time.

        Filters (each off when None): ``status``, ``workflow``, ``version``,
        ``submission_key``; the owner's ``tenant`` and ``principal``; ``created_from``
        (inclusive) and ``created_to`` (exclusive), ISO 8601 dates or times (UTC when no zone
        is given); ``input``, a condition on the input (:func:`input_condition`, e.g.
        ``customer = c1``). A tenant outside the operator's scope matches nothing."""
        tenants = self.tenants(access)
        count = _limit(limit)
        check_run_filters(status=status, workflow=workflow, submission_key=submission_key,
                          tenant=tenant)
        if version is not None:
            check_identifier("version", version)
        if principal is not None:
            check_identifier("principal", principal)
        start = parse_time("created_from", created_from)
        end = parse_time("created_to", created_to)
        contains = input_condition(input)
        cursor = parse_run_cursor(before)
        async with self.db.connection() as conn:
            rows = await views.run_page(conn, tenants=tenants, status=status,
                                        workflow=workflow, version=version,
                                        submission_key=submission_key, tenant=tenant,
                                        principal=principal, created_from=start,
                                        created_to=end, contains=contains, before=cursor,
                                        limit=count + 1)
        shown = rows[:count]
        return Page(shown, _run_cursor(shown[-1]) if len(rows) > count else None)

    async def run(self, access: Access, run_id: Any) -> RunView:
        tenants = self.tenants(access)
        rid = parse_run_id(run_id)
        async with self.db.connection() as conn:
            row = await runs_db.run_get(conn, rid, result=False)
            if row is None or (tenants is not None and row["tenant"] not in tenants):
                raise AccessDenied(DENIED)
            given = await views.run_input(conn, rid)
            children = await views.run_page(conn, tenants=tenants, parent=rid, limit=PAGE_MAX)
            incidents = (await views.incident_page(conn, tenants=tenants, run_id=rid,
                                                   limit=PAGE_MAX)
                         if self.reads_incidents(access) else None)
        detail = await admin.show_run(self.db, rid)
        queue = await self.ops.list_items(operator=access.operator, run_id=rid)
        return RunView(detail, given, children, queue, incidents)

    async def events(self, access: Access, run_id: Any, *, after: int,
                     given_as: str = "after", topics: tuple[str, ...] | None = None,
                     heartbeat: float | None = None
                     ) -> AsyncGenerator[list[dict[str, Any]], None] | None:
        """The run's stream after the cursor ``after`` (:meth:`RunStreams.pages`, following
        live; with ``topics``, only the messages published on them and the run's end), once
        the run is found in the operator's scope (else ``ACCESS_DENIED``, as a missing one,
        before anything is streamed); None when the run had ended at or before the cursor
        (nothing more will come). With ``heartbeat``, an empty page after that many seconds
        without an entry. ``given_as``: how the client sent the cursor (:meth:`follow`)."""
        tenants = self.tenants(access)
        rid = parse_run_id(run_id)
        async with self.db.connection() as conn:
            row = await runs_db.run_get(conn, rid, result=False)
        if row is None or (tenants is not None and row["tenant"] not in tenants):
            raise AccessDenied(DENIED)
        return self.follow(row, after=after, given_as=given_as, topics=topics,
                           heartbeat=heartbeat)

    def follow(self, row: Mapping[str, Any], *, after: int, given_as: str = "after",
               topics: tuple[str, ...] | None = None, heartbeat: float | None = None
               ) -> AsyncGenerator[list[dict[str, Any]], None] | None:
        """The stream of a run already found (``row``, its summary) and checked to be the
        caller's: None when it had ended at or before the cursor; ``RUN_PRUNED`` when
        retention deleted its journal (:func:`~orchestrator.stream.check_kept`);
        ``INVALID_REQUEST`` for a cursor past the last entry of a run still going (no entry
        of it was ever sent, and the stream would wait for that seq instead of the run's
        end), naming the cursor as the client sent it (``given_as``: ``Last-Event-ID`` or
        ``after``)."""
        if row["status"] in TERMINAL and after >= row["revision"]:
            return None
        check_kept(row, after)
        if after > row["revision"]:
            raise InvalidRequest(f"{given_as} {after} is past the run's last entry "
                                 f"({row['revision']}): give the id (seq) of an event of "
                                 "this stream", path=given_as)
        return self.streams.pages(row["id"], after=after, follow=True, topics=topics,
                                  heartbeat=heartbeat)

    async def cancel(self, access: Access, run_id: Any, *, evidence: str) -> tuple[str, str]:
        """Cancel a run (audited: ``run.cancel``); (status before, status after). A run not
        finished counts as a cancellation requested here, as ``app.cancel`` counts one."""
        tenants = self.tenants(access)
        access.need("cancel")
        done = await admin.operator_cancel(self.db, parse_run_id(run_id),
                                           operator=access.operator, evidence=evidence,
                                           tenants=tenants)
        if done.before not in TERMINAL:
            self.ops.metrics.incr("cancellations", stage="requested")
        return done.before, done.after

    async def workers(self, access: Access) -> list[Worker]:
        self.tenants(access)
        return await admin.list_workers(self.db)

    # -- queues (docs/flow.md) ---------------------------------------------------------------

    async def queues(self, access: Access) -> list[QueueInfo]:
        """Every queue with its limits and what it holds (counted over every tenant, as the
        workers page is)."""
        self.tenants(access)
        return await QueueAdmin(self.db).list()

    async def change_queue(self, access: Access, name: str, *, action: str, evidence: str,
                           changes: Mapping[str, Any] | None = None) -> QueueInfo:
        """``pause``, ``resume``, ``set`` (``changes``: limits by name) or ``reset`` a queue,
        audited (``queue.pause`` …, with the queue before and after) by
        :meth:`QueueAdmin.change`, the CLI's path. Needs the ``queues`` grant and an operator
        without tenant scopes: a queue is every tenant's."""
        tenants = self.tenants(access)
        access.need("queues")
        if tenants is not None:
            raise Forbidden(f"operator {access.operator!r} is limited to some tenants, and a "
                            "queue is shared by every tenant")
        return await QueueAdmin(self.db).change(name, action, operator=access.operator,
                                                evidence=evidence, changes=changes)

    # -- the reconciliation queue ------------------------------------------------------------

    async def queue(self, access: Access, *, state: str | None = UNRESOLVED,
                    tool: str | None = None, older_than: float | None = None,
                    key: str | None = None, run_id: str | None = None,
                    workflow: str | None = None, limit: int | None = None,
                    after: str | None = None) -> Page:
        """Queue items oldest first (``state`` None: every item), as ``ops list``, ``limit``
        (1 to :data:`PAGE_MAX`, default 100) at a time; ``after``: a page's ``next``."""
        self.tenants(access)
        count = _limit(limit, 100)
        rows = await self.ops.list_items(
            operator=access.operator, state=state, tool=tool, older_than=older_than, key=key,
            run_id=run_id, workflow=workflow, limit=count + 1, after=after)
        shown = rows[:count]
        return Page(shown, item_cursor(shown[-1]["created_at"], shown[-1]["item_id"])
                    if len(rows) > count else None)

    async def operation(self, access: Access, operation_id: Any) -> dict[str, Any]:
        """``ops show``'s view; what lookups said only with the ``incidents`` grant.
        ``operation_id`` as :func:`~orchestrator.operators.parse_operation_id` takes it."""
        self.tenants(access)
        shown = await self.ops.show(parse_operation_id(operation_id), operator=access.operator)
        if not access.may("incidents") and shown["reasons"] == "shown":
            shown = {**shown, "reasons": "withheld",
                     "lookups": [{**x, "reason": None} for x in shown["lookups"]]}
        return shown

    async def resolve(self, access: Access, operation_id: Any, *, resolution: str,
                      evidence: str, receipt: Any = None, then: str | None = None) -> str:
        """``committed`` (with ``receipt``), ``not_applied`` (``then`` resend, the default, or
        fail) or ``abandoned``; ``resolved`` or ``noop`` (already so), as ``ops resolve``."""
        return (await self.settle(access, operation_id, resolution=resolution,
                                  evidence=evidence, receipt=receipt, then=then)).outcome

    async def settle(self, access: Access, operation_id: Any, *, resolution: str,
                     evidence: str, receipt: Any = None, then: str | None = None) -> Resolved:
        """:meth:`resolve`, and what the resolution found in its own transaction (the run's
        status and cancellation before it, the operations it still waits for after it)."""
        self.tenants(access)
        access.need("resolve")
        operation_id = parse_operation_id(operation_id)
        _check_resolution(resolution, receipt, then)
        return await self.ops.resolve(
            operation_id, resolution, evidence=evidence, operator=access.operator,
            receipt=receipt if resolution == "committed" else None,
            then=(then or "resend") if resolution == "not_applied" else None)

    async def bulk(self, access: Access, *, resolution: str, evidence: str,
                   receipt: Any = None, then: str | None = None, confirmed: int | None,
                   state: str = UNRESOLVED, tool: str | None = None,
                   older_than: float | None = None, key: str | None = None,
                   run_id: str | None = None, workflow: str | None = None,
                   limit: int | None = None, ids: list[int] | None = None,
                   confirmed_selection: str | None = None) -> BulkSummary:
        """Resolve or abandon every unresolved item the filter selects (or those of the
        operations ``ids`` names, in the operator's tenants, instead of a filter), each on its
        own and audited, as ``ops resolve-many`` / ``abandon-many``.

        A count first: ``confirmed`` None selects and acts on nothing (a dry run); an action
        names the count the operator confirmed, and if the selection has another number now
        nothing is done (``declined``). ``confirmed_selection``, the dry run's ``selection``,
        declines as well a selection of that number whose operations are not those shown."""
        self.tenants(access)
        access.need("resolve", "bulk")
        _check_resolution(resolution, receipt, then)
        if confirmed is not None and (type(confirmed) is not int or confirmed < 1):
            raise InvalidRequest("confirmed must be the count of operations confirmed",
                                 path="confirmed")
        options: dict[str, Any] = {
            "evidence": evidence, "operator": access.operator, "state": state, "tool": tool,
            "older_than": older_than, "key": key, "run_id": run_id, "workflow": workflow,
            "dry_run": confirmed is None, "ids": ids,
            "confirm": lambda selected: len(selected.matched) == confirmed and (
                confirmed_selection is None or selected.selection == confirmed_selection)}
        if limit is not None:
            options["limit"] = limit
        if resolution == "abandoned":
            return await self.ops.abandon_many(**options)
        return await self.ops.resolve_many(resolution=resolution, receipt=receipt, then=then,
                                           **options)

    # -- incidents and the audit log ---------------------------------------------------------

    async def incidents(self, access: Access, *, before: str | None = None,
                        limit: int | None = None) -> Page:
        tenants = self.tenants(access)
        self._need_incidents(access)
        count = _limit(limit)
        async with self.db.connection() as conn:
            rows = await views.incident_page(conn, tenants=tenants,
                                             before=parse_incident_cursor(before),
                                             limit=count + 1)
        shown = rows[:count]
        more = len(rows) > count
        return Page(shown, f"{cursor_time(shown[-1]['created_at'])}_{shown[-1]['ref']}"
                    if more else None)

    async def incident(self, access: Access, ref: str) -> dict[str, Any]:
        self.tenants(access)
        self._need_incidents(access)
        return await self.ops.incident(ref, operator=access.operator)

    def _need_incidents(self, access: Access) -> None:
        access.need("incidents")
        if not self.ops.may_read_incidents(access.operator):
            raise Forbidden(f"operator {access.operator!r} is not one of this application's "
                            "incident readers")

    async def audit(self, access: Access, *, operator: str | None = None,
                    action: str | None = None, target: str | None = None,
                    kind: str | None = None, before: str | None = None,
                    limit: int | None = None) -> Page:
        """Audit rows newest first, of the operator's tenants; filters as
        :meth:`~orchestrator.operators.Operators.audit_log` (``operator``: who acted)."""
        rows, cursor = await self.ops.audit_log(
            operator=access.operator, by=operator, action=action, target=target, kind=kind,
            before=before, limit=_limit(limit))
        return Page(rows, cursor)


def _check_resolution(resolution: str, receipt: Any, then: str | None) -> None:
    if resolution not in ("committed", "not_applied", "abandoned"):
        raise InvalidRequest("resolution must be committed, not_applied or abandoned",
                             path="resolution")
    if then is not None and (resolution != "not_applied" or then not in THEN):
        raise InvalidRequest("then must be resend or fail, and goes only with not_applied",
                             path="then")
    if resolution != "committed" and receipt is not None:
        raise InvalidRequest("a receipt goes only with a committed resolution", path="receipt")
