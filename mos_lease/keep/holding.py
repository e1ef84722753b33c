"""The two holders of :func:`~mos_lease.hold`: each is the supervisor engine with one binding
(:class:`~mos_lease.supervisor.Supervisor` or :class:`~mos_lease.supervisor.AsyncSupervisor`,
``add(..., once=True)``), turned by hand in the caller's thread or task while it waits, and
handed to the background once the lease is held (``start()``).

The engine decides everything: the campaign (what to read and try, when to pause, when to
give up), the renewals, the local deadline, the notice-confirmed loss. A holder only reads its
reports: :class:`~mos_lease.keep.changes.BindingStarted` enters the block,
:class:`~mos_lease.keep.changes.GaveUp` raises :class:`LeaseNotAcquired`,
:class:`~mos_lease.keep.changes.BindingLost` is the loss (``on_lost``, ``lost_event``,
the cancellation under ``cancel_on_loss``). Leaving removes the binding, which releases the
lease, and closes the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from datetime import timedelta
from types import TracebackType
from typing import Any, Generic, TypeVar

from mos_lease.coordinator import AsyncConnectorLeaseCoordinator, ConnectorLeaseCoordinator
from mos_lease.errors import InvalidInput
from mos_lease.identity import LeaseIdentity
from mos_lease.keep.changes import (
    BindingLost,
    BindingStarted,
    Change,
    GaveUp,
    NewHolder,
)
from mos_lease.keep.hold_options import (
    HoldOptions,
    LeaseLost,
    LeaseNotAcquired,
    NoticeSource,
)
from mos_lease.keep.notices import AnyNoticeCallback
from mos_lease.keep.runner import AsyncSupervisor, Supervisor
from mos_lease.keep.timing import LeaseLoss, LossCause
from mos_lease.notice_confirmer import NoticeConfirmer, confirmer_of
from mos_lease.records import LeaseHandle
from mos_lease.results import GrantResult, LeaseResult

log = logging.getLogger("mos_lease.holder")  # the name docs/telemetry.md gives operators

E = TypeVar("E", Supervisor, AsyncSupervisor)


def expiring_check(deadline: float, now: float, within: float) -> tuple[float | None, float]:
    """``(seconds left to report, or None; seconds until it is worth looking again)`` for a
    lease whose local deadline is ``deadline``."""
    alarm = deadline - within
    if now < alarm:
        return None, alarm - now
    # Inside the window: report, then look again at the deadline (by which the engine has
    # either renewed, moving the deadline, or reported loss).
    return max(deadline - now, 0.0), max(deadline - now, 0.01)


class _Feed:
    """``hold()``'s push source of one identity's changes as the engine's one subscription
    takes them (a :class:`~mos_lease.keep.notices.NoticeFeed`), naming the source's
    confirmer. :meth:`dispatch` is what a notice does, with or without a source."""

    def __init__(self, identity: LeaseIdentity, source: NoticeSource | None) -> None:
        self.identity = identity
        self.source = source
        self.confirmer: NoticeConfirmer = confirmer_of(source)
        self._callback: AnyNoticeCallback | None = None

    def subscribe_all(self, callback: AnyNoticeCallback) -> None:
        self._callback = callback
        if self.source is not None:
            self.source.subscribe(self.identity, self._on_notice)

    def unsubscribe_all(self, callback: AnyNoticeCallback) -> None:
        if self.source is not None:
            self.source.unsubscribe(self.identity, self._on_notice)
        self._callback = None

    def _on_notice(self, epoch: int, kind: str) -> None:
        self.dispatch(self.identity, epoch, kind)

    def dispatch(self, identity: LeaseIdentity, epoch: int, kind: str = "notice") -> None:
        callback = self._callback
        if callback is not None:
            callback(identity, epoch, kind)


class _Holding(Generic[E]):
    """What both holders share: the engine and its one binding, the reports read off it, and
    what the block uses. A shell names its engine (``_engine_kind``) and adds what waits."""

    _engine_kind: type[E]
    lost_event: threading.Event | asyncio.Event

    def __init__(self, coordinator: Any, options: HoldOptions, *, sleep: Any,
                 heartbeat_coordinator: Any) -> None:
        self.coordinator = coordinator
        self.options = options
        self._callbacks = options.callbacks
        self._sleep = sleep
        self._heartbeat_coordinator = heartbeat_coordinator
        self._clock = coordinator.monotonic if options.clock is None else options.clock
        self._engine: E | None = None
        self._feed = _Feed(options.identity, options.notices)
        self._held: LeaseHandle | None = None  # the lease won, once BindingStarted came
        self._gave_up: GaveUp | None = None
        self._loss: LeaseLoss | None = None  # a loss while held (never the release on leaving)
        self._stopped: LeaseLoss | None = None  # the release on leaving
        self._seen: tuple[str, int] | None = None
        self._left = False
        self._expiring_fired_for: float | None = None

    # -- entering and leaving ------------------------------------------------------------

    def _engage(self) -> E:
        """The engine, running the one binding (turned by hand until the lease is held)."""
        if self._engine is not None:
            raise InvalidInput("holder", "a holder holds once; call hold() again")
        options, timing = self.options, self.options.timing
        engine = self._engine = self._engine_kind(
            self.coordinator, on_change=self._changed, clock=self._clock, sleep=self._sleep,
            random=options.random, background=False, notices=self._feed,
            heartbeat_coordinator=self._heartbeat_coordinator,
            on_event=self._callbacks.on_event)
        # Only a real source tells of releases and takeovers: without one an active lease
        # is read again at each backoff, not waited out to its expiry.
        engine._core.schedule.noticed = options.notices is not None
        engine.add(options.identity, options.connector_id, scopes=options.scopes,
                   ttl=timing.ttl, safety_margin=timing.safety_margin,
                   clock_step=timing.clock_step, renew_fraction=timing.renew_fraction,
                   jitter=timing.jitter, min_backoff=timing.min_backoff,
                   max_backoff=timing.max_backoff, metadata=options.metadata or None,
                   takeover=options.takeover, wait=options.wait, once=True)
        return engine

    def _waiting(self) -> bool:
        return self._held is None and self._gave_up is None

    def _entered(self, engine: E) -> LeaseHandle:
        """After the wait: the lease held (the engine goes on in the background), or
        :class:`LeaseNotAcquired`."""
        gave_up = self._gave_up
        if gave_up is not None:
            raise LeaseNotAcquired(gave_up.identity, gave_up.reason, gave_up.holder,
                                   gave_up.error)
        assert self._held is not None
        # Named by identity only: a thread or task name can reach log records, a lease UUID
        # and scopes must not.
        engine.start(name=f"mos-lease-holder {self.options.identity}")
        self._callbacks.call("on_started", self._held)
        return self._held

    def _released(self, result: LeaseResult | None) -> None:
        if result is not None and not result.ok:
            log.info("mos_lease: release of %s refused: %s", self.options.identity,
                     result.reason)

    # -- the engine's reports --------------------------------------------------------------

    def _changed(self, change: Change) -> None:
        if isinstance(change, NewHolder):
            self._saw(change.holder.connector_id, change.holder.epoch)
        elif isinstance(change, BindingStarted):
            self._saw(change.lease.connector_id, change.lease.epoch)
            self._held = change.lease
        elif isinstance(change, GaveUp):
            self._gave_up = change
        elif isinstance(change, BindingLost):
            if change.loss.cause is LossCause.STOPPED:
                self._stopped = change.loss  # our own exit giving the lease back
                return
            self._loss = change.loss
            self.lost_event.set()
            self._callbacks.call("on_lost", change.loss)
            self._after_loss(change.loss)

    def _saw(self, connector_id: str, epoch: int) -> None:
        if self._seen != (connector_id, epoch):
            self._seen = (connector_id, epoch)
            self._callbacks.call("on_new_holder", connector_id, epoch)

    def _after_loss(self, loss: LeaseLoss) -> None:
        """What a shell does on loss besides reporting it (the asyncio one may cancel)."""

    # -- what the block uses ---------------------------------------------------------------

    def _now_held(self) -> LeaseHandle | None:
        """The lease held now, its local deadline judged by the engine (a passed one is
        recorded and reported here); ``None`` once lost or given back."""
        engine = self._engine
        if engine is None or self._held is None:
            raise InvalidInput("holder", "holds no lease: use it as a context manager")
        if self._left:
            return None
        return engine.lease(self.options.identity)

    @property
    def lease(self) -> LeaseHandle:
        """The held lease's handle; raises :class:`LeaseLost` once it is lost."""
        lease = self._now_held()
        if lease is None:
            raise LeaseLost(self._last_loss())
        return lease

    @property
    def lost(self) -> LeaseLoss | None:
        """Why the lease was lost while held (``None`` while held, and after a clean exit:
        giving the lease back is not a loss). The local deadline is checked on the spot."""
        if self._engine is not None and self._held is not None:
            self._now_held()
        return self._loss

    def _last_loss(self) -> LeaseLoss:
        if self._loss is not None:
            return self._loss
        engine = self._engine
        assert engine is not None
        with engine._core.lock:  # lost on the engine's thread, reported a moment later
            loss = engine._core.schedule.loss(self.options.identity)
        if loss is None:
            loss = self._stopped
        assert loss is not None
        return loss

    def _granted(self, result: GrantResult) -> GrantResult:
        """A refusal that revealed the loss raises :class:`LeaseLost`; any other result is
        returned."""
        if not result.ok:
            _ = self.lease
        return result

    def _check_expiring(self) -> float | None:
        """Report ``on_expiring`` when due; the seconds until it is worth looking again, or
        ``None`` once there is nothing left to watch."""
        engine = self._engine
        deadline = None if engine is None or self._left \
            else engine.deadline(self.options.identity)
        if deadline is None:
            return None
        left, again = expiring_check(deadline, self._clock(), self.options.expiring_within)
        if left is not None and self._expiring_fired_for != deadline:
            # Once per deadline: a renewal that succeeds moves it and re-arms the report.
            self._expiring_fired_for = deadline
            self._callbacks.call("on_expiring", left)
        return again

    def _notice(self, identity: LeaseIdentity, epoch: int) -> None:
        """What a notice does (the hook of the push source): ``identity``'s lease is now at
        ``epoch``, or so it says. Safe from any thread; the engine only ever confirms it by
        a read (coalesced and rate-bounded: :mod:`mos_lease.keep.notices`)."""
        self._feed.dispatch(identity, epoch)

    def _wake(self) -> None:
        """End the engine's pause now (on the loop, for the asyncio holder)."""
        if self._engine is not None:
            self._engine._wakeup.set()


