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
from typing import Any

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
from mos_lease.fleet.placement import place
from mos_lease.machine import Rotate, Write, apply_write
from mos_lease.machine import write_outcome as guarded
from mos_lease.notice_confirmer import NoticeConfirmer
from mos_lease.records import LeaseRow
from mos_lease.results import HolderView, LeaseResult
from mos_lease.supervisor import AsyncSupervisor, BindingLost, Change, Moved, Supervisor
from mos_lease.testing.notice_feed import ManualNoticeFeed
from mos_lease.vocabulary import LeaseState, Outcome
from mos_lease_memory import AsyncInMemoryLeaseStore
from tests.fleet_check import Watching, active_holder, epochs_step_by_one
from tests.fleet_race import Race
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

    def start(self, name: str, members: Sequence[str] = NAMES,
              notices: ManualNoticeFeed | None = None) -> Supervisor:
        changes = self.changes.setdefault(name, [])
        supervisor = Supervisor(ConnectorLeaseCoordinator(self.store, AllowAllPolicy()),
                                clock=self.time, background=False, sleep=lambda _: None,
                                on_change=changes.append, notices=notices,
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


def test_release_notices_of_awaited_hand_offs_take_no_confirming_turns() -> None:
    """A member that joins reads every holder, then its share's releases arrive at once, a
    notice each: each moves its binding's read to a moment after the read just made
    (``NOTICED_PAUSE``) and takes no confirming turn, so a hand-off of thousands is not
    warned of as a flood of notices (the confirmer's bound is for notices it cannot
    foresee); the hand-offs then complete as usual."""
    run = Fleetrun()
    run.start("m1")
    run.run(3)
    confirmer = NoticeConfirmer(rate=1, burst=1)
    feed = ManualNoticeFeed(confirmer)
    m2 = run.start("m2", notices=feed)
    for _ in range(4):  # its member lease, the member set, every holder read
        m2.turn()
    placement = place({"m1": 1.0, "m2": 1.0}, BINDINGS)
    awaited = [b for b in BINDINGS if placement.preferred(b) == "m2"]
    assert len(awaited) > 30
    for identity in awaited:  # as m1's releases would send them, before any is read
        feed.send(identity, 1, "release")
    assert m2.stats().notices == len(awaited)  # each acted on: its read moved
    assert confirmer.stats().notices == 0
    run.run(4)
    assert {b for b in BINDINGS if active_holder(run.store, b, run.time.wall.now()) == "m2"} \
        == set(awaited)
    run.check_safety()


def test_notices_of_bindings_preferred_to_another_member_cost_no_read() -> None:
    """A member's shutdown releases thousands and the others take them over, a notice each:
    a member acts only on those of the share it gains. The notices of bindings preferred to
    another member move no read and take no confirming turn; that member's takeover is its
    own, and the binding stays unheld here."""
    run = Fleetrun()
    for name in ("m1", "m2"):
        run.start(name)
    feed = ManualNoticeFeed(NoticeConfirmer(rate=1, burst=1))
    m3 = run.start("m3", notices=feed)
    run.run(6)
    placement = place(dict.fromkeys(NAMES, 1.0), BINDINGS)
    assert {b: active_holder(run.store, b, run.time.wall.now()) for b in BINDINGS} \
        == {b: placement.preferred(b) for b in BINDINGS}
    others = [b for b in BINDINGS if placement.preferred(b) != "m3"]
    reads: list[int] = []  # a read of each binding (the member set is read too)
    read = m3.coordinator.current_holders

    def counted(identities: Sequence[LeaseIdentity]) -> list[HolderView | None]:
        reads.extend(1 for identity in identities if identity in BINDINGS)
        return read(identities)

    m3.coordinator.current_holders = counted  # type: ignore[method-assign]
    before = m3.stats().notices
    for identity in others:
        feed.send(identity, 2, "release")
        feed.send(identity, 3, "takeover")
    for _ in range(3):
        m3.turn()
    assert m3.stats().notices == before
    assert feed.confirmer.stats().notices == 0
    assert reads == []


def test_notices_during_a_members_own_writes_take_no_confirming_turn() -> None:
    """The notices of a member's own acquires and takeovers may come before their answers:
    the answers settle what they tell, so none takes a confirming turn (thousands of them,
    as a member takes its share over, were warned of as a flood)."""
    run = Fleetrun()
    feed = ManualNoticeFeed(NoticeConfirmer(rate=1, burst=1))
    m1 = run.start("m1", notices=feed)
    acquire = m1.coordinator.acquire_many

    def noticed_meanwhile(identities: Sequence[LeaseIdentity], *args: Any, **kwargs: Any
                          ) -> list[LeaseResult]:
        results = acquire(identities, *args, **kwargs)
        for result in results:
            if result.lease is not None:
                feed.send(result.lease.identity, result.lease.epoch, "takeover")
        return results

    m1.coordinator.acquire_many = noticed_meanwhile  # type: ignore[method-assign]
    run.run(3)
    assert run.shares() == {"m1": 90}
    assert feed.confirmer.stats().notices == 0


def test_a_member_reads_the_bindings_preferred_to_it_before_its_other_looks() -> None:
    """When a member's reads of bindings it awaits and its looks at the others are due in
    one turn, the awaited ones are read (and taken over) first."""
    run = Fleetrun()
    run.start("m1")
    run.run(3)
    m2 = run.start("m2")
    for _ in range(8):  # m2 alone turns: m1 holds everything, and hands nothing over yet
        m2.turn()
        run.time.advance(STEP / 2)
    schedule = m2._core.schedule
    now = m2._core.clock()
    for slot in schedule.slots.values():
        if not slot.holding and not slot.busy:
            slot.try_at = now
            schedule._index(slot)
    mine = {b for b in BINDINGS if place({"m1": 1.0, "m2": 1.0}, BINDINGS).preferred(b) == "m2"}
    due = schedule.due(now)
    read = [call.slot.binding.identity for call in due.campaigns
            if call.slot.binding.identity in BINDINGS]
    assert 0 < len(mine) < len(read)
    assert set(read[:len(mine)]) == mine, "the bindings it awaits are read first"


def test_a_release_noticed_while_its_holder_read_is_in_flight_is_read_again_at_once() -> None:
    """The read in flight may have been made before the release its notice tells of: a
    member awaiting that hand-off reads again as soon as the answer is in, not a ``look``
    later as for an active lease preferred to it that no notice spoke of."""
    run = Fleetrun()
    m1 = run.start("m1")
    run.run(3)
    feed = ManualNoticeFeed(NoticeConfirmer(rate=1, burst=1))
    m2 = run.start("m2", notices=feed)
    for _ in range(8):  # m2 alone turns: m1 has not seen it yet, and hands nothing over
        m2.turn()
        run.time.advance(STEP / 2)
    awaited = next(b for b in BINDINGS if place({"m1": 1.0, "m2": 1.0}, BINDINGS
                                               ).preferred(b) == "m2")
    read = m2.coordinator.current_holders
    released: list[LeaseResult] = []

    def released_meanwhile(identities: Sequence[LeaseIdentity]) -> list[HolderView | None]:
        views = read(identities)  # made before the release below: it shows m1's lease
        lease = m1.lease(awaited)
        if awaited in identities and lease is not None and not released:
            released.append(m1.coordinator.release(lease))
            feed.send(awaited, lease.epoch, "release")
        return views

    m2.coordinator.current_holders = released_meanwhile  # type: ignore[method-assign]
    for _ in range(4):  # its next look at the bindings m1 holds for it
        run.time.advance(STEP)
        m2.turn()
        if released:
            break
    m2.coordinator.current_holders = read  # type: ignore[method-assign]
    assert [r.ok for r in released] == [True]
    assert active_holder(run.store, awaited, run.time.wall.now()) is None
    run.time.advance(STEP)
    for _ in range(3):
        m2.turn()
    assert m2.lease(awaited) is not None  # a look (1 s) later before: unheld that long
    assert run.store.takeovers[awaited] == 1


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


def _race() -> Watching:
    time = Time()
    store = Watching(time.wall)
    race = Race("edge", {"m1": store, "m2": store}, BINDINGS[:12], time, time.advance)
    try:
        race.play(lambda identity: store.audit(identity, limit=10_000))
    finally:
        race.close()
    return store


def test_members_that_see_only_themselves_never_have_two_epochs_valid_at_once() -> None:
    """Each member sees only itself: both campaign for every binding at once, and again
    after both stall past the ttl (tests/fleet_race.py). At every turn at most one grant per
    binding validates, the current epoch's; the older epochs' are refused."""
    assert _race().preempted == []


def test_the_race_catches_a_takeover_without_compare_and_set(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A store that applies a takeover whatever the epoch and the lease's state (a planted
    flaw): the member that read the binding unheld and wrote second takes it from the
    first, and both count it as their own."""
    def write_outcome(write: Write, row: LeaseRow | None, now: datetime) -> LeaseRow | None:
        if isinstance(write, Rotate) and row is not None:
            return apply_write(write, row, now)
        return guarded(write, row, now)

    monkeypatch.setattr("mos_lease_memory.store.write_outcome", write_outcome)
    with pytest.raises(AssertionError, match="held by both members at once"):
        _race()
