"""The JSON records of the operator surfaces: what the CLI's ``--json`` prints (one document per
command, the field names documented in ``docs/cli-json.md``) and what the console's API answers
(``docs/console.md``).

Each record is built field by field from the rows the command read, so that a column added to
a table never appears in (or renames) the output by accident. The rules: times are ISO 8601 in
UTC with microseconds and a ``Z`` (``2026-01-02T03:04:05.000000Z``); ids (runs, operations,
audit rows) are strings; an absent value is ``null``, never a missing field; stored JSON
values (inputs, arguments, receipts, results, journal payloads) are passed through as they are.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from orchestrator.admin import LeaseHolder, RunDetail, Worker
from orchestrator.errors import AccessDenied
from orchestrator.journal import shown
from orchestrator.operators import NOT_WAITING, BulkItem, BulkSummary, Followed


def iso(when: datetime | None) -> str | None:
    """A time as ``--json`` prints it: UTC, ISO 8601, microseconds, ``Z``."""
    if when is None:
        return None
    if when.tzinfo is not None:
        when = when.astimezone(UTC).replace(tzinfo=None)
    return when.isoformat(timespec="microseconds") + "Z"


def ident(value: Any) -> str | None:
    """An id as ``--json`` prints it: a string (None stays null)."""
    return None if value is None else str(value)


def why(error: Any) -> str | None:
    """An operation's stored error in a line: its stable code and cause (``TOOL_FAILED
    (upstream_error)``, ``CALL_CANCELLED (deadline)``), else None. Nothing else of it is
    shown (the tool's own words are in its incident)."""
    code = error.get("code") if isinstance(error, dict) else None
    if not isinstance(code, str):
        return None
    cause = error.get("cause")
    return code + (f" ({cause})" if isinstance(cause, str) else "")


def error_record(error: Any) -> dict[str, Any] | None:
    """A run's public error: its code, message, incident reference and cause (C10; the cause
    holds controlled fields only, see :mod:`orchestrator.errors`)."""
    if not isinstance(error, dict):
        return None
    cause = error.get("cause")
    return {"code": error.get("code"), "message": error.get("message"),
            "incident": error.get("incident"),
            "cause": cause if isinstance(cause, dict) else None}


def run_summary(r: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": ident(r["id"]),
        "workflow_name": r["workflow_name"],
        "workflow_version": r["workflow_version"],
        "tenant": r["tenant"],
        "principal": r["principal"],
        "status": r["status"],
        "outcome_code": r["outcome_code"],
        "error": error_record(r["error"]),
        "waiting_for": r["waiting_for"],
        "submission_key": r["idempotency_key"],
        "parent_run_id": ident(r["parent_run_id"]),
        "parent_position": r["parent_position"],
        "lease_owner": r["lease_owner"],
        "lease_expires_at": iso(r["lease_expires_at"]),
        "deadline_at": iso(r["deadline_at"]),
        "available_at": iso(r["available_at"]),
        "cancel_requested_at": iso(r["cancel_requested_at"]),
        "created_at": iso(r["created_at"]),
        "updated_at": iso(r["updated_at"]),
        "finished_at": iso(r["finished_at"]),
        "queue": r.get("queue"),
        "priority": r.get("priority", 0),
        "concurrency_key": r.get("concurrency_key"),
        "started_at": iso(r.get("started_at")),
        "blocked": r.get("blocked"),
        "pruned_at": iso(r.get("pruned_at")),
        "restarted_from": ident(r.get("restarted_from")),
        "superseded_by": ident(r.get("superseded_by")),
        "continued_from": ident(r.get("continued_from")),
    }


def lease_record(holder: LeaseHolder | None) -> dict[str, Any] | None:
    if holder is None:
        return None
    return {"worker_id": holder.worker_id, "holder_state": holder.state,
            "expires_at": iso(holder.lease_expires_at), "heartbeat_at": iso(holder.heartbeat_at),
            "heartbeat_age_seconds": holder.heartbeat_age, "reclaim": holder.reclaim,
            "draining_since": iso(holder.draining_since)}


def worker_record(w: Worker) -> dict[str, Any]:
    """A registered worker (``workers list --json``, ``GET /api/workers``)."""
    row = w.row
    return {"id": row["id"], "state": w.state, "hostname": row["hostname"], "pid": row["pid"],
            "workflows": list(row["workflows"]), "concurrency": row["concurrency"],
            "runs_held": int(row["runs_held"]), "started_at": iso(row["started_at"]),
            "heartbeat_at": iso(row["heartbeat_at"]),
            "heartbeat_age_seconds": row["heartbeat_age"], "liveness_lock": row["lock_held"],
            "draining_since": iso(row["draining_since"])}


def run_operation(o: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "id": ident(o["id"]),
        "position": o["position"],
        "attempt": o["attempt"],
        "tool_name": o["tool_name"],
        "tool_version": o["tool_version"],
        "effect_class": o["effect_class"],
        "state": o["state"],
        "idempotency_key": o["idempotency_key"],
        "worker_id": o["worker_id"],
        "receipt": o["receipt"],
        "error": o["error"],
        "created_at": iso(o["created_at"]),
        "submitted_at": iso(o["submitted_at"]),
        "finished_at": iso(o["finished_at"]),
    }


def journal_entry(e: Mapping[str, Any]) -> dict[str, Any]:
    """One journal entry, its payload as readers see it (:func:`~orchestrator.journal.shown`)."""
    e = shown(e)
    return {"seq": e["seq"], "at": iso(e["created_at"]), "kind": e["kind"],
            "position": e["position"], "name": e["name"], "payload": e["payload"]}


def watch_entry(e: Mapping[str, Any]) -> dict[str, Any]:
    """A line of ``runs watch --json`` for one journal entry."""
    return {"type": "entry", **journal_entry(e)}


def watch_outcome(r: Mapping[str, Any]) -> dict[str, Any]:
    """The last line of ``runs watch --json``: the finished run's outcome."""
    return {"type": "outcome", "run_id": ident(r["id"]), "status": r["status"],
            "outcome_code": r["outcome_code"], "result": r["result"],
            "error": error_record(r["error"]), "finished_at": iso(r["finished_at"])}


def run_detail(detail: RunDetail) -> dict[str, Any]:
    return {
        "run": {**run_summary(detail.run), "revision": detail.run["revision"],
                "result": detail.run["result"]},
        "note": detail.note,
        "lease": lease_record(detail.holder),
        "operations": [run_operation(o) for o in detail.operations],
        "journal": [journal_entry(e) for e in detail.journal],
    }


def queue_item(i: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "operation_id": ident(i["operation_id"]),
        "run_id": ident(i["run_id"]),
        "run_status": i["run_status"],
        "tool_name": i["tool_name"],
        "tool_version": i["tool_version"],
        "effect_class": i["effect_class"],
        "position": i["position"],
        "attempt": i["attempt"],
        "tenant": i["tenant"],
        "principal": i["principal"],
        "idempotency_key": i["idempotency_key"],
        "intent_digest": i["intent_digest"],
        "arguments": i["arguments"],
        "operation_state": i["operation_state"],
        "item_state": i["item_state"],
        "resolution": i["resolution"],
        "then": i["then"],
        "reason": i["reason"],
        "lookup_attempts": i["lookup_attempts"],
        "next_attempt_at": iso(i["next_attempt_at"]),
        "submitted_at": iso(i["submitted_at"]),
        "created_at": iso(i["created_at"]),
        "resolved_at": iso(i["resolved_at"]),
    }


def item_detail(d: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "item": {**queue_item(d), "receipt": d["receipt"], "receipt_digest": d["receipt_digest"],
                 "worker_id": d["worker_id"], "run_cancel_requested": d["run_cancel_requested"]},
        "evidence": list(d["evidence"] or []),
        "attempts": [{"operation_id": ident(a["id"]), "attempt": a["attempt"],
                      "state": a["state"], "idempotency_key": a["idempotency_key"],
                      "worker_id": a["worker_id"], "submitted_at": iso(a["submitted_at"]),
                      "finished_at": iso(a["finished_at"]), "error": a["error"]}
                     for a in d["attempts"]],
        "incidents": [{"ref": x["ref"], "operation_id": ident(x["operation_id"]),
                       "phase": x["phase"], "cause": x["cause"], "at": iso(x["created_at"])}
                      for x in d["incidents"]],
        "lookups": [{"attempt": x["attempt"], "answer": x["answer"],
                     "incident": x["incident"], "at": iso(x["created_at"]),
                     "has_reason": x["has_reason"], "reason": x["reason"]}
                    for x in d["lookups"]],
        "reasons": d["reasons"],
        "audit": [{"id": ident(a["id"]), "at": iso(a["created_at"]), "operator": a["operator"],
                   "action": a["action"], "evidence": a["evidence"], "before": a["before"],
                   "after": a["after"]} for a in d["audit"]],
        "journal": [journal_entry(e) for e in d["journal"]],
        "wait": d["wait"],
    }


def audit_row(a: Mapping[str, Any]) -> dict[str, Any]:
    """One row of the operator audit (``ops audit --json``, the console's ``/api/audit``)."""
    return {"id": ident(a["id"]), "at": iso(a["created_at"]), "operator": a["operator"],
            "action": a["action"], "target_kind": a["target_kind"],
            "target_id": a["target_id"], "tenant": a["tenant"], "evidence": a["evidence"],
            "before": a["before"], "after": a["after"]}


def incident(row: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "ref": row["ref"],
        "created_at": iso(row["created_at"]),
        "code": row["code"],
        "run_id": ident(row["run_id"]),
        "operation_id": ident(row["operation_id"]),
        "tenant": row["tenant"],
        "phase": row["phase"],
        "cause": row["cause"],
        "upstream_status": row["upstream_status"],
        "detail": row["detail"],
    }


def bulk_item(item: BulkItem, followed: Followed | None = None) -> dict[str, Any]:
    """A bulk action's item, with what its resolution led its run to (``then``,
    ``waits_for``; null and empty for an item not resolved)."""
    return {
        "operation_id": ident(item.operation_id),
        "run_id": ident(item.run_id),
        "item_state": item.item_state,
        "tool_name": item.tool_name,
        "tenant": item.tenant,
        "principal": item.principal,
        "idempotency_key": item.idempotency_key,
        "reason": item.reason,
        "created_at": iso(item.created_at),
        "then": None if followed is None else followed.then,
        "waits_for": [] if followed is None else [ident(op) for op in followed.waits_for],
    }


def bulk_summary(summary: BulkSummary) -> dict[str, Any]:
    """A bulk action's summary. ``skipped`` lists the items it met in another state and then
    the ids it was given but did not select (``ACCESS_DENIED``: missing, another tenant's or
    not waiting look the same, C9), in a dry run too."""
    skipped = [{"operation_id": ident(s.item.operation_id), "code": s.code,
                "reason": s.reason} for s in summary.skipped]
    skipped += [{"operation_id": ident(op), "code": AccessDenied.code,
                 "reason": NOT_WAITING}
                for op in summary.missing]
    return {
        "resolution": summary.resolution,
        "dry_run": summary.dry_run,
        "more": summary.more,
        "counts": {"matched": len(summary.matched), "resolved": len(summary.resolved),
                   "skipped": len(skipped)},
        "matched": [bulk_item(i, summary.followed.get(i.operation_id))
                    for i in summary.matched],
        "resolved": [ident(i.operation_id) for i in summary.resolved],
        "skipped": skipped,
    }
