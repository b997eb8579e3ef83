"""Which interpreter command lines are ``python -m orchestrator`` (``orchestrator/_early.py``):
only those keep SIGTERM while the package loads."""

from __future__ import annotations

import pytest

from orchestrator._early import running_as_main


@pytest.mark.parametrize(("argv", "expected"), [
    (["python", "-m", "orchestrator", "worker"], True),
    (["python", "-morchestrator", "worker"], True),
    (["python", "-I", "-m", "orchestrator"], True),
    (["python", "-Im", "orchestrator"], True),
    (["python", "-X", "dev", "-W", "error", "-m", "orchestrator"], True),
    (["python", "-Xdev", "-m", "orchestrator"], True),
    (["python", "--check-hash-based-pycs", "always", "-m", "orchestrator"], True),
    (["python", "-m", "orchestrator.cli"], False),
    (["python", "-m", "workers.worker", "-m", "orchestrator"], False),
    (["python", "-m", "otherprog", "orchestrator"], False),
    (["python", "-c", "import orchestrator", "-m", "orchestrator"], False),
    (["python", "script.py", "-m", "orchestrator"], False),
    (["python", "-X", "m", "orchestrator"], False),
    (["python"], False),
])
def test_only_python_m_orchestrator_is_running_as_main(argv, expected):
    assert running_as_main(argv) is expected
