"""A private event loop on a daemon thread, so sync methods can share the async code.

A sync method waits in its caller's thread, blocking whatever loop runs there. That is only
slow in async code of one's own (a notebook's cell, a script's ``asyncio.run``), but on a loop
where a worker or a reconciler of this process runs it stops them, and ``run.result()`` there
would wait for ever for a run that cannot go on: refused (:func:`check_sync_caller`)."""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import threading
import weakref
from collections.abc import Callable, Coroutine, Iterator
from typing import Any, TypeVar

from orchestrator.errors import InvalidRequest

T = TypeVar("T")


# The loops where a worker or a reconciler of this process runs, with how many run there.
_SERVING: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, int] = (
    weakref.WeakKeyDictionary())


@contextlib.contextmanager
def serving() -> Iterator[None]:
    """Mark the running loop as one a worker or a reconciler runs on, while it does."""
    loop = asyncio.get_running_loop()
    _SERVING[loop] = _SERVING.get(loop, 0) + 1
    try:
        yield
    finally:
        left = _SERVING.get(loop, 1) - 1
        if left:
            _SERVING[loop] = left
        else:
            _SERVING.pop(loop, None)


def check_sync_caller(instead: str) -> None:
    """Refuse a sync method on an event loop where a worker or a reconciler of this process
    runs (tool code, a test or a program that runs its worker in its own loop).

    The method would wait in this thread and so block that loop, and the worker with it:
    ``run.result()`` would wait for ever for a run that cannot finish, and every run's lease
    would go unrenewed meanwhile. ``INVALID_REQUEST`` instead, saying what to write there
    (``instead``: "await RunHandle.result_async()"). Elsewhere (a script, a notebook's loop)
    the call waits as it always did."""
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        return
    if loop in _SERVING:
        raise InvalidRequest(f"a sync method was called on the event loop a worker or a "
                             f"reconciler runs on, which waiting here would stop: {instead} "
                             "instead")


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

    def call(self, coro: Coroutine[Any, Any, T], *, instead: str | None = None) -> T:
        """Run ``coro`` on the private loop and wait for its result in this thread; refused
        on a worker's loop (:func:`check_sync_caller`, with ``instead``, else awaiting
        ``coro``'s function) and on the private loop itself (it would wait for itself)."""
        name = getattr(coro, "__qualname__", "the method's _async twin")  # "RunHandle.info_async"
        loop = self._ensure()
        try:
            check_sync_caller(instead or f"await {name}()")
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                running = None
            if running is loop:
                raise InvalidRequest("a sync method was called on its own private loop: "
                                     f"{instead or f'await {name}()'} instead")
        except InvalidRequest:
            coro.close()
            raise
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result()
        except BaseException:
            # Interrupted here (Ctrl-C during run.result()): the coroutine stops with the
            # wait instead of going on, unseen, on the private loop. (Once it is done, this
            # does nothing.)
            future.cancel()
            raise

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
