"""The asyncio keeper: :class:`AsyncLeaseKeeper` runs the keeper's steps as a task on the
running loop; a heartbeat still running at the deadline is cancelled and abandoned."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Mapping
from datetime import timedelta
from typing import Any

from mos_lease.bounded import bounded_async
from mos_lease.coordinator import AsyncConnectorLeaseCoordinator
from mos_lease.errors import MosLeaseError
from mos_lease.identity import LeaseIdentity
from mos_lease.keeper import steps
from mos_lease.keeper.base import _Keeper
from mos_lease.keeper.calls import HeartbeatCall, Sleep, Step, Steps, drive_async
from mos_lease.keeper.schedule import Action
from mos_lease.records import LeaseHandle
from mos_lease.results import GrantResult, LeaseResult

log = logging.getLogger("mos_lease.keeper")


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
    lost: asyncio.Event
    """Set once the lease is lost (or the keeper stopped); never cleared."""

    def _setup(self, sleep: Callable[[float], Awaitable[object]] | None
               ) -> Callable[[], object]:
        self.lost = asyncio.Event()
        self._sleep = sleep if sleep is not None else asyncio.sleep
        self._task: asyncio.Task[None] | None = None
        self._abandoned: set[asyncio.Future[Any]] = set()
        return self.lost.set

    async def _drive(self, running: Steps[Any],
                     thrown: type[BaseException] = MosLeaseError) -> Any:
        return await drive_async(running, self._perform, thrown)

    async def _perform(self, step: Step) -> Any:
        if isinstance(step, Sleep):
            return await self._sleep(step.seconds)  # stop() cancels the task: it ends at once
        if isinstance(step, HeartbeatCall):
            return await self._bounded_heartbeat(step)
        return await step.on(self.coordinator)

    async def _bounded_heartbeat(self, call: HeartbeatCall) -> object:
        # The heartbeat runs as a task of its own and is waited for, not awaited under a
        # timeout: cancelling a call only ends it once the call lets go, and a driver may
        # hold on to a cancelled call for as long as it waits for the server (psycopg sends
        # a cancel request and then waits for the reply).
        return await bounded_async(call.on(self.heartbeat_coordinator), call.timeout,
                                   self._abandoned, log=log)

    async def acquire(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
                      correlation_id: str | None = None,
                      metadata: Mapping[str, str] | None = None) -> LeaseResult:
        """As :meth:`LeaseKeeper.acquire`: acquire with the keeper's ttl (and the holder
        ``metadata``, if given), and on success hold the lease and start the renewing
        task."""
        return await self._start(self._acquire(identity, connector_id, scopes, correlation_id,
                                               metadata))

    async def takeover(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
                       expected_epoch: int, correlation_id: str | None = None,
                       metadata: Mapping[str, str] | None = None) -> LeaseResult:
        """As :meth:`LeaseKeeper.takeover`: take over at ``expected_epoch`` with the
        keeper's ttl (and the holder ``metadata``, if given), and on success hold the lease
        and start the renewing task."""
        return await self._start(self._takeover(identity, connector_id, scopes,
                                                expected_epoch, correlation_id, metadata))

    async def adopt(self, lease: LeaseHandle, *, obtained_at: float) -> None:
        """As :meth:`LeaseKeeper.adopt`: keep a lease obtained elsewhere; ``obtained_at`` is
        the keeper clock's reading taken before the call that produced ``lease``."""
        await self._start(self._adopt(lease, obtained_at))

    async def _start(self, starting: Steps[Any]) -> LeaseResult:
        result: LeaseResult
        result, holding = await self._drive(starting, BaseException)
        if holding and self._background:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=self._name())
        return result

    async def step(self) -> Action:
        """Run one decision: renew, wait, or report loss. Returns what was decided."""
        action: Action = await self._drive(steps.step(self._core))
        return action

    async def _run(self) -> None:
        while not self.lost.is_set():
            try:
                await self.step()
            except Exception as error:
                steps.run_failed(self._core, error)

    async def issue_grant(self, *, scopes: object, ttl: float | timedelta,
                          correlation_id: str | None = None) -> GrantResult:
        """Mint a grant for the kept lease, or refuse locally once it is lost (the deadline
        is checked before and after the store call)."""
        result: GrantResult = await self._drive(steps.issue_grant(self._core, scopes, ttl,
                                                                  correlation_id))
        return result

    async def stop(self, *, release: bool = True) -> LeaseResult | None:
        """Stop renewing (cancelling the renewing task) and, if the lease is still held and
        ``release``, release it. Returns the release result, or ``None`` if nothing was
        released; marks the keeper lost with cause ``STOPPED`` unless it already was."""
        task = self._task
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            # Waited for without awaiting it: ``await task`` raises the task's own
            # CancelledError, and suppressing that would drop a cancellation of the caller
            # arriving meanwhile. asyncio.wait raises only the caller's.
            await asyncio.wait((task,))
            error = None if task.cancelled() else task.exception()
            if error is not None:
                raise error  # as ``await task`` would
        result: LeaseResult | None = await self._drive(steps.stop(self._core, release))
        return result

    async def __aenter__(self) -> AsyncLeaseKeeper:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.stop()
