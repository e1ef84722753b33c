"""A client-side deadline on every call, whatever the network does.

The server bounds a statement by ``statement_timeout``, but only once the statement reached
it, and only if its answer can come back: through a half-open or silent network libpq waits
for a reply forever (TCP keepalives and ``tcp_user_timeout`` close such a socket eventually,
but in tens of seconds, and not at all while the kernel keeps acknowledging). So each call
arms a watch on its connection. If the call has not finished shortly before its deadline,
the watch fires: it asks the server to cancel the statement (``cancel_safe``, public, with a
short timeout of its own) and then shuts the socket down, which wakes the waiting call with
a connection error. The caller then discards the connection: a connection whose reply is
still outstanding is never used again.

The socket is shut down through a duplicate of its descriptor (``os.dup``): ``shutdown``
acts on the socket itself, so the waiter's ``poll`` wakes, while the descriptor libpq owns
is left for libpq to close (closing it under another thread's ``poll`` would be a race).

Sync calls are watched by one daemon thread per process, which sleeps while nothing is
armed; each sync connection has one :class:`Watch`, armed again for each of its calls.
Async calls are watched by a timer on their own event loop. Either watch is a context
manager around a statement (``with watch.arm(...)``, ``async with AsyncWatch(...)``):
leaving it disarms the watch and, if it fired, closes the connection. Deadlines are read on
the monotonic clock the store was given (``mos_lease.clock``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import threading
import time
from types import TracebackType
from typing import Any, Final, Self

import psycopg

from mos_lease.clock import MonotonicClock, default_clock

# How often the watchdog thread looks at the armed watches while any is armed: the bound
# on how late a watch fires.
_TICK: Final = 0.02
_ARMED, _DONE, _FIRED = 0, 1, 2


def grace(call_timeout: float) -> float:
    """How long before its deadline a watch fires: the time the cancel request may take."""
    return min(0.5, call_timeout / 4)


def shut_down(conn: psycopg.Connection[Any] | psycopg.AsyncConnection[Any]) -> None:
    """Shut the connection's socket down so that a call waiting on it fails now."""
    with contextlib.suppress(OSError, psycopg.Error):
        dup = socket.socket(fileno=os.dup(conn.fileno()))
        try:
            dup.shutdown(socket.SHUT_RDWR)
        finally:
            dup.close()


class Watch:
    """The deadline watch of one sync connection, armed around each of its statements.

    One per connection, made when the connection is, and armed again for every call
    (:meth:`arm`), so a call builds no watch of its own. :meth:`done` disarms it;
    afterwards :attr:`fired` says whether the connection must be discarded. ``clock`` is the
    monotonic clock the deadlines are read on (the store's)."""

    __slots__ = ("_claimed", "_clock", "_conn", "_dog", "_lock", "_state", "cancel_timeout",
                 "fire_at", "generation")

    def __init__(self, conn: psycopg.Connection[Any], clock: MonotonicClock,
                 dog: Watchdog) -> None:
        self._conn = conn
        self._clock = clock
        self._dog = dog
        self._lock = threading.Lock()
        self._state = _DONE
        self.fire_at = 0.0
        self.cancel_timeout = 0.0
        # Counts the armings: a firing decided for one call never cuts a later call short.
        self.generation = 0
        self._claimed = 0  # the last arming the watchdog decided to fire

    def arm(self, deadline: float, call_timeout: float) -> Self:
        """Watch one call whose deadline is ``deadline`` (on the watch's clock)."""
        cancel = grace(call_timeout)
        with self._lock:
            self.fire_at = deadline - cancel
            self.cancel_timeout = cancel
            self.generation += 1
            self._state = _ARMED
        self._dog.watch(self)
        return self

    def due(self) -> int | None:
        """The arming to fire now, once: its generation, read with its deadline (a call
        that ends and arms again meanwhile is a new arming, judged on its own deadline)."""
        # Never waits: a firing in progress holds the lock for up to its grace, and the
        # watchdog must not make the other watches late meanwhile.
        if not self._lock.acquire(blocking=False):
            return None
        try:
            if (self._state != _ARMED or self._claimed == self.generation
                    or self._clock() < self.fire_at):
                return None
            self._claimed = self.generation
            return self.generation
        finally:
            self._lock.release()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.done()
        if self._state == _FIRED:
            self._conn.close()  # its reply may still be outstanding: never reuse it

    @property
    def fired(self) -> bool:
        return self._state == _FIRED

    def done(self) -> None:
        """Disarm. Waits for a firing in progress (at most the cancel's grace), so that the
        socket is never shut down under the next call on the same connection."""
        with self._lock:
            if self._state == _ARMED:
                self._state = _DONE
        self._dog.unwatch(self)

    def fire(self, generation: int) -> None:
        with self._lock:
            if self._state != _ARMED or self.generation != generation:
                return
            self._state = _FIRED
            with contextlib.suppress(psycopg.Error, OSError):
                self._conn.cancel_safe(timeout=self.cancel_timeout)
            shut_down(self._conn)


