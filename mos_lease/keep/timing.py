"""The keeper's schedule: when to heartbeat, when to retry, when the lease counts as lost.

Pure functions of (state, monotonic now, outcome, a random draw): :func:`next_action` and
:func:`after_renewal`. The deadline rule and why it is safe are in ``docs/keeping.md``.
"""

from __future__ import annotations

import enum
import math
from datetime import timedelta
from typing import Final

import attrs

from mos_lease.errors import CommitOutcomeUnknown, ConfigurationError, StoreUnavailable
from mos_lease.records import LeaseHandle
from mos_lease.results import GrantResult, LeaseResult
from mos_lease.vocabulary import Outcome, Reason

__all__ = [  # re-exported by mos_lease.keeper
    "DEFAULT_CLOCK_STEP", "LEASE_GONE_REASONS", "TIMING_OPTIONS", "TRANSIENT_ERRORS", "Action",
    "HeartbeatDue", "KeeperState", "KeeperTiming", "LeaseLoss", "LossCause", "ReportLoss",
    "Wait", "abandoned", "after_renewal", "default_clock_step", "grant_loss", "held",
    "local_refusal", "lose", "next_action", "timing_over",
]

DEFAULT_CLOCK_STEP: Final = 2.0
"""Seconds of database-clock difference between hosts that the keeper's default safety
margin covers. A failover may hand the lease table to a standby whose clock differs from
the old primary's: measured with the standby's clock 2 s ahead, a rival took over a 10 s
lease 8.05 s after it was acquired, before a keeper with a ``ttl / 10`` margin (9 s) had
stopped. Keep the database hosts' clocks within this bound (NTP). It is the default only
for a store whose time can step (:func:`default_clock_step`)."""

TIMING_OPTIONS: Final = (
    "keyword arguments of LeaseKeeper, AsyncLeaseKeeper and Supervisor.add(), fields of "
    "HoldTiming for hold(timing=...)")
"""Where the timing options are given, as the errors about them say."""


def default_clock_step(store: object) -> float:
    """The ``clock_step`` a keeper, ``hold()`` or the supervisor uses over ``store`` when
    none is given: :data:`DEFAULT_CLOCK_STEP`, or 0 for a store whose ``clock_can_step`` is
    false. Only a failover moves a store's time to another host's clock; a store that
    cannot fail over (the in-memory store, one process's clock) says so, and a store that
    does not say is assumed to step."""
    return 0.0 if getattr(store, "clock_can_step", True) is False else DEFAULT_CLOCK_STEP


def timing_over(store: object, ttl: float | timedelta, **options: float | None
                ) -> KeeperTiming:
    """The timing of a lease kept over ``store``, for ``ttl`` (seconds or a timedelta): the
    one reading of the timing options of the keepers, ``hold()`` and ``Supervisor.add()``.
    An option given as ``None`` takes :class:`KeeperTiming`'s default, ``clock_step`` the
    store's (:func:`default_clock_step`)."""
    given = {name: value for name, value in options.items() if value is not None}
    given.setdefault("clock_step", default_clock_step(store))
    return KeeperTiming(ttl.total_seconds() if isinstance(ttl, timedelta) else ttl, **given)

TRANSIENT_ERRORS: Final = (StoreUnavailable, CommitOutcomeUnknown)

# A renewal's result that refuses nothing: the store did not get to judge the lease (a batch
# did not reach a row another transaction held locked: ``heartbeat_many``). Retried as a
# transient error is, until the deadline.
_UNJUDGED: Final = Reason.STORE_UNAVAILABLE

LEASE_GONE_REASONS: Final = frozenset({
    Reason.LEASE_MISSING, Reason.LEASE_EXPIRED, Reason.LEASE_RELEASED, Reason.LEASE_REPLACED,
    Reason.STALE_EPOCH, Reason.EPOCH_MISMATCH,
})
"""Refusals of a grant that mean the lease itself is gone (others, such as a scope the
policy refuses, leave the lease as it was)."""


