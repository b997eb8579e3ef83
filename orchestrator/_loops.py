"""One object per event loop: what the readers of one database share within a loop (the
event streams' poller, ``orchestrator.stream``; the result waits', ``orchestrator.waiting``).

An asyncio object belongs to the loop that made it, and an application is used from several
(the caller's, the sync portal's thread, each test's): each loop gets its own, made on first
use, forgotten with the loop.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Awaitable, Callable
from typing import Generic, Protocol, TypeVar


class Closable(Protocol):
    def close(self) -> Awaitable[None]: ...


P = TypeVar("P", bound=Closable)


class PerLoop(Generic[P]):
    """The running loop's ``P`` (:meth:`get`), made by ``make`` on first use."""

    def __init__(self, make: Callable[[], P]) -> None:
        self._make = make
        self._by_loop: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, P] = (
            weakref.WeakKeyDictionary())

    def get(self) -> P:
        loop = asyncio.get_running_loop()
        found = self._by_loop.get(loop)
        if found is None:
            found = self._by_loop[loop] = self._make()
        return found

    def values(self) -> list[P]:
        """Every loop's, as they stand now."""
        return list(self._by_loop.values())

    async def close(self) -> None:
        """Close and forget the running loop's (the others are closed in their loops)."""
        found = self._by_loop.pop(asyncio.get_running_loop(), None)
        if found is not None:
            await found.close()
