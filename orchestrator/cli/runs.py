"""``orchestrator runs``: list, show, watch and cancel runs, for operators."""

from __future__ import annotations

import argparse
import asyncio
import json
import uuid
from typing import Any

from orchestrator import admin, replay
from orchestrator.canonical import JsonLimits
from orchestrator.cli import records
from orchestrator.cli.common import (
    audited_as,
    database_target,
    is_input_limit,
    json_option,
    over_default_limits,
)
from orchestrator.cli.options import MAX_LIMIT, one_of, whole
from orchestrator.cli.tables import cell, clip, render
from orchestrator.cli.worker import load_app
from orchestrator.db import runs as runs_db
from orchestrator.db.database import Database
from orchestrator.db.schema import RUN_STATUSES
from orchestrator.errors import AccessDenied, InvalidRequest
from orchestrator.journal import shown_payload
from orchestrator.models import parse_run_id
from orchestrator.operators import Operators
from orchestrator.records import why
from orchestrator.recovery import hint_refusal
from orchestrator.stream import RunStreams, check_cursor, check_kept

EXIT_NOT_SUCCEEDED = 1  # the CLI's EXIT_FINDING: `runs watch` of a run that failed or was cancelled


def register(subparsers: Any) -> None:
    group = subparsers.add_parser("runs", help="list, inspect and cancel runs")
    commands = group.add_subparsers(title="runs commands", metavar="COMMAND")
    group.set_defaults(func=None, help_parser=group)

    ls = commands.add_parser("list", help="runs, newest first, across owners")
    ls.add_argument("--tenant")
    ls.add_argument("--status", choices=RUN_STATUSES, type=one_of("--status", RUN_STATUSES))
    ls.add_argument("--workflow", help="the workflow's name")
    ls.add_argument("--submission-key", metavar="KEY",
                    help="the idempotency key the run was submitted with")
    ls.add_argument("--limit", type=whole("--limit", low=1, high=MAX_LIMIT), default=50,
                    help=f"at most this many rows (1 to {MAX_LIMIT})")
    json_option(ls)
    ls.set_defaults(func=cmd_list)

    show = commands.add_parser("show", help="one run: status, operations and journal timeline")
    show.add_argument("run_id")
    json_option(show)
    show.set_defaults(func=cmd_show)

    watch = commands.add_parser(
        "watch", help="follow a run live: a line per journal entry, then its outcome",
        description="Follow a run's journal live, one line per entry as it is committed "
        "(under the column labels of `runs show`'s timeline), until the run ends; then "
        "print its outcome. Exit status: 0 the run succeeded, 1 it "
        "failed or was cancelled, 2 an error (e.g. ACCESS_DENIED for a run that does not "
        "exist, RUN_PRUNED for one that retention pruned). Ctrl-C stops watching (status "
        "130); the run goes on.")
    watch.add_argument("run_id")
    watch.add_argument("--after", type=whole("--after", low=0), default=0, metavar="N",
                       help="begin after the entry whose seq is N (default 0: from the first); "
                       "reconnecting with the last seq seen prints each later entry once")
    watch.add_argument("--json", action="store_true",
                       help="print JSON lines: one object per entry, then one for the outcome "
                       "(fields: docs/cli-json.md)")
    watch.set_defaults(func=cmd_watch)

    export = commands.add_parser(
        "export", help="one run and its journal as JSON, for `orchestrator replay --from-file`",
        description="Print one run (workflow, version, owner, input, status) and its whole "
        "journal as one JSON document, which `orchestrator replay --from-file` (and "
        "orchestrator.testing.replay) checks new code against with no database. The input, "
        "receipts and results are the owner's data: keep the file as you keep them.")
    export.add_argument("run_id")
    export.add_argument("--output", "-o", metavar="FILE",
                        help="write to FILE instead of stdout")
    export.set_defaults(func=cmd_export)

    restart = commands.add_parser(
        "restart", help="restart a finished run without repeating its effects",
        description="Start a new run of the same workflow version and input whose journal "
        "carries the old run's entries before --from-position (default: where it went wrong) "
        "and every call that committed, whose receipt it returns instead of calling again; "
        "everything else runs anew, a call as a new operation with a new key. The runs name "
        "each other; the restart is audited. Refused while an operation of the old run has "
        "no outcome (reconcile first), and for a run not finished, pruned or restarted "
        "already (docs/versioning.md).")
    restart.add_argument("run_id")
    restart.add_argument("--from-position", type=whole("--from-position", low=0), metavar="N",
                         help="keep the old run's history before position N (default: the "
                         "first position that failed)")
    restart.add_argument("--operator", required=True, metavar="NAME",
                         help="who restarts it (audited)")
    restart.add_argument("--evidence", required=True, metavar="TEXT",
                         help="why (audited), e.g. 'the PSP outage is over'")
    restart.add_argument("--app", default=None, metavar="MODULE:ATTR",
                         help="the application: its JSON limits hold the new run's input (as "
                         "for a submission to it) and its operator scopes the operator")
    json_option(restart)
    restart.set_defaults(func=cmd_restart)

    cancel = commands.add_parser(
        "cancel", help="request cancellation of a run",
        description="Request the run's cancellation: it stops at its next step (a run whose "
        "operations wait for reconciliation, once they are settled). The cancellation is "
        "audited (`run.cancel`, as the console's is): with --operator and --evidence as "
        "given, else as the login that ran the command, with no reason given; with --app "
        "the operator is held to their scopes.")
    cancel.add_argument("run_id")
    cancel.add_argument("--operator", default=None, metavar="NAME",
                        help="who cancels it (audited; give --evidence too)")
    cancel.add_argument("--evidence", default=None, metavar="TEXT",
                        help="why (audited), e.g. 'the customer withdrew the order'")
    cancel.add_argument("--app", default=None, metavar="MODULE:ATTR",
                        help="the application: its operator scopes hold the operator")
    cancel.set_defaults(func=cmd_cancel)


