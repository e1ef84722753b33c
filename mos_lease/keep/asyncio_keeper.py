"""The asyncio keeper: :class:`AsyncLeaseKeeper` keeps one lease on the supervisor engine's
task (:class:`~mos_lease.supervisor.AsyncSupervisor`) on the running loop; a heartbeat
still running at the deadline is cancelled and abandoned."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any

from mos_lease import held_grant
from mos_lease.coordinator import AsyncConnectorLeaseCoordinator
from mos_lease.errors import InvalidInput
from mos_lease.flowdrive import Drive, outcome_of_async
from mos_lease.identity import LeaseIdentity
from mos_lease.keep.keeper import _adopted, _Keeper
from mos_lease.keep.keeper_calls import AcquireCall, IssueGrantCall, TakeoverCall
from mos_lease.keep.runner import AsyncSupervisor
from mos_lease.keep.timing import Action, ReportLoss
from mos_lease.records import LeaseHandle
from mos_lease.results import GrantResult, LeaseResult


class AsyncLeaseKeeper(_Keeper[AsyncConnectorLeaseCoordinator,
                               Callable[[float], Awaitable[object]]]):
    """The asyncio keeper, for an :class:`AsyncConnectorLeaseCoordinator`.

    Renewal runs as a task on the running loop. ``lost`` is an :class:`asyncio.Event`
    (``await keeper.lost.wait()``); ``on_lost`` is called once, on the loop. Loss is
    reported at the deadline even if a heartbeat is still running then: that heartbeat is
    cancelled and abandoned without waiting for it to end (a driver may take long to give
    up a cancelled call), and nothing it returns later can change the reported loss.
    The options are :class:`LeaseKeeper`'s.
    """

    _kind = AsyncConnectorLeaseCoordinator
    _engine_kind = AsyncSupervisor
    _engine: AsyncSupervisor
    lost: asyncio.Event
    """Set once the lease is lost (or the keeper stopped); never cleared."""

    def _setup(self) -> None:
        self.lost = asyncio.Event()

    def _signal(self) -> None:
        self.lost.set()

    @property
    def _task(self) -> asyncio.Task[None] | None:
        return self._engine._worker._task

    async def acquire(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
                      correlation_id: str | None = None,
                      metadata: Mapping[str, str] | None = None) -> LeaseResult:
        """As :meth:`LeaseKeeper.acquire`: acquire with the keeper's ttl (and the holder
        ``metadata``, if given), and on success hold the lease and start the renewing
        task."""
        return await self._start(self._acquire_call(identity, connector_id, scopes,
                                                    correlation_id, metadata))

    async def takeover(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
                       expected_epoch: int, correlation_id: str | None = None,
                       metadata: Mapping[str, str] | None = None) -> LeaseResult:
        """As :meth:`LeaseKeeper.takeover`: take over at ``expected_epoch`` with the
        keeper's ttl (and the holder ``metadata``, if given), and on success hold the lease
        and start the renewing task."""
        return await self._start(self._takeover_call(identity, connector_id, scopes,
                                                     expected_epoch, correlation_id, metadata))

    async def adopt(self, lease: LeaseHandle, *, obtained_at: float) -> None:
        """As :meth:`LeaseKeeper.adopt`: keep a lease obtained elsewhere; ``obtained_at`` is
        the keeper clock's reading taken before the call that produced ``lease``."""
        await self._start(_adopted(lease), obtained_at)

    async def _start(self, call: AcquireCall | TakeoverCall | LeaseResult,
                     obtained_at: float | None = None) -> LeaseResult:
        started = self._claim_start()
        result: LeaseResult | None = None
        try:
            result = call if isinstance(call, LeaseResult) else await call.on(self.coordinator)
        finally:
            self._started(result, started if obtained_at is None else obtained_at)
        assert result is not None
        return result

    async def step(self) -> Action:
        """Run one decision: renew, wait, or report loss. Returns what was decided."""
        action = self._action()
        if isinstance(action, ReportLoss):
            self.enforce_deadline()
        else:
            await self._engine.turn()  # renews if due, else sleeps until the renewal
        return action

    async def issue_grant(self, *, scopes: object, ttl: float | timedelta,
                          correlation_id: str | None = None) -> GrantResult:
        """Mint a grant for the kept lease, or refuse locally once it is lost (the deadline
        is checked before and after the store call)."""
        self._require()
        drive = Drive(held_grant.issue_grant(self, self._clock, scopes, ttl, correlation_id))
        for call in drive:
            drive.send(await outcome_of_async(self._grant, call))
        return drive.result

    async def _grant(self, call: IssueGrantCall) -> GrantResult:
        result: GrantResult = await call.on(self.coordinator)
        return result

    async def stop(self, *, release: bool = True) -> LeaseResult | None:
        """Stop renewing (cancelling the renewing task) and, if the lease is still held and
        ``release``, release it. Returns the release result, or ``None`` if nothing was
        released; marks the keeper lost with cause ``STOPPED`` unless it already was."""
        identity = self._stopping()
        if identity is None:
            return None  # nothing held yet: the keeper may still start
        try:
            result: Any = await self._engine.remove(identity, release=release)
        except InvalidInput:
            result = None  # stopped already
        await self._engine.close()
        return result  # type: ignore[no-any-return]

    async def __aenter__(self) -> AsyncLeaseKeeper:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.stop()
