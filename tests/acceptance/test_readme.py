"""The README's workflow example, run the way the README says: its code block saved as
``checkout.py`` beside a stand-in for the payment client, the schema created and a worker
started with the ``orchestrator`` command, then ``python checkout.py``. Documentation a newcomer
copies must work as written."""

from __future__ import annotations

import ast
import signal
import subprocess
import sys
from pathlib import Path

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


def test_the_readme_example_runs_as_written(tmp_path: Path, empty_database_url: str) -> None:
    (tmp_path / "checkout.py").write_text(readme_example())
    (tmp_path / "psp.py").write_text(PSP)
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
