"""The pure part of :func:`~mos_lease.hold`: what to try while waiting for a lease.

:func:`waiting` is a generator of steps, as the keeper's are (:mod:`mos_lease.keeper.calls`):
it decides what to try (an ``AcquireCall``, a ``TakeoverCall`` at the epoch just read, a
``CurrentHolderCall``), how long to pause (:class:`~mos_lease.sleep.Sleep`) and when to give
up; the shells only perform the steps.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Final

import attrs

from mos_lease.holder.options import HoldOptions, LeaseNotAcquired, TakeoverPolicy
from mos_lease.keeper import TRANSIENT_ERRORS, KeeperTiming
from mos_lease.keeper.calls import AcquireCall, CurrentHolderCall, Sleep, Steps, TakeoverCall
from mos_lease.results import HolderView, LeaseResult
from mos_lease.vocabulary import LeaseState, Reason

# Refusals a later try may not meet: the lease may expire, be released or change hands, and
# the store may come back. Any other refusal (the policy's, an exhausted epoch) is final.
RETRY_REASONS: Final = frozenset({
    Reason.LEASE_HELD, Reason.TAKEOVER_REQUIRED, Reason.EPOCH_MISMATCH, Reason.LEASE_MISSING,
    Reason.PREEMPTION_DENIED, Reason.STORE_UNAVAILABLE,
})


def plan_attempt(view: HolderView | None, options: HoldOptions,
                 preempt_refused: bool) -> AcquireCall | TakeoverCall | Reason:
    """What to try after reading ``view``, or the reason to go on waiting instead. An
    acquire wins exactly when the identity never had a lease; a takeover names the epoch
    just read, so of several waiters exactly one wins."""
    if view is None:
        return options.acquire_call()
    if view.state is LeaseState.ACTIVE:
        if options.takeover is TakeoverPolicy.PREEMPT and not preempt_refused:
            return options.takeover_call(view.epoch)
        return Reason.LEASE_HELD
    if options.takeover is TakeoverPolicy.NEVER:
        return Reason.TAKEOVER_REQUIRED
    return options.takeover_call(view.epoch)


def pause_for(timing: KeeperTiming, failures: int, draw: float, remaining: float | None,
              view: HolderView | None, *, until_expiry: bool = False) -> float:
    """Backoff with jitter (the keeper's), never past the end of the wait, and waking no
    later than the moment the observed lease would expire. ``until_expiry``: a notice will
    tell of a release or takeover of the observed lease, so an active one is waited out
    until it would expire (the store's time, counted from the read) instead of re-read at
    every backoff; only its renewal can keep it, and that is seen by reading then."""
    cap = math.inf if remaining is None else remaining
    if view is not None and view.state is LeaseState.ACTIVE:
        expiry = max((view.expires_at - view.now).total_seconds(), 0.0)
        if until_expiry:
            return max(min(expiry, cap), 0.0)
        return max(min(timing.backoff(failures, draw, cap), expiry), 0.0)
    return max(timing.backoff(failures, draw, cap), 0.0)


@attrs.frozen(slots=True)
class Acquired:
    result: LeaseResult
    started: float  # the clock before the successful call: where the keeper's deadline starts


def waiting(options: HoldOptions, clock: Callable[[], float], draw: Callable[[], float],
            new_holder: Callable[[str, int], None]) -> Steps[Acquired]:
    """The whole wait, as steps: an ``AcquireCall`` or ``TakeoverCall`` is sent its
    :class:`LeaseResult`, a ``CurrentHolderCall`` its :class:`HolderView` or ``None``,
    :class:`Sleep` nothing. A transient store error may be thrown in at any step. Returns
    once a lease is held; raises :class:`LeaseNotAcquired` when the wait is over or waiting
    cannot help."""
    ends = None if options.wait is None else clock() + options.wait
    attempt: AcquireCall | TakeoverCall | None = options.acquire_call()
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
            yield Sleep(pause_for(options.timing, failures + 1, draw(), remaining, view))
            failures += 1
        try:
            view = yield CurrentHolderCall(options.identity)
        except TRANSIENT_ERRORS as down:
            reason, error = Reason.STORE_UNAVAILABLE, f"{type(down).__name__}: {down}"
            attempt = None
            continue
        if view is not None and seen != (view.connector_id, view.epoch):
            seen = (view.connector_id, view.epoch)
            new_holder(*seen)
        planned = plan_attempt(view, options, preempt_refused)
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