def _db(args: argparse.Namespace) -> Database:
    return Database(database_target(args), max_pool_size=2)


async def _with_db(args: argparse.Namespace, fn: Any) -> Any:
    db = _db(args)
    try:
        return await fn(db)
    finally:
        await db.close()


def cmd_list(args: argparse.Namespace) -> int:
    rows = asyncio.run(_with_db(args, lambda db: admin.list_runs(
        db, tenant=args.tenant, status=args.status, workflow=args.workflow,
        submission_key=args.submission_key, limit=args.limit)))
    if args.json:
        records.emit({"runs": [records.run_summary(r) for r in rows], "count": len(rows),
                      "limit": args.limit})
        return 0
    if not rows:
        print("no runs")
        return 0
    print(render(
        ["RUN", "WORKFLOW", "STATUS", "OWNER", "DETAIL", "CREATED", "UPDATED"],
        [[r["id"], f"{r['workflow_name']}@{r['workflow_version']}", r["status"],
          f"{r['tenant']}/{r['principal']}",
          r["outcome_code"] or r.get("blocked") or r["waiting_for"] or r.get("stalled"),
          r["created_at"], r["updated_at"]] for r in rows]))
    return 0


BEFORE_SEND = "_before_send"
"""The end of the cause words (``connection_before_send``, ``timeout_before_send``) of a
failure that proves the request never left (``ToolError.before_send``)."""


def never_sent(journal: list[dict[str, Any]]) -> frozenset[int]:
    """The operations whose attempt failed before it was sent, as their later ``call.retrying``
    or ``call.failed`` entry says (its cause word, :data:`BEFORE_SEND`): their
    ``call.submitted`` entry was written ahead of a request that never left."""
    return frozenset(
        e["payload"]["op"] for e in journal
        if e["kind"] in ("call.retrying", "call.failed") and isinstance(e["payload"], dict)
        and str(e["payload"].get("cause", "")).endswith(BEFORE_SEND))


