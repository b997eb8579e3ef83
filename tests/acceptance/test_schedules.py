"""A schedule that fires every second, ticked by three real worker processes for a minute while
two of them are killed (SIGKILL) and started again: every slot from the first to the last
fires exactly once, one run each, with no gap (docs/schedules.md)."""

from __future__ import annotations

import time
from datetime import timedelta

from orchestrator import Orchestrator
from tests.acceptance.conftest import Workers

RUN_FOR = 60.0
KILLS_AT = (15.0, 35.0)


def test_every_slot_fires_once_while_workers_are_killed(workers: Workers,
                                                       client: Orchestrator) -> None:
    client.schedules.create("every-second", "single", cron="* * * * * *",
                            overlap="allow_all", catchup_window=timedelta(seconds=30),
                            input={})
    procs = {name: workers.start(name) for name in ("a", "b", "c")}
    started = time.monotonic()
    for n, at in enumerate(KILLS_AT):
        time.sleep(max(0.0, started + at - time.monotonic()))
        victim = "ab"[n]
        procs[victim].kill()  # mid-tick or not: its transaction dies with it
        procs[victim].wait()
        procs[victim] = workers.start(f"{victim}{n}")
    time.sleep(max(0.0, started + RUN_FOR - time.monotonic()))
    client.schedules.pause("every-second")
    time.sleep(2.0)  # a tick that began before the pause commits or not; then nothing more

    slots = workers.sql("SELECT slot, kind, state, run_id FROM orchestrator.schedule_slots "
                        "WHERE schedule_id = 'every-second' ORDER BY slot")
    assert slots, "the schedule never fired"
    first, last = slots[0]["slot"], slots[-1]["slot"]
    assert last - first >= timedelta(seconds=RUN_FOR - 10)
    seconds = int((last - first).total_seconds())
    assert [s["slot"] for s in slots] == [first + timedelta(seconds=i)
                                          for i in range(seconds + 1)]  # none twice, none lost
    assert {(s["kind"], s["state"]) for s in slots} == {("cron", "fired")}
    runs = workers.sql("SELECT id, idempotency_key FROM orchestrator.runs "
                       "WHERE idempotency_key LIKE 'schedule:every-second:%'")
    assert len(runs) == len(slots)
    assert {r["id"] for r in runs} == {s["run_id"] for s in slots}
    assert workers.sql("SELECT * FROM orchestrator.schedule_gaps") == []
