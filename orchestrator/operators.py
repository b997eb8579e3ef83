"""The operator API: list, inspect and resolve operations whose outcome is unknown (C8, C9, C17).

Consoles and the ``orchestrator ops`` and ``orchestrator incidents`` commands use this. Every
action names an operator and carries evidence; every resolution is audited.

Who sees what:

- An operator's name is checked by :func:`orchestrator.text.check_operator` (1 to 200
  characters, no whitespace, no control or invisible characters): ``'alice '`` or
  ``'alice\\u200b'`` is an ``INVALID_REQUEST``, never a second identity.
- A host may restrict operators to tenants (``Orchestrator(operator_scopes={"bob": ["acme"]})``).
  Once it does, the map is the list of operators: a name that is not in it sees nothing and may
  do nothing (``ACCESS_DENIED``: the operator is not configured). Without any scopes, every
  operator may act on every tenant.
- Within an operator's tenants, an operation, an incident or an audit row of another tenant
  looks exactly like one that does not exist (``ACCESS_DENIED``, or absent from a list). An
  incident belongs to its run's tenant; one without a run (or whose run is gone) belongs to no
  tenant and is readable only when no scopes are configured.
- Protected diagnostics (incidents: upstream text, tracebacks, what a lookup said) need the
  incident-reader grant as well (``Orchestrator(incident_readers=[...])``; without it, any
  operator in scope). The grant adds reading within the operator's tenants, never across them.
  :meth:`Operators.show` gives everyone a lookup's answer, attempt and time, whether it gave a
  reason and the incident reference that keeps it; the reason itself (the text of a
  ``NotApplied`` or ``StillUnknown``, which may hold secrets) only to incident readers.
"""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from datetime import datetime
from typing import Any

from orchestrator import reconcile
from orchestrator.canonical import DEFAULT_LIMITS, JsonLimits
from orchestrator.db import journal as journal_db
from orchestrator.db import reconciliation as recon_db
from orchestrator.db import views as views_db
from orchestrator.db.database import Conn, Database
from orchestrator.db.events import incident_get, incident_reasons, incidents_of_operations
from orchestrator.errors import (
    AccessDenied,
    ConfigurationError,
    DatabaseError,
    InvalidRequest,
    OperationInProgress,
    ResolutionConflict,
)
from orchestrator.journal import check_versions
from orchestrator.metrics import Metrics
from orchestrator.models import (
    check_workflow_filter,
    parse_item_cursor,
    parse_run_id,
    validate_idempotency_key,
)
from orchestrator.text import check_identifier, check_operator, is_number

ITEM_STATES = ("open", "operator", "resolved")
UNRESOLVED = "unresolved"
"""``list_items(state=UNRESOLVED)``: the items still waiting (``open`` or ``operator``)."""
ALL_STATES = "all"
"""``list_items(state=ALL_STATES)``: every item, as ``state=None`` (``ops list --state all``,
the API's ``state=all``)."""

_NO_INCIDENT = "the incident does not exist or is not accessible"

AUDIT_TARGET_KINDS = ("run", "operation", "queue", "schedule")
"""What an audit row's target can be (its ``target_kind``): an id names a target only with
its kind (a schedule may be named as a run's id, a queue ``2`` as operation 2)."""


def check_target_kind(kind: object) -> str:
    """``kind`` if it is one of :data:`AUDIT_TARGET_KINDS`, else ``INVALID_REQUEST`` with
    ``path="kind"``."""
    if kind not in AUDIT_TARGET_KINDS:
        raise InvalidRequest(f"kind must be one of {', '.join(AUDIT_TARGET_KINDS)}, got "
                             f"{kind!r}", path="kind")
    assert isinstance(kind, str)
    return kind


