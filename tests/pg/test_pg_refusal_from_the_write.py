"""A refused guarded write names its refusal from the row it found, in the same statement:
no second read. The row is the newest version (the one the write judged after waiting for
its lock), so the reason and the holder it reports are the ones that beat it."""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any
from uuid import UUID, uuid4

import psycopg
import pytest

from mos_lease import AllowAllPolicy, ConnectorLeaseCoordinator, LeaseIdentity, Outcome, Reason
from mos_lease.ids import uuid7
from mos_lease.machine import Renew, Rotate, Write
from mos_lease.records import AuditEntry, Snapshot, WriteOutcome
from mos_lease.vocabulary import LeaseState, LifecycleEvent
from mos_lease_pg import PostgresLeaseStore, statements
from tests.pg_fixtures import StoreFactory

pytestmark = pytest.mark.pg

SCOPES = ["tool:read"]
WAIT_S = 10.0


class CountingStore:
    """A PostgreSQL store that counts the reads the coordinator asks of it."""

    def __init__(self, inner: PostgresLeaseStore) -> None:
        self.inner = inner
        self.loads = 0

    def load(self, identity: LeaseIdentity) -> Snapshot:
        self.loads += 1
        return self.inner.load(identity)

    def apply(self, write: Write, entry: AuditEntry) -> WriteOutcome:
        return self.inner.apply(write, entry)

    def renew_many(self, items: Sequence[tuple[Renew, AuditEntry]]) -> list[WriteOutcome]:
        return self.inner.renew_many(items)

    def record(self, entry: AuditEntry) -> None:
        self.inner.record(entry)

    def record_many(self, entries: Sequence[AuditEntry]) -> None:
        self.inner.record_many(entries)

    def event_committed(self, event_id: UUID) -> bool:
        return self.inner.event_committed(event_id)


def _identity() -> LeaseIdentity:
    return LeaseIdentity("refusal", "agent", uuid4().hex)


def _denials(store: PostgresLeaseStore, identity: LeaseIdentity) -> list[tuple[str, str | None]]:
    return [(r.entry.event.value, r.entry.reason and r.entry.reason.value)
            for r in store.audit(identity) if r.entry.outcome is Outcome.DENIED]


def test_a_lost_takeover_names_its_refusal_without_a_read(pg_stores: StoreFactory) -> None:
    store = pg_stores()
    counting = CountingStore(store)
    gateway = ConnectorLeaseCoordinator(counting, AllowAllPolicy())
    rival = ConnectorLeaseCoordinator(pg_stores(), AllowAllPolicy())
    identity = _identity()
    assert gateway.acquire(identity, "holder", scopes=SCOPES, ttl=30).ok
    view = gateway.current_holder(identity)
    assert view is not None
    assert rival.takeover(identity, "rival", scopes=SCOPES, ttl=30, expected_epoch=1).ok
    loads = counting.loads
    lost = gateway.takeover(identity, "late", scopes=SCOPES, ttl=30, expected_epoch=1,
                            observed=view)
    assert (lost.reason, lost.current_epoch) == (Reason.EPOCH_MISMATCH, 2)
    assert lost.holder is not None and lost.holder.connector_id == "rival"
    assert counting.loads == loads  # named from the failed write's own row
    assert ("takeover", "epoch_mismatch") in _denials(store, identity)


def test_a_refused_heartbeat_names_its_refusal_without_a_read(pg_stores: StoreFactory) -> None:
    store = pg_stores()
    counting = CountingStore(store)
    gateway = ConnectorLeaseCoordinator(counting, AllowAllPolicy())
    identity = _identity()
    held = gateway.acquire(identity, "holder", scopes=SCOPES, ttl=30).lease
    assert held is not None
    assert gateway.release(held).ok
    loads = counting.loads
    refused = gateway.heartbeat(held, ttl=30)
    assert refused.reason is Reason.LEASE_RELEASED and counting.loads == loads
    assert refused.holder is not None and refused.holder.state is LeaseState.RELEASED
    missing = gateway.heartbeat(
        type(held)(_identity(), held.connector_id, held.lease_id, held.epoch, held.scopes,
                   held.expires_at), ttl=30)
    assert missing.reason is Reason.LEASE_MISSING and counting.loads == loads


def test_a_write_that_waited_for_the_lock_reports_the_row_that_beat_it(
        pg_stores: StoreFactory, pg_dsn: str, pg_admin: psycopg.Connection[Any]) -> None:
    store = pg_stores()
    counting = CountingStore(store)
    gateway = ConnectorLeaseCoordinator(counting, AllowAllPolicy())
    identity = _identity()
    assert gateway.acquire(identity, "holder", scopes=SCOPES, ttl=30).ok
    view = gateway.current_holder(identity)
    assert view is not None
    winner = statements.apply(
        Rotate(identity, 1, True, uuid4(), "winner", ("tool:read",), timedelta(seconds=30)),
        AuditEntry(uuid7(), LifecycleEvent.TAKEOVER, Outcome.TAKEN_OVER, None, identity,
                   "winner", 2, "winner"), timedelta(0))
    answer: list[Any] = []
    with psycopg.connect(pg_dsn) as other:
        # The winner's takeover runs first and keeps its transaction (and the row lock) open.
        won = other.execute(winner.statement.text, winner.params).fetchone()
        assert won is not None and won[1] is not None
        loads = counting.loads
        late = threading.Thread(target=lambda: answer.append(gateway.takeover(
            identity, "late", scopes=SCOPES, ttl=30, expected_epoch=1, observed=view)))
        late.start()
        deadline = time.monotonic() + WAIT_S
        while pg_admin.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = "
                               "current_database() AND wait_event_type = 'Lock'"
                               ).fetchone() != (1,):
            assert time.monotonic() < deadline, "the late takeover never waited for the lock"
            time.sleep(0.02)
        other.commit()
    late.join(WAIT_S)
    assert not late.is_alive()
    (result,) = answer
    assert (result.reason, result.current_epoch) == (Reason.EPOCH_MISMATCH, 2)
    assert result.holder is not None and result.holder.connector_id == "winner"
    assert counting.loads == loads