class Watchdog:
    """The process's watcher of sync calls (see the module docstring)."""

    def __init__(self) -> None:
        self._armed: dict[int, Watch] = {}
        self._work = threading.Event()
        self._start = threading.Lock()
        self._thread: threading.Thread | None = None

    def arm(self, conn: psycopg.Connection[Any], deadline: float, call_timeout: float,
            clock: MonotonicClock = default_clock) -> Watch:
        """A watch of its own for one statement on ``conn`` (a connection's checks before
        its first call; the store's calls use the connection's reusable watch)."""
        return Watch(conn, clock, self).arm(deadline, call_timeout)

    def watch(self, watch: Watch) -> None:
        self._armed[id(watch)] = watch
        if self._thread is None:
            self._launch()
        if not self._work.is_set():
            self._work.set()

    def unwatch(self, watch: Watch) -> None:
        self._armed.pop(id(watch), None)

    def disarm(self, watch: Watch) -> None:
        watch.done()

    def _launch(self) -> None:
        with self._start:
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="mos-lease-watchdog",
                                                daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        while True:
            self._work.wait()
            if not self._armed:
                self._work.clear()
                # A watch armed between the check and the clear set the event again.
                if not self._armed:
                    continue
                self._work.set()
            for watch in list(self._armed.values()):
                generation = watch.due()
                if generation is not None:
                    # Its own thread: a cancel request waiting on a silent network must
                    # not make the other watches fire late. The watch stays listed until
                    # its call disarms it (an arming is claimed once, see Watch.due).
                    threading.Thread(target=watch.fire, args=(generation,),
                                     name="mos-lease-watch-fire", daemon=True).start()
            time.sleep(_TICK)


WATCHDOG: Final = Watchdog()


class AsyncWatch:
    """One call's deadline on one async connection, a timer on the running loop; as
    :class:`Watch`, an (async) context manager."""

    __slots__ = ("_conn", "_handle", "_task", "fired")

    def __init__(self, conn: psycopg.AsyncConnection[Any], deadline: float,
                 call_timeout: float, clock: MonotonicClock = default_clock) -> None:
        self._conn = conn
        self.fired = False
        self._task: asyncio.Task[None] | None = None
        loop = asyncio.get_running_loop()
        # The loop's clock is monotonic too: a delay read on ``clock`` is one on the loop's.
        delay = max(0.0, deadline - grace(call_timeout) - clock())
        self._handle = loop.call_later(delay, self._fire, grace(call_timeout))

    def _fire(self, cancel_timeout: float) -> None:
        self.fired = True
        self._task = asyncio.get_running_loop().create_task(self._cut(cancel_timeout))

    async def _cut(self, cancel_timeout: float) -> None:
        with contextlib.suppress(psycopg.Error, OSError):
            await self._conn.cancel_safe(timeout=cancel_timeout)
        shut_down(self._conn)

    async def done(self) -> None:
        self._handle.cancel()
        if self._task is not None:
            # Finish cutting before the caller discards the connection (bounded by grace).
            await self._task

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        try:
            await self.done()
        finally:
            # Closed even when the caller is cancelled while the cut finishes: its reply may
            # still be outstanding (close does not suspend, so it always completes).
            if self.fired:
                await self._conn.close()
