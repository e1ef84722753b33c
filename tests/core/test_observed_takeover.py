"""A takeover that acts on the holder view the coordinator just returned: one round trip,
the policy told the same facts, and nothing but a view this coordinator issued accepted."""

from __future__ import annotations

import gc
from datetime import timedelta

import attrs
import pytest

from mos_lease import (
    ConnectorLeaseCoordinator,
    InvalidInput,
    Outcome,
    PolicyRequest,
    PolicyVerdict,
    Reason,
)
from mos_lease.machine import ALLOW
from mos_lease.vocabulary import LeaseState
from tests.helpers import (
    IDENT,
    OTHER_IDENT,
    SCOPES,
    CountingIds,
    FaultyStore,
    expire,
    make_env,
    put_row,
    row_of,
)


class RecordingPolicy:
    def __init__(self) -> None:
        self.requests: list[PolicyRequest] = []

    def authorize(self, request: PolicyRequest) -> PolicyVerdict:
        self.requests.append(request)
        return ALLOW


def _rig() -> tuple[ConnectorLeaseCoordinator, FaultyStore, RecordingPolicy, object]:
    env = make_env()
    store = FaultyStore(env.store)
    policy = RecordingPolicy()
    coordinator = ConnectorLeaseCoordinator(store, policy, id_source=CountingIds())
    return coordinator, store, policy, env


def test_a_takeover_on_the_current_holder_view_reads_nothing_more() -> None:
    coordinator, store, policy, _ = _rig()
    assert coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=60).ok
    view = coordinator.current_holder(IDENT)
    assert view is not None and view.state is LeaseState.ACTIVE
    loads = store.loads
    taken = coordinator.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=60, expected_epoch=1,
                                 observed=view)
    assert taken.outcome is Outcome.TAKEN_OVER and taken.lease is not None
    assert taken.lease.epoch == 2
    assert store.loads == loads  # the write was the only store call
    told = policy.requests[-1]
    assert (told.current_state, told.current_connector_id) == (LeaseState.ACTIVE, "conn-a")


def test_without_a_view_the_takeover_reads_first() -> None:
    coordinator, store, policy, _ = _rig()
    assert coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=60).ok
    loads = store.loads
    assert coordinator.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=60, expected_epoch=1).ok
    assert store.loads == loads + 1
    assert policy.requests[-1].current_connector_id == "conn-a"


def test_a_refused_acquire_carries_the_view_a_takeover_can_use() -> None:
    env = make_env()
    held = env.acquire(ttl=10)
    refused = env.coordinator.acquire(IDENT, "conn-b", scopes=SCOPES, ttl=10)
    assert refused.reason is Reason.LEASE_HELD and refused.holder is not None
    assert (refused.holder.connector_id, refused.holder.epoch) == ("conn-a", held.epoch)
    assert refused.holder.state is LeaseState.ACTIVE
    expire(env, held)
    refused = env.coordinator.acquire(IDENT, "conn-b", scopes=SCOPES, ttl=10)
    assert refused.reason is Reason.TAKEOVER_REQUIRED and refused.holder is not None
    assert refused.holder.state is LeaseState.EXPIRED
    taken = env.coordinator.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=10,
                                     expected_epoch=refused.holder.epoch,
                                     observed=refused.holder)
    assert taken.outcome is Outcome.TAKEN_OVER


def test_a_policy_refusal_reveals_no_holder() -> None:
    env = make_env(policy=None)  # deny-all
    result = env.coordinator.acquire(IDENT, "conn-b", scopes=SCOPES, ttl=10)
    assert result.reason is Reason.POLICY_DENIED
    assert result.holder is None and result.current_epoch is None


def test_a_view_outdated_by_another_takeover_is_refused_by_the_write() -> None:
    env = make_env()
    env.acquire()
    view = env.coordinator.current_holder(IDENT)
    assert view is not None
    assert env.coordinator.takeover(IDENT, "conn-c", scopes=SCOPES, ttl=60,
                                    expected_epoch=1).ok
    late = env.coordinator.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=60, expected_epoch=1,
                                    observed=view)
    assert late.reason is Reason.EPOCH_MISMATCH and late.current_epoch == 2


def test_an_active_lease_seen_expired_is_not_preempted_on_that_word() -> None:
    """The view said expired (it was, at its read): the takeover asks no preemption, so the
    write's guard refuses it should the lease be active after all."""
    env = make_env()
    held = env.acquire(ttl=10)
    expire(env, held)
    refused = env.coordinator.acquire(IDENT, "conn-b", scopes=SCOPES, ttl=10)
    assert refused.holder is not None and refused.holder.state is LeaseState.EXPIRED
    # The store now finds the lease active (as after a step back of the database clock).
    row = row_of(env.store)
    put_row(env.store, attrs.evolve(row, expires_at=env.clock.now() + timedelta(seconds=5)))
    taken = env.coordinator.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=10,
                                     expected_epoch=refused.holder.epoch,
                                     observed=refused.holder)
    assert taken.reason is Reason.PREEMPTION_DENIED


@pytest.mark.parametrize("change", ["copy", "connector", "state"])
def test_a_view_built_or_altered_by_hand_is_refused_and_writes_nothing(change: str) -> None:
    env = make_env()
    env.acquire()
    view = env.coordinator.current_holder(IDENT)
    assert view is not None
    forged = {"copy": attrs.evolve(view),
              "connector": attrs.evolve(view, connector_id="friendly"),
              "state": attrs.evolve(view, state=LeaseState.EXPIRED)}[change]
    before = env.state()
    with pytest.raises(InvalidInput, match="observed: must be a HolderView this coordinator"):
        env.coordinator.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=60, expected_epoch=1,
                                 observed=forged)
    assert env.state() == before


def test_a_view_from_another_coordinator_or_identity_or_epoch_is_refused() -> None:
    env = make_env()
    env.acquire()
    env.acquire(OTHER_IDENT)
    other_gateway = env.restart()
    foreign = other_gateway.current_holder(IDENT)
    mine_for_other = env.coordinator.current_holder(OTHER_IDENT)
    mine = env.coordinator.current_holder(IDENT)
    assert foreign is not None and mine_for_other is not None and mine is not None
    before = env.state()
    for view in (foreign, mine_for_other):
        with pytest.raises(InvalidInput, match="returned for this identity"):
            env.coordinator.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=60,
                                     expected_epoch=1, observed=view)
    with pytest.raises(InvalidInput, match="shows epoch 1, not expected_epoch 2"):
        env.coordinator.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=60, expected_epoch=2,
                                 observed=mine)
    with pytest.raises(InvalidInput, match="must be a HolderView, not dict"):
        env.coordinator.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=60, expected_epoch=1,
                                 observed={"epoch": 1})  # type: ignore[arg-type]
    assert env.state() == before


def test_the_coordinator_forgets_views_nobody_holds() -> None:
    env = make_env()
    env.acquire()
    for _ in range(1000):
        assert env.coordinator.current_holder(IDENT) is not None
    gc.collect()
    assert len(env.coordinator._flows.views) <= 1
