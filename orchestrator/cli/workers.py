"""``orchestrator workers list``: the fleet as the database sees it, for operators.

Every registered worker with its state (``live``, ``draining`` since when, ``waiting``,
``silent``, ``dead``: the rule that decides when a dead worker's runs are re-queued,
:func:`orchestrator.admin.worker_state`), host, pid, the runs it holds, its slots, its last
heartbeat and the workflows it serves; the console's Workers page and ``GET /api/workers`` read
the same rows (:func:`orchestrator.admin.list_workers`). A worker that stopped cleanly
unregisters and is not listed. The liveness test reads ``pg_locks``: point the command at the
primary, not at a replica.
"""

from __future__ import annotations

import argparse
import asyncio
import textwrap
from datetime import UTC
from typing import Any

from orchestrator import admin
from orchestrator.cli import records
from orchestrator.cli.common import database_target, json_option
from orchestrator.cli.tables import duration, render
from orchestrator.db.database import Database

STATE_NOTES = {
    "live": "it heartbeats and claims runs",
    "draining": "told to stop, it claims nothing more and heartbeats until its runs reach a "
                "durable point (STATE shows since when)",
    "waiting": "it heartbeats, but holds no liveness lock yet, so it claims nothing (its "
               "listen_url cannot be reached, or its lock's session ended and the lock cannot "
               "be taken again yet; it takes the lock once it can)",
    "silent": "no heartbeat for over a second, its liveness lock held (paused or overloaded) "
              "or never taken (behind a transaction pooler without a listen_url: paused or "
              "dead, the database cannot tell): its runs wait for their leases to expire",
    "dead": "no heartbeat and its liveness lock released: its process is gone (killed, "
            "crashed, its host lost); a live worker's next sweep re-queues its runs, a call "
            "it had in flight becomes unknown (sent again for an idempotent or read tool, "
            "else reconciled: `orchestrator ops list`), and its row is deleted an hour after its "
            "last heartbeat",
}
"""What each state means, in the note under the table: a line (folded) for each state shown."""

NONE_LIVE = ("no worker is live: nothing claims runs until one starts "
             "(`orchestrator worker --app MODULE:ATTR`)")
"""The note's last line when no listed worker is live."""

NOTE_WIDTH = 100
"""The width the note's lines are folded to."""


def register(subparsers: Any) -> None:
    group = subparsers.add_parser("workers", help="the workers registered in the database")
    commands = group.add_subparsers(title="workers commands", metavar="COMMAND")
    group.set_defaults(func=None, help_parser=group)
    ls = commands.add_parser(
        "list", help="every registered worker: state, host, runs held, last heartbeat",
        description="Every registered worker, newest first: its state (live, draining, "
        "waiting, silent or dead), "
        "host and pid, the runs whose lease it holds, its slots, the age of its last "
        "heartbeat, when it started and the workflows it serves. A worker that stopped "
        "cleanly is not listed. The console's Workers page shows the same.")
    json_option(ls)
    ls.set_defaults(func=cmd_list)


def cmd_list(args: argparse.Namespace) -> int:
    async def main() -> list[admin.Worker]:
        db = Database(database_target(args), max_pool_size=1)
        try:
            return await admin.list_workers(db)
        finally:
            await db.close()

    shown = asyncio.run(main())
    if args.json:
        records.emit({"workers": [records.worker_record(w) for w in shown],
                      "count": len(shown)})
        return 0
    if not shown:
        print("no workers registered (a worker registers when it starts and unregisters when "
              "it stops; start one with `orchestrator worker --app MODULE:ATTR`)")
        return 0
    print(render(
        ["WORKER", "STATE", "HOST", "PID", "RUNS HELD", "SLOTS", "LAST HEARTBEAT", "STARTED",
         "WORKFLOWS"],
        [[w.row["id"], _state(w), w.row["hostname"], w.row["pid"], w.row["runs_held"],
          w.row["concurrency"], _ago(w.row["heartbeat_age"]), w.row["started_at"],
          ", ".join(w.row["workflows"]) or "-"] for w in shown]))
    if any(w.state != "live" for w in shown):
        print()
        states = {w.state for w in shown}
        for state, meaning in STATE_NOTES.items():
            if state in states:
                print(textwrap.fill(f"{state}: {meaning}", NOTE_WIDTH, subsequent_indent="  ",
                                    break_on_hyphens=False))
        if "live" not in states:
            print(NONE_LIVE)
    return 0


def _ago(seconds: float | None) -> str:
    return "-" if seconds is None else f"{duration(max(seconds, 0.0))} ago"


def _state(w: admin.Worker) -> str:
    since = w.row.get("draining_since")
    if w.state != "draining" or since is None:
        return w.state
    return f"draining since {since.astimezone(UTC):%H:%M:%S}Z"