def _story(kind: str, p: dict[str, Any], unsent: frozenset[int] = frozenset()) -> str | None:
    """What a tool call's entry, a child run's, an event's, a message or a run's end says, in
    words (None: the payload says it best). ``unsent``: the operations known to have failed
    before they were sent (:func:`never_sent`)."""
    by = f" by {p['resolved_by']}" if p.get("resolved_by") else ""
    if kind == "call.submitted" and p["op"] in unsent:
        return (f"attempt {p['attempt']} handed to the tool, which failed before sending it "
                f"(operation {p['op']}, key {p['key']})")
    if kind in ("call.submitted", "call.pending"):
        verb = "sent" if kind == "call.submitted" else "intent recorded"
        return f"attempt {p['attempt']} {verb} (operation {p['op']}, key {p['key']})"
    if kind == "call.unknown":
        wait = f" in {p['delay_ms']} ms" if p.get("delay_ms") else ""
        return f"operation {p['op']}: outcome unknown ({p['reason']}); next: {p['next']}{wait}"
    if kind == "call.not_applied":
        then = f"; then {p['then']}" if p.get("then") else ""
        return f"operation {p['op']} proven not applied{by}{then}"
    if kind == "call.retrying":
        nxt = p["attempt"] + 1
        if p.get("resend") == "lost":
            return (f"re-sent as attempt {nxt}: attempt {p['attempt']} was lost by its worker "
                    "and proven not applied")
        if p.get("resend") == "operator":
            return f"re-sent as attempt {nxt}, as an operator chose"
        failed = ("was never sent" if p["cause"].endswith(BEFORE_SEND) else "failed")
        return (f"attempt {p['attempt']} {failed} ({p['cause']}); attempt {nxt} after "
                f"{p['delay_ms']} ms")
    if kind == "call.completed":
        return f"operation {p['op']} committed{by}"
    if kind == "call.failed":
        failed = "failed before it was sent" if p["cause"].endswith(BEFORE_SEND) else "failed"
        hint = f"; {hint_refusal(p['retry_after'])}" if p.get("retry_after") else ""
        return f"operation {p['op']} {failed}: {p['cause']} ({p['reason']}){hint}"
    if kind == "call.abandoned":
        return f"operation {p['op']} abandoned{by}: the run fails"
    if kind == "child.started":
        return f"child run {p['run_id']} started (version {p['version']})"
    if kind == "child.completed":
        return "the child run succeeded"
    if kind == "child.failed":
        return f"the child run failed: {p['code']}: {p['message']}"
    if kind == "event.received":  # its payload: --json
        return "the event was received"
    if kind == "event.timeout":
        return "the wait timed out (EVENT_TIMEOUT)"
    if kind == "patch":
        return "took the patch's new code (ctx.patched)"
    if kind == "message":
        return clip(json.dumps(p["value"], sort_keys=True, ensure_ascii=False), 120)
    if kind == "run.completed":
        return "the run succeeded"
    if kind == "run.failed":
        return f"the run failed: {p['code']}: {p['message']}"
    if kind == "run.cancelled":
        return "the run was cancelled"
    if kind == "run.continued":
        return f"the run continued as run {p['run_id']} (version {p['version']})"
    return None


def _summary(payload: Any, kind: str = "", unsent: frozenset[int] = frozenset()) -> str:
    """An event's payload in a line; its incident reference first, so that no clipping hides
    what an operator needs for `orchestrator incidents show`."""
    payload = shown_payload(kind, payload)
    if isinstance(payload, dict):
        try:
            told = _story(kind, payload, unsent)
        except (KeyError, TypeError):  # an older entry: show its fields
            told = None
        incident = payload.get("incident")
        if told is not None:
            return f"incident {incident} {told}" if incident else told
        shown = {k: v for k, v in payload.items()
                 if k not in ("intent", "result", "payload", "incident")}
        text = clip(json.dumps(shown, default=str, sort_keys=True), 78)
        return f"incident {incident} {text}" if incident else text
    return cell(payload)


