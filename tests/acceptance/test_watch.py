"""``orchestrator runs watch`` (CONTRACT C14) with real processes: a watcher follows a run
across the SIGKILL of the worker executing it and another worker finishing it, prints the
whole story once, in order, and ends with the outcome and its exit status; Ctrl-C ends it
quietly."""

from __future__ import annotations

import json
import signal
import subprocess
from typing import Any

from tests.acceptance import flows
from tests.acceptance.conftest import Workers
from tests.clitools import run_cli, start_cli


def _journal(workers: Workers, run_id: Any) -> list[dict[str, Any]]:
    return workers.sql("SELECT seq, kind, name FROM orchestrator.journal WHERE run_id = %s "
                       "ORDER BY seq", (run_id,))


def _finish(proc: subprocess.Popen[str], timeout: float = 60) -> tuple[int, str, str]:
    """The watcher's exit status and output; one still running after ``timeout`` is killed
    (the test fails, and the process does not outlive it)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise
    return proc.returncode, out, err


def test_watch_follows_a_run_across_a_worker_sigkill_to_its_outcome(workers, client):
    doomed = workers.start("a", ORCHESTRATOR_FAULT_POINT="after_submitted",
                           ORCHESTRATOR_FAULT_TOOL="record_idempotent")
    run = client.submit(flows.reported, {})
    text = start_cli(["runs", "watch", str(run.id)], database_url=workers.url)
    lines = start_cli(["runs", "watch", str(run.id), "--json"], database_url=workers.url)
    doomed.wait(timeout=30)
    assert doomed.returncode == -9, "the worker did not die at the fault point"
    workers.wait(lambda: text.poll() is None and lines.poll() is None, "the watchers to wait")
    workers.start("b")  # replays the run and sends step 2 again, with the same key

    code, out, err = _finish(text)
    journal = _journal(workers, run.id)
    assert code == 0, err
    assert err == ""
    header, *told = out.splitlines()
    assert header.split() == ["SEQ", "AT", "POS", "EVENT", "NAME", "DETAIL"]
    assert len(told) == len(journal) + 1  # a line per entry, then the outcome
    for line, entry in zip(told, journal, strict=False):
        assert line.split()[0] == str(entry["seq"]) and entry["kind"] in line, (line, entry)
    kinds = [e["kind"] for e in journal]
    # The whole story: the step sent by the worker that died, what the next one made of it.
    assert kinds[:5] == ["message", "call.submitted", "call.completed", "message",
                         "call.submitted"]
    assert kinds.count("call.submitted") >= 3 and kinds[-2:] == ["message", "run.completed"]
    assert any(k in kinds for k in ("call.unknown", "call.retrying"))
    assert 'attempt 1 sent' in told[1] and '{"of": 2, "step": 2}' in told[3]
    assert told[-1].startswith(f"run {run.id} succeeded; result [")

    code, out, err = _finish(lines)
    assert code == 0, err
    records = [json.loads(line) for line in out.splitlines()]
    assert [r["seq"] for r in records[:-1]] == [e["seq"] for e in journal]
    assert all(r["type"] == "entry" for r in records[:-1])
    assert records[-1]["type"] == "outcome" and records[-1]["status"] == "succeeded"
    assert records[-1]["result"] == client.get_run(run.id).result(timeout=5)
    assert records[3]["payload"] == {"value": {"step": 2, "of": 2}}

    # Watching again after entry N prints N+1 … once, and the outcome.
    middle = journal[len(journal) // 2]["seq"]
    again = run_cli(["runs", "watch", str(run.id), "--after", str(middle)],
                    database_url=workers.url)
    assert again.returncode == 0, again.stderr
    assert [line.split()[0] for line in again.stdout.splitlines()[1:-1]] == [
        str(e["seq"]) for e in journal if e["seq"] > middle]  # after the header


def test_ctrl_c_stops_watching_quietly(workers, client):
    run = client.submit(flows.single, {})  # no worker: it stays queued while it is watched
    watch = start_cli(["runs", "watch", str(run.id)], database_url=workers.url)
    workers.wait(lambda: workers.sql(
        "SELECT 1 FROM pg_stat_activity WHERE datname = current_database() "
        "AND query LIKE '%WITH asked AS%moved AS%' "  # its poll (journal_poll) …
        "AND pid <> pg_backend_pid()"),  # … not this query, which has the same words
        "the watcher to follow the run")
    watch.send_signal(signal.SIGINT)
    code, out, err = _finish(watch, timeout=30)  # a cancelled poll may take a while to end
    assert (code, out, err) == (130, "", "")  # no traceback, no message
    assert workers.sql("SELECT status FROM orchestrator.runs")[0]["status"] == "queued"
