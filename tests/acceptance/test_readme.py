"""The README's workflow example, run the way the README says: its code block saved as
``checkout.py`` beside a stand-in for the payment client, the schema created and a worker
started with the ``orchestrator`` command, then ``python checkout.py``. Documentation a newcomer
copies must work as written."""

from __future__ import annotations

import ast
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.clitools import cli_env, command, run_cli

ROOT = Path(__file__).resolve().parents[2]

PSP = '''"""A stand-in for a payment provider's client (what the README's `import psp` names)."""
charges = {}


async def charge(customer, cents, *, idempotency_key):
    charges[idempotency_key] = {"id": "ch_" + idempotency_key[-8:], "cents": cents}
    return charges[idempotency_key]


async def find(*, idempotency_key):
    return charges.get(idempotency_key)
'''


def readme_example() -> str:
    """The first Python block under the README's "A workflow" heading."""
    section = (ROOT / "README.md").read_text().split("\n## A workflow\n", 1)[1]
    return section.split("```python\n", 1)[1].split("```", 1)[0]


def readme_stand_in() -> str:
    """The README's stand-in ``psp.py``: the second Python block under "A workflow"."""
    section = (ROOT / "README.md").read_text().split("\n## A workflow\n", 1)[1]
    block = section.split("```python\n", 2)[2].split("```", 1)[0]
    assert block.startswith("# psp.py\n"), block
    return block


@pytest.mark.parametrize("stand_in", ["minimal", "readme"])
def test_the_readme_example_runs_as_written(tmp_path: Path, empty_database_url: str,
                                            stand_in: str) -> None:
    (tmp_path / "checkout.py").write_text(readme_example())
    (tmp_path / "psp.py").write_text(PSP if stand_in == "minimal" else readme_stand_in())
    env = cli_env(empty_database_url)

    upgraded = run_cli(["db", "upgrade"], database_url=empty_database_url)
    assert upgraded.returncode == 0, upgraded.stderr
    log = (tmp_path / "worker.log").open("w")  # a file: a pipe nobody reads could fill up
    worker = subprocess.Popen([*command(), "worker", "--app", "checkout:app"], cwd=tmp_path,
                              env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        first = subprocess.run([sys.executable, "checkout.py"], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=90, check=False)
        again = subprocess.run([sys.executable, "checkout.py"], cwd=tmp_path, env=env,
                               capture_output=True, text=True, timeout=90, check=False)
    finally:
        worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=60)
        log.close()
    output = (tmp_path / "worker.log").read_text()
    assert first.returncode == 0, first.stderr + output
    result = ast.literal_eval(first.stdout)  # what `print(run.result(...))` printed
    assert result["approved"] == {"ok": True}
    assert result["receipt"]["cents"] == 500 and result["receipt"]["id"].startswith("ch_")
    assert again.returncode == 0 and again.stdout == first.stdout  # the key names the same run
    assert worker.returncode == 0, output


DURABLE_PSP = '''"""A payment provider stand-in that keeps its charges in a file, so that every
process sees them; with PSP_DIE_IN_CHARGE set, the worker dies inside charge() before the
provider applied anything (as a machine failure would)."""
import json
import os
import signal
from pathlib import Path

FILE = Path(os.environ["PSP_FILE"])


def _charges():
    return json.loads(FILE.read_text()) if FILE.exists() else {}


async def charge(customer, cents, *, idempotency_key):
    if os.environ.get("PSP_DIE_IN_CHARGE"):
        os.kill(os.getpid(), signal.SIGKILL)
    charges = _charges()
    charges.setdefault(idempotency_key, {"id": "ch_" + idempotency_key[-8:], "cents": cents})
    FILE.write_text(json.dumps(charges))
    return charges[idempotency_key]


async def find(*, idempotency_key):
    return _charges().get(idempotency_key)
'''


def test_the_readme_example_survives_a_worker_killed_inside_charge(
        tmp_path: Path, empty_database_url: str) -> None:
    """The worker is SIGKILLed in the middle of ``charge``, before the provider applied it.
    The next worker finds the call uncertain, the reconciler's lookup proves it not applied,
    and the call is sent again: the run succeeds with exactly one charge, and ``runs show``
    tells that story."""
    (tmp_path / "checkout.py").write_text(readme_example())
    (tmp_path / "psp.py").write_text(DURABLE_PSP)
    env = {**cli_env(empty_database_url), "PSP_FILE": str(tmp_path / "charges.json")}
    assert run_cli(["db", "upgrade"], database_url=empty_database_url).returncode == 0
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str, *args: str, **extra: str) -> subprocess.Popen[bytes]:
        with (tmp_path / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen([*command(), *args, "--app", "checkout:app"], cwd=tmp_path,
                                    env={**env, **extra}, stdout=log, stderr=subprocess.STDOUT)
        procs.append(proc)
        return proc

    try:
        doomed = start("doomed", "worker", PSP_DIE_IN_CHARGE="1")
        start("reconciler", "reconciler")
        submitter = subprocess.Popen([sys.executable, "checkout.py"], cwd=tmp_path, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert doomed.wait(timeout=60) == -signal.SIGKILL
        start("worker", "worker")
        out, err = submitter.communicate(timeout=90)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                proc.wait(timeout=60)
    assert submitter.returncode == 0, err + (tmp_path / "worker.log").read_text()
    result = ast.literal_eval(out)
    charges = json.loads((tmp_path / "charges.json").read_text())
    assert list(charges.values()) == [result["receipt"]]  # exactly one charge
    run_id = run_cli(["runs", "list", "--json"], database_url=empty_database_url)
    shown = run_cli(["runs", "show", json.loads(run_id.stdout)["runs"][0]["id"]],
                    database_url=empty_database_url)
    assert "succeeded" in shown.stdout
    story = [line for line in shown.stdout.splitlines() if "charge" in line]
    for told in ("attempt 1 sent", "outcome unknown (WORKER_LOST)",
                 "proven not applied by reconciler", "re-sent as attempt 2", "attempt 2 sent",
                 "committed"):
        assert any(told in line for line in story), shown.stdout


def test_the_typing_docs_example_runs_beside_a_worker(
        tmp_path: Path, empty_database_url: str) -> None:
    """docs/typing.md's example, saved as a module that a worker imports for its app: it
    submitted at import time (so the worker blocked on its own run) and with no owner."""
    doc = (ROOT / "docs" / "typing.md").read_text()
    example = doc.split("```python\n", 1)[1].split("```", 1)[0]
    printed = example.replace("total = run.result(timeout=60)",
                              "total = run.result(timeout=60); print(total)")
    assert printed != example
    (tmp_path / "typed.py").write_text(printed)
    env = cli_env(empty_database_url)
    assert run_cli(["db", "upgrade"], database_url=empty_database_url).returncode == 0
    with (tmp_path / "worker.log").open("wb") as log:
        worker = subprocess.Popen([*command(), "worker", "--app", "typed:app"], cwd=tmp_path,
                                  env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        submitted = subprocess.run([sys.executable, "typed.py"], cwd=tmp_path, env=env,
                                   capture_output=True, text=True, timeout=90, check=False)
    finally:
        if worker.poll() is None:
            worker.send_signal(signal.SIGTERM)
        worker.wait(timeout=90)
    output = (tmp_path / "worker.log").read_text()
    assert (submitted.returncode, submitted.stdout) == (0, "500\n"), submitted.stderr + output
    assert worker.returncode == 0, output
