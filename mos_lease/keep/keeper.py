"""What the two keepers share. A keeper is the supervisor engine with one binding held once
(:class:`~mos_lease.supervisor.Supervisor` or :class:`~mos_lease.supervisor.AsyncSupervisor`,
``add(..., once=True, held=...)``): the start call (an acquire or a takeover, made by the
call itself, ``call.on(coordinator)``, :mod:`mos_lease.keep.keeper_calls`) is the keeper's; the
renewals, the deadline, the loss and its report are the engine's, the same as for every
binding of a supervisor. What is shared here: construction, the read-only view of the kept
state, the start, the loss report and the grant subject; the shells add what waits.
"""

from __future__ import annotations

import logging
import random as _random
import threading
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, Generic, TypeVar

from mos_lease.clock import MonotonicClock
from mos_lease.coordinator import (
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
)
from mos_lease.errors import ConfigurationError, InvalidInput
from mos_lease.events import EventHook
from mos_lease.identity import LeaseIdentity
from mos_lease.keep.changes import BindingLost, Change
from mos_lease.keep.keeper_calls import AcquireCall, TakeoverCall
from mos_lease.keep.slots import Slot
from mos_lease.keep.timing import (
    Action,
    KeeperState,
    KeeperTiming,
    LeaseLoss,
    next_action,
    timing_over,
)
from mos_lease.records import LeaseHandle
from mos_lease.results import LeaseResult
from mos_lease.vocabulary import Outcome

C = TypeVar("C", ConnectorLeaseCoordinator, AsyncConnectorLeaseCoordinator)
S = TypeVar("S")

log = logging.getLogger("mos_lease.keeper")


def _renewer(coordinator: C, heartbeat_coordinator: C | None, kind: type[C]) -> C:
    """The coordinator the keeper heartbeats through: by default its own; given another
    (on a store of its own), a heartbeat stuck on its connection cannot hold up the grant
    issues and validations going through ``coordinator``'s store."""
    if heartbeat_coordinator is None:
        return coordinator
    if not isinstance(heartbeat_coordinator, kind):
        raise ConfigurationError(f"heartbeat_coordinator must be a {kind.__name__}, not "
                                 f"{type(heartbeat_coordinator).__name__}")
    return heartbeat_coordinator


def _refuse_other_kind(keeper: str, coordinator: object, kind: type[object]) -> None:
    # Refused here, not at the first heartbeat: the engine a keeper runs on takes a
    # coordinator of its own kind only.
    if isinstance(coordinator, kind):
        return
    other: type[object] = (AsyncConnectorLeaseCoordinator if kind is ConnectorLeaseCoordinator
                           else ConnectorLeaseCoordinator)
    hint = ""
    if isinstance(coordinator, other):
        right = "AsyncLeaseKeeper" if other is AsyncConnectorLeaseCoordinator else "LeaseKeeper"
        hint = f": use {right} with it"
    raise ConfigurationError(f"{keeper} needs a {kind.__name__}, not "
                             f"{type(coordinator).__name__}{hint}")


def _adopted(lease: object) -> LeaseResult:
    if not isinstance(lease, LeaseHandle):
        raise InvalidInput("lease", f"must be a LeaseHandle, not {type(lease).__name__}")
    return LeaseResult(Outcome.ACQUIRED, None, "adopted", lease=lease)


