"""The console API's JSON documents, built field by field like the CLI's ``--json``
(:mod:`orchestrator.records`, whose records they reuse): times in ISO 8601 UTC with a ``Z``, ids
as strings, absent values ``null``. The pages render the same documents, so a page shows
nothing the API would not."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from orchestrator import records
from orchestrator.admin import Worker
from orchestrator.console.grants import Access
from orchestrator.console.service import Overview, Page, RunView
from orchestrator.queues import QueueInfo, queue_record
from orchestrator.records import ident, iso


def session(access: Access, csrf_token: str) -> dict[str, Any]:
    return {"operator": access.operator, "grants": sorted(access.grants), "via": access.via,
            "csrf_token": csrf_token}


def worker(w: Worker) -> dict[str, Any]:
    """A worker (``workers list --json``'s ``WORKER``)."""
    return records.worker_record(w)


def queue_doc(info: QueueInfo) -> dict[str, Any]:
    """A queue (docs/cli-json.md's ``QUEUE``)."""
    return queue_record(info)


def overview(o: Overview) -> dict[str, Any]:
    return {
        "runs_by_status": dict(sorted(o.statuses.items())),
        "backlog": {"queued": o.backlog["queued"],
                    "oldest_age_seconds": o.backlog["oldest_age"]},
        "needs_reconciliation": o.statuses.get("needs_reconciliation", 0),
        "unknown_operations": [{"tool_name": u["tool_name"], "count": int(u["unknown"]),
                                "oldest_age_seconds": u["oldest_age"]}
                               for u in o.unknown_by_tool],
        "waiting_for_operators": o.waiting_for_operators,
        "workers": {"alive": o.workers_alive, "draining": o.workers_draining,
                    "waiting": o.workers_waiting, "registered": len(o.workers)},
        "throughput": [{"minute": iso(m.at), "succeeded": m.succeeded, "failed": m.failed,
                        "cancelled": m.cancelled} for m in o.throughput],
    }


def run_page(page: Page) -> dict[str, Any]:
    return {"runs": [records.run_summary(r) for r in page.rows], "count": len(page.rows),
            "next": page.next}


def incident_summary(x: Mapping[str, Any]) -> dict[str, Any]:
    return {"ref": x["ref"], "created_at": iso(x["created_at"]), "code": x["code"],
            "run_id": ident(x["run_id"]), "operation_id": ident(x["operation_id"]),
            "tenant": x["tenant"], "phase": x["phase"], "cause": x["cause"],
            "upstream_status": x["upstream_status"]}


def run(view: RunView) -> dict[str, Any]:
    shown = records.run_detail(view.detail)
    shown["run"]["input"] = view.input
    return {**shown,
            "children": [records.run_summary(c) for c in view.children],
            "queue": [records.queue_item(i) for i in view.queue],
            "incidents": (None if view.incidents is None
                          else [incident_summary(x) for x in view.incidents])}


def queue(page: Page) -> dict[str, Any]:
    return {"items": [records.queue_item(i) for i in page.rows], "count": len(page.rows),
            "next": page.next}


def bulk(summary: Any) -> dict[str, Any]:
    return {**records.bulk_summary(summary), "declined": summary.declined,
            "selection": summary.selection}


audit_row = records.audit_row


def audit_page(page: Page) -> dict[str, Any]:
    return {"audit": [audit_row(a) for a in page.rows], "count": len(page.rows),
            "next": page.next}


def incident_page(page: Page) -> dict[str, Any]:
    return {"incidents": [incident_summary(x) for x in page.rows], "count": len(page.rows),
            "next": page.next}
