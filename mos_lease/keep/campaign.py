"""The campaign rule, written once: what a binding without a lease tries after reading its
holder, which refusals are worth waiting out, and how long to pause before looking again.

Pure: the supervisor's schedule (:meth:`~mos_lease.keep.schedule.Schedule.campaigned`)
decides with these functions for every binding, :func:`~mos_lease.hold`'s one included.
"""

from __future__ import annotations

import contextlib
import enum
import math
from typing import Final

from mos_lease.errors import InvalidInput
from mos_lease.keep.timing import KeeperTiming
from mos_lease.results import HolderView
from mos_lease.vocabulary import LeaseState, Reason

ACQUIRE: Final = 0
"""What :func:`next_try` answers for an identity that never had a lease: acquire it.
Epochs start at 1, so 0 names no takeover."""

MAX_WAIT: Final = 7 * 24 * 3600.0
"""The longest finite ``wait`` (seconds) of :func:`~mos_lease.hold` and of
``Supervisor.add()``."""

# Refusals a later try may not meet: the lease may expire, be released or change hands, and
# the store may come back. Any other refusal (the policy's, an exhausted epoch) is final.
RETRY_REASONS: Final = frozenset({
    Reason.LEASE_HELD, Reason.TAKEOVER_REQUIRED, Reason.EPOCH_MISMATCH, Reason.LEASE_MISSING,
    Reason.PREEMPTION_DENIED, Reason.STORE_UNAVAILABLE,
})


class TakeoverPolicy(enum.StrEnum):
    """When a campaign may take the lease over (``takeover=`` of :func:`~mos_lease.hold`)."""

    NEVER = "never"  # only a first acquisition: an identity that never had a lease
    EXPIRED = "expired"  # also take over an expired or released lease (the default)
    PREEMPT = "preempt"  # also an active one, if the coordinator's policy allows it


def check_takeover(value: object) -> TakeoverPolicy:
    """``value`` (a :class:`TakeoverPolicy` or its string) as a policy; anything else is
    refused with :class:`~mos_lease.errors.InvalidInput`."""
    if isinstance(value, TakeoverPolicy):
        return value
    if isinstance(value, str):
        with contextlib.suppress(ValueError):
            return TakeoverPolicy(str.__str__(value))
    choices = ", ".join(repr(p.value) for p in TakeoverPolicy)
    raise InvalidInput("takeover", f"must be one of {choices}, not {value!r:.40}")


def check_wait(value: object) -> float | None:
    """``value`` as seconds to wait, in [0, :data:`MAX_WAIT`], or ``None``."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput("wait", f"must be seconds or None, not {type(value).__name__}")
    if not (math.isfinite(value) and 0 <= value <= MAX_WAIT):
        raise InvalidInput("wait", f"must be between 0 and {MAX_WAIT:g} s, or None to wait "
                           "without limit")
    return float(value)


def next_try(view: HolderView | None, policy: TakeoverPolicy,
             preempt_refused: bool) -> int | Reason:
    """What to try after reading ``view``: :data:`ACQUIRE`, the epoch to take over at, or
    the reason to go on waiting instead. An acquire wins exactly when the identity never
    had a lease; a takeover names the epoch just read, so of several campaigners exactly
    one wins. An active lease is taken only under ``PREEMPT``, until the policy refused
    that once (``preempt_refused``)."""
    if view is None:
        return ACQUIRE
    if view.state is LeaseState.ACTIVE:
        if policy is TakeoverPolicy.PREEMPT and not preempt_refused:
            return view.epoch
        return Reason.LEASE_HELD
    if policy is TakeoverPolicy.NEVER:
        return Reason.TAKEOVER_REQUIRED
    return view.epoch


def pause_for(timing: KeeperTiming, failures: int, draw: float, remaining: float | None,
              view: HolderView | None, *, until_expiry: bool = False) -> float:
    """Backoff with jitter (the keeper's), never past the end of the wait (``remaining``
    seconds, ``None``: no end), and waking no later than the moment the observed lease would
    expire. ``until_expiry``: a notice will tell of a release or takeover of the observed
    lease, so an active one is waited out until it would expire (the store's time, counted
    from the read) instead of re-read at every backoff; only its renewal can keep it, and
    that is seen by reading then."""
    cap = math.inf if remaining is None else remaining
    if view is not None and view.state is LeaseState.ACTIVE:
        expiry = max((view.expires_at - view.now).total_seconds(), 0.0)
        if until_expiry:
            return max(min(expiry, cap), 0.0)
        return max(min(timing.backoff(failures, draw, cap), expiry), 0.0)
    return max(timing.backoff(failures, draw, cap), 0.0)