class _Keeper(Generic[C, S]):
    """What both keepers share. ``C`` is the coordinator class, ``S`` the type of
    ``sleep``; a shell names its engine (``_engine_kind``) and its lost event's kind, and
    adds the methods that wait (start, step, grant, stop)."""

    _kind: type[C]  # the class heartbeat_coordinator must be
    _engine_kind: Any  # Supervisor or AsyncSupervisor

    def __init__(self, coordinator: C, *, ttl: float | timedelta,
                 renew_fraction: float | None = None, jitter: float | None = None,
                 safety_margin: float | None = None, min_backoff: float | None = None,
                 max_backoff: float | None = None, clock_step: float | None = None,
                 on_lost: Callable[[LeaseLoss], object] | None = None,
                 clock: MonotonicClock | None = None,
                 sleep: S | None = None,
                 random: Callable[[], float] = _random.random,
                 background: bool = True,
                 heartbeat_coordinator: C | None = None,
                 on_event: EventHook | None = None) -> None:
        _refuse_other_kind(type(self).__name__, coordinator, self._kind)
        self._setup()
        self.coordinator: C = coordinator
        self.heartbeat_coordinator: C = _renewer(coordinator, heartbeat_coordinator,
                                                 self._kind)
        self.timing: KeeperTiming = timing_over(
            coordinator.store, ttl, renew_fraction=renew_fraction, jitter=jitter,
            safety_margin=safety_margin, min_backoff=min_backoff, max_backoff=max_backoff,
            clock_step=clock_step)
        self.ttl = self.timing.ttl
        self._on_lost = on_lost
        self._background = background
        # The coordinator's clock unless told otherwise: deadlines and the coordinator's
        # in-flight times are then measured on one clock (CLOCK_BOOTTIME by default, so a
        # process resumed from suspend finds its deadline passed).
        self._clock: MonotonicClock = coordinator.monotonic if clock is None else clock
        self._engine = self._engine_kind(
            coordinator, on_change=self._changed, clock=self._clock, sleep=sleep,
            random=random, background=False, heartbeat_coordinator=self.heartbeat_coordinator,
            on_event=on_event)
        self._claim = threading.Lock()
        self._starting = False
        self._slot: Slot | None = None  # the engine's binding, once a lease is held

    # -- the kept state ------------------------------------------------------------------

    def _state(self) -> KeeperState | None:
        slot = self._slot
        if slot is None:
            return None
        with self._engine._core.lock:
            return slot.state

    @property
    def lease(self) -> LeaseHandle | None:
        """The current handle, or ``None`` before a lease is held and after it is lost."""
        state = self._state()
        return None if state is None or state.loss is not None else state.lease

    @property
    def loss(self) -> LeaseLoss | None:
        state = self._state()
        return None if state is None else state.loss

    @property
    def deadline(self) -> float | None:
        """The local deadline on the keeper's clock (``None`` before a lease is held)."""
        state = self._state()
        return None if state is None else state.deadline

    def enforce_deadline(self) -> LeaseLoss | None:
        """Record the loss if the local deadline has passed by now (reported like any
        loss, once); return the loss, if the lease is lost."""
        self.held_now()
        return self.loss

    def mark_lost(self, loss: LeaseLoss) -> None:
        """Record a loss learned elsewhere (say, news of a newer epoch) without waiting for
        the next heartbeat to find it; reported like any other loss, once. (On the
        asyncio keeper, call it on the loop.)"""
        lease = self.lease
        if lease is not None:
            self.revealed(lease, loss)

    def _changed(self, change: Change) -> None:
        """The engine's report: a loss (any cause, a stop too) sets ``lost`` and calls
        ``on_lost``, once."""
        if not isinstance(change, BindingLost):
            return
        self._signal()
        if self._on_lost is not None:
            try:
                self._on_lost(change.loss)
            except Exception:
                # The loss is already recorded and signalled; a failing callback must not
                # hide it or stop the engine.
                log.exception("mos_lease: on_lost callback failed")

    def _setup(self) -> None:
        """Make the shell's ``lost`` event."""
        raise NotImplementedError

    def _signal(self) -> None:
        raise NotImplementedError

    def _require(self) -> KeeperState:
        state = self._state()
        if state is None:
            raise InvalidInput("keeper", "holds no lease: acquire, take over or adopt first")
        return state

    def _action(self) -> Action:
        """What the keeper's next step does: the keeper's schedule, read off the engine's
        state (which the engine's turn then carries out)."""
        return next_action(self._require(), self._clock())

    # -- starting ------------------------------------------------------------------------

    def _claim_start(self) -> float:
        """Before an acquire, takeover or adoption: a keeper keeps one lease, once; the
        clock's reading before the call."""
        with self._claim:
            if self._slot is not None:
                raise InvalidInput("keeper", "a keeper keeps one lease; make a new keeper")
            if self._starting:
                raise InvalidInput("keeper", "another acquire or takeover is in progress")
            self._starting = True
        return self._clock()

    def _started(self, result: LeaseResult | None, started: float) -> None:
        """After the start call (``None`` if it raised): a lease won is kept by the engine
        from the call's start, renewing in the background unless driven by hand."""
        try:
            lease = None if result is None or not result.ok else result.lease
            if lease is None:
                return
            timing = self.timing
            self._engine.add(lease.identity, lease.connector_id, scopes=lease.scopes,
                             ttl=timing.ttl, safety_margin=timing.safety_margin,
                             clock_step=timing.clock_step, renew_fraction=timing.renew_fraction,
                             jitter=timing.jitter, min_backoff=timing.min_backoff,
                             max_backoff=timing.max_backoff, once=True, held=lease,
                             obtained_at=started)
            with self._engine._core.lock:
                self._slot = self._engine._core.schedule.slots[lease.identity]
            if self._background:
                # Named by identity only: a thread or task name reaches log records, and a
                # handle's repr carries the lease UUID and the scopes.
                self._engine.start(name=f"mos-lease-keeper {lease.identity}")
        finally:
            with self._claim:
                self._starting = False

    def _acquire_call(self, identity: LeaseIdentity, connector_id: str, scopes: object,
                      correlation_id: str | None,
                      metadata: Mapping[str, str] | None) -> AcquireCall:
        return AcquireCall(identity, connector_id, scopes, self.ttl, correlation_id, metadata)

    def _takeover_call(self, identity: LeaseIdentity, connector_id: str, scopes: object,
                       expected_epoch: int, correlation_id: str | None,
                       metadata: Mapping[str, str] | None) -> TakeoverCall:
        return TakeoverCall(identity, connector_id, scopes, self.ttl, expected_epoch,
                            correlation_id, metadata)

    # -- the keeper as held_grant.GrantSubject sees it -----------------------------------

    def held_now(self) -> LeaseHandle | None:
        """The lease held now, its local deadline judged by the engine (a passed one is
        recorded and reported); ``None`` if none is held."""
        slot = self._slot
        if slot is None or slot.removed:
            return None
        return self._engine.lease(slot.binding.identity)  # type: ignore[no-any-return]

    def revealed(self, lease: LeaseHandle, loss: LeaseLoss) -> None:
        core = self._engine._core
        with core.lock:
            changes = core.schedule.reveal(lease.identity, lease, loss)
        core.report(changes)

    def last_loss(self) -> LeaseLoss | None:
        return self.loss

    def _stopping(self) -> LeaseIdentity | None:
        """The identity to remove from the engine on stop (``None``: nothing was held, and
        the keeper may still start)."""
        slot = self._slot
        return None if slot is None else slot.binding.identity
