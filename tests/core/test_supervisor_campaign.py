"""The campaign rule, written once (``mos_lease/keep/campaign.py``), and what the
supervisor does with it for one binding as ``hold()`` asks: a takeover policy per binding,
a wait after which the binding gives up with the last reason and holder view, and refusals
that waiting cannot change ending the wait at once. In-memory store, fake time, the thread
supervisor driven turn by turn."""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import pytest

from mos_lease import (
    AllowAllPolicy,
    ConnectorLeaseCoordinator,
    InvalidInput,
    LossCause,
    Reason,
    StaticConnectorPolicy,
)
from mos_lease.keep.campaign import ACQUIRE, next_try
from mos_lease.keeper import KeeperTiming, abandoned, held
from mos_lease.policy import ConnectorLeaseService
from mos_lease.results import HolderView
from mos_lease.supervisor import BindingStarted, GaveUp, NewHolder, Supervisor, TakeoverPolicy
from mos_lease.vocabulary import LeaseState, LifecycleEvent, Outcome
from tests.core.test_supervisor import SCOPES, Counting, Rig, _handle, ident
from tests.helpers import Time

RIVAL_TTL = 20.0


def _view(state: LeaseState, epoch: int = 4) -> HolderView:
    now = Time().wall.now()
    return HolderView("gw-b", epoch, state, now + timedelta(seconds=3), now)


@pytest.mark.parametrize(("seen", "policy", "refused", "expected"), [
    (None, TakeoverPolicy.NEVER, False, ACQUIRE),
    (None, TakeoverPolicy.EXPIRED, False, ACQUIRE),
    (_view(LeaseState.ACTIVE), TakeoverPolicy.EXPIRED, False, Reason.LEASE_HELD),
    (_view(LeaseState.ACTIVE), TakeoverPolicy.NEVER, False, Reason.LEASE_HELD),
    (_view(LeaseState.ACTIVE), TakeoverPolicy.PREEMPT, False, 4),
    (_view(LeaseState.ACTIVE), TakeoverPolicy.PREEMPT, True, Reason.LEASE_HELD),
    (_view(LeaseState.EXPIRED), TakeoverPolicy.NEVER, False, Reason.TAKEOVER_REQUIRED),
    (_view(LeaseState.RELEASED), TakeoverPolicy.NEVER, False, Reason.TAKEOVER_REQUIRED),
    (_view(LeaseState.EXPIRED), TakeoverPolicy.EXPIRED, False, 4),
    (_view(LeaseState.RELEASED), TakeoverPolicy.EXPIRED, False, 4),
    (_view(LeaseState.RELEASED), TakeoverPolicy.PREEMPT, True, 4),
])
def test_next_try(seen: HolderView | None, policy: TakeoverPolicy, refused: bool,
                  expected: object) -> None:
    assert next_try(seen, policy, refused) == expected


def _rig(policy: ConnectorLeaseService | None = None) -> Rig:
    rig = Rig()
    if policy is not None:
        rig.coordinator = ConnectorLeaseCoordinator(rig.store, policy,
                                                    monotonic_clock=rig.time)
        rig.supervisor = Supervisor(rig.coordinator, on_change=rig.changes.append,
                                    clock=rig.time, sleep=rig.sleeps.append,
                                    random=lambda: 0.5, background=False)
    return rig


def _rival(rig: Rig, ttl: float = RIVAL_TTL) -> None:
    rival = ConnectorLeaseCoordinator(rig.store, AllowAllPolicy())
    assert rival.acquire(ident(0), "gw-b", scopes=SCOPES, ttl=ttl).ok


def _add(rig: Rig, **options: Any) -> None:
    rig.supervisor.add(ident(0), "gw-a", scopes=SCOPES, ttl=30, **options)


def _writes(store: Counting) -> dict[str, int]:
    return {name: count for name, count in store.calls.items()
            if name in ("acquire_many", "takeover_many", "apply", "record")}


def _rules(preempt: bool, connector_id: str = "*") -> ConnectorLeaseService:
    return StaticConnectorPolicy.from_dict({"rules": [{
        "tenant_id": "acme", "logical_agent_id": "*", "binding_id": "*",
        "connector_id": connector_id, "scopes": list(SCOPES), "max_lease_ttl": 300,
        "max_grant_ttl": 30, "preempt_active": preempt}]})


