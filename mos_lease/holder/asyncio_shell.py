"""The asyncio holder: :func:`~mos_lease.hold` on an
:class:`~mos_lease.AsyncConnectorLeaseCoordinator` (``async with``), with an
:class:`~mos_lease.keeper.AsyncLeaseKeeper`, and the cancellation of the block on loss."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from datetime import timedelta
from types import TracebackType
from typing import Any

from mos_lease.coordinator import AsyncConnectorLeaseCoordinator
from mos_lease.holder.base import HolderStep, _HolderBase
from mos_lease.holder.options import HoldOptions, LeaseLost
from mos_lease.keeper import AsyncLeaseKeeper, LeaseLoss
from mos_lease.keeper.calls import Sleep, drive_async
from mos_lease.notice_confirmer import Done
from mos_lease.records import LeaseHandle
from mos_lease.results import GrantResult


class AsyncHolder(_HolderBase[AsyncLeaseKeeper]):
    """:func:`hold` for an :class:`~mos_lease.AsyncConnectorLeaseCoordinator`
    (``async with``). With ``cancel_on_loss`` the task running the block is cancelled when
    the lease is lost, and the ``async with`` raises :class:`LeaseLost` instead of
    :class:`asyncio.CancelledError` (a cancellation from elsewhere still propagates)."""

    coordinator: AsyncConnectorLeaseCoordinator
    _sleep: Callable[[float], Awaitable[object]] | None

    def __init__(self, coordinator: AsyncConnectorLeaseCoordinator, options: HoldOptions, *,
                 sleep: Callable[[float], Awaitable[object]] | None = None,
                 heartbeat_coordinator: AsyncConnectorLeaseCoordinator | None = None) -> None:
        super().__init__(coordinator, options, sleep=sleep,
                         heartbeat_coordinator=heartbeat_coordinator)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._confirming: set[asyncio.Task[None]] = set()
        self._cancel_on_loss = options.cancel_on_loss
        self._wakeup = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None
        self._task: asyncio.Task[Any] | None = None
        self._inside = False
        self._cancel_sent = False
        self._base_cancelling = 0
        self.lost_event = asyncio.Event()
        """Set once the lease is lost while held (``await lost_event.wait()``)."""

    async def _perform(self, step: HolderStep) -> object:
        if not isinstance(step, Sleep):
            return await step.on(self._target(step))
        if self._sleep is not None:
            await self._sleep(step.seconds)
        else:
            # A notice ends the pause early. asyncio.timeout, not wait_for: on 3.11 wait_for
            # drops a cancellation that arrives as the event is set.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(step.seconds):
                    await self._wakeup.wait()
            self._wakeup.clear()
        return None

    def __enter__(self) -> None:
        raise TypeError("hold() on an AsyncConnectorLeaseCoordinator: use `async with`")

    def __exit__(self, *_exc: object) -> None:  # pragma: no cover - __enter__ refuses
        return None

    async def __aenter__(self) -> AsyncHolder:
        lease = await drive_async(self._entering(AsyncLeaseKeeper), self._perform,
                                  BaseException)
        self._task = asyncio.current_task()
        if self._task is not None:
            self._base_cancelling = self._task.cancelling()
        self._inside = True
        self._callbacks.call("on_started", lease)
        if self._callbacks.has("on_expiring"):
            self._watcher = asyncio.get_running_loop().create_task(
                self._watch(), name=self._watcher_name(lease))
        return self

    async def _watch(self) -> None:
        while True:
            again = self._check_expiring()
            if again is None:
                return
            await asyncio.sleep(again)

    def _after_loss(self, loss: LeaseLoss) -> None:
        self.lost_event.set()
        if self._cancel_on_loss and self._inside and self._task is not None \
                and not self._cancel_sent:
            self._cancel_sent = True
            self._task.cancel(f"mos_lease: lease lost ({loss.reason})")

    def _wake(self) -> None:
        self._wakeup.set()

    def _confirm(self, done: Done) -> None:
        # On the confirmer's thread: the holder's state and store belong to the loop.
        loop = self._loop
        if loop is None:
            done()
            return
        try:
            loop.call_soon_threadsafe(self._confirm_on_loop, done)
        except RuntimeError:  # the loop has closed: nothing to confirm
            done()

    def _confirm_on_loop(self, done: Done) -> None:
        lease = self._held_lease()
        if lease is None:
            self._wake()
            done()
            return

        async def confirm(held: LeaseHandle) -> None:
            try:
                await drive_async(self._confirmation(held), self._perform)
            finally:
                done()  # also when cancelled: the turn is over either way

        task = asyncio.get_running_loop().create_task(confirm(lease))
        self._confirming.add(task)  # keep a reference until it is done
        task.add_done_callback(self._confirming.discard)

    def _subscribe(self) -> None:
        self._loop = asyncio.get_running_loop()  # where confirming turns run
        super()._subscribe()

    async def wait_lost(self) -> LeaseLoss:
        """Wait until the lease is lost; the loss."""
        await self.lost_event.wait()
        assert self._loss is not None
        return self._loss

    async def issue_grant(self, *, scopes: object, ttl: float | timedelta,
                          correlation_id: str | None = None) -> GrantResult:
        """As :meth:`Holder.issue_grant`."""
        return self._granted(await self._granting().issue_grant(
            scopes=scopes, ttl=ttl, correlation_id=correlation_id))

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        if self._keeper is None:
            return
        self._unsubscribe()
        self._inside = False
        if self._watcher is not None:
            self._watcher.cancel()
        try:
            await drive_async(self._leaving(), self._perform, Exception)
        except asyncio.CancelledError:
            if not self._cancel_sent:
                raise
            # Our own cancellation, reaching the task here rather than in the block (which
            # ended first); counted and taken back below.
        self._callbacks.call("on_stopped")
        if not self._cancel_sent:
            return
        task = self._task
        assert task is not None and self._loss is not None
        if exc_type is not asyncio.CancelledError:
            # The block ended before our cancellation reached it: take it back here,
            # rather than let it hit whatever the task awaits next.
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0)
        if task.uncancel() > self._base_cancelling:
            raise asyncio.CancelledError  # cancelled from elsewhere as well: that wins
        if exc_type is None or exc_type is asyncio.CancelledError:
            raise LeaseLost(self._loss) from exc
