"""Running the ``orchestrator`` command as a real subprocess, the way users run it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrator.db.config import ENV_URL


def command(*, module: bool = False) -> list[str]:
    """The installed console script next to this interpreter, or ``python -m orchestrator``."""
    if not module:
        script = shutil.which("orchestrator", path=str(Path(sys.executable).parent))
        if script is not None:
            return [script]
    return [sys.executable, "-m", "orchestrator"]


def cli_env(database_url: str | None = None) -> dict[str, str]:
    """The current environment with ``ORCHESTRATOR_DATABASE_URL`` set to exactly this URL."""
    env = {key: value for key, value in os.environ.items() if key != ENV_URL}
    if database_url is not None:
        env[ENV_URL] = database_url
    return env


@dataclass(frozen=True)
class Result:
    """What a finished command did."""

    returncode: int
    stdout: str
    stderr: str

    @property
    def stderr_lines(self) -> list[str]:
        return self.stderr.splitlines()


def run_cli(
    args: Sequence[str],
    *,
    database_url: str | None = None,
    module: bool = False,
    timeout: float = 60,
) -> Result:
    """Run ``orchestrator ARGS`` with ``database_url`` in the environment; wait for it."""
    proc = subprocess.run(
        [*command(module=module), *args],
        env=cli_env(database_url),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


def start_cli(args: Sequence[str], *, database_url: str | None = None) -> subprocess.Popen[str]:
    """Start ``orchestrator ARGS`` without waiting (for concurrency tests), with SIGINT's
    default disposition, as at a terminal: a test suite started in the background (``make
    test &``) inherits SIGINT ignored, and the command would then never see a Ctrl-C."""
    return subprocess.Popen(
        [*command(), *args],
        env=cli_env(database_url),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=_default_sigint,  # noqa: PLW1509 - only resets a signal before exec
    )


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)
