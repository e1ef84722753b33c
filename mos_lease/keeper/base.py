"""What the two keepers share: construction, the read-only view of the keeper's state, and
which steps each public method runs. :class:`~mos_lease.keeper.thread_keeper.LeaseKeeper`
runs the steps of ``steps.py`` on a thread, :class:`~mos_lease.keeper.asyncio_keeper.
AsyncLeaseKeeper` as an asyncio task. Each only performs the steps: a coordinator call is
made by the call itself (``call.on(coordinator)``, :mod:`mos_lease.keeper.calls`); what a
driver adds is how it waits (a pause that a stop ends early, a heartbeat abandoned at the
deadline), which is where threads and asyncio differ.
"""

from __future__ import annotations

import random as _random
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
from mos_lease.keeper import steps
from mos_lease.keeper.calls import AcquireCall, Steps, TakeoverCall
from mos_lease.keeper.schedule import KeeperTiming, LeaseLoss, default_clock_step
from mos_lease.keeper.steps import KeeperCore
from mos_lease.records import LeaseHandle
from mos_lease.results import LeaseResult
from mos_lease.vocabulary import Outcome

C = TypeVar("C", ConnectorLeaseCoordinator, AsyncConnectorLeaseCoordinator)
S = TypeVar("S")


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
    # Refused here, not at the first heartbeat (a coroutine never awaited, or an awaited
    # result that is no awaitable). Only the other kind is refused: a stand-in with the
    # coordinator's methods (a test's recording double) is taken.
    other: type[object] = (AsyncConnectorLeaseCoordinator if kind is ConnectorLeaseCoordinator
                           else ConnectorLeaseCoordinator)
    if isinstance(coordinator, other):
        right = "AsyncLeaseKeeper" if other is AsyncConnectorLeaseCoordinator else "LeaseKeeper"
        raise ConfigurationError(f"{keeper} needs a {kind.__name__}, not "
                                 f"{type(coordinator).__name__}: use {right} with it")


def _timing(store: object, ttl: float | timedelta, **options: float | None) -> KeeperTiming:
    # An option left at None takes KeeperTiming's default; clock_step the store's.
    seconds = ttl.total_seconds() if isinstance(ttl, timedelta) else ttl
    if options.get("clock_step") is None:
        options["clock_step"] = default_clock_step(store)
    return KeeperTiming(seconds, **{k: v for k, v in options.items() if v is not None})


def _adopted(lease: object) -> LeaseResult:
    if not isinstance(lease, LeaseHandle):
        raise InvalidInput("lease", f"must be a LeaseHandle, not {type(lease).__name__}")
    return LeaseResult(Outcome.ACQUIRED, None, "adopted", lease=lease)


class _Keeper(Generic[C, S]):
    """What both keepers share: construction and the read-only view of the core. ``C`` is
    the coordinator class, ``S`` the type of ``sleep``; a shell adds ``_setup``, which makes
    its own parts, and ``_perform``, which performs one step."""

    _kind: type[C]  # the class heartbeat_coordinator must be

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
        signal = self._setup(sleep)
        self.coordinator: C = coordinator
        self.heartbeat_coordinator: C = _renewer(coordinator, heartbeat_coordinator,
                                                 self._kind)
        timing = _timing(coordinator.store, ttl, renew_fraction=renew_fraction, jitter=jitter,
                         safety_margin=safety_margin, min_backoff=min_backoff,
                         max_backoff=max_backoff, clock_step=clock_step)
        # The coordinator's clock unless told otherwise: deadlines and the coordinator's
        # in-flight times are then measured on one clock (CLOCK_BOOTTIME by default, so a
        # process resumed from suspend finds its deadline passed).
        self._core = KeeperCore(timing, coordinator.monotonic if clock is None else clock,
                                random, on_lost, on_event, signal)
        self.ttl = timing.ttl
        self._background = background

    def _setup(self, sleep: S | None) -> Callable[[], object]:
        """Make the shell's own parts (its ``lost`` event first); return the loss signal."""
        raise NotImplementedError

    @property
    def timing(self) -> KeeperTiming:
        return self._core.timing

    @property
    def lease(self) -> LeaseHandle | None:
        """The current handle, or ``None`` before a lease is held and after it is lost."""
        return self._core.lease

    @property
    def loss(self) -> LeaseLoss | None:
        return self._core.loss

    @property
    def deadline(self) -> float | None:
        """The local deadline on the keeper's clock (``None`` before a lease is held)."""
        return self._core.deadline

    def enforce_deadline(self) -> LeaseLoss | None:
        """Record the loss if the local deadline has passed by now (reported like any
        loss, once); return the loss, if the lease is lost."""
        return self._core.enforce_deadline()

    def mark_lost(self, loss: LeaseLoss) -> None:
        """Record a loss learned elsewhere (say, news of a newer epoch) without waiting for
        the next heartbeat to find it; reported like any other loss, once. (On the
        asyncio keeper, call it on the loop.)"""
        self._core.lose(loss)

    def _name(self) -> str:
        # Named by identity only: a thread or task name reaches log records, and a
        # handle's repr carries the lease UUID and the scopes.
        return f"mos-lease-keeper {self._core.require_state().lease.identity}"

    # -- which steps the public methods run ---------------------------------------------

    def _acquire(self, identity: LeaseIdentity, connector_id: str, scopes: object,
                 correlation_id: str | None,
                 metadata: Mapping[str, str] | None = None) -> Steps[Any]:
        return steps.start(self._core, AcquireCall(identity, connector_id, scopes, self.ttl,
                                                   correlation_id, metadata))

    def _takeover(self, identity: LeaseIdentity, connector_id: str, scopes: object,
                  expected_epoch: int, correlation_id: str | None,
                  metadata: Mapping[str, str] | None = None) -> Steps[Any]:
        return steps.start(self._core, TakeoverCall(identity, connector_id, scopes, self.ttl,
                                                    expected_epoch, correlation_id, metadata))

    def _adopt(self, lease: LeaseHandle, obtained_at: float) -> Steps[Any]:
        return steps.start(self._core, _adopted(lease), obtained_at)
