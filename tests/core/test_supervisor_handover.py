"""A planned hand-off of one binding (``Supervisor.handover(identity, to=...)``) on the
in-memory store, turn by turn on a manual clock: the lease goes to the named connector at the
next epoch, the old holder reports ``Moved`` (not a loss) and mints no grant from the call
on, its grants in flight are given until they expire (at most ``drain``), the release's audit
row names the successor, the old grants are refused ``stale_epoch`` at the gateway and at a
fenced resource from the new epoch on, the policy decides (a refusal is a typed result and
writes nothing), bad input writes nothing, and a successor that never comes leaves the
binding unheld for the grace period only."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta

import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    InvalidInput,
    LeaseIdentity,
    Reason,
    StaticConnectorPolicy,
)
from mos_lease.fleet.members import member_identity
from mos_lease.fleet.membership import Fleet
from mos_lease.keep.handover import HANDOVER_PREFIX, HOLD_OFF, MAX_SUCCESSOR
from mos_lease.policy import ConnectorLeaseService
from mos_lease.supervisor import (
    AsyncSupervisor,
    BindingLost,
    BindingStarted,
    Change,
    Moved,
    Supervisor,
)
from mos_lease.token import format_token, parse_token
from mos_lease.vocabulary import LeaseState, LifecycleEvent, Outcome
from mos_lease_memory import AsyncInMemoryLeaseStore, InMemoryLeaseStore
from mos_lease_memory.fencing import InMemoryResourceGuard
from tests.helpers import Time

AGENT = LeaseIdentity("acme", "agent-1", "main")
OTHER = LeaseIdentity("acme", "agent-2", "main")
TTL = 10.0
RUN = ["tool:run"]


class Pair:
    """Two supervisors over one binding on one store, turned by hand: ``old`` runs it as
    connector ``claude`` (and holds it), ``new`` as ``codex`` (and waits)."""

    def __init__(self, policy: ConnectorLeaseService | None = None) -> None:
        self.time = Time()
        self.store = InMemoryLeaseStore(self.time.wall)
        self.policy = policy if policy is not None else AllowAllPolicy()
        self.during_sleep: list[Callable[[], object]] = []
        self.changes: dict[str, list[Change]] = {"claude": [], "codex": []}
        self.old = self.supervisor("claude")
        self.old.add(AGENT, "claude", scopes=RUN, ttl=TTL)
        self.old.add(OTHER, "claude", scopes=RUN, ttl=TTL)
        self.turn(self.old)
        self.new = self.supervisor("codex")
        self.new.add(AGENT, "codex", scopes=RUN, ttl=TTL)
        self.turn(self.new)

    def supervisor(self, name: str) -> Supervisor:
        return Supervisor(ConnectorLeaseCoordinator(self.store, self.policy),
                          clock=self.time, background=False, sleep=self.sleep,
                          on_change=self.changes[name].append)

    def sleep(self, seconds: float) -> None:
        """The drain's pause: time passes (and whatever a test does meanwhile); a turn's
        pause, in :meth:`turn`, passes no time (the test moves it)."""
        if self.turning:
            return
        for action in self.during_sleep:
            action()
        self.time.advance(seconds)

    turning = False

    def turn(self, supervisor: Supervisor, times: int = 3) -> None:
        self.turning, turning = True, self.turning
        try:
            for _ in range(times):
                supervisor.turn()
        finally:
            self.turning = turning

    def holder(self) -> tuple[str, int, LeaseState]:
        view = self.old.coordinator.current_holder(AGENT)
        assert view is not None
        return view.connector_id, view.epoch, view.state

    def audit_rows(self) -> int:
        return len(self.store.audit(AGENT))


def test_the_lease_goes_to_the_named_connector_at_the_next_epoch_and_the_old_is_fenced(
        ) -> None:
    pair = Pair()
    held = pair.old.lease(AGENT)
    assert held is not None and held.epoch == 1
    grant = pair.old.issue_grant(AGENT, scopes=RUN, ttl=10).grant
    assert grant is not None
    checked = pair.old.coordinator.validate(grant, identity=AGENT, scopes=RUN)
    assert checked.context is not None
    guard = InMemoryResourceGuard(clock=pair.time.wall.now)  # an effect boundary downstream
    assert guard.admit("mailbox", parse_token(format_token(checked.context))).ok

    result = pair.old.handover(AGENT, to="codex", drain=0)  # its grant lives on
    assert result.ok and result.reason is None and result.successor == "codex"
    assert result.lease == held
    assert pair.old.lease(AGENT) is None
    assert [c for c in pair.changes["claude"] if c.identity == AGENT] == [
        BindingStarted(AGENT, held), Moved(AGENT, held, "codex")]
    release = pair.store.audit(AGENT)[-1].entry
    assert (release.event, release.outcome, release.correlation_id) == (
        LifecycleEvent.RELEASE, Outcome.RELEASED, HANDOVER_PREFIX + "codex")
    assert pair.holder() == ("claude", 1, LeaseState.RELEASED)

    pair.time.advance(pair.new._core.schedule.slots[AGENT].binding.timing.max_backoff)
    pair.turn(pair.new)  # its next look (no notices here) finds the release
    assert pair.holder() == ("codex", 2, LeaseState.ACTIVE)
    started = [c for c in pair.changes["codex"] if isinstance(c, BindingStarted)]
    assert [(c.lease.connector_id, c.lease.epoch) for c in started] == [("codex", 2)]
    new_lease = pair.new.lease(AGENT)
    assert new_lease is not None and new_lease.epoch == 2

    # The old connector's grant is refused from the new epoch on, at the gateway and at the
    # resource; the new connector's actions are admitted.
    stale = pair.old.coordinator.validate(grant, identity=AGENT, scopes=RUN)
    assert stale.reason is Reason.STALE_EPOCH
    fresh = pair.new.issue_grant(AGENT, scopes=RUN, ttl=2).grant
    assert fresh is not None
    context = pair.new.coordinator.validate(fresh, identity=AGENT, scopes=RUN).context
    assert context is not None and context.epoch == 2
    assert guard.admit("mailbox", parse_token(format_token(context))).ok
    refused = guard.admit("mailbox", parse_token(format_token(checked.context)))
    assert refused.reason is not None and refused.reason.value == "stale_epoch"

    # The old holder never campaigns against it, and reported no loss.
    pair.time.advance(HOLD_OFF + 1)
    pair.turn(pair.old)
    pair.turn(pair.new)
    assert pair.holder() == ("codex", 2, LeaseState.ACTIVE)
    assert not [c for c in pair.changes["claude"] if isinstance(c, BindingLost)]
    takeovers = [r.entry for r in pair.store.audit(AGENT)
                 if r.entry.event is LifecycleEvent.TAKEOVER]
    assert [(e.connector_id, e.outcome) for e in takeovers] == [("codex", Outcome.TAKEN_OVER)]


def test_no_new_grant_from_the_call_and_the_grants_in_flight_are_given_until_they_expire(
        ) -> None:
    pair = Pair()
    assert pair.old.issue_grant(AGENT, scopes=RUN, ttl=2).ok
    seen: list[tuple[object, Reason | None]] = []
    pair.during_sleep.append(lambda: seen.append((
        pair.old.lease(AGENT), pair.old.issue_grant(AGENT, scopes=RUN, ttl=1).reason)))
    before = pair.time()
    result = pair.old.handover(AGENT, to="codex", drain=5)
    assert result.ok
    # Released once the 2 s grant had expired, not at the 5 s bound, and not at once.
    assert result.drained == pytest.approx(2.0, abs=0.01)
    assert pair.time() - before == pytest.approx(2.0, abs=0.01)
    assert seen and all(lease is None for lease, _ in seen)
    assert all(reason is not None for _, reason in seen)  # refused locally
    issued = [r for r in pair.store.audit(AGENT)
              if r.entry.event is LifecycleEvent.GRANT_ISSUE]
    assert len(issued) == 1  # the refusals during the drain wrote nothing


def test_the_drain_is_bounded() -> None:
    pair = Pair()
    assert pair.old.issue_grant(AGENT, scopes=RUN, ttl=20).ok
    result = pair.old.handover(AGENT, to="codex", drain=timedelta(seconds=1.5))
    assert result.ok and result.drained == pytest.approx(1.5, abs=0.01)
    no_grants = Pair()
    assert no_grants.old.handover(AGENT, to="codex").drained == 0.0  # nothing to wait for


def test_the_lease_is_renewed_during_a_long_drain() -> None:
    pair = Pair()
    assert pair.old.issue_grant(AGENT, scopes=RUN, ttl=30).ok
    pair.during_sleep.append(lambda: pair.turn(pair.old, 1))  # its turns go on meanwhile
    pair.old._sleep = lambda seconds: pair.sleep(min(seconds, 1.0))  # a turn a second
    result = pair.old.handover(AGENT, to="codex", drain=25)  # longer than the 10 s ttl
    assert result.ok and result.drained == pytest.approx(25, abs=1.01)
    assert not [c for c in pair.changes["claude"] if isinstance(c, BindingLost)]
    renewed = [r for r in pair.store.audit(AGENT) if r.entry.event is LifecycleEvent.HEARTBEAT]
    assert renewed


def test_a_successor_that_never_comes_leaves_the_binding_unheld_for_the_hold_off_only(
        ) -> None:
    pair = Pair()
    pair.new.remove(AGENT)  # nobody runs "ghost"
    result = pair.old.handover(AGENT, to="ghost")
    assert result.ok
    for _ in range(int(HOLD_OFF / 0.5) - 1):
        pair.time.advance(0.5)
        pair.turn(pair.old)
        assert pair.holder() == ("claude", 1, LeaseState.RELEASED)
    pair.time.advance(1.0)
    pair.turn(pair.old)
    assert pair.holder() == ("claude", 2, LeaseState.ACTIVE)  # the normal campaign again
    assert isinstance(pair.changes["claude"][-1], BindingStarted)


def test_a_notice_of_its_own_release_does_not_bring_the_old_holder_back_early() -> None:
    from mos_lease.testing import ManualNoticeFeed

    time = Time()
    store = InMemoryLeaseStore(time.wall)
    feed = ManualNoticeFeed()
    old = Supervisor(ConnectorLeaseCoordinator(store, AllowAllPolicy()), clock=time,
                     background=False, sleep=lambda _: None, notices=feed)
    old.add(AGENT, "claude", scopes=RUN, ttl=TTL)
    for _ in range(3):
        old.turn()
    assert old.handover(AGENT, to="ghost").ok
    for _ in range(10):
        feed.send(AGENT, 1, "release")  # true or forged: a reason to look, never to take
        time.advance(0.2)
        old.turn()
        old.turn()
    view = old.coordinator.current_holder(AGENT)
    assert view is not None and (view.state, view.epoch) == (LeaseState.RELEASED, 1)


def test_the_policy_decides_as_for_the_successors_takeover_and_a_refusal_writes_nothing(
        ) -> None:
    rule = {"tenant_id": "acme", "logical_agent_id": "*", "binding_id": "*",
            "scopes": RUN, "max_lease_ttl": 60, "max_grant_ttl": 10}
    policy = StaticConnectorPolicy.from_dict({"rules": [
        {**rule, "connector_id": "claude"},
        {**rule, "connector_id": "codex", "max_lease_ttl": 5},  # no preempt_active: none
    ]})                                                         # is needed
    pair = Pair(policy)
    held = pair.old.lease(AGENT)
    rows = pair.audit_rows()
    denied = pair.old.handover(AGENT, to="nobody-allowed")
    assert (denied.ok, denied.reason, denied.lease) == (False, Reason.POLICY_DENIED, held)
    too_long = pair.old.handover(AGENT, to="codex")  # the binding's 10 s ttl is beyond 5 s
    assert (too_long.ok, too_long.reason) == (False, Reason.TTL_NOT_AUTHORIZED)
    assert pair.audit_rows() == rows
    assert pair.old.lease(AGENT) == held  # still held, grants still minted
    assert pair.old.issue_grant(AGENT, scopes=RUN, ttl=1).ok
    assert held is not None
    assert [c for c in pair.changes["claude"] if c.identity == AGENT] == [
        BindingStarted(AGENT, held)]


@pytest.mark.parametrize(("identity", "to", "drain", "field"), [
    (LeaseIdentity("acme", "unknown", "main"), "codex", 1.0, "identity"),
    (AGENT, "", 1.0, "to"),
    (AGENT, "x" * (MAX_SUCCESSOR + 1), 1.0, "to"),
    (AGENT, "claude", 1.0, "to"),
    (AGENT, 7, 1.0, "to"),
    (AGENT, "codex", -0.5, "drain"),
    (AGENT, "codex", 31.0, "drain"),
    (AGENT, "codex", float("nan"), "drain"),
    (AGENT, "codex", True, "drain"),
    (AGENT, "codex", "5", "drain"),
])
def test_bad_input_is_refused_and_writes_nothing(identity: LeaseIdentity, to: object,
                                                 drain: object, field: str) -> None:
    pair = Pair()
    held, rows = pair.old.lease(AGENT), pair.audit_rows()
    with pytest.raises(InvalidInput) as refused:
        pair.old.handover(identity, to=to, drain=drain)  # type: ignore[arg-type]
    assert refused.value.field == field
    assert pair.audit_rows() == rows and pair.old.lease(AGENT) == held
    assert [type(c) for c in pair.changes["claude"]] == [BindingStarted, BindingStarted]


def test_a_binding_not_held_here_is_refused() -> None:
    pair = Pair()
    with pytest.raises(InvalidInput, match="holds no lease here"):
        pair.new.handover(AGENT, to="claude")
    assert pair.old.handover(AGENT, to="codex").ok
    with pytest.raises(InvalidInput, match="holds no lease here"):  # handed over already
        pair.old.handover(AGENT, to="codex")


def test_in_a_fleet_only_the_preferred_member_may_be_named_and_others_do_not_race(
        ) -> None:
    time = Time()
    store = InMemoryLeaseStore(time.wall)
    changes: list[Change] = []
    member = Supervisor(ConnectorLeaseCoordinator(store, AllowAllPolicy()), clock=time,
                        background=False, sleep=lambda _: None, on_change=changes.append,
                        fleet=Fleet("edge", "m1", members=["m1", "m2"], ttl=TTL, grace=3,
                                    look=1))
    member.add(AGENT, "m1", scopes=RUN, ttl=TTL)
    for _ in range(12):
        member.turn()
        time.advance(0.25)
    held = member.lease(AGENT)
    assert held is not None
    with pytest.raises(InvalidInput, match="placement does not prefer"):
        member.handover(AGENT, to="m2")  # not live: the placement prefers m1
    with pytest.raises(InvalidInput, match="connector already"):
        member.handover(AGENT, to="m1")
    with pytest.raises(InvalidInput, match="own lease"):
        member.handover(member_identity("edge", "m1"), to="codex")
    assert member.handover(AGENT, to="codex").ok  # a connector outside the fleet
    assert changes[-1] == Moved(AGENT, held, "codex")
    status = member.fleet_status()
    assert status is not None and status.hand_offs == 1
    for _ in range(8):  # within the grace period the member leaves it to the successor
        time.advance(0.25)
        member.turn()
    view = member.coordinator.current_holder(AGENT)
    assert view is not None and (view.state, view.epoch) == (LeaseState.RELEASED, 1)


def test_the_asyncio_supervisor_hands_over_too() -> None:
    async def main() -> None:
        time = Time()
        store = AsyncInMemoryLeaseStore(InMemoryLeaseStore(time.wall))
        changes: list[Change] = []

        async def sleep(seconds: float) -> None:
            time.advance(seconds)

        old = AsyncSupervisor(AsyncConnectorLeaseCoordinator(store, AllowAllPolicy()),
                              clock=time, background=False, sleep=sleep,
                              on_change=changes.append)
        old.add(AGENT, "claude", scopes=RUN, ttl=TTL)
        for _ in range(3):
            await old.turn()
        held = old.lease(AGENT)
        assert (await old.issue_grant(AGENT, scopes=RUN, ttl=1)).ok
        result = await old.handover(AGENT, to="codex", drain=3)
        assert result.ok and result.drained == pytest.approx(1.0, abs=0.01)
        assert held is not None and changes[-1] == Moved(AGENT, held, "codex")
        with pytest.raises(InvalidInput):
            await old.handover(AGENT, to="codex")
        await old.close()

    asyncio.run(main())


def test_a_release_notice_after_one_that_came_during_a_read_is_acted_on_at_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A waiting successor whose read was in flight when a notice came plans a look
    ``max_backoff`` later; the release notice that follows within that time still moves its
    read to now (a confirming turn), instead of waiting for that look."""
    from tests.core.test_supervisor import SCOPES, ident
    from tests.core.test_supervisor_notices import NoticeRig, eventually

    rig = NoticeRig()
    rival = ConnectorLeaseCoordinator(rig.store, AllowAllPolicy())
    theirs = rival.acquire(ident(0), "gw-b", scopes=SCOPES, ttl=300).lease
    assert theirs is not None
    rig.add(1, max_backoff=3)
    rig.settle()  # read: waiting it out to its expiry
    rig.time.advance(4)
    read = rig.coordinator.current_holders

    def read_while_a_notice_comes(identities: list[LeaseIdentity]) -> object:
        rig.feed.send(ident(0), 1, "takeover")  # the read in flight may predate a change
        return read(identities)

    monkeypatch.setattr(rig.coordinator, "current_holders", read_while_a_notice_comes)
    rig.feed.send(ident(0), 1, "takeover")  # a reason to look: the read is moved to now
    rig.settle()
    monkeypatch.setattr(rig.coordinator, "current_holders", read)
    assert not rig.of(BindingStarted)
    rig.time.advance(1)  # less than max_backoff after that read
    assert rival.release(theirs).ok
    rig.feed.send(ident(0), 1, "release")
    slot = rig.supervisor._core.schedule.slots[ident(0)]
    eventually(lambda: slot.try_at == rig.time.mono, timeout=2.0)
    rig.settle()
    [started] = rig.of(BindingStarted, ident(0))
    assert started.lease.epoch == 2


