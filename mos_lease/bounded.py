"""A call given a time limit from outside: a blocking one run on a daemon thread
(:func:`bounded`), an awaitable run as a task of its own (:func:`bounded_async`); either is
abandoned if it has not finished in time.

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
from typing import Any, Final, TypeVar

T = TypeVar("T")

OVERDUE: Final[Any] = object()
"""What :func:`bounded` returns for a call still running at its limit."""


def bounded(call: Callable[[], T], timeout: float, *, name: str,
            late: Callable[[T], object] | None = None) -> T | BaseException:
    """Run ``call`` on a daemon thread named ``name``: its result, the exception it raised,
    or :data:`OVERDUE` if it is still running after ``timeout`` seconds. A result that
    arrives after that goes to ``late``."""
    box: list[T | BaseException] = []
    lock = threading.Lock()
    done = threading.Event()
    abandoned = False

    def run() -> None:
        outcome: T | BaseException
        try:
            outcome = call()
        except BaseException as error:
            outcome = error
        with lock:
            box.append(outcome)
            too_late = abandoned
        done.set()
        if too_late and late is not None and not isinstance(outcome, BaseException):
            late(outcome)

    threading.Thread(target=run, daemon=True, name=name).start()
    if not done.wait(max(timeout, 0.0)):
        with lock:
            if not box:  # not finished in the meantime
                abandoned = True
                overdue: T | BaseException = OVERDUE
                return overdue
    return box[0]


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
    running = asyncio.ensure_future(call)
    try:
        done, _ = await asyncio.wait((running,), timeout=min(max(timeout, 0.0), 1e9))
    except asyncio.CancelledError:
        _abandon(running, keep, log)
        raise
    if not done:
        _abandon(running, keep, log)
        overdue: T | Exception = OVERDUE
        return overdue
    try:
        return running.result()
    except Exception as error:
        return error


def _abandon(running: asyncio.Future[Any], keep: set[asyncio.Future[Any]],
             log: logging.Logger | None) -> None:
    def forget(ended: asyncio.Future[Any]) -> None:
        keep.discard(ended)
        if not ended.cancelled() and (error := ended.exception()) is not None and log:
            log.info("mos_lease: abandoned call ended with %r", error)

    keep.add(running)
    running.add_done_callback(forget)
    running.cancel()
