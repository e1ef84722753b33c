"""A fleet's members: each member's presence is an ordinary lease, and who is live is read
from those leases.

A member of fleet ``F`` named ``M`` holds the lease of :func:`member_identity` ``(F, M)``:
tenant :data:`FLEET_TENANT`, logical agent ``F``, binding ``M``. It is acquired, renewed,
taken over and released like any binding's lease, so a member's presence has the guarantees
every lease has: the database's time, insert-only first acquire, takeover by compare-and-set
on the epoch, an audit row per attempt. The policy sees these calls like any other and must
allow them for the gateways of the fleet.

The tenant :data:`FLEET_TENANT` is reserved for member leases: agents' identities must not
use it (it is not a valid tenant of any other kind of binding, by convention; the library
does not refuse it, since the gateway's policy decides who may use which tenant).

The member's lease carries holder metadata (:mod:`mos_lease.metadata`, within its size
caps): ``endpoint``, where the member is reached (optional), and ``weight``, its share of the
bindings relative to the others (optional, ``1`` when absent; a decimal number, positive and
at most :data:`~mos_lease.fleet.placement.MAX_MEMBER_WEIGHT`). Other keys are the member's
own and ignored here. :func:`member_metadata` builds it.

The live member set is read with one ``current_holders`` call over the identities of the
fleet's configured member names (:func:`member_identities`; at most 1,000 names per read)
and judged by :func:`live_members`, a pure function of what that read returned: a member is
live while its lease is active at the read's database time. A member whose metadata breaks
the rules (withheld by the store, or a weight that is not a positive number) is left out of
the live set and listed with a stable reason code (:class:`MemberRejection`), so one
misconfigured member cannot make the others disagree about the rest.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Final

import attrs

from mos_lease.errors import InvalidInput
from mos_lease.fleet.placement import check_members, check_weight
from mos_lease.identity import LeaseIdentity, check_id
from mos_lease.metadata import Metadata, check_metadata
from mos_lease.results import HolderView
from mos_lease.vocabulary import LeaseState

FLEET_TENANT: Final = "mos-lease.fleet"
"""The tenant of every member lease, reserved for them."""
ENDPOINT_KEY: Final = "endpoint"
"""The member lease's metadata key for where the member is reached."""
WEIGHT_KEY: Final = "weight"
"""The member lease's metadata key for the member's weight."""
# What a weight is written as: a plain decimal number, optionally with an exponent (as
# repr() of a float writes it). float() alone would also take "nan", "inf" and " 1 ".
_WEIGHT_RE: Final = re.compile(r"[0-9]+(\.[0-9]+)?([eE][-+]?[0-9]+)?")


def member_identity(fleet: str, member: str) -> LeaseIdentity:
    """The identity of member ``member``'s lease in fleet ``fleet``."""
    return LeaseIdentity(FLEET_TENANT, check_id("fleet", fleet), check_id("member", member))


def member_identities(fleet: str, members: Iterable[str]) -> list[LeaseIdentity]:
    """The member lease identities of ``members`` (distinct names), sorted by name: the
    identities to read together with ``current_holders``."""
    return [member_identity(fleet, name) for name in check_members("members", list(members))]


def member_metadata(endpoint: str | None = None, weight: float = 1) -> Metadata:
    """Holder metadata for a member lease: its endpoint (if any) and its weight. Bad input
    raises :class:`~mos_lease.errors.InvalidInput` naming the field."""
    items = {WEIGHT_KEY: repr(check_weight("weight", weight))}
    if endpoint is not None:
        items[ENDPOINT_KEY] = endpoint
    return check_metadata("metadata", items)


class MemberRejection(enum.StrEnum):
    """Why a member with an active lease is left out of the live set (stable codes)."""

    METADATA_WITHHELD = "metadata_withheld"
    """The store withheld the lease's metadata: it breaks the rules every write passes."""
    WEIGHT_INVALID = "weight_invalid"
    """The ``weight`` entry is not a positive decimal number within the bound."""


@attrs.frozen(slots=True)
class Member:
    """A live member: its lease is active at the read's database time."""

    name: str
    endpoint: str | None
    weight: float
    connector_id: str
    epoch: int
    expires_at: datetime
    """The member lease's expiry, database time."""