def check_scopes(scopes: Mapping[str, Sequence[str]] | None) -> dict[str, list[str]]:
    """The host's operator scopes as a plain dict, or ``CONFIGURATION_ERROR`` saying which key
    or tenant is unacceptable: keys are operator names, values lists of tenant names (a bare
    string is refused: it is not a list of tenants)."""
    if scopes is None:
        return {}
    if not isinstance(scopes, Mapping):
        raise ConfigurationError("operator_scopes must map operator names to lists of tenants")
    checked: dict[str, list[str]] = {}
    for name, tenants in scopes.items():
        _configured("operator_scopes", name)
        if isinstance(tenants, str | bytes) or not isinstance(tenants, Iterable):
            raise ConfigurationError(f"operator_scopes[{name!r}] must be a list of tenant "
                                     "names, not a single string")
        listed = list(tenants)
        for tenant in listed:
            try:
                check_identifier("tenant", tenant)
            except InvalidRequest as exc:
                raise ConfigurationError(f"operator_scopes[{name!r}]: {tenant!r} is not a valid "
                                         f"tenant name ({exc.message})") from None
        checked[name] = listed
    return checked


def check_readers(readers: Sequence[str] | None) -> list[str] | None:
    """The host's incident readers as a list (None: every operator in scope), or
    ``CONFIGURATION_ERROR`` naming the unacceptable entry."""
    if readers is None:
        return None
    if isinstance(readers, str | bytes) or not isinstance(readers, Iterable):
        raise ConfigurationError("incident_readers must be a list of operator names, not a "
                                 "single string")
    listed = list(readers)
    for name in listed:
        _configured("incident_readers", name)
    return listed


def _configured(option: str, name: Any) -> None:
    try:
        check_operator(name)
    except InvalidRequest as exc:
        raise ConfigurationError(f"{option}: {name!r} is not a valid operator name "
                                 f"({exc.message})") from None


def _plausible_ref(ref: Any) -> bool:
    """Whether ``ref`` could name an incident (a NUL byte or a lone surrogate could not be
    looked up; such a reference is as missing as any other unknown one)."""
    try:
        check_identifier("ref", ref)
    except InvalidRequest:
        return False
    return True


MAX_AGE = 10 * 365 * 86400.0
"""The largest ``older_than`` (seconds) ``list_items`` takes: ten years."""


BULK_LIMIT = 1000
"""How many items ``resolve_many`` and ``abandon_many`` act on unless told (oldest first)."""
MAX_BULK = 10_000
BULK_STATES = ("open", "operator", UNRESOLVED)
"""The states a bulk action selects from: only items that still wait can be resolved."""
MAX_IDS = 500
"""How many operations a bulk action may name one by one (``ids``)."""
NOT_WAITING = ("the operation does not exist, is not accessible or is not waiting for a "
               "resolution")
"""Why a bulk action skipped an id it was given but did not select: one answer for a missing
operation, another tenant's and one already resolved (C9)."""


def check_ids(ids: Any) -> list[int]:
    """The operations a bulk action names (``ids``): a list of 1 to :data:`MAX_IDS` operation
    ids, duplicates dropped (first place kept); ``INVALID_REQUEST`` otherwise."""
    if isinstance(ids, str | bytes) or not isinstance(ids, list | tuple):
        raise InvalidRequest("ids must be a list of operation ids", path="ids")
    if not 1 <= len(ids) <= MAX_IDS:
        raise InvalidRequest(f"ids must name 1 to {MAX_IDS} operations", path="ids")
    for value in ids:
        if type(value) is not int or not 0 < value < 2**63:
            raise InvalidRequest("ids must be operation ids (positive integers)", path="ids")
    return list(dict.fromkeys(ids))