def test_a_binding_waiting_for_an_active_lease_gives_up_when_its_wait_runs_out() -> None:
    rig = _rig()
    _rival(rig)
    rig.store.reset()
    _add(rig, wait=3)
    rig.run(2)
    assert rig.of(GaveUp) == []  # still waiting
    rig.run(2)
    [gave_up] = rig.of(GaveUp)
    assert gave_up.identity == ident(0)
    assert gave_up.reason is Reason.LEASE_HELD and gave_up.error is None
    assert gave_up.holder is not None
    assert (gave_up.holder.connector_id, gave_up.holder.epoch) == ("gw-b", 1)
    # Waiting is reading: no write was tried, and the binding is no longer run.
    assert _writes(rig.store) == {}
    assert rig.supervisor.bindings == []
    with pytest.raises(InvalidInput):
        rig.supervisor.lease(ident(0))


def test_wait_zero_is_one_look_and_the_try_it_calls_for() -> None:
    rig = _rig()
    _add(rig, wait=0)
    rig.settle()
    assert [type(c) for c in rig.changes] == [BindingStarted]
    busy = _rig()
    _rival(busy)
    _add(busy, wait=0)
    busy.settle()
    [gave_up] = busy.of(GaveUp)
    assert gave_up.reason is Reason.LEASE_HELD
    assert busy.of(BindingStarted) == []


def test_takeover_never_waits_at_a_released_lease_and_gives_up_with_takeover_required(
) -> None:
    rig = _rig()
    rival = ConnectorLeaseCoordinator(rig.store, AllowAllPolicy())
    held = rival.acquire(ident(0), "gw-b", scopes=SCOPES, ttl=RIVAL_TTL)
    assert held.ok and held.lease is not None
    assert rival.release(held.lease).ok
    rig.store.reset()
    _add(rig, takeover="never", wait=5)
    rig.run(6)
    [gave_up] = rig.of(GaveUp)
    assert gave_up.reason is Reason.TAKEOVER_REQUIRED
    assert gave_up.holder is not None and gave_up.holder.state is LeaseState.RELEASED
    assert _writes(rig.store) == {}
    # Under the default policy the same binding takes the released lease over at once.
    other = _rig()
    _rival(other, ttl=1)
    other.time.advance(2)
    _add(other, wait=5)
    other.settle()
    [started] = other.of(BindingStarted)
    assert started.lease.epoch == 2


def test_preempt_takes_an_active_lease_when_the_policy_allows() -> None:
    rig = _rig(_rules(preempt=True))
    _rival(rig)
    _add(rig, takeover=TakeoverPolicy.PREEMPT, wait=1)
    rig.settle()
    [started] = rig.of(BindingStarted)
    assert (started.lease.connector_id, started.lease.epoch) == ("gw-a", 2)
    assert [c.holder.connector_id for c in rig.of(NewHolder)] == ["gw-b"]


def test_preempt_refused_by_the_policy_waits_like_expired() -> None:
    rig = _rig(_rules(preempt=False))
    _rival(rig, ttl=5)
    _add(rig, takeover="preempt", wait=30)
    rig.run(8, step=0.25)
    [started] = rig.of(BindingStarted)
    assert started.lease.epoch == 2
    denied = [(r.entry.event, r.entry.reason) for r in rig.store.audit(limit=100)
              if r.entry.connector_id == "gw-a" and r.entry.outcome is Outcome.DENIED]
    # One refused preemption, then plain waiting until the rival's lease expired.
    assert denied == [(LifecycleEvent.TAKEOVER, Reason.PREEMPTION_DENIED)]
    assert rig.of(GaveUp) == []


def test_a_refusal_waiting_cannot_change_ends_the_wait_at_once() -> None:
    rig = _rig(_rules(preempt=False, connector_id="someone-else"))
    _add(rig, wait=float(7 * 24 * 3600))
    rig.settle()
    [gave_up] = rig.of(GaveUp)
    assert gave_up.reason is Reason.POLICY_DENIED
    assert rig.store.leases() == []
    # Without a wait the supervisor campaigns until removed, whatever is refused.
    again = _rig(_rules(preempt=False, connector_id="someone-else"))
    _add(again)
    again.run(5)
    assert again.of(GaveUp) == [] and again.supervisor.bindings == [ident(0)]


def test_a_binding_held_once_gives_up_on_a_final_refusal_even_without_a_wait() -> None:
    """hold() with ``wait=None`` waits without limit, but not for what waiting cannot
    change: its binding (held once) gives up at once on the policy's refusal."""
    rig = _rig(_rules(preempt=False, connector_id="someone-else"))
    _add(rig, once=True)
    rig.settle()
    [gave_up] = rig.of(GaveUp)
    assert gave_up.reason is Reason.POLICY_DENIED
    assert rig.store.leases() == [] and rig.supervisor.bindings == []


