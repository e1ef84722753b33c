"""In-memory resource guards: for a boundary that lives in one process, and for tests."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from mos_lease.fencing import (
    NO_GRACE,
    GuardDecision,
    ResourceEpoch,
    admit,
    check_resource_id,
    check_token,
    judged_grace,
)
from mos_lease.token import FencingToken


def _utc_now() -> datetime:
    return datetime.now(UTC)


class InMemoryResourceGuard:
    """Thread-safe highest-epoch-per-resource memory, using the shared pure decision.

    Memory is one entry per resource ever admitted and is never dropped: forgetting a
    resource would let an old epoch in again. It is lost with the process, so a boundary
    that must stay fenced across restarts needs a durable guard (``mos_lease_pg``).

    A token is refused (``token_expired``) once its ``expires_at`` plus ``expiry_grace``
    (zero by default) is not after ``clock()``, read under the guard's lock. ``clock`` is
    this process's UTC wall clock by default: give the guard the lease store's clock where
    there is one in the process (``clock=store_clock.now``), and a small ``expiry_grace``
    where this clock may lag the lease store's. ``ignore_expiry=True`` judges epochs only,
    for a boundary whose clock cannot be trusted at all.
    """

    def __init__(self, *, expiry_grace: timedelta = NO_GRACE, ignore_expiry: bool = False,
                 clock: Callable[[], datetime] = _utc_now) -> None:
        # ``None`` when expiry is not judged: the shared decision's spelling of "off".
        self.expiry_grace = judged_grace(expiry_grace, ignore_expiry)
        self._clock = clock
        self._lock = threading.Lock()
        self._resources: dict[str, ResourceEpoch] = {}

    def admit(self, resource_id: str, token: FencingToken) -> GuardDecision:
        """:meth:`mos_lease.ResourceGuard.admit` under the guard's lock, judging expiry by
        its clock."""
        resource_id = check_resource_id(resource_id)
        token = check_token(token)
        with self._lock:
            now = self._clock() if self.expiry_grace is not None else None
            after, decision = admit(self._resources.get(resource_id), token, resource_id,
                                    now=now, expiry_grace=self.expiry_grace)
            if after is not None:
                self._resources[resource_id] = after
            return decision

    def state(self, resource_id: str) -> ResourceEpoch | None:
        """What is remembered about ``resource_id`` (for inspection and tests)."""
        resource_id = check_resource_id(resource_id)
        with self._lock:
            return self._resources.get(resource_id)


class AsyncInMemoryResourceGuard:
    """The same guard behind the asyncio protocol (``admit`` never blocks long)."""

    def __init__(self, guard: InMemoryResourceGuard | None = None) -> None:
        self.sync = guard if guard is not None else InMemoryResourceGuard()

    async def admit(self, resource_id: str, token: FencingToken) -> GuardDecision:
        """As :meth:`InMemoryResourceGuard.admit`."""
        return self.sync.admit(resource_id, token)
