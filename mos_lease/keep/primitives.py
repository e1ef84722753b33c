"""Where the thread and the asyncio supervisor differ, each difference behind one small pair
with the same call shape, so that the supervisor itself is written once
(:mod:`mos_lease.keep.runner`); the store calls, the third such pair, are
:mod:`mos_lease.keep.calls`'s:

* :class:`Wakeup` / :class:`AsyncWakeup`: the loop's sleep, ended early by an ``add()``, a
  ``close()`` or the notice confirmer's thread (``set_from_thread``);
* :class:`Worker` / :class:`AsyncWorker`: the one thread, or task, the loop runs on.

The asyncio runner is the source; ``tools/async_to_sync.py`` generates the thread one from
it, dropping ``async`` and ``await`` and naming the synchronous twin of each pair.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Callable, Coroutine
from typing import Any

from mos_lease.keep.calls import NAME


class Wakeup:
    """The thread supervisor's sleep: :meth:`wait` ends early once :meth:`set` is called,
    from any thread."""

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event = threading.Event()

    def set(self) -> None:
        self._event.set()

    def set_from_thread(self) -> bool:
        """:meth:`set`, from another thread; whether the loop could be woken."""
        self._event.set()
        return True

    def clear(self) -> None:
        self._event.clear()

    def wait(self, seconds: float) -> None:
        self._event.wait(min(seconds, threading.TIMEOUT_MAX))  # math.inf is too long for it


class AsyncWakeup:
    """The asyncio supervisor's sleep: :meth:`wait` ends early once :meth:`set` is called on
    the loop, or :meth:`set_from_thread` from another thread. The event belongs to the loop
    of the first :meth:`set` made on one (the first ``add()``): another thread wakes it
    through that loop."""

    __slots__ = ("_event", "_loop")

    def __init__(self) -> None:
        self._event = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None

    def set(self) -> None:
        self._event.set()
        if self._loop is None:
            with contextlib.suppress(RuntimeError):  # driven by hand, outside a loop
                self._loop = asyncio.get_running_loop()

    def set_from_thread(self) -> bool:
        loop = self._loop
        if loop is None:
            return False
        try:
            loop.call_soon_threadsafe(self._event.set)
        except RuntimeError:  # the loop has closed: nobody will make the read
            return False
        return True

    def clear(self) -> None:
        self._event.clear()

    async def wait(self, seconds: float) -> None:
        if math.isinf(seconds):
            await self._event.wait()
            return
        try:
            async with asyncio.timeout(seconds):
                await self._event.wait()
        except TimeoutError:
            pass


class Worker:
    """The thread the thread supervisor's loop runs on, started by the first ``add()``."""

    __slots__ = ("_lock", "_thread")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def start(self, run: Callable[[], object], name: str = NAME) -> None:
        """Run ``run`` on a daemon thread named ``name``, unless it was started already."""
        if self._thread is None:
            with self._lock:  # two threads adding the first bindings start one thread
                if self._thread is None:
                    self._thread = threading.Thread(target=run, daemon=True, name=name)
                    self._thread.start()

    def stop(self, timeout: float | None) -> None:
        """Wait for the thread to end (it was told to: the supervisor is closing), at most
        ``timeout`` seconds; not on the thread itself."""
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)


class AsyncWorker:
    """The task the asyncio supervisor's loop runs as, started by the first ``add()``."""

    __slots__ = ("_task",)

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None

    def start(self, run: Callable[[], Coroutine[Any, Any, None]], name: str = NAME) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(run(), name=name)

    async def stop(self, timeout: float | None) -> None:
        """Cancel the task and wait for it to end, at most ``timeout`` seconds; not from
        the task itself."""
        task = self._task
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            # Waited for without awaiting it, so a cancellation of the caller is not lost
            # (the asyncio keeper's stop() explains why).
            await asyncio.wait((task,), timeout=timeout)
