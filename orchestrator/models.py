"""Records at the public boundary: owners, run summaries, journal entries."""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from orchestrator.errors import InvalidRequest
from orchestrator.text import check_identifier

_IDEMPOTENCY_KEY = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:\-]{0,127}")


def validate_idempotency_key(key: str, field: str = "idempotency_key") -> str:
    """1–128 ASCII letters, digits, ``.``, ``_``, ``:``, ``-``; first a letter or digit (C1).
    ``field`` names the argument in the error (``event_key`` uses the same rules)."""
    if not isinstance(key, str) or not _IDEMPOTENCY_KEY.fullmatch(key) or not key.isascii():
        raise InvalidRequest(
            f"{field} must be 1-128 ASCII letters, digits, '.', '_', ':' or '-', "
            "starting with a letter or digit",
            path=field,
        )
    return key


RUN_STATUSES = ("queued", "running", "waiting", "needs_reconciliation", "succeeded", "failed",
                "cancelled")


def parse_run_id(value: Any, field: str = "run_id") -> uuid.UUID:
    """A run id as a UUID (a ``UUID`` or its text), else ``INVALID_REQUEST`` naming ``field``
    (``run_id``, or the name the caller gave it, such as the console's filter ``run``)."""
    if isinstance(value, uuid.UUID):
        return value
    if isinstance(value, str):
        try:
            return uuid.UUID(value)
        except ValueError:
            pass
    raise InvalidRequest(f"{field} must be a run id (a UUID), not {value!r}", path=field)


def check_workflow_filter(workflow: Any) -> str:
    """A filter by workflow name, else ``INVALID_REQUEST`` (``path`` ``workflow``). Tables show a
    workflow as ``name@version`` and no name holds an ``@``, so ``checkout@1`` could never
    match: it is refused saying what the filter takes, not answered with nothing."""
    check_identifier("workflow", workflow)
    if "@" in workflow:
        name = workflow.partition("@")[0]
        raise InvalidRequest(f"workflow filters by a workflow's name ({name!r}), not name@version "
                             f"({workflow!r})", path="workflow")
    return str(workflow)


def check_run_filters(*, status: Any = None, workflow: Any = None, tenant: Any = None,
                      limit: Any = 50, submission_key: Any = None) -> None:
    """Refuse run-list filters that could never match, or that the database could not take
    (a NUL byte, a lone surrogate), with ``INVALID_REQUEST`` naming the filter."""
    if type(limit) is not int or not 1 <= limit <= 1000:
        raise InvalidRequest("limit must be between 1 and 1000", path="limit")
    if status is not None and status not in RUN_STATUSES:
        raise InvalidRequest(f"status must be one of {', '.join(RUN_STATUSES)}", path="status")
    if workflow is not None:
        check_workflow_filter(workflow)
    if tenant is not None:
        check_identifier("tenant", tenant)
    if submission_key is not None:
        validate_idempotency_key(submission_key, "submission_key")


class Owner(BaseModel):
    """Who a run belongs to. The host application authenticates; the orchestrator compares."""

    model_config = ConfigDict(frozen=True)

    tenant: str = Field(min_length=1, max_length=200)
    principal: str = Field(min_length=1, max_length=200)

    @field_validator("tenant", "principal", mode="before")
    @classmethod
    def _names(cls, value: Any, info: Any) -> Any:
        # InvalidRequest is not a ValueError, so pydantic lets it through as it is: a bad owner
        # is INVALID_REQUEST naming the field, like every other bad input.
        return check_identifier(f"owner.{info.field_name}", value)

    def as_dict(self) -> dict[str, str]:
        return {"tenant": self.tenant, "principal": self.principal}


def held_until(row: dict[str, Any]) -> datetime | None:
    """When a run submitted with ``start_at`` or ``delay`` may start (its insert computed it
    from the same clock as ``created_at``); None for a run submitted to start at once, and for
    a continuation, which carries its first generation's options but is ready when it is made."""
    options = row.get("options") or {}
    if not isinstance(options, dict) or row.get("continued_from") is not None:
        return None
    created: datetime = row["created_at"]
    if isinstance(options.get("start_at"), str):
        return max(created, datetime.fromisoformat(options["start_at"]))
    if isinstance(options.get("delay_seconds"), int | float):
        return created + timedelta(seconds=options["delay_seconds"])
    return None


def cursor_time(at: datetime) -> str:
    """A keyset cursor's time: UTC with ``Z`` and every microsecond, so that a cursor holds
    only characters a query string takes as they are (an offset's ``+`` would be read as a
    space by a client that pastes the cursor into a URL without encoding it)."""
    return at.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def split_cursor(text: Any, what: str, name: str = "before") -> tuple[datetime, str]:
    """A keyset cursor ``<ISO time with zone>_<key>``, split (``INVALID_REQUEST`` naming
    ``name``, the parameter that gave it, and ``what`` otherwise). The time holds no ``_``;
    the key may (an incident's ref)."""
    at, _, key = text.partition("_") if isinstance(text, str) else ("", "", "")
    try:
        when = datetime.fromisoformat(at)
        if when.tzinfo is None:
            raise ValueError(at)
    except ValueError:
        raise InvalidRequest(f"{name} must be the next cursor of a page of {what}",
                             path=name) from None
    return when, key


def run_cursor(created_at: datetime, run_id: uuid.UUID) -> str:
    """The cursor of a run in a list of runs, newest first: where the next page begins."""
    return f"{cursor_time(created_at)}_{run_id}"


