"""The installed package is typed for applications: ``mypy --strict``, run from a directory
outside the repository (so that only the installed package can answer ``import orchestrator``),
passes a typed application cleanly and reports the mistakes of another, line by line.

The mypy is the installed one (``python -m mypy`` of this interpreter), with no configuration
but ``--strict``; ``PYTHONPATH`` and ``MYPYPATH`` are cleared so nothing points at the sources.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).parent
REPO = HERE.parent.parent
_EXPECTED = re.compile(r"#\s*E:\s*(?P<text>.+?)\s*$")
_REPORTED = re.compile(r"^(?P<file>[^:]+):(?P<line>\d+): error: (?P<text>.*?)(?:  \[[a-z-]+\])?$")


@pytest.fixture(scope="module")
def outside(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory outside the repository holding copies of the samples and an empty mypy
    configuration (so that no user or parent configuration applies); one cache for all runs."""
    where = tmp_path_factory.mktemp("typed-app")
    assert REPO not in where.parents
    for sample in ("sample_app.py", "sample_mistakes.py"):
        shutil.copy(HERE / sample, where / sample)
    (where / "mypy.ini").write_text("[mypy]\n")
    return where


def mypy(where: Path, sample: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--config-file", "mypy.ini",
         "--cache-dir", str(where / ".mypy_cache"), "--no-error-summary",
         "--show-error-codes", "--hide-error-context", sample],
        cwd=where, env=env, capture_output=True, text=True, timeout=300, check=False)


def errors(output: str) -> dict[int, list[str]]:
    found: dict[int, list[str]] = {}
    for line in output.splitlines():
        if match := _REPORTED.match(line):
            found.setdefault(int(match["line"]), []).append(match["text"])
    return found


def test_a_typed_app_passes_mypy_strict_against_the_installed_package(outside: Path) -> None:
    done = mypy(outside, "sample_app.py")
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout == "", done.stdout


def test_mypy_strict_reports_each_mistake_of_a_typed_app(outside: Path) -> None:
    expected = {number: match["text"]
                for number, line in enumerate((outside / "sample_mistakes.py").read_text()
                                              .splitlines(), start=1)
                if (match := _EXPECTED.search(line))}
    assert len(expected) >= 10
    done = mypy(outside, "sample_mistakes.py")
    assert done.returncode == 1, done.stdout + done.stderr
    reported = errors(done.stdout)
    assert "import-not-found" not in done.stdout, done.stdout
    for number, text in expected.items():
        assert any(text in message for message in reported.get(number, [])), (
            f"line {number}: expected {text!r}, mypy said {reported.get(number)}")
    unexpected = {n: m for n, m in reported.items() if n not in expected}
    assert not unexpected, unexpected
