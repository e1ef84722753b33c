"""Holding a lease: wait until it can be had, keep it renewed, give it back. :func:`hold` is
the keep engine (:mod:`mos_lease.supervisor`'s) with one binding, a wait deadline, a takeover
policy and a ``with`` block; its options come in two groups, :class:`HoldTiming` and
:class:`HoldCallbacks`.
"""

from mos_lease.keep.campaign import MAX_WAIT, RETRY_REASONS, TakeoverPolicy, pause_for
from mos_lease.keep.hold import hold
from mos_lease.keep.hold_options import (
    HoldCallbacks,
    HoldKeywords,
    HoldOptions,
    HoldTiming,
    LeaseLost,
    LeaseNotAcquired,
    NoticeCallback,
    NoticeSource,
    check_options,
    latest_healthy_gap,
)
from mos_lease.keep.holding import AsyncHolder, Holder, expiring_check

__all__ = [
    "MAX_WAIT", "RETRY_REASONS", "AsyncHolder", "HoldCallbacks", "HoldKeywords", "HoldOptions",
    "HoldTiming", "Holder", "LeaseLost", "LeaseNotAcquired", "NoticeCallback", "NoticeSource",
    "TakeoverPolicy", "check_options", "expiring_check", "hold", "latest_healthy_gap",
    "pause_for",
]
