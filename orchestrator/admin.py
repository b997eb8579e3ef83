"""Operator views of runs across owners, for the CLI and for consoles a host builds.

These functions do not check ownership: they are for operators, whom the host authorises. The
owner-scoped API for applications is :class:`~orchestrator.Orchestrator`.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from orchestrator.db import journal as journal_db
from orchestrator.db import operations as ops_db
from orchestrator.db import runs as runs_db
from orchestrator.db import workers as workers_db
from orchestrator.db.database import Conn, Database
from orchestrator.errors import AccessDenied, InvalidRequest
from orchestrator.models import check_run_filters

LIVE_WORKER_SECONDS = 60.0


def parse_run_id(value: str) -> uuid.UUID:
    try:
        return uuid.UUID(value)
    except ValueError:
        raise InvalidRequest(f"{value!r} is not a run id (a UUID)", path="run_id") from None


async def list_runs(db: Database, *, tenant: str | None = None, status: str | None = None,
                    workflow: str | None = None, parent: uuid.UUID | None = None,
                    limit: int = 50) -> list[dict[str, Any]]:
    """Runs of every owner, newest first; ``parent`` keeps the child runs of that run."""
    check_run_filters(status=status, workflow=workflow, tenant=tenant, limit=limit)
    async with db.connection() as conn:
        return await runs_db.run_list(conn, tenant=tenant, principal=None, status=status,
                                      workflow=workflow, limit=limit, parent=parent)


@dataclass
class RunDetail:
    """Everything ``runs show`` prints about one run."""

    run: dict[str, Any]
    journal: list[dict[str, Any]]
    operations: list[dict[str, Any]]
    note: str | None = None
    live_workers: list[dict[str, Any]] = field(default_factory=list)


async def show_run(db: Database, run_id: uuid.UUID) -> RunDetail:
    async with db.connection() as conn:
        run = await runs_db.run_get(conn, run_id)
        if run is None:
            raise AccessDenied("the run does not exist or is not accessible")
        journal = await journal_db.journal_read(conn, run_id)
        operations = await ops_db.operation_list_for_run(conn, run_id)
        workers = await workers_db.worker_list_live(conn, within_seconds=LIVE_WORKER_SECONDS)
    return RunDetail(run, journal, operations, _note(run, workers), workers)


def _note(run: dict[str, Any], workers: list[dict[str, Any]]) -> str | None:
    """Why a run that is not finished is not moving, in words."""
    key = f"{run['workflow_name']}@{run['workflow_version']}"
    if run["status"] == "queued":
        able = [w for w in workers if key in w["workflows"]]
        if not able:
            return (f"waiting for a worker that has workflow {run['workflow_name']} version "
                    f"{run['workflow_version']}: no live worker registers it")
        return f"ready; {len(able)} live worker(s) can run {key}"
    if run["status"] == "waiting":
        when = run["available_at"]
        return f"waiting for {run['waiting_for']}" + (f" (wakes at {utc_text(when)})"
                                                       if when else "")
    if run["status"] == "needs_reconciliation":
        return f"blocked: {run['waiting_for']}; see `orchestrator ops list`"
    if run["status"] == "running":
        return f"held by {run['lease_owner']} until {utc_text(run['lease_expires_at'])}"
    return None


def utc_text(when: datetime) -> str:
    """A time as operators read it everywhere (UTC, ``Z``); a naive one is taken as UTC."""
    if when.tzinfo is not None:
        when = when.astimezone(UTC)
    return f"{when:%Y-%m-%d %H:%M:%S}Z"


async def cancel_run(db: Database, run_id: uuid.UUID) -> str:
    """Cancel a run; return its status afterwards (no ownership check: callers do that).

    A queued or waiting run is cancelled at once; a running one at its next command; a run
    blocked on an unknown operation only after that operation is reconciled (C7).
    """

    async def cancel(conn: Conn) -> str:
        row = await runs_db.run_lock(conn, run_id)
        if row is None:
            raise AccessDenied("the run does not exist or is not accessible")
        if row["status"] in ("succeeded", "failed", "cancelled"):
            return str(row["status"])
        error = json.dumps({"code": "CANCELLED", "message": "the run was cancelled",
                            "retryable": False, "incident": None})
        if row["status"] in ("queued", "waiting") and await runs_db.run_cancel_idle(
                conn, run_id=run_id, revision=row["revision"], error=error):
            return "cancelled"
        await runs_db.run_request_cancel(conn, run_id)
        return str(row["status"])

    return await db.run_in_transaction(cancel)