def test_a_ttl_above_the_coordinators_cap_is_refused_and_adds_nothing() -> None:
    rig = _rig()
    rig.coordinator = ConnectorLeaseCoordinator(rig.store, AllowAllPolicy(),
                                                monotonic_clock=rig.time, lease_ttl_cap=5)
    rig.supervisor = Supervisor(rig.coordinator, clock=rig.time, sleep=rig.sleeps.append,
                                background=False)
    with pytest.raises(InvalidInput, match="ttl"):
        _add(rig)  # ttl 30: every campaign call would be refused as bad input
    assert rig.supervisor.bindings == [] and rig.store.leases() == []


def test_a_store_outage_while_waiting_is_reported_with_the_last_error() -> None:
    rig = _rig()
    rig.store.down = True
    _add(rig, wait=2)
    rig.run(3)
    [gave_up] = rig.of(GaveUp)
    assert gave_up.reason is Reason.STORE_UNAVAILABLE
    assert gave_up.error is not None and "connection refused" in gave_up.error


def test_after_the_first_hold_a_loss_campaigns_again_without_a_wait() -> None:
    rig = _rig()
    _add(rig, wait=1)
    rig.settle()
    [held] = rig.of(BindingStarted)
    rival = ConnectorLeaseCoordinator(rig.store, AllowAllPolicy())
    assert rival.takeover(ident(0), "gw-b", scopes=SCOPES, ttl=5,
                          expected_epoch=held.lease.epoch).ok
    rig.run(15, step=0.25)
    assert rig.of(GaveUp) == []
    assert [c.lease.epoch for c in rig.of(BindingStarted)] == [1, 3]


@pytest.mark.parametrize(("field", "value"), [("takeover", "sometimes"), ("wait", -1),
                                              ("wait", True), ("wait", float("nan"))])
def test_bad_takeover_or_wait_is_refused_and_adds_nothing(field: str, value: object) -> None:
    rig = _rig()
    with pytest.raises(InvalidInput) as refused:
        _add(rig, **{field: value})
    assert refused.value.field == field
    assert rig.supervisor.bindings == []


# --- the overdue-heartbeat rule, one for the keeper and the supervisor ------------------------


def test_an_abandoned_renewal_is_lost_at_its_own_deadline_and_retried_before_it() -> None:
    """keep.timing.abandoned judges a renewal abandoned at its time limit: lost when that
    limit was the lease's own deadline (the keeper's case, and the earliest lease of a
    supervisor's batch) or the deadline has come, else retried as a transient failure (a
    lease whose batch was given up at another lease's earlier deadline)."""
    timing = KeeperTiming(30.0, clock_step=2.0)
    state = held(timing, _handle(ident(0)), started=100.0, draw=0.5)
    deadline = state.deadline  # 125.0
    # The limit was its own deadline: lost, even if the clock read a hair earlier.
    own = abandoned(state, timing, 110.0, deadline - 0.001, deadline, 0.5)
    assert own.loss is not None and own.loss.cause is LossCause.DEADLINE
    assert own.loss.reason is Reason.LEASE_EXPIRED
    assert own.loss.error == "heartbeat still running at the deadline"
    # Another lease's earlier deadline set the limit: retried, before its own deadline.
    other = abandoned(state, timing, 110.0, 120.0, 120.0, 0.5)
    assert other.loss is None and other.failures == 1
    assert other.last_error is not None and "abandoned" in other.last_error
    assert 120.0 < other.renew_at < deadline
    # A loss is final.
    assert abandoned(own, timing, 110.0, 130.0, 130.0, 0.5) is own


# --- one grant rule, for the keeper and the supervisor ----------------------------------------


def test_the_keeper_and_the_supervisor_mint_grants_by_one_rule(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Both grant through mos_lease.held_grant.issue_grant (the local deadline judged before
    and after the store call), each only saying what it holds; and the supervisor's grant
    module names no class like a machine command for it."""
    from mos_lease import held_grant
    from mos_lease.keep import granting
    from mos_lease.keeper import LeaseKeeper

    subjects: list[str] = []
    real = held_grant.issue_grant

    def spy(subject: Any, *args: Any) -> Any:
        subjects.append(type(subject).__module__)
        return real(subject, *args)

    monkeypatch.setattr(held_grant, "issue_grant", spy)
    rig = _rig()
    _add(rig)
    rig.settle()
    assert rig.supervisor.issue_grant(ident(0), scopes=SCOPES, ttl=5).ok
    keeper = LeaseKeeper(rig.coordinator, ttl=30, background=False, clock=rig.time)
    assert keeper.acquire(ident(1), "gw-a", scopes=SCOPES).ok
    assert keeper.issue_grant(scopes=SCOPES, ttl=5).ok
    assert subjects == ["mos_lease.keep.granting", "mos_lease.keep.thread_keeper"]
    assert not hasattr(granting, "IssueGrant")
