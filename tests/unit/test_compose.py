"""docker-compose.yml against the code: its commands parse as the CLI takes them, and a
container is given the time its process needs to stop cleanly (Docker sends SIGTERM, then
SIGKILL once the service's ``stop_grace_period`` has passed: 10 s unless it says otherwise)."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from typing import Any

import yaml

from orchestrator import cli, reconcile, worker
from orchestrator.app import Orchestrator
from tests.unit.test_named_commands import problem

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DOCKER_DEFAULT_GRACE = 10.0


def _services() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())["services"]


def _seconds(duration: str) -> float:
    """A compose duration (``45s``, ``1m30s``) in seconds."""
    units = {"h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
    parts = re.findall(r"(\d+(?:\.\d+)?)(ms|h|m|s)", duration)
    assert parts and "".join(n + u for n, u in parts) == duration, duration
    return sum(float(n) * units[u] for n, u in parts)


def test_every_service_command_parses() -> None:
    for name, service in _services().items():
        command = service.get("command")
        if command and command[0] == "orchestrator":
            assert problem(" ".join(command)) is None, name


def test_a_stopping_worker_is_not_killed_in_its_drain() -> None:
    service = _services()["worker"]
    args = cli.build_parser().parse_args(service["command"][1:])
    needs = args.drain_timeout + worker.COMPANION_GRACE + worker.WRITE_GRACE
    grace = _grace(service)
    assert grace > needs, f"SIGKILL after {grace} s, while a drain may take {needs} s"


def test_a_stopping_reconciler_is_not_killed_in_its_last_lookup() -> None:
    """A stopping reconciler lets the lookup under way answer (up to the lookup timeout the
    command runs with: ``run_reconciler``'s default) and records the answer."""
    service = _services()["reconciler"]
    cli.build_parser().parse_args(service["command"][1:])
    timeout = inspect.signature(Orchestrator.run_reconciler).parameters["lookup_timeout"]
    needs = timeout.default + reconcile.STOP_GRACE
    grace = _grace(service)
    assert grace > needs, f"SIGKILL after {grace} s, while a stop may take {needs} s"


def _grace(service: dict[str, Any]) -> float:
    """Seconds Docker waits between SIGTERM and SIGKILL for ``service``."""
    if "stop_grace_period" in service:
        return _seconds(service["stop_grace_period"])
    return DOCKER_DEFAULT_GRACE
