"""A supervisor's membership of a fleet: the options it joins with (:class:`Fleet`) and what
it decides from them (:class:`Membership`), turn by turn.

The supervisor (``Supervisor(..., fleet=Fleet(...))``) runs the member's presence lease as
one more binding of its schedule, renewed in the same batches as the others. Once per
``look`` seconds (sooner after a notice about a member lease) its turn reads every configured
member's lease in one ``current_holders`` call and hands the views to :meth:`Membership.read`,
which judges the live set (:func:`~mos_lease.fleet.members.live_members`) and recomputes the
placement (:func:`~mos_lease.fleet.placement.place`) only when the live set or the bindings
changed. Then:

- every campaign of the schedule, after reading a binding's holder, asks :meth:`Membership.
  judge` whether to go on: the campaign gate (:mod:`mos_lease.fleet.gate`) in database time,
  answered as a wait in the supervisor's monotonic time, or ``None`` to campaign now;
- the held bindings the placement now prefers to another live member are released naming
  that member (:meth:`Membership.hand_offs`), and its successor, which waited for the release
  (a notice, or its next look), takes the lease over at the observed epoch.

Pure: no clock is read and no store is called. Store times come from the views read; the
supervisor's monotonic time is passed in, and the two are tied by the last member read
(``anchor``), so a binding never seen held (no store time of its own) is judged at an
estimate of the store's time. The estimate only advises when to campaign: a wrong one costs
a refused write or a later campaign, never safety, which stays the lease's.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from datetime import datetime, timedelta
from typing import Final

import attrs

from mos_lease.errors import InvalidInput
from mos_lease.fleet.gate import Held, Unheld, check_grace, gate, hand_offs
from mos_lease.fleet.members import (
    FleetView,
    live_members,
    member_connectors,
    member_identities,
    member_identity,
    member_metadata,
)
from mos_lease.fleet.placement import Placement, Placer, check_members, check_weight, place
from mos_lease.identity import LEASE_TTL_CAP, MAX_ID_LENGTH, LeaseIdentity, check_id
from mos_lease.metadata import Metadata
from mos_lease.records import LeaseHandle
from mos_lease.results import HolderView
from mos_lease.vocabulary import LeaseState

MAX_MEMBERS: Final = 1_000
"""The most configured member names: their leases are read in one ``current_holders`` call."""
RECOMPUTE_PAUSE: Final = 0.25
"""Seconds between placements while bindings are being added or removed: a gateway adding
10,000 bindings one by one places them a few times, not 10,000 times."""
EXPIRY_MARGIN: Final = 0.05
"""Seconds after another member's lease would expire (as last read) that the member set is
read again: a member that stopped renewing is seen gone at once, not up to a ``look``
later. A live member's renewal has moved that expiry on by then, so this costs no read."""
NOTICED_PAUSE: Final = 0.1
"""The least seconds between two member reads asked for by notices: a flood of notices about
member leases costs at most ten reads a second."""
HANDOFF_PREFIX: Final = "fleet-handoff:"
"""The release of a planned hand-off carries the correlation id ``fleet-handoff:<member>``
in its audit row, naming the successor (``None`` if that would be longer than an id may be)."""


def _seconds(field: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float | timedelta):
        raise InvalidInput(field, f"must be seconds or a timedelta, not {type(value).__name__}")
    seconds = value.total_seconds() if isinstance(value, timedelta) else float(value)
    if not (math.isfinite(seconds) and seconds > 0):
        raise InvalidInput(field, "must be a positive, finite number of seconds")
    return seconds