def parse_run_cursor(text: str | None) -> tuple[datetime, uuid.UUID] | None:
    """A run's cursor (:func:`run_cursor`) as its keyset, ``(created_at, id)``; None for
    None; ``INVALID_REQUEST`` (path ``before``) for anything else."""
    if text is None:
        return None
    when, rid = split_cursor(text, "runs")
    try:
        return when, uuid.UUID(rid)
    except ValueError:
        raise InvalidRequest("before must be the next cursor of a page of runs",
                             path="before") from None


def item_cursor(created_at: datetime, item_id: int) -> str:
    """The cursor of a reconciliation queue item in a list of items, oldest first (its
    ``created_at`` and its id): where the next page begins."""
    return f"{cursor_time(created_at)}_{item_id}"


def parse_item_cursor(text: str | None) -> tuple[datetime, int] | None:
    """An item's cursor (:func:`item_cursor`) as its keyset, ``(created_at, id)``; None for
    None; ``INVALID_REQUEST`` (path ``after``) for anything else."""
    if text is None:
        return None
    when, item_id = split_cursor(text, "operations", "after")
    if not (item_id.isascii() and item_id.isdigit() and len(item_id) <= 19
            and int(item_id) < 2**63):  # an id the database's bigint holds
        raise InvalidRequest("after must be the next cursor of a page of operations",
                             path="after")
    return when, int(item_id)


class RunInfo(BaseModel):
    """A run as its owner may see it."""

    id: uuid.UUID
    workflow: str
    version: str
    owner: Owner
    status: str
    outcome: str | None = None
    waiting_for: str | None = None
    revision: int
    deadline_at: datetime | None = None
    start_at: datetime | None = None
    """When a held-back run (``submit(start_at=…)`` or ``delay=``) may start; None if it was
    submitted to start at once, and for a continuation (``ctx.continue_as_new``)."""
    queue: str | None = None
    """The queue the run waits in (None: the default queue); docs/flow.md."""
    priority: int = 0
    concurrency_key: str | None = None
    created_at: datetime
    updated_at: datetime
    finished_at: datetime | None = None
    cancel_requested: bool = False
    parent_run_id: uuid.UUID | None = None
    error: dict[str, Any] | None = None
    pruned_at: datetime | None = None
    """When retention pruned the finished run (its journal, input and result deleted;
    docs/retention.md); None if it was not."""
    restarted_from: uuid.UUID | None = None
    """The run this one restarts (``handle.restart``); None for a run submitted."""
    superseded_by: uuid.UUID | None = None
    """The run that restarted this one, or that it continued as (``outcome`` is
    ``CONTINUED_AS_NEW``): the authoritative one; None if there is none."""
    continued_from: uuid.UUID | None = None
    """The run this one continues (``ctx.continue_as_new``); None for a run submitted."""

    @property
    def cursor(self) -> str:
        """Where a list of runs goes on after this one: ``list_runs(before=run.cursor)``
        gives the runs older than it (the HTTP API's ``next``)."""
        return run_cursor(self.created_at, self.id)

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> RunInfo:
        return cls(
            id=row["id"],
            workflow=row["workflow_name"],
            version=row["workflow_version"],
            # Stored names are not checked again: a run written under older rules is readable.
            owner=Owner.model_construct(tenant=row["tenant"], principal=row["principal"]),
            status=row["status"],
            outcome=row["outcome_code"],
            waiting_for=row["waiting_for"],
            revision=row["revision"],
            deadline_at=row["deadline_at"],
            start_at=held_until(row),
            queue=row.get("queue"),
            priority=row.get("priority") or 0,
            concurrency_key=row.get("concurrency_key"),
            created_at=row["created_at"],
            updated_at=row["updated_at"],
            finished_at=row["finished_at"],
            cancel_requested=row["cancel_requested_at"] is not None,
            parent_run_id=row["parent_run_id"],
            error=row["error"],
            pruned_at=row.get("pruned_at"),
            restarted_from=row.get("restarted_from"),
            superseded_by=row.get("superseded_by"),
            continued_from=row.get("continued_from"),
        )


class JournalEntry(BaseModel):
    """One entry of a run's journal, as its owner reads it (``journal()``, ``events()``).

    ``seq`` numbers a run's entries 1, 2, 3 … with no gaps and is the cursor of
    ``events(after=seq)``; ``kind`` is one of the journal's kinds (``call.submitted``,
    ``message`` …, see docs/streams.md); ``at`` is when it was committed (the database's
    clock); ``position`` is the workflow command it belongs to (None for the run's own entries:
    ``run.completed``, ``run.failed``, ``run.cancelled``, ``run.continued``); ``name`` is the tool,
    event, workflow or value name, or a ``message``'s topic; ``payload`` holds the kind's
    fields, built by the orchestrator from controlled values and the owner's own data (no
    tool's error text: that stays in incidents).
    """

    seq: int
    kind: str
    at: datetime
    position: int | None
    name: str | None
    payload: Any
    schema_version: int
    lease_token: int

    @property
    def created_at(self) -> datetime:
        """The same as :attr:`at` (its earlier name)."""
        return self.at

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> JournalEntry:
        return cls(seq=row["seq"], kind=row["kind"], at=row["created_at"],
                   position=row["position"], name=row["name"], payload=row["payload"],
                   schema_version=row["schema_version"], lease_token=row["lease_token"])
