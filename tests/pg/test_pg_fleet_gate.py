"""Fleet members that disagree about the member set on PostgreSQL, each on its own
connection: campaigning by the gate (preemption allowed by the policy), none ever takes over
an active lease, every binding ends up held by a live member, and the audit log shows each
binding's epochs going up by one per takeover; and supervisors that each see only
themselves, campaigning for the same bindings at once, never have two epochs valid at
once (tests/fleet_race.py)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from mos_lease import LeaseIdentity
from mos_lease.vocabulary import LeaseState, LifecycleEvent, Outcome
from tests.fleet_race import Race
from tests.fleet_sim import SimMember
from tests.pg_fixtures import StoreFactory

pytestmark = pytest.mark.pg

GRACE = timedelta(seconds=5)


def test_disagreeing_members_share_the_bindings_without_preempting(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    bindings = [LeaseIdentity(pg_tenant, f"agent-{i}", "b") for i in range(60)]
    views = {"m1": {"m1", "m2"}, "m2": {"m2", "m3"}, "m3": {"m1", "m2", "m3"}}
    stores = {name: pg_stores() for name in views}
    members = {name: SimMember(name, view, stores[name], stores[name].now, bindings, GRACE)
               for name, view in views.items()}

    def advance(seconds: float) -> None:  # database time moves on for every member alike
        for store in stores.values():
            store.advance(timedelta(seconds=seconds))

    for _ in range(3):
        for member in members.values():
            member.turn(ttl=4)
        advance(3)
    # m2 crashes: it stops renewing; the others take its bindings once they expire and the
    # grace is over, whatever each thinks the member set is.
    del members["m2"]
    for _ in range(4):
        for member in members.values():
            member.turn(ttl=4)
        advance(3)

    reader = stores["m1"]
    now = reader.now()
    holders = {}
    for binding in bindings:
        row = reader.load(binding).row
        assert row is not None and row.state(now) is LeaseState.ACTIVE
        holders[binding] = row.connector_id
    assert set(holders.values()) <= {"m1", "m3"}
    assert sum(m.takeovers for m in members.values()) > 0  # m2's bindings were taken over
    for binding in bindings:
        written = [r.entry for r in reader.audit(binding)
                   if r.entry.outcome in (Outcome.ACQUIRED, Outcome.TAKEN_OVER)]
        assert written[0].event is LifecycleEvent.ACQUIRE and written[0].epoch == 1
        assert [e.epoch for e in written] == list(range(1, len(written) + 1))


def test_members_that_see_only_themselves_never_have_two_epochs_valid_at_once(
        pg_stores: StoreFactory, pg_tenant: str) -> None:
    stores = {name: pg_stores() for name in ("m1", "m2")}
    bindings = [LeaseIdentity(pg_tenant, f"agent-{i}", "b") for i in range(8)]
    # The supervisors' clock moves with the database's: real time, plus what the test adds.
    start, added = time.monotonic(), [0.0]

    def clock() -> float:
        return time.monotonic() - start + added[0]

    def advance(seconds: float) -> None:
        added[0] += seconds
        for store in stores.values():
            store.advance(timedelta(seconds=seconds))

    race = Race(pg_tenant, stores, bindings, clock, advance)
    try:
        race.play(lambda identity: stores["m1"].audit(identity, limit=10_000))
    finally:
        race.close()
