"""The fleet run by the supervisor (``Supervisor(fleet=Fleet(...))``) over the in-memory
store, turn by turn on a manual clock: members join and get balanced shares within the cap,
hand over by release and takeover at the observed epoch (reported as ``Moved``), leave
gracefully, crash (the others take over after expiry), rejoin, and disagree about the member
set; in every run no lease is taken over while active (the policy would allow it: the gate
must not ask), epochs step by one in the audit log, and each moved binding is taken over
exactly once."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConfigurationError,
    ConnectorLeaseCoordinator,
    InvalidInput,
    LeaseIdentity,
    LossCause,
)
from mos_lease.fleet.members import member_identity
from mos_lease.fleet.membership import EXPIRY_MARGIN, HANDOFF_PREFIX, Fleet, Membership
from mos_lease.results import HolderView
from mos_lease.supervisor import AsyncSupervisor, BindingLost, Change, Moved, Supervisor
from mos_lease.vocabulary import LeaseState, Outcome
from mos_lease_memory import AsyncInMemoryLeaseStore
from tests.fleet_check import Watching, active_holder, epochs_step_by_one
from tests.helpers import Time

START = datetime(2030, 1, 1, tzinfo=UTC)
TTL, GRACE, LOOK, STEP = 10.0, 3.0, 1.0, 0.25
BINDINGS = [LeaseIdentity("acme", f"agent-{n}", "main") for n in range(90)]
NAMES = ["m1", "m2", "m3"]


class Fleetrun:
    """Members on one store, turned by hand; each step checks and records who holds what."""

    def __init__(self, bindings: Sequence[LeaseIdentity] = BINDINGS) -> None:
        self.time = Time()
        self.store = Watching(self.time.wall)
        self.bindings = list(bindings)
        self.members: dict[str, Supervisor] = {}
        self.changes: dict[str, list[Change]] = {}
        self.unheld_since: dict[LeaseIdentity, datetime] = {}
        self.longest_unheld = timedelta(0)

    def start(self, name: str, members: Sequence[str] = NAMES) -> Supervisor:
        changes = self.changes.setdefault(name, [])
        supervisor = Supervisor(ConnectorLeaseCoordinator(self.store, AllowAllPolicy()),
                                clock=self.time, background=False, sleep=lambda _: None,
                                on_change=changes.append,
                                fleet=Fleet("edge", name, members=members, ttl=TTL,
                                            grace=GRACE, look=LOOK, endpoint=f"{name}:8443"))
        for identity in self.bindings:
            supervisor.add(identity, name, scopes=["tool:run"], ttl=TTL)
        self.members[name] = supervisor
        return supervisor

    def run(self, seconds: float) -> None:
        for _ in range(round(seconds / STEP)):
            for supervisor in list(self.members.values()):
                for _ in range(3):  # a turn makes one kind of call; a step allows a few
                    supervisor.turn()
            self.time.advance(STEP)
            self.look()

    def look(self) -> None:
        now = self.time.wall.now()
        for identity in self.bindings:
            if active_holder(self.store, identity, now) is None:
                since = self.unheld_since.setdefault(identity, now)
                self.longest_unheld = max(self.longest_unheld, now - since)
            else:
                self.unheld_since.pop(identity, None)

    def shares(self) -> Counter[str | None]:
        now = self.time.wall.now()
        return Counter(active_holder(self.store, identity, now) for identity in self.bindings)

    def moved(self, name: str) -> list[Moved]:
        return [c for c in self.changes[name] if isinstance(c, Moved)]

    def check_safety(self) -> None:
        assert self.store.preempted == []
        epochs_step_by_one(self.store, self.bindings)


def cap(bindings: int, members: int) -> int:
    return math.ceil(1.1 * bindings / members)


def test_join_balances_and_hands_over_by_release_and_takeover() -> None:
    run = Fleetrun()
    run.start("m1")
    run.run(3)
    assert run.shares() == {"m1": 90}
    run.start("m2")
    run.run(4)
    shares = run.shares()
    assert None not in shares and max(shares.values()) <= cap(90, 2), shares
    # What m2 holds it got from m1 by a planned hand-off: m1 reported each as Moved (not a
    # loss), released it naming m2, and m2 took it over once, at the next epoch.
    moved = run.moved("m1")
    assert {m.identity for m in moved} == {b for b in BINDINGS
                                           if active_holder(run.store, b, run.time.wall.now())
                                           == "m2"}
    assert all(m.successor == "m2" for m in moved)
    assert not [c for c in run.changes["m1"] if isinstance(c, BindingLost)]
    assert all(run.store.takeovers[m.identity] == 1 for m in moved)
    releases = [r.entry for m in moved for r in run.store.audit(m.identity)
                if r.entry.outcome is Outcome.RELEASED]
    assert {e.correlation_id for e in releases} == {HANDOFF_PREFIX + "m2"}
    run.start("m3")
    run.run(4)
    shares = run.shares()
    assert None not in shares and max(shares.values()) <= cap(90, 3), shares
    assert set(shares) == {"m1", "m2", "m3"}
    run.check_safety()
    # A binding was without a holder only between a release and its successor's takeover.
    assert run.longest_unheld <= timedelta(seconds=LOOK + STEP)
    status = run.members["m3"].fleet_status()
    assert status is not None and status.view is not None
    assert [m.name for m in status.view.members] == NAMES
    assert status.view.member("m2") is not None
    assert status.view.member("m2").endpoint == "m2:8443"  # type: ignore[union-attr]
    assert status.held == shares["m3"] and status.preferred_not_held == 0


def test_a_join_moves_each_binding_once_after_members_that_started_together() -> None:
    """Two members start together (each first campaigns with only itself in view, then
    they hand over to each other); a third joins: every binding it moves is taken over once,
    by its successor, and never taken back by the member that handed it over earlier and
    remembers it unheld since its first read."""
    run = Fleetrun()
    run.start("m1")
    run.start("m2")
    run.run(TTL)
    before = Counter(run.store.takeovers)
    run.start("m3")
    run.run(5)
    shares = run.shares()
    assert set(shares) == set(NAMES) and max(shares.values()) <= cap(90, 3), shares
    moved = run.store.takeovers - before
    assert moved and set(moved.values()) == {1}, moved
    run.check_safety()


def test_the_grace_period_counts_from_the_start_of_this_unheld_stretch() -> None:
    """A binding first seen never held, then (unseen) held and released at epoch 2 a minute
    later: its grace period starts at the read that found it released, not at the first
    read (as it did when the start was remembered per identity: members took bindings handed
    to another member at once, and the successor took them over a second time)."""
    membership = Membership(Fleet("edge", "m1", members=["m1", "m2"], grace=GRACE))
    for identity in BINDINGS:
        membership.add(identity)
    membership.read([HolderView(name, 1, LeaseState.ACTIVE, START + timedelta(seconds=10),
                                START) for name in ("m1", "m2")], 0.0)
    other = next(b for b in BINDINGS if membership.placement.preferred(b) == "m2")
    assert membership.judge(other, None, 0.0) == GRACE  # never held: wait out the grace
    later = START + timedelta(seconds=60)

    def released(at: datetime) -> HolderView:
        return HolderView("m2", 2, LeaseState.RELEASED, later - timedelta(seconds=5), at)

    assert membership.judge(other, released(later), 60.0) == GRACE
    assert membership.judge(other, released(later + timedelta(seconds=GRACE)),
                            60.0 + GRACE) is None  # then campaign
    expired = HolderView("m2", 3, LeaseState.EXPIRED, later, later + timedelta(seconds=1))
    assert membership.judge(other, expired, 61.0) == GRACE - 1  # from the expiry itself


def test_the_member_set_is_read_again_as_another_member_lease_would_expire() -> None:
    """A member that stops renewing is seen gone as its lease expires, not up to a look
    later; a live member's renewal moves that read on, so it costs nothing."""
    membership = Membership(Fleet("edge", "m1", members=["m1", "m2"], look=10))
    membership.reading(100.0)
    membership.read([HolderView("m1", 1, LeaseState.ACTIVE, START + timedelta(seconds=9),
                                START),
                     HolderView("m2", 1, LeaseState.ACTIVE, START + timedelta(seconds=4),
                                START)], 100.0)
    assert membership.next_read() == pytest.approx(104.0 + EXPIRY_MARGIN)
    membership.reading(104.05)  # m2 renewed meanwhile: its expiry moved on
    membership.read([HolderView("m1", 1, LeaseState.ACTIVE, START + timedelta(seconds=9),
                                START + timedelta(seconds=4.05)),
                     HolderView("m2", 1, LeaseState.ACTIVE, START + timedelta(seconds=14),
                                START + timedelta(seconds=4.05))], 104.05)
    assert membership.next_read() == pytest.approx(114.05)  # the look comes first