class Fleet:
    """How a supervisor joins fleet ``name`` as member ``member``: ``members`` are the
    fleet's configured member names (this one among them; at most :data:`MAX_MEMBERS`, each
    member reads them all at once), ``endpoint`` where this member is reached and
    ``weight`` its share relative to the others (the member lease's metadata,
    :func:`~mos_lease.fleet.members.member_metadata`), ``grace`` how long a binding preferred
    to another member stays without a holder before this one campaigns for it, ``ttl`` the
    member lease's ttl (give it the bindings' ttl, so that it is renewed in their batch),
    ``look`` the seconds between reads of the member set. Every argument is checked here;
    bad input raises :class:`~mos_lease.errors.InvalidInput` naming it."""

    __slots__ = ("endpoint", "grace", "look", "member", "members", "metadata", "name", "ttl",
                 "weight")

    def __init__(self, name: str, member: str, *, members: Iterable[str],
                 endpoint: str | None = None, weight: float = 1,
                 grace: float | timedelta = 5.0, ttl: float | timedelta = 10.0,
                 look: float | timedelta = 1.0) -> None:
        self.name: str = check_id("name", name)
        self.member: str = check_id("member", member)
        if isinstance(members, str | bytes) or not isinstance(members, Iterable):
            raise InvalidInput("members", "must be a collection of member names")
        self.members: tuple[str, ...] = tuple(check_members("members", list(members)))
        if self.member not in self.members:
            raise InvalidInput("members", f"must include this member, {self.member!r}")
        if len(self.members) > MAX_MEMBERS:
            raise InvalidInput("members", f"at most {MAX_MEMBERS} names (one read each look)")
        if endpoint is not None and not isinstance(endpoint, str):
            raise InvalidInput("endpoint", f"must be a str or None, not "
                               f"{type(endpoint).__name__}")
        self.endpoint: str | None = endpoint
        self.weight: float = check_weight("weight", weight)
        self.metadata: Metadata = member_metadata(endpoint, self.weight)
        self.grace: timedelta = check_grace("grace", grace)
        self.ttl: float = _seconds("ttl", ttl)
        if self.ttl > LEASE_TTL_CAP.total_seconds():
            raise InvalidInput("ttl", f"must be at most {LEASE_TTL_CAP.total_seconds():g} s, "
                               "the lease cap")
        self.look: float = _seconds("look", look)

    @property
    def identity(self) -> LeaseIdentity:
        """The identity of this member's presence lease."""
        return member_identity(self.name, self.member)

    def __repr__(self) -> str:
        return (f"Fleet({self.name!r}, {self.member!r}, members={list(self.members)!r}, "
                f"endpoint={self.endpoint!r}, weight={self.weight!r})")


@attrs.frozen(slots=True)
class FleetStatus:
    """What a member sees of its fleet (``Supervisor.fleet_status()``)."""

    view: FleetView | None
    """The last member read's verdict (``None`` before the first)."""
    held: int
    """Bindings this member holds."""
    preferred: int
    """Bindings the placement prefers to this member."""
    preferred_not_held: int
    """Of those, the ones it does not hold (yet)."""
    unheld: int
    """Bindings this member last saw without an active lease."""
    unheld_since: datetime | None
    """The earliest store time since which one of those has been without one."""
    hand_offs: int
    """Bindings this member released to a successor since it started (hand-offs out)."""
    unheld_for: float
    """Seconds the oldest of the unheld bindings has been without an active lease, at the
    store's time as estimated now from the last member read (``0.0`` if none)."""
    hand_offs_in: int
    """Bindings this member took over from a lease another connector had released: a
    hand-off to it, or a member leaving (``close()``), since it started."""
    takeovers: int
    """Bindings this member took over from a lease that had not been released (it
    expired: its holder stopped renewing), since it started."""
    fleet: str
    """The fleet's name."""
    member: str
    """This member's name."""


