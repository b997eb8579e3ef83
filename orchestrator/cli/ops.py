"""``orchestrator ops``: the reconciliation queue, for operators (CONTRACT C8, C9, C17).

With ``--app`` the application's operator scopes apply, and every command needs
``--operator NAME`` (a default name would be an identity nobody configured). Without ``--app``
nothing restricts the operator; ``list`` and ``show`` then act as ``operator`` unless told.
"""

from __future__ import annotations

import argparse
import json
import shlex
import textwrap
from typing import Any

from orchestrator import reconcile
from orchestrator.cli import bulk, records
from orchestrator.cli.common import json_option
from orchestrator.cli.operating import (
    described,
    filter_of,
    filters,
    operator_options,
    receipt_of,
    then_of,
    then_option,
    with_operators,
)
from orchestrator.cli.options import MAX_LIMIT, one_of, whole
from orchestrator.cli.tables import cell, render
from orchestrator.db.schema import TERMINAL_STATUSES
from orchestrator.errors import InvalidRequest
from orchestrator.operators import (
    AUDIT_TARGET_KINDS,
    ITEM_STATES,
    UNRESOLVED,
    parse_operation_id,
)
from orchestrator.records import why

AUDIT_LIMIT = 50  # rows of `ops audit` unless --limit says otherwise


def register(subparsers: Any) -> None:
    group = subparsers.add_parser("ops", help="operations whose outcome is unknown")
    commands = group.add_subparsers(title="ops commands", metavar="COMMAND")
    group.set_defaults(func=None, help_parser=group)

    ls = commands.add_parser("list", help="the queue, oldest first")
    states = (*ITEM_STATES, UNRESOLVED, "all")
    ls.add_argument("--state", choices=states, type=one_of("--state", states),
                    default=UNRESOLVED,
                    help="open: lookups still to try; operator: waits for a person; "
                         "resolved: settled (by a lookup or an operator); unresolved (the "
                         "default): open or operator; all: every item")
    filters(ls)
    ls.add_argument("--limit", type=whole("--limit", low=1, high=MAX_LIMIT), default=100,
                    help=f"at most this many rows (1 to {MAX_LIMIT})")
    operator_options(ls, operator_required=False)
    json_option(ls)
    ls.set_defaults(func=cmd_list)

    show = commands.add_parser("show", help="a queued operation (or one whose call is still "
                                            "under way: what to wait for): intent, arguments, "
                                            "attempts, lookups, timeline (`runs show` lists "
                                            "every operation of a run)")
    show.add_argument("operation_id")  # parse_operation_id: refused as the console does
    operator_options(show, operator_required=False)
    json_option(show)
    show.set_defaults(func=cmd_show)

    res = commands.add_parser("resolve", help="record what happened, with evidence")
    res.add_argument("operation_id")  # parse_operation_id: refused as the console does
    kind = res.add_mutually_exclusive_group(required=True)
    kind.add_argument("--committed", action="store_true", help="the effect was applied")
    kind.add_argument("--not-applied", action="store_true", help="nothing was applied")
    res.add_argument("--receipt", metavar="JSON", help="with --committed: the receipt")
    then_option(res)
    res.add_argument("--evidence", required=True, metavar="TEXT")
    operator_options(res, operator_required=True)
    json_option(res)
    res.set_defaults(func=cmd_resolve)

    abandon = commands.add_parser("abandon", help="give up: the run fails OPERATION_ABANDONED")
    abandon.add_argument("operation_id")  # parse_operation_id: refused as the console does
    abandon.add_argument("--evidence", required=True, metavar="TEXT")
    operator_options(abandon, operator_required=True)
    json_option(abandon)
    abandon.set_defaults(func=cmd_abandon)

    bulk.register(commands)

    audit = commands.add_parser(
        "audit", help="the operator audit log, newest first: who did what, when and why",
        description="Every operator action (resolutions, cancellations, restarts, queue and "
                    "schedule changes) with who acted, when, the evidence given and the target "
                    "before and after, newest first, within the operator's tenants (--app, "
                    "--operator): the console's audit log.")
    audit.add_argument("--by", metavar="NAME", help="the operator who acted")
    audit.add_argument("--action", help="an action and those under it: `resolve` matches "
                                        "`resolve.committed`, `schedule` every schedule's")
    audit.add_argument("--target", metavar="ID", help="the target's id: an operation's, a "
                                                      "run's, a queue's or a schedule's")
    audit.add_argument("--kind", metavar="KIND",
                       help=f"the target's kind: {', '.join(AUDIT_TARGET_KINDS)} (with "
                            "--target, the one target of that kind and id)")
    audit.add_argument("--before", metavar="CURSOR",
                       help="the next page: the cursor the page before printed")
    audit.add_argument("--limit", type=whole("--limit", low=1, high=MAX_LIMIT),
                       default=AUDIT_LIMIT, help=f"at most this many rows (1 to {MAX_LIMIT})")
    operator_options(audit, operator_required=False)
    json_option(audit)
    audit.set_defaults(func=cmd_audit)