def cause_text(cause: Any) -> str | None:
    """A run's public cause in a line: ``TOOL_FAILED (tool charge, cause timeout, reason
    budget, attempts 1, reconciled lookup)``; a child run's own cause follows its id."""
    if not isinstance(cause, dict):
        return None
    parts = [f"{key} {value}" for key, value in cause.items()
             if key not in ("code", "cause") and value is not None and not isinstance(value, dict)]
    inner = cause.get("cause")
    if isinstance(inner, str):
        parts.insert(1 if "tool" in cause else 0, f"cause {inner}")
    text = str(cause.get("code")) + (f" ({', '.join(parts)})" if parts else "")
    if isinstance(cause.get("retry_after"), dict):  # the hint that stopped the call
        text += f"; {hint_refusal(cause['retry_after'])}"
    if isinstance(inner, dict):
        text += f"; its cause: {cause_text(inner)}"
    return text


def cmd_show(args: argparse.Namespace) -> int:
    run_id = parse_run_id(args.run_id)
    detail = asyncio.run(_with_db(args, lambda db: admin.show_run(db, run_id)))
    if args.json:
        records.emit(records.run_detail(detail))
        return 0
    run = detail.run
    fields = [
        ("run", run["id"]),
        ("workflow", f"{run['workflow_name']} version {run['workflow_version']}"),
        ("owner", f"{run['tenant']}/{run['principal']}"),
        ("submission key", run["idempotency_key"]),
        ("status", run["status"] + (f" ({run['outcome_code']})" if run["outcome_code"]
                                    and run["outcome_code"].lower() != run["status"] else "")),
        ("note", detail.note),
        ("queue", None if run["queue"] is None else run["queue"] + "".join(
            f", {label} {value}" for label, value in (
                ("priority", run["priority"] or None), ("key", run["concurrency_key"]))
            if value is not None)),
        ("revision", run["revision"]),
        ("deadline", run["deadline_at"]),
        ("created", run["created_at"]),
        ("finished", run["finished_at"]),
        ("pruned", None if run.get("pruned_at") is None else
         f"{cell(run['pruned_at'])} (journal, input and result deleted by retention)"),
        ("parent", run["parent_run_id"]),
        ("restarts", run.get("restarted_from")),
        ("continues", run.get("continued_from")),
        ("superseded by", None if run.get("superseded_by") is None else
         f"{run['superseded_by']} (continued as new: the run goes on there)"
         if run["outcome_code"] == "CONTINUED_AS_NEW" else
         f"{run['superseded_by']} (restarted: that run is the authoritative one)"),
    ]
    if run["result"] is not None:
        fields.append(("result", clip(json.dumps(run["result"], sort_keys=True), 200)))
    if run["error"]:
        incident = run["error"].get("incident")
        fields.append(("error", run["error"].get("message")
                       + (f" (incident {incident})" if incident else "")))
        fields.append(("cause", cause_text(run["error"].get("cause"))))
    for name, value in fields:
        if value is not None:
            print(f"{name + ':':<15} {cell(value)}")
    if detail.operations:
        print("\noperations")
        print(render(["ID", "POS", "ATTEMPT", "TOOL", "EFFECT", "STATE", "WHY", "KEY"],
                     [[o["id"], o["position"], o["attempt"],
                       f"{o['tool_name']}@{o['tool_version']}", o["effect_class"], o["state"],
                       why(o["error"]), o["idempotency_key"]] for o in detail.operations],
                     max_width=48))
    print("\ntimeline")
    if not detail.journal and run.get("pruned_at") is not None:
        print("(deleted by retention when the run was pruned; its operations above are the "
              "evidence)")
    elif not detail.journal:
        print("(no events yet)")
    else:
        unsent = never_sent(detail.journal)
        print(render(["SEQ", "AT", "POS", "EVENT", "NAME", "DETAIL"],
                     [[e["seq"], e["created_at"], e["position"], e["kind"], e["name"],
                       _summary(e["payload"], e["kind"], unsent)] for e in detail.journal],
                     max_width=100, clip_last=False))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    run_id = parse_run_id(args.run_id)

    async def load(db: Database) -> list[replay.RecordedRun]:
        async with db.connection() as conn:
            return await replay.load_runs(conn, run_id=run_id, last=1)

    found = asyncio.run(_with_db(args, load))
    if not found:
        raise AccessDenied("the run does not exist or is not accessible")
    text = json.dumps(replay.export_document(found[0]), ensure_ascii=False, sort_keys=True,
                      default=str)
    if args.output:
        with open(args.output, "w", encoding="utf-8") as out:
            out.write(text + "\n")
    else:
        print(text)
    return 0