class Membership:
    """One supervisor's membership: the live member set, the placement, and the times it
    keeps (the supervisor's monotonic time unless said otherwise). Not thread-safe: the
    supervisor calls it under its schedule's lock."""

    def __init__(self, fleet: Fleet) -> None:
        self.fleet = fleet
        self.identity = fleet.identity
        self.identities: tuple[LeaseIdentity, ...] = tuple(
            member_identities(fleet.name, fleet.members))
        self._watched = frozenset(self.identities)
        self.view: FleetView | None = None
        self.placement: Placement = place({}, ())
        self._bindings: set[LeaseIdentity] = set()
        self._changed = False  # bindings added or removed since the last placement
        self._placer: Placer | None = None  # of the bindings at the last placement
        self.read_at = -math.inf  # when the member set is read next
        self._last_read = -math.inf
        self._expiry_read = math.inf  # when another member's lease would expire (+ margin)
        self._anchor: tuple[datetime, float] | None = None  # (store time, monotonic) of a read
        self._connectors: dict[str, str] = {}  # live members' connector ids -> names
        self._unheld: dict[LeaseIdentity, tuple[int, datetime]] = {}  # (epoch, since)
        self.handed = 0
        self._handed_in = 0
        self._taken_over = 0

    # -- the bindings placed --------------------------------------------------------------------

    def add(self, identity: LeaseIdentity) -> None:
        if identity != self.identity:
            self._bindings.add(identity)
            self._changed = True

    def remove(self, identity: LeaseIdentity) -> None:
        if identity in self._bindings:
            self._bindings.discard(identity)
            self._unheld.pop(identity, None)
            self._changed = True

    # -- reading the member set -----------------------------------------------------------------

    def next_read(self) -> float:
        """When the member set is read next: every ``look``; as another member's lease
        would expire (:data:`EXPIRY_MARGIN`), if sooner; sooner (not more often than
        :data:`RECOMPUTE_PAUSE`) while bindings were added or removed."""
        due = min(self.read_at, self._expiry_read)
        if self._changed:
            return min(due, self._last_read + RECOMPUTE_PAUSE)
        return due

    def noticed(self, identity: LeaseIdentity, now: float) -> bool:
        """A notice came for ``identity``: if it is a member lease of the fleet (a member
        left, or was taken over), read the member set at once, but not more often than
        :data:`NOTICED_PAUSE`. Whether the read moved earlier."""
        if identity not in self._watched or identity == self.identity:
            return False
        at = max(now, self._last_read + NOTICED_PAUSE)
        if at >= self.read_at:
            return False
        self.read_at = at
        return True

    def preferred_here(self, identity: LeaseIdentity) -> bool:
        """Whether the placement prefers this member for ``identity``."""
        return self.placement.is_preferred(identity, self.fleet.member)

    def notice_pause(self, identity: LeaseIdentity, pause: float) -> float | None:
        """The least seconds between two reads of ``identity`` that notices may ask for, of
        a binding whose ``max_backoff`` is ``pause``: :data:`NOTICED_PAUSE` (or ``pause``
        if shorter) for a binding preferred to this member and not held by it,
        whose holder is to hand it over, so that the release's notice is acted on at once;
        ``None`` (no read) for a binding preferred to another member, whose notices are
        that member's to act on: this one may campaign for it only after the grace period,
        which its own looks judge, and a member that dies is seen gone by the member read
        its lease's expiry brings, which moves the reads of the bindings it leaves. So a
        member's shutdown, releasing thousands, and the takeovers that follow cost each
        other member only the reads of the share it gains. ``None`` too before the first
        member read has placed the binding: that read brings the reads of this member's
        whole share forward, so a member starting while the others hand it its share
        reads nothing twice for their notices."""
        if self.placement.is_preferred(identity, self.fleet.member):
            return min(pause, NOTICED_PAUSE)
        return None

    def joined(self, now: float) -> None:
        """This member's own lease was won: read the member set at once, so that the others
        seen and this one agree on a placement without waiting a ``look``."""
        self.read_at = min(self.read_at, now)

    def won(self, identity: LeaseIdentity, observed: HolderView | None, lease: LeaseHandle,
            now: float) -> None:
        """This member won ``lease`` of ``identity`` at monotonic ``now``, by a call planned
        on ``observed`` (``None``: an acquire of a binding never held). Its own member lease:
        the member set is read at once (:meth:`joined`). A binding: its unheld stretch is
        over (else, handed over later, it would count as unheld since long before), and a
        takeover is counted, as a hand-off in if the lease taken over was released by
        another connector, else as a takeover."""
        if identity == self.identity:
            self.joined(now)
            return
        self._unheld.pop(identity, None)
        if observed is None:
            return
        if observed.state is LeaseState.RELEASED and observed.connector_id != lease.connector_id:
            self._handed_in += 1
        else:
            self._taken_over += 1

    def reading(self, now: float) -> None:
        """A member read starts at ``now``: the next is a ``look`` later."""
        self._last_read = now
        self.read_at = now + self.fleet.look
        self._expiry_read = math.inf  # set again by what this read finds

    def read(self, views: Sequence[HolderView | None], now: float
             ) -> frozenset[LeaseIdentity]:
        """Judge the member read's ``views`` (one per configured member, in the order of
        :attr:`identities`), made at monotonic ``now``: the bindings the placement now
        prefers to this member and did not before (those worth reading again at once)."""
        view = live_members(self.fleet.name, self.fleet.members, views)
        self.view = view
        if view.now is not None:
            self._anchor = (view.now, now)
            others = [m.expires_at for m in view.members if m.name != self.fleet.member]
            if others:
                self._expiry_read = now + EXPIRY_MARGIN + max(
                    (min(others) - view.now).total_seconds(), 0.0)
        self._connectors = member_connectors((m.name, m.connector_id) for m in view.members)
        weights = view.weights()
        if weights == self.placement.weights and not self._changed:
            return frozenset()
        if self._changed or self._placer is None:
            self._placer = Placer(self._bindings)
        self._changed = False
        placement = self._placer.place(weights)
        me = self.fleet.member
        gained = placement.share(me) - self.placement.share(me)
        self.placement = placement
        return gained

    # -- deciding -------------------------------------------------------------------------------

    def store_time(self, now: float) -> datetime | None:
        """The store's time at monotonic ``now``, estimated from the last member read."""
        if self._anchor is None:
            return None
        at, then = self._anchor
        return at + timedelta(seconds=now - then)

    def judge(self, identity: LeaseIdentity, view: HolderView | None, now: float
              ) -> float | None:
        """After a campaign read ``view`` of ``identity`` at monotonic ``now``: ``None`` to
        campaign now (the gate's ``preferred`` or ``grace_elapsed``), else the seconds to
        wait before reading again: to the lease's expiry or the end of the grace period, and
        no longer than a ``look`` for an active lease of a binding preferred to this member
        (its holder is to hand it over: without a notice, the next look sees the release)."""
        store_now = view.now if view is not None else self.store_time(now)
        if store_now is None:
            return self.fleet.look  # no member read has answered yet: nothing to judge with
        seen: Held | Unheld
        if view is not None and view.state is LeaseState.ACTIVE:
            self._unheld.pop(identity, None)
            seen = Held(self._connectors.get(view.connector_id), view.expires_at)
        else:
            seen = Unheld(self._since(identity, view, store_now))
        decided = gate(self.placement, self.fleet.member, identity, seen, store_now,
                       self.fleet.grace)
        if decided.campaign:
            return None
        if isinstance(seen, Held):  # the gate's held or mine: look again at its expiry
            wait = max((seen.expires_at - store_now).total_seconds(), 0.0)
            if self.placement.is_preferred(identity, self.fleet.member):
                return min(wait, self.fleet.look)
            if seen.holder is not None and seen.holder != self.fleet.member:
                # Another live member renews it: its expiry will have moved on. The looks
                # of all such bindings go out together, on the grid of ``look`` seconds,
                # as a few batched reads instead of one per expiry. If that member dies,
                # the member read that shows it gone brings the bindings it gives this
                # member forward (read); the others are their new members' to take.
                look = self.fleet.look
                wait = math.ceil((now + wait) / look) * look - now
            return wait
        assert decided.next_look is not None  # in_grace: look again as it ends
        return max((decided.next_look - store_now).total_seconds(), 0.0)

    def _since(self, identity: LeaseIdentity, view: HolderView | None, store_now: datetime
               ) -> datetime:
        """Since when ``identity`` has had no active lease: an expired lease's expiry; for
        a released lease, or one never held, whose view does not say when, the first read
        that found it so in this unheld stretch. The epoch names the stretch: a lease
        released at epoch ``e`` is never active at ``e`` again (a takeover, at ``e + 1``,
        is all that can follow), so a stretch remembered at another epoch is an older one
        and starts again now. (Keyed by the identity alone, a binding this member held,
        handed over and read again would look unheld since its first read long ago, and be
        taken back at once.)"""
        epoch = 0 if view is None else view.epoch
        if view is not None and view.state is LeaseState.EXPIRED:
            self._unheld[identity] = (epoch, view.expires_at)
            return view.expires_at
        known = self._unheld.get(identity)
        if known is None or known[0] != epoch:
            known = self._unheld[identity] = (epoch, store_now)
        return known[1]

    def hand_offs(self, held: Iterable[LeaseIdentity]) -> dict[LeaseIdentity, str]:
        """The bindings of ``held`` the placement prefers to another live member, with that
        member (:func:`~mos_lease.fleet.gate.hand_offs`). None while this member is not
        live itself: a member that cannot show it is in the fleet hands nothing over."""
        if self.view is None or self.view.member(self.fleet.member) is None:
            return {}
        return hand_offs(self.placement, self.fleet.member, held)

    def status(self, held: Iterable[LeaseIdentity], now: float) -> FleetStatus:
        """What this member sees at monotonic ``now``, holding ``held``."""
        mine = self.placement.share(self.fleet.member)
        holding = set(held) - {self.identity}
        unheld = [since for identity, (_, since) in self._unheld.items()
                  if identity not in holding]
        oldest = min(unheld, default=None)
        store_now = self.store_time(now)
        age = 0.0 if oldest is None or store_now is None \
            else max((store_now - oldest).total_seconds(), 0.0)
        return FleetStatus(self.view, len(holding), len(mine), len(mine - holding),
                           len(unheld), oldest, self.handed, age, self._handed_in,
                           self._taken_over, self.fleet.name, self.fleet.member)


def handoff_correlation(successor: str) -> str | None:
    """The correlation id that names ``successor`` in a hand-off's release audit rows."""
    text = HANDOFF_PREFIX + successor
    return text if len(text) <= MAX_ID_LENGTH else None
