"""When a fleet member campaigns for a binding, and which of its bindings it should hand off.

The placement (:mod:`mos_lease.fleet.placement`) says who *should* hold each binding; this
module turns that into what a member does, given what it observed of each binding in
database time:

- a binding with an active lease is never campaigned for, whoever holds it: the member looks
  again at the lease's expiry (a notice may bring that look forward). So a member never
  campaigns against a live member holding a binding, preferred to it or not;
- a binding without an active lease (never held, expired, released) preferred to this member
  is campaigned for at once;
- any other binding without an active lease is campaigned for once it has been without one
  for the grace period, so a binding whose preferred member crashed, left or disagrees about
  the member set is never left unheld for longer than the grace period.

With equal views of the member set, every binding without an active lease has exactly one
member that campaigns at once during the grace period: its preferred member. With unequal
views two members may campaign together; that costs one of them a refused write, never
safety, which is the lease's: an acquire is insert-only and a takeover a compare-and-set on
the observed epoch.

A member should hand off (:func:`hand_offs`) each binding it holds that the placement
prefers to another member. The hand-off itself (drain, release naming the successor) is the
engine's.

Everything here is pure: times are the store's, passed in.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from datetime import datetime, timedelta

import attrs

from mos_lease.errors import InvalidInput
from mos_lease.fleet.placement import Placement
from mos_lease.identity import LeaseIdentity, check_id


@attrs.frozen(slots=True)
class Held:
    """The binding's lease is active (at the read's database time) until ``expires_at``."""

    holder: str | None
    """The member holding it, by name; ``None`` for a holder that is not a live member (a
    connector outside the fleet, or a member whose own lease has expired)."""
    expires_at: datetime


@attrs.frozen(slots=True)
class Unheld:
    """The binding has had no active lease since ``since`` (database time): the expiry of
    its last lease; for a lease released before its expiry, or for a binding never held,
    the first read that found it so (a holder view does not say when a release happened)."""

    since: datetime


Observed = Held | Unheld
"""What a member observed of one binding."""


class GateReason(enum.StrEnum):
    """Why a member campaigns for a binding now, or not (stable codes)."""

    PREFERRED = "preferred"
    """No active lease and preferred to this member: campaign now."""
    GRACE_ELAPSED = "grace_elapsed"
    """No active lease for the grace period, preferred elsewhere: campaign now."""
    IN_GRACE = "in_grace"
    """No active lease, preferred elsewhere, within the grace period: wait."""
    HELD = "held"
    """Another holder's lease is active: wait for its expiry (or a notice)."""
    MINE = "mine"
    """This member holds it: nothing to campaign for."""


@attrs.frozen(slots=True)
class Gate:
    """The decision for one binding."""

    campaign: bool
    """Campaign now (acquire, or take over at the observed epoch)."""
    reason: GateReason
    next_look: datetime | None
    """When the decision may change without a new observation (database time): the
    lease's expiry, or the end of the grace period; ``None`` if only a new observation
    changes it."""


def check_grace(field: str, value: object) -> timedelta:
    """A grace period: a positive ``timedelta`` or number of seconds."""
    if isinstance(value, bool) or not isinstance(value, timedelta | int | float):
        raise InvalidInput(field, f"must be seconds or a timedelta, not {type(value).__name__}")
    try:
        grace = value if isinstance(value, timedelta) else timedelta(seconds=value)
    except (OverflowError, ValueError):
        raise InvalidInput(field, "must be a finite number of seconds") from None
    if grace <= timedelta(0):
        raise InvalidInput(field, "must be positive")
    return grace


def gate(placement: Placement, me: str, identity: LeaseIdentity, observed: Observed,
         now: datetime, grace: timedelta) -> Gate:
    """Whether member ``me`` campaigns for ``identity`` now, from ``observed`` at database
    time ``now``. ``grace`` is checked by :func:`gates`; this is the rule for one binding."""
    if isinstance(observed, Held):
        if observed.holder == me:
            return Gate(False, GateReason.MINE, None)
        return Gate(False, GateReason.HELD, observed.expires_at)
    if placement.is_preferred(identity, me):
        return Gate(True, GateReason.PREFERRED, None)
    ends = observed.since + grace
    if now >= ends:
        return Gate(True, GateReason.GRACE_ELAPSED, None)
    return Gate(False, GateReason.IN_GRACE, ends)


def gates(placement: Placement, me: str, observed: Mapping[LeaseIdentity, Observed],
          now: datetime, grace: timedelta | float) -> dict[LeaseIdentity, Gate]:
    """:func:`gate` for every binding of ``observed``; bad input raises
    :class:`~mos_lease.errors.InvalidInput` naming the field."""
    me = check_id("me", me)
    period = check_grace("grace", grace)
    if not isinstance(now, datetime) or now.tzinfo is None:
        raise InvalidInput("now", "must be an aware datetime (the store's time)")
    decided = {}
    for identity, seen in observed.items():
        if not isinstance(seen, Held | Unheld):
            raise InvalidInput("observed", f"must map to Held or Unheld, not "
                               f"{type(seen).__name__}")
        decided[identity] = gate(placement, me, identity, seen, now, period)
    return decided


def next_look(decided: Mapping[LeaseIdentity, Gate]) -> datetime | None:
    """The earliest time any of ``decided`` may change without a new observation."""
    return min((g.next_look for g in decided.values() if g.next_look is not None),
               default=None)


def hand_offs(placement: Placement, me: str,
              held: Iterable[LeaseIdentity]) -> dict[LeaseIdentity, str]:
    """The bindings of ``held`` (held by member ``me``) that the placement prefers to
    another member, with that member: the successor each should be handed to. A binding
    the placement does not know stays where it is."""
    me = check_id("me", me)
    moves = {}
    for identity in held:
        successor = placement.preferred(identity)
        if successor is not None and successor != me:
            moves[identity] = successor
    return moves