def cmd_restart(args: argparse.Namespace) -> int:
    run_id = parse_run_id(args.run_id)
    app = load_app(args.app, args.database_url) if args.app else None
    # The new run is admitted as a submission to the application would be: under its JSON
    # limits and, for the operator, its scopes. Without --app the defaults hold, and an input
    # the application accepted under larger limits is refused with what to pass.
    limits = app.json_limits if app is not None else JsonLimits()
    tenants = (Operators(app.database, app.operator_scopes).tenants_of(args.operator)
               if app is not None else None)
    try:
        done = asyncio.run(_with_db(args, lambda db: admin.restart_run(
            db, run_id, operator=args.operator, evidence=args.evidence,
            from_position=args.from_position, limits=limits, tenants=tenants)))
    except InvalidRequest as exc:  # PAYLOAD_TOO_LARGE too
        if app is not None or not is_input_limit(exc):
            raise
        raise over_default_limits(exc, "the run's", "restart it") from None
    if args.json:
        records.emit({"run_id": str(done.run_id), "restarted_from": str(done.restarted_from),
                      "from_position": done.from_position, "carried_entries": done.carried})
        return 0
    print(f"run {done.run_id} restarts run {done.restarted_from}: it carries "
          f"{done.carried} journal entries (history before position {done.from_position} and "
          "every committed call); follow it with `orchestrator runs watch "
          f"{done.run_id}`")
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    run_id = parse_run_id(args.run_id)
    after = check_cursor(args.after)
    return int(asyncio.run(_with_db(args, lambda db: _watch(db, run_id, after, args.json))))


async def _watch(db: Database, run_id: Any, after: int, as_json: bool) -> int:
    """Print the run's entries as they come, then its outcome; the exit status. A pruned
    run's entries after ``after`` are gone: ``RUN_PRUNED``, as its stream is everywhere."""
    async with db.connection() as conn:
        found = await runs_db.run_get(conn, run_id, result=False)
    if found is None:
        raise AccessDenied("the run does not exist or is not accessible")
    check_kept(found, after)
    streams = RunStreams(db)
    headed = as_json  # JSON lines are labelled by their keys
    try:
        async for page in streams.pages(run_id, after=after, follow=True):
            lines = [json.dumps(records.watch_entry(e), ensure_ascii=False) if as_json
                     else entry_line(e) for e in page]
            if not headed and lines:
                lines.insert(0, WATCH_HEADER)
                headed = True
            print("\n".join(lines), flush=True)
    finally:
        await streams.close()
    async with db.connection() as conn:
        run = await runs_db.run_get(conn, run_id)
    if run is None:
        raise AccessDenied("the run does not exist or is not accessible")
    print(json.dumps(records.watch_outcome(run), ensure_ascii=False) if as_json
          else outcome_line(run), flush=True)
    return 0 if run["status"] == "succeeded" else EXIT_NOT_SUCCEEDED


