"""Holding a lease: wait until it can be had, keep it renewed, give it back.

:func:`~mos_lease.hold` is the loop every gateway needs around the low-level calls::

    with hold(coordinator, identity, "claude-a", scopes=["tool:run"], ttl=30) as held:
        grant = held.issue_grant(scopes=["tool:run"], ttl=10)
        ...
    # released here, also when the block raised

    async with hold(async_coordinator, identity, "claude-a", scopes=["tool:run"], ttl=30,
                    cancel_on_loss=True) as held:
        ...  # cancelled if the lease is lost; the ``async with`` then raises LeaseLost

Holding is the supervisor engine (:mod:`mos_lease.supervisor`) with one binding, held once:
it campaigns for the lease while the caller waits, then renews it in the background until
the block is left. The two holders (:class:`Holder`, :class:`AsyncHolder`) are in
:mod:`~mos_lease.keep.holding`, the options (two groups, :class:`HoldTiming` and
:class:`HoldCallbacks`) and exceptions in :mod:`~mos_lease.keep.hold_options`.

A push source of lease changes (``notices=``, a :class:`NoticeSource` such as
``mos_lease_pg.notices.LeaseNotices``) feeds ``_notice(identity, epoch)``: it wakes a waiter
at once and reports loss early to a holder whose epoch was superseded. Without one, waiters
poll and holders learn of loss at their next heartbeat. A notice is only a hint: it never
grants anything, fencing never waits for one, and what it says is never believed: it only
asks the process's :class:`~mos_lease.notice_confirmer.NoticeConfirmer` for a confirming
turn (a read of the row, or a waiter's look), coalesced per identity and rate-bounded for
the process, so a flood of forged notices costs a bounded number of reads and nothing else.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar, Unpack, overload

from mos_lease.coordinator import (
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
)
from mos_lease.errors import InvalidInput
from mos_lease.identity import LeaseIdentity
from mos_lease.keep.hold_options import (
    HoldKeywords,
    check_options,
)
from mos_lease.keep.holding import AsyncHolder, Holder

__all__ = ["hold"]


C = TypeVar("C", ConnectorLeaseCoordinator, AsyncConnectorLeaseCoordinator)


def _same_kind(heartbeat_coordinator: object, kind: type[C]) -> C | None:
    """``heartbeat_coordinator``, refused unless it is of the coordinator's ``kind``."""
    if heartbeat_coordinator is None or isinstance(heartbeat_coordinator, kind):
        return heartbeat_coordinator
    raise InvalidInput("heartbeat_coordinator", f"must be a {kind.__name__} like the "
                       f"coordinator, not {type(heartbeat_coordinator).__name__}")


# The two overloads differ only in the coordinator types, ``sleep`` and the holder returned.
@overload
def hold(coordinator: ConnectorLeaseCoordinator, identity: LeaseIdentity, connector_id: str,
         *, scopes: object, ttl: float | timedelta,
         heartbeat_coordinator: ConnectorLeaseCoordinator | None = ...,
         sleep: Callable[[float], object] | None = ...,
         **options: Unpack[HoldKeywords]) -> Holder: ...


@overload
def hold(coordinator: AsyncConnectorLeaseCoordinator, identity: LeaseIdentity,
         connector_id: str, *, scopes: object, ttl: float | timedelta,
         heartbeat_coordinator: AsyncConnectorLeaseCoordinator | None = ...,
         sleep: Callable[[float], Awaitable[object]] | None = ...,
         **options: Unpack[HoldKeywords]) -> AsyncHolder: ...


