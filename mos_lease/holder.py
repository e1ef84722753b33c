"""Holding a lease: wait until it can be had, keep it renewed, give it back.

:func:`hold` is the loop every gateway needs around the low-level calls::

    with hold(coordinator, identity, "claude-a", scopes=["tool:run"], ttl=30) as held:
        grant = held.issue_grant(scopes=["tool:run"], ttl=10)
        ...
    # released here, also when the block raised

    async with hold(async_coordinator, identity, "claude-a", scopes=["tool:run"], ttl=30,
                    cancel_on_loss=True) as held:
        ...  # cancelled if the lease is lost; the ``async with`` then raises LeaseLost

Waiting is a generator of steps (:func:`waiting`), like the coordinator's flows: it decides
what to try, how long to pause and when to give up, and the two thin shells
(:class:`Holder`, :class:`AsyncHolder`) only perform the steps. Holding is a keeper
(:mod:`mos_lease.keeper`), which already owns the renewal schedule and the local deadline.

While waiting, the lease is *read* (:meth:`~mos_lease.ConnectorLeaseCoordinator.
current_holder`, no audit row), and a write is tried only when the read says it could
succeed: a waiter polling for minutes does not fill the audit log with refusals. The first
try is an acquire, which wins at once on a free identity. A takeover always names the epoch
just observed, so of several waiters exactly one wins, and an active holder is preempted
only under ``takeover="preempt"`` (which the coordinator's policy may still refuse).

A push source of lease changes (``notices=``, a :class:`NoticeSource` such as
``mos_lease_pg.notices.LeaseNotices``) feeds ``_notice(identity, epoch)``: it wakes a waiter
at once and reports loss early to a holder whose epoch was superseded. Without one, waiters
poll and holders learn of loss at their next heartbeat. A notice is only a hint: it never
grants anything, and fencing never waits for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import random as _random
import threading
from collections.abc import Awaitable, Callable, Generator
from datetime import timedelta
from types import TracebackType
from typing import Any, Final, Protocol, overload

import attrs

from mos_lease.coordinator import (
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    default_clock,
)
from mos_lease.errors import InvalidInput, MosLeaseError
from mos_lease.events import EventHook
from mos_lease.identity import (
    LEASE_TTL_CAP,
    LeaseIdentity,
    Scopes,
    check_id,
    check_identity,
    normalize_scopes,
    normalize_ttl,
)
from mos_lease.keeper import (
    TRANSIENT_ERRORS,
    AsyncLeaseKeeper,
    KeeperTiming,
    LeaseKeeper,
    LeaseLoss,
    LossCause,
)
from mos_lease.records import LeaseHandle
from mos_lease.results import GrantResult, HolderView, LeaseResult
from mos_lease.vocabulary import LeaseState, Reason

log = logging.getLogger("mos_lease.holder")

MAX_WAIT: Final = 7 * 24 * 3600.0
"""The longest finite ``wait`` (seconds); ``None`` waits without limit."""


class TakeoverPolicy(enum.StrEnum):
    """When a waiter may take the lease over (``takeover=`` of :func:`hold`)."""

    NEVER = "never"  # only a first acquisition: an identity that never had a lease
    EXPIRED = "expired"  # also take over an expired or released lease (the default)
    PREEMPT = "preempt"  # also an active one, if the coordinator's policy allows it


# Refusals a later try may not meet: the lease may expire, be released or change hands, and
# the store may come back. Any other refusal (the policy's, an exhausted epoch) is final.
RETRY_REASONS: Final = frozenset({
    Reason.LEASE_HELD, Reason.TAKEOVER_REQUIRED, Reason.EPOCH_MISMATCH, Reason.LEASE_MISSING,
    Reason.PREEMPTION_DENIED, Reason.STORE_UNAVAILABLE,
})


class LeaseNotAcquired(MosLeaseError):
    """:func:`hold` gave up: ``wait`` ran out, or the refusal cannot change by waiting.

    ``reason`` is the last reason the lease could not be had; ``holder`` the last view of
    who holds it (``None`` if none was read), with ``connector_id`` and ``epoch`` copied
    from it. ``error`` describes the last store error, if the store was unavailable.
    Defined here rather than in :mod:`mos_lease.errors`: it is the holder's typed way of
    saying "not acquired", not a fault of the library or its caller.
    """

    def __init__(self, identity: LeaseIdentity, reason: Reason, holder: HolderView | None,
                 error: str | None = None) -> None:
        held = ("" if holder is None else
                f"; {holder.state} lease of {holder.connector_id!r} at epoch {holder.epoch}")
        super().__init__(f"lease of {identity} not acquired: {reason}{held}"
                         + (f" (last error: {error})" if error else ""))
        self.identity = identity
        self.reason = reason
        self.holder = holder
        self.connector_id = None if holder is None else holder.connector_id
        self.epoch = None if holder is None else holder.epoch
        self.error = error


class LeaseLost(MosLeaseError):
    """The held lease is lost (``loss`` says why and when); the holder may not act on it."""

    def __init__(self, loss: LeaseLoss) -> None:
        super().__init__(f"lease lost: {loss.cause} ({loss.reason})"
                         + (f", last error: {loss.error}" if loss.error else ""))
        self.loss = loss


# --- options --------------------------------------------------------------------------------


@attrs.frozen(slots=True)
class HoldOptions:
    """Everything :func:`hold` was asked for, checked and normalized."""

    identity: LeaseIdentity
    connector_id: str
    scopes: Scopes
    wait: float | None
    takeover: TakeoverPolicy
    timing: KeeperTiming  # the ttl and the backoff bounds, shared with the keeper
    expiring_within: float

    @property
    def ttl(self) -> float:
        return self.timing.ttl


def _check_wait(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput("wait", f"must be seconds or None, not {type(value).__name__}")
    if not (math.isfinite(value) and 0 <= value <= MAX_WAIT):
        raise InvalidInput("wait", f"must be between 0 and {MAX_WAIT:g} s, or None to wait "
                           "without limit")
    return float(value)


def _check_takeover(value: object) -> TakeoverPolicy:
    if isinstance(value, TakeoverPolicy):
        return value
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return TakeoverPolicy(str.__str__(value))
    choices = ", ".join(repr(p.value) for p in TakeoverPolicy)
    raise InvalidInput("takeover", f"must be one of {choices}, not {value!r:.40}")


def _check_callable(field: str, value: object) -> None:
    if value is not None and not callable(value):
        raise InvalidInput(field, f"must be callable or None, not {type(value).__name__}")


NoticeCallback = Callable[[int, str], object]


class NoticeSource(Protocol):
    """A push source of lease changes: calls ``callback(epoch, kind)`` from any thread when
    ``identity``'s lease changed hands or was released (``mos_lease_pg.notices``)."""

    def subscribe(self, identity: LeaseIdentity, callback: NoticeCallback) -> None: ...

    def unsubscribe(self, identity: LeaseIdentity, callback: NoticeCallback) -> None: ...


