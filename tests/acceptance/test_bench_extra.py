"""``make bench`` works on a fresh clone: the ``bench`` extra alone installs everything the
benchmark suite imports.

A new virtual environment gets ``pip install '.[bench]'`` and nothing else (no dev extra, no
system site packages); every module of ``bench/`` must then import, and ``python -m bench.run
--help`` and ``python -m bench.versus --help`` must answer. pip's cache keeps this to a few
seconds after the first run; it needs the package index the dev install already used.
"""

from __future__ import annotations

import os
import subprocess
import sys
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent.parent
BENCH_MODULES = sorted(
    "bench." + (p.stem if p.parent.name == "bench" else f"{p.parent.name}.{p.stem}")
    for p in [*(REPO / "bench").glob("*.py"), *(REPO / "bench" / "peers").glob("*.py")]
    if p.stem != "__init__")


@pytest.fixture(scope="module")
def bench_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The interpreter of a new venv holding the package with its ``bench`` extra only."""
    where = tmp_path_factory.mktemp("bench-venv")
    venv.EnvBuilder(with_pip=True, system_site_packages=False).create(where)
    python = where / "bin" / "python"
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check",
         f"{REPO}[bench]"],
        capture_output=True, text=True, timeout=900, check=False, env=_clean_env())
    assert done.returncode == 0, done.stdout + done.stderr
    return python


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env.update(extra)
    return env


def _run(python: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # The bench package is not installed: it runs from the checkout, as `make bench` runs it.
    return subprocess.run([str(python), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300, check=False, env=_clean_env())


def test_the_venv_has_no_dev_tools(bench_python: Path) -> None:
    """The check means something only if the dev extra is really absent."""
    assert bench_python != Path(sys.executable)
    done = _run(bench_python, "-c", "import pytest")
    assert done.returncode != 0


def test_every_bench_module_imports_with_the_bench_extra_alone(bench_python: Path) -> None:
    assert "bench.run" in BENCH_MODULES and "bench.console_load" in BENCH_MODULES
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\n"
    done = _run(bench_python, "-c", code, *BENCH_MODULES)
    assert done.returncode == 0, done.stderr


@pytest.mark.parametrize("module", ["bench.run", "bench.versus"])
def test_the_bench_commands_answer_help(bench_python: Path, module: str) -> None:
    done = _run(bench_python, "-m", module, "--help")
    assert done.returncode == 0, done.stderr
    assert "usage:" in done.stdout
