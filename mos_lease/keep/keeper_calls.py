"""The calls a keeper makes on its coordinator outside the engine's turn, written once for
both kinds: its start (:class:`AcquireCall`, :class:`TakeoverCall`) and its grants
(:class:`IssueGrantCall`, which the supervisor's grants use too).

A call knows how it is made: ``call.on(coordinator)`` calls the coordinator's method with
the call's arguments. On a :class:`~mos_lease.ConnectorLeaseCoordinator` that returns the
result; on an :class:`~mos_lease.AsyncConnectorLeaseCoordinator` it returns the awaitable
that the asyncio keeper awaits. So which method is called, and with what, is written here
once; the thread and asyncio keepers only choose how to wait. A kept lease's renewals and
release are the engine's turn (:mod:`mos_lease.keep.turn`), not calls of a keeper's.
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import attrs

from mos_lease.identity import LeaseIdentity
from mos_lease.records import LeaseHandle

if TYPE_CHECKING:
    from mos_lease.coordinator import AsyncConnectorLeaseCoordinator, ConnectorLeaseCoordinator

    Coordinator = ConnectorLeaseCoordinator | AsyncConnectorLeaseCoordinator

__all__ = ["AcquireCall", "CoordinatorCall", "IssueGrantCall", "TakeoverCall"]

# ``on`` returns ``Any``: the result from a sync coordinator, an awaitable from an asyncio
# one; the keeper of each kind knows which it has.


@attrs.frozen(slots=True)
class _Claim:
    """Who asks for which lease, for how long: what an acquire and a takeover share."""

    identity: LeaseIdentity
    connector_id: str
    scopes: object
    ttl: float


@attrs.frozen(slots=True)
class AcquireCall(_Claim):
    """``coordinator.acquire``: wins when the identity never had a lease. ``metadata`` is
    the holder metadata the acquire sets (checked by the coordinator)."""

    correlation_id: str | None = None
    metadata: Mapping[str, str] | None = None

    def on(self, coordinator: Coordinator) -> Any:
        return coordinator.acquire(self.identity, self.connector_id, scopes=self.scopes,
                                   ttl=self.ttl, correlation_id=self.correlation_id,
                                   metadata=self.metadata)


@attrs.frozen(slots=True)
class TakeoverCall(_Claim):
    """``coordinator.takeover`` at ``expected_epoch``, the epoch last observed, setting
    ``metadata`` in place of the previous holder's."""

    expected_epoch: int
    correlation_id: str | None = None
    metadata: Mapping[str, str] | None = None

    def on(self, coordinator: Coordinator) -> Any:
        return coordinator.takeover(self.identity, self.connector_id, scopes=self.scopes,
                                    ttl=self.ttl, expected_epoch=self.expected_epoch,
                                    correlation_id=self.correlation_id, metadata=self.metadata)


@attrs.frozen(slots=True)
class IssueGrantCall:
    """``coordinator.issue_grant`` for the kept lease."""

    lease: LeaseHandle
    scopes: object
    ttl: float | timedelta
    correlation_id: str

    def on(self, coordinator: Coordinator) -> Any:
        return coordinator.issue_grant(self.lease, scopes=self.scopes, ttl=self.ttl,
                                       correlation_id=self.correlation_id)


CoordinatorCall = AcquireCall | TakeoverCall | IssueGrantCall
