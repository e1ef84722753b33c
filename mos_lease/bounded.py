"""A blocking call given a time limit from outside: run on a daemon thread and abandoned
if it has not finished in time.

A blocking call cannot be interrupted from another thread; it can only stop being waited
for. Whatever the abandoned call still returns is handed to ``late`` (a connection opened
after its caller gave up is closed there, for instance), never to the caller, who was told
:data:`OVERDUE` already.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
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