class Holder(_Holding[Supervisor]):
    """:func:`~mos_lease.hold` for a :class:`~mos_lease.ConnectorLeaseCoordinator` (``with``)."""

    _engine_kind = Supervisor
    coordinator: ConnectorLeaseCoordinator

    def __init__(self, coordinator: ConnectorLeaseCoordinator, options: HoldOptions, *,
                 sleep: Callable[[float], object] | None = None,
                 heartbeat_coordinator: ConnectorLeaseCoordinator | None = None) -> None:
        super().__init__(coordinator, options, sleep=sleep,
                         heartbeat_coordinator=heartbeat_coordinator)
        self._closing = threading.Event()
        self._watcher: threading.Thread | None = None
        self.lost_event: threading.Event = threading.Event()
        """Set once the lease is lost while held (``lost_event.wait(timeout)``)."""

    def __enter__(self) -> Holder:
        engine = self._engage()
        try:
            while self._waiting():
                engine._wakeup.clear()  # as the engine's own loop: only a new wake-up counts
                engine.turn()
            lease = self._entered(engine)
        except BaseException:
            engine.close()  # a lease won meanwhile is released
            raise
        if self._callbacks.has("on_expiring"):
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

    def wait_lost(self, timeout: float | None = None) -> LeaseLoss | None:
        """Block until the lease is lost (or ``timeout`` passes); the loss, or ``None``."""
        self.lost_event.wait(timeout)
        return self.lost

    def issue_grant(self, *, scopes: object, ttl: float | timedelta,
                    correlation_id: str | None = None) -> GrantResult:
        """Mint a grant for the held lease. Raises :class:`LeaseLost` once the lease is lost
        (refused locally: nothing reaches the store); other refusals come back as results."""
        _ = self.lease
        assert self._engine is not None
        return self._granted(self._engine.issue_grant(
            self.options.identity, scopes=scopes, ttl=ttl, correlation_id=correlation_id))

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        engine = self._engine
        if engine is None or self._held is None or self._left:
            return
        self._left = True
        self._closing.set()
        try:
            self._released(engine.remove(self.options.identity))
        except Exception:
            # Never raised over the block's own exception (or its clean exit): the lease
            # expires on its own at the store's time, and nobody can act on it meanwhile.
            log.exception("mos_lease: release of %s failed", self.options.identity)
        engine.close()
        if self._watcher is not None:
            self._watcher.join(1.0)
        self._callbacks.call("on_stopped")