def _item_filter(*, state: str | None, tool: Any, older_than: Any, key: Any, run_id: Any,
                 workflow: Any, bulk: bool = False) -> dict[str, Any]:
    """A queue filter checked (``INVALID_REQUEST`` naming the bad one) and turned into
    :func:`~orchestrator.db.reconciliation.recon_list`'s keywords."""
    allowed = BULK_STATES if bulk else (*ITEM_STATES, UNRESOLVED, ALL_STATES)
    if state is not None and state not in allowed:
        raise InvalidRequest(f"state must be one of {', '.join(allowed)}", path="state")
    if bulk and state is None:
        raise InvalidRequest(f"state must be one of {', '.join(allowed)}", path="state")
    if tool is not None:
        check_identifier("tool", tool)
    if older_than is not None and (
            type(older_than) not in (int, float) or not 0 <= older_than <= MAX_AGE):
        raise InvalidRequest("older_than must be a number of seconds from 0 to ten years",
                             path="older_than")
    if key is not None:
        validate_idempotency_key(key, "key")
    if workflow is not None:
        check_workflow_filter(workflow)
    states = (None if state in (None, ALL_STATES) else ["open", "operator"]
              if state == UNRESOLVED else [state])
    return {"states": states, "tool": tool, "older_than": older_than, "key": key,
            "run_id": None if run_id is None else parse_run_id(run_id),
            "workflow": workflow}


def _bulk_selection(ids: Any, **given: Any) -> dict[str, Any]:
    """What a bulk action selects: the filter ``given`` (as :func:`_item_filter`), or the
    operations ``ids`` names among those still waiting; ``INVALID_REQUEST`` for both."""
    if ids is None:
        return {**_item_filter(**given, bulk=True), "ids": None}
    if given["state"] != UNRESOLVED or any(
            given[name] is not None for name in ("tool", "older_than", "key", "run_id",
                                                  "workflow")):
        raise InvalidRequest("give ids or a filter, not both", path="ids")
    return {**_item_filter(**given, bulk=True), "ids": check_ids(ids)}


@dataclass(frozen=True)
class BulkItem:
    """One queue item a bulk action selected (or would, with ``dry_run``)."""

    operation_id: int
    run_id: uuid.UUID
    item_state: str
    tool_name: str
    tenant: str
    principal: str
    idempotency_key: str
    reason: str
    created_at: datetime

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> BulkItem:
        return cls(**{f.name: row[f.name] for f in fields(cls)})


@dataclass(frozen=True)
class Skipped:
    """An item a bulk action left alone: the stable code and message of what it met."""

    item: BulkItem
    code: str
    reason: str


@dataclass(frozen=True)
class Followed:
    """What a bulk action's resolution of one item led its run to: ``then``, one of
    :data:`~orchestrator.reconcile.NEXT_STEPS` (:func:`~orchestrator.reconcile.next_step`),
    and for ``waits`` the other operations the run still waits for (``waits_for``)."""

    then: str | None
    waits_for: list[int]


@dataclass
class BulkSummary:
    """What ``resolve_many`` or ``abandon_many`` did: the items it selected (``matched``;
    ``more`` when the limit left some out), those it resolved and those it skipped."""

    resolution: str
    dry_run: bool
    matched: list[BulkItem]
    more: bool
    resolved: list[BulkItem] = field(default_factory=list)
    skipped: list[Skipped] = field(default_factory=list)
    declined: bool = False
    missing: list[int] = field(default_factory=list)
    """Ids the action was given that it did not select (:data:`NOT_WAITING`): left alone."""
    followed: dict[int, Followed] = field(default_factory=dict)
    """What each resolved item led its run to, by operation id."""

    @property
    def selection(self) -> str:
        """A digest of the operations selected: a confirmation names it beside the count, so
        that a selection that kept its count but not its operations (one settled meanwhile,
        another matching since) is not acted on unseen."""
        ids = ",".join(str(op) for op in sorted(i.operation_id for i in self.matched))
        return hashlib.sha256(ids.encode()).hexdigest()[:32]


Confirm = Callable[[BulkSummary], bool]
"""Asked with a bulk action's selection before it acts; False: act on nothing."""


def check_operation_id(value: Any) -> int:
    """An operation id is a positive integer (a database ``bigint``); anything else is
    ``INVALID_REQUEST`` naming ``operation_id``, never a driver error, in the words of
    :func:`parse_operation_id` (the console's and the CLI's)."""
    if type(value) is not int or not 0 < value < 2**63:
        shown = repr(str(value)[:40]) if isinstance(value, str) else str(value)[:40]
        raise InvalidRequest(f"operation_id must be an operation id (a positive integer), "
                             f"not {shown}", path="operation_id")
    return value


