"""The batched acquire, takeover, release and holder read on the in-memory store: each item
judged by the policy and the write's guard as its single call is, audited on its own, the
writes of a batch in one store call, and a batch whose commit outcome was lost reconciled
item by item by the ids made before it was sent."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from datetime import timedelta
from typing import Any
from uuid import UUID, uuid4

import attrs
import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    ConnectorLeaseCoordinator,
    LeaseIdentity,
)
from mos_lease.errors import CommitOutcomeUnknown, InvalidInput, StoreUnavailable
from mos_lease.events import StoreCall
from mos_lease.identity import MAX_EPOCH
from mos_lease.machine import ALLOW, PolicyVerdict, Rotate, Write
from mos_lease.policy import PolicyRequest
from mos_lease.records import AuditEntry, Snapshot, WriteOutcome
from mos_lease.testing import run_store_contract
from mos_lease.vocabulary import LeaseState, LifecycleEvent, Outcome, Reason
from mos_lease_memory import AsyncInMemoryLeaseStore, InMemoryLeaseStore, MemoryHarness
from tests.helpers import SCOPES, expire, make_env, put_row, row_of

KEYS = [LeaseIdentity("acme", "agent-1", f"binding-{i}") for i in range(6)]


class Calls:
    def __init__(self) -> None:
        self.events: list[StoreCall] = []

    def __call__(self, event: object) -> None:
        if isinstance(event, StoreCall):
            self.events.append(event)

    def take(self) -> list[tuple[str, int]]:
        taken = [(e.operation, e.batch_size) for e in self.events]
        self.events.clear()
        return taken


class NotOnOdd:
    """Allows everything but any lifecycle event on an odd binding number."""

    def authorize(self, request: PolicyRequest) -> PolicyVerdict:
        if int(request.identity.binding_id.rsplit("-", 1)[1]) % 2:
            return PolicyVerdict(False, Reason.POLICY_DENIED)
        return ALLOW


def test_the_policy_judges_each_item_and_a_denied_one_is_audited_and_never_written() -> None:
    calls = Calls()
    env = make_env(NotOnOdd(), on_event=calls)
    results = env.coordinator.acquire_many(KEYS, "conn-a", scopes=SCOPES, ttl=10)
    assert [(r.outcome, r.reason) for r in results] == [
        (Outcome.ACQUIRED, None) if i % 2 == 0 else
        (Outcome.DENIED, Reason.POLICY_DENIED) for i in range(6)]
    # The denials are appended as a single acquire's are; the writes go in one call.
    assert calls.take() == [("record", 1)] * 3 + [("acquire_many", 3)]
    for i, key in enumerate(KEYS):
        assert (env.store.load(key).row is not None) == (i % 2 == 0)
        [record] = env.store.audit(key)
        assert record.entry.event is LifecycleEvent.ACQUIRE
        assert record.entry.reason is (None if i % 2 == 0 else Reason.POLICY_DENIED)


def test_a_mixed_takeover_batch_gives_each_item_its_own_reason() -> None:
    calls = Calls()
    env = make_env(on_event=calls)
    held = env.coordinator.acquire_many(KEYS[:5], "conn-a", scopes=SCOPES, ttl=10)
    assert env.coordinator.release(held[1].lease).ok  # type: ignore[arg-type]
    row = row_of(env.store, KEYS[3])
    put_row(env.store, attrs.evolve(row, epoch=MAX_EPOCH))
    calls.take()
    results = env.coordinator.takeover_many(
        [(KEYS[0], 1), (KEYS[1], 1), (KEYS[2], 2), (KEYS[3], MAX_EPOCH), (KEYS[5], 1)],
        "conn-b", scopes=SCOPES, ttl=10)
    assert [(r.outcome, r.reason) for r in results] == [
        (Outcome.TAKEN_OVER, None), (Outcome.TAKEN_OVER, None),
        (Outcome.DENIED, Reason.EPOCH_MISMATCH), (Outcome.DENIED, Reason.EPOCH_EXHAUSTED),
        (Outcome.DENIED, Reason.LEASE_MISSING)]
    assert calls.take() == [("load_many", 5), ("record", 1), ("record", 1), ("record", 1),
                            ("takeover_many", 2)]
    assert [r.current_epoch for r in results[:2]] == [2, 2]
    assert row_of(env.store, KEYS[2]).epoch == 1


def test_a_release_batch_matches_every_field_of_each_lease() -> None:
    env = make_env()
    leases = [r.lease for r in env.coordinator.acquire_many(KEYS[:3], "conn-a", scopes=SCOPES,
                                                             ttl=10) if r.lease is not None]
    assert len(leases) == 3
    leases[2] = attrs.evolve(leases[2], lease_id=uuid4())  # another lease of that binding
    results = env.coordinator.release_many(leases)
    assert [r.reason for r in results] == [None, None, Reason.LEASE_REPLACED]
    assert [row_of(env.store, k).released_at is not None for k in KEYS[:3]] == [
        True, True, False]
    assert [row_of(env.store, k).epoch for k in KEYS[:3]] == [1, 1, 1]
    again = env.coordinator.release_many(leases[:1])
    assert again[0].reason is Reason.LEASE_RELEASED
    held = env.coordinator.acquire(KEYS[4], "conn-a", scopes=SCOPES, ttl=10).lease
    assert held is not None
    expire(env, held)
    assert env.coordinator.release_many([held])[0].reason is Reason.LEASE_EXPIRED


def test_current_holders_reads_every_binding_at_once_without_auditing() -> None:
    calls = Calls()
    env = make_env(on_event=calls)
    env.coordinator.acquire_many(KEYS[:2], "conn-a", scopes=SCOPES, ttl=10,
                                 metadata={"endpoint": "gw-1"})
    calls.take()
    views = env.coordinator.current_holders([KEYS[1], KEYS[4], KEYS[0]])
    assert calls.take() == [("load_many", 3)]
    assert views[1] is None
    assert [v.state if v else None for v in views] == [LeaseState.ACTIVE, None,
                                                       LeaseState.ACTIVE]
    assert views[0] is not None and views[0].metadata == {"endpoint": "gw-1"}
    assert len(env.store.audit()) == 2  # the acquires only
    assert env.coordinator.current_holders([]) == []
    assert calls.take() == []


class LosingStore:
    """The in-memory store whose batch writes lose their commit outcome: applied and then
    lost (``after``), or lost before anything was applied (``before``)."""

    def __init__(self, inner: InMemoryLeaseStore, when: str) -> None:
        self.inner = inner
        self.when = when
        self.batches = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def load(self, identity: LeaseIdentity) -> Snapshot:
        return self.inner.load(identity)

    def _lose(self, method: str, items: Sequence[tuple[Write, AuditEntry]]
              ) -> list[WriteOutcome]:
        self.batches += 1
        if self.when == "after":
            getattr(self.inner, method)(items)
        raise CommitOutcomeUnknown(items[0][1].event_id, "connection dropped")

    def acquire_many(self, items: Sequence[tuple[Write, AuditEntry]]) -> list[WriteOutcome]:
        return self._lose("acquire_many", items)

    def takeover_many(self, items: Sequence[tuple[Write, AuditEntry]]) -> list[WriteOutcome]:
        return self._lose("takeover_many", items)


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_lost_batch_is_reconciled_item_by_item_by_its_own_ids(when: str) -> None:
    env = make_env()
    env.coordinator.acquire_many(KEYS[:3], "conn-a", scopes=SCOPES, ttl=10)
    losing = LosingStore(env.store, when)
    gateway = ConnectorLeaseCoordinator(losing, AllowAllPolicy(), id_source=env.ids)
    views = gateway.current_holders(KEYS[:3])
    results = gateway.takeover_many([(k, 1) for k in KEYS[:3]], "conn-b", scopes=SCOPES,
                                    ttl=10, observed=views)
    assert losing.batches == 1
    assert all(r.outcome is Outcome.TAKEN_OVER and r.current_epoch == 2 for r in results)
    for key, result in zip(KEYS[:3], results, strict=True):
        row = row_of(env.store, key)
        assert result.lease is not None and row.lease_id == result.lease.lease_id
        assert row.epoch == 2  # never twice
        taken = [r for r in env.store.audit(key) if r.entry.outcome is Outcome.TAKEN_OVER]
        assert len(taken) == 1
    # Applied and lost: recognized as ours (reconciled); lost before: written once more,
    # one by one.
    assert all(r.reconciled for r in results) == (when == "after")


def test_bad_batches_raise_and_write_nothing() -> None:
    env = make_env()
    view = env.coordinator.current_holders([KEYS[0]])
    with pytest.raises(InvalidInput, match="twice"):
        env.coordinator.takeover_many([(KEYS[0], 1), (KEYS[0], 2)], "c", scopes=SCOPES,
                                      ttl=10)
    with pytest.raises(InvalidInput, match="one per target"):
        env.coordinator.takeover_many([(KEYS[0], 1), (KEYS[1], 1)], "c", scopes=SCOPES,
                                      ttl=10, observed=view)
    other = make_env()
    other.coordinator.acquire(KEYS[0], "c", scopes=SCOPES, ttl=10)
    foreign = other.coordinator.current_holders([KEYS[0]])
    with pytest.raises(InvalidInput, match="observed"):
        env.coordinator.takeover_many([(KEYS[0], 1)], "c", scopes=SCOPES, ttl=10,
                                      observed=foreign)
    with pytest.raises(InvalidInput, match="expected_epoch"):
        env.coordinator.takeover_many([(KEYS[0], 0)], "c", scopes=SCOPES, ttl=10)
    with pytest.raises(InvalidInput, match="at most 1000"):
        env.coordinator.acquire_many([LeaseIdentity("t", "a", f"b{i}") for i in range(1001)],
                                     "c", scopes=SCOPES, ttl=10)
    with pytest.raises(InvalidInput, match="ttl"):
        env.coordinator.acquire_many(KEYS, "c", scopes=SCOPES, ttl=timedelta(hours=2))
    assert env.store.leases() == [] and env.store.audit() == []


def test_the_asyncio_coordinator_runs_the_same_batches() -> None:
    async def scenario() -> list[Outcome]:
        gateway = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(), AllowAllPolicy())
        first = await gateway.acquire_many(KEYS[:3], "conn-a", scopes=SCOPES, ttl=10)
        views = await gateway.current_holders(KEYS[:3])
        taken = await gateway.takeover_many([(k, 1) for k in KEYS[:3]], "conn-b",
                                            scopes=SCOPES, ttl=10, observed=views)
        released = await gateway.release_many([r.lease for r in taken if r.lease])
        return [r.outcome for r in (*first, *taken, *released)]

    assert asyncio.run(scenario()) == ([Outcome.ACQUIRED] * 3 + [Outcome.TAKEN_OVER] * 3
                                       + [Outcome.RELEASED] * 3)


class Preempting(InMemoryLeaseStore):
    """A planted flaw: its batched takeover replaces an active lease unasked."""

    def takeover_many(self, items: Sequence[tuple[Rotate, AuditEntry]]) -> list[WriteOutcome]:
        return super().takeover_many([(attrs.evolve(write, preempt_active=True), entry)
                                      for write, entry in items])


class PreemptingHarness(MemoryHarness):
    def __init__(self) -> None:
        super().__init__()
        self._store = Preempting(self.clock)


def test_the_kit_checks_each_item_of_a_batch() -> None:
    run_store_contract(MemoryHarness, steps=20)
    with pytest.raises(AssertionError, match="takeover_many"):
        run_store_contract(PreemptingHarness, steps=20)


class SingleCallsOnly:
    """A store without the optional batch methods (``apply`` and ``load`` only), whose
    ``apply`` fails after ``fail_after`` writes."""

    def __init__(self, inner: InMemoryLeaseStore, fail_after: int | None = None) -> None:
        self.inner = inner
        self.fail_after = fail_after
        self.applied = 0

    def load(self, identity: LeaseIdentity) -> Snapshot:
        return self.inner.load(identity)

    def apply(self, write: Write, entry: AuditEntry) -> WriteOutcome:
        if self.fail_after is not None and self.applied >= self.fail_after:
            self.fail_after = None
            raise StoreUnavailable("connection refused")
        self.applied += 1
        return self.inner.apply(write, entry)

    def renew_many(self, items: Sequence[tuple[Write, AuditEntry]]) -> list[WriteOutcome]:
        return [self.apply(write, entry) for write, entry in items]

    def record(self, entry: AuditEntry) -> None:
        self.inner.record(entry)

    def event_committed(self, event_id: UUID) -> bool:
        return self.inner.event_committed(event_id)


def test_a_store_without_batch_methods_gets_the_single_calls() -> None:
    calls = Calls()
    inner = InMemoryLeaseStore()
    gateway = ConnectorLeaseCoordinator(SingleCallsOnly(inner), AllowAllPolicy(),
                                        on_event=calls)
    results = gateway.acquire_many(KEYS[:3], "conn-a", scopes=SCOPES, ttl=10)
    assert all(r.outcome is Outcome.ACQUIRED for r in results)
    views = gateway.current_holders(KEYS[:3])
    assert [v.epoch if v else None for v in views] == [1, 1, 1]
    assert [name for name, _ in calls.take()] == ["acquire_many", "load_many"]
    assert [r.entry.outcome for r in inner.audit()] == [Outcome.ACQUIRED] * 3


def test_a_batch_of_single_calls_cut_short_is_settled_item_by_item() -> None:
    """The second write fails: the first is committed, so the batch's outcome is unknown
    (never "nothing happened"), and each item is reconciled: none is written twice."""
    inner = InMemoryLeaseStore()
    gateway = ConnectorLeaseCoordinator(SingleCallsOnly(inner, fail_after=1),
                                        AllowAllPolicy())
    results = gateway.acquire_many(KEYS[:3], "conn-a", scopes=SCOPES, ttl=10)
    assert all(r.outcome is Outcome.ACQUIRED for r in results)
    assert results[0].reconciled
    assert len(inner.audit()) == 3
