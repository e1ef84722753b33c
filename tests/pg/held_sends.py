"""Holding a PostgreSQL store at its sending step: how the coalescing tests make an overlap
certain instead of likely. A recorder is told of every statement the store is about to send
(``note(call)``); where it answers ``True`` the send waits until ``recorder.release`` is set
(at most ``hold`` seconds, so a failing test ends rather than hangs), while the calls meant to
queue behind it queue."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar

from tests.pg_clock import ShiftedAsyncPostgresLeaseStore, ShiftedPostgresLeaseStore


class Noting(Protocol):
    release: threading.Event

    def note(self, call: Any) -> bool:
        """Record ``call`` about to be sent; whether to hold it."""


R = TypeVar("R", bound=Noting)


def hold_sync(store: ShiftedPostgresLeaseStore, recorder: R, *, hold: float,
              fail: Callable[[Any], BaseException | None] | None = None) -> R:
    """``store`` sends through ``recorder`` from now on; ``fail(call)`` may name an error to
    raise instead of sending (after any hold)."""
    real = store._attempt

    def attempt(call: Any, covers: Any, deadline: float) -> Any:
        if recorder.note(call):
            recorder.release.wait(hold)
        error = None if fail is None else fail(call)
        if error is not None:
            raise error
        return real(call, covers, deadline)

    store._attempt = attempt  # type: ignore[method-assign]
    return recorder


def hold_async(store: ShiftedAsyncPostgresLeaseStore, recorder: R, *, hold: float) -> R:
    """As :func:`hold_sync`, for the asyncio store (the hold polls, so the loop runs on)."""
    real = store._attempt

    async def attempt(call: Any, covers: Any, deadline: float) -> Any:
        if recorder.note(call):
            ends = time.monotonic() + hold
            while not recorder.release.is_set() and time.monotonic() < ends:
                await asyncio.sleep(0.002)
        return await real(call, covers, deadline)

    store._attempt = attempt  # type: ignore[method-assign]
    return recorder
