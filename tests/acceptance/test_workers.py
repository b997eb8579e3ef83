"""Real worker processes, killed and paused (CONTRACT C4, C5, C6)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

from tests.acceptance import flows


def _journal(workers, run_id):  # type: ignore[no-untyped-def]
    return workers.sql("SELECT seq, kind, lease_token FROM orchestrator.journal "
                       "WHERE run_id = %s ORDER BY seq", (run_id,))


def _one_history(journal) -> None:  # type: ignore[no-untyped-def]
    assert [e["seq"] for e in journal] == list(range(1, len(journal) + 1))
    tokens = [e["lease_token"] for e in journal]
    assert tokens == sorted(tokens), "a writer with an older lease wrote after a newer one"
    assert [e["kind"] for e in journal].count("run.completed") == 1


def test_sigkill_mid_run_another_worker_finishes_without_rerunning_steps(workers, client):
    a = workers.start("a", ACCEPTANCE_TOOL_DELAY="60")
    run = client.submit(flows.two_steps, {})
    # Step 1 is recorded; step 2 is in flight inside worker A.
    workers.wait(lambda: workers.sql("SELECT 1 FROM public.sink_calls WHERE step = 2"),
                 "step 2 to start in worker A")
    a.send_signal(signal.SIGKILL)
    a.wait()
    workers.start("b")
    result = client.get_run(run.id).result(timeout=30)
    assert [r["step"] for r in result] == [1, 2]
    calls = workers.sql("SELECT step, key, pid FROM public.sink_calls ORDER BY id")
    assert [c["step"] for c in calls if c["step"] == 1] == [1], "a recorded step ran again"
    step2 = [c for c in calls if c["step"] == 2]
    assert len(step2) == 2 and step2[0]["pid"] == a.pid
    assert len({c["key"] for c in step2}) == 1, "the idempotent re-send changed its key"
    effects = workers.sql("SELECT step FROM public.sink_effects ORDER BY step")
    assert [e["step"] for e in effects] == [1, 2]
    _one_history(_journal(workers, run.id))


def test_a_paused_worker_is_fenced_when_it_wakes(workers, client):
    a = workers.start("a", ACCEPTANCE_TOOL_DELAY="3", ACCEPTANCE_LEASE_TTL="1")
    run = client.submit(flows.two_steps, {})
    workers.wait(lambda: workers.sql("SELECT 1 FROM public.sink_calls WHERE step = 2"),
                 "step 2 to start in worker A")
    a.send_signal(signal.SIGSTOP)
    workers.start("b", ACCEPTANCE_LEASE_TTL="1")
    client.get_run(run.id).result(timeout=30)  # B took over after A's lease expired
    assert ("re-queued 1 run whose lease expired (its worker stopped renewing it: dead, "
            "paused, overloaded or cut off)") in workers.log("b")
    a.send_signal(signal.SIGCONT)
    # A finishes its call, then tries to record the receipt: the fence rejects it.
    workers.wait(lambda: "lease" in workers.log("a") and "lost" in workers.log("a"),
                 "worker A to report its lost lease", proc=a)
    journal = _journal(workers, run.id)
    _one_history(journal)
    tokens = {e["lease_token"] for e in journal}
    assert len(tokens) == 2  # A's history, then B's
    assert workers.sql("SELECT count(*) AS n FROM public.sink_effects WHERE step = 2"
                       )[0]["n"] == 1
    status = workers.sql("SELECT status FROM orchestrator.runs WHERE id = %s", (run.id,))
    assert status[0]["status"] == "succeeded"
    assert a.poll() is None  # A is alive and goes on working; it just lost this run


def test_two_workers_complete_200_runs_exactly_once(workers, client):
    workers.start("a", concurrency=25)
    workers.start("b", concurrency=25)
    handles = [client.submit(flows.single, {"n": i}) for i in range(200)]
    for handle in handles:
        handle.result(timeout=120)
    rows = workers.sql("SELECT run_id, count(*) AS n FROM public.sink_calls GROUP BY run_id")
    assert len(rows) == 200 and all(r["n"] == 1 for r in rows)
    done = workers.sql(
        "SELECT count(*) AS n FROM orchestrator.journal WHERE kind = 'run.completed'")
    assert done[0]["n"] == 200
    by_worker = workers.sql("SELECT count(DISTINCT worker_id) AS n FROM orchestrator.operations")
    assert by_worker[0]["n"] == 2


def test_sigterm_drains_in_flight_runs_and_releases_them(workers, client):
    a = workers.start("a", ACCEPTANCE_TOOL_DELAY="2")
    run = client.submit(flows.three_steps, {})
    workers.wait(lambda: workers.sql("SELECT 1 FROM public.sink_calls WHERE step = 2"),
                 "step 2 to start in worker A")
    a.send_signal(signal.SIGTERM)
    assert a.wait(timeout=30) == 0
    # A let the in-flight call land, recorded its receipt and gave the run back at once.
    row = workers.sql("SELECT status, lease_owner FROM orchestrator.runs WHERE id = %s",
                      (run.id,))[0]
    assert row["status"] == "queued" and row["lease_owner"] is None
    calls = workers.sql("SELECT step, finished FROM public.sink_calls ORDER BY id")
    assert calls == [{"step": 1, "finished": True}, {"step": 2, "finished": True}]
    assert not workers.sql("SELECT 1 FROM orchestrator.workers WHERE pid = %s", (a.pid,))
    workers.start("b")
    result = client.get_run(run.id).result(timeout=30)
    assert [r["step"] for r in result] == [1, 2, 3]
    steps = [c["step"] for c in workers.sql("SELECT step FROM public.sink_calls ORDER BY id")]
    assert steps == [1, 2, 3]  # nothing ran again


def test_a_dead_workers_runs_resume_before_its_leases_expire(workers, client):
    a = workers.start("a", ACCEPTANCE_TOOL_DELAY="60", ACCEPTANCE_LEASE_TTL="60")
    run = client.submit(flows.two_steps, {})
    workers.wait(lambda: workers.sql("SELECT 1 FROM public.sink_calls WHERE step = 2"),
                 "step 2 to start in worker A")
    workers.start("b", ACCEPTANCE_LEASE_TTL="60")
    a.send_signal(signal.SIGKILL)
    a.wait()
    started = time.monotonic()
    client.get_run(run.id).result(timeout=20)  # a 60 s lease would not allow this
    assert time.monotonic() - started < 10
    # B's log says what happened to A's run, and where to look (docs/logging.md)
    said = [line for line in workers.log("b").splitlines() if "re-queued" in line]
    assert len(said) == 1 and "WARNING" in said[0], workers.log("b")
    assert ("re-queued 1 run whose worker died (no heartbeat, its liveness lock released): "
            "`orchestrator workers list` shows it dead") in said[0]


def test_a_worker_whose_registration_was_deleted_registers_again(workers, client):
    """A worker's row can go while the process lives (another worker's sweep forgets a
    registration silent for an hour: a host suspended or cut off that long; an operator's
    cleanup): the worker puts it back at its next heartbeat, so `workers list` shows it and a
    death of it afterwards is noticed through its liveness lock, not only its leases."""
    a = workers.start("a", ACCEPTANCE_TOOL_DELAY="60", ACCEPTANCE_LEASE_TTL="60")
    workers.sql("DELETE FROM orchestrator.workers WHERE pid = %s", (a.pid,))
    workers.wait(lambda: workers.sql("SELECT 1 FROM orchestrator.workers WHERE pid = %s "
                                     "AND lock_key IS NOT NULL", (a.pid,)),
                 "worker A to register again", timeout=10, proc=a)
    run = client.submit(flows.two_steps, {})
    workers.wait(lambda: workers.sql("SELECT 1 FROM public.sink_calls WHERE step = 2"),
                 "step 2 to start in worker A")
    workers.start("b", ACCEPTANCE_LEASE_TTL="60")
    a.send_signal(signal.SIGKILL)
    a.wait()
    started = time.monotonic()
    client.get_run(run.id).result(timeout=20)  # its 60 s lease did not have to run out
    assert time.monotonic() - started < 10


def test_drain_timeout_flag_bounds_the_stop(workers, client):
    """`--drain-timeout` is how long a stopping worker waits for its runs to reach a durable
    point (a container's stop grace period must cover it): past it the calls still running
    are abandoned and the process exits."""
    a = workers.start("a", ACCEPTANCE_TOOL_DELAY="60", args=["--drain-timeout", "1"])
    run = client.submit(flows.two_steps, {})
    workers.wait(lambda: workers.sql("SELECT 1 FROM public.sink_calls WHERE step = 2"),
                 "step 2 to start in worker A")
    started = time.monotonic()
    a.send_signal(signal.SIGTERM)
    assert a.wait(timeout=20) == 0
    assert time.monotonic() - started < 8, "the default 30 s drain was used"
    assert "up to 1 s" in workers.log("a")
    assert not workers.sql("SELECT 1 FROM orchestrator.workers WHERE pid = %s", (a.pid,))
    status = workers.sql("SELECT status FROM orchestrator.runs WHERE id = %s", (run.id,))
    assert status[0]["status"] in ("running", "queued")


def test_drain_timeout_bounds_the_stop_of_a_tool_that_swallows_its_cancellation(
        workers, client):
    """A tool that catches ``CancelledError`` and goes on must not hold a stopping worker past
    ``--drain-timeout`` (and the process manager's grace period after it): the process exits,
    and the run keeps its call ``submitted`` and its lease until it lapses (C6)."""
    a = workers.start("a", ACCEPTANCE_TOOL_DELAY="60", ACCEPTANCE_LEASE_TTL="60",
                      args=["--drain-timeout", "1"])
    run = client.submit(flows.one_call, {"tool": "stubborn"})
    workers.wait(lambda: workers.sql("SELECT 1 FROM public.sink_calls WHERE run_id = %s",
                                     (str(run.id),)), "the stubborn call to start", proc=a)
    started = time.monotonic()
    a.send_signal(signal.SIGTERM)
    try:
        code = a.wait(timeout=30)
    except subprocess.TimeoutExpired:
        code = None
    assert code == 0, workers.log("a")[-3000:]
    assert time.monotonic() - started < 8, "the stop waited for the tool"
    assert "1 task still running 1 s after it was cancelled" in workers.log("a")
    assert not workers.sql("SELECT 1 FROM orchestrator.workers WHERE pid = %s", (a.pid,))
    row = workers.sql("SELECT status, lease_owner FROM orchestrator.runs WHERE id = %s",
                      (run.id,))[0]
    assert row["status"] == "running" and row["lease_owner"] is not None
    ops = workers.sql("SELECT state FROM orchestrator.operations WHERE run_id = %s",
                      (run.id,))
    assert [o["state"] for o in ops] == ["submitted"]


def test_a_second_interrupt_ends_the_drain_at_once(workers, client):
    """Ctrl-C drains; a second Ctrl-C (or SIGTERM) stops without waiting out the drain
    timeout, as if it had passed: what an operator at a terminal expects."""
    a = workers.start("a", ACCEPTANCE_TOOL_DELAY="60")
    client.submit(flows.two_steps, {})
    workers.wait(lambda: workers.sql("SELECT 1 FROM public.sink_calls WHERE step = 2"),
                 "step 2 to start in worker A")
    a.send_signal(signal.SIGINT)
    workers.wait(lambda: "draining" in workers.log("a"), "worker A to drain", proc=a)
    started = time.monotonic()
    a.send_signal(signal.SIGINT)
    assert a.wait(timeout=25) == 0
    assert time.monotonic() - started < 8, "the second interrupt waited for the drain timeout"
    assert "stopping now" in workers.log("a")
    assert not workers.sql("SELECT 1 FROM orchestrator.workers WHERE pid = %s", (a.pid,))


def test_a_draining_worker_is_listed_as_draining_until_it_stops(workers, client):
    """A worker that was told to stop claims nothing more: the fleet shows it ``draining``,
    since when, and not ``live``, until it has stopped and unregistered."""
    a = workers.start("a", ACCEPTANCE_TOOL_DELAY="60", args=["--drain-timeout", "20"])
    client.submit(flows.two_steps, {})
    workers.wait(lambda: workers.sql("SELECT 1 FROM public.sink_calls WHERE step = 2"),
                 "step 2 to start in worker A")
    a.send_signal(signal.SIGTERM)
    workers.wait(lambda: "draining" in workers.log("a"), "worker A to drain", proc=a)
    workers.wait(lambda: workers.sql("SELECT 1 FROM orchestrator.workers WHERE pid = %s "
                                     "AND draining_since IS NOT NULL", (a.pid,)),
                 "worker A to record its drain", proc=a)

    def workers_list(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "orchestrator", "workers", "list", *args],
            env={**os.environ, "ORCHESTRATOR_DATABASE_URL": workers.url}, capture_output=True,
            text=True, timeout=60, check=True)
        return done.stdout

    table = workers_list()
    row = next(line for line in table.splitlines() if f" {a.pid} " in line)
    assert row.split()[1] == "draining"
    assert "draining: told to stop" in table
    doc = json.loads(workers_list("--json"))
    (mine,) = [w for w in doc["workers"] if w["pid"] == a.pid]
    assert mine["state"] == "draining"
    assert mine["draining_since"] is not None and mine["draining_since"].endswith("Z")
    assert mine["draining_since"] >= mine["started_at"]
    a.send_signal(signal.SIGINT)  # a second signal: stop without waiting out the drain
    assert a.wait(timeout=25) == 0
    assert not workers.sql("SELECT 1 FROM orchestrator.workers WHERE pid = %s", (a.pid,))


def test_a_drain_that_gives_up_releases_at_once_the_runs_with_no_call_in_flight(
        workers, client):
    """A rolling restart: worker A is told to stop while one run is busy in its own code and
    another waits on a call. Past ``--drain-timeout`` both were abandoned and both leases left
    to lapse, so the run that had nothing in flight waited out the whole TTL (60 s here)
    before worker B could take it. A now gives it back at once; the run whose call was in
    flight keeps its lease until it lapses (C6: the call stays fenced, and the next holder
    finds it ``submitted``)."""
    a = workers.start("a", ACCEPTANCE_TOOL_DELAY="60", ACCEPTANCE_THINK_DELAY="60",
                      ACCEPTANCE_LEASE_TTL="60", args=["--drain-timeout", "1"])
    calling = client.submit(flows.two_steps, {})
    thinking = client.submit(flows.thinks_then_calls, {})
    workers.wait(lambda: workers.sql("SELECT 1 FROM public.sink_calls WHERE step = 2"),
                 "step 2 to start in worker A", proc=a)
    workers.wait(lambda: workers.sql("SELECT 1 FROM orchestrator.runs WHERE id = %s AND "
                                     "status = 'running'", (thinking.id,)),
                 "worker A to claim the thinking run", proc=a)
    a.send_signal(signal.SIGTERM)
    assert a.wait(timeout=20) == 0
    state = {row["id"]: row for row in workers.sql(
        "SELECT id, status, lease_owner FROM orchestrator.runs WHERE id IN (%s, %s)",
        (thinking.id, calling.id))}
    assert (state[thinking.id]["status"], state[thinking.id]["lease_owner"]) == ("queued", None)
    assert state[calling.id]["status"] == "running"
    assert state[calling.id]["lease_owner"] is not None
    log = workers.log("a")
    assert "released 1 of the 2 runs it abandoned" in log, log
    workers.start("b", ACCEPTANCE_LEASE_TTL="60")
    started = time.monotonic()
    assert client.get_run(thinking.id).result(timeout=20)["step"] == 1
    assert time.monotonic() - started < 10, "the released run waited for its lease"
    # The run whose call was in flight is still fenced: A's lease has most of a minute to go.
    still = workers.sql("SELECT status, lease_owner FROM orchestrator.runs WHERE id = %s",
                        (calling.id,))[0]
    assert (still["status"], still["lease_owner"]) == (
        "running", state[calling.id]["lease_owner"])
    ops = workers.sql("SELECT state FROM orchestrator.operations WHERE run_id = %s "
                      "ORDER BY position", (calling.id,))
    assert [o["state"] for o in ops] == ["committed", "submitted"]
