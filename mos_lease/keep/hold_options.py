"""What :func:`~mos_lease.hold` is asked for and how it says no: its two groups of options
(:class:`HoldTiming`, :class:`HoldCallbacks`), all its options checked and normalized before
anything is read or written (:func:`check_options`, into :class:`HoldOptions`), the push
source of lease changes it may be given (:class:`NoticeSource`), and its two exceptions."""

from __future__ import annotations

import logging
import math
import random as _random
from collections.abc import Callable, Mapping
from typing import Final, Protocol, TypedDict, TypeVar, Unpack

import attrs

from mos_lease.clock import MonotonicClock
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
from mos_lease.keep.campaign import TakeoverPolicy, check_takeover, check_wait
from mos_lease.keep.timing import KeeperTiming, LeaseLoss, timing_over
from mos_lease.metadata import EMPTY_METADATA, Metadata, check_metadata
from mos_lease.records import LeaseHandle
from mos_lease.results import HolderView
from mos_lease.vocabulary import Reason

log = logging.getLogger("mos_lease.holder")  # the name docs/telemetry.md gives operators

_G = TypeVar("_G", "HoldTiming", "HoldCallbacks")

class LeaseNotAcquired(MosLeaseError):
    """:func:`~mos_lease.hold` gave up: ``wait`` ran out, or the refusal cannot change by waiting.

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


@attrs.frozen(slots=True, kw_only=True)
class HoldTiming:
    """How :func:`~mos_lease.hold` paces itself, besides ``ttl`` and ``wait`` (``timing=``).
    Seconds; ``None`` takes the default.

    * ``min_backoff``, ``max_backoff``: bounds of the pauses between reads while waiting
      (exponential, with jitter; never past the expiry of the lease last seen, nor the end
      of the wait) and of the keeper's retries (defaults 0.05 and 2).
    * ``clock_step``: the step in database time the keeper's safety margin covers (default
      2 s, a failover to a host whose clock differs, over a store that can fail over; 0
      over one that cannot, the in-memory store; give ``0`` for one database host and no
      failover), as for the keepers.
    * ``safety_margin``: how long before the lease's expiry the keeper's local deadline
      falls, in [0, ttl) (default ``ttl / 10 + clock_step``), as for the keepers. A ``ttl``
      too short for the default margin (under about ``2 * clock_step``) is refused naming
      this and ``clock_step``.
    * ``expiring_within``: ``on_expiring`` is called when the keeper's local deadline is
      this close (default: half the closest a healthy lease comes to it).
    """

    min_backoff: float | None = None
    max_backoff: float | None = None
    clock_step: float | None = None
    safety_margin: float | None = None
    expiring_within: float | None = None


@attrs.frozen(slots=True, kw_only=True)
class HoldCallbacks:
    """What :func:`~mos_lease.hold` tells you, as it happens (``callbacks=``).

    * ``on_started(lease)``, ``on_stopped()``: once the lease is held, and once the block
      is left.
    * ``on_new_holder(connector_id, epoch)``: whenever the waiter sees a holder other than
      the last one it saw, its own acquisition included.
    * ``on_lost(loss)``: the lease was lost while held (never for the release on leaving).
    * ``on_expiring(seconds_left)``: once per stretch of failed renewals, when the keeper's
      local deadline is within ``expiring_within`` seconds.
    * ``on_event(event)``: the keeper's telemetry (``Renewed``, ``RenewalRetry``, ``Lost``;
      see :mod:`mos_lease.events`); the coordinator's own operations report to the
      coordinator's ``on_event``.

    Callbacks run on the keeper's thread or the loop (a thread holder's ``on_lost`` after a
    notice: on the notice confirmer's thread, so keep it short); one that raises is logged
    and ignored (``on_event`` as the keeper's hook is).
    """

    on_started: Callable[[LeaseHandle], object] | None = None
    on_stopped: Callable[[], object] | None = None
    on_new_holder: Callable[[str, int], object] | None = None
    on_lost: Callable[[LeaseLoss], object] | None = None
    on_expiring: Callable[[float], object] | None = None
    on_event: EventHook | None = None

    def has(self, name: str) -> bool:
        """Whether the callback ``name`` (``"on_lost"``, ...) was given."""
        return getattr(self, name) is not None

    def call(self, name: str, *args: object) -> None:
        """Call the callback ``name`` if there is one; one that raises is logged and never
        breaks holding."""
        callback = getattr(self, name)
        if callback is None:
            return
        try:
            callback(*args)
        except Exception:
            log.exception("mos_lease: %s callback failed", name)


@attrs.frozen(slots=True)
class HoldOptions:
    """Everything :func:`~mos_lease.hold` was asked for that does not depend on the coordinator's
    kind, checked and normalized."""

    identity: LeaseIdentity
    connector_id: str
    scopes: Scopes
    wait: float | None
    takeover: TakeoverPolicy
    timing: KeeperTiming  # the ttl and the backoff bounds, shared with the keeper
    expiring_within: float
    callbacks: HoldCallbacks = HoldCallbacks()
    cancel_on_loss: bool = False
    notices: NoticeSource | None = None
    clock: MonotonicClock | None = None  # None: the coordinator's
    random: Callable[[], float] = _random.random
    metadata: Metadata = EMPTY_METADATA  # set by every acquire and takeover of the wait

    @property
    def ttl(self) -> float:
        return self.timing.ttl


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


def _non_negative(field: str, value: object) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) \
            or not math.isfinite(value) or value < 0:
        raise InvalidInput(field, "must be a non-negative number of seconds, or None")
    return float(value)


def _group(field: str, value: object, kind: type[_G]) -> _G:
    if value is None:
        return kind()
    if not isinstance(value, kind):
        raise InvalidInput(field, f"must be a {kind.__name__} or None, not "
                           f"{type(value).__name__}")
    return value


class HoldKeywords(TypedDict, total=False):
    """The keywords of :func:`~mos_lease.hold` that do not depend on the coordinator's kind,
    declared here once: hold's two overloads, hold itself and :func:`check_options` take
    them as ``**options``, and :func:`check_options` gives the defaults (in the comments)."""

    wait: float | None  # None: wait without limit
    takeover: TakeoverPolicy | str  # "expired"
    timing: HoldTiming | None  # HoldTiming(): every pace at its default
    callbacks: HoldCallbacks | None  # HoldCallbacks(): none
    cancel_on_loss: bool  # False
    notices: NoticeSource | None  # None: waiters poll, holders learn of loss by renewing
    clock: MonotonicClock | None  # None: the coordinator's monotonic clock
    random: Callable[[], float]  # random.random
    metadata: Mapping[str, str] | None  # None: the holder sets no metadata


_GROUPED: Final = {field.name: kind.__name__ for kind in (HoldTiming, HoldCallbacks)
                   for field in attrs.fields(kind)}


def _unexpected(keyword: str) -> TypeError:
    # As Python itself says it of a keyword that is not in a signature, and where it goes.
    group = _GROUPED.get(keyword)
    where = "" if group is None else (
        f"; it is a field of {group}: hold(..., "
        f"{'timing' if group == 'HoldTiming' else 'callbacks'}={group}({keyword}=...))")
    return TypeError(f"hold() got an unexpected keyword argument {keyword!r}{where}")


def check_options(identity: object, connector_id: object, *, scopes: object, ttl: object,
                  store: object = None, **options: Unpack[HoldKeywords]) -> HoldOptions:
    """Check every argument of :func:`~mos_lease.hold` that does not depend on the
    coordinator's kind, before anything is read or written, and apply the defaults (the
    ``clock_step`` of the coordinator's ``store`` when ``timing`` gives none:
    :func:`~mos_lease.keeper.timing_over`)."""
    unknown = sorted(set(options) - HoldKeywords.__optional_keys__)
    if unknown:
        raise _unexpected(unknown[0])
    wait = options.get("wait")
    takeover = options.get("takeover", TakeoverPolicy.EXPIRED)
    cancel_on_loss = options.get("cancel_on_loss", False)
    clock = options.get("clock")
    random = options.get("random", _random.random)
    checked_identity = check_identity("identity", identity)
    checked_connector = check_id("connector_id", connector_id)
    norm_scopes = normalize_scopes("scopes", scopes)
    norm_ttl = normalize_ttl("ttl", ttl, LEASE_TTL_CAP).total_seconds()
    paced = _group("timing", options.get("timing"), HoldTiming)
    # Refuses min_backoff > max_backoff, and a ttl too short for the margin.
    keeper_timing = timing_over(
        store, norm_ttl, min_backoff=_seconds_or_none("min_backoff", paced.min_backoff),
        max_backoff=_seconds_or_none("max_backoff", paced.max_backoff),
        safety_margin=_non_negative("safety_margin", paced.safety_margin),
        clock_step=_non_negative("clock_step", paced.clock_step))
    gap = latest_healthy_gap(keeper_timing)
    within = _seconds_or_none("expiring_within", paced.expiring_within)
    if within is None:
        within = gap / 2
    elif within >= gap:
        raise InvalidInput("expiring_within", f"must be less than {gap:g} s for ttl "
                           f"{norm_ttl:g} s (a healthy lease comes that close to its deadline)")
    told = _group("callbacks", options.get("callbacks"), HoldCallbacks)
    for field in attrs.fields(HoldCallbacks):
        _check_callable(field.name, getattr(told, field.name))
    _check_callable("clock", clock)
    _check_callable("random", random)
    if not isinstance(cancel_on_loss, bool):
        raise InvalidInput("cancel_on_loss", "must be a bool")
    metadata = check_metadata("metadata", options.get("metadata"))
    return HoldOptions(checked_identity, checked_connector, norm_scopes, check_wait(wait),
                       check_takeover(takeover), keeper_timing, within, told,
                       cancel_on_loss, _check_notices(options.get("notices")), clock,
                       random, metadata)