def hold(coordinator: ConnectorLeaseCoordinator | AsyncConnectorLeaseCoordinator,
         identity: LeaseIdentity, connector_id: str, *, scopes: object,
         ttl: float | timedelta, heartbeat_coordinator: Any = None, sleep: Any = None,
         **options: Unpack[HoldKeywords]) -> Holder | AsyncHolder:
    """Hold ``identity``'s lease as ``connector_id`` for the length of a ``with`` block
    (``async with`` for an :class:`~mos_lease.AsyncConnectorLeaseCoordinator`).

    Entering waits for the lease; the block runs while a keeper renews it; leaving
    releases it (also when the block raised; a failed release is logged, not raised).
    Besides ``scopes`` and ``ttl`` every keyword is optional; those that do not depend on the
    coordinator's kind are declared once, in :class:`HoldKeywords`.

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
    * ``metadata``: the holder metadata every acquire and takeover of the wait sets (a
      small ``str -> str`` mapping, such as the endpoint this process serves the binding
      on; see :mod:`mos_lease.metadata`); ``None``: none.
    * ``timing``: a :class:`HoldTiming`: the backoff bounds, the keeper's
      ``safety_margin`` and the ``clock_step`` it covers, and ``expiring_within``. The
      keeper stops ``safety_margin`` before the lease's expiry, by default ``ttl / 10 +
      clock_step``, where ``clock_step`` is 2 s over a store that can fail over
      (PostgreSQL) and 0 over one that cannot (the in-memory store); so over PostgreSQL a
      ``ttl`` of 4 s or less needs ``HoldTiming(clock_step=0)`` (one database host, no
      failover) or ``HoldTiming(safety_margin=...)``, and is refused naming them.
    * ``callbacks``: a :class:`HoldCallbacks`: ``on_started``, ``on_stopped``,
      ``on_new_holder``, ``on_lost``, ``on_expiring`` and the keeper's ``on_event``.
    * ``cancel_on_loss`` (asyncio only): cancel the block's task when the lease is lost;
      the ``async with`` then raises :class:`LeaseLost`.
    * ``notices``: a push source of takeovers and releases (``mos_lease_pg.notices.
      LeaseNotices``): a waiter looks again as soon as the lease is released or taken over,
      and a holder whose lease was taken over reports the loss at once instead of at its
      next heartbeat. Only a hint: without it (or when it cannot listen) waiters poll and
      holders find loss at their next heartbeat. asyncio holders take the same thread-based
      source. Each notice only asks for a confirming turn: at most one per identity in
      flight, and ``burst + rate * T`` turns in any ``T`` seconds for the whole process
      (10 + 20/s by default; :class:`~mos_lease.notice_confirmer.NoticeConfirmer`, the
      source's ``confirmer``), so any login's flood of forged notices neither ends a
      holding nor holds up renewals or validations.
    * ``heartbeat_coordinator``: renew through another coordinator (a connection of its
      own), as for the keepers.
    * ``clock``: the monotonic clock the wait and the keeper's deadline are measured on;
      by default the coordinator's (``coordinator.monotonic``).
    * ``random``, ``sleep``: uniform draws in [0, 1) and the pause, injectable for tests.
      Without ``sleep`` a pause ends early on a notice.

    Inside the block, ``.lease`` and ``.issue_grant(...)`` raise :class:`LeaseLost` once the
    lease is lost (nothing reaches the store); ``.lost`` is the loss or ``None``;
    ``lost_event`` and ``wait_lost()`` wait for it.

    Every argument is checked here, before anything is read or written: bad input raises
    :class:`~mos_lease.errors.InvalidInput` (:class:`~mos_lease.errors.ConfigurationError`
    for backoff bounds that contradict each other, or a ``ttl`` too short for the safety
    margin).
    """
    checked = check_options(identity, connector_id, scopes=scopes, ttl=ttl,
                            store=getattr(coordinator, "store", None), **options)
    if not (sleep is None or callable(sleep)):
        raise InvalidInput("sleep", f"must be callable or None, not {type(sleep).__name__}")
    if isinstance(coordinator, ConnectorLeaseCoordinator):
        if checked.cancel_on_loss:
            raise InvalidInput("cancel_on_loss", "only an asyncio holder can cancel its "
                               "block; use lost_event, wait_lost() or on_lost")
        return Holder(coordinator, checked, sleep=sleep, heartbeat_coordinator=_same_kind(
            heartbeat_coordinator, ConnectorLeaseCoordinator))
    if isinstance(coordinator, AsyncConnectorLeaseCoordinator):
        return AsyncHolder(coordinator, checked, sleep=sleep, heartbeat_coordinator=_same_kind(
            heartbeat_coordinator, AsyncConnectorLeaseCoordinator))
    raise InvalidInput("coordinator", "must be a ConnectorLeaseCoordinator or an "
                       f"AsyncConnectorLeaseCoordinator, not {type(coordinator).__name__}")