def test_a_handed_over_binding_gives_no_new_grant_while_its_release_is_in_flight() -> None:
    run = Fleetrun(BINDINGS[:10])
    m1 = run.start("m1")
    run.run(3)
    seen: list[tuple[object, bool]] = []

    def during_release() -> None:  # m1's hand-off is in flight: what m1 answers now
        for identity in BINDINGS[:10]:
            if m1.lease(identity) is None:
                seen.append((identity, m1.issue_grant(identity, scopes=["tool:run"],
                                                      ttl=5).ok))
                # The successor's takeover notice may come before the release's answer:
                # no loss to confirm (a confirming read would count against the notice
                # bound, and flood it at a join of thousands).
                assert not m1._core.schedule.worth_confirming(identity, 99)

    run.store.on_release_many = during_release
    m2 = run.start("m2")
    run.run(3)
    moved = {change.identity for change in run.moved("m1")}
    assert moved and {identity for identity, _ in seen} >= moved
    assert not any(ok for _, ok in seen)
    for identity in moved:
        assert m2.lease(identity) is not None
    run.check_safety()


def test_graceful_leave_hands_its_bindings_to_the_others() -> None:
    run = Fleetrun()
    for name in NAMES:
        run.start(name)
    run.run(6)
    assert set(run.shares()) == set(NAMES)
    run.members.pop("m2").close()
    assert all(isinstance(c, BindingLost) and c.loss.cause is LossCause.STOPPED
               for c in run.changes["m2"][-5:])
    run.run(4)  # a look sees m2 gone: its bindings are preferred to the others at once
    shares = run.shares()
    assert set(shares) == {"m1", "m3"} and max(shares.values()) <= cap(90, 2), shares
    run.check_safety()
    assert run.longest_unheld <= timedelta(seconds=LOOK + 2 * STEP)


