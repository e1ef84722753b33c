"""A call given a time limit from outside: a blocking one run on a daemon thread
(:func:`bounded`), an awaitable run as a task of its own (:func:`bounded_async`); either is
abandoned if it has not finished in time. Each is also written as a start and a wait
(:func:`start` and :meth:`Running.wait`; :func:`bounded_wait`), for a driver that keeps more
than one call in flight.

A blocking call cannot be interrupted from another thread; it can only stop being waited
for. Whatever the abandoned call still returns is handed to ``late`` (a connection opened
after its caller gave up is closed there, for instance), never to the caller, who was told
:data:`OVERDUE` already.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Final, Generic, TypeVar

T = TypeVar("T")

OVERDUE: Final[Any] = object()
"""What :func:`bounded` returns for a call still running at its limit."""


class Running(Generic[T]):
    """A blocking call running on a daemon thread of its own (:func:`start`), to be waited
    for once with :meth:`wait`. Starting and waiting apart lets a driver keep two calls in
    flight (the supervisor's renewal batches) and still give up on each at its own limit."""

    __slots__ = ("_abandoned", "_box", "_done", "_late", "_lock", "_thread")

    def __init__(self, call: Callable[[], T], name: str,
                 late: Callable[[T], object] | None) -> None:
        self._box: list[T | BaseException] = []
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._abandoned = False
        self._late = late
        self._thread = threading.Thread(target=self._run, args=(call,), daemon=True,
                                        name=name)
        self._thread.start()

    def _run(self, call: Callable[[], T]) -> None:
        outcome: T | BaseException
        try:
            outcome = call()
        except BaseException as error:
            outcome = error
        with self._lock:
            self._box.append(outcome)
            too_late = self._abandoned
        self._done.set()
        if too_late and self._late is not None and not isinstance(outcome, BaseException):
            self._late(outcome)

    def done(self) -> bool:
        """Whether the call has ended (its thread has nothing left to run but ``late``)."""
        return self._done.is_set()

    def ended(self, timeout: float) -> bool:
        """Whether the call ends within ``timeout`` seconds, waiting that long at most and
        giving up on nothing (:meth:`wait` then answers at once)."""
        return self._done.wait(max(timeout, 0.0))

    def wait(self, timeout: float) -> T | BaseException:
        """The call's result, the exception it raised, or :data:`OVERDUE` if it is still
        running after ``timeout`` seconds (it is then abandoned: a result that arrives later
        goes to ``late``)."""
        if not self._done.wait(max(timeout, 0.0)):
            with self._lock:
                if not self._box:  # not finished in the meantime
                    self._abandoned = True
                    overdue: T | BaseException = OVERDUE
                    return overdue
        # Finished and not abandoned: its thread has nothing left to do but end. Joined, so
        # that a driver starting its next call right away never runs two threads at once
        # (the supervisor holds its threads to three).
        self._thread.join()
        return self._box[0]


def start(call: Callable[[], T], *, name: str,
          late: Callable[[T], object] | None = None) -> Running[T]:
    """Start ``call`` on a daemon thread named ``name``; :meth:`Running.wait` for it."""
    return Running(call, name, late)


def bounded(call: Callable[[], T], timeout: float, *, name: str,
            late: Callable[[T], object] | None = None) -> T | BaseException:
    """Run ``call`` on a daemon thread named ``name``: its result, the exception it raised,
    or :data:`OVERDUE` if it is still running after ``timeout`` seconds. A result that
    arrives after that goes to ``late``."""
    return Running(call, name, late).wait(timeout)


async def bounded_async(call: Awaitable[T], timeout: float,
                        keep: set[asyncio.Future[Any]], *,
                        log: logging.Logger | None = None) -> T | Exception:
    """Run ``call`` as a task of its own, waited for rather than awaited under a timeout (a
    cancelled call ends only once the caller lets go of it): its result, the exception it
    raised, or :data:`OVERDUE` if it is still running after ``timeout`` seconds.

    A call still running at its limit, or when the caller is cancelled (the cancellation is
    raised on), is cancelled and abandoned: its result is never looked at; it stays in
    ``keep`` until it ends (a task nobody references may be collected mid-run), and its
    outcome is retrieved so asyncio does not log it as never retrieved (``log``, if given,
    notes an exception it ended with).
    """
    return await bounded_wait(asyncio.ensure_future(call), timeout, keep, log=log)


async def bounded_wait(running: asyncio.Future[T], timeout: float,
                       keep: set[asyncio.Future[Any]], *,
                       log: logging.Logger | None = None) -> T | Exception:
    """The waiting half of :func:`bounded_async`, for a call started already (so that a
    driver can keep two in flight): wait for ``running`` until ``timeout`` seconds from now,
    abandoning it as :func:`bounded_async` does."""
    try:
        done, _ = await asyncio.wait((running,), timeout=min(max(timeout, 0.0), 1e9))
    except asyncio.CancelledError:
        abandon(running, keep, log)
        raise
    if not done:
        abandon(running, keep, log)
        overdue: T | Exception = OVERDUE
        return overdue
    try:
        return running.result()
    except Exception as error:
        return error


def abandon(running: asyncio.Future[Any], keep: set[asyncio.Future[Any]],
            log: logging.Logger | None = None) -> None:
    """Cancel ``running`` and never look at its result; it stays in ``keep`` until it ends
    (a started call its driver will not wait for any more)."""
    def forget(ended: asyncio.Future[Any]) -> None:
        keep.discard(ended)
        if not ended.cancelled() and (error := ended.exception()) is not None and log:
            log.info("mos_lease: abandoned call ended with %r", error)

    keep.add(running)
    running.add_done_callback(forget)
    running.cancel()
