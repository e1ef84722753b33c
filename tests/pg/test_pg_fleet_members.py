"""A fleet's members on PostgreSQL: each member's presence is an ordinary lease (acquired,
audited, released, expiring in database time), several gateways on their own connections
see the same live set from one ``current_holders`` read each, and compute the same
placement from it."""

from __future__ import annotations

from datetime import timedelta

import pytest

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.fleet.members import live_members, member_identities, member_metadata
from mos_lease.fleet.placement import place
from mos_lease.vocabulary import LifecycleEvent, Outcome
from tests.pg_fixtures import StoreFactory

pytestmark = pytest.mark.pg

NAMES = ["gw-1", "gw-2", "gw-3", "gw-4", "gw-5"]


def test_members_join_leave_and_expire_in_database_time(pg_stores: StoreFactory,
                                                        pg_tenant: str) -> None:
    fleet = pg_tenant  # a fleet of its own for this test
    identities = dict(zip(NAMES, member_identities(fleet, NAMES), strict=True))
    gateways = {name: ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
                for name in NAMES[:4]}
    leases = {}
    for number, (name, gateway) in enumerate(gateways.items(), start=1):
        got = gateway.acquire(identities[name], f"proc-{name}", scopes=[],
                              ttl=2 if name == "gw-3" else 60,
                              metadata=member_metadata(f"10.0.0.{number}:8443",
                                                       weight=2 if name == "gw-2" else 1))
        assert got.lease is not None, got
        leases[name] = got.lease
    assert gateways["gw-4"].release(leases["gw-4"]).ok  # a graceful leave

    # Every member reads the whole fleet in one call and judges it the same way.
    views = {name: live_members(fleet, NAMES, gateway.current_holders(
        [identities[n] for n in NAMES])) for name, gateway in gateways.items()}
    for view in views.values():
        assert [m.name for m in view.members] == ["gw-1", "gw-2", "gw-3"]
        assert view.absent == ("gw-4", "gw-5")
        assert view.weights() == {"gw-1": 1.0, "gw-2": 2.0, "gw-3": 1.0}
    member = views["gw-1"].member("gw-2")
    assert member is not None and member.endpoint == "10.0.0.2:8443"
    assert member.connector_id == "proc-gw-2" and member.epoch == 1

    # gw-3 stops renewing: once its lease is past its expiry in database time (the reading
    # store's clock moved on past it), it is absent, and the placement follows.
    reader = pg_stores()
    reader.advance(timedelta(seconds=3))
    later = live_members(fleet, NAMES, ConnectorLeaseCoordinator(
        reader, AllowAllPolicy()).current_holders([identities[n] for n in NAMES]))
    assert [m.name for m in later.members] == ["gw-1", "gw-2"]
    assert later.absent == ("gw-3", "gw-4", "gw-5")

    bindings = [LeaseIdentity(pg_tenant, f"agent-{i}", "b") for i in range(300)]
    placements = [place(view.weights(), bindings).assignment() for view in views.values()]
    assert all(p == placements[0] for p in placements)
    assert "gw-3" not in place(later.weights(), bindings).assignment().values()

    # A member lease is audited like any lease; the reads wrote nothing.
    audit = gateways["gw-4"].store.audit(identities["gw-4"])  # type: ignore[attr-defined]
    assert [(r.entry.event, r.entry.outcome) for r in audit] == [
        (LifecycleEvent.ACQUIRE, Outcome.ACQUIRED), (LifecycleEvent.RELEASE, Outcome.RELEASED)]
    assert gateways["gw-1"].store.audit(identities["gw-5"]) == []  # type: ignore[attr-defined]
