"""A bad value for a typed option, through the real command against a real database: the
refusal every other bad input gets (``INVALID_REQUEST``, exit status 2, one line on stderr,
``--json`` or not), and nothing read or written (docs/cli-json.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import psycopg

from tests.clitools import run_cli

SCOPED_APP = "tests.integration.scoped_app:app"

WRITERS = [
    # commands that write when their options are good, each given one bad value
    (["queues", "set", "exports", "--concurrency", "5", "--priority", "maybe"],
     "--priority must be one of on, off, not 'maybe'"),
    (["queues", "set", "exports", "--count-parked", "yes", "--json"],
     "--count-parked must be one of on, off, not 'yes'"),
    (["ops", "resolve-many", "--not-applied", "--then", "later", "--evidence", "x",
      "--operator", "alice", "--yes", "--json"],
     "--then must be one of resend, fail, not 'later'"),
    (["ops", "abandon-many", "--limit", "-3", "--evidence", "x", "--operator", "alice",
      "--yes"], "--limit must be a whole number from 1 to 10000, not '-3'"),
    (["schedules", "trigger", "nightly", "--overlap", "whenever", "--json"],
     "--overlap must be one of skip, buffer_one, buffer_all, cancel_other, allow_all, "
     "not 'whenever'"),
    (["prune", "--older-than", "0s", "--batch", "lots", "--json"],
     "--batch must be a whole number from 1 to 100000, not 'lots'"),
    (["prune", "--older-than", "0s", "--duty", "nan"],
     "--duty must be a number more than 0 and at most 1, not 'nan'"),
    (["worker", "--app", SCOPED_APP, "--concurrency", "abc"],
     "--concurrency must be a whole number, 1 or more, not 'abc'"),
    (["worker", "--app", SCOPED_APP, "--concurrency", "0"],
     "--concurrency must be a whole number, 1 or more, not '0'"),
    (["reconciler", "--app", SCOPED_APP, "--max-lookups", "-1"],
     "--max-lookups must be a whole number, 1 or more, not '-1'"),
    (["demo", "--runs", "0"], "--runs must be a whole number, 1 or more, not '0'"),
]

READERS = [
    (["runs", "list", "--limit", "abc"],
     "--limit must be a whole number from 1 to 1000, not 'abc'"),
    (["runs", "list", "--limit", "-3", "--json"],
     "--limit must be a whole number from 1 to 1000, not '-3'"),
    (["runs", "list", "--json", "--status", "finished"],
     "--status must be one of queued, running, waiting, needs_reconciliation, succeeded, "
     "failed, cancelled, not 'finished'"),
    (["ops", "list", "--json", "--limit", "1e3"],
     "--limit must be a whole number from 1 to 1000, not '1e3'"),
    (["ops", "audit", "--limit", "0", "--json"],
     "--limit must be a whole number from 1 to 1000, not '0'"),
    (["schedules", "show", "nightly", "--recent", "1001", "--json"],
     "--recent must be a whole number from 0 to 1000, not '1001'"),
]


def _written(sql: Any) -> dict[str, int]:
    """How many rows each table a command above writes holds."""
    return {table: sql(f"SELECT count(*) AS n FROM orchestrator.{table}")[0]["n"]
            for table in ("runs", "queues", "schedules", "schedule_slots", "operator_audit",
                          "workers", "reconciliation_items")}


def test_a_bad_option_value_is_refused_before_anything_is_written(migrated_database_url, sql):
    before = _written(sql)
    for argv, said in WRITERS + READERS:
        done = run_cli(argv, database_url=migrated_database_url)
        assert (done.returncode, done.stdout, done.stderr) == (
            2, "", f"orchestrator: error: INVALID_REQUEST: {said}\n"), argv
    assert _written(sql) == before


def test_a_worker_with_a_bad_metrics_port_migrates_nothing(empty_database_url):
    """``worker --migrate --metrics-port 70000`` upgraded the schema of the database it was
    given and only then refused the port: a refused command had changed the database."""
    done = run_cli(["worker", "--app", SCOPED_APP, "--migrate", "--metrics-port", "70000"],
                   database_url=empty_database_url)
    assert (done.returncode, done.stderr) == (
        2, "orchestrator: error: INVALID_REQUEST: --metrics-port must be a whole number from "
        "0 to 65535, not '70000'\n")
    with psycopg.connect(empty_database_url) as conn:
        schemas = conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = 'orchestrator'")
        assert schemas.fetchall() == []


def test_a_good_value_still_runs_the_command(migrated_database_url):
    done = run_cli(["runs", "list", "--limit", "5", "--status", "failed", "--json"],
                   database_url=migrated_database_url)
    assert done.returncode == 0, done.stderr
    assert '"limit": 5' in done.stdout



def test_the_reconciler_command_passes_every_setting_on(
        migrated_database_url: str, tmp_path: Any) -> None:
    """Each of ``orchestrator reconciler``'s settings reaches ``run_reconciler``: the lookup
    timeout, the longest pause between lookups, the batch and the prune interval had no flag
    (a fleet running the command could not set them). The command runs in a process of its
    own (it sets the process's signal handlers and logging), with an app whose
    ``run_reconciler`` writes what it was given to a file and returns."""
    import json
    import subprocess
    import sys

    from tests.clitools import cli_env

    given = tmp_path / "given.json"
    (tmp_path / "recording_app.py").write_text(
        "import json\n"
        "from orchestrator import Orchestrator\n"
        "from tests.integration.scoped_app import app\n"
        "def _record(self, **kwargs):\n"
        f"    with open({str(given)!r}, 'w') as out:\n"
        "        json.dump({k: v for k, v in kwargs.items() if k != 'event_loop'}, out)\n"
        "Orchestrator.run_reconciler = _record\n")
    env = cli_env(migrated_database_url)
    env["PYTHONPATH"] = f"{tmp_path}:{env.get('PYTHONPATH', '')}:{Path.cwd()}"
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator", "reconciler", "--app", "recording_app:app",
         "--max-lookups", "7", "--base-delay", "0.5", "--max-delay", "60",
         "--lookup-timeout", "12.5", "--batch", "25", "--poll-interval", "2",
         "--prune-interval", "600", "--unserved-grace", "0"],
        env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    got = json.loads(given.read_text())
    assert {k: got[k] for k in ("max_lookups", "base_delay", "max_delay", "lookup_timeout",
                                "batch", "poll_interval", "prune_interval",
                                "unserved_grace")} == {
        "max_lookups": 7, "base_delay": 0.5, "max_delay": 60.0, "lookup_timeout": 12.5,
        "batch": 25, "poll_interval": 2.0, "prune_interval": 600.0, "unserved_grace": 0.0}
