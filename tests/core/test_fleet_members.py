"""A fleet's members (:mod:`mos_lease.fleet.members`): presence is an ordinary lease on a
reserved identity with the endpoint and weight in its metadata; the live set is judged from
one ``current_holders`` read (database time), bad metadata is left out with a reason code,
and bad input is refused naming the field."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from uuid import uuid4

import pytest

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, InvalidInput, LeaseIdentity
from mos_lease.clock import ManualClock
from mos_lease.fleet.members import (
    FLEET_TENANT,
    MemberRejection,
    live_members,
    member_identities,
    member_identity,
    member_metadata,
)
from mos_lease.fleet.placement import place
from mos_lease.ids import uuid7
from mos_lease.machine import Insert
from mos_lease.metadata import Metadata
from mos_lease.records import AuditEntry
from mos_lease.results import HolderView
from mos_lease.vocabulary import LeaseState, LifecycleEvent, Outcome
from mos_lease_memory import InMemoryLeaseStore

NAMES = ["gw-1", "gw-2", "gw-3", "gw-4"]


def _fleet() -> tuple[ConnectorLeaseCoordinator, InMemoryLeaseStore, ManualClock]:
    clock = ManualClock()
    store = InMemoryLeaseStore(clock)
    return ConnectorLeaseCoordinator(store, AllowAllPolicy()), store, clock


def _join(gateway: ConnectorLeaseCoordinator, name: str, ttl: float = 10,
          weight: float = 1) -> None:
    got = gateway.acquire(member_identity("edge", name), f"proc-{name}", scopes=[], ttl=ttl,
                          metadata=member_metadata(f"10.0.0.{name[-1]}:8443", weight))
    assert got.ok, got


def test_the_member_identity_is_reserved_and_checked() -> None:
    assert member_identity("edge", "gw-1") == LeaseIdentity(FLEET_TENANT, "edge", "gw-1")
    assert member_identities("edge", ["b", "a"]) == [member_identity("edge", "a"),
                                                      member_identity("edge", "b")]
    with pytest.raises(InvalidInput) as caught:
        member_identity("edge", " gw")
    assert caught.value.field == "member"
    with pytest.raises(InvalidInput) as caught:
        member_identity("", "gw")
    assert caught.value.field == "fleet"
    with pytest.raises(InvalidInput, match="distinct"):
        member_identities("edge", ["a", "a"])


def test_member_metadata_carries_endpoint_and_weight() -> None:
    assert member_metadata("h:1", 2.5) == {"endpoint": "h:1", "weight": "2.5"}
    assert member_metadata() == {"weight": "1.0"}
    with pytest.raises(InvalidInput) as caught:
        member_metadata("h:1", 0)
    assert caught.value.field == "weight"
    with pytest.raises(InvalidInput) as caught:
        member_metadata("x" * 600)
    assert caught.value.field == "metadata['endpoint']"


def test_live_members_from_one_read_in_database_time() -> None:
    gateway, _, clock = _fleet()
    _join(gateway, "gw-1")
    _join(gateway, "gw-2", weight=3)
    _join(gateway, "gw-3", ttl=2)
    left = gateway.acquire(member_identity("edge", "gw-4"), "proc-4", scopes=[], ttl=10)
    assert left.lease is not None and gateway.release(left.lease).ok  # a graceful leave
    clock.advance(3)  # gw-3 stopped renewing: its lease has expired
    names = ["gw-4", "gw-3", "gw-2", "gw-1", "gw-5"]  # gw-5 never joined; any order
    view = live_members("edge", names, gateway.current_holders(
        [member_identity("edge", name) for name in names]))
    assert [m.name for m in view.members] == ["gw-1", "gw-2"]
    assert view.weights() == {"gw-1": 1.0, "gw-2": 3.0}
    assert view.absent == ("gw-3", "gw-4", "gw-5")
    assert view.rejected == ()
    member = view.member("gw-2")
    assert member is not None and member.endpoint == "10.0.0.2:8443"
    assert member.connector_id == "proc-gw-2" and member.epoch == 1
    assert view.now is not None and member.expires_at == view.now + timedelta(seconds=7)
    assert view.member("gw-3") is None
    # What every member then computes from it.
    bindings = [LeaseIdentity("t", f"a{i}", "b") for i in range(400)]
    shares = place(view.weights(), bindings)
    assert len(shares.share("gw-2")) > 2 * len(shares.share("gw-1"))


def _view(metadata: dict[str, str], invalid: bool = False,
          state: LeaseState = LeaseState.ACTIVE) -> HolderView:
    now = datetime(2026, 1, 1, tzinfo=UTC)
    return HolderView(connector_id="c", epoch=1, state=state,
                      expires_at=now + timedelta(seconds=5), now=now, metadata=metadata,
                      metadata_invalid=invalid)


@pytest.mark.parametrize(("metadata", "invalid", "reason"), [
    ({}, True, MemberRejection.METADATA_WITHHELD),
    ({"weight": "0"}, False, MemberRejection.WEIGHT_INVALID),
    ({"weight": "-1"}, False, MemberRejection.WEIGHT_INVALID),
    ({"weight": "nan"}, False, MemberRejection.WEIGHT_INVALID),
    ({"weight": "inf"}, False, MemberRejection.WEIGHT_INVALID),
    ({"weight": " 1"}, False, MemberRejection.WEIGHT_INVALID),
    ({"weight": "1e999"}, False, MemberRejection.WEIGHT_INVALID),
    ({"weight": "2e6"}, False, MemberRejection.WEIGHT_INVALID),
    ({"weight": "heavy"}, False, MemberRejection.WEIGHT_INVALID),
])
def test_bad_member_metadata_is_left_out_with_its_reason(
        metadata: dict[str, str], invalid: bool, reason: MemberRejection) -> None:
    view = live_members("edge", ["bad", "good"],
                        [_view(metadata, invalid), _view({"weight": "2", "own": "x"})])
    assert [m.name for m in view.members] == ["good"]
    assert view.members[0].weight == 2.0 and view.members[0].endpoint is None
    assert [(r.name, r.reason) for r in view.rejected] == [("bad", reason)]
    assert view.rejected[0].detail


def test_a_planted_row_on_the_store_is_withheld_and_rejected() -> None:
    gateway, store, _ = _fleet()
    identity = member_identity("edge", "gw-1")
    write = Insert(identity, uuid4(), "c1", (), timedelta(seconds=10),
                   Metadata({"weight": "1\n"}))
    store.apply(write, AuditEntry(uuid7(), LifecycleEvent.ACQUIRE, Outcome.ACQUIRED, None,
                                  identity, "c1", 1, "planted"))
    view = live_members("edge", ["gw-1"], gateway.current_holders([identity]))
    assert view.members == ()
    assert [r.reason for r in view.rejected] == [MemberRejection.METADATA_WITHHELD]


def test_released_and_expired_member_leases_are_absent() -> None:
    view = live_members("edge", ["a", "b", "c"], [
        _view({}, state=LeaseState.EXPIRED), _view({}, state=LeaseState.RELEASED), None])
    assert view.members == () and view.absent == ("a", "b", "c")
    assert live_members("edge", [], []).now is None


@pytest.mark.parametrize(("names", "views", "field"), [
    ("gw-1", [None] * 4, "names"),
    (["a", "a"], [None, None], "names"),
    (["a", ""], [None, None], "names[]"),
    (["a"], [], "views"),
    (["a"], ["active"], "views"),
])
def test_bad_input_is_refused(names: object, views: list[object], field: str) -> None:
    with pytest.raises(InvalidInput) as caught:
        live_members("edge", names, views)  # type: ignore[arg-type]
    assert caught.value.field == field
