"""A sampling profile of one worker process during a throughput drain (py-spy, no restart).

``py-spy record --format raw`` writes collapsed stacks; we fold them into the functions where
the worker spends its own time (leaf frames) and the engine functions that hold the most time
including what they call. Only samples of a thread holding the GIL count (``--gil``): that
leaves out the event loop waiting on its sockets, and also a process that is runnable but
not running. Without it, on a machine whose cores the server and the workers share, a third
of the samples fell in psycopg's ``_send_query_prepared``: the ``send()`` wakes the server's
backend, which takes the core, and the worker waits there for its turn (its system time, which
``send()`` is, was 5 µs of the 105 µs a K = 3 step costs it).
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import shutil
import signal
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import ROOT

_FRAME = re.compile(r"^(?P<fn>.*?) \((?P<file>[^()]*?)(?::\d+)?\)$")


def py_spy() -> str | None:
    exe = Path(sys.executable).parent / "py-spy"
    return str(exe) if exe.exists() else shutil.which("py-spy")


class Recorder:
    """``async with Recorder(pid) as rec: …``; then ``rec.summary()``."""

    def __init__(self, pid: int, rate: int = 250, keep: Path | None = None) -> None:
        self.pid = pid
        self.rate = rate
        self.keep = keep  # where to copy py-spy's collapsed stacks (a flame graph's input)
        self.output = Path(tempfile.mkdtemp(prefix="bench-pyspy-")) / "stacks.txt"
        self.proc: asyncio.subprocess.Process | None = None
        self.stderr = ""

    async def __aenter__(self) -> Recorder:
        exe = py_spy()
        if exe is None:
            raise RuntimeError("py-spy is not installed (pip install '.[bench]')")
        self.proc = await asyncio.create_subprocess_exec(
            exe, "record", "--pid", str(self.pid), "--rate", str(self.rate), "--format", "raw",
            "--output", str(self.output), "--nonblocking", "--gil",
            stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE)
        await asyncio.sleep(0.5)  # let it attach
        if self.proc.returncode is not None:
            raise RuntimeError("py-spy could not attach: "
                               + (await self.proc.stderr.read()).decode()[-300:])  # type: ignore[union-attr]
        return self

    async def __aexit__(self, *exc: Any) -> None:
        if self.proc is None:
            return
        with contextlib.suppress(ProcessLookupError):
            self.proc.send_signal(signal.SIGINT)
        try:
            _, err = await asyncio.wait_for(self.proc.communicate(), 30)
            self.stderr = err.decode(errors="replace")
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()

    def summary(self, top: int = 15) -> dict[str, Any]:
        if not self.output.exists():
            raise RuntimeError(f"py-spy wrote nothing: {self.stderr[-300:]}")
        own: Counter[str] = Counter()
        packages: Counter[str] = Counter()
        inclusive: Counter[str] = Counter()
        total = 0
        for line in self.output.read_text().splitlines():
            stack, _, count_text = line.rpartition(" ")
            if not stack or not count_text.isdigit():
                continue
            count = int(count_text)
            total += count
            frames = [_name(f) for f in stack.split(";") if f]
            if frames:
                own[frames[-1]] += count
                packages[_package(frames[-1])] += count
            for name in set(frames):
                if "orchestrator/" in name or "bench/" in name:
                    inclusive[name] += count
        if self.keep is not None:
            shutil.copyfile(self.output, self.keep)
        shutil.rmtree(self.output.parent, ignore_errors=True)
        return {"samples": total,
                "packages": [(n, c / total) for n, c in packages.most_common(top)]
                if total else [],
                "self": [(n, c / total) for n, c in own.most_common(top)] if total else [],
                "inclusive": [(n, c / total) for n, c in inclusive.most_common(top)]
                if total else []}


def _name(frame: str) -> str:
    frame = frame.strip()
    match = _FRAME.match(frame)
    if not match:
        return frame
    path = match.group("file")
    stdlib = f"lib/python{sys.version_info.major}.{sys.version_info.minor}/"
    for marker in ("site-packages/", stdlib, f"{ROOT}/"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{match.group('fn')} ({path})"


def _package(name: str) -> str:
    """``fn (psycopg/_cursor_base.py)`` → ``psycopg``; the standard library by module."""
    path = name.rpartition(" (")[2].rstrip(")")
    head = path.split("/", 1)[0]
    return head.removesuffix(".py") or path
