"""The bench's CPU accounting: a process's time split into user and system (kernel) time, the
split the bench prints per step (on loopback TCP a ``send()`` does the receiver's work too)."""

from __future__ import annotations

import os
import sys

import pytest

from bench.common import CpuMeter, cpu_seconds, cpu_split

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def _burn_user(seconds: float) -> None:
    start = sum(cpu_split(os.getpid()) or (0.0, 0.0))
    n = 0
    while sum(cpu_split(os.getpid()) or (0.0, 0.0)) - start < seconds:
        for i in range(20_000):
            n += i * i


def _burn_system(seconds: float) -> None:
    start = (cpu_split(os.getpid()) or (0.0, 0.0))[1]
    with open("/dev/zero", "rb", buffering=0) as zero:
        while (cpu_split(os.getpid()) or (0.0, 0.0))[1] - start < seconds:
            for _ in range(200):
                zero.read(1 << 20)


def test_a_process_cpu_time_is_its_user_and_system_time() -> None:
    split = cpu_split(os.getpid())
    assert split is not None
    total = cpu_seconds(os.getpid())
    assert total is not None and total >= split[0] + split[1] - 0.05


def test_the_meter_keeps_the_kernel_part_of_each_kind() -> None:
    meter = CpuMeter()
    pids = {"self": [os.getpid()], "remote": []}
    meter.start(pids)
    _burn_system(0.2)
    _burn_user(0.2)
    meter.stop(pids)
    assert "remote" not in meter.used and "remote" not in meter.system
    assert meter.system["self"] >= 0.15
    assert meter.used["self"] - meter.system["self"] >= 0.15
