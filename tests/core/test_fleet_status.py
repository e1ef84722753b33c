"""What a fleet member reports of itself (``Supervisor.fleet_status()``): its share, the
bindings preferred to it and not held, the bindings without a holder and for how long, its
hand-offs out and in and its takeovers, each checked against what the store shows."""

from __future__ import annotations

from collections import Counter

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity
from mos_lease.fleet.members import member_identity, member_metadata
from mos_lease.fleet.membership import FleetStatus
from mos_lease.fleet.placement import place
from mos_lease.supervisor import Moved
from tests.core.test_fleet_supervisor import BINDINGS, GRACE, NAMES, STEP, TTL, Fleetrun
from tests.fleet_check import active_holder


def status(run: Fleetrun, name: str) -> FleetStatus:
    found = run.members[name].fleet_status()
    assert found is not None
    return found


def holders(run: Fleetrun) -> dict[LeaseIdentity, str | None]:
    now = run.time.wall.now()
    return {b: active_holder(run.store, b, now) for b in run.bindings}


def test_a_join_counts_hand_offs_out_and_in_and_no_takeover() -> None:
    run = Fleetrun()
    run.start("m1")
    run.run(3)
    first = status(run, "m1")
    assert (first.fleet, first.member) == ("edge", "m1")
    assert (first.held, first.preferred, first.preferred_not_held) == (90, 90, 0)
    assert (first.unheld, first.unheld_since, first.unheld_for) == (0, None, 0.0)
    assert (first.hand_offs, first.hand_offs_in, first.takeovers) == (0, 0, 0)
    run.start("m2")
    run.run(4)
    moved = [c for c in run.changes["m1"] if isinstance(c, Moved)]
    m1, m2 = status(run, "m1"), status(run, "m2")
    shares = Counter(holders(run).values())
    assert m1.held == shares["m1"] and m2.held == shares["m2"] and None not in shares
    assert m1.hand_offs == len(moved) == m2.hand_offs_in == shares["m2"] > 0
    assert (m1.hand_offs_in, m1.takeovers, m2.hand_offs, m2.takeovers) == (0, 0, 0, 0)
    assert m1.preferred + m2.preferred == 90 and m2.preferred_not_held == 0
    run.check_safety()


def test_a_binding_won_then_handed_over_is_not_counted_unheld_since_before() -> None:
    """m1 acquired every binding when it started; once it has handed some to m2, and m2
    took them over, none of them is without a holder, and m1 must not count them unheld
    since its own first read (it did: the start of the stretch it won was kept until its
    next read of the binding, a grace period later)."""
    run = Fleetrun()
    run.start("m1")
    run.run(5)
    run.start("m2")
    for _ in range(40):
        run.run(STEP)
        m1 = status(run, "m1")
        if m1.hand_offs and status(run, "m2").hand_offs_in == m1.hand_offs:
            break
    assert m1.hand_offs > 0
    assert m1.unheld == 0 and m1.unheld_for == 0.0, m1


def test_unheld_bindings_are_counted_with_the_age_of_the_oldest() -> None:
    """m2 is live (its member lease is held) but runs no binding: the bindings preferred to
    it stay without a holder until m1's grace period is over. m1 counts them, and their age
    grows with the store's time; then it takes them (acquires: neither kind of takeover),
    and none is left."""
    run = Fleetrun()
    lone = ConnectorLeaseCoordinator(run.store, AllowAllPolicy())
    assert lone.acquire(member_identity("edge", "m2"), "m2", scopes=[], ttl=60,
                        metadata=member_metadata()).ok
    run.start("m1")
    run.run(1)
    m1 = status(run, "m1")
    placement = place(["m1", "m2"], BINDINGS)
    waiting = len(placement.share("m2"))
    assert m1.unheld == waiting == 90 - m1.held > 0
    assert m1.preferred == len(placement.share("m1")) and m1.preferred_not_held == 0
    assert m1.unheld_since is not None and 0.5 <= m1.unheld_for <= 1.0
    run.time.advance(1.0)
    later = status(run, "m1")
    assert later.unheld_for == m1.unheld_for + 1.0
    assert (later.unheld, later.unheld_since) == (m1.unheld, m1.unheld_since)
    for _ in range(round((GRACE + 1) / STEP)):
        run.run(STEP)
        done = status(run, "m1")
        if done.held == 90:
            break
    assert done.held == 90, done
    assert (done.unheld, done.unheld_for, done.unheld_since) == (0, 0.0, None)
    assert (done.hand_offs_in, done.takeovers) == (0, 0)


def test_a_crash_is_counted_as_takeovers_by_the_others() -> None:
    run = Fleetrun()
    for name in NAMES:
        run.start(name)
    run.run(6)
    crashed = sum(1 for holder in holders(run).values() if holder == "m2")
    before = {name: status(run, name) for name in ("m1", "m3")}
    run.members.pop("m2")  # stops renewing
    run.run(TTL + 3)
    after = {name: status(run, name) for name in ("m1", "m3")}
    assert crashed > 0
    assert sum(after[n].takeovers - before[n].takeovers for n in after) == crashed
    # Any other move between the two is a hand-off, out of one and into the other.
    assert sum(after[n].hand_offs_in - before[n].hand_offs_in for n in after) \
        == sum(after[n].hand_offs - before[n].hand_offs for n in after)
    assert [m.name for m in after["m1"].view.members] == ["m1", "m3"]  # type: ignore[union-attr]
