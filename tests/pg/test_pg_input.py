"""Bad input is refused before any SQL runs.

Two proofs: a store whose database does not exist answers bad input with ``InvalidInput``
(any statement would have raised ``StoreUnavailable`` first), and a real store behind a
counting wrapper sees no call and gains no row.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID, uuid4

import attrs
import pytest

from mos_lease import (
    AllowAllPolicy,
    ConnectorLeaseCoordinator,
    InvalidInput,
    LeaseHandle,
    LeaseIdentity,
    StoreUnavailable,
)
from mos_lease.machine import Renew, Write
from mos_lease.records import AuditEntry, Snapshot, WriteOutcome
from mos_lease_pg import PostgresLeaseStore
from tests.pg_fixtures import StoreFactory

pytestmark = pytest.mark.pg

UNREACHABLE = "host=127.0.0.1 port=1 user=nobody dbname=nothing connect_timeout=2"


class CountingStore:
    """Forwards to a store and counts every call that would send SQL."""

    def __init__(self, inner: PostgresLeaseStore) -> None:
        self.inner = inner
        self.calls = 0

    def load(self, identity: LeaseIdentity) -> Snapshot:
        self.calls += 1
        return self.inner.load(identity)

    def apply(self, write: Write, entry: AuditEntry) -> WriteOutcome:
        self.calls += 1
        return self.inner.apply(write, entry)

    def renew_many(self, items: Sequence[tuple[Renew, AuditEntry]]) -> Sequence[WriteOutcome]:
        self.calls += 1
        return self.inner.renew_many(items)

    def record(self, entry: AuditEntry) -> None:
        self.calls += 1
        self.inner.record(entry)

    def record_many(self, entries: Sequence[AuditEntry]) -> None:
        self.calls += 1
        self.inner.record_many(entries)

    def event_committed(self, event_id: UUID) -> bool:
        self.calls += 1
        return self.inner.event_committed(event_id)


def bad_calls(coordinator: ConnectorLeaseCoordinator, tenant: str
              ) -> list[tuple[str, Callable[[], Any]]]:
    ident = LeaseIdentity(tenant, "agent", "b1")
    handle = LeaseHandle(ident, "c1", uuid4(), 1, ("tool:run",), datetime.now(UTC))
    c: Any = coordinator  # the calls below are wrong on purpose
    not_a_uuid: Any = "x"
    return [
        ("identity", lambda: c.acquire(("t", "a", "b"), "c1", scopes=[], ttl=5)),
        ("connector_id", lambda: c.acquire(ident, "", scopes=[], ttl=5)),
        ("connector_id", lambda: c.acquire(ident, "c1\n", scopes=[], ttl=5)),
        ("scopes", lambda: c.acquire(ident, "c1", scopes="tool:run", ttl=5)),
        ("scopes", lambda: c.acquire(ident, "c1", scopes=["Tool Run"], ttl=5)),
        ("ttl", lambda: c.acquire(ident, "c1", scopes=[], ttl=0)),
        ("ttl", lambda: c.acquire(ident, "c1", scopes=[], ttl=301)),
        ("ttl", lambda: c.acquire(ident, "c1", scopes=[], ttl=float("nan"))),
        ("expected_epoch", lambda: c.takeover(ident, "c1", scopes=[], ttl=5,
                                              expected_epoch=0)),
        ("expected_epoch", lambda: c.takeover(ident, "c1", scopes=[], ttl=5,
                                              expected_epoch=True)),
        ("correlation_id", lambda: c.acquire(ident, "c1", scopes=[], ttl=5,
                                             correlation_id="\u202e")),
        ("lease", lambda: c.heartbeat("not a handle", ttl=5)),
        ("lease.epoch", lambda: c.heartbeat(attrs.evolve(handle, epoch=-1), ttl=5)),
        ("ttl", lambda: c.heartbeat(handle, ttl=timedelta(minutes=6))),
        ("lease.lease_id", lambda: c.release(attrs.evolve(handle, lease_id=not_a_uuid))),
        ("ttl", lambda: c.issue_grant(handle, scopes=[], ttl=31)),
        ("scopes", lambda: c.issue_grant(handle, scopes=[1], ttl=5)),
        ("identity", lambda: c.validate(object(), identity="t/a/b", scopes=[])),
        ("leases", lambda: c.heartbeat_many(handle, ttl=5)),
    ]


def test_bad_input_never_reaches_the_database(pg_stores: StoreFactory, pg_tenant: str) -> None:
    unreachable = ConnectorLeaseCoordinator(pg_stores(UNREACHABLE), AllowAllPolicy())
    counting = CountingStore(pg_stores())
    coordinator = ConnectorLeaseCoordinator(counting, AllowAllPolicy())
    for gateway in (unreachable, coordinator):
        for field, call in bad_calls(gateway, pg_tenant):
            with pytest.raises(InvalidInput) as refused:
                call()
            assert refused.value.field == field
    assert counting.calls == 0
    assert counting.inner.leases(pg_tenant) == []
    assert counting.inner.search_audit(tenant_id=pg_tenant) == []
    # The same unreachable store does try the database for good input.
    with pytest.raises(StoreUnavailable):
        unreachable.acquire(LeaseIdentity(pg_tenant, "agent", "b1"), "c1", scopes=[], ttl=5)


def test_bad_inspection_arguments_never_reach_the_database(pg_stores: StoreFactory) -> None:
    store = pg_stores(UNREACHABLE)
    refused: list[Callable[[], Any]] = [
        lambda: store.leases(""),
        lambda: store.leases(7),  # type: ignore[arg-type]
        lambda: store.audit("t/a/b"),  # type: ignore[arg-type]
        lambda: store.audit(after_seq=-1),
        lambda: store.audit(limit=0),
        lambda: store.audit(limit=10**7),
        lambda: store.search_audit(tenant_id="\x00"),
        lambda: store.search_audit(after_seq=1.5),  # type: ignore[arg-type]
    ]
    for call in refused:
        with pytest.raises(InvalidInput):
            call()
    with pytest.raises(StoreUnavailable):
        store.leases()
