"""The asyncio supervisor: :class:`AsyncSupervisor` runs the turns of ``flow.py`` as one task
on the running loop and performs the calls they yield, each store call as a task of its own,
abandoned past the earliest local deadline (:func:`mos_lease.bounded.bounded_async`; a
renewal is started and waited for apart, :func:`mos_lease.bounded.bounded_wait`, so that two
batches are in flight at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random as _random
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Any

from mos_lease.bounded import abandon, bounded_async, bounded_wait
from mos_lease.coordinator import AsyncConnectorLeaseCoordinator
from mos_lease.events import EventHook
from mos_lease.flowdrive import Drive, outcome_of_async
from mos_lease.identity import LeaseIdentity
from mos_lease.records import LeaseHandle
from mos_lease.results import GrantResult, LeaseResult
from mos_lease.supervisor.base import _Supervisor
from mos_lease.supervisor.changes import Change
from mos_lease.supervisor.flow import (
    IN_FLIGHT,
    Attempt,
    Call,
    Collect,
    IssueGrantCall,
    Release,
    Sleep,
    issue_grant,
    turn,
    turn_failed,
)
from mos_lease.supervisor.notices import NoticeFeed
from mos_lease.supervisor.slots import Acquire, ReadHolder, Renew, Takeover

log = logging.getLogger("mos_lease.supervisor")


class AsyncSupervisor(_Supervisor[AsyncConnectorLeaseCoordinator]):
    """The asyncio supervisor, for an :class:`~mos_lease.AsyncConnectorLeaseCoordinator`:
    one task on the running loop (started by the first :meth:`add`). A store call runs as a
    task of its own, waited for until the earliest local deadline and abandoned past it
    (cancelled, never trusted later); two renewal batches are in flight at once, so at most
    three tasks run at once. Call every method on the loop. ``changes()`` is an
    async iterator; the other options are :class:`Supervisor`'s, ``notices`` included (the
    same thread-based source: a confirming read is made by the supervisor's task)."""

    _kind = AsyncConnectorLeaseCoordinator

    def __init__(self, coordinator: AsyncConnectorLeaseCoordinator, *,
                 on_change: Callable[[Change], object] | None = None,
                 clock: Callable[[], float] | None = None,
                 sleep: Callable[[float], Awaitable[object]] | None = None,
                 random: Callable[[], float] = _random.random,
                 background: bool = True, notices: NoticeFeed | None = None,
                 heartbeat_coordinator: AsyncConnectorLeaseCoordinator | None = None,
                 on_event: EventHook | None = None) -> None:
        self._wakeup = asyncio.Event()
        self._loop: asyncio.AbstractEventLoop | None = None  # the loop of the first add()
        super().__init__(coordinator, on_change=on_change, clock=clock, random=random,
                         background=background, notices=notices,
                         heartbeat_coordinator=heartbeat_coordinator, on_event=on_event)
        self._sleep = sleep if sleep is not None else self._wait_for_wakeup
        self._task: asyncio.Task[None] | None = None
        self._abandoned: set[asyncio.Future[Any]] = set()

    def _started(self) -> None:
        self._wakeup.set()
        if self._background and self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._run(), name=self._name)
        if self._loop is None:
            with contextlib.suppress(RuntimeError):  # driven by hand, outside a loop
                self._loop = asyncio.get_running_loop()

    def _real_sleep(self) -> Callable[[float], Awaitable[object]]:
        return self._wait_for_wakeup

    def _wake_from_thread(self) -> bool:
        # Called on the notice confirmer's thread: the event belongs to the loop.
        loop = self._loop
        if loop is None:
            return False
        try:
            loop.call_soon_threadsafe(self._wakeup.set)
        except RuntimeError:  # the loop has closed: nobody will make the read
            return False
        return True

    async def _wait_for_wakeup(self, seconds: float) -> None:
        if math.isinf(seconds):
            await self._wakeup.wait()
            return
        try:
            async with asyncio.timeout(seconds):
                await self._wakeup.wait()
        except TimeoutError:
            pass

    async def _run(self) -> None:
        while not self._core.closing:
            self._wakeup.clear()
            try:
                await self.turn()
            except Exception as error:
                turn_failed(self._core, error)
                await asyncio.sleep(0.1)

    async def turn(self) -> None:
        """One turn: renew what is due, make the campaign calls due, or sleep."""
        started: set[asyncio.Future[Any]] = set()  # renewals started, not yet collected
        try:
            drive = Drive(turn(self._core, IN_FLIGHT), ())
            for call in drive:
                drive.send(await self._perform(call, started))
        finally:
            # A turn cut short (cancelled, or a bug) leaves no renewal running unwatched.
            for running in started:
                abandon(running, self._abandoned)

    async def _perform(self, call: Call, started: set[asyncio.Future[Any]]) -> object:
        if isinstance(call, Sleep):
            return await self._sleep(call.seconds)
        if isinstance(call, Renew):  # started now, waited for by its Collect
            self._counts.renewal(len(call.leases))
            running = asyncio.ensure_future(
                self.renewer.heartbeat_many(call.leases, ttl=call.ttl))
            started.add(running)
            return running
        if isinstance(call, Collect):
            assert isinstance(call.ticket, asyncio.Future)
            started.discard(call.ticket)
            return await bounded_wait(call.ticket, call.timeout, self._abandoned)
        if isinstance(call, Attempt):
            return await self._bounded(self._campaign(call), call.timeout)
        assert isinstance(call, Release)
        return await self._release(call.lease)

    async def _release(self, lease: LeaseHandle) -> object:
        self._counts.releases += 1
        try:
            return await self.coordinator.release(lease)
        except Exception as error:
            return error

    async def _campaign(self, attempt: Attempt) -> object:
        calls, kind = attempt.calls, attempt.kind
        identities = [call.slot.binding.identity for call in calls]
        if kind is ReadHolder:
            self._counts.campaign_reads += len(identities)
            return await self.coordinator.current_holders(identities)
        binding = calls[0].slot.binding  # a write batch shares these (flow.batches)
        if kind is Acquire:
            self._counts.acquires += len(identities)
            return await self.coordinator.acquire_many(identities, binding.connector_id,
                                                       scopes=binding.scopes,
                                                       ttl=binding.timing.ttl,
                                                       metadata=binding.metadata)
        takeovers = [call for call in calls if isinstance(call, Takeover)]
        self._counts.takeovers += len(takeovers)
        return await self.coordinator.takeover_many(
            [(call.slot.binding.identity, call.expected_epoch) for call in takeovers],
            binding.connector_id, scopes=binding.scopes, ttl=binding.timing.ttl,
            observed=[call.observed for call in takeovers], metadata=binding.metadata)

    async def _bounded(self, call: Awaitable[object], timeout: float) -> object:
        return await bounded_async(call, timeout, self._abandoned)

    async def issue_grant(self, identity: LeaseIdentity, *, scopes: object,
                          ttl: float | timedelta, correlation_id: str | None = None
                          ) -> GrantResult:
        """As :meth:`Supervisor.issue_grant`."""
        drive = Drive(issue_grant(self._core, identity, scopes, ttl, correlation_id))
        for call in drive:
            drive.send(await outcome_of_async(self._grant, call))
        return drive.result

    async def _grant(self, call: IssueGrantCall) -> GrantResult:
        return await self.coordinator.issue_grant(call.lease, scopes=call.scopes, ttl=call.ttl,
                                                  correlation_id=call.correlation_id)

    async def remove(self, identity: LeaseIdentity, *, release: bool = True
                     ) -> LeaseResult | None:
        """As :meth:`Supervisor.remove`."""
        lease = self._take(identity)
        if lease is None or not release:
            return None
        self._counts.releases += 1
        return await self.coordinator.release(lease)

    async def close(self) -> None:
        """Cancel the task and release every held lease, as :meth:`Supervisor.close`."""
        with self._core.lock:
            self._core.closing = True
        task = self._task
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            # Waited for without awaiting it, so a cancellation of the caller is not lost
            # (the asyncio keeper's stop() explains why).
            await asyncio.wait((task,))
        for batch in self._close_all():
            self._counts.releases += len(batch)
            try:
                outcome: list[LeaseResult] | Exception = await self.coordinator.release_many(
                    [lease for lease, _ in batch])
            except Exception as error:
                outcome = error
            self._released(batch, outcome)
        self._closed()

    def changes(self) -> AsyncIterator[Change]:
        """As :meth:`Supervisor.changes`, for ``async for``."""
        box: asyncio.Queue[Change | None] = asyncio.Queue()
        with self._core.lock:
            closed = self._core.closing
            self._core.listeners.append(box.put_nowait)
        return self._read(box, closed)

    async def _read(self, box: asyncio.Queue[Change | None], closed: bool
                    ) -> AsyncIterator[Change]:
        try:
            while not closed:
                change = await box.get()
                if change is None:
                    return
                yield change
        finally:
            with self._core.lock:
                self._core.listeners.remove(box.put_nowait)

    async def __aenter__(self) -> AsyncSupervisor:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()