def _check_notices(value: object) -> NoticeSource | None:
    if value is None:
        return None
    if not (callable(getattr(value, "subscribe", None))
            and callable(getattr(value, "unsubscribe", None))):
        raise InvalidInput("notices", "must have subscribe() and unsubscribe() (a "
                           f"LeaseNotices) or be None, not {type(value).__name__}")
    return value  # type: ignore[return-value]


def latest_healthy_gap(timing: KeeperTiming) -> float:
    """How close to its deadline a healthy keeper's lease can come before its renewal is
    due: an ``expiring_within`` this large or larger would cry wolf."""
    return timing.ttl - timing.margin - timing.ttl * timing.renew_fraction * (1 + timing.jitter)


def _seconds_or_none(field: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value <= 0:
        raise InvalidInput(field, "must be a positive number of seconds, or None")
    return float(value)


def check_options(identity: object, connector_id: object, *, scopes: object, ttl: object,
                  wait: object, takeover: object, min_backoff: object, max_backoff: object,
                  expiring_within: object) -> HoldOptions:
    """Check every argument before anything is read or written."""
    checked_identity = check_identity("identity", identity)
    checked_connector = check_id("connector_id", connector_id)
    norm_scopes = normalize_scopes("scopes", scopes)
    norm_ttl = normalize_ttl("ttl", ttl, LEASE_TTL_CAP).total_seconds()
    bounds = {name: seconds for name, seconds in (
        ("min_backoff", _seconds_or_none("min_backoff", min_backoff)),
        ("max_backoff", _seconds_or_none("max_backoff", max_backoff))) if seconds is not None}
    timing = KeeperTiming(norm_ttl, **bounds)  # refuses min_backoff > max_backoff
    gap = latest_healthy_gap(timing)
    within = _seconds_or_none("expiring_within", expiring_within)
    if within is None:
        within = gap / 2
    elif within >= gap:
        raise InvalidInput("expiring_within", f"must be less than {gap:g} s for ttl "
                           f"{norm_ttl:g} s (a healthy lease comes that close to its deadline)")
    return HoldOptions(checked_identity, checked_connector, norm_scopes, _check_wait(wait),
                       _check_takeover(takeover), timing, within)


# --- the pure part: what to try while waiting -------------------------------------------------


@attrs.frozen(slots=True)
class TryAcquire:
    """Acquire (insert-only): wins exactly when the identity never had a lease."""


@attrs.frozen(slots=True)
class TryTakeover:
    """Take over the lease at ``expected_epoch``, the epoch just observed."""

    expected_epoch: int


@attrs.frozen(slots=True)
class ReadHolder:
    """Read who holds the lease (no audit row)."""


@attrs.frozen(slots=True)
class Pause:
    seconds: float


Step = TryAcquire | TryTakeover | ReadHolder | Pause


def plan_attempt(view: HolderView | None, policy: TakeoverPolicy,
                 preempt_refused: bool) -> TryAcquire | TryTakeover | Reason:
    """What to try after reading ``view``, or the reason to go on waiting instead."""
    if view is None:
        return TryAcquire()
    if view.state is LeaseState.ACTIVE:
        if policy is TakeoverPolicy.PREEMPT and not preempt_refused:
            return TryTakeover(view.epoch)
        return Reason.LEASE_HELD
    if policy is TakeoverPolicy.NEVER:
        return Reason.TAKEOVER_REQUIRED
    return TryTakeover(view.epoch)


def pause_for(timing: KeeperTiming, failures: int, draw: float, remaining: float | None,
              view: HolderView | None) -> float:
    """Backoff with jitter (the keeper's), never past the end of the wait, and waking no
    later than the moment the observed lease would expire."""
    delay = timing.backoff(failures, draw, math.inf if remaining is None else remaining)
    if view is not None and view.state is LeaseState.ACTIVE:
        delay = min(delay, max((view.expires_at - view.now).total_seconds(), 0.0))
    return max(delay, 0.0)


@attrs.frozen(slots=True)
class Acquired:
    result: LeaseResult
    started: float  # the clock before the successful call: where the keeper's deadline starts


def waiting(options: HoldOptions, clock: Callable[[], float], draw: Callable[[], float],
            new_holder: Callable[[str, int], None]) -> Generator[Step, Any, Acquired]:
    """The whole wait, as steps: a :class:`TryAcquire` or :class:`TryTakeover` is sent its
    :class:`LeaseResult`, :class:`ReadHolder` its :class:`HolderView` or ``None``,
    :class:`Pause` nothing. A transient store error may be thrown in at any step. Returns
    once a lease is held; raises :class:`LeaseNotAcquired` when the wait is over or waiting
    cannot help."""
    ends = None if options.wait is None else clock() + options.wait
    attempt: TryAcquire | TryTakeover | None = TryAcquire()
    probing = True  # a refused first acquire is how the state is learnt: no pause after it
    failures = 0
    reason = Reason.LEASE_HELD
    error: str | None = None
    view: HolderView | None = None
    seen: tuple[str, int] | None = None
    preempt_refused = False
    while True:
        pause = True
        if attempt is not None:
            started = clock()
            try:
                result: LeaseResult = yield attempt
            except TRANSIENT_ERRORS as down:
                reason, error = Reason.STORE_UNAVAILABLE, f"{type(down).__name__}: {down}"
            else:
                if result.ok and result.lease is not None:
                    lease = result.lease
                    if seen != (lease.connector_id, lease.epoch):
                        new_holder(lease.connector_id, lease.epoch)
                    return Acquired(result, started)
                assert result.reason is not None
                reason, error = result.reason, None
                if reason not in RETRY_REASONS:
                    raise LeaseNotAcquired(options.identity, reason, view)
                preempt_refused |= reason is Reason.PREEMPTION_DENIED
            pause, probing = not probing, False
        if pause:
            remaining = None if ends is None else ends - clock()
            if remaining is not None and remaining <= 0:
                raise LeaseNotAcquired(options.identity, reason, view, error)
            yield Pause(pause_for(options.timing, failures + 1, draw(), remaining, view))
            failures += 1
        try:
            view = yield ReadHolder()
        except TRANSIENT_ERRORS as down:
            reason, error = Reason.STORE_UNAVAILABLE, f"{type(down).__name__}: {down}"
            attempt = None
            continue
        if view is not None and seen != (view.connector_id, view.epoch):
            seen = (view.connector_id, view.epoch)
            new_holder(*seen)
        planned = plan_attempt(view, options.takeover, preempt_refused)
        if isinstance(planned, Reason):
            reason, error, attempt = planned, None, None
        else:
            attempt = planned


def expiring_check(deadline: float, now: float, within: float) -> tuple[float | None, float]:
    """``(seconds left to report, or None; seconds until it is worth looking again)`` for a
    keeper whose local deadline is ``deadline``."""
    alarm = deadline - within
    if now < alarm:
        return None, alarm - now
    # Inside the window: report, then look again at the deadline (by which the keeper has
    # either renewed, moving the deadline, or reported loss).
    return max(deadline - now, 0.0), max(deadline - now, 0.01)


# --- what both shells share ---------------------------------------------------------------------


class _Callbacks:
    """The user's callbacks; one that raises is logged and never breaks holding."""

    def __init__(self, **callbacks: Callable[..., object] | None) -> None:
        for name, callback in callbacks.items():
            _check_callable(name, callback)
        self._callbacks = callbacks

    def has(self, name: str) -> bool:
        return self._callbacks.get(name) is not None

    def __call__(self, name: str, *args: object) -> None:
        callback = self._callbacks.get(name)
        if callback is None:
            return
        try:
            callback(*args)
        except Exception:
            log.exception("mos_lease: %s callback failed", name)


class _HolderBase:
    """State and behaviour that do not depend on threads or asyncio."""

    _keeper: LeaseKeeper | AsyncLeaseKeeper | None

    def __init__(self, options: HoldOptions, callbacks: _Callbacks,
                 clock: Callable[[], float], random: Callable[[], float],
                 notices: NoticeSource | None = None) -> None:
        self.options = options
        self._notices = notices
        self._callbacks = callbacks
        self._clock = clock
        self._random = random
        self._keeper = None
        self._loss: LeaseLoss | None = None
        self._expiring_fired_for: float | None = None

    # -- what the body uses ----------------------------------------------------------------

    @property
    def lease(self) -> LeaseHandle:
        """The held lease's handle; raises :class:`LeaseLost` once it is lost."""
        keeper = self._require_keeper()
        self._raise_if_lost()
        lease = keeper.lease
        assert lease is not None  # not lost, so held
        return lease

    @property
    def lost(self) -> LeaseLoss | None:
        """Why the lease was lost while held (``None`` while held, and after a clean exit:
        giving the lease back is not a loss). The local deadline is checked on the spot."""
        if self._keeper is not None and self._keeper.lease is not None:
            self._keeper.enforce_deadline()  # a passed deadline is recorded (and reported) now
        return self._loss

    def _require_keeper(self) -> LeaseKeeper | AsyncLeaseKeeper:
        if self._keeper is None:
            raise InvalidInput("holder", "holds no lease: use it as a context manager")
        return self._keeper

    def _raise_if_lost(self) -> None:
        keeper = self._require_keeper()
        if keeper.lease is not None:
            keeper.enforce_deadline()
        loss = keeper.loss
        if loss is not None:
            raise LeaseLost(self._loss if self._loss is not None else loss)

    # -- events --------------------------------------------------------------------------

    def _new_holder(self, connector_id: str, epoch: int) -> None:
        self._callbacks("on_new_holder", connector_id, epoch)

    def _keeper_lost(self, loss: LeaseLoss) -> None:
        """The keeper's ``on_lost``: runs once, on the keeper's thread or the loop."""
        if loss.cause is LossCause.STOPPED:
            return  # our own exit giving the lease back: not a loss
        self._loss = loss
        self._callbacks("on_lost", loss)
        self._after_loss(loss)

    def _after_loss(self, loss: LeaseLoss) -> None:
        """What a shell does on loss besides reporting it (the asyncio one may cancel)."""

    def _check_expiring(self) -> float | None:
        """Report ``on_expiring`` when due; the seconds until it is worth looking again, or
        ``None`` once there is nothing left to watch."""
        keeper = self._keeper
        deadline = None if keeper is None or keeper.lease is None else keeper.deadline
        if deadline is None:
            return None
        left, again = expiring_check(deadline, self._clock(), self.options.expiring_within)
        if left is not None and self._expiring_fired_for != deadline:
            # Once per deadline: a renewal that succeeds moves it and re-arms the report.
            self._expiring_fired_for = deadline
            self._callbacks("on_expiring", left)
        return again

    def _notice(self, identity: LeaseIdentity, epoch: int) -> None:
        """The hook for a push source of lease changes: ``identity``'s lease is now at
        ``epoch``. A holder whose epoch it supersedes reports loss at once; a waiter looks
        again at once. Safe to call from any thread for :class:`Holder`; on the loop for
        :class:`AsyncHolder`. A notice is only a hint: it never grants anything."""
        if identity != self.options.identity:
            return
        keeper = self._keeper
        lease = None if keeper is None else keeper.lease
        if keeper is not None and lease is not None:
            if epoch > lease.epoch:
                # Anyone who can log in may send NOTIFY: a notice alone must not end a
                # holding, so one read confirms the newer epoch first.
                self._confirm_superseded(lease.epoch)
            return
        self._wake()

    def _lose_to(self, held_epoch: int, view: HolderView | None) -> None:
        """Report loss if the store's current epoch ``view`` supersedes ``held_epoch``."""
        keeper = self._keeper
        if keeper is None or view is None or view.epoch <= held_epoch:
            return
        keeper.mark_lost(LeaseLoss(LossCause.DENIED, Reason.STALE_EPOCH, self._clock(),
                                   f"notice of epoch {view.epoch}, confirmed by a read"))

    def _confirm_superseded(self, held_epoch: int) -> None:
        raise NotImplementedError

    def _wake(self) -> None:
        raise NotImplementedError

    def _on_notice(self, epoch: int, kind: str) -> None:
        """The callback given to the notice source; runs on its thread (see ``_notice``)."""
        self._notice(self.options.identity, epoch)

    def _subscribe(self) -> None:
        if self._notices is not None:
            self._notices.subscribe(self.options.identity, self._on_notice)

    def _unsubscribe(self) -> None:
        if self._notices is not None:
            self._notices.unsubscribe(self.options.identity, self._on_notice)

    def _released(self, result: LeaseResult | None) -> None:
        if result is not None and not result.ok:
            log.info("mos_lease: release of %s refused: %s", self.options.identity,
                     result.reason)


def _log_release_failure(identity: LeaseIdentity) -> None:
    # Logged, never raised over the body's own exception (or its clean exit: the lease
    # expires on its own at the store's time, and nobody can act on it meanwhile).
    log.exception("mos_lease: release of %s failed", identity)


# --- the thread shell -------------------------------------------------------------------------


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
                             max_backoff=timing.max_backoff, on_lost=self._keeper_lost,
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


# --- the asyncio shell ------------------------------------------------------------------------


class AsyncHolder(_HolderBase):
    """:func:`hold` for an :class:`~mos_lease.AsyncConnectorLeaseCoordinator`
    (``async with``). With ``cancel_on_loss`` the task running the block is cancelled when
    the lease is lost, and the ``async with`` raises :class:`LeaseLost` instead of
    :class:`asyncio.CancelledError` (a cancellation from elsewhere still propagates)."""

    _keeper: AsyncLeaseKeeper | None

    def __init__(self, coordinator: AsyncConnectorLeaseCoordinator, options: HoldOptions,
                 callbacks: _Callbacks, *, clock: Callable[[], float],
                 random: Callable[[], float], sleep: Callable[[float], Awaitable[object]] | None,
                 heartbeat_coordinator: AsyncConnectorLeaseCoordinator | None,
                 cancel_on_loss: bool, on_event: EventHook | None = None,
                 notices: NoticeSource | None = None) -> None:
        super().__init__(options, callbacks, clock, random, notices)
        self._loop: asyncio.AbstractEventLoop | None = None
        self.coordinator = coordinator
        self._confirming: set[asyncio.Task[None]] = set()
        self._heartbeat_coordinator = heartbeat_coordinator
        self._on_event = on_event
        self._sleep = sleep
        self._cancel_on_loss = cancel_on_loss
        self._wakeup = asyncio.Event()
        self._watcher: asyncio.Task[None] | None = None
        self._task: asyncio.Task[Any] | None = None
        self._inside = False
        self._cancel_sent = False
        self._base_cancelling = 0
        self.lost_event = asyncio.Event()
        """Set once the lease is lost while held (``await lost_event.wait()``)."""

    async def _perform(self, step: Step) -> object:
        o = self.options
        if isinstance(step, TryAcquire):
            return await self.coordinator.acquire(o.identity, o.connector_id, scopes=o.scopes,
                                                  ttl=o.ttl)
        if isinstance(step, TryTakeover):
            return await self.coordinator.takeover(
                o.identity, o.connector_id, scopes=o.scopes, ttl=o.ttl,
                expected_epoch=step.expected_epoch)
        if isinstance(step, ReadHolder):
            return await self.coordinator.current_holder(o.identity)
        if self._sleep is not None:
            await self._sleep(step.seconds)
        else:
            with contextlib.suppress(TimeoutError):  # a notice ends the pause early
                await asyncio.wait_for(self._wakeup.wait(), step.seconds)
            self._wakeup.clear()
        return None

    async def _wait(self) -> Acquired:
        flow = waiting(self.options, self._clock, self._random, self._new_holder)
        try:
            step = next(flow)
            while True:
                try:
                    outcome = await self._perform(step)
                except MosLeaseError as failure:
                    step = flow.throw(failure)
                else:
                    step = flow.send(outcome)
        except StopIteration as done:
            return done.value  # type: ignore[no-any-return]

    def __enter__(self) -> None:
        raise TypeError("hold() on an AsyncConnectorLeaseCoordinator: use `async with`")

    def __exit__(self, *_exc: object) -> None:  # pragma: no cover - __enter__ refuses
        return None

    async def __aenter__(self) -> AsyncHolder:
        if self._keeper is not None:
            raise InvalidInput("holder", "a holder holds once; call hold() again")
        self._loop = asyncio.get_running_loop()
        self._subscribe()
        try:
            acquired = await self._wait()
        except BaseException:
            self._unsubscribe()
            raise
        lease = acquired.result.lease
        assert lease is not None
        timing = self.options.timing
        keeper = AsyncLeaseKeeper(self.coordinator, ttl=timing.ttl,
                                  min_backoff=timing.min_backoff,
                                  max_backoff=timing.max_backoff, on_lost=self._keeper_lost,
                                  clock=self._clock, random=self._random,
                                  heartbeat_coordinator=self._heartbeat_coordinator,
                                  on_event=self._on_event)
        self._keeper = keeper
        await keeper.adopt(lease, obtained_at=acquired.started)
        self._task = asyncio.current_task()
        if self._task is not None:
            self._base_cancelling = self._task.cancelling()
        self._inside = True
        self._callbacks("on_started", lease)
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
        self.lost_event.set()
        if self._cancel_on_loss and self._inside and self._task is not None \
                and not self._cancel_sent:
            self._cancel_sent = True
            self._task.cancel(f"mos_lease: lease lost ({loss.reason})")

    def _wake(self) -> None:
        self._wakeup.set()

    def _confirm_superseded(self, held_epoch: int) -> None:
        async def confirm() -> None:
            try:
                view = await self.coordinator.current_holder(self.options.identity)
            except MosLeaseError:
                return  # unconfirmed: the keeper's next renewal decides
            self._lose_to(held_epoch, view)

        task = asyncio.get_running_loop().create_task(confirm())
        self._confirming.add(task)  # keep a reference until it is done
        task.add_done_callback(self._confirming.discard)

    def _on_notice(self, epoch: int, kind: str) -> None:
        # The notice source calls from its own thread; the holder's state lives on the loop.
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has closed: nothing to tell
                loop.call_soon_threadsafe(self._notice, self.options.identity, epoch)

    async def wait_lost(self) -> LeaseLoss:
        """Wait until the lease is lost; the loss."""
        await self.lost_event.wait()
        assert self._loss is not None
        return self._loss

    async def issue_grant(self, *, scopes: object, ttl: float | timedelta,
                          correlation_id: str | None = None) -> GrantResult:
        """As :meth:`Holder.issue_grant`."""
        keeper = self._keeper
        self._raise_if_lost()
        assert isinstance(keeper, AsyncLeaseKeeper)
        result = await keeper.issue_grant(scopes=scopes, ttl=ttl, correlation_id=correlation_id)
        if not result.ok:
            self._raise_if_lost()
        return result

    async def __aexit__(self, exc_type: type[BaseException] | None,
                        exc: BaseException | None, tb: TracebackType | None) -> None:
        keeper = self._keeper
        if keeper is None:
            return
        self._unsubscribe()
        self._inside = False
        if self._watcher is not None:
            self._watcher.cancel()
        try:
            self._released(await keeper.stop(release=True))
        except asyncio.CancelledError:
            if not self._cancel_sent:
                raise
            # Our own cancellation, reaching the task here rather than in the block (which
            # ended first); counted and taken back below.
        except Exception:
            _log_release_failure(self.options.identity)
        self._callbacks("on_stopped")
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


# --- the entry point --------------------------------------------------------------------------


# The two signatures differ in the coordinator types, ``sleep`` and the holder returned.
@overload
def hold(coordinator: ConnectorLeaseCoordinator, identity: LeaseIdentity, connector_id: str,
         *, scopes: object,
         ttl: float | timedelta, wait: float | None = ...,
         takeover: TakeoverPolicy | str = ...,
         on_started: Callable[[LeaseHandle], object] | None = ...,
         on_stopped: Callable[[], object] | None = ...,
         on_new_holder: Callable[[str, int], object] | None = ...,
         on_lost: Callable[[LeaseLoss], object] | None = ...,
         on_expiring: Callable[[float], object] | None = ...,
         expiring_within: float | None = ..., cancel_on_loss: bool = ...,
         min_backoff: float | None = ..., max_backoff: float | None = ...,
         heartbeat_coordinator: ConnectorLeaseCoordinator | None = ...,
         clock: Callable[[], float] = ..., random: Callable[[], float] = ...,
         sleep: Callable[[float], object] | None = ...,
         on_event: EventHook | None = ...,
         notices: NoticeSource | None = ...) -> Holder: ...


@overload
def hold(coordinator: AsyncConnectorLeaseCoordinator, identity: LeaseIdentity,
         connector_id: str, *, scopes: object,
         ttl: float | timedelta, wait: float | None = ...,
         takeover: TakeoverPolicy | str = ...,
         on_started: Callable[[LeaseHandle], object] | None = ...,
         on_stopped: Callable[[], object] | None = ...,
         on_new_holder: Callable[[str, int], object] | None = ...,
         on_lost: Callable[[LeaseLoss], object] | None = ...,
         on_expiring: Callable[[float], object] | None = ...,
         expiring_within: float | None = ..., cancel_on_loss: bool = ...,
         min_backoff: float | None = ..., max_backoff: float | None = ...,
         heartbeat_coordinator: AsyncConnectorLeaseCoordinator | None = ...,
         clock: Callable[[], float] = ..., random: Callable[[], float] = ...,
         sleep: Callable[[float], Awaitable[object]] | None = ...,
         on_event: EventHook | None = ...,
         notices: NoticeSource | None = ...) -> AsyncHolder: ...


def hold(coordinator: ConnectorLeaseCoordinator | AsyncConnectorLeaseCoordinator,
         identity: LeaseIdentity, connector_id: str, *, scopes: object,
         ttl: float | timedelta, wait: float | None = None,
         takeover: TakeoverPolicy | str = TakeoverPolicy.EXPIRED,
         on_started: Callable[[LeaseHandle], object] | None = None,
         on_stopped: Callable[[], object] | None = None,
         on_new_holder: Callable[[str, int], object] | None = None,
         on_lost: Callable[[LeaseLoss], object] | None = None,
         on_expiring: Callable[[float], object] | None = None,
         expiring_within: float | None = None, cancel_on_loss: bool = False,
         min_backoff: float | None = None, max_backoff: float | None = None,
         heartbeat_coordinator: Any = None, clock: Callable[[], float] = default_clock,
         random: Callable[[], float] = _random.random, sleep: Any = None,
         on_event: EventHook | None = None, notices: NoticeSource | None = None,
         ) -> Holder | AsyncHolder:
    """Hold ``identity``'s lease as ``connector_id`` for the length of a ``with`` block
    (``async with`` for an :class:`~mos_lease.AsyncConnectorLeaseCoordinator`).

    Entering waits for the lease; the block runs while a keeper renews it; leaving
    releases it (also when the block raised; a failed release is logged, not raised).

    * ``scopes``, ``ttl``: as for ``acquire``; the keeper renews with the same ``ttl``.
    * ``wait``: seconds to wait for the lease (``None``: without limit; ``0``: one try,
      which on an expired lease is the acquire and the takeover it calls for). When it runs
      out, or at once on a refusal waiting cannot change (the policy's, an exhausted epoch),
      entering raises :class:`LeaseNotAcquired`. A store call under way when the wait ends
      finishes first (stores bound their calls).
    * ``takeover``: ``"expired"`` (default) takes over an expired or released lease,
      ``"never"`` only acquires an identity that never had a lease, ``"preempt"`` also
      takes over an active one if the coordinator's policy allows it (if it refuses once,
      the holder waits like ``"expired"``).
    * ``min_backoff``, ``max_backoff``: bounds of the pauses between reads while waiting
      (exponential, with jitter; never past the expiry of the lease last seen, nor the end
      of the wait) and of the keeper's retries.
    * ``on_started(lease)``, ``on_stopped()``: once the lease is held, and once the block
      is left. ``on_new_holder(connector_id, epoch)``: whenever the waiter sees a holder
      other than the last one it saw, its own acquisition included. ``on_lost(loss)``: the
      lease was lost while held (never for the release on leaving).
      ``on_expiring(seconds_left)``: once per stretch of failed renewals, when the keeper's
      local deadline is within ``expiring_within`` seconds (default: half the closest a
      healthy lease comes to it). Callbacks run on the keeper's thread or the loop (a
      thread holder's ``on_lost`` after a notice: on the notice source's thread, so keep it
      short); one that raises is logged and ignored.
    * ``cancel_on_loss`` (asyncio only): cancel the block's task when the lease is lost;
      the ``async with`` then raises :class:`LeaseLost`.
    * ``heartbeat_coordinator``: renew through another coordinator (a connection of its
      own), as for the keepers.
    * ``on_event``: the keeper's telemetry hook (``Renewed``, ``RenewalRetry``, ``Lost``;
      see :mod:`mos_lease.events`); the coordinator's own operations report to the
      coordinator's ``on_event``.
    * ``clock``, ``random``, ``sleep``: monotonic seconds, uniform draws in [0, 1) and the
      pause, injectable for tests. Without ``sleep`` a pause ends early on a notice.
    * ``notices``: a push source of takeovers and releases (``mos_lease_pg.notices.
      LeaseNotices``): a waiter looks again as soon as the lease is released or taken over,
      and a holder whose lease was taken over reports the loss at once instead of at its
      next heartbeat. Only a hint: without it (or when it cannot listen) waiters poll and
      holders find loss at their next heartbeat. asyncio holders take the same thread-based
      source; each notice is handed to the loop.

    Inside the block, ``.lease`` and ``.issue_grant(...)`` raise :class:`LeaseLost` once the
    lease is lost (nothing reaches the store); ``.lost`` is the loss or ``None``;
    ``lost_event`` and ``wait_lost()`` wait for it.

    Every argument is checked here, before anything is read or written: bad input raises
    :class:`~mos_lease.errors.InvalidInput` (:class:`~mos_lease.errors.ConfigurationError`
    for backoff bounds that contradict each other).
    """
    options = check_options(identity, connector_id, scopes=scopes, ttl=ttl, wait=wait,
                            takeover=takeover, min_backoff=min_backoff,
                            max_backoff=max_backoff, expiring_within=expiring_within)
    callbacks = _Callbacks(on_started=on_started, on_stopped=on_stopped,
                           on_new_holder=on_new_holder, on_lost=on_lost,
                           on_expiring=on_expiring)
    for name, value in (("clock", clock), ("random", random), ("sleep", sleep),
                        ("on_event", on_event)):
        _check_callable(name, value)
    if not isinstance(cancel_on_loss, bool):
        raise InvalidInput("cancel_on_loss", "must be a bool")
    source = _check_notices(notices)
    if isinstance(coordinator, ConnectorLeaseCoordinator):
        if heartbeat_coordinator is not None \
                and not isinstance(heartbeat_coordinator, ConnectorLeaseCoordinator):
            raise InvalidInput("heartbeat_coordinator", "must be a ConnectorLeaseCoordinator")
        if cancel_on_loss:
            raise InvalidInput("cancel_on_loss", "only an asyncio holder can cancel its "
                               "block; use lost_event, wait_lost() or on_lost")
        return Holder(coordinator, options, callbacks, clock=clock, random=random,
                      sleep=sleep, heartbeat_coordinator=heartbeat_coordinator,
                      on_event=on_event, notices=source)
    if isinstance(coordinator, AsyncConnectorLeaseCoordinator):
        if heartbeat_coordinator is not None \
                and not isinstance(heartbeat_coordinator, AsyncConnectorLeaseCoordinator):
            raise InvalidInput("heartbeat_coordinator",
                               "must be an AsyncConnectorLeaseCoordinator")
        return AsyncHolder(coordinator, options, callbacks, clock=clock, random=random,
                           sleep=sleep, heartbeat_coordinator=heartbeat_coordinator,
                           cancel_on_loss=cancel_on_loss, on_event=on_event,
                           notices=source)
    raise InvalidInput("coordinator", "must be a ConnectorLeaseCoordinator or an "
                       f"AsyncConnectorLeaseCoordinator, not {type(coordinator).__name__}")
