"""The pure part of :func:`~mos_lease.hold`: what to try while waiting for a lease.

:func:`waiting` is a generator of steps, as the keeper's are (:mod:`mos_lease.keeper.calls`):
it decides what to try (an ``AcquireCall``, a ``TakeoverCall`` at the epoch just read, a
``CurrentHolderCall``), how long to pause (:class:`~mos_lease.sleep.Sleep`) and when to give
up; the shells only perform the steps. What to try and how long to pause is the
supervisor's campaign rule (:mod:`mos_lease.supervisor.campaign`), used here as it is there.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from mos_lease.holder.options import HoldOptions, LeaseNotAcquired
from mos_lease.keeper import TRANSIENT_ERRORS
from mos_lease.keeper.calls import AcquireCall, CurrentHolderCall, Sleep, Steps, TakeoverCall
from mos_lease.results import HolderView, LeaseResult
from mos_lease.supervisor.campaign import ACQUIRE, RETRY_REASONS, next_try, pause_for
from mos_lease.vocabulary import Reason

__all__ = ["RETRY_REASONS", "Acquired", "expiring_check", "pause_for", "plan_attempt",
           "waiting"]


def plan_attempt(view: HolderView | None, options: HoldOptions,
                 preempt_refused: bool) -> AcquireCall | TakeoverCall | Reason:
    """The campaign rule's next try (:func:`~mos_lease.supervisor.campaign.next_try`) as the
    call to make for ``options``, or the reason to go on waiting instead."""
    planned = next_try(view, options.takeover, preempt_refused)
    if isinstance(planned, Reason):
        return planned
    return options.acquire_call() if planned == ACQUIRE else options.takeover_call(planned)


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