# What the ITEM column's waiting states mean, and the next command: under a list that has one.
ITEMS_NOTE = ("ITEM open: it waits for a running `orchestrator reconciler` to ask the tool's "
              "lookup (a tool without one goes to operators); operator: it waits for a person. "
              "Either may be resolved by hand: `orchestrator ops show OP` shows one and the "
              "commands that settle it")


def cmd_list(args: argparse.Namespace) -> int:
    state = None if args.state == "all" else args.state
    where = filter_of(args)
    items = with_operators(args, lambda ops, operator: ops.list_items(
        operator=operator, state=state, limit=args.limit, **where))
    if args.json:
        records.emit({"items": [records.queue_item(i) for i in items], "count": len(items),
                      "limit": args.limit})
        return 0
    if not items:
        given = described(args)
        print(f"no operations match {given}" if given else
              "nothing waits in the reconciliation queue (--state all lists settled items too)")
        return 0
    print(render(["OP", "RUN", "TOOL", "ITEM", "OPERATION", "REASON", "LOOKUPS", "OWNER",
                  "SINCE"],
                 [[i["operation_id"], i["run_id"], i["tool_name"], i["item_state"],
                   i["operation_state"], i["reason"], i["lookup_attempts"],
                   f"{i['tenant']}/{i['principal']}", i["created_at"]] for i in items]))
    if len(items) == args.limit:
        print(f"(the first {args.limit}, oldest first: there may be more; see --limit)")
    if any(i["item_state"] != "resolved" for i in items):
        print(textwrap.fill(f"({ITEMS_NOTE})", 100, break_on_hyphens=False))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    op = parse_operation_id(args.operation_id)
    d = with_operators(args, lambda ops, operator: ops.show(op, operator=operator))
    if args.json:
        records.emit(records.item_detail(d))
        return 0
    fields = [
        ("operation", d["operation_id"]),
        ("tool", f"{d['tool_name']} version {d['tool_version']} ({d['effect_class']})"),
        ("owner", f"{d['tenant']}/{d['principal']}"),
        ("run", f"{d['run_id']} ({d['run_status']}"
                + ("; its cancellation was requested: once this operation is resolved as "
                   "committed or not applied, and no other unknown operation of the run "
                   "remains, it ends cancelled and nothing is sent again; abandoning it fails "
                   "the run with OPERATION_ABANDONED"
                   if d["run_cancel_requested"] and d["run_status"] not in TERMINAL_STATUSES
                   else _ENDED if d["run_status"] in TERMINAL_STATUSES
                   and d["item_state"] not in (None, "resolved")
                   else "") + ")"),
        ("state", f"operation {d['operation_state']}; "
                  + (f"queue item {d['item_state']}" if d["item_state"] is not None
                     else "not in the reconciliation queue")
                  + (f", resolved as {d['resolution']}" if d["resolution"] else "")
                  + (_follows(d["then"]) if d["resolution"] == "not_applied" else "")),
        ("reason", d["reason"]),
        *([("lookups", f"{d['lookup_attempts']} so far; the next is due at "
                       f"{cell(d['next_attempt_at'])}, made by a running `orchestrator "
                       "reconciler --app MODULE:ATTR` (nothing asks the lookup while none "
                       "runs; a tool without one goes to operators)")]
          if d["item_state"] == "open" and d["next_attempt_at"] is not None else []),
        ("intent", d["intent_digest"]),
        ("key", d["idempotency_key"]),
        ("arguments", json.dumps(d["arguments"], sort_keys=True)),
        ("submitted", d["submitted_at"]),
    ]
    if d["receipt"] is not None:
        fields.append(("receipt", json.dumps(d["receipt"], sort_keys=True)))
    for name, value in fields:
        print(f"{name + ':':<11} {cell(value)}")
    print("\nattempts at this position")
    print(render(["OP", "ATTEMPT", "STATE", "WHY", "KEY", "WORKER", "SUBMITTED"],
                 [[a["id"], a["attempt"], a["state"], why(a["error"]),
                   a["idempotency_key"], a["worker_id"], a["submitted_at"]]
                  for a in d["attempts"]], max_width=44))
    if d["incidents"]:
        print("\nincidents (what went wrong, for `orchestrator incidents show REF --operator "
              "NAME`)")
        print(render(["REF", "OP", "PHASE", "CAUSE", "AT"],
                     [[i["ref"], i["operation_id"], i["phase"], i["cause"], i["created_at"]]
                      for i in d["incidents"]]))
    _lookups(d)
    if d["evidence"]:
        print("\nevidence")
        for e in d["evidence"]:
            line = json.dumps(e, sort_keys=True)
            print("  " + (line if len(line) <= EVIDENCE_SHOWN else
                          line[:EVIDENCE_SHOWN] + "… (cut: `ops show --json` gives it whole)"))
    if d["audit"]:
        print("\naudit")
        print(render(["AT", "OPERATOR", "ACTION", "THEN", "RECEIPT", "EVIDENCE"],
                     [[a["created_at"], a["operator"], a["action"], _then_cell(a),
                       _receipt_cell(a), a["evidence"]] for a in d["audit"]]))
    print("\nrun timeline")
    print(render(["SEQ", "AT", "POS", "EVENT", "NAME"],
                 [[e["seq"], e["created_at"], e["position"], e["kind"], e["name"]]
                  for e in d["journal"]]))
    if d["wait"] is not None:  # a call still under way: nothing to settle yet
        print(f"\nwait: {d['wait']}")
    elif d["item_state"] != "resolved":
        op = d["operation_id"]
        print(f"\nnext: orchestrator ops resolve {op} --committed --receipt JSON --evidence TEXT"
              f" --operator NAME\n      orchestrator ops resolve {op} --not-applied "
              f"[--then resend|fail] --evidence TEXT --operator NAME\n      orchestrator ops "
              f"abandon {op} --evidence TEXT --operator NAME")
    return 0


