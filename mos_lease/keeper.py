"""Lease keepers: heartbeat a lease in the background and know, locally, when it is gone.

The store decides whether a lease is held; a keeper decides when *this process* must stop
acting. It keeps a conservative local deadline on a monotonic clock::

    deadline = (start of the last successful acquire/takeover/heartbeat) + ttl - safety_margin

The store set the lease's expiry to its own ``now + ttl`` at some instant *after* the call
started, so the local deadline falls before the store's expiry however slow the round trip
was (up to clock-rate drift, which the margin covers). Once the deadline passes the keeper
reports the lease lost and refuses to mint grants, even if the store cannot be reached:
"I could not renew" must never turn into "so I keep going" (Kubernetes leader election's
split brain, kubernetes#67651). A transient error (:class:`StoreUnavailable`,
:class:`CommitOutcomeUnknown`) is retried with backoff until the deadline and is never loss
by itself (pglock#40); a refusal from the store is definite loss at once (pglock#18).

The decisions are pure functions of (state, monotonic now, outcome, a random draw):
:func:`next_action` and :func:`after_renewal`. :class:`LeaseKeeper` (a thread) and
:class:`AsyncLeaseKeeper` (an asyncio task) only run them, so the two cannot disagree.

Local refusals are values, as everywhere in the library: :meth:`LeaseKeeper.issue_grant`
returns a denied :class:`~mos_lease.results.GrantResult` whose reason is the store's own
reason for a definite loss, and :attr:`Reason.LEASE_EXPIRED` when the keeper can no longer
show the lease is live. A local refusal never reaches the store, so it writes no audit row.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import math
import random as _random
import threading
import uuid
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Final, TypeVar

import attrs

from mos_lease.coordinator import (
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    default_clock,  # CLOCK_BOOTTIME: a resumed process finds its deadline already passed
)
from mos_lease.errors import (
    CommitOutcomeUnknown,
    ConfigurationError,
    InvalidInput,
    StoreUnavailable,
)
from mos_lease.events import Emitter, EventHook, RenewalRetry, Renewed, emitter
from mos_lease.events import Lost as LostEvent
from mos_lease.identity import LeaseIdentity, check_correlation_id
from mos_lease.records import LeaseHandle
from mos_lease.results import GrantResult, LeaseResult
from mos_lease.vocabulary import Outcome, Reason

log = logging.getLogger("mos_lease.keeper")

T = TypeVar("T")

TRANSIENT_ERRORS: Final = (StoreUnavailable, CommitOutcomeUnknown)

LEASE_GONE_REASONS: Final = frozenset({
    Reason.LEASE_MISSING, Reason.LEASE_EXPIRED, Reason.LEASE_RELEASED, Reason.LEASE_REPLACED,
    Reason.STALE_EPOCH, Reason.EPOCH_MISMATCH,
})
"""Refusals of a grant that mean the lease itself is gone (others, such as a scope the
policy refuses, leave the lease as it was)."""


# --- pure part ----------------------------------------------------------------------------


class LossCause(enum.StrEnum):
    DENIED = "denied"  # the store refused a renewal or a grant: definite
    DEADLINE = "deadline"  # no renewal succeeded before the local deadline
    ERROR = "error"  # an unexpected exception while renewing: fail closed
    STOPPED = "stopped"  # the keeper was stopped (and released the lease if asked)


@attrs.frozen(slots=True)
class LeaseLoss:
    """Why and when (on the keeper's clock) the keeper stopped holding its lease.

    ``reason`` is the store's reason for a ``DENIED`` loss; :attr:`Reason.LEASE_EXPIRED`
    for ``DEADLINE`` and ``ERROR`` (the lease may still exist in the store, but this
    process can no longer show it is live); :attr:`Reason.LEASE_RELEASED` for ``STOPPED``.
    ``error`` describes the last exception seen, if any.
    """

    cause: LossCause
    reason: Reason
    at: float
    error: str | None = None


@attrs.frozen(slots=True)
class KeeperTiming:
    """Renewal timing. All values in seconds.

    A renewal is due ``ttl * renew_fraction`` after the start of the last success, spread by
    ``± jitter`` (so keepers started together do not renew in lockstep). After a transient
    failure the retry waits an exponential backoff between ``min_backoff`` and
    ``max_backoff``, never more than half the time left, so several tries fit before the
    deadline.
    """

    ttl: float
    renew_fraction: float = 1 / 3
    jitter: float = 0.2
    safety_margin: float | None = None  # None: ttl / 10
    min_backoff: float = 0.05
    max_backoff: float = 2.0

    def __attrs_post_init__(self) -> None:
        for name in ("ttl", "renew_fraction", "jitter", "min_backoff", "max_backoff"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value):
                raise ConfigurationError(f"{name} must be a finite number")
        if self.ttl <= 0:
            raise ConfigurationError("ttl must be positive")
        if not 0 < self.renew_fraction < 1 or not 0 <= self.jitter < 1:
            raise ConfigurationError("need 0 < renew_fraction < 1 and 0 <= jitter < 1")
        if not 0 < self.min_backoff <= self.max_backoff:
            raise ConfigurationError("need 0 < min_backoff <= max_backoff")
        margin = self.margin
        if not 0 <= margin < self.ttl:
            raise ConfigurationError("safety_margin must be in [0, ttl)")
        if self.ttl * self.renew_fraction * (1 + self.jitter) >= self.ttl - margin:
            # The latest first renewal must come before the deadline, with room to retry.
            raise ConfigurationError(
                "renew_fraction * (1 + jitter) must leave time before ttl - safety_margin")

    @property
    def margin(self) -> float:
        return self.ttl / 10 if self.safety_margin is None else self.safety_margin

    def deadline(self, started: float) -> float:
        return started + self.ttl - self.margin

    def renew_delay(self, draw: float) -> float:
        """``draw`` is uniform in [0, 1)."""
        return self.ttl * self.renew_fraction * (1 + self.jitter * (2 * draw - 1))

    def backoff(self, failures: int, draw: float, remaining: float) -> float:
        base = min(self.max_backoff, self.min_backoff * 2.0 ** min(max(failures - 1, 0), 32))
        delay = base * (0.5 + draw / 2)  # "equal jitter": never less than half the base
        return max(0.0, min(delay, max(remaining / 2, min(self.min_backoff, remaining))))


@attrs.frozen(slots=True)
class KeeperState:
    lease: LeaseHandle
    deadline: float
    renew_at: float
    failures: int = 0
    last_error: str | None = None
    loss: LeaseLoss | None = None


@attrs.frozen(slots=True)
class Renew:
    """Send a heartbeat now; it must finish before ``deadline``."""

    deadline: float


@attrs.frozen(slots=True)
class Wait:
    until: float


@attrs.frozen(slots=True)
class Lost:
    loss: LeaseLoss


Action = Renew | Wait | Lost


def held(timing: KeeperTiming, lease: LeaseHandle, started: float, draw: float) -> KeeperState:
    """The state after a success (acquire, takeover or heartbeat) that started at ``started``."""
    return KeeperState(lease, timing.deadline(started), started + timing.renew_delay(draw))


def next_action(state: KeeperState, now: float) -> Action:
    """What to do at monotonic time ``now``: the whole heartbeat schedule."""
    if state.loss is not None:
        return Lost(state.loss)
    if now >= state.deadline:
        return Lost(LeaseLoss(LossCause.DEADLINE, Reason.LEASE_EXPIRED, now, state.last_error))
    if now >= state.renew_at:
        return Renew(state.deadline)
    return Wait(min(state.renew_at, state.deadline))


def lose(state: KeeperState, loss: LeaseLoss) -> KeeperState:
    """Record ``loss`` unless one is recorded already: loss is final."""
    return state if state.loss is not None else attrs.evolve(state, loss=loss)


def after_renewal(state: KeeperState, timing: KeeperTiming, started: float, finished: float,
                  outcome: LeaseResult | BaseException, draw: float) -> KeeperState:
    """The state after a heartbeat that started at ``started`` and returned at ``finished``
    with ``outcome`` (its result, or the exception it raised)."""
    if state.loss is not None:
        return state
    if isinstance(outcome, LeaseResult):
        if outcome.ok and outcome.lease is not None:
            if finished >= state.deadline:
                # The renewal worked, but the deadline passed while it was in flight and
                # loss is reported the moment the deadline passes; it cannot be undone.
                return lose(state, LeaseLoss(LossCause.DEADLINE, Reason.LEASE_EXPIRED,
                                             finished, state.last_error))
            return held(timing, outcome.lease, started, draw)
        reason = outcome.reason if outcome.reason is not None else Reason.LEASE_MISSING
        return lose(state, LeaseLoss(LossCause.DENIED, reason, finished))
    error = f"{type(outcome).__name__}: {outcome}"
    if isinstance(outcome, TRANSIENT_ERRORS):
        failures = state.failures + 1
        delay = timing.backoff(failures, draw, state.deadline - finished)
        return attrs.evolve(state, failures=failures, last_error=error,
                            renew_at=finished + delay)
    return lose(state, LeaseLoss(LossCause.ERROR, Reason.LEASE_EXPIRED, finished, error))


def grant_loss(result: GrantResult, now: float) -> LeaseLoss | None:
    """The loss a refused grant reveals, if the refusal says the lease itself is gone."""
    if result.reason in LEASE_GONE_REASONS:
        assert result.reason is not None
        return LeaseLoss(LossCause.DENIED, result.reason, now)
    return None


def local_refusal(loss: LeaseLoss, correlation_id: str) -> GrantResult:
    log.info("mos_lease: grant refused locally: lease lost (%s, reason=%s)", loss.cause,
             loss.reason)
    return GrantResult(Outcome.DENIED, loss.reason, correlation_id)


# --- the shared imperative core -----------------------------------------------------------


def _check_timing(ttl: float | timedelta, **options: float | None) -> KeeperTiming:
    seconds = ttl.total_seconds() if isinstance(ttl, timedelta) else ttl
    given: dict[str, float] = {k: v for k, v in options.items() if v is not None}
    return KeeperTiming(seconds, **given)


class _Core:
    """State, timing and loss reporting shared by both keepers (not thread-safe itself)."""

    def __init__(self, timing: KeeperTiming, clock: Callable[[], float],
                 draw: Callable[[], float], on_lost: Callable[[LeaseLoss], object] | None,
                 on_event: EventHook | None) -> None:
        self.timing = timing
        self.clock = clock
        self.draw = draw
        self.on_lost = on_lost
        self.emit: Emitter | None = emitter(on_event)
        self.state: KeeperState | None = None
        self.began = False

    def begin(self, result: LeaseResult, started: float) -> None:
        if result.ok and result.lease is not None:
            self.state = held(self.timing, result.lease, started, self.draw())

    def check_fresh(self) -> None:
        if self.began:
            raise InvalidInput("keeper", "a keeper keeps one lease; make a new keeper")

    def require_state(self) -> KeeperState:
        if self.state is None:
            raise InvalidInput("keeper", "holds no lease: acquire, take over or adopt first")
        return self.state

    @property
    def lease(self) -> LeaseHandle | None:
        state = self.state
        return None if state is None or state.loss is not None else state.lease

    @property
    def loss(self) -> LeaseLoss | None:
        return None if self.state is None else self.state.loss

    @property
    def deadline(self) -> float | None:
        return None if self.state is None else self.state.deadline

    def record(self, new: KeeperState) -> LeaseLoss | None:
        """Store ``new``; return the loss if it is newly recorded (report it exactly once)."""
        old = self.state
        self.state = new
        if new.loss is not None and (old is None or old.loss is None):
            return new.loss
        return None

    def renewed(self, new: KeeperState, finished: float, duration: float,
                outcome: LeaseResult | BaseException) -> None:
        """Report a heartbeat that neither lost the lease nor failed for good: a success
        (DEBUG) or a transient failure to be retried (WARNING, with its cause)."""
        if new.loss is not None:
            return  # reported by ``report``
        lease = new.lease
        who = (lease.identity.tenant_id, lease.identity.logical_agent_id,
               lease.identity.binding_id, lease.connector_id, lease.epoch)
        if isinstance(outcome, LeaseResult):
            log.debug("mos_lease: renewed %s connector=%s epoch=%d in %.3f s", lease.identity,
                      lease.connector_id, lease.epoch, duration)
            if self.emit is not None:
                self.emit(Renewed(*who, duration))
            return
        delay = max(0.0, new.renew_at - finished)
        log.warning("mos_lease: renewal of %s connector=%s epoch=%d failed (attempt %d): "
                    "%s; retrying in %.3f s, %.3f s before the local deadline",
                    lease.identity, lease.connector_id, lease.epoch, new.failures,
                    new.last_error, delay, new.deadline - finished)
        if self.emit is not None:
            self.emit(RenewalRetry(*who, type(outcome).__name__, new.failures, delay))

    def report(self, loss: LeaseLoss) -> None:
        level = logging.INFO if loss.cause is LossCause.STOPPED else logging.WARNING
        state = self.state
        log.log(level, "mos_lease: lease %s lost: %s (%s)%s",
                None if state is None else state.lease.identity, loss.cause, loss.reason,
                f" last error: {loss.error}" if loss.error else "")
        if self.emit is not None and state is not None:
            lease = state.lease
            self.emit(LostEvent(lease.identity.tenant_id, lease.identity.logical_agent_id,
                                lease.identity.binding_id, lease.connector_id, lease.epoch,
                                str(loss.cause), loss.reason))
        if self.on_lost is not None:
            try:
                self.on_lost(loss)
            except Exception:
                # The loss is already recorded and signalled; a failing callback must not
                # hide it or kill the keeper.
                log.exception("mos_lease: on_lost callback failed")


C = TypeVar("C", ConnectorLeaseCoordinator, AsyncConnectorLeaseCoordinator)


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


def _correlation(correlation_id: str | None) -> str:
    given = check_correlation_id("correlation_id", correlation_id)
    return given if given is not None else uuid.uuid4().hex


class _Overdue(Exception):
    """A heartbeat did not return before the deadline."""


# --- thread keeper ------------------------------------------------------------------------


class LeaseKeeper:
    """Holds one lease for a :class:`ConnectorLeaseCoordinator`, renewing it on a thread.

    Typical use::

        keeper = LeaseKeeper(coordinator, ttl=30, on_lost=stop_working)
        result = keeper.acquire(identity, "claude-1", scopes=["tool:run"])
        if result.ok:
            grant = keeper.issue_grant(scopes=["tool:run"], ttl=10)
            ...
        keeper.stop()  # stops renewing and releases the lease

    A keeper keeps one lease: once lost or stopped it stays so; make a new one to try again.
    ``clock`` (monotonic seconds), ``sleep`` and ``random`` are injectable for tests; with
    ``background=False`` no thread is started and :meth:`step` drives the keeper by hand.
    Each heartbeat runs on its own short-lived daemon thread, so a store call that hangs
    (a half-open TCP connection) cannot delay the loss past the deadline; such a call is
    abandoned, and the coordinator's store must tolerate a call still running on it.
    ``on_lost`` is called once, from whichever thread noticed the loss. ``on_event``
    receives :class:`~mos_lease.events.Renewed`, :class:`~mos_lease.events.RenewalRetry`
    and :class:`~mos_lease.events.Lost` events (the coordinator has a hook of its own).

    ``heartbeat_coordinator`` (default: ``coordinator``) is the coordinator heartbeats go
    through. Give it one on a store (a connection) of its own, with the same policy, so a
    heartbeat stuck on its connection never holds up the grants issued and validated
    through ``coordinator``; acquire, takeover, grants and release use ``coordinator``.
    """

    def __init__(self, coordinator: ConnectorLeaseCoordinator, *, ttl: float | timedelta,
                 renew_fraction: float | None = None, jitter: float | None = None,
                 safety_margin: float | None = None, min_backoff: float | None = None,
                 max_backoff: float | None = None,
                 on_lost: Callable[[LeaseLoss], object] | None = None,
                 clock: Callable[[], float] = default_clock,
                 sleep: Callable[[float], object] | None = None,
                 random: Callable[[], float] = _random.random,
                 background: bool = True,
                 heartbeat_coordinator: ConnectorLeaseCoordinator | None = None,
                 on_event: EventHook | None = None) -> None:
        self.coordinator = coordinator
        self.heartbeat_coordinator = _renewer(coordinator, heartbeat_coordinator,
                                              ConnectorLeaseCoordinator)
        timing = _check_timing(ttl, renew_fraction=renew_fraction, jitter=jitter,
                               safety_margin=safety_margin, min_backoff=min_backoff,
                               max_backoff=max_backoff)
        self.ttl = timing.ttl
        self._core = _Core(timing, clock, random, on_lost, on_event)
        self._lock = threading.RLock()
        self._wakeup = threading.Event()
        self._sleep = sleep if sleep is not None else self._interruptible_sleep
        self._background = background
        self._thread: threading.Thread | None = None
        self.lost = threading.Event()
        """Set once the lease is lost (or the keeper stopped); never cleared."""

    # -- properties ----------------------------------------------------------------------

    @property
    def timing(self) -> KeeperTiming:
        return self._core.timing

    @property
    def lease(self) -> LeaseHandle | None:
        """The current handle, or ``None`` before a lease is held and after it is lost."""
        with self._lock:
            return self._core.lease

    @property
    def loss(self) -> LeaseLoss | None:
        with self._lock:
            return self._core.loss

    @property
    def deadline(self) -> float | None:
        """The local deadline on the keeper's clock (``None`` before a lease is held)."""
        with self._lock:
            return self._core.deadline

    # -- getting a lease -----------------------------------------------------------------

    def acquire(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
                correlation_id: str | None = None) -> LeaseResult:
        """:meth:`ConnectorLeaseCoordinator.acquire` with the keeper's ttl; on success the
        keeper holds the lease and starts renewing it. A refusal leaves the keeper unused."""
        return self._begin(lambda: self.coordinator.acquire(
            identity, connector_id, scopes=scopes, ttl=self.ttl,
            correlation_id=correlation_id))

    def takeover(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
                 expected_epoch: int, correlation_id: str | None = None) -> LeaseResult:
        return self._begin(lambda: self.coordinator.takeover(
            identity, connector_id, scopes=scopes, ttl=self.ttl, expected_epoch=expected_epoch,
            correlation_id=correlation_id))

    def adopt(self, lease: LeaseHandle, *, obtained_at: float) -> None:
        """Keep a lease obtained elsewhere with this keeper's ttl. ``obtained_at`` must be
        the keeper clock's reading taken *before* the call that produced ``lease``."""
        if not isinstance(lease, LeaseHandle):
            raise InvalidInput("lease", f"must be a LeaseHandle, not {type(lease).__name__}")
        self._begin(lambda: LeaseResult(Outcome.ACQUIRED, None, "adopted", lease=lease),
                    started=obtained_at)

    def _begin(self, call: Callable[[], LeaseResult], started: float | None = None) -> LeaseResult:
        with self._lock:
            self._core.check_fresh()
            started = self._core.clock() if started is None else started
            result = call()
            self._core.begin(result, started)
            if self._core.state is None:
                return result
            self._core.began = True
        if self._background:
            # Named by identity only: a thread name reaches log records, and a handle's
            # repr carries the lease UUID and the scopes.
            self._thread = threading.Thread(
                target=self._run, daemon=True,
                name=f"mos-lease-keeper {self._core.require_state().lease.identity}")
            self._thread.start()
        return result

    # -- the heartbeat loop --------------------------------------------------------------

    def step(self) -> Action:
        """Run one decision: renew, wait, or report loss. Returns what was decided."""
        with self._lock:
            state = self._core.require_state()
            action = next_action(state, self._core.clock())
        if isinstance(action, Lost):
            self._lose(action.loss)
            return action
        if isinstance(action, Wait):
            self._sleep(max(0.0, action.until - self._core.clock()))
            return action
        started = self._core.clock()
        outcome: LeaseResult | BaseException
        try:
            outcome = self._bounded(
                lambda: self.heartbeat_coordinator.heartbeat(state.lease, ttl=self.ttl),
                action.deadline - started)
        except _Overdue:
            # Abandon the call: whatever it returns later cannot undo a reported loss.
            self._lose(LeaseLoss(LossCause.DEADLINE, Reason.LEASE_EXPIRED, self._core.clock(),
                                 "heartbeat still running at the deadline"))
            return action
        except Exception as error:
            outcome = error
        finished = self._core.clock()
        draw = self._core.draw()
        new = self._update(lambda current: after_renewal(current, self._core.timing, started,
                                                         finished, outcome, draw))
        self._core.renewed(new, finished, finished - started, outcome)
        return action

    @staticmethod
    def _bounded(call: Callable[[], T], timeout: float) -> T:
        """Run ``call`` on a daemon thread; raise ``_Overdue`` if it runs past ``timeout``."""
        box: list[T] = []
        failure: list[BaseException] = []
        done = threading.Event()

        def run() -> None:
            try:
                box.append(call())
            except BaseException as error:
                failure.append(error)
            finally:
                done.set()

        threading.Thread(target=run, daemon=True, name="mos-lease-heartbeat").start()
        if not done.wait(max(timeout, 0.0)):
            raise _Overdue
        if failure:
            raise failure[0]
        return box[0]

    def _run(self) -> None:
        while not self._wakeup.is_set() and not self.lost.is_set():
            try:
                self.step()
            except Exception as error:
                # ``step`` turns store errors into state; anything else is a bug, and a
                # keeper that cannot run must not leave its lease looking healthy.
                self._lose(LeaseLoss(LossCause.ERROR, Reason.LEASE_EXPIRED, self._core.clock(),
                                     repr(error)))

    def _lose(self, loss: LeaseLoss) -> None:
        self._update(lambda current: lose(current, loss))

    def _interruptible_sleep(self, seconds: float) -> None:
        self._wakeup.wait(seconds)

    def _update(self, change: Callable[[KeeperState], KeeperState]) -> KeeperState:
        """Apply ``change`` to the current state atomically; signal a new loss exactly once.

        The events are set under the lock, so whoever sees the new state also sees ``lost``
        set; the callback runs after the lock is released, so it may call back into the
        keeper (even :meth:`stop`) from any thread without deadlocking.
        """
        with self._lock:
            new = change(self._core.require_state())
            loss = self._core.record(new)
            if loss is not None:
                self.lost.set()
                self._wakeup.set()
        if loss is not None:
            self._core.report(loss)
        return new

    # -- using the lease -----------------------------------------------------------------

    def check(self) -> LeaseLoss | None:
        """The loss, if the lease is lost by now; checks the deadline on the spot."""
        now = self._core.clock()

        def judge(state: KeeperState) -> KeeperState:
            action = next_action(state, now)
            return lose(state, action.loss) if isinstance(action, Lost) else state

        return self._update(judge).loss

    def mark_lost(self, loss: LeaseLoss) -> None:
        """Record a loss learned elsewhere (say, news of a newer epoch) without waiting for
        the next heartbeat to find it; reported like any other loss, once."""
        self._lose(loss)

    def issue_grant(self, *, scopes: object, ttl: float | timedelta,
                    correlation_id: str | None = None) -> GrantResult:
        """Mint a grant for the kept lease, or refuse locally once it is lost.

        The deadline is checked before and after the store call, so no grant is handed out
        once the deadline has passed, whatever the store says or however long it took.
        """
        correlation = _correlation(correlation_id)
        loss = self.check()
        if loss is not None:
            return local_refusal(loss, correlation)
        with self._lock:
            lease = self._core.require_state().lease
        result = self.coordinator.issue_grant(lease, scopes=scopes, ttl=ttl,
                                              correlation_id=correlation)
        revealed = grant_loss(result, self._core.clock())
        if revealed is not None:
            self._lose(revealed)
        loss = self.check()
        if loss is not None:
            return local_refusal(loss, correlation)
        return result

    # -- stopping ------------------------------------------------------------------------

    def stop(self, *, release: bool = True, timeout: float | None = 10.0) -> LeaseResult | None:
        """Stop renewing and, if the lease is still held and ``release``, release it.

        Returns the release result, or ``None`` if nothing was released. Marks the keeper
        lost with cause ``STOPPED`` (so ``lost`` waiters wake up) unless it already was.
        """
        self._wakeup.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
        with self._lock:
            state = self._core.state
            if state is None:
                return None
            held_lease = state.lease if state.loss is None else None
        self._lose(LeaseLoss(LossCause.STOPPED, Reason.LEASE_RELEASED, self._core.clock()))
        if held_lease is None or not release:
            return None
        return self.coordinator.release(held_lease)

    def __enter__(self) -> LeaseKeeper:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.stop()


# --- asyncio keeper -----------------------------------------------------------------------


class AsyncLeaseKeeper:
    """The asyncio twin of :class:`LeaseKeeper` for an :class:`AsyncConnectorLeaseCoordinator`.

    Renewal runs as a task on the running loop. ``lost`` is an :class:`asyncio.Event`
    (``await keeper.lost.wait()``); ``on_lost`` is called once, on the loop. Loss is
    reported at the deadline even if a heartbeat is still running then: that heartbeat is
    cancelled and abandoned without waiting for it to end (a driver may take long to give
    up a cancelled call), and nothing it returns later can change the reported loss.
    ``heartbeat_coordinator`` is as for :class:`LeaseKeeper`.
    """

    def __init__(self, coordinator: AsyncConnectorLeaseCoordinator, *, ttl: float | timedelta,
                 renew_fraction: float | None = None, jitter: float | None = None,
                 safety_margin: float | None = None, min_backoff: float | None = None,
                 max_backoff: float | None = None,
                 on_lost: Callable[[LeaseLoss], object] | None = None,
                 clock: Callable[[], float] = default_clock,
                 sleep: Callable[[float], Awaitable[object]] | None = None,
                 random: Callable[[], float] = _random.random,
                 background: bool = True,
                 heartbeat_coordinator: AsyncConnectorLeaseCoordinator | None = None,
                 on_event: EventHook | None = None) -> None:
        self.coordinator = coordinator
        self.heartbeat_coordinator = _renewer(coordinator, heartbeat_coordinator,
                                              AsyncConnectorLeaseCoordinator)
        timing = _check_timing(ttl, renew_fraction=renew_fraction, jitter=jitter,
                               safety_margin=safety_margin, min_backoff=min_backoff,
                               max_backoff=max_backoff)
        self.ttl = timing.ttl
        self._core = _Core(timing, clock, random, on_lost, on_event)
        self._sleep = sleep if sleep is not None else asyncio.sleep
        self._background = background
        self._task: asyncio.Task[None] | None = None
        self._abandoned: set[asyncio.Future[LeaseResult]] = set()
        self._beginning = False
        self.lost = asyncio.Event()
        """Set once the lease is lost (or the keeper stopped); never cleared."""

    @property
    def timing(self) -> KeeperTiming:
        return self._core.timing

    @property
    def lease(self) -> LeaseHandle | None:
        return self._core.lease

    @property
    def loss(self) -> LeaseLoss | None:
        return self._core.loss

    @property
    def deadline(self) -> float | None:
        return self._core.deadline

    async def acquire(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
                      correlation_id: str | None = None) -> LeaseResult:
        return await self._begin(lambda: self.coordinator.acquire(
            identity, connector_id, scopes=scopes, ttl=self.ttl,
            correlation_id=correlation_id))

    async def takeover(self, identity: LeaseIdentity, connector_id: str, *, scopes: object,
                       expected_epoch: int, correlation_id: str | None = None) -> LeaseResult:
        return await self._begin(lambda: self.coordinator.takeover(
            identity, connector_id, scopes=scopes, ttl=self.ttl, expected_epoch=expected_epoch,
            correlation_id=correlation_id))

    async def adopt(self, lease: LeaseHandle, *, obtained_at: float) -> None:
        if not isinstance(lease, LeaseHandle):
            raise InvalidInput("lease", f"must be a LeaseHandle, not {type(lease).__name__}")

        async def adopted() -> LeaseResult:
            return LeaseResult(Outcome.ACQUIRED, None, "adopted", lease=lease)

        await self._begin(adopted, started=obtained_at)

    async def _begin(self, call: Callable[[], Awaitable[LeaseResult]],
                     started: float | None = None) -> LeaseResult:
        self._core.check_fresh()
        if self._beginning:
            raise InvalidInput("keeper", "another acquire or takeover is in progress")
        self._beginning = True
        try:
            started = self._core.clock() if started is None else started
            result = await call()
        finally:
            self._beginning = False
        self._core.begin(result, started)
        if self._core.state is not None:
            self._core.began = True
            if self._background:
                self._task = asyncio.get_running_loop().create_task(
                    self._run(),
                    name=f"mos-lease-keeper {self._core.require_state().lease.identity}")
        return result

    async def step(self) -> Action:
        state = self._core.require_state()
        action = next_action(state, self._core.clock())
        if isinstance(action, Lost):
            self._record(lose(state, action.loss))
            return action
        if isinstance(action, Wait):
            await self._sleep(max(0.0, action.until - self._core.clock()))
            return action
        started = self._core.clock()
        outcome: LeaseResult | BaseException
        # The heartbeat runs as a task of its own and is waited for, not awaited under a
        # timeout: cancelling a call only ends it once the call lets go, and a driver may
        # hold on to a cancelled call for as long as it waits for the server (psycopg sends
        # a cancel request and then waits for the reply). Loss is reported at the deadline
        # whatever the abandoned call does afterwards.
        call = asyncio.ensure_future(
            self.heartbeat_coordinator.heartbeat(state.lease, ttl=self.ttl))
        try:
            done, _ = await asyncio.wait((call,), timeout=max(action.deadline - started, 0.0))
        except asyncio.CancelledError:
            self._abandon(call)  # the keeper is stopping: the call is not waited for
            raise
        if not done:
            self._abandon(call)
            self._record(lose(self._core.require_state(), LeaseLoss(
                LossCause.DEADLINE, Reason.LEASE_EXPIRED, self._core.clock(),
                "heartbeat still running at the deadline")))
            return action
        try:
            outcome = call.result()
        except Exception as error:
            outcome = error
        finished = self._core.clock()
        new = after_renewal(self._core.require_state(), self._core.timing, started,
                            finished, outcome, self._core.draw())
        self._record(new)
        self._core.renewed(new, finished, finished - started, outcome)
        return action

    def _abandon(self, call: asyncio.Future[LeaseResult]) -> None:
        """Cancel a heartbeat left running at the deadline and let it end on its own.

        Its result is never looked at, so it cannot bring a lost lease back; it is kept
        referenced until it ends (a task nobody references may be collected mid-run), and
        its outcome is retrieved so asyncio does not log it as never retrieved.
        """
        self._abandoned.add(call)
        call.add_done_callback(self._forget_abandoned)
        call.cancel()

    def _forget_abandoned(self, call: asyncio.Future[LeaseResult]) -> None:
        self._abandoned.discard(call)
        if not call.cancelled() and call.exception() is not None:
            log.info("mos_lease: abandoned heartbeat ended with %r", call.exception())

    async def _run(self) -> None:
        while not self.lost.is_set():
            try:
                await self.step()
            except Exception as error:
                # As in the thread keeper: a keeper that cannot run reports loss.
                self._record(lose(self._core.require_state(), LeaseLoss(
                    LossCause.ERROR, Reason.LEASE_EXPIRED, self._core.clock(), repr(error))))

    def _record(self, new: KeeperState) -> None:
        loss = self._core.record(new)
        if loss is not None:
            self.lost.set()
            self._core.report(loss)

    def check(self) -> LeaseLoss | None:
        state = self._core.require_state()
        action = next_action(state, self._core.clock())
        if isinstance(action, Lost):
            self._record(lose(state, action.loss))
            return action.loss
        return None

    def mark_lost(self, loss: LeaseLoss) -> None:
        """As :meth:`LeaseKeeper.mark_lost`; call it on the loop."""
        self._record(lose(self._core.require_state(), loss))

    async def issue_grant(self, *, scopes: object, ttl: float | timedelta,
                          correlation_id: str | None = None) -> GrantResult:
        correlation = _correlation(correlation_id)
        loss = self.check()
        if loss is not None:
            return local_refusal(loss, correlation)
        lease = self._core.require_state().lease
        result = await self.coordinator.issue_grant(lease, scopes=scopes, ttl=ttl,
                                                    correlation_id=correlation)
        revealed = grant_loss(result, self._core.clock())
        if revealed is not None:
            self._record(lose(self._core.require_state(), revealed))
        loss = self.check()
        if loss is not None:
            return local_refusal(loss, correlation)
        return result

    async def stop(self, *, release: bool = True) -> LeaseResult | None:
        task = self._task
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        state = self._core.state
        if state is None:
            return None
        held_lease = state.lease if state.loss is None else None
        self._record(lose(state, LeaseLoss(LossCause.STOPPED, Reason.LEASE_RELEASED,
                                           self._core.clock())))
        if held_lease is None or not release:
            return None
        return await self.coordinator.release(held_lease)

    async def __aenter__(self) -> AsyncLeaseKeeper:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.stop()