def test_a_fleet_hand_off_gives_the_grants_in_flight_until_they_expire() -> None:
    """When the placement moves bindings to a member that joins, those with a grant in
    flight stop minting at once and are released once it has expired (at most the drain
    bound); the others move at once."""
    from tests.core.test_fleet_supervisor import BINDINGS, Fleetrun
    from tests.fleet_check import active_holder

    run = Fleetrun()
    m1 = run.start("m1")
    run.run(3)
    granted = BINDINGS[:30]
    for binding in granted:
        assert m1.issue_grant(binding, scopes=RUN, ttl=2.5).ok
    expires = run.time() + 2.5
    run.start("m2")
    run.run(1.5)
    placement = m1._core.schedule.fleet.placement  # type: ignore[union-attr]
    leaving = [b for b in BINDINGS if placement.preferred(b) == "m2"]
    draining = [b for b in leaving if b in granted]
    assert draining and len(draining) < len(leaving)
    now = run.time.wall.now()
    for binding in leaving:
        holder = active_holder(run.store, binding, now)
        assert holder == ("m1" if binding in draining else "m2"), binding
    assert all(m1.lease(b) is None for b in draining)  # no new grant while they drain
    assert run.time() < expires
    run.run(2.5)
    now = run.time.wall.now()
    assert all(active_holder(run.store, b, now) == "m2" for b in leaving)
    moved = {m.identity for m in run.moved("m1")}
    assert moved == set(leaving)
    run.check_safety()