def parse_operation_id(value: Any) -> int:
    """An operation id given as text (a path's or a command line's: whole ASCII digits) or as
    an int, checked as :func:`check_operation_id`; anything else is ``INVALID_REQUEST`` naming
    ``operation_id``, as a malformed run id names ``run_id``."""
    if isinstance(value, str) and is_number(value, 19):
        value = int(value)
    return check_operation_id(value)


class Operators:
    """Operator actions on one database, with the host's operator scopes and incident
    readers (see the module docstring for the rules)."""

    def __init__(self, database: Database,
                 scopes: Mapping[str, Sequence[str]] | None = None,
                 metrics: Metrics | None = None, *,
                 incident_readers: Sequence[str] | None = None,
                 json_limits: JsonLimits = DEFAULT_LIMITS) -> None:
        self.db = database
        self.scopes = check_scopes(scopes)
        self.incident_readers = check_readers(incident_readers)
        self.metrics = metrics or Metrics()
        self.json_limits = json_limits  # an operator's receipt is held to the app's caps

    def tenants_of(self, operator: str) -> list[str] | None:
        """The tenants ``operator`` may act on; None means all (no scopes are configured).

        ``INVALID_REQUEST`` for a name that is not a valid operator name; ``ACCESS_DENIED``
        for one that is not in the configured scopes."""
        check_operator(operator)
        if not self.scopes:
            return None
        tenants = self.scopes.get(operator)
        if tenants is None:
            raise AccessDenied(f"operator {operator!r} is not configured in this "
                               "application's operator scopes")
        return tenants

    def may_read_incidents(self, operator: str) -> bool:
        """Whether ``operator`` holds the incident-reader grant (within its tenants)."""
        self.tenants_of(operator)
        return self.incident_readers is None or operator in self.incident_readers

    async def list_items(self, *, operator: str, state: str | None = None, tool: str | None = None,
                         older_than: float | None = None, limit: int = 100,
                         key: str | None = None, run_id: uuid.UUID | str | None = None,
                         workflow: str | None = None, after: str | None = None
                         ) -> list[dict[str, Any]]:
        """Queue items (one per unknown operation), oldest first; ``state`` one of
        :data:`ITEM_STATES`, :data:`UNRESOLVED` or :data:`ALL_STATES` (None: every item, as
        ``all``). ``key`` is the operation's idempotency key, ``run_id`` its run,
        ``workflow`` its run's workflow name; every filter is checked (``INVALID_REQUEST``
        naming it) and applied in SQL. ``after``: the cursor of an item
        (:func:`~orchestrator.models.item_cursor` of its ``created_at`` and ``item_id``), to
        list only those after it: the next page."""
        tenants = self.tenants_of(operator)
        if type(limit) is not int or not 1 <= limit <= 1000:
            raise InvalidRequest("limit must be between 1 and 1000", path="limit")
        where = _item_filter(state=state, tool=tool, older_than=older_than, key=key,
                             run_id=run_id, workflow=workflow)
        cursor = parse_item_cursor(after)
        async with self.db.connection() as conn:
            return await recon_db.recon_list(conn, **where, tenants=tenants, limit=limit,
                                             after=cursor)

    async def show(self, operation_id: int, *, operator: str) -> dict[str, Any]:
        """The item with the operation's intent, arguments, owner, every attempt at its
        position, its incidents, the lookup history, the evidence and the run's timeline.

        Each lookup has its ``answer``, ``attempt``, time (``created_at``), ``has_reason``
        (it said something, kept in its ``incident``) and ``reason``: what it said, for an
        incident reader, else None. ``reasons`` says which: ``shown``, ``withheld`` (the
        operator lacks the incident-reader grant) or ``unreadable`` (the database role may
        read only the incidents' summary, ``db grant --no-incident-details``).

        ``wait`` is None for a queued operation. One whose call is still under way (its call
        in flight or not sent yet, or unknown and sent again by its run itself), which
        :meth:`resolve_committed` and the others refuse with ``OPERATION_IN_PROGRESS``, is
        shown as well, its item's fields None and ``wait`` saying what to wait for; any
        other operation outside the queue is refused as they refuse it.
        ``run_cancel_requested``: the run's cancellation was requested (resolved, committed or
        not applied, the operation lets it end cancelled: nothing is sent again)."""
        check_operation_id(operation_id)
        tenants = self.tenants_of(operator)

        async def look(conn: Conn) -> dict[str, Any]:
            # One snapshot: a resolution (or the run moving on) between two of these reads
            # must not show an item still waiting beside the audit row that resolved it.
            await recon_db.recon_read_snapshot(conn)
            return await self._shown(conn, operation_id, tenants)

        return await self._with_reasons(await self.db.run_in_transaction(look), operator)

    async def _shown(self, conn: Conn, operation_id: int, tenants: list[str] | None
                     ) -> dict[str, Any]:
        """What :meth:`show` shows but what lookups said, read on ``conn``."""
        wait = None
        item = await recon_db.recon_get(conn, operation_id, tenants=tenants)
        if item is None:
            refused = await reconcile.not_queued(conn, operation_id, tenants)
            item = (await recon_db.operation_unqueued(conn, operation_id)
                    if isinstance(refused, OperationInProgress) else None)
            if item is None:
                raise refused
            wait = refused.message
        attempts = await recon_db.operation_attempts(conn, item["run_id"], item["position"])
        run = await recon_db.run_status_of(conn, operation_id)
        journal = await journal_db.journal_read(conn, item["run_id"])
        check_versions(journal)  # as every reader of a journal refuses newer entries (C3)
        return {
            **item,
            "run_cancel_requested": run is not None and run[1],
            "wait": wait,
            "attempts": attempts,
            "incidents": await incidents_of_operations(
                conn, item["run_id"], [a["id"] for a in attempts]),
            "lookups": ([] if item["item_id"] is None
                        else await recon_db.recon_lookups(conn, item["item_id"])),
            "journal": journal,
            "audit": await recon_db.audit_list(conn, operation_id=operation_id,
                                               tenants=tenants),
        }

    async def _with_reasons(self, shown: dict[str, Any], operator: str) -> dict[str, Any]:
        """``shown``'s lookups with what they said, for an incident reader (the item is in
        the operator's tenants, and so are its run's incidents)."""
        lookups = [{**x, "has_reason": x["incident"] is not None, "reason": None}
                   for x in shown["lookups"]]
        refs = [x["incident"] for x in lookups if x["incident"] is not None]
        reasons, said = "withheld", {}
        if self.may_read_incidents(operator):
            try:
                async with self.db.connection() as conn:
                    said = await incident_reasons(conn, shown["run_id"], refs) if refs else {}
                reasons = "shown"
            except ConfigurationError:  # no SELECT on incidents.detail for this role
                reasons = "unreadable"
        for x in lookups:
            x["reason"] = said.get(x["incident"])
        return {**shown, "lookups": lookups, "reasons": reasons}

    async def incident(self, ref: str, *, operator: str) -> dict[str, Any]:
        """The protected diagnostics behind an incident reference, for an incident reader
        whose tenants include the incident's run's. A reference that does not exist, one of
        another tenant and a reader without the grant all get the same ``ACCESS_DENIED``."""
        tenants = self.tenants_of(operator)
        if not self.may_read_incidents(operator) or not _plausible_ref(ref):
            raise AccessDenied(_NO_INCIDENT)
        async with self.db.connection() as conn:
            row = await incident_get(conn, ref)
        if row is None or (tenants is not None and row["tenant"] not in tenants):
            raise AccessDenied(_NO_INCIDENT)
        return row

    async def resolve_committed(self, operation_id: int, *, receipt: Any, evidence: str,
                                operator: str) -> str:
        """The effect was applied: record ``receipt`` as its outcome; the run resumes."""
        return await self._resolve(operation_id, "committed", evidence, operator, receipt)

    async def resolve_not_applied(self, operation_id: int, *, evidence: str, operator: str,
                                  then: str = "resend") -> str:
        """Nothing was applied. ``then="resend"`` (the default): the call is sent again as a
        new attempt with a new key, outside the tool's retry budget; ``then="fail"``: the call
        fails in the workflow (``TOOL_FAILED``, cause ``not_applied``), which may catch it."""
        return await self._resolve(operation_id, "not_applied", evidence, operator, then=then)

    async def abandon(self, operation_id: int, *, evidence: str, operator: str) -> str:
        """Give up on the operation: the run fails with ``OPERATION_ABANDONED``."""
        return await self._resolve(operation_id, "abandoned", evidence, operator)

    async def _resolve(self, operation_id: int, resolution: str, evidence: str, operator: str,
                       receipt: Any = None, then: str | None = None) -> str:
        return (await self.resolve(operation_id, resolution, evidence=evidence,
                                   operator=operator, receipt=receipt, then=then)).outcome

    async def resolve(self, operation_id: int, resolution: str, *, evidence: str, operator: str,
                      receipt: Any = None, then: str | None = None) -> reconcile.Resolved:
        """:meth:`resolve_committed`, :meth:`resolve_not_applied` (``then``) or
        :meth:`abandon` by ``resolution`` (``committed``, ``not_applied``, ``abandoned``), and
        what the resolution found, read in its own transaction: the run's status and
        cancellation before it and the operations the run still waits for after it
        (:func:`orchestrator.reconcile.next_step` words what follows)."""
        check_operation_id(operation_id)
        done = await reconcile.resolve(
            self.db, operation_id=operation_id, resolution=resolution, receipt=receipt,
            evidence=evidence, operator=operator, tenants=self.tenants_of(operator),
            limits=self.json_limits, then=then)
        if done.outcome == "resolved":
            self.metrics.incr("reconciliation_operator", answer=resolution)
        return done

    async def still_waiting_on(self, operation_id: int, *, operator: str) -> list[int]:
        """The other operations the run of ``operation_id`` still waits for before it resumes
        (unknown and not settled yet): after a resolution, whether the run was woken or still
        waits, and for what. Another tenant's operation answers as having none (C9)."""
        check_operation_id(operation_id)
        tenants = self.tenants_of(operator)
        async with self.db.connection() as conn:
            item = await recon_db.recon_get(conn, operation_id, tenants=tenants)
            if item is None:
                return []
            return await recon_db.run_still_waiting_on(conn, operation_id)

    async def run_status_of(self, operation_id: int, *, operator: str
                            ) -> tuple[str, bool] | None:
        """The status of the run of a queued ``operation_id`` and whether its cancellation was
        requested: what a resolution leads to (a run that has ended is not woken, and one
        whose cancellation was requested ends cancelled: a call resolved not applied is then
        neither sent again nor failed into the workflow). None for an operation that is not
        queued or is another tenant's (C9)."""
        check_operation_id(operation_id)
        tenants = self.tenants_of(operator)
        async with self.db.connection() as conn:
            if await recon_db.recon_get(conn, operation_id, tenants=tenants) is None:
                return None
            return await recon_db.run_status_of(conn, operation_id)

    async def resolve_many(self, *, resolution: str, evidence: str, operator: str,
                           receipt: Any = None, state: str = UNRESOLVED,
                           tool: str | None = None, older_than: float | None = None,
                           key: str | None = None, run_id: uuid.UUID | str | None = None,
                           workflow: str | None = None, limit: int = BULK_LIMIT,
                           dry_run: bool = False, confirm: Confirm | None = None,
                           progress: Callable[[int, int], None] | None = None,
                           then: str | None = None,
                           ids: Sequence[int] | None = None) -> BulkSummary:
        """Resolve every unresolved item matching the filter (``resolution`` ``committed``,
        with one ``receipt`` for all, or ``not_applied``, with ``then`` ``resend``, the
        default, or ``fail`` as in :meth:`resolve_not_applied`), oldest first, at most
        ``limit``.

        Each item is resolved in its own transaction with its own audit row, exactly as
        :meth:`resolve_committed` / :meth:`resolve_not_applied` would; an item whose state
        changed after the selection (resolved by someone else, the queue item moved on, its
        run picked up by a worker) is skipped and listed with the error it met, and the rest
        go on. The database failing (``DATABASE_UNAVAILABLE``) stops the action: that item and
        the ones not tried yet are skipped with its code, the ones resolved stay so, and the
        same action again selects those still waiting. ``dry_run`` selects and acts on
        nothing. ``confirm(summary)`` is asked with the selection before anything is done:
        False leaves everything as it is (``declined``). ``progress(done, total)`` is called
        after each item. Bad input (a filter, the evidence, the receipt) is an
        ``INVALID_REQUEST`` before anything is read or written.

        ``ids`` (instead of a filter: both are ``INVALID_REQUEST``) selects those operations
        (:func:`check_ids`) among the items still waiting in the operator's tenants; an id it
        does not select (missing, another tenant's, already resolved: one answer, C9) is
        listed in ``missing`` and left alone."""
        if resolution not in ("committed", "not_applied"):
            raise InvalidRequest("resolution must be committed or not_applied "
                                 "(abandon_many gives up on operations)", path="resolution")
        if resolution == "not_applied" and then is None:
            then = "resend"
        if then is not None and (resolution != "not_applied" or then not in reconcile.THEN):
            raise InvalidRequest("then must be resend or fail, and goes only with not_applied",
                                 path="then")
        return await self._bulk(resolution, evidence, operator, receipt, limit, dry_run,
                                confirm, progress, _bulk_selection(
                                    ids, state=state, tool=tool, older_than=older_than,
                                    key=key, run_id=run_id, workflow=workflow), then)

    async def abandon_many(self, *, evidence: str, operator: str, state: str = UNRESOLVED,
                           tool: str | None = None, older_than: float | None = None,
                           key: str | None = None, run_id: uuid.UUID | str | None = None,
                           workflow: str | None = None, limit: int = BULK_LIMIT,
                           dry_run: bool = False, confirm: Confirm | None = None,
                           progress: Callable[[int, int], None] | None = None,
                           ids: Sequence[int] | None = None) -> BulkSummary:
        """Abandon every unresolved item matching the filter (or named by ``ids``), as
        :meth:`abandon` does one (each run fails with ``OPERATION_ABANDONED``); otherwise as
        :meth:`resolve_many`."""
        return await self._bulk("abandoned", evidence, operator, None, limit, dry_run,
                                confirm, progress, _bulk_selection(
                                    ids, state=state, tool=tool, older_than=older_than,
                                    key=key, run_id=run_id, workflow=workflow))

    async def _bulk(self, resolution: str, evidence: str, operator: str, receipt: Any,
                    limit: int, dry_run: bool, confirm: Confirm | None,
                    progress: Callable[[int, int], None] | None, where: dict[str, Any],
                    then: str | None = None) -> BulkSummary:
        tenants = self.tenants_of(operator)
        if type(limit) is not int or not 1 <= limit <= MAX_BULK:
            raise InvalidRequest(f"limit must be between 1 and {MAX_BULK:,}", path="limit")
        if where["ids"] is not None and limit < len(where["ids"]):
            raise InvalidRequest("limit must be at least the number of ids", path="limit")
        if type(dry_run) is not bool:
            raise InvalidRequest("dry_run must be True or False", path="dry_run")
        reconcile.check_evidence(evidence, operator)  # resolve() checks it all again per item
        if resolution == "committed":
            self.json_limits.text(receipt, "$.receipt")
        elif receipt is not None:
            raise InvalidRequest("a receipt goes only with a committed resolution",
                                 path="receipt")
        async with self.db.connection() as conn:
            rows = await recon_db.recon_match(conn, **where, tenants=tenants, limit=limit + 1)
        items = [BulkItem.from_row(row) for row in rows[:limit]]
        summary = BulkSummary(resolution=resolution, dry_run=dry_run, matched=items,
                              more=len(rows) > limit)
        if where["ids"] is not None:
            selected = {item.operation_id for item in items}
            summary.missing = [op for op in where["ids"] if op not in selected]
        if dry_run or not items:
            return summary
        if confirm is not None and not confirm(summary):
            summary.declined = True
            return summary
        for done, item in enumerate(items, 1):
            try:
                settled = await reconcile.resolve(
                    self.db, operation_id=item.operation_id, resolution=resolution,
                    receipt=receipt, evidence=evidence, operator=operator, tenants=tenants,
                    limits=self.json_limits, expect=item.item_state, then=then)
            except (ResolutionConflict, OperationInProgress, AccessDenied) as exc:
                summary.skipped.append(Skipped(item, code=exc.code, reason=exc.message))
            except DatabaseError as exc:
                # The database failed, not the item: the rest are not tried. Those resolved
                # stay resolved, and the same action again selects the ones still waiting.
                summary.skipped.append(Skipped(item, code=exc.code, reason=(
                    f"{exc.message}; whether operation {item.operation_id} was resolved is "
                    "not known: `orchestrator ops show` says")))
                summary.skipped += [Skipped(rest, code=exc.code, reason=(
                    f"not tried: the database failed at operation {item.operation_id}; "
                    "run the same action again")) for rest in items[done:]]
                break
            else:
                assert settled.outcome == "resolved"  # expect= turns a no-op into a conflict
                self.metrics.incr("reconciliation_operator", answer=resolution)
                summary.resolved.append(item)
                summary.followed[item.operation_id] = Followed(
                    reconcile.next_step(resolution, then, settled), list(settled.waits_for))
            if progress is not None:
                progress(done, len(items))
        return summary

    async def audit_log(self, *, operator: str, by: str | None = None,
                        action: str | None = None, target: str | None = None,
                        kind: str | None = None, before: str | None = None, limit: int = 50
                        ) -> tuple[list[dict[str, Any]], str | None]:
        """A page of the audit log, newest first, as far as it concerns ``operator``'s
        tenants (a row of a target of every tenant, a queue's, only without scopes): the rows
        and the cursor of the next page (None: no more). Filters: ``by`` (the operator who
        acted), ``action`` (itself and the actions under it: ``run`` matches ``run.cancel``),
        ``target`` (the target's id, of any kind), ``kind`` (the target's kind: one of
        :data:`AUDIT_TARGET_KINDS`), ``before`` (a page's cursor); each checked
        (``INVALID_REQUEST`` naming it)."""
        tenants = self.tenants_of(operator)
        if kind is not None:
            check_target_kind(kind)
        if by is not None:
            check_operator(by)
        for name, value in (("action", action), ("target", target)):
            if value is not None:
                check_identifier(name, value)
        if type(limit) is not int or not 1 <= limit <= 1000:
            raise InvalidRequest("limit must be between 1 and 1000", path="limit")
        after = None
        if before is not None:
            if not isinstance(before, str) or not is_number(before) or int(before) == 0:
                raise InvalidRequest("before must be the next cursor of a page of the audit "
                                     "log", path="before")
            after = int(before)
        async with self.db.connection() as conn:
            rows = await views_db.audit_page(conn, tenants=tenants, operator=by,
                                             action=action, target=target, kind=kind,
                                             before=after, limit=limit + 1)
        shown = rows[:limit]
        return shown, str(shown[-1]["id"]) if len(rows) > limit else None

    async def audit(self, operation_id: int | None = None, *, operator: str
                    ) -> list[dict[str, Any]]:
        """The audit log, oldest first (all of it, or one operation's), as far as it concerns
        ``operator``'s tenants: each row belongs to the tenant of the operation it acted on."""
        tenants = self.tenants_of(operator)
        async with self.db.connection() as conn:
            return await recon_db.audit_list(conn, operation_id=operation_id, tenants=tenants)
