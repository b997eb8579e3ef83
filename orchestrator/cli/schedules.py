"""``orchestrator schedules list|show|pause|resume|trigger|backfill|delete``: the stored
schedules.

No application code is needed: a schedule names its workflow and version, and firing one
submits a run of it (docs/schedules.md). Times print in UTC; ``show`` also gives each slot in
the schedule's own time zone.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar
from zoneinfo import ZoneInfo

from orchestrator.admin import unserved
from orchestrator.canonical import JsonLimits
from orchestrator.cli import records
from orchestrator.cli.common import (
    audit_options,
    audited_as,
    database_target,
    is_input_limit,
    json_option,
    over_default_limits,
    parse_time,
)
from orchestrator.cli.options import one_of, whole
from orchestrator.cli.tables import render
from orchestrator.cli.worker import load_app
from orchestrator.db.database import Database
from orchestrator.errors import InvalidRequest
from orchestrator.metrics import Metrics
from orchestrator.records import ident, iso
from orchestrator.scheduler import ScheduleAdmin, ScheduleDetail, ScheduleInfo
from orchestrator.schedules import OVERLAP_POLICIES

T = TypeVar("T")
MAX_RECENT = 1000
"""The most handled slots ``schedules show --recent`` lists."""


def register(subparsers: Any) -> None:
    group = subparsers.add_parser("schedules", help="cron schedules that fire runs")
    commands = group.add_subparsers(title="schedules commands", metavar="COMMAND")
    group.set_defaults(func=None, help_parser=group)
    listing = commands.add_parser("list", help="every schedule, its next and last slot")
    json_option(listing)
    listing.set_defaults(func=cmd_list)
    show = commands.add_parser("show", help="a schedule: its next slots, its recent slots "
                                            "and their runs, what it missed")
    show.add_argument("id")
    show.add_argument("--recent", type=whole("--recent", low=0, high=MAX_RECENT), default=20,
                      help=f"slots to show (0 to {MAX_RECENT}; default 20)")
    json_option(show)
    show.set_defaults(func=cmd_show)
    for name, about in (("pause", "fire nothing until resumed (buffered slots wait)"),
                        ("resume", "fire again from the next slot; what passed meanwhile is "
                                   "recorded as one gap")):
        cmd = commands.add_parser(name, help=about)
        cmd.add_argument("id")
        audit_options(cmd, f"{name}s it")
        json_option(cmd)
        cmd.set_defaults(func=cmd_pause if name == "pause" else cmd_resume)
    trigger = commands.add_parser("trigger", help="fire a run now, under the overlap policy")
    trigger.add_argument("id")
    trigger.add_argument("--overlap", choices=OVERLAP_POLICIES,
                         type=one_of("--overlap", OVERLAP_POLICIES), default=None,
                         help="instead of the schedule's own policy")
    trigger.add_argument("--idempotency-key", metavar="KEY", default=None,
                         help="sent again with this key, the trigger answers with what became "
                              "of the first and fires nothing")
    _app_option(trigger)
    audit_options(trigger, "fires it")
    json_option(trigger)
    trigger.set_defaults(func=cmd_trigger)
    backfill = commands.add_parser("backfill", help="fire the slots of a past range")
    backfill.add_argument("id")
    backfill.add_argument("--from", dest="start", required=True, metavar="T",
                          help="ISO 8601 time with its offset, e.g. 2026-12-01T00:00:00Z")
    backfill.add_argument("--to", dest="end", required=True, metavar="T",
                          help="ISO 8601 time with its offset (not later than now)")
    backfill.add_argument("--overlap", choices=OVERLAP_POLICIES,
                          type=one_of("--overlap", OVERLAP_POLICIES), default="allow_all",
                          help="the backfill's own overlap policy (default allow_all)")
    _app_option(backfill)
    audit_options(backfill, "fires the slots")
    json_option(backfill)
    backfill.set_defaults(func=cmd_backfill)
    delete = commands.add_parser(
        "delete", help="delete a schedule (its slot records with it; its runs stay)",
        description="Delete a schedule made at run time, or one declared in code "
        "(@app.schedule) that the code deployed now no longer declares: give that code with "
        "--app, which refuses a schedule it still declares (remove it there; pause it "
        "meanwhile). Without --app a schedule declared in code is refused.")
    delete.add_argument("id")
    delete.add_argument("--app", default=None, metavar="MODULE:ATTR",
                        help="the application as deployed now: a schedule declared in code is "
                        "deleted only when this code no longer declares it")
    audit_options(delete, "deletes it")
    json_option(delete)
    delete.set_defaults(func=cmd_delete)


def _app_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--app", default=None, metavar="MODULE:ATTR",
                        help="the application: its JSON limits hold the input of the runs "
                        "fired, as its workers' ticker does (default: the default limits)")


def _admin(args: argparse.Namespace, act: Callable[[ScheduleAdmin], Awaitable[T]]) -> T:
    app = load_app(args.app, args.database_url) if getattr(args, "app", None) else None

    async def main() -> T:
        db = Database(database_target(args))
        try:
            limits = app.json_limits if app is not None else JsonLimits()
            workflows = app.registry.workflows if app is not None else None
            declared = app.schedules.admin.declared_here if app is not None else None
            return await act(ScheduleAdmin(db, limits, Metrics(), workflows=workflows,
                                           declared_here=declared))
        finally:
            await db.close()

    try:
        return asyncio.run(main())
    except InvalidRequest as exc:  # PAYLOAD_TOO_LARGE too
        if app is not None or not is_input_limit(exc):
            raise
        raise over_default_limits(exc, "the schedule's", "fire it") from None


def record(info: ScheduleInfo) -> dict[str, Any]:
    return {"id": info.id, "workflow": info.workflow, "version": info.version,
            "cron": info.cron, "timezone": info.timezone, "overlap": info.overlap,
            "catchup_window_seconds": info.catchup_window.total_seconds(),
            "input": info.input, "tenant": info.owner.tenant,
            "principal": info.owner.principal, "declared": info.declared,
            "paused": info.paused, "next_slot": iso(info.next_slot),
            "last_slot": iso(info.last_slot), "last_run_id": ident(info.last_run_id),
            "buffered": info.buffered, "queue": info.queue}


def _state(info: ScheduleInfo) -> str:
    return "paused" if info.paused else "active"


def blocked(info: ScheduleInfo, served: frozenset[str]) -> str | None:
    """Why the runs the schedule fires do not start, as ``runs list`` says it of each: no
    live worker registers its workflow version (None: one does)."""
    return unserved(info.workflow, info.version, served)


def cmd_list(args: argparse.Namespace) -> int:
    async def read(admin: ScheduleAdmin) -> tuple[list[ScheduleInfo], frozenset[str]]:
        return await admin.list(), await admin.served()

    shown, served = _admin(args, read)
    if args.json:
        records.emit({"schedules": [{**record(s), "blocked": blocked(s, served)}
                                    for s in shown], "count": len(shown)})
        return 0
    if not shown:
        print("no schedules")
        return 0
    print(render(["SCHEDULE", "WORKFLOW", "CRON", "TIMEZONE", "OVERLAP", "STATE", "NEXT SLOT",
                  "LAST SLOT", "BUFFERED"],
                 [[s.id, f"{s.workflow}@{s.version}", s.cron, s.timezone, s.overlap,
                   "; ".join(filter(None, (_state(s), blocked(s, served)))),
                   s.next_slot, s.last_slot, s.buffered] for s in shown]))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    async def read(admin: ScheduleAdmin) -> tuple[ScheduleDetail, frozenset[str]]:
        return await admin.show(args.id, recent=args.recent), await admin.served()

    detail, served = _admin(args, read)
    info = detail.info
    unserved = blocked(info, served)
    if args.json:
        records.emit({**record(info), "blocked": unserved,
                      "upcoming": [iso(t) for t in detail.upcoming],
                      "recent": [{"slot": iso(r["slot"]), "kind": r["kind"],
                                  "state": r["state"], "reason": r["reason"],
                                  "overlap": r["overlap"], "run_id": ident(r["run_id"]),
                                  "run_status": r["run_status"]} for r in detail.recent],
                      "gaps": [{"first_slot": iso(g["first_slot"]),
                                "last_slot": iso(g["last_slot"]), "reason": g["reason"]}
                               for g in detail.gaps]})
        return 0
    zone = ZoneInfo(info.timezone)
    print(f"schedule {info.id}: {info.workflow}@{info.version}, cron '{info.cron}' in "
          f"{info.timezone}, overlap {info.overlap}, catch-up "
          f"{info.catchup_window.total_seconds():.0f} s, {_state(info)}"
          + (" (declared in code)" if info.declared else ""))
    print(f"runs as {info.owner.tenant}/{info.owner.principal} in "
          + (f"queue {info.queue}" if info.queue is not None else "the default queue")
          + f"; buffered slots: {info.buffered}")
    if unserved is not None:
        print(f"{unserved}: its runs wait, queued, until a worker that has workflow "
              f"{info.workflow} version {info.version} starts (`orchestrator runs list "
              f"--workflow {info.workflow}` shows them)")
    if detail.upcoming:
        print("next slots: " + ", ".join(
            f"{iso(t)} ({t.astimezone(zone):%Y-%m-%d %H:%M:%S %Z})" for t in detail.upcoming))
    elif info.paused:
        print("next slots: none while paused (`orchestrator schedules resume` fires again)")
    else:
        print("next slots: none (the expression does not fire again)")
    if detail.recent:
        print(render(["SLOT", "KIND", "STATE", "REASON", "RUN", "RUN STATUS"],
                     [[r["slot"], r["kind"], r["state"], r["reason"], r["run_id"],
                       r["run_status"]] for r in detail.recent]))
    else:
        print("no slots handled yet")
    for gap in detail.gaps:
        print(f"{gap['reason']}: the slots from {iso(gap['first_slot'])} to "
              f"{iso(gap['last_slot'])}")
    return 0


def _changed(args: argparse.Namespace, paused: bool) -> int:
    who = audited_as(args, f"schedules {'pause' if paused else 'resume'}")
    info = _admin(args, lambda admin: admin.set_paused(args.id, paused, **who))
    if args.json:
        records.emit(record(info))
    else:
        print(f"schedule {info.id} {'paused' if paused else 'resumed'}"
              + ("" if paused else f"; next slot {iso(info.next_slot)}"))
    return 0


def cmd_pause(args: argparse.Namespace) -> int:
    return _changed(args, True)


def cmd_resume(args: argparse.Namespace) -> int:
    return _changed(args, False)


def cmd_trigger(args: argparse.Namespace) -> int:
    who = audited_as(args, "schedules trigger")
    said = _admin(args, lambda admin: admin.trigger(args.id, overlap=args.overlap,
                                                    idempotency_key=args.idempotency_key,
                                                    **who))
    if args.json:
        records.emit({**said, "slot": iso(said["slot"]), "run_id": ident(said["run_id"])})
    elif said["repeated"]:
        what = (f"run {said['run_id']}" if said["state"] == "fired"
                else f"the trigger was {said['state']}")
        print(f"schedule {args.id}: already triggered with this key: {what}; nothing fired "
              "again")
    elif said["state"] == "fired":
        print(f"schedule {args.id} fired: run {said['run_id']}")
    else:
        print(f"schedule {args.id}: the trigger was {said['state']} (its previous run has not "
              "finished; --overlap allow_all fires anyway)")
    return 0


def cmd_backfill(args: argparse.Namespace) -> int:
    start, end = parse_time(args.start, "from"), parse_time(args.end, "to")
    who = audited_as(args, "schedules backfill")
    said = _admin(args, lambda admin: admin.backfill(args.id, start, end,
                                                     overlap=args.overlap,
                                                     given_as=("--from", "--to"), **who))
    if args.json:
        records.emit({"schedule": args.id, "slots": [
            {"slot": iso(s["slot"]), "state": s["state"]} for s in said],
            "count": len(said)})
        return 0
    counts: dict[str, int] = {}
    for s in said:
        counts[s["state"]] = counts.get(s["state"], 0) + 1
    summary = ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "no slots"
    print(f"schedule {args.id}: {len(said)} slots from {iso(start)} to {iso(end)}: {summary}"
          + (" (known: handled before, left as they were)" if "known" in counts else ""))
    return 0


def cmd_delete(args: argparse.Namespace) -> int:
    who = audited_as(args, "schedules delete")
    info = _admin(args, lambda admin: admin.delete(args.id, **who))
    if args.json:
        records.emit(record(info))
    else:
        print(f"schedule {info.id} deleted ({info.workflow}@{info.version}, cron "
              f"'{info.cron}' in {info.timezone}); its slot records went with it, its runs "
              "stay")
    return 0