class LossCause(enum.StrEnum):
    """Why a keeper stopped holding its lease: ``denied`` (the store refused a renewal or a
    grant), ``deadline`` (no renewal succeeded before the local deadline), ``error`` (an
    unexpected exception while renewing) or ``stopped``."""

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
    deadline. The deadline falls ``safety_margin`` before the lease's expiry; by default
    that is ``ttl / 10`` (clock-rate drift) plus ``clock_step``, the largest step in
    database time a failover may bring (see :data:`DEFAULT_CLOCK_STEP`; the keepers,
    ``hold()`` and the supervisor default it by the store, :func:`default_clock_step`).
    A ``ttl`` too short for that margin is refused with a :class:`ConfigurationError` that
    names the options that fix it (a longer ``ttl``, ``safety_margin``, ``clock_step``).
    """

    ttl: float
    renew_fraction: float = 1 / 3
    jitter: float = 0.2
    safety_margin: float | None = None  # None: ttl / 10 + clock_step
    min_backoff: float = 0.05
    max_backoff: float = 2.0
    clock_step: float = DEFAULT_CLOCK_STEP

    def __attrs_post_init__(self) -> None:
        for name in ("ttl", "renew_fraction", "jitter", "min_backoff", "max_backoff",
                     "clock_step"):
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
        if self.clock_step < 0:
            raise ConfigurationError("clock_step must not be negative")
        margin = self.margin
        if not 0 <= margin < self.ttl:
            raise ConfigurationError(self._too_short() if self.safety_margin is None
                                     else "safety_margin must be in [0, ttl)")
        if self.ttl * self.renew_fraction * (1 + self.jitter) >= self.ttl - margin:
            if self.safety_margin is None:
                raise ConfigurationError(self._too_short())
            # The latest first renewal must come before the deadline, with room to retry.
            raise ConfigurationError(
                "renew_fraction * (1 + jitter) must leave time before ttl - safety_margin")

    def _too_short(self) -> str:
        # The shortest ttl the default margin allows: the latest first renewal,
        # ttl * renew_fraction * (1 + jitter), must come before ttl - ttl / 10 - clock_step.
        room = 0.9 - self.renew_fraction * (1 + self.jitter)
        longer = (f"a ttl above {self.clock_step / room:.3g} s" if room > 0
                  else "a smaller renew_fraction or jitter")
        return (f"ttl {self.ttl:g} s is too short for the default safety margin, ttl / 10 + "
                f"clock_step ({self.clock_step:g} s: the step in database time a failover to "
                f"a host with another clock may bring); use {longer}, or safety_margin= (a "
                "margin of your own, in [0, ttl)), or clock_step=0 for a database of one "
                f"host and no failover ({TIMING_OPTIONS})")

    @property
    def margin(self) -> float:
        if self.safety_margin is not None:
            return self.safety_margin
        return self.ttl / 10 + self.clock_step

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
class HeartbeatDue:
    """Send a heartbeat now; it must finish before ``deadline``."""

    deadline: float


@attrs.frozen(slots=True)
class Wait:
    """Nothing to do before ``until`` (the keeper's driver sleeps until then)."""

    until: float


@attrs.frozen(slots=True)
class ReportLoss:
    """The lease is lost (``loss`` says why): report it, once, and stop renewing."""

    loss: LeaseLoss


Action = HeartbeatDue | Wait | ReportLoss


def held(timing: KeeperTiming, lease: LeaseHandle, started: float, draw: float,
         renew_from: float | None = None) -> KeeperState:
    """The state after a success (acquire, takeover or heartbeat) that started at
    ``started``: its deadline counts from then, and so does its next renewal unless
    ``renew_from`` (earlier) is given."""
    return KeeperState(lease, timing.deadline(started),
                       (started if renew_from is None else renew_from)
                       + timing.renew_delay(draw))


def next_action(state: KeeperState, now: float) -> Action:
    """What to do at monotonic time ``now``: the whole heartbeat schedule."""
    if state.loss is not None:
        return ReportLoss(state.loss)
    if now >= state.deadline:
        return ReportLoss(LeaseLoss(LossCause.DEADLINE, Reason.LEASE_EXPIRED, now,
                                    state.last_error))
    if now >= state.renew_at:
        return HeartbeatDue(state.deadline)
    return Wait(min(state.renew_at, state.deadline))


def lose(state: KeeperState, loss: LeaseLoss) -> KeeperState:
    """Record ``loss`` unless one is recorded already: loss is final."""
    return state if state.loss is not None else attrs.evolve(state, loss=loss)


def after_renewal(state: KeeperState, timing: KeeperTiming, started: float, finished: float,
                  outcome: LeaseResult | BaseException, draw: float,
                  renew_from: float | None = None) -> KeeperState:
    """The state after a heartbeat that started at ``started`` and returned at ``finished``
    with ``outcome`` (its result, or the exception it raised). ``renew_from``: on success,
    the next renewal counts from then rather than from ``started`` (see :func:`held`)."""
    if state.loss is not None:
        return state
    if isinstance(outcome, LeaseResult):
        if outcome.ok and outcome.lease is not None:
            if finished >= state.deadline:
                # The renewal worked, but the deadline passed while it was in flight and
                # loss is reported the moment the deadline passes; it cannot be undone.
                return lose(state, LeaseLoss(LossCause.DEADLINE, Reason.LEASE_EXPIRED,
                                             finished, state.last_error))
            return held(timing, outcome.lease, started, draw, renew_from)
        if outcome.reason is _UNJUDGED:
            return _retry(state, timing, finished, draw,
                          f"renewal not made: {outcome.reason} (the lease was not judged)")
        reason = outcome.reason if outcome.reason is not None else Reason.LEASE_MISSING
        return lose(state, LeaseLoss(LossCause.DENIED, reason, finished))
    error = f"{type(outcome).__name__}: {outcome}"
    if isinstance(outcome, TRANSIENT_ERRORS):
        return _retry(state, timing, finished, draw, error)
    return lose(state, LeaseLoss(LossCause.ERROR, Reason.LEASE_EXPIRED, finished, error))


def abandoned(state: KeeperState, timing: KeeperTiming, started: float, finished: float,
              limit: float, draw: float) -> KeeperState:
    """The state after a heartbeat that started at ``started`` was still running at its time
    limit ``limit`` and was abandoned at ``finished`` (whatever it returns later cannot undo
    what is decided here). The lease is lost if its own deadline was that limit or has
    come; else something earlier set the limit (in a supervisor's batch: another lease's
    deadline, or half the time left on a renewal connection outpaced by another), and this
    lease is retried as after a transient failure, until its own deadline."""
    if state.loss is not None:
        return state
    if finished >= state.deadline or limit >= state.deadline:
        return lose(state, LeaseLoss(LossCause.DEADLINE, Reason.LEASE_EXPIRED, finished,
                                     "heartbeat still running at the deadline"))
    return _retry(state, timing, finished, draw, f"{StoreUnavailable.__name__}: "
                  "renewal still running when the earliest deadline came; abandoned")


def _retry(state: KeeperState, timing: KeeperTiming, finished: float, draw: float,
           error: str) -> KeeperState:
    """A transient failure: try again after the backoff, never past half the time left."""
    failures = state.failures + 1
    delay = timing.backoff(failures, draw, state.deadline - finished)
    return attrs.evolve(state, failures=failures, last_error=error, renew_at=finished + delay)


def grant_loss(result: GrantResult, now: float) -> LeaseLoss | None:
    """The loss a refused grant reveals, if the refusal says the lease itself is gone."""
    if result.reason in LEASE_GONE_REASONS:
        assert result.reason is not None
        return LeaseLoss(LossCause.DENIED, result.reason, now)
    return None


def local_refusal(loss: LeaseLoss, correlation_id: str) -> GrantResult:
    """A grant the keeper refuses itself, naming the loss's reason (no store call, so no
    audit row)."""
    return GrantResult(Outcome.DENIED, loss.reason, correlation_id)