EVIDENCE_SHOWN = 200
"""Characters of each piece of kept evidence the table shows; a longer one is cut, and says
so (a receipt copied from it would be incomplete)."""

_ENDED = ("; it has ended: resolving this operation only records what became of its call "
          "(nothing is sent again or failed, the run stays as it ended)")
"""Said of the run of a queued operation that ended meanwhile (its deadline passed, it was
cancelled): ``--then`` and abandoning have nothing left to act on."""

_WHY_NO_REASONS = {
    "withheld": "reading them needs the incident-reader grant",
    "unreadable": "this database role may read only the incidents' summary",
}


def _lookups(d: dict[str, Any]) -> None:
    """The lookup history: answer, attempt and time for everyone; what each lookup said
    (tool text, kept in its incident) only for an incident reader, in full."""
    print("\nlookups (what a lookup said is kept in its incident)")
    if not d["lookups"]:
        print("(none)")
        return
    print(render(["#", "ANSWER", "REASON", "INCIDENT", "AT"],
                 [[x["attempt"], x["answer"], _reason_cell(x, d["reasons"]),
                   x["incident"] or "", x["created_at"]] for x in d["lookups"]]))
    said = [x for x in d["lookups"] if x["reason"] is not None]
    for x in said:
        print(f"  #{x['attempt']} said: {x['reason']}")
    if d["reasons"] in _WHY_NO_REASONS and any(x["has_reason"] for x in d["lookups"]):
        print(f"  (the reasons stay in their incidents: {_WHY_NO_REASONS[d['reasons']]})")


