"""A fleet as the lease table shows it: its members, each member's share, and the bindings no
one holds, from one read of the rows (``mos-lease status --fleet``).

A supervisor knows its bindings; an operator's command knows only the rows. So the fleet's
bindings are found the way a member recognises another member's leases: a binding's lease
belongs to member ``M`` when its connector is the connector of ``M``'s member lease
(:func:`~mos_lease.fleet.members.member_connectors`). A member runs its bindings under its
own name (``Supervisor.add(identity, member, ...)`` as ``docs/fleet.md`` shows), so the rows
to count are the fleet's member leases and every other row whose last holder is one of
their connectors. What that cannot show, it does not guess: a binding never acquired has no
row, one last held by a connector outside the fleet is not the fleet's, and two fleets whose
members share names share those rows (narrow the read by tenant to tell them apart).

Each row is judged at the read's database time. A binding's lease that is active counts for
its member's share; one that is not (released, or expired) is a binding no one holds, since
its release (``released_at``) or its expiry. Pure: the rows and the time are handed in.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import datetime
from typing import Final

import attrs

from mos_lease.errors import InvalidInput
from mos_lease.fleet.members import (
    ENDPOINT_KEY,
    FLEET_TENANT,
    MemberRejection,
    live_members,
    member_connectors,
)
from mos_lease.identity import LeaseIdentity, check_id
from mos_lease.records import LeaseRow
from mos_lease.results import HolderView
from mos_lease.vocabulary import LeaseState

UNHELD_SHOWN: Final = 10
"""How many bindings without a holder are listed by default, the oldest first."""
MAX_UNHELD_SHOWN: Final = 1_000
"""The most that may be listed."""


@attrs.frozen(slots=True)
class MemberShare:
    """One member lease of the fleet, as the read found it, and the bindings its connector
    holds an active lease on."""

    name: str
    connector_id: str
    endpoint: str | None
    """From the member lease's metadata (``None`` if it has none or it was withheld)."""
    epoch: int
    state: LeaseState
    expires_at: datetime
    live: bool
    """Active, and its metadata accepted: a member the others place bindings on."""
    rejected: MemberRejection | None
    """Why an active member is left out of the live set, if it is."""
    held: int
    """Bindings whose active lease is held by this member's connector."""


@attrs.frozen(slots=True)
class UnheldBinding:
    """A binding of the fleet without an active lease."""

    identity: LeaseIdentity
    member: str
    """The member whose connector held it last."""
    epoch: int
    state: LeaseState
    """``released`` or ``expired``."""
    since: datetime
    """Its release, or its lease's expiry (database time)."""


@attrs.frozen(slots=True)
class FleetCensus:
    """Fleet ``fleet`` at database time ``now``."""

    fleet: str
    now: datetime
    members: tuple[MemberShare, ...]
    """Every member that ever held its member lease, by name."""
    held: int
    """Bindings with an active lease held by a member's connector."""
    unheld: int
    """Bindings without an active lease, last held by a member's connector."""
    unheld_since: datetime | None
    """Since when the oldest binding without a holder has been so."""
    oldest: tuple[UnheldBinding, ...]
    """The longest without a holder, oldest first (at most the number asked for)."""

    @property
    def unheld_for(self) -> float:
        """Seconds the oldest binding without a holder has been so (``0.0`` if none)."""
        since = self.unheld_since
        return 0.0 if since is None else max((self.now - since).total_seconds(), 0.0)

    @property
    def live(self) -> int:
        """How many members are live."""
        return sum(1 for member in self.members if member.live)


def _shown(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) \
            or not 0 <= value <= MAX_UNHELD_SHOWN:
        raise InvalidInput("shown", f"must be an int from 0 to {MAX_UNHELD_SHOWN}")
    return value


def census(fleet: str, now: datetime, rows: Iterable[LeaseRow],
           shown: int = UNHELD_SHOWN) -> FleetCensus:
    """Fleet ``fleet`` from ``rows`` read at database time ``now``: its member leases (tenant
    :data:`~mos_lease.fleet.members.FLEET_TENANT`, logical agent ``fleet``) and any other
    rows; those of other fleets' members, and those whose connector is no member's, are
    left out. ``shown``: how many bindings without a holder to list, oldest first. Bad input
    raises :class:`~mos_lease.errors.InvalidInput` naming it."""
    fleet = check_id("fleet", fleet)
    if not isinstance(now, datetime) or now.tzinfo is None:
        raise InvalidInput("now", "must be an aware datetime (the database's time)")
    shown = _shown(shown)
    members: list[LeaseRow] = []
    bindings: list[LeaseRow] = []
    for row in rows:
        if not isinstance(row, LeaseRow):
            raise InvalidInput("rows", f"must hold LeaseRow, not {type(row).__name__}")
        if row.identity.tenant_id != FLEET_TENANT:
            bindings.append(row)
        elif row.identity.logical_agent_id == fleet:
            members.append(row)
    members.sort(key=lambda row: row.identity.binding_id)
    names = [row.identity.binding_id for row in members]
    view = live_members(fleet, names, [HolderView.of(row, now) for row in members])
    rejected = {r.name: r.reason for r in view.rejected}
    owner = member_connectors((row.identity.binding_id, row.connector_id) for row in members)
    held: dict[str, int] = dict.fromkeys(names, 0)
    unheld: list[UnheldBinding] = []
    for row in bindings:
        name = owner.get(row.connector_id)
        if name is None:
            continue
        state = row.state(now)
        if state is LeaseState.ACTIVE:
            held[name] += 1
        else:
            since = row.released_at if row.released_at is not None else row.expires_at
            unheld.append(UnheldBinding(row.identity, name, row.epoch, state, since))
    unheld.sort(key=lambda b: (b.since, b.identity.tenant_id, b.identity.logical_agent_id,
                               b.identity.binding_id))
    shares = tuple(
        MemberShare(row.identity.binding_id, row.connector_id,
                    None if row.metadata_invalid else row.metadata.get(ENDPOINT_KEY),
                    row.epoch, row.state(now), row.expires_at,
                    view.member(row.identity.binding_id) is not None,
                    rejected.get(row.identity.binding_id), held[row.identity.binding_id])
        for row in members)
    return FleetCensus(fleet, now, shares, sum(held.values()), len(unheld),
                       unheld[0].since if unheld else None, tuple(unheld[:shown]))