WATCH_NAME_WIDTH = 16
"""The width ``runs watch`` pads an entry's name to, so that the details of consecutive lines
start in one column (a longer name pushes its own line's detail along)."""


WATCH_HEADER = (f"{'SEQ':>5}  {'AT':<20}  {'POS':>4}  {'EVENT':<17} "
                f"{'NAME':<{WATCH_NAME_WIDTH}}  DETAIL")
"""The labels over :func:`entry_line`'s columns, those of ``runs show``'s timeline: printed
once, above the first entry (a time is 20 characters: ``2026-01-31 12:00:00Z``)."""


def entry_line(e: dict[str, Any]) -> str:
    """One journal entry in a line, with the words of ``runs show``'s timeline."""
    return (f"{e['seq']:>5}  {cell(e['created_at'])}  {cell(e['position']):>4}  "
            f"{e['kind']:<17} {cell(e['name']):<{WATCH_NAME_WIDTH}}  "
            f"{_summary(e['payload'], e['kind'])}")


def outcome_line(run: dict[str, Any]) -> str:
    """A finished run's outcome in a line: its status, and its result or its public error."""
    head = f"run {run['id']} {run['status']}"
    if run["outcome_code"] == runs_db.CONTINUED and run.get("superseded_by") is not None:
        # No result of its own: the chain goes on (and its result comes) in that run.
        return f"{head} ({run['outcome_code']}): it continued as run {run['superseded_by']}"
    if run["status"] == "succeeded":
        return f"{head}; result {clip(json.dumps(run['result'], sort_keys=True), 200)}"
    error = run["error"] or {}
    code = run["outcome_code"] or error.get("code")
    if code and code.lower() != run["status"]:
        message = error.get("message")
        head += f": {code}" + (f": {message}" if message else "")
    if error.get("incident"):
        head += f" (incident {error['incident']})"
    cause = cause_text(error.get("cause"))
    return head + (f"; cause {cause}" if cause else "")


def cmd_cancel(args: argparse.Namespace) -> int:
    run_id = parse_run_id(args.run_id)
    if (args.operator is None) != (args.evidence is None):
        raise InvalidRequest("--operator and --evidence go together: give both to audit the "
                             "cancellation, or neither", path="operator"
                             if args.operator is None else "evidence")
    if args.operator is None and args.app is not None:
        raise InvalidRequest("--app holds an operator to their scopes: give --operator "
                             "and --evidence with it", path="app")
    who = audited_as(args, "runs cancel")  # without them: the login, and no reason given
    app = load_app(args.app, args.database_url) if args.app else None
    tenants = (Operators(app.database, app.operator_scopes).tenants_of(who["operator"])
               if app is not None else None)
    done = asyncio.run(_with_db(args, lambda db: admin.operator_cancel(
        db, run_id, tenants=tenants, **who)))
    print(_cancelled_text(run_id, done))
    return 0


def _cancelled_text(run_id: uuid.UUID, done: admin.Cancellation) -> str:
    status = done.after
    if done.before == "cancelled":
        return f"run {run_id} already finished (cancelled); nothing to cancel"
    if status in ("succeeded", "failed"):
        return f"run {run_id} already finished ({status}); nothing to cancel"
    if status == "cancelled":
        said = f"run {run_id} is cancelled"
    elif status in ("needs_reconciliation", "queued"):
        said = (f"run {run_id} is {status}: cancellation requested; it takes effect once its "
                "unsettled operations are reconciled (see `orchestrator ops list`)")
    else:
        said = f"run {run_id} is {status}: cancellation requested; it stops at its next step"
    if done.children:  # unfinished child runs, at every depth, cancelled by the same rules
        said += f", and {done.children} child run{'' if done.children == 1 else 's'} with it"
    return said
