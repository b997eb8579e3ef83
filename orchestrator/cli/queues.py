"""``orchestrator queues list|show|pause|resume|set|reset``: the stored queues (docs/flow.md).

No application code is needed: a queue is stored once a worker of an app that declares it has
started, and its limits are enforced by the claim in the database, so a change here is in
force at the next claim of every worker. A change (``pause``, ``resume``, ``set``, ``reset``)
is audited (``queue.pause`` …) as the console's is, naming ``--operator`` (default: the login
name) and ``--evidence`` (default: a text saying none was given): both go through
:meth:`~orchestrator.queues.QueueAdmin.change`.
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any, TypeVar

from orchestrator.cli import records
from orchestrator.cli.common import database_target, json_option, login_name
from orchestrator.cli.options import one_of, whole_or_none
from orchestrator.cli.tables import render
from orchestrator.db.database import Database
from orchestrator.flow import RateLimit
from orchestrator.queues import QueueAdmin, QueueInfo, queue_record

T = TypeVar("T")
SWITCH = ("on", "off")
SETTINGS = (("concurrency", ("concurrency",)), ("worker concurrency", ("worker_concurrency",)),
            ("key concurrency", ("key_concurrency",)), ("rate", ("rate_limit", "rate_seconds")),
            ("priority", ("priority",)), ("priority aging", ("priority_aging_seconds",)),
            ("count parked", ("count_parked",)))
"""Each setting as ``queues set`` takes it, and the stored columns (``overridden``,
``declared``) it is kept in."""


def register(subparsers: Any) -> None:
    group = subparsers.add_parser("queues", help="queues and their limits")
    commands = group.add_subparsers(title="queues commands", metavar="COMMAND")
    group.set_defaults(func=None, help_parser=group)
    listing = commands.add_parser("list", help="every queue: its limits and what it holds")
    json_option(listing)
    listing.set_defaults(func=cmd_list)
    show = commands.add_parser("show", help="a queue: its limits, slots, rate window, keys")
    show.add_argument("name")
    json_option(show)
    show.set_defaults(func=cmd_show)
    for name, about in (("pause", "start nothing new from the queue (running runs go on)"),
                        ("resume", "start runs from the queue again")):
        cmd = commands.add_parser(name, help=about)
        cmd.add_argument("name")
        _audited(cmd)
        json_option(cmd)
        cmd.set_defaults(func=cmd_pause if name == "pause" else cmd_resume, queue_action=name)
    change = commands.add_parser(
        "set", help="change limits at run time (kept until `queues reset`)",
        description="Change a queue's limits at run time. A number sets a limit; 'none' "
        "removes it. The change is in force at every worker's next claim and is kept when "
        "workers start again with other declarations, until `orchestrator queues reset`.")
    change.add_argument("name")
    for option in ("concurrency", "worker-concurrency", "key-concurrency"):
        change.add_argument(f"--{option}", metavar="N|none",
                            type=whole_or_none(f"--{option}", low=1))
    change.add_argument("--rate", metavar="COUNT/UNIT|none",
                        help="e.g. 100/s, 10/5s, 600/min, 5000/day")
    for switch in ("--priority", "--count-parked"):
        change.add_argument(switch, choices=SWITCH, type=one_of(switch, SWITCH))
    _audited(change)
    json_option(change)
    change.set_defaults(func=cmd_set, queue_action="set")
    reset = commands.add_parser("reset", help="drop the limits set at run time: the code's "
                                              "declaration is in force again")
    reset.add_argument("name")
    _audited(reset)
    json_option(reset)
    reset.set_defaults(func=cmd_reset, queue_action="reset")


def _audited(cmd: argparse.ArgumentParser) -> None:
    # Optional, so that scripts written before the audit keep working: the row then names
    # the login that ran the command and says that no reason was given.
    cmd.add_argument("--operator", metavar="NAME",
                     help="who changes the queue (audited; default: your login name)")
    cmd.add_argument("--evidence", metavar="TEXT",
                     help="why (kept in the audit row; default: says none was given)")


def _admin(args: argparse.Namespace, act: Callable[[QueueAdmin], Awaitable[T]]) -> T:
    async def main() -> T:
        db = Database(database_target(args), max_pool_size=2)
        try:
            return await act(QueueAdmin(db))
        finally:
            await db.close()

    return asyncio.run(main())


record = queue_record


def _who(args: argparse.Namespace) -> dict[str, str]:
    """The audit row's operator and evidence: as given, else the login name and a text that
    says no reason was given (a blank one given is refused, as the console refuses it)."""
    operator = args.operator if args.operator is not None else login_name()
    evidence = (args.evidence if args.evidence is not None
                else f"none given (orchestrator queues {args.queue_action})")
    return {"operator": operator, "evidence": evidence}


def _limit(value: int | None) -> str:
    return "-" if value is None else str(value)


def _rate(info: QueueInfo) -> str:
    return "-" if info.rate is None else str(info.rate)


def cmd_list(args: argparse.Namespace) -> int:
    shown = _admin(args, lambda admin: admin.list())
    if args.json:
        records.emit({"queues": [record(q) for q in shown], "count": len(shown)})
        return 0
    if not shown:
        print("no queues (a queue is stored once a worker of an app that declares it starts)")
        return 0
    print(render(["QUEUE", "STATE", "CONCURRENCY", "PER WORKER", "PER KEY", "RATE", "HELD",
                  "READY", "OLDEST READY"],
                 [[q.name, "paused" if q.paused else "active", _limit(q.concurrency),
                   _limit(q.worker_concurrency), _limit(q.key_concurrency), _rate(q), q.held,
                   q.ready, "-" if q.oldest_seconds is None else f"{q.oldest_seconds:.1f} s"]
                  for q in shown]))
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    info = _admin(args, lambda admin: admin.get(args.name, keys=20))
    if args.json:
        records.emit(record(info))
        return 0
    set_here = (f" (set at run time: {_set_at_run_time(info)}; `orchestrator queues "
                f"reset {info.name}` returns to the code's)" if info.overridden else "")
    print(f"queue {info.name}: {'paused' if info.paused else 'active'}{set_here}")
    held = f"{info.held}" + (f" of {info.concurrency}" if info.concurrency else " (no limit)")
    print(f"slots held:     {held}; parked runs "
          f"{'hold' if info.count_parked else 'free'} their slot")
    print(f"running:        {info.running}"
          + (f" (at most {info.worker_concurrency} per worker)"
             if info.worker_concurrency else ""))
    print(f"ready:          {info.ready}" + (
        f", the oldest for {info.oldest_seconds:.1f} s" if info.oldest_seconds else ""))
    if info.rate is not None:
        print(f"rate:           {info.recent_starts} starts in the last "
              f"{info.rate.per.total_seconds():g} s, limit {info.rate.limit}")
    if info.priority:
        print(f"priority:       lower first; a waiting run gains a level every "
              f"{info.priority_aging.total_seconds():g} s")
    if info.key_concurrency is not None:
        print(f"per key:        at most {info.key_concurrency} started, in submission order "
              "(a key is its tenant's)")
        if info.keys:
            print(render(["TENANT", "KEY", "HELD", "WAITING"],
                         [[k["tenant"], k["key"], k["held"], k["waiting"]] for k in info.keys]))
    return 0


def _set_at_run_time(info: QueueInfo) -> str:
    """The settings changed at run time, each as ``queues set`` takes it with the code's
    value beside it: ``concurrency 8, the code's 4; rate 2/s, the code's none``."""
    now = {"concurrency": info.concurrency, "worker_concurrency": info.worker_concurrency,
           "key_concurrency": info.key_concurrency, "priority": info.priority,
           "count_parked": info.count_parked,
           "priority_aging_seconds": info.priority_aging.total_seconds(),
           "rate_limit": None if info.rate is None else info.rate.limit,
           "rate_seconds": None if info.rate is None else info.rate.per.total_seconds()}
    return "; ".join(
        f"{name} {_setting(columns, now)}, the code's {_setting(columns, info.declared)}"
        for name, columns in SETTINGS if set(columns) & set(info.overridden))


def _setting(columns: tuple[str, ...], values: Mapping[str, Any]) -> str:
    if columns == ("rate_limit", "rate_seconds"):
        limit, seconds = values.get("rate_limit"), values.get("rate_seconds")
        return ("none" if limit is None or seconds is None
                else str(RateLimit(int(limit), timedelta(seconds=float(seconds)))))
    value = values.get(columns[0])
    if columns == ("priority_aging_seconds",) and value is not None:
        return f"{float(value):g} s"
    return _said(value)


def _changed(info: QueueInfo, what: str, args: argparse.Namespace) -> int:
    if args.json:
        records.emit(record(info))
    else:
        print(f"queue {info.name} {what}")
    return 0


def cmd_pause(args: argparse.Namespace) -> int:
    info = _admin(args, lambda admin: admin.set_paused(args.name, True, **_who(args)))
    return _changed(info, "paused: nothing new starts; its running runs go on", args)


def cmd_resume(args: argparse.Namespace) -> int:
    info = _admin(args, lambda admin: admin.set_paused(args.name, False, **_who(args)))
    return _changed(info, "resumed", args)


def cmd_set(args: argparse.Namespace) -> int:
    changes: dict[str, Any] = {}
    for option in ("concurrency", "worker_concurrency", "key_concurrency"):
        value = getattr(args, option)
        if value is not None:
            changes[option] = None if value == "none" else value
    if args.rate is not None:
        changes["rate"] = None if args.rate.lower() == "none" else args.rate
    for flag in ("priority", "count_parked"):
        if getattr(args, flag) is not None:
            changes[flag] = getattr(args, flag) == "on"
    info = _admin(args, lambda admin: admin.set(args.name, **_who(args), **changes))
    said = ", ".join(f"{k.replace('_', ' ')} {_said(v)}" for k, v in changes.items())
    return _changed(info, f"set: {said}", args)


def _said(value: Any) -> str:
    """A changed setting as the command takes it: ``none``, ``on``/``off``, or the value."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def cmd_reset(args: argparse.Namespace) -> int:
    info = _admin(args, lambda admin: admin.reset(args.name, **_who(args)))
    return _changed(info, "reset to the code's declaration", args)
