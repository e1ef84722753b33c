"""The thread holder: :func:`~mos_lease.hold` on a :class:`~mos_lease.ConnectorLeaseCoordinator`
(``with``), performing the waiting steps with blocking calls and keeping the lease with a
:class:`~mos_lease.keeper.LeaseKeeper`."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType

from mos_lease.coordinator import ConnectorLeaseCoordinator
from mos_lease.holder.base import HolderStep, _HolderBase
from mos_lease.holder.options import HoldOptions
from mos_lease.keeper import LeaseKeeper, LeaseLoss
from mos_lease.keeper.calls import Sleep, drive
from mos_lease.notice_confirmer import Done
from mos_lease.results import GrantResult


class Holder(_HolderBase[LeaseKeeper]):
    """:func:`hold` for a :class:`~mos_lease.ConnectorLeaseCoordinator` (``with``)."""

    coordinator: ConnectorLeaseCoordinator
    _sleep: Callable[[float], object] | None

    def __init__(self, coordinator: ConnectorLeaseCoordinator, options: HoldOptions, *,
                 sleep: Callable[[float], object] | None = None,
                 heartbeat_coordinator: ConnectorLeaseCoordinator | None = None) -> None:
        super().__init__(coordinator, options, sleep=sleep,
                         heartbeat_coordinator=heartbeat_coordinator)
        self._wakeup = threading.Event()
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None
        self.lost_event = threading.Event()
        """Set once the lease is lost while held (``lost_event.wait(timeout)``)."""

    def _perform(self, step: HolderStep) -> object:
        if not isinstance(step, Sleep):
            return step.on(self._target(step))
        if self._sleep is not None:
            self._sleep(step.seconds)
        else:
            self._wakeup.wait(step.seconds)  # a notice ends the pause early
            self._wakeup.clear()
        return None

    def __enter__(self) -> Holder:
        lease = drive(self._entering(LeaseKeeper), self._perform, BaseException)
        self._callbacks.call("on_started", lease)
        if self._callbacks.has("on_expiring"):
            self._watcher = threading.Thread(target=self._watch, daemon=True,
                                             name=self._watcher_name(lease))
            self._watcher.start()
        return self

    def _watch(self) -> None:
        while not self._closing.is_set():
            again = self._check_expiring()
            if again is None:
                return
            self._closing.wait(again)

    def _after_loss(self, loss: LeaseLoss) -> None:
        self.lost_event.set()

    def _confirm(self, done: Done) -> None:
        # On the confirmer's thread: the read blocks it (for at most the store's call
        # bound), never the notice source's thread nor the keeper's.
        try:
            lease = self._held_lease()
            if lease is None:
                self._wake()
                return
            drive(self._confirmation(lease), self._perform)
        finally:
            done()

    def _wake(self) -> None:
        self._wakeup.set()

    def wait_lost(self, timeout: float | None = None) -> LeaseLoss | None:
        """Block until the lease is lost (or ``timeout`` passes); the loss, or ``None``."""
        self.lost_event.wait(timeout)
        return self.lost

    def issue_grant(self, *, scopes: object, ttl: float | timedelta,
                    correlation_id: str | None = None) -> GrantResult:
        """Mint a grant for the held lease. Raises :class:`LeaseLost` once the lease is lost
        (refused locally: nothing reaches the store); other refusals come back as results."""
        return self._granted(self._granting().issue_grant(scopes=scopes, ttl=ttl,
                                                          correlation_id=correlation_id))

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._keeper is None:
            return
        self._unsubscribe()
        self._closing.set()
        drive(self._leaving(), self._perform, Exception)
        if self._watcher is not None:
            self._watcher.join(1.0)
        self._callbacks.call("on_stopped")
