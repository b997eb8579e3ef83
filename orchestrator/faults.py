"""Named fault points, for crash tests and for tests that must stop the engine at a moment.

The points sit right after each commit on the effect path (see :data:`POINTS`). Two ways to
arm one:

- **SIGKILL, by environment.** A test starts a worker process with
  ``ORCHESTRATOR_FAULT_POINT=<name>`` (and optionally ``ORCHESTRATOR_FAULT_TOOL=<tool name>``);
  when the worker reaches that point it kills itself with SIGKILL, exactly as a machine failure
  would. With ``ORCHESTRATOR_FAULT_SIGNAL=SIGSTOP`` it stops itself there instead, once (a
  paused process: the test sends SIGCONT when it chooses).
- **A gate, in process.** :func:`arm` returns a :class:`Gate`: each time the engine reaches the
  point (for the given tool, or any) the gate counts it, signals it, and, if it blocks, holds
  the engine there until the test calls :meth:`Gate.release`. The test waits for
  :meth:`Gate.arrived` instead of sleeping and hoping the race went one way.
  :func:`orchestrator.testing.fault_gate` arms one for the body of a ``with`` and always
  disarms it.

Nothing armed, :func:`reach` costs one dict lookup. It returns None, or an awaitable that the
engine awaits at the point (a blocking gate's hold)::

    if (held := faults.reach("after_submitted", tool.name)) is not None:
        await held

The armed points are global to the process, like the environment variables; a gate is
armed by one test and disarmed by it.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from collections.abc import Awaitable, Generator
from typing import Any

POINTS = (
    "after_intent",  # the operation's intent is committed (pending/submitted row written)
    "after_submitted",  # `submitted` is committed; the tool has not been called
    "after_tool_return",  # the tool returned; its receipt is not committed
    "after_receipt",  # the receipt is committed
)


class _Flag:
    """A one-way signal that both threads and event loops can wait for (``await flag``): the
    engine may run on another loop than the test (the sync API's background loop), so waiters
    are woken through their own loop. Awaiting it creates the coroutine only then, so a flag
    handed out and never awaited leaves nothing behind."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = threading.Event()
        self._waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Future[None]]] = []

    def is_set(self) -> bool:
        return self._set.is_set()

    def set(self) -> None:
        with self._lock:
            self._set.set()
            waiters, self._waiters = self._waiters, []
        for loop, future in waiters:
            if not loop.is_closed():
                loop.call_soon_threadsafe(_resolve, future)

    def __await__(self) -> Generator[Any, None, None]:
        return self.wait().__await__()

    async def wait(self) -> None:
        with self._lock:
            if self._set.is_set():
                return
            loop = asyncio.get_running_loop()
            future: asyncio.Future[None] = loop.create_future()
            self._waiters.append((loop, future))
        await future

    def wait_sync(self, timeout: float) -> bool:
        return self._set.wait(timeout)


def _resolve(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class Gate:
    """A fault point armed in this process by :func:`arm`.

    Every arrival of the engine at ``point`` (for ``tool``, or for any tool when ``tool`` is
    None) adds one to :attr:`hits` and sets the arrival signal. A blocking gate then holds
    that engine task at the point until :meth:`release`; once released, the gate holds nothing
    more (later arrivals are still counted). A gate made with ``block=False`` only counts and
    signals.
    """

    def __init__(self, point: str, tool: str | None, *, block: bool) -> None:
        self.point = point
        self.tool = tool
        self.hits = 0
        self._arrived = _Flag()
        self._open = _Flag()
        if not block:
            self._open.set()

    def __repr__(self) -> str:
        tool = "" if self.tool is None else f", tool={self.tool!r}"
        return f"Gate({self.point!r}{tool}, hits={self.hits}, released={self.released})"

    @property
    def released(self) -> bool:
        """True once nothing is held here any more (at once for a gate that does not block)."""
        return self._open.is_set()

    def release(self) -> None:
        """Let every held arrival go on, and every later one pass. Safe from any thread."""
        self._open.set()

    async def arrived(self, timeout: float = 10.0) -> None:
        """Wait until the engine has reached this point at least once; ``AssertionError``
        naming the point after ``timeout`` seconds."""
        try:
            await asyncio.wait_for(self._arrived.wait(), timeout)
        except TimeoutError:
            raise AssertionError(f"{self!r} was not reached within {timeout} s") from None

    def arrived_sync(self, timeout: float = 10.0) -> None:
        """:meth:`arrived` for a test that does not run in an event loop."""
        if not self._arrived.wait_sync(timeout):
            raise AssertionError(f"{self!r} was not reached within {timeout} s")

    def _arrive(self, tool: str) -> Awaitable[None] | None:
        if self.tool is not None and tool != self.tool:
            return None
        self.hits += 1
        self._arrived.set()
        return None if self._open.is_set() else self._open


class _Kill:
    """The environment's point: SIGKILL (or the signal the environment names, sent once)."""

    def __init__(self, tool: str | None, signum: signal.Signals = signal.SIGKILL) -> None:
        self.tool = tool
        self.signum = signum
        self.sent = False

    def _arrive(self, tool: str) -> None:
        if (self.tool is None or self.tool == tool) and not self.sent:
            self.sent = self.signum != signal.SIGKILL
            os.kill(os.getpid(), self.signum)


_armed: dict[str, list[Gate | _Kill]] = {}
_env_point = os.environ.get("ORCHESTRATOR_FAULT_POINT")
if _env_point:
    _armed[_env_point] = [_Kill(os.environ.get("ORCHESTRATOR_FAULT_TOOL"),
                                signal.Signals[os.environ.get("ORCHESTRATOR_FAULT_SIGNAL",
                                                              "SIGKILL")])]


def reach(point: str, tool: str) -> Awaitable[None] | None:
    """The engine reached ``point`` while calling ``tool``: die there if the environment
    armed it; count it for every gate armed there; return what a blocking gate holds the
    engine on (the caller awaits it), else None."""
    hooks = _armed.get(point)
    if hooks is None:
        return None
    held: Awaitable[None] | None = None
    for hook in hooks:
        hold = hook._arrive(tool)
        if held is None:
            held = hold
    return held


def arm(point: str, *, tool: str | None = None, block: bool = True) -> Gate:
    """Arm ``point`` in this process (for ``tool`` only, if given) and return its gate.

    ``ValueError`` for a point that is not in :data:`POINTS`. Several gates may be armed at
    one point (say, for two tools); the engine is held by the first blocking one that holds.
    Call :func:`disarm` when done (or use :func:`orchestrator.testing.fault_gate`).
    """
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}; the points are {', '.join(POINTS)}")
    gate = Gate(point, tool, block=block)
    _armed.setdefault(point, []).append(gate)
    return gate


def disarm(gate: Gate) -> None:
    """Remove ``gate`` from its point and release whatever it still holds."""
    gate.release()
    hooks = _armed.get(gate.point, [])
    if gate in hooks:
        hooks.remove(gate)
    if not hooks:
        _armed.pop(gate.point, None)


# Test-only: re-dispatch consequential operations whose outcome is unknown, as engines without
# an effect ledger do. It exists so that the chaos suite can show that it catches the duplicate
# effects this causes. No configuration or environment variable turns it on: only code that
# assigns it (the chaos suite's own application module does, for its self-test).
UNSAFE_REDISPATCH = False