def test_a_crashed_member_is_taken_over_after_expiry_and_gets_its_share_back() -> None:
    run = Fleetrun()
    for name in NAMES:
        run.start(name)
    run.run(6)
    crashed = {b for b in BINDINGS if active_holder(run.store, b, run.time.wall.now()) == "m2"}
    before = Counter(run.store.takeovers)
    run.members.pop("m2")  # stops renewing: a crash
    run.run(TTL + LOOK + 1)
    shares = run.shares()
    assert set(shares) == {"m1", "m3"}, shares
    assert all(run.store.takeovers[b] - before[b] == 1 for b in crashed)
    # Without a holder for no longer than a step or two after its lease expired: the
    # member set is read again as m2's member lease would expire, not a look later.
    assert run.longest_unheld <= timedelta(seconds=2 * STEP)
    run.start("m2")  # rejoins: a new process takes its expired member lease over
    run.run(5)
    shares = run.shares()
    assert set(shares) == set(NAMES) and max(shares.values()) <= cap(90, 3), shares
    assert run.store.takeovers[member_identity("edge", "m2")] == 1
    run.check_safety()


def test_members_that_disagree_about_the_member_set_never_preempt() -> None:
    """m1 knows only m1 and m2, m2 all three, m3 only m2 and m3: they place the bindings
    differently for as long as they run. The leases stay safe, every takeover is of an
    ended lease at the next epoch, and no binding is without a holder for longer than the
    grace period and a look."""
    run = Fleetrun(BINDINGS[:40])
    run.start("m1", ["m1", "m2"])
    run.start("m2", NAMES)
    run.run(2)
    run.start("m3", ["m2", "m3"])
    run.run(20)
    run.members.pop("m1")  # and a crash
    run.run(TTL + GRACE + 2)
    run.check_safety()
    assert run.longest_unheld <= timedelta(seconds=GRACE + LOOK + 2 * STEP)
    assert set(run.shares()) <= {"m2", "m3"}


