"""What :func:`~mos_lease.hold` is asked for and how it says no: the options, checked and
normalized before anything is read or written (:func:`check_options`), the push source of
lease changes it may be given (:class:`NoticeSource`), and its two exceptions."""

from __future__ import annotations

import contextlib
import enum
import math
from collections.abc import Callable
from typing import Final, Protocol

import attrs

from mos_lease.errors import InvalidInput, MosLeaseError
from mos_lease.identity import (
    LEASE_TTL_CAP,
    LeaseIdentity,
    Scopes,
    check_id,
    check_identity,
    normalize_scopes,
    normalize_ttl,
)
from mos_lease.keeper import KeeperTiming, LeaseLoss
from mos_lease.results import HolderView
from mos_lease.vocabulary import Reason

MAX_WAIT: Final = 7 * 24 * 3600.0
"""The longest finite ``wait`` (seconds); ``None`` waits without limit."""


class TakeoverPolicy(enum.StrEnum):
    """When a waiter may take the lease over (``takeover=`` of :func:`hold`)."""

    NEVER = "never"  # only a first acquisition: an identity that never had a lease
    EXPIRED = "expired"  # also take over an expired or released lease (the default)
    PREEMPT = "preempt"  # also an active one, if the coordinator's policy allows it


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
    ``identity``'s lease changed hands or was released (``mos_lease_pg.notices``). Calls
    may be forged and come by the thousand: a holder only asks a
    :class:`~mos_lease.notice_confirmer.NoticeConfirmer` for a turn on each, the one a
    source names as its ``confirmer`` attribute, else the process's."""

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


def _clock_step(value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value < 0:
        raise InvalidInput("clock_step", "must be a non-negative number of seconds, or None")
    return float(value)


def check_options(identity: object, connector_id: object, *, scopes: object, ttl: object,
                  wait: object, takeover: object, min_backoff: object, max_backoff: object,
                  expiring_within: object, clock_step: object = None) -> HoldOptions:
    """Check every argument before anything is read or written."""
    checked_identity = check_identity("identity", identity)
    checked_connector = check_id("connector_id", connector_id)
    norm_scopes = normalize_scopes("scopes", scopes)
    norm_ttl = normalize_ttl("ttl", ttl, LEASE_TTL_CAP).total_seconds()
    bounds = {name: seconds for name, seconds in (
        ("min_backoff", _seconds_or_none("min_backoff", min_backoff)),
        ("max_backoff", _seconds_or_none("max_backoff", max_backoff)),
        ("clock_step", _clock_step(clock_step))) if seconds is not None}
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
