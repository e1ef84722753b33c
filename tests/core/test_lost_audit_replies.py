"""An audit row that changes no lease (a refusal's, a grant issue's) whose reply was lost is
sent once more, and the caller gets its refusal or its grant; reconcile answers whether a
write took effect, not whether a row with its event id exists (a refusal's row carries the
event id of the write it refused)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from uuid import UUID

import pytest

from mos_lease import (
    AllowAllPolicy,
    AsyncConnectorLeaseCoordinator,
    CommitOutcomeUnknown,
    ConnectorLeaseCoordinator,
    LeaseHandle,
    LeaseResult,
    Outcome,
    Reason,
    StoreUnavailable,
)
from mos_lease.clock import ManualClock
from mos_lease.ids import uuid7
from mos_lease.machine import PolicyVerdict
from mos_lease.policy import PolicyRequest
from mos_lease.reconciliation import took_effect
from mos_lease.records import AuditEntry, AuditRecord
from mos_lease.vocabulary import LifecycleEvent
from mos_lease_memory import AsyncInMemoryLeaseStore, InMemoryLeaseStore
from tests.helpers import IDENT, SCOPES, START, CountingIds


class LosingRecords(InMemoryLeaseStore):
    """The in-memory store whose next ``record`` calls lose their reply: ``"after"`` the
    entry was appended (it committed) or ``"before"`` (it did not); ``"down"`` raises
    ``StoreUnavailable`` (nothing was sent)."""

    def __init__(self) -> None:
        super().__init__(ManualClock(START))
        self.faults: list[str] = []
        self.records = 0

    def record(self, entry: AuditEntry) -> None:
        self.records += 1
        fault = self.faults.pop(0) if self.faults else None
        if fault == "down":
            raise StoreUnavailable("record: connection refused")
        if fault == "before":
            raise CommitOutcomeUnknown(entry.event_id, "connection lost before the commit")
        super().record(entry)
        if fault == "after":
            raise CommitOutcomeUnknown(entry.event_id, "connection lost after the commit")


class DenyHeartbeats(AllowAllPolicy):
    def authorize(self, request: PolicyRequest) -> PolicyVerdict:
        if request.event is LifecycleEvent.HEARTBEAT:
            return PolicyVerdict(False, Reason.POLICY_DENIED)
        return super().authorize(request)


def _setup() -> tuple[LosingRecords, ConnectorLeaseCoordinator, LeaseHandle]:
    store = LosingRecords()
    coordinator = ConnectorLeaseCoordinator(store, AllowAllPolicy(), id_source=CountingIds())
    first = coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=60)
    assert first.lease is not None
    return store, coordinator, first.lease


def _rows_of(store: InMemoryLeaseStore, event: LifecycleEvent) -> list[AuditRecord]:
    return [r for r in store.audit(IDENT, limit=1000) if r.entry.event is event]


# Each refused lifecycle operation, with the lease held by conn-a at epoch 1.
REFUSALS: dict[str, tuple[LifecycleEvent, Reason]] = {
    "acquire": (LifecycleEvent.ACQUIRE, Reason.LEASE_HELD),
    "takeover": (LifecycleEvent.TAKEOVER, Reason.EPOCH_MISMATCH),
    "heartbeat": (LifecycleEvent.HEARTBEAT, Reason.LEASE_REPLACED),
    "release": (LifecycleEvent.RELEASE, Reason.LEASE_REPLACED),
}


def _refused(name: str, coordinator: ConnectorLeaseCoordinator,
             lease: LeaseHandle) -> Callable[[], LeaseResult]:
    forged = LeaseHandle(lease.identity, "conn-b", lease.lease_id, lease.epoch, lease.scopes,
                         lease.expires_at)  # another connector: never the holder
    if name == "acquire":
        return lambda: coordinator.acquire(IDENT, "conn-b", scopes=SCOPES, ttl=60)
    if name == "takeover":
        return lambda: coordinator.takeover(IDENT, "conn-b", scopes=SCOPES, ttl=60,
                                            expected_epoch=7)
    if name == "heartbeat":
        return lambda: coordinator.heartbeat(forged, ttl=60)
    return lambda: coordinator.release(forged)


@pytest.mark.parametrize("fault", ["after", "before"])
@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_a_refusal_whose_audit_reply_was_lost_is_returned(name: str, fault: str) -> None:
    store, coordinator, lease = _setup()
    operation = _refused(name, coordinator, lease)
    event, reason = REFUSALS[name]
    store.faults = [fault]
    result = operation()  # not CommitOutcomeUnknown: the append was sent once more
    assert (result.outcome, result.reason) == (Outcome.DENIED, reason)
    assert store.records == 2
    denials = [r for r in _rows_of(store, event) if r.entry.outcome is Outcome.DENIED]
    assert [r.entry.reason for r in denials] == [reason]  # exactly one row, either way
    # The refused write did not happen, and reconcile says so from the refusal's row.
    assert not coordinator.reconcile(IDENT, denials[0].entry.event_id)


@pytest.mark.parametrize("fault", ["after", "before"])
def test_a_grant_whose_audit_reply_was_lost_is_issued_once(fault: str) -> None:
    store, coordinator, lease = _setup()
    store.faults = [fault]
    issued = coordinator.issue_grant(lease, scopes=["tool:run"], ttl=10)
    assert issued.outcome is Outcome.GRANT_ISSUED and issued.grant is not None
    rows = _rows_of(store, LifecycleEvent.GRANT_ISSUE)
    assert [r.entry.outcome for r in rows] == [Outcome.GRANT_ISSUED]
    assert coordinator.reconcile(IDENT, rows[0].entry.event_id)
    assert coordinator.validate(issued.grant, identity=IDENT, scopes=["tool:run"]).ok


@pytest.mark.parametrize("second", ["after", "before", "down"])
def test_a_grant_whose_audit_stays_unknown_is_never_handed_out(second: str) -> None:
    store, coordinator, lease = _setup()
    store.faults = ["after", second]
    with pytest.raises(CommitOutcomeUnknown) as unknown:
        coordinator.issue_grant(lease, scopes=["tool:run"], ttl=10)
    assert store.records == 2  # once more, not in a loop
    assert coordinator.live_grants == 0  # no grant exists whose audit row is not known
    # Its row did commit (the first attempt): reconcile says the grant issue took effect.
    assert coordinator.reconcile(IDENT, unknown.value.event_id)


def test_a_refusal_whose_audit_stays_unknown_raises_and_reconciles_as_not_committed() -> None:
    store, coordinator, lease = _setup()
    operation = _refused("acquire", coordinator, lease)
    store.faults = ["after", "after"]
    with pytest.raises(CommitOutcomeUnknown) as unknown:
        operation()
    assert store.records == 2
    # The refusal's row is in the log under the acquire's event id, once; the acquire
    # itself never happened, which is what reconcile answers.
    denials = [r for r in _rows_of(store, LifecycleEvent.ACQUIRE)
               if r.entry.event_id == unknown.value.event_id]
    assert [r.entry.outcome for r in denials] == [Outcome.DENIED]
    assert not coordinator.reconcile(IDENT, unknown.value.event_id)


def test_a_store_that_cannot_be_reached_is_not_retried() -> None:
    store, coordinator, lease = _setup()
    store.faults = ["down"]
    with pytest.raises(StoreUnavailable):
        _refused("acquire", coordinator, lease)()
    assert store.records == 1  # nothing was sent: nothing is unknown


def test_a_refused_heartbeat_reconciles_as_not_committed() -> None:
    """No fault at all: the refusal's row carries the heartbeat's event id, and reconcile of
    that id must not say the heartbeat happened."""
    store, coordinator, lease = _setup()
    store.clock.advance(timedelta(seconds=61))  # type: ignore[attr-defined]
    refused = coordinator.heartbeat(lease, ttl=60)
    assert refused.reason is Reason.LEASE_EXPIRED
    (row,) = _rows_of(store, LifecycleEvent.HEARTBEAT)
    assert row.entry.outcome is Outcome.DENIED
    assert not coordinator.reconcile(IDENT, row.entry.event_id)
    assert not coordinator.reconcile(IDENT, UUID(int=7))


def test_a_batch_denial_whose_audit_reply_was_lost_is_returned() -> None:
    store = LosingRecords()
    coordinator = ConnectorLeaseCoordinator(store, DenyHeartbeats(), id_source=CountingIds())
    first = coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=60)
    assert first.lease is not None
    store.faults = ["after"]
    (result,) = coordinator.heartbeat_many([first.lease], ttl=60)
    assert result.reason is Reason.POLICY_DENIED
    assert [r.entry.outcome for r in _rows_of(store, LifecycleEvent.HEARTBEAT)] == [
        Outcome.DENIED]


def test_the_asyncio_coordinator_returns_the_refusal_too() -> None:
    store = LosingRecords()
    coordinator = AsyncConnectorLeaseCoordinator(AsyncInMemoryLeaseStore(store),
                                                 AllowAllPolicy(), id_source=CountingIds())

    async def scenario() -> LeaseResult:
        assert (await coordinator.acquire(IDENT, "conn-a", scopes=SCOPES, ttl=60)).ok
        store.faults = ["after"]
        return await coordinator.acquire(IDENT, "conn-b", scopes=SCOPES, ttl=60)

    result = asyncio.run(scenario())
    assert result.reason is Reason.LEASE_HELD
    assert len([r for r in _rows_of(store, LifecycleEvent.ACQUIRE)
                if r.entry.outcome is Outcome.DENIED]) == 1


def test_the_spec_table_of_reconciling_matches_took_effect() -> None:
    spec = Path(__file__).resolve().parents[2] / "specs" / "transitions.md"
    section = spec.read_text().split("## Reconciling an event id", 1)[1].split("\n## ", 1)[0]
    rows = [[cell.strip() for cell in line.strip().strip("|").split("|")]
            for line in section.splitlines() if line.startswith("|")][2:]
    assert [row[0] for row in rows] == ["none", "outcome `denied`", "any other outcome"]
    store = InMemoryLeaseStore(ManualClock(START))
    assert store.event_committed(UUID(int=1)) is (rows[0][1] == "yes")
    for outcome in Outcome:
        entry = AuditEntry(uuid7(), LifecycleEvent.ACQUIRE, outcome,
                           Reason.LEASE_HELD if outcome is Outcome.DENIED else None, IDENT,
                           "conn-a", None, "spec")
        row = rows[1] if outcome is Outcome.DENIED else rows[2]
        assert took_effect(entry) is (row[1] == "yes"), outcome
        store.record(entry)
        assert store.event_committed(entry.event_id) is took_effect(entry), outcome


def test_a_grant_renewal_whose_audit_reply_was_lost_hands_out_its_successor() -> None:
    store, coordinator, lease = _setup()
    issued = coordinator.issue_grant(lease, scopes=["tool:run"], ttl=10)
    assert issued.grant is not None
    store.faults = ["after"]
    renewed = coordinator.renew_grant(issued.grant, identity=IDENT, scopes=["tool:run"], ttl=10)
    assert renewed.grant is not None and renewed.context is not None
    assert store.records == 3  # the first grant's row, the successor's and its resend
    assert [r.entry.outcome for r in _rows_of(store, LifecycleEvent.GRANT_ISSUE)] == [
        Outcome.GRANT_ISSUED, Outcome.GRANT_ISSUED]
