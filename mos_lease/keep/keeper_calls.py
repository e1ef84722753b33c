"""The calls a keeper makes on its coordinator, written once, and the two loops that make
them.

A keeper decides in generators of *steps*: each step it yields is a value that
says what it needs done, and the generator is resumed with the outcome (or thrown the
failure). The steps are the calls below, each named for the coordinator method it calls,
and :class:`~mos_lease.sleep.Sleep`::

    def look(identity: LeaseIdentity) -> Steps[HolderView | None]:
        view = yield CurrentHolderCall(identity)  # decides, performs nothing
        if view is not None:
            yield Sleep(1.0)
        return view

A call knows how it is made: ``call.on(coordinator)`` calls the coordinator's method with
the call's arguments. On a :class:`~mos_lease.ConnectorLeaseCoordinator` that returns the
result; on an :class:`~mos_lease.AsyncConnectorLeaseCoordinator` it returns the awaitable
that the asyncio driver awaits. So which method a step calls, and with what, is written
here once for both kinds; a thread driver and an asyncio driver only choose how to wait
(a pause that a notice or a stop may end early) and run the steps with :func:`drive` or
:func:`drive_async`, which differ only in ``await``::

    view = drive(look(identity), perform)               # perform(step) -> outcome
    view = await drive_async(look(identity), perform)   # await perform(step) -> outcome

These are not the coordinator's own flows (:mod:`mos_lease.coordinator`), which sit one
level lower, between the coordinator and its store: a keeper's step is one whole
coordinator call, with its policy check, its audit row and its retries. A kept lease's
renewals and release are the supervisor engine's (:mod:`mos_lease.supervisor`), not steps.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Mapping
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeVar

import attrs

from mos_lease.errors import MosLeaseError
from mos_lease.flowdrive import Drive, outcome_of, outcome_of_async
from mos_lease.identity import LeaseIdentity
from mos_lease.records import LeaseHandle
from mos_lease.sleep import Sleep

if TYPE_CHECKING:
    from mos_lease.coordinator import AsyncConnectorLeaseCoordinator, ConnectorLeaseCoordinator

    Coordinator = ConnectorLeaseCoordinator | AsyncConnectorLeaseCoordinator

__all__ = [
    "AcquireCall", "CoordinatorCall", "CurrentHolderCall", "IssueGrantCall", "Sleep", "Step",
    "Steps", "TakeoverCall", "drive", "drive_async",
]

S = TypeVar("S")
T = TypeVar("T")

# ``on`` returns ``Any``: the result from a sync coordinator, an awaitable from an asyncio
# one; the driver of each kind knows which it has.


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


@attrs.frozen(slots=True)
class CurrentHolderCall:
    """``coordinator.current_holder``: who holds the lease (a read, no audit row)."""

    identity: LeaseIdentity

    def on(self, coordinator: Coordinator) -> Any:
        return coordinator.current_holder(self.identity)


CoordinatorCall = AcquireCall | TakeoverCall | IssueGrantCall | CurrentHolderCall
Step = CoordinatorCall | Sleep
Steps = Generator[Step, Any, T]
"""A generator of steps that returns a ``T``."""

Thrown = type[BaseException] | tuple[type[BaseException], ...]


def drive(steps: Generator[S, Any, T], perform: Callable[[S], object],
          thrown: Thrown = MosLeaseError) -> T:
    """Run ``steps`` to its end, performing each step with ``perform``; failures that are
    instances of ``thrown`` go into the steps, any other is raised (see
    :class:`~mos_lease.flowdrive.Drive`)."""
    driving = Drive(steps, thrown)
    for step in driving:
        driving.send(outcome_of(perform, step))
    return driving.result


async def drive_async(steps: Generator[S, Any, T], perform: Callable[[S], Awaitable[object]],
                      thrown: Thrown = MosLeaseError) -> T:
    """As :func:`drive`, awaiting each ``perform(step)``."""
    driving = Drive(steps, thrown)
    for step in driving:
        driving.send(await outcome_of_async(perform, step))
    return driving.result