@attrs.frozen(slots=True)
class Rejected:
    """A member whose lease is active but whose metadata is refused."""

    name: str
    reason: MemberRejection
    detail: str


@attrs.frozen(slots=True)
class FleetView:
    """The members of a fleet as one read saw them."""

    fleet: str
    now: datetime | None
    """The read's database time (``None`` if no configured member ever held a lease)."""
    members: tuple[Member, ...]
    """The live members, by name."""
    rejected: tuple[Rejected, ...]
    """Members with an active lease but refused metadata, by name."""
    absent: tuple[str, ...]
    """Configured names with no active lease (never held, expired or released), sorted."""

    def weights(self) -> dict[str, float]:
        """The live members and their weights: what :func:`~mos_lease.fleet.placement.place`
        takes."""
        return {member.name: member.weight for member in self.members}

    def member(self, name: str) -> Member | None:
        """The live member ``name``, or ``None``."""
        return next((member for member in self.members if member.name == name), None)


def member_connectors(members: Iterable[tuple[str, str]]) -> dict[str, str]:
    """Which member each connector id stands for, from ``(name, connector_id)`` pairs of
    member leases: a binding's lease is member ``M``'s when its connector is the connector
    of ``M``'s member lease (a supervisor holds its member lease, and runs its bindings, as
    the member's name). Of members sharing a connector (a misconfiguration), the first name
    in sorted order."""
    found: dict[str, str] = {}
    for name, connector_id in sorted(members):
        found.setdefault(connector_id, name)
    return found


def _weight(metadata: Metadata) -> float | str:
    """The weight a member's metadata gives, or the reason it is refused."""
    text = metadata.get(WEIGHT_KEY)
    if text is None:
        return 1.0
    if not _WEIGHT_RE.fullmatch(text):
        return f"weight {text!r} is not a decimal number"
    try:
        return check_weight(WEIGHT_KEY, float(text))
    except InvalidInput as bad:
        return f"weight {text!r}: {bad.message}"


def live_members(fleet: str, names: Sequence[str],
                 views: Sequence[HolderView | None]) -> FleetView:
    """The members of ``fleet`` that are live, from ``views``: what ``current_holders``
    returned for the member identities of ``names`` (one view per name, in the same
    order, as :func:`member_identities` gives them).

    Live means the lease is active at the read's database time (``view.state``). Names
    and the fleet are checked; a length mismatch or anything but a view or ``None`` raises
    :class:`~mos_lease.errors.InvalidInput`.
    """
    fleet = check_id("fleet", fleet)
    if isinstance(names, str):
        raise InvalidInput("names", "must be a sequence of member names, not a single string")
    given = [check_id("names[]", name) for name in names]
    if len(set(given)) != len(given):
        raise InvalidInput("names", "member names must be distinct")
    if len(views) != len(given):
        raise InvalidInput("views", f"must hold one view per name ({len(given)}), "
                           f"not {len(views)}")
    members: list[Member] = []
    rejected: list[Rejected] = []
    absent: list[str] = []
    now: datetime | None = None
    for name, view in sorted(zip(given, views, strict=True), key=lambda pair: pair[0]):
        if view is not None and not isinstance(view, HolderView):
            raise InvalidInput("views", f"must be HolderView or None, not {type(view).__name__}")
        if view is not None:
            now = view.now if now is None else max(now, view.now)
        if view is None or view.state is not LeaseState.ACTIVE:
            absent.append(name)
            continue
        if view.metadata_invalid:
            rejected.append(Rejected(name, MemberRejection.METADATA_WITHHELD,
                                     "the stored metadata breaks the metadata rules"))
            continue
        metadata = Metadata(view.metadata)
        weight = _weight(metadata)
        if isinstance(weight, str):
            rejected.append(Rejected(name, MemberRejection.WEIGHT_INVALID, weight))
            continue
        members.append(Member(name, metadata.get(ENDPOINT_KEY), weight, view.connector_id,
                              view.epoch, view.expires_at))
    return FleetView(fleet, now, tuple(members), tuple(rejected), tuple(absent))