def _reason_cell(x: dict[str, Any], reasons: str) -> str:
    if not x["has_reason"]:
        return "(none)"
    if x["reason"] is not None:
        return f"see #{x['attempt']} below"
    return "(kept in the incident)" if reasons == "shown" else f"({reasons})"


NEXT = {"resend": "; the run was woken and sends the call again as a new attempt",
        "fail": "; the run was woken and the call fails with TOOL_FAILED in the workflow",
        None: "; the run was woken"}


def _emitted(op_id: int, resolution: str, then: str | None, done: reconcile.Resolved) -> int:
    """``ops resolve --json`` / ``ops abandon --json``: what came of one resolution, in the
    words of ``resolve-many --json``'s items (``then``, ``waits_for``)."""
    step = reconcile.next_step(resolution, then, done)
    records.emit({"operation_id": str(op_id), "resolution": resolution,
                  "outcome": done.outcome, "then": step,
                  "waits_for": [str(op) for op in done.waits_for] if step == "waits" else []})
    return 0


def _report(op_id: int, done: reconcile.Resolved, what: str, then: str | None = None) -> int:
    outcome, others = done.outcome, list(done.waits_for)
    status, cancel_requested = done.run_status or "", done.cancel_requested
    if outcome == "noop":
        print(f"operation {op_id} was already resolved as {what}; nothing changed")
    elif status in TERMINAL_STATUSES:  # an ended run is not woken: only the ledger changes
        print(f"operation {op_id} resolved as {what}; its run had already ended ({status}), "
              "so only the ledger changed" + (" (nothing is sent again)" if then else ""))
    elif others:  # the run resumes once every unknown outcome of it is settled
        ops = ", ".join(str(op) for op in others)
        print(f"operation {op_id} resolved as {what}; its run still waits for operation "
              f"{ops} to be settled (`orchestrator ops show {others[0]}`)")
    elif cancel_requested:  # the woken run ends cancelled: no re-send, no failure in it
        print(f"operation {op_id} resolved as {what}; its run was woken and ends cancelled, "
              "as was requested" + (" (nothing is sent again)" if then else ""))
    else:
        print(f"operation {op_id} resolved as {what}{NEXT[then]}")
    return 0


def cmd_resolve(args: argparse.Namespace) -> int:
    receipt = receipt_of(args)
    then_of(args)
    op = parse_operation_id(args.operation_id)
    if args.committed:
        done = with_operators(args, lambda ops, operator: ops.resolve(
            op, "committed", receipt=receipt, evidence=args.evidence, operator=operator))
        if args.json:
            return _emitted(op, "committed", None, done)
        return _report(op, done, "committed")
    then = then_of(args)
    assert then is not None
    done = with_operators(args, lambda ops, operator: ops.resolve(
        op, "not_applied", evidence=args.evidence, operator=operator, then=then))
    if args.json:
        return _emitted(op, "not_applied", then, done)
    return _report(op, done, "not applied", then)


def cmd_abandon(args: argparse.Namespace) -> int:
    op = parse_operation_id(args.operation_id)
    done = with_operators(args, lambda ops, operator: ops.resolve(
        op, "abandoned", evidence=args.evidence, operator=operator))
    if args.json:
        return _emitted(op, "abandoned", None, done)
    outcome, status = done.outcome, done.run_status or ""
    if outcome == "noop":
        print(f"operation {op} was already abandoned; nothing changed")
    elif status in TERMINAL_STATUSES:  # an ended run keeps its outcome: only the ledger changes
        print(f"operation {op} abandoned; its run had already ended ({status}), so only the "
              "ledger changed")
    else:
        print(f"operation {op} abandoned; its run failed with OPERATION_ABANDONED")
    return 0


