"""In-memory resource guards: for a boundary that lives in one process, and for tests."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from mos_lease.fencing import (
    GuardDecision,
    ResourceEpoch,
    admit,
    check_expiry_grace,
    check_resource_id,
    check_token,
)
from mos_lease.token import FencingToken


def _utc_now() -> datetime:
    return datetime.now(UTC)


class InMemoryResourceGuard:
    """Thread-safe highest-epoch-per-resource memory, using the shared pure decision.

    Memory is one entry per resource ever admitted and is never dropped: forgetting a
    resource would let an old epoch in again. It is lost with the process, so a boundary
    that must stay fenced across restarts needs a durable guard (``mos_lease_pg``).

    ``expiry_grace`` (off by default) also refuses tokens whose ``expires_at`` is more than
    that far in the past by ``clock``; set it only where this process's clock is kept close
    to the lease store's.
    """

    def __init__(self, *, expiry_grace: timedelta | None = None,
                 clock: Callable[[], datetime] = _utc_now) -> None:
        self.expiry_grace = check_expiry_grace(expiry_grace)
        self._clock = clock
        self._lock = threading.Lock()
        self._resources: dict[str, ResourceEpoch] = {}

    def admit(self, resource_id: str, token: FencingToken) -> GuardDecision:
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
        return self.sync.admit(resource_id, token)
