"""Which member of a fleet should hold each binding: rendezvous hashing with bounded load.

Every member of a fleet computes the preferred member of every binding on its own, from the
live member set and the bindings, and they must all get the same answer without talking to
each other. So the answer is a pure function of those two sets: no input order, no process
state, no Python ``hash()`` (salted per process) plays a part. Each name and identity is
hashed with BLAKE2b of a canonical encoding; a binding's score for a member mixes the two
64-bit digests (the splitmix64 finalizer), so hashing costs one digest per binding and one
per member, not one per pair.

Rendezvous (highest random weight) hashing alone moves only the bindings whose winner joined
or left, but its shares are only balanced on average. A bound is added the way bounded-load
consistent hashing does it: bindings are taken in the order of their own digest (the same
order for every member set), and each goes to the highest-scoring member that still has room
under its cap, ``ceil(PLACEMENT_SLACK x bindings x weight / total weight)``. The caps add up
to at least the number of bindings, so every binding is placed.

What the bound costs is stability: a binding whose first choice was full goes to its next
choice, and a change of the member set can change which first choices are full. So a join or
a leave moves the bindings whose winner changed plus a few that overflow differently: over
1,500 random joins and leaves of 1 to 7 members, at most 11 other bindings of 300 and 10 of
1,000 moved; at 10,000 bindings none did (only bindings to the newcomer, or the leaver's).
This is measured, not proven: the property tests assert at most ``2 x sqrt(bindings) + 1``
others (``tests/core/test_fleet_placement.py``).

Weights: a member of weight ``w`` wins a binding with probability ``w / total`` (weighted
rendezvous: score ``w / -ln(u)``). With equal weights the integer scores are compared
exactly; with unequal weights the comparison goes through ``math.log``, which may differ in
its last bit between C libraries. Members on different platforms may then, very rarely,
disagree about one binding: that costs liveness for a moment, never safety (the lease
decides who holds a binding, the placement only who should try first).

A placement is computed once per change of the member set or the bindings, by a
:class:`Placer` that keeps what the bindings alone decide; asking it is a dictionary lookup
(:meth:`Placement.preferred`, :meth:`Placement.is_preferred`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Final

import attrs

from mos_lease.errors import InvalidInput
from mos_lease.identity import LeaseIdentity, check_id, check_identity

PLACEMENT_SLACK: Final = 1.1
"""How far over its fair share a member may be preferred: the cap is
``ceil(PLACEMENT_SLACK x bindings x weight / total weight)``."""
MAX_MEMBER_WEIGHT: Final = 1_000_000.0
"""The largest member weight; weights are positive finite numbers up to this."""

_MASK: Final = (1 << 64) - 1


def _digest(data: bytes, person: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8, person=person).digest(), "big")


def member_digest(name: str) -> int:
    """The 64-bit digest of a member's name that every score for it starts from."""
    return _digest(name.encode("utf-8"), b"mos-lease.member")


def binding_digest(identity: LeaseIdentity) -> int:
    """The 64-bit digest of a binding: BLAKE2b of its three ids joined by NUL (which no id
    may contain, ``check_id`` (:mod:`mos_lease.identity`)), so the encoding is unambiguous."""
    canonical = "\0".join((identity.tenant_id, identity.logical_agent_id, identity.binding_id))
    return _digest(canonical.encode("utf-8"), b"mos-lease.bind")


def score(binding: int, member: int) -> int:
    """A binding's 64-bit rendezvous score for a member, from their digests (splitmix64's
    finalizer over their XOR: every bit of both digests moves about half the bits)."""
    z = binding ^ member
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def _weighted(value: int, weight: float) -> float:
    # Weighted rendezvous: u uniform in (0, 1) from the top 53 bits, never 0 or 1.
    return weight / -math.log(((value >> 11) + 0.5) / 9007199254740992.0)


def check_members(field: str, members: object) -> dict[str, float]:
    """Member names (an iterable of ``str``, each weight 1) or a mapping of name to weight,
    as a dict sorted by name; :class:`~mos_lease.errors.InvalidInput` names what is wrong.
    Names follow ``check_id`` (:mod:`mos_lease.identity`); weights are ``int`` or ``float``,
    positive, finite and at most :data:`MAX_MEMBER_WEIGHT`."""
    if isinstance(members, str | bytes):
        raise InvalidInput(field, "must be a collection of member names, not a single string")
    if isinstance(members, Mapping):
        given = list(members.items())
    elif isinstance(members, Iterable):
        given = [(name, 1.0) for name in members]
    else:
        raise InvalidInput(field, f"must be member names or a mapping of name to weight, "
                           f"not {type(members).__name__}")
    checked: dict[str, float] = {}
    for given_name, weight in given:
        name = check_id(f"{field}[]", given_name)
        checked[name] = check_weight(f"{field}[{name!r}]", weight)
    if len(checked) != len(given):
        raise InvalidInput(field, "member names must be distinct")
    return dict(sorted(checked.items()))


