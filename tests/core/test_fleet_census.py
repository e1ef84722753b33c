"""A fleet as the lease table shows it (``mos_lease.fleet.census``), from rows built by
hand: which rows are the fleet's, how each member's share and the bindings no one holds are
counted, and what is refused."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest

from mos_lease import InvalidInput, LeaseIdentity
from mos_lease.fleet.census import MAX_UNHELD_SHOWN, census
from mos_lease.fleet.members import MemberRejection, member_identity, member_metadata
from mos_lease.metadata import Metadata
from mos_lease.records import LeaseRow
from mos_lease.vocabulary import LeaseState

NOW = datetime(2030, 1, 1, 12, tzinfo=UTC)


def row(identity: LeaseIdentity, connector: str, *, expires: float = 10,
        released: float | None = None, epoch: int = 1, metadata: Metadata | None = None,
        invalid: bool = False) -> LeaseRow:
    """A row whose lease expires ``expires`` seconds from NOW (released ``released``
    seconds from NOW, if given)."""
    return LeaseRow(identity, uuid.uuid4(), connector, (), epoch, NOW - timedelta(minutes=1),
                    NOW - timedelta(seconds=1), NOW + timedelta(seconds=expires),
                    None if released is None else NOW + timedelta(seconds=released),
                    NOW - timedelta(seconds=1), metadata or Metadata({}), invalid)


def binding(n: int, tenant: str = "acme") -> LeaseIdentity:
    return LeaseIdentity(tenant, f"agent-{n}", "main")


def test_members_shares_and_unheld_bindings() -> None:
    rows = [
        row(member_identity("edge", "m2"), "m2", epoch=3,
            metadata=member_metadata("m2:8443", 2)),
        row(member_identity("edge", "m1"), "m1", metadata=member_metadata("m1:8443")),
        row(member_identity("edge", "m3"), "m3", expires=-4),  # expired: not live
        row(member_identity("other", "m1"), "m1"),  # another fleet's member: not ours
        *[row(binding(n), "m1") for n in range(5)],
        *[row(binding(n), "m2") for n in range(5, 8)],
        row(binding(8), "m3", expires=5),  # a crashed member's lease, still active
        row(binding(9), "m1", expires=-3),  # expired 3 s ago
        row(binding(10), "m2", expires=20, released=-7),  # released 7 s ago
        row(binding(11), "m3", expires=-30, released=-60),  # released a minute ago
        row(binding(12), "outsider", expires=-100),  # never a member's: not the fleet's
    ]
    found = census("edge", NOW, rows, shown=2)
    assert [(m.name, m.endpoint, m.epoch, m.state, m.live, m.held) for m in found.members] == [
        ("m1", "m1:8443", 1, LeaseState.ACTIVE, True, 5),
        ("m2", "m2:8443", 3, LeaseState.ACTIVE, True, 3),
        ("m3", None, 1, LeaseState.EXPIRED, False, 1)]
    assert (found.held, found.unheld, found.live) == (9, 3, 2)
    assert [(b.identity, b.member, b.state, b.since) for b in found.oldest] == [
        (binding(11), "m3", LeaseState.RELEASED, NOW - timedelta(seconds=60)),
        (binding(10), "m2", LeaseState.RELEASED, NOW - timedelta(seconds=7))]
    assert found.unheld_since == NOW - timedelta(seconds=60) and found.unheld_for == 60.0
    # Listing none still counts them, with the oldest's age.
    none = census("edge", NOW, rows, shown=0)
    assert (none.unheld, none.oldest, none.unheld_for) == (3, (), 60.0)
    assert census("edge", NOW, reversed(rows)) == census("edge", NOW, rows)


def test_a_member_with_refused_metadata_is_listed_but_not_live() -> None:
    rows = [row(member_identity("edge", "m1"), "m1", metadata=Metadata({"weight": "-1"})),
            row(member_identity("edge", "m2"), "m2", invalid=True),
            row(binding(0), "m1"), row(binding(1), "m2")]
    found = census("edge", NOW, rows)
    assert [(m.name, m.live, m.rejected, m.held) for m in found.members] == [
        ("m1", False, MemberRejection.WEIGHT_INVALID, 1),
        ("m2", False, MemberRejection.METADATA_WITHHELD, 1)]
    assert found.members[1].endpoint is None


def test_a_fleet_with_no_member_row_has_no_member_and_no_binding() -> None:
    found = census("edge", NOW, [row(binding(0), "m1", expires=-1)])
    assert (found.members, found.held, found.unheld, found.unheld_since, found.unheld_for) \
        == ((), 0, 0, None, 0.0)


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"fleet": ""}, "fleet"),
    ({"fleet": "edge\n"}, "fleet"),
    ({"now": datetime(2030, 1, 1)}, "now"),
    ({"now": "2030-01-01"}, "now"),
    ({"rows": [object()]}, "rows"),
    ({"shown": -1}, "shown"),
    ({"shown": MAX_UNHELD_SHOWN + 1}, "shown"),
    ({"shown": True}, "shown"),
    ({"shown": 2.0}, "shown"),
])
def test_bad_input_is_refused(kwargs: dict[str, object], field: str) -> None:
    given: dict[str, object] = {"fleet": "edge", "now": NOW, "rows": []}
    given.update(kwargs)
    with pytest.raises(InvalidInput) as bad:
        census(**given)  # type: ignore[arg-type]
    assert bad.value.field == field
