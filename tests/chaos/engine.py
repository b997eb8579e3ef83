"""Running the chaos harness against a committed engine instead of the work tree.

Other people edit ``orchestrator/`` while a long chaos run goes on; ``--engine REF`` exports
that revision's ``orchestrator/`` and ``migrations/`` (``git archive``) to a folder that also
links to this ``tests/``, and the harness, its workers and its reconciler all import the
engine from there.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def snapshot(ref: str) -> tuple[Path, str]:
    """Export ``ref``'s engine; returns (folder, commit). Reused when it already exists."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{ref}^{{commit}}"], cwd=ROOT,
                         capture_output=True, text=True, check=True).stdout.strip()
    folder = Path(tempfile.gettempdir()) / f"chaos-engine-{sha[:12]}"
    if not (folder / "orchestrator").exists():
        staging = Path(tempfile.mkdtemp(prefix="chaos-engine-"))
        archive = subprocess.run(["git", "archive", sha, "orchestrator", "migrations"],
                                 cwd=ROOT, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(staging)], input=archive, check=True)
        # What the package build maps: migrations/ ships as orchestrator._migrations.
        (staging / "orchestrator" / "_migrations").symlink_to("../migrations")
        (staging / "tests").symlink_to(ROOT / "tests")
        if folder.exists():
            shutil.rmtree(folder)
        staging.rename(folder)
    return folder, sha


def reexec_with(ref: str, argv: list[str]) -> None:
    """Replace this process by ``python -m tests.chaos argv`` importing ``ref``'s engine."""
    folder, sha = snapshot(ref)
    print(f"chaos: engine {sha} exported to {folder}", flush=True)
    env = {**os.environ, "CHAOS_ENGINE_DIR": str(folder), "CHAOS_ENGINE_COMMIT": sha,
           "PYTHONPATH": os.pathsep.join([str(folder), str(ROOT)])}
    os.chdir(folder)
    os.execve(sys.executable, [sys.executable, "-m", "tests.chaos", *argv], env)
