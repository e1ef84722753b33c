"""The thread holder: :func:`~mos_lease.hold` on a :class:`~mos_lease.ConnectorLeaseCoordinator`
(``with``), performing the waiting steps with blocking calls and keeping the lease with a
:class:`~mos_lease.keeper.LeaseKeeper`."""

from __future__ import annotations

import threading
from collections.abc import Callable, Generator
from datetime import timedelta
from types import TracebackType
from typing import Any, TypeVar

from mos_lease.coordinator import ConnectorLeaseCoordinator
from mos_lease.errors import MosLeaseError
from mos_lease.events import EventHook
from mos_lease.flowdrive import Drive, outcome_of
from mos_lease.holder.base import Adopt, HolderStep, Stop, _Callbacks, _HolderBase
from mos_lease.holder.options import HoldOptions, NoticeSource
from mos_lease.holder.waiting import ReadHolder, TryAcquire, TryTakeover
from mos_lease.keeper import LeaseKeeper, LeaseLoss
from mos_lease.notice_confirmer import Done
from mos_lease.results import GrantResult

T = TypeVar("T")


class Holder(_HolderBase[LeaseKeeper]):
    """:func:`hold` for a :class:`~mos_lease.ConnectorLeaseCoordinator` (``with``)."""

    coordinator: ConnectorLeaseCoordinator
    _sleep: Callable[[float], object] | None

    def __init__(self, coordinator: ConnectorLeaseCoordinator, options: HoldOptions,
                 callbacks: _Callbacks, *, clock: Callable[[], float],
                 random: Callable[[], float], sleep: Callable[[float], object] | None,
                 heartbeat_coordinator: ConnectorLeaseCoordinator | None,
                 on_event: EventHook | None = None,
                 notices: NoticeSource | None = None) -> None:
        super().__init__(coordinator, options, callbacks, clock=clock, random=random,
                         sleep=sleep, heartbeat_coordinator=heartbeat_coordinator,
                         on_event=on_event, notices=notices)
        self._wakeup = threading.Event()
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None
        self.lost_event = threading.Event()
        """Set once the lease is lost while held (``lost_event.wait(timeout)``)."""

    def _run(self, steps: Generator[HolderStep, Any, T], thrown: type[BaseException]) -> T:
        drive = Drive(steps, thrown)
        for step in drive:
            drive.send(outcome_of(self._perform, step))
        return drive.result

    def _perform(self, step: HolderStep) -> object:
        o = self.options
        if isinstance(step, TryAcquire):
            return self.coordinator.acquire(o.identity, o.connector_id, scopes=o.scopes,
                                            ttl=o.ttl)
        if isinstance(step, TryTakeover):
            return self.coordinator.takeover(o.identity, o.connector_id, scopes=o.scopes,
                                             ttl=o.ttl, expected_epoch=step.expected_epoch)
        if isinstance(step, ReadHolder):
            return self.coordinator.current_holder(o.identity)
        if isinstance(step, Adopt):
            self._require_keeper().adopt(step.lease, obtained_at=step.started)
            return None
        if isinstance(step, Stop):
            return self._require_keeper().stop(release=True)
        if self._sleep is not None:
            self._sleep(step.seconds)
        else:
            self._wakeup.wait(step.seconds)  # a notice ends the pause early
            self._wakeup.clear()
        return None

    def __enter__(self) -> Holder:
        lease = self._run(self._entering(LeaseKeeper), BaseException)
        self._callbacks("on_started", lease)
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
            try:
                view = self.coordinator.current_holder(self.options.identity)
            except MosLeaseError:
                return  # unconfirmed: the keeper's next renewal decides
            self._lose_to(lease.epoch, view)
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
        self._run(self._leaving(), Exception)
        if self._watcher is not None:
            self._watcher.join(1.0)
        self._callbacks("on_stopped")
