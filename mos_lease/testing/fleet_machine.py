"""The executable specification of a fleet: a Hypothesis state machine running several
members (each a :class:`~mos_lease.supervisor.Supervisor` with ``fleet=``) over the same
bindings of any store, on one manual clock.

Members join (each with its own list of configured members, so some never see the others,
and a weight), leave gracefully (``close()``), crash (stop renewing, release nothing),
rejoin (a new process, another weight or another list), pause and resume (a process that
does not run for a while and then goes on), and read a stale member set (their member read
answers what it answered earlier): members disagree about who is live, so their placements
differ. Rejoins and weights move the placement, so held bindings are handed over (released
naming the successor, taken over at the observed epoch; the members run without notices,
so a successor sees the release at its next look); and a member hands a binding over by
``handover()``, to the member its placement prefers or to a connector outside the fleet.
Each member keeps a grant for every binding it holds, and grants are asked for at any time.
Time passes with every running member turning at each step, in an order drawn each time,
and single turns run in any order. After every rule, and at every step while time passes,
the machine checks:

* **one holder at a time**: at most one member counts a binding (or a member lease) as its
  own at any moment, and only the store's current lease, not released; no lease is counted
  past the store's expiry;
* **one epoch valid at a time**: every grant minted is validated until it expires: at most
  one epoch's per binding is valid, the store's current one; a grant of an older epoch is
  refused, and a grant refused once is never valid again;
* **no preemption**: no member ever asks to take over an active lease, though the policy
  would allow it;
* **epochs step by one**: in the audit log every acquire and takeover of a binding names
  the epoch after the last, and the store's epochs never go back;
* **moves are releases**: every :class:`~mos_lease.supervisor.Moved` a member reports is a
  release of that lease in the audit log naming the successor, and every report starts
  a lease not held, or ends the one held.

And one rule checks liveness where it is deterministic: once every running member reads
the member set afresh and knows every other running member, after a ttl, the grace period
and a few looks each binding is held by the member the placement prefers.

On a store whose time also runs on its own (PostgreSQL's: the database's clock plus the
harness's offset), the store's time drifts ahead of the manual clock by the real time the
run takes; a lease is then judged expired by the store before its holder's deadline on the
manual clock. There a lease is checked to be counted no longer than the store's expiry
plus that drift, the rest of the one-holder check is left out, and the other invariants
(grants, audit, no preemption, moves) are checked in full.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from mos_lease.coordinator import ConnectorLeaseCoordinator
from mos_lease.fleet.members import member_identities
from mos_lease.fleet.membership import HANDOFF_PREFIX, Fleet
from mos_lease.fleet.placement import place
from mos_lease.identity import LeaseIdentity
from mos_lease.keep.handover import HANDOVER_PREFIX
from mos_lease.supervisor import Change, Moved, Supervisor
from mos_lease.testing.fleet_world import (
    AuditTrail,
    MemberProcess,
    RecordingPolicy,
    StaleView,
    free_tenant,
)
from mos_lease.testing.harness import StoreHarness
from mos_lease.vocabulary import LeaseState

NAMES = ("m1", "m2", "m3")
BINDINGS = 4
SCOPES = ("tool:run",)
TTL = 10.5  # half seconds: never exactly on a step of the clock
GRACE = 3.0
LOOK = 1.0
STEP = 0.5  # seconds between the members' turns while time runs
WEIGHTS = (1.0, 2.0)
OUTSIDE = "connector-outside"  # handed to by handover(); no supervisor of the fleet runs it


def make_fleet_machine(harness_factory: Callable[[], StoreHarness]
                       ) -> type[RuleBasedStateMachine]:
    """A state machine class running a fleet of supervisors against stores from the
    factory. Use it as ``TestMyFleet = make_fleet_machine(factory).TestCase``."""

    class FleetMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.harness = harness_factory()
            self.store = self.harness.store
            self.mono = 1000.0
            tenant = free_tenant(self.store)
            self.fleet = tenant  # the member leases apart by fleet name too
            self.bindings = [LeaseIdentity(tenant, f"agent-{k}", "b") for k in range(BINDINGS)]
            self.member_leases = member_identities(self.fleet, NAMES)
            self.watched = self.bindings + self.member_leases
            self.policy = RecordingPolicy()
            self.running: dict[str, MemberProcess] = {}
            self.sleeps = 0
            self.audit = AuditTrail(self.store, self.watched)
            self.moves: list[tuple[str, Moved]] = []  # reported, not yet found released
            self.highest: dict[LeaseIdentity, int] = {}
            # Where the store's clock and the members' start (see the module's last note).
            self.wall0, self.mono0 = self.store.load(self.bindings[0]).now, self.mono

        # -- the clock and the turns --------------------------------------------------------

        def _clock(self) -> float:
            return self.mono

        def _sleep(self, _seconds: float) -> None:
            self.sleeps += 1

        def _settle(self, member: MemberProcess) -> None:
            """Turn ``member`` until it has nothing to do at this instant."""
            for _ in range(10_000):
                before = self.sleeps
                member.supervisor.turn()
                if self.sleeps > before:
                    return
            raise AssertionError(f"{member.name} never went to sleep")

        def _run(self, seconds: float, order: list[str], settle: bool = True,
                 step: float = STEP) -> None:
            """Time passes by ``step``; at each step every running member turns, in
            ``order``: until it has nothing left to do (``settle``), or one turn each, so
            that one member's read and its write have another's turns between them."""
            for _ in range(round(seconds / step)):
                self.mono += step
                self.harness.advance(timedelta(seconds=step))
                for name in order:
                    member = self.running.get(name)
                    if member is not None and not member.paused:
                        if settle:
                            self._settle(member)
                        else:
                            member.supervisor.turn()
                # Checked at every step, not only after the rule.
                self.one_holder_at_a_time()
                self._mint_where_none()
                self.one_epoch_valid_at_a_time()

        def _drift(self) -> float:
            now = self.store.load(self.bindings[0]).now
            return (now - self.wall0).total_seconds() - (self.mono - self.mono0)

        def teardown(self) -> None:
            for member in self.running.values():
                member.view.thaw()
                member.supervisor.close()

        # -- members come and go ------------------------------------------------------------

        @precondition(lambda self: len(self.running) < len(NAMES))
        @rule(data=st.data(), weight=st.sampled_from(WEIGHTS),
              others=st.one_of(st.just(set(NAMES)), st.sets(st.sampled_from(NAMES))))
        def join(self, data: st.DataObject, weight: float, others: set[str]) -> None:
            """A member process starts (again, after a leave or a crash: a rejoin), knowing
            ``others`` besides itself, with ``weight``."""
            name = data.draw(st.sampled_from(sorted(set(NAMES) - set(self.running))))
            view = StaleView(self.store)
            configured = frozenset(others | {name})

            def make(reported: list[Change]) -> Supervisor:
                coordinator = ConnectorLeaseCoordinator(view, self.policy,
                                                        monotonic_clock=self._clock)
                fleet = Fleet(self.fleet, name, members=sorted(configured), weight=weight,
                              ttl=TTL, grace=GRACE, look=LOOK)
                return Supervisor(coordinator, on_change=reported.append, clock=self._clock,
                                  sleep=self._sleep, random=lambda: 0.5, background=False,
                                  fleet=fleet)

            member = MemberProcess(name, configured, weight, view, make)
            for identity in self.bindings:
                member.supervisor.add(identity, name, scopes=SCOPES, ttl=TTL)
            self.running[name] = member
            self._settle(member)

        @precondition(lambda self: bool(self.running))
        @rule(data=st.data(), crash=st.booleans())
        def stop(self, data: st.DataObject, crash: bool) -> None:
            """A member closes (its leases are released, its member lease first), or its
            process dies (nothing is released: its leases run out)."""
            name = data.draw(st.sampled_from(sorted(self.running)))
            member = self.running.pop(name)
            if crash:
                return
            member.view.thaw()
            member.supervisor.close()
            self._check_reports(member)
            assert member.held == {}, f"{name} closed and still holds {member.held}"

        @precondition(lambda self: bool(self.running))
        @rule(data=st.data(), how=st.sampled_from(("pause", "resume", "stale", "fresh")))
        def disturb(self, data: st.DataObject, how: str) -> None:
            """A member's process stops running for a while (``pause``), then turns as if
            nothing happened (``resume``); or its reads of the member set answer what they
            answer now, from now on (``stale``), until they are ``fresh`` again."""
            name = data.draw(st.sampled_from(sorted(self.running)))
            member = self.running[name]
            if how == "stale":
                fleet = member.supervisor._core.schedule.fleet
                assert fleet is not None
                member.view.freeze(fleet.identities)
            elif how == "fresh":
                member.view.thaw()
            else:
                member.paused = how == "pause"
                if not member.paused:
                    self._settle(member)

        # -- turns, time, grants --------------------------------------------------------------

        @precondition(lambda self: bool(self.running))
        @rule(data=st.data())
        def one_turn(self, data: st.DataObject) -> None:
            """One turn of one member, whatever the others are doing."""
            name = data.draw(st.sampled_from(sorted(self.running)))
            if not self.running[name].paused:
                self.running[name].supervisor.turn()

        @rule(seconds=st.sampled_from((0.5, 1.0, 3.0, 6.0, 12.0)),
              order=st.permutations(NAMES), settle=st.booleans())
        def time_passes(self, seconds: float, order: list[str], settle: bool) -> None:
            self._run(seconds, order, settle)

        def _mint(self, member: MemberProcess, identity: LeaseIdentity) -> None:
            result = member.supervisor.issue_grant(identity, scopes=SCOPES, ttl=5)
            if result.grant is None:
                return
            snapshot = self.store.load(identity)
            row = snapshot.row
            # Minted only for the current epoch's active lease.
            assert row is not None and (row.epoch, row.lease_id) == (
                result.grant.epoch, result.grant.lease_id)
            assert row.connector_id == member.name
            assert row.state(snapshot.now) is LeaseState.ACTIVE
            member.grants.setdefault(identity, []).append(result.grant)

        def _mint_where_none(self) -> None:
            """Each member running mints a grant for each binding it holds that has none
            that may still be valid: a hand-off then always finds one of the old epoch."""
            for member in self.running.values():
                if member.paused:
                    continue
                for identity in member.holding(self.mono):
                    if identity in self.bindings and all(
                            grant.grant_id in member.refused
                            for grant in member.grants.get(identity, ())):
                        self._mint(member, identity)

        @precondition(lambda self: bool(self.running))
        @rule(data=st.data(), k=st.integers(0, BINDINGS - 1))
        def issue_grant(self, data: st.DataObject, k: int) -> None:
            """A member asked for a grant, whether it holds the binding or not."""
            name = data.draw(st.sampled_from(sorted(self.running)))
            self._mint(self.running[name], self.bindings[k])

        def _handing(self) -> dict[str, list[LeaseIdentity]]:
            """The bindings each running member could hand over now."""
            return {name: held for name, member in self.running.items() if not member.paused
                    and (held := member.handable(self.mono, self.bindings))}

        @precondition(lambda self: bool(self._handing()))
        @rule(data=st.data(), outside=st.booleans())
        def handover(self, data: st.DataObject, outside: bool) -> None:
            """A member hands a binding it holds (``handover()``, no drain) to a connector
            outside the fleet, which never takes it, or to the member its placement
            prefers for it; its grants are refused from the release on."""
            handing = self._handing()
            name = data.draw(st.sampled_from(sorted(handing)))
            identity = data.draw(st.sampled_from(handing[name]))
            member = self.running[name]
            preferred = member.preferred(identity)
            to = OUTSIDE if outside or preferred is None or preferred == name else preferred
            member.supervisor.handover(identity, to=to, drain=0)
            self._check_reports(member)

        def _agreeing(self) -> bool:
            """Whether the running members know each other (their placements can agree)."""
            names = set(self.running)
            return bool(names) and all(names <= m.configured for m in self.running.values())

        @precondition(_agreeing)
        @rule(order=st.permutations(NAMES))
        def everyone_agrees_and_settles(self, order: list[str]) -> None:
            """Every running member runs again and reads the member set afresh, and each
            knows every other one: after a ttl, the grace period and a few looks, each
            binding is held by the member the placement of the running members prefers."""
            for member in self.running.values():
                member.view.thaw()
                member.paused = False
            self._run(TTL + GRACE + 4 * LOOK, order, step=LOOK)
            placement = place({m.name: m.weight for m in self.running.values()},
                              self.bindings)
            snapshots = [self.store.load(identity) for identity in self.bindings]
            for identity, snapshot in zip(self.bindings, snapshots, strict=True):
                row = snapshot.row
                assert row is not None and row.state(snapshot.now) is LeaseState.ACTIVE, \
                    f"{identity} has no holder after the fleet settled"
                assert row.connector_id == placement.preferred(identity), (
                    identity, row.connector_id, placement.preferred(identity))

        # -- invariants ---------------------------------------------------------------------

        @invariant()
        def one_holder_at_a_time(self) -> None:
            drift = self._drift()
            owners: dict[LeaseIdentity, list[str]] = {}
            for name, member in self.running.items():
                for identity, (lease, deadline) in member.holding(self.mono).items():
                    owners.setdefault(identity, []).append(name)
                    snapshot = self.store.load(identity)
                    row = snapshot.row
                    assert row is not None
                    if row.lease_id == lease.lease_id:
                        # Counted as its own no longer than the store keeps it: the local
                        # deadline comes before the store's expiry (and the store's drift).
                        left = (row.expires_at - snapshot.now).total_seconds()
                        assert deadline - self.mono <= left + max(drift, 0.0), \
                            f"{name} counts {identity} as its own past its expiry"
                    if drift != 0:
                        continue  # see the module's last note
                    assert row.lease_id == lease.lease_id and row.released_at is None, \
                        f"{name} counts {identity} at epoch {lease.epoch} as its own, the " \
                        f"store has epoch {row.epoch}, released at {row.released_at}"
            if drift == 0:
                both = {identity: names for identity, names in owners.items()
                        if len(names) > 1}
                assert not both, f"held by two members at once: {both}"

        @invariant()
        def one_epoch_valid_at_a_time(self) -> None:
            for identity in self.bindings:
                snapshot = self.store.load(identity)
                row = snapshot.row
                valid = set()
                for name, member in self.running.items():
                    for grant in list(member.grants.get(identity, ())):
                        if grant.expires_at <= snapshot.now:  # refused for its age alone
                            member.grants[identity].remove(grant)
                            continue
                        checked = member.supervisor.coordinator.validate(
                            grant, identity=identity, scopes=SCOPES)
                        if not checked.ok:
                            member.refused.add(grant.grant_id)
                            continue
                        assert grant.grant_id not in member.refused, \
                            f"{name}'s grant of epoch {grant.epoch} refused, then valid again"
                        assert row is not None and (row.epoch, row.lease_id) == (
                            grant.epoch, grant.lease_id), "a grant of an older epoch validated"
                        valid.add((name, grant.epoch))
                assert len(valid) <= 1, f"{identity}: grants of {valid} valid at once"

        @invariant()
        def no_member_preempts(self) -> None:
            asked = [(r.identity, r.connector_id) for r in self.policy.preemptions]
            assert asked == [], f"a takeover of an active lease was asked: {asked}"

        def _check_reports(self, member: MemberProcess) -> None:
            for change in member.new_reports():
                if isinstance(change, Moved):
                    assert change.successor != member.name, change
                    self.moves.append((member.name, change))

        @invariant()
        def epochs_step_by_one(self) -> None:
            self.audit.read()
            for identity in self.watched:
                snapshot = self.store.load(identity)
                if snapshot.row is not None:
                    epoch = snapshot.row.epoch
                    assert epoch >= self.highest.get(identity, 0), "epoch went back"
                    assert epoch == self.audit.epochs.get(identity), (identity, epoch)
                    self.highest[identity] = epoch

        @invariant()
        def moves_are_releases_naming_the_successor(self) -> None:
            for member in self.running.values():
                self._check_reports(member)
            self.audit.read()
            for name, moved in self.moves:
                entry = self.audit.releases.get((moved.identity, moved.lease.epoch))
                assert entry is not None, f"{name} reported {moved} without a release"
                assert entry.connector_id == name
                # Named by the fleet's hand-off, or by a handover() call.
                assert entry.correlation_id in (HANDOFF_PREFIX + moved.successor,
                                                HANDOVER_PREFIX + moved.successor), entry
            self.moves.clear()

    return FleetMachine


__all__ = ["make_fleet_machine"]