FOLLOWS = {"resend": "with --then resend (the run to send the call again as a new attempt)",
           "fail": "with --then fail (the run to fail the call with TOOL_FAILED in the "
                   "workflow)",
           None: "with no --then (a lookup's answer: an attempt the engine lost is sent "
                 "again outside the retry budget, up to max_engine_resends; otherwise the "
                 "tool's retry policy decides)"}
"""What a not applied resolution chose to follow (``then``), in ``ops show``'s state line: a
choice, which a run that had ended or whose cancellation was requested does not carry out."""

THEN_CELLS = {"resend": "send again", "fail": "fail the call"}
"""An audit row's THEN cell, by the ``then`` its not applied resolution chose."""


def _follows(then: str | None) -> str:
    return " " + FOLLOWS.get(then, f"with --then {then}")


def _then_cell(row: dict[str, Any]) -> str | None:
    """An audit row's THEN cell: what an operator's not applied resolution chose to follow
    (``after.then``: the call sent again, or failed in the workflow), else None (``-``)."""
    after = row["after"]
    then = after.get("then") if isinstance(after, dict) else None
    return THEN_CELLS.get(then, then) if isinstance(then, str) else None


def _receipt_cell(row: dict[str, Any]) -> str | None:
    """An audit row's RECEIPT cell: the first 16 hex digits of the digest of the receipt a
    committed resolution recorded (``after.receipt_digest``; ``--json`` has all of it), else
    None (``-``)."""
    after = row["after"]
    digest = after.get("receipt_digest") if isinstance(after, dict) else None
    return digest[:16] if isinstance(digest, str) else None


def cmd_audit(args: argparse.Namespace) -> int:
    """The audit log, newest first; the next page's cursor when there is one."""
    if args.before is not None and not args.before.strip().isdigit():
        raise InvalidRequest(f"--before {args.before!r}: give the cursor a page printed "
                             "(`next`)", path="before")
    rows, following = with_operators(args, lambda ops, operator: ops.audit_log(
        operator=operator, by=args.by, action=args.action, target=args.target,
        kind=args.kind, before=args.before, limit=args.limit))
    if args.json:
        records.emit({"audit": [records.audit_row(a) for a in rows], "count": len(rows),
                      "limit": args.limit, "next": following})
        return 0
    if not rows:
        print("no audit rows match" if (args.by or args.action or args.target or args.kind
                                        or args.before)
              else "the audit log is empty")
        return 0
    print(render(["AT", "OPERATOR", "ACTION", "THEN", "TARGET", "TENANT", "RECEIPT",
                  "EVIDENCE"],
                 [[a["created_at"], a["operator"], a["action"], _then_cell(a),
                   f"{a['target_kind']} {a['target_id']}", a["tenant"] or "-", _receipt_cell(a),
                   a["evidence"]] for a in rows]))
    if following is not None:
        print(f"(more: {_next_page(args, following)})")
    return 0


def _next_page(args: argparse.Namespace, cursor: str) -> str:
    """The command that prints the next page of the same selection: the filters, scopes and
    limit given, and ``--before`` the page's cursor (ready to copy)."""
    given = [(option, getattr(args, name)) for option, name in (
        ("--by", "by"), ("--action", "action"), ("--target", "target"), ("--kind", "kind"),
        ("--app", "app"), ("--operator", "operator"))]
    if args.limit != AUDIT_LIMIT:
        given.append(("--limit", str(args.limit)))
    words = [f"{option} {shlex.quote(value)}" for option, value in given if value is not None]
    return " ".join(["orchestrator ops audit", *words, f"--before {cursor}"])
