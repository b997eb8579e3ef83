"""A private event loop on a daemon thread, so sync methods can share the async code."""

from __future__ import annotations

import asyncio
import atexit
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


class Portal:
    """Runs coroutines on one background loop and waits for them from any thread."""

    def __init__(self, finalizer: Callable[[], Coroutine[Any, Any, Any]] | None = None) -> None:
        self._finalizer = finalizer
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def _ensure(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="orchestrator-sync",
                                          daemon=True)
                thread.start()
                self._loop, self._thread = loop, thread
                atexit.register(self.close)
            return self._loop

    def call(self, coro: Coroutine[Any, Any, T]) -> T:
        loop = self._ensure()
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:  # pragma: no cover - would deadlock
            coro.close()
            raise RuntimeError("a sync orchestrator method was called from its own loop")
        return asyncio.run_coroutine_threadsafe(coro, loop).result()

    def close(self) -> None:
        """Run the finalizer (e.g. closing pools) on the loop, then stop the loop."""
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None:
            return
        atexit.unregister(self.close)
        if self._finalizer is not None:
            try:
                asyncio.run_coroutine_threadsafe(self._finalizer(), loop).result(timeout=10)
            except Exception:  # noqa: BLE001 - best effort at shutdown
                pass
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(timeout=5)
        loop.close()
