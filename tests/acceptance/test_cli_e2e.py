"""The commands people run: the demo, and runs list/show/cancel on real runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tomllib
from urllib.parse import urlsplit

import psycopg
import pytest

from tests import dbtools
from tests.acceptance import flows
from tests.acceptance.conftest import ROOT


def _cli(url: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator", "--database-url", url, *args], cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
        timeout=timeout)


def test_the_demo_runs_to_completion(empty_database_url):
    done = _cli(empty_database_url, "demo", timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "every run finished and every effect was applied exactly once" in done.stdout
    assert "worker A killed with SIGKILL" in done.stdout
    # Every run in the table can be told apart and looked up (run ids are time-ordered, so
    # their leading digits are shared by runs submitted together).
    rows = [line.split() for line in done.stdout.splitlines()
            if line.split()[-3:-2] == ["succeeded"]]  # … STATUS EFFECTS WORKERS
    ids = [row[0] for row in rows]
    assert len(ids) == len(set(ids)) > 1
    assert any("(child)" in row for row in rows)  # the bundle's child run has its own row
    # The table accounts for every effect: its column adds up to the total printed below it.
    applied = int(done.stdout.split("effects applied: ", 1)[1].split(";", 1)[0])
    assert sum(int(row[-2]) for row in rows) == applied
    assert _cli(empty_database_url, "runs", "show", ids[0]).returncode == 0


def test_the_demo_keeps_to_a_database_of_its_own(empty_database_url, pg_admin_url):
    """With the database configured in the environment (an application's), the demo runs in
    a database of its own beside it (its name and ``_demo``), created for it: the
    application's database gets no demo runs, not even the schema."""
    name = urlsplit(empty_database_url).path.lstrip("/")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "ORCHESTRATOR_DATABASE_URL": empty_database_url}
    try:
        done = subprocess.run([sys.executable, "-m", "orchestrator", "demo", "--runs", "1"],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stdout + done.stderr
        assert f"/{name}_demo" in done.stdout.splitlines()[0]  # database: …/NAME_demo
        with psycopg.connect(empty_database_url) as conn:
            schemas = conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = 'orchestrator'")
            assert schemas.fetchall() == []
        with psycopg.connect(dbtools.url_for_database(empty_database_url, f"{name}_demo")) as conn:
            runs = conn.execute("SELECT count(*) FROM orchestrator.runs").fetchone()
            assert runs is not None and runs[0] >= 3
        shown = next(line for line in done.stdout.splitlines()
                     if line.startswith("inspect a run: "))
        assert f"/{name}_demo" in shown
    finally:
        dbtools.drop_database(pg_admin_url, f"{name}_demo")


def test_runs_list_show_and_cancel(workers, client):
    url = workers.url
    workers.start("a")
    finished = client.submit(flows.single, {"n": 1})
    finished.result(timeout=30)
    listed = _cli(url, "runs", "list")
    assert listed.returncode == 0
    assert str(finished.id) in listed.stdout and "single@1" in listed.stdout
    assert "succeeded" in listed.stdout and "acceptance/tests" in listed.stdout
    shown = _cli(url, "runs", "show", str(finished.id))
    assert shown.returncode == 0
    for text in ("status:         succeeded", "operations", "record@1", "committed", "timeline",
                 "call.submitted", "call.completed", "run.completed"):
        assert text in shown.stdout, text
    result = json.dumps(finished.result(timeout=30), sort_keys=True)
    assert f"result:         {result[:40]}" in shown.stdout  # what the run returned, clipped
    workers.procs[0].terminate()
    workers.procs[0].wait()
    queued = client.submit(flows.one_call, {"tool": "record"})
    note = _cli(url, "runs", "show", str(queued.id))
    assert "no live worker registers it" in note.stdout  # nobody can run it now, and it says
    cancelled = _cli(url, "runs", "cancel", str(queued.id))
    assert cancelled.returncode == 0 and "is cancelled" in cancelled.stdout
    assert client.get_run(queued.id).status() == "cancelled"
    shown = _cli(url, "runs", "show", str(queued.id))
    assert "status:         cancelled\n" in shown.stdout  # not "cancelled (CANCELLED)"
    bad = _cli(url, "runs", "show", "not-a-run")
    assert bad.returncode == 2 and bad.stderr.count("\n") == 1 and "INVALID_REQUEST" in bad.stderr


def test_the_process_entry_points_under_workers(workers, client):
    import signal as signals

    env = {**os.environ, "ORCHESTRATOR_DATABASE_URL": workers.url, "PYTHONPATH": str(ROOT)}
    procs = [subprocess.Popen([sys.executable, "-m", f"workers.{name}", "--app",
                               "tests.acceptance.flows:app"], cwd=ROOT, env=env,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
             for name in ("worker", "reconciler")]
    try:
        assert client.submit(flows.single, {"n": 7}).result(timeout=30)["step"] == 1
    finally:
        for proc in procs:
            proc.send_signal(signals.SIGTERM)
        codes = [proc.wait(timeout=30) for proc in procs]
    assert codes == [0, 0]  # both stop cleanly on SIGTERM


def test_a_sigterm_during_start_up_stops_the_process_cleanly(workers):
    """A process manager may stop a worker or a reconciler while it is still starting
    (importing, checking the database): the signal is kept and the process stops cleanly as
    soon as it runs, instead of dying of the signal (exit -15)."""
    script = """
import os, signal, sys
from orchestrator.app import catch_early_sigterm
catch_early_sigterm()
os.kill(os.getpid(), signal.SIGTERM)  # before the loop's own handler exists
from tests.acceptance.flows import app
app.run_worker() if sys.argv[1] == "worker" else app.run_reconciler()
print("stopped")
"""
    env = {**os.environ, "ORCHESTRATOR_DATABASE_URL": workers.url, "PYTHONPATH": str(ROOT)}
    for role in ("worker", "reconciler"):
        done = subprocess.run([sys.executable, "-c", script, role], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=60)
        assert (done.returncode, done.stdout.strip()) == (0, "stopped"), done.stderr[-2000:]


@pytest.mark.parametrize("name", ["worker", "reconciler"])
def test_an_entry_point_keeps_a_sigterm_that_comes_while_the_package_loads(name):
    """``python -m workers.NAME`` takes SIGTERM before it imports the package (a second or more
    on a busy host), so a stop request meanwhile ends in a clean stop, not in death by the
    signal (exit -15). Asked of the module itself: what SIGTERM does at the moment the
    package's first import begins."""
    probe = (
        "import runpy, signal, sys\n"
        "seen = []\n"
        "def hook(event, args):\n"
        "    if event == 'import' and args[0] == 'orchestrator' and not seen:\n"
        "        seen.append(signal.getsignal(signal.SIGTERM))\n"
        "sys.addaudithook(hook)\n"
        f"sys.argv = ['{name}', '--help']\n"
        "try:\n"
        f"    runpy.run_module('workers.{name}', run_name='__main__')\n"
        "except SystemExit:\n"
        "    pass\n"
        "print('kept' if seen and seen[0] not in (signal.SIG_DFL, None) else 'default', "
        "file=sys.stderr)\n")
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True,
                          text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.stderr.strip().splitlines()[-1] == "kept", done.stderr


@pytest.mark.parametrize(("command", "code"), [
    (["worker", "--app", "tests.acceptance.flows:app"], 0),
    (["reconciler", "--app", "tests.acceptance.flows:app"], 0),
    (["runs", "list"], -signal.SIGTERM),  # a short command dies of it, as it always did
])
def test_python_m_orchestrator_keeps_a_sigterm_that_comes_while_the_package_loads(
        workers, tmp_path, command, code):
    """``python -m orchestrator worker`` imports the package before its ``__main__`` runs: a
    SIGTERM meanwhile (a process manager's stop of a worker still starting) ends a
    long-running command cleanly, as the console script does, not in death by the signal
    (exit -15). The real command line, the signal sent (from a ``sitecustomize`` on the path)
    as the package's ``__init__`` begins to import the rest (``orchestrator.app``, most of the
    load): the moments before, locating and reading ``__init__``, are as short as the
    interpreter's own start, which no entry point covers."""
    (tmp_path / "sitecustomize.py").write_text(
        "import os, signal, sys\n"
        "sent = []\n"
        "def hook(event, args):\n"
        "    if event == 'import' and args[0] == 'orchestrator.app' and not sent:\n"
        "        sent.append(True)\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "sys.addaudithook(hook)\n")
    env = {**os.environ, "ORCHESTRATOR_DATABASE_URL": workers.url,
           "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"}
    done = subprocess.run([sys.executable, "-m", "orchestrator", *command], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stdout[-2000:] + done.stderr[-2000:]


def test_importing_the_package_under_another_python_m_keeps_sigterm_at_its_default(tmp_path):
    """Only ``python -m orchestrator`` itself keeps SIGTERM while the package loads: another
    program run with ``-m`` that imports the package as it is located gets SIGTERM as it
    was."""
    pkg = tmp_path / "otherprog"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import orchestrator\n")
    (pkg / "__main__.py").write_text(
        "import signal\nprint(signal.getsignal(signal.SIGTERM) is signal.SIG_DFL)\n")
    done = subprocess.run([sys.executable, "-m", "otherprog", "worker"], cwd=tmp_path,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{ROOT}"})
    assert (done.returncode, done.stdout.strip()) == (0, "True"), done.stderr[-2000:]


@pytest.mark.parametrize(("command", "code"), [
    (["worker", "--app", "tests.acceptance.flows:app"], 0),
    (["reconciler", "--app", "tests.acceptance.flows:app"], 0),
    (["console", "--port", "0"], 0),
    (["runs", "list"], -signal.SIGTERM),  # a short command dies of it, as it always did
])
def test_the_console_script_keeps_a_sigterm_that_comes_while_the_package_loads(
        workers, command, code):
    """The ``orchestrator`` console script imports its target before anything runs: a SIGTERM
    while the package loads (a process manager's stop of a worker still starting) must end a
    long-running command cleanly, as ``python -m workers.worker`` does, not kill it (exit -15).
    Run as the script pip writes runs it (``from MODULE import ATTR; sys.exit(ATTR())``), the
    signal sent as the package's first import begins."""
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    module, _, attr = scripts["orchestrator"].partition(":")
    probe = (
        "import os, signal, sys\n"
        "sent = []\n"
        "def hook(event, args):\n"
        "    if event == 'import' and args[0] == 'orchestrator' and not sent:\n"
        "        sent.append(True)\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "sys.addaudithook(hook)\n"
        f"sys.argv = ['orchestrator', *{command!r}]\n"
        f"from {module} import {attr}\n"
        f"sys.exit({attr}())\n")
    env = {**os.environ, "ORCHESTRATOR_DATABASE_URL": workers.url, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == code, done.stdout[-2000:] + done.stderr[-2000:]