def check_weight(field: str, value: object) -> float:
    """A member weight: an ``int`` or ``float`` (not ``bool``), positive, finite, at most
    :data:`MAX_MEMBER_WEIGHT`, as a ``float``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidInput(field, f"a weight must be an int or float, not {type(value).__name__}")
    weight = float(value)
    if not (math.isfinite(weight) and 0 < weight <= MAX_MEMBER_WEIGHT):
        raise InvalidInput(field, f"a weight must be positive, finite and at most "
                           f"{MAX_MEMBER_WEIGHT:g}")
    return weight


def caps(weights: Mapping[str, float], bindings: int) -> dict[str, int]:
    """The most bindings each member may be preferred for: ``ceil(PLACEMENT_SLACK x bindings
    x weight / total weight)``. They add up to at least ``bindings``."""
    total = math.fsum(weights.values())
    return {name: math.ceil(PLACEMENT_SLACK * bindings * weight / total)
            for name, weight in weights.items()}


@attrs.frozen(slots=True)
class Placement:
    """The preferred member of every binding, for one member set and one set of bindings.

    Built by :func:`place`; every member that builds it from the same sets gets an equal
    one. Lookups are dictionary reads.
    """

    weights: Mapping[str, float]
    """The members and their weights, by name."""
    caps: Mapping[str, int]
    """The most bindings each member may be preferred for."""
    _preferred: Mapping[LeaseIdentity, str] = attrs.field(alias="preferred")
    _shares: Mapping[str, frozenset[LeaseIdentity]] = attrs.field(alias="shares")

    def preferred(self, identity: LeaseIdentity) -> str | None:
        """The member that should hold ``identity``; ``None`` for a binding not placed
        (unknown to this placement, or no member at all)."""
        return self._preferred.get(identity)

    def is_preferred(self, identity: LeaseIdentity, member: str) -> bool:
        """Whether ``member`` should hold ``identity``."""
        return self._preferred.get(identity) == member

    def share(self, member: str) -> frozenset[LeaseIdentity]:
        """The bindings ``member`` should hold (empty for a name that is not a member)."""
        return self._shares.get(member, frozenset())

    @property
    def bindings(self) -> int:
        """How many bindings are placed."""
        return len(self._preferred)

    def assignment(self) -> dict[LeaseIdentity, str]:
        """Every placed binding with its preferred member (a copy)."""
        return dict(self._preferred)


def _checked_binding(identity: object) -> LeaseIdentity:
    # A plain LeaseIdentity was checked by its constructor; re-checking 10,000 of them would
    # cost more than placing them. Anything else (a subclass, another type) is checked
    # in full. A placement is advice, so an identity altered behind the constructor's back
    # can only misplace itself.
    return identity if type(identity) is LeaseIdentity else check_identity("bindings[]", identity)


class Placer:
    """The placements of one set of bindings, for whatever member sets come: what depends
    on the bindings alone (their digests and their order) is computed once, and each
    member's column of scores once per member, so a member joining or leaving a fleet of
    10,000 bindings costs one pass over the rows, not their hashing and sorting again (a
    fifth of the time: ``replace_vs_place`` in ``bench/placement.py``). Equal to
    :func:`place` for every member set, which is one ``Placer(bindings).place(members)``."""

    __slots__ = ("_columns", "_order")

    COLUMNS: Final = 64
    """The most member columns kept; more members than that are scored again each time."""

    def __init__(self, bindings: Iterable[LeaseIdentity]) -> None:
        unique = {_checked_binding(identity): None for identity in bindings}
        # The same order whatever the member set: the binding's digest, then its ids for
        # the (vanishingly rare) equal digests.
        self._order: list[tuple[int, str, str, str, LeaseIdentity]] = sorted(
            (binding_digest(identity), identity.tenant_id, identity.logical_agent_id,
             identity.binding_id, identity) for identity in unique)
        self._columns: dict[str, list[int]] = {}

    def _column(self, name: str) -> list[int]:
        column = self._columns.get(name)
        if column is None:
            if len(self._columns) >= self.COLUMNS:
                self._columns.clear()
            key = member_digest(name)
            column = self._columns[name] = [score(row[0], key) for row in self._order]
        return column

    def place(self, members: object) -> Placement:
        """The preferred member of each binding among ``members`` (names, or a mapping of
        name to weight: :func:`check_members`). With no members, no binding is placed."""
        weights = check_members("members", members)
        if not weights:
            return Placement(weights, {}, preferred={}, shares={})
        limit = caps(weights, len(self._order))
        names = list(weights)
        columns = [self._column(name) for name in names]
        ranks: Sequence[Sequence[float]] = columns  # equal weights: the integers, exactly
        if len(set(weights.values())) > 1:
            ranks = [[_weighted(value, weights[name]) for value in column]
                     for name, column in zip(names, columns, strict=True)]
        room = [limit[name] for name in names]
        chosen: list[list[LeaseIdentity]] = [[] for _ in names]
        preferred: dict[LeaseIdentity, str] = {}
        for row, scores in zip(self._order, zip(*ranks, strict=True), strict=True):
            best = scores.index(max(scores))  # ties: the first name in sorted order
            if not room[best]:
                # Full: the next choices in score order (a stable sort keeps name order on
                # ties).
                best = next(i for i in sorted(range(len(names)), key=scores.__getitem__,
                                              reverse=True) if room[i])
            room[best] -= 1
            chosen[best].append(row[4])
            preferred[row[4]] = names[best]
        shares = {name: frozenset(found) for name, found in zip(names, chosen, strict=True)}
        return Placement(weights, limit, preferred=preferred, shares=shares)


def place(members: object, bindings: Iterable[LeaseIdentity]) -> Placement:
    """The preferred member of each of ``bindings`` among ``members`` (names, or a mapping
    of name to weight: :func:`check_members`). Duplicate bindings count once; the order of
    either argument plays no part. With no members, no binding is placed."""
    check_members("members", members)  # bad members are refused before any hashing
    return Placer(bindings).place(members)
