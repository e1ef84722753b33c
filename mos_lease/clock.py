"""The library's clocks: the monotonic clock deadlines and in-flight times are measured on,
and the wall clocks of the in-memory store, which is its own time authority (this process's
clock, or a manual one for tests, demos and simulations)."""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Final, Protocol

MonotonicClock = Callable[[], float]
"""Seconds on a clock that never jumps: how long a store call was in flight is measured
on it (and keepers keep their deadlines on it). Injectable, so tests can make a reply slow
without sleeping."""


# ``CLOCK_MONOTONIC`` stops while a machine is suspended; a lease's expiry in the store does
# not. ``CLOCK_BOOTTIME`` (Linux) counts suspended time, so time spent suspended counts as
# time elapsed, whether a keeper's deadline or a reply in flight is being judged.
# A partial of the C function, not a Python wrapper: it is read several times per call
# (deadlines, time in flight), and a Python frame costs more than the clock read itself.
default_clock: Final[MonotonicClock] = (
    functools.partial(time.clock_gettime, time.CLOCK_BOOTTIME)
    if hasattr(time, "CLOCK_BOOTTIME") else time.monotonic)
"""Monotonic seconds that keep counting through suspend where the platform allows."""


class Clock(Protocol):
    """What the in-memory store reads its time from."""

    def now(self) -> datetime:
        """The store's current time, timezone-aware."""
        ...


class SystemClock:
    """Wall-clock UTC time of this process: right for a store embedded in one process."""

    def now(self) -> datetime:
        """This process's wall-clock time, in UTC."""
        return datetime.now(UTC)


class ManualClock:
    """A clock that moves only when told to; for tests, demos and simulations."""

    def __init__(self, start: datetime | None = None) -> None:
        self._now = start if start is not None else datetime(2030, 1, 1, tzinfo=UTC)
        if self._now.tzinfo is None:
            raise ValueError("ManualClock needs a timezone-aware start")
        self._lock = threading.Lock()

    def now(self) -> datetime:
        """The clock's time, which moves only by :meth:`advance`."""
        with self._lock:
            return self._now

    def advance(self, by: timedelta | float) -> datetime:
        """Move the clock forward by ``by`` (a ``timedelta`` or seconds) and return the new
        time; a negative step raises ``ValueError``."""
        step = by if isinstance(by, timedelta) else timedelta(seconds=by)
        if step < timedelta(0):
            raise ValueError("time does not go backwards")
        with self._lock:
            self._now += step
            return self._now

    def step_back(self, by: timedelta | float) -> datetime:
        """Move the clock backwards, as a failover to a host whose clock is behind or a bad
        NTP step moves a store's clock: what ``clock_behind`` refusals are about."""
        step = by if isinstance(by, timedelta) else timedelta(seconds=by)
        if step < timedelta(0):
            raise ValueError("a step back is a positive amount")
        with self._lock:
            self._now -= step
            return self._now