def test_without_a_fleet_nothing_is_read_or_gated() -> None:
    time = Time()
    store = Watching(time.wall)
    supervisor = Supervisor(ConnectorLeaseCoordinator(store, AllowAllPolicy()), clock=time,
                            background=False, sleep=lambda _: None)
    supervisor.add(BINDINGS[0], "gw", scopes=[], ttl=TTL)
    for _ in range(3):
        supervisor.turn()
    assert supervisor.lease(BINDINGS[0]) is not None
    assert supervisor.fleet_status() is None
    assert [r.row.identity for r in map(store.load, [member_identity("edge", "gw")])
            if r.row is not None] == []


async def no_sleep(_: float) -> None:
    pass


def test_the_asyncio_supervisor_runs_a_fleet() -> None:
    async def main() -> Counter[str | None]:
        time = Time()
        store = AsyncInMemoryLeaseStore(Watching(time.wall))
        members = []
        for name in ("m1", "m2"):
            supervisor = AsyncSupervisor(
                AsyncConnectorLeaseCoordinator(store, AllowAllPolicy()), clock=time,
                background=False, sleep=no_sleep,
                fleet=Fleet("edge", name, members=["m1", "m2"], ttl=TTL, grace=GRACE,
                            look=LOOK))
            for identity in BINDINGS[:30]:
                supervisor.add(identity, name, scopes=[], ttl=TTL)
            members.append(supervisor)
        for _ in range(round(4 / STEP)):
            for supervisor in members:
                for _ in range(3):
                    await supervisor.turn()
            time.advance(STEP)
        now = time.wall.now()
        shares = Counter(active_holder(store.sync, b, now) for b in BINDINGS[:30])
        for supervisor in members:
            await supervisor.close()
        return shares

    shares = asyncio.run(main())
    assert set(shares) == {"m1", "m2"} and max(shares.values()) <= cap(30, 2), shares


@pytest.mark.parametrize(("kwargs", "field"), [
    ({"name": ""}, "name"),
    ({"member": "m\n1"}, "member"),
    ({"members": "m1"}, "members"),
    ({"members": ["m2"]}, "members"),
    ({"members": ["m1", "m1"]}, "members"),
    ({"members": [f"m{n}" for n in range(1_001)]}, "members"),
    ({"weight": 0}, "weight"),
    ({"weight": True}, "weight"),
    ({"endpoint": 8443}, "endpoint"),
    ({"grace": -1}, "grace"),
    ({"ttl": math.nan}, "ttl"),
    ({"ttl": 301}, "ttl"),
    ({"look": 0}, "look"),
    ({"look": "1"}, "look"),
])
def test_fleet_options_are_checked(kwargs: dict[str, object], field: str) -> None:
    given: dict[str, object] = {"name": "edge", "member": "m1", "members": ["m1", "m2"]}
    given.update(kwargs)
    with pytest.raises(InvalidInput) as bad:
        Fleet(**given)  # type: ignore[arg-type]
    assert bad.value.field.split("[")[0] == field


def test_a_supervisor_refuses_what_is_not_a_fleet() -> None:
    coordinator = ConnectorLeaseCoordinator(Watching(), AllowAllPolicy())
    with pytest.raises(ConfigurationError, match="fleet must be a Fleet"):
        Supervisor(coordinator, background=False, fleet="edge")  # type: ignore[arg-type]
