"""When the operation a store call serves began, for stores that bound their calls in time.

A store that bounds its calls (the PostgreSQL stores: ``ConnectionSettings.call_bound``)
counts each call's bound from the moment it is called. A validation is one answer for its
caller, though: the read and, when it is denied, the audit append of the denial. So the
coordinator sets a validation's start in :data:`SHARED_START` (``time.monotonic()``
seconds) while it runs, and such a store counts every call made meanwhile from that start:
a validation that cannot get its read through fails closed within one bound, and the
denial's audit append only gets what is left of it (a log line records a denial it could not
append). The coordinator sets it only for a store whose class says ``shares_bound = True``
(nothing is paid for the others, such as the in-memory store). A context variable, so
that concurrent asyncio tasks and threads each see their own operation's start.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from typing import Final

SHARED_START: Final[ContextVar[float | None]] = ContextVar("mos_lease_shared_start",
                                                           default=None)


def call_deadline(bound: float) -> float:
    """The deadline of a store call made now whose own bound is ``bound`` seconds: counted
    from the shared start, if one is set, else from now."""
    start = SHARED_START.get()
    return (time.monotonic() if start is None else start) + bound


def time_left(bound: float) -> float:
    """Seconds left of a store call's ``bound`` made now: all of it, or what the shared
    start left of it. A store that reads deadlines on a clock of its own adds this to its
    clock's reading, so both agree whichever monotonic clock each reads."""
    start = SHARED_START.get()
    return bound if start is None else start + bound - time.monotonic()
