"""A fleet: several gateway processes sharing their bindings.

The pure parts a member decides with, each in the module named for it: who should hold each
binding (:mod:`mos_lease.fleet.placement`), who the live members are, read from their
leases (:mod:`mos_lease.fleet.members`), and when to campaign and what to hand off
(:mod:`mos_lease.fleet.gate`); a supervisor's membership, the options it joins with and
what it decides turn by turn (:mod:`mos_lease.fleet.membership`); and a fleet as the lease
table shows it, for an operator (:mod:`mos_lease.fleet.census`). The guide is
``docs/fleet.md`` ("Running a fleet").
"""

from mos_lease.fleet.census import FleetCensus, MemberShare, UnheldBinding, census
from mos_lease.fleet.gate import Gate, GateReason, Held, Unheld, gates, hand_offs, next_look
from mos_lease.fleet.members import (
    FLEET_TENANT,
    FleetView,
    Member,
    MemberRejection,
    live_members,
    member_connectors,
    member_identities,
    member_identity,
    member_metadata,
)
from mos_lease.fleet.membership import Fleet, FleetStatus
from mos_lease.fleet.placement import Placement, place

__all__ = [
    "FLEET_TENANT",
    "Fleet",
    "FleetCensus",
    "FleetStatus",
    "FleetView",
    "Gate",
    "GateReason",
    "Held",
    "Member",
    "MemberRejection",
    "MemberShare",
    "Placement",
    "Unheld",
    "UnheldBinding",
    "census",
    "gates",
    "hand_offs",
    "live_members",
    "member_connectors",
    "member_identities",
    "member_identity",
    "member_metadata",
    "next_look",
    "place",
]
