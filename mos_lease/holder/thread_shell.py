"""The thread holder: :func:`~mos_lease.hold` on a :class:`~mos_lease.ConnectorLeaseCoordinator`
(``with``), performing the waiting steps with blocking calls and keeping the lease with a
:class:`~mos_lease.keeper.LeaseKeeper`."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType

from mos_lease.coordinator import ConnectorLeaseCoordinator
from mos_lease.errors import InvalidInput, MosLeaseError
from mos_lease.events import EventHook
from mos_lease.holder.base import _Callbacks, _HolderBase, _log_release_failure
from mos_lease.holder.options import HoldOptions, NoticeSource
from mos_lease.holder.waiting import Acquired, ReadHolder, Step, TryAcquire, TryTakeover, waiting
from mos_lease.keeper import LeaseKeeper, LeaseLoss
from mos_lease.results import GrantResult


class Holder(_HolderBase):
    """:func:`hold` for a :class:`~mos_lease.ConnectorLeaseCoordinator` (``with``)."""

    _keeper: LeaseKeeper | None

    def __init__(self, coordinator: ConnectorLeaseCoordinator, options: HoldOptions,
                 callbacks: _Callbacks, *, clock: Callable[[], float],
                 random: Callable[[], float], sleep: Callable[[float], object] | None,
                 heartbeat_coordinator: ConnectorLeaseCoordinator | None,
                 on_event: EventHook | None = None,
                 notices: NoticeSource | None = None) -> None:
        super().__init__(options, callbacks, clock, random, notices)
        self.coordinator = coordinator
        self._heartbeat_coordinator = heartbeat_coordinator
        self._on_event = on_event
        self._sleep = sleep
        self._wakeup = threading.Event()
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None
        self.lost_event = threading.Event()
        """Set once the lease is lost while held (``lost_event.wait(timeout)``)."""

    def _perform(self, step: Step) -> object:
        o = self.options
        if isinstance(step, TryAcquire):
            return self.coordinator.acquire(o.identity, o.connector_id, scopes=o.scopes,
                                            ttl=o.ttl)
        if isinstance(step, TryTakeover):
            return self.coordinator.takeover(o.identity, o.connector_id, scopes=o.scopes,
                                             ttl=o.ttl, expected_epoch=step.expected_epoch)
        if isinstance(step, ReadHolder):
            return self.coordinator.current_holder(o.identity)
        if self._sleep is not None:
            self._sleep(step.seconds)
        else:
            self._wakeup.wait(step.seconds)  # a notice ends the pause early
            self._wakeup.clear()
        return None

    def _wait(self) -> Acquired:
        flow = waiting(self.options, self._clock, self._random, self._new_holder)
        try:
            step = next(flow)
            while True:
                try:
                    outcome = self._perform(step)
                except MosLeaseError as failure:
                    step = flow.throw(failure)
                else:
                    step = flow.send(outcome)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]

    def __enter__(self) -> Holder:
        if self._keeper is not None:
            raise InvalidInput("holder", "a holder holds once; call hold() again")
        # Subscribed before the first read, so a change between that read and the pause
        # still ends the pause.
        self._subscribe()
        try:
            acquired = self._wait()
        except BaseException:
            self._unsubscribe()
            raise
        lease = acquired.result.lease
        assert lease is not None
        timing = self.options.timing
        keeper = LeaseKeeper(self.coordinator, ttl=timing.ttl, min_backoff=timing.min_backoff,
                             max_backoff=timing.max_backoff, clock_step=timing.clock_step,
                             on_lost=self._keeper_lost,
                             clock=self._clock, random=self._random,
                             heartbeat_coordinator=self._heartbeat_coordinator,
                             on_event=self._on_event)
        self._keeper = keeper
        keeper.adopt(lease, obtained_at=acquired.started)
        self._callbacks("on_started", lease)
        if self._callbacks.has("on_expiring"):
            # Named by identity only: a thread name can reach log records, a lease UUID
            # and scopes must not.
            self._watcher = threading.Thread(target=self._watch, daemon=True,
                                             name=f"mos-lease-holder {lease.identity}")
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

    def _confirm_superseded(self, held_epoch: int) -> None:
        try:
            view = self.coordinator.current_holder(self.options.identity)
        except MosLeaseError:
            return  # unconfirmed: the keeper's next renewal decides
        self._lose_to(held_epoch, view)

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
        keeper = self._keeper
        self._raise_if_lost()
        assert isinstance(keeper, LeaseKeeper)
        result = keeper.issue_grant(scopes=scopes, ttl=ttl, correlation_id=correlation_id)
        if not result.ok:
            self._raise_if_lost()
        return result

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        keeper = self._keeper
        if keeper is None:
            return
        self._unsubscribe()
        self._closing.set()
        try:
            self._released(keeper.stop(release=True))
        except Exception:
            _log_release_failure(self.options.identity)
        if self._watcher is not None:
            self._watcher.join(1.0)
        self._callbacks("on_stopped")