class AsyncHolder(_Holding[AsyncSupervisor]):
    """:func:`~mos_lease.hold` for an :class:`~mos_lease.AsyncConnectorLeaseCoordinator`
    (``async with``). With ``cancel_on_loss`` the task running the block is cancelled when
    the lease is lost, and the ``async with`` raises :class:`LeaseLost` instead of
    :class:`asyncio.CancelledError` (a cancellation from elsewhere still propagates)."""

    _engine_kind = AsyncSupervisor
    coordinator: AsyncConnectorLeaseCoordinator

    def __init__(self, coordinator: AsyncConnectorLeaseCoordinator, options: HoldOptions, *,
                 sleep: Callable[[float], Any] | None = None,
                 heartbeat_coordinator: AsyncConnectorLeaseCoordinator | None = None) -> None:
        super().__init__(coordinator, options, sleep=sleep,
                         heartbeat_coordinator=heartbeat_coordinator)
        self._cancel_on_loss = options.cancel_on_loss
        self._watcher: asyncio.Task[None] | None = None
        self._task: asyncio.Task[Any] | None = None
        self._inside = False
        self._cancel_sent = False
        self._base_cancelling = 0
        self.lost_event: asyncio.Event = asyncio.Event()
        """Set once the lease is lost while held (``await lost_event.wait()``)."""

    def __enter__(self) -> None:
        raise TypeError("hold() on an AsyncConnectorLeaseCoordinator: use `async with`")

    def __exit__(self, *_exc: object) -> None:  # pragma: no cover - __enter__ refuses
        return None

    async def __aenter__(self) -> AsyncHolder:
        engine = self._engage()
        try:
            while self._waiting():
                engine._wakeup.clear()  # as the engine's own loop: only a new wake-up counts
                await engine.turn()
            lease = self._entered(engine)
        except BaseException:
            # Cancelled, or given up: nothing here awaits while nothing is held, so a
            # cancellation is never held up; a campaign call in flight releases what it
            # wins once it ends (the engine's own rule for a binding removed meanwhile).
            await engine.close()
            raise
        self._task = asyncio.current_task()
        if self._task is not None:
            self._base_cancelling = self._task.cancelling()
        self._inside = True
        if self._callbacks.has("on_expiring"):
            self._watcher = asyncio.get_running_loop().create_task(
                self._watch(), name=f"mos-lease-holder {lease.identity}")
        return self

    async def _watch(self) -> None:
        while True:
            again = self._check_expiring()
            if again is None:
                return
            await asyncio.sleep(again)

    def _after_loss(self, loss: LeaseLoss) -> None:
        if self._cancel_on_loss and self._inside and self._task is not None \
                and not self._cancel_sent:
            self._cancel_sent = True
            self._task.cancel(f"mos_lease: lease lost ({loss.reason})")

    async def _leave(self, engine: AsyncSupervisor) -> None:
        try:
            self._released(await engine.remove(self.options.identity))
        except Exception:
            log.exception("mos_lease: release of %s failed", self.options.identity)
        finally:
            await engine.close()

    async def wait_lost(self) -> LeaseLoss:
        """Wait until the lease is lost; the loss."""
        await self.lost_event.wait()
        assert self._loss is not None
        return self._loss

    async def issue_grant(self, *, scopes: object, ttl: float | timedelta,
                          correlation_id: str | None = None) -> GrantResult:
        """As :meth:`Holder.issue_grant`."""
        _ = self.lease
        assert self._engine is not None
        return self._granted(await self._engine.issue_grant(
            self.options.identity, scopes=scopes, ttl=ttl, correlation_id=correlation_id))

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        engine = self._engine
        if engine is None or self._held is None or self._left:
            return
        self._left = True
        self._inside = False
        if self._watcher is not None:
            self._watcher.cancel()
        try:
            await self._leave(engine)
        except asyncio.CancelledError:
            if not self._cancel_sent:
                raise
            # Our own cancellation, reaching the task here rather than in the block (which
            # ended first); counted and taken back below, once the engine is closed.
            await engine.close()
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
