"""Helpers shared by the unit tests of the core and the coordinator.

Deterministic ids (counter-based UUIDs), a coordinator wired to an in-memory store driven by
a ``ManualClock``, and small store wrappers that inject infrastructure faults.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import attrs

from mos_lease import (
    AllowAllPolicy,
    CommitOutcomeUnknown,
    ConnectorLeaseCoordinator,
    ConnectorLeaseService,
    ExecutionGrant,
    LeaseHandle,
    LeaseIdentity,
    LeaseResult,
    StoreUnavailable,
)
from mos_lease.clock import ManualClock
from mos_lease.ids import uuid7_of
from mos_lease.machine import Renew, Write
from mos_lease.records import AuditEntry, AuditRecord, LeaseRow, Snapshot, WriteOutcome
from mos_lease_memory import InMemoryLeaseStore

START = datetime(2030, 1, 1, tzinfo=UTC)
IDENT = LeaseIdentity("acme", "agent-1", "binding-1")
OTHER_IDENT = LeaseIdentity("acme", "agent-1", "binding-2")
SCOPES = ("tool:read", "tool:run")
ALLOW_ALL: ConnectorLeaseService = AllowAllPolicy()


class Time:
    """The store's wall clock and the supervisors' monotonic clock, moved together."""

    def __init__(self) -> None:
        self.wall = ManualClock(START)
        self.mono = 1000.0

    def __call__(self) -> float:
        return self.mono

    def advance(self, seconds: float) -> None:
        self.mono += seconds
        self.wall.advance(seconds)


_prefixes = itertools.count(1)
_prefix_lock = threading.Lock()


def fresh_prefix() -> int:
    """A namespace no other id source in this test process uses."""
    with _prefix_lock:
        return next(_prefixes)


MINTED_MS = time.time_ns() // 1_000_000
"""The millisecond every reproducible id of this test process carries (the PostgreSQL store
requires time-ordered event ids minted near the database's clock: migration 0009)."""


class CountingIds:
    """A deterministic, thread-safe id source: version-7 UUIDs of :data:`MINTED_MS` whose
    other bits are ``prefix << 34 | n``, n = 1, 2, ...

    Two sources with the same prefix produce the same sequence (used to compare the sync and
    async coordinators); different prefixes never collide (several coordinators on one store
    must not reuse audit event ids).
    """

    def __init__(self, prefix: int | None = None) -> None:
        self.prefix = fresh_prefix() if prefix is None else prefix
        self._counter = itertools.count(1)
        self._lock = threading.Lock()
        self.issued = 0

    def __call__(self) -> UUID:
        with self._lock:
            self.issued += 1
            return uuid7_of(MINTED_MS, (self.prefix << 34) | next(self._counter))


@attrs.define
class Env:
    """One store, its manual clock and a coordinator on it."""

    clock: ManualClock
    store: InMemoryLeaseStore
    coordinator: ConnectorLeaseCoordinator
    ids: CountingIds

    def restart(self, policy: ConnectorLeaseService = ALLOW_ALL,
                **options: Any) -> ConnectorLeaseCoordinator:
        """A new gateway process on the same durable store (fresh ids, fresh registry)."""
        return ConnectorLeaseCoordinator(self.store, policy, id_source=CountingIds(),
                                         **options)

    def acquire(self, identity: LeaseIdentity = IDENT, connector_id: str = "conn-a",
                scopes: Sequence[str] = SCOPES, ttl: float | timedelta = 60) -> LeaseHandle:
        result = self.coordinator.acquire(identity, connector_id, scopes=scopes, ttl=ttl)
        assert result.ok, result
        assert result.lease is not None
        return result.lease

    def grant(self, lease: LeaseHandle, scopes: Sequence[str] | None = None,
              ttl: float = 10) -> ExecutionGrant:
        issued = self.coordinator.issue_grant(lease, scopes=scopes or ["tool:run"], ttl=ttl)
        assert issued.grant is not None, issued
        return issued.grant

    def audit(self) -> list[AuditRecord]:
        return list(self.store.audit(limit=1_000_000))

    def rows(self) -> list[LeaseRow]:
        return list(self.store.leases())

    def state(self) -> tuple[list[AuditRecord], list[LeaseRow]]:
        """Everything the store holds; compared before and after to prove "no writes"."""
        return self.audit(), self.rows()


def make_env(policy: ConnectorLeaseService | None = ALLOW_ALL, start: datetime = START,
             **options: Any) -> Env:
    """A coordinator on ``InMemoryLeaseStore(ManualClock(start))`` with counter ids.

    ``policy=None`` gives the coordinator's own default (deny-all).
    """
    clock = ManualClock(start)
    store = InMemoryLeaseStore(clock)
    ids = CountingIds()
    coordinator = ConnectorLeaseCoordinator(store, policy, id_source=ids, **options)
    return Env(clock, store, coordinator, ids)


def put_row(store: InMemoryLeaseStore, row: LeaseRow) -> None:
    """Overwrite the durable row directly: only for states the API cannot reach quickly."""
    store._rows[row.identity] = row


def row_of(store: InMemoryLeaseStore, identity: LeaseIdentity = IDENT) -> LeaseRow:
    row = store.load(identity).row
    assert row is not None
    return row


class FaultyStore:
    """Wraps an ``InMemoryLeaseStore``; each fault is switched on by a flag.

    ``fail_load``/``fail_record`` raise ``StoreUnavailable``; ``lose_commit`` makes the next
    ``apply`` raise ``CommitOutcomeUnknown`` after (``"after"``) or instead of (``"before"``)
    applying the write.
    """

    def __init__(self, inner: InMemoryLeaseStore) -> None:
        self.inner = inner
        self.fail_load = False
        self.fail_record = False
        self.lose_commit: str | None = None
        self.loads = 0

    def load(self, identity: LeaseIdentity) -> Snapshot:
        self.loads += 1
        if self.fail_load:
            raise StoreUnavailable("load: connection refused")
        return self.inner.load(identity)

    def apply(self, write: Write, entry: AuditEntry) -> WriteOutcome:
        mode, self.lose_commit = self.lose_commit, None
        if mode == "before":
            raise CommitOutcomeUnknown(entry.event_id, "connection dropped before commit")
        outcome = self.inner.apply(write, entry)
        if mode == "after":
            raise CommitOutcomeUnknown(entry.event_id, "connection dropped after commit")
        return outcome

    def renew_many(self, items: Sequence[tuple[Renew, AuditEntry]]) -> list[WriteOutcome]:
        return [self.apply(write, entry) for write, entry in items]

    def record(self, entry: AuditEntry) -> None:
        if self.fail_record:
            raise StoreUnavailable("record: connection refused")
        self.inner.record(entry)

    def record_many(self, entries: Sequence[AuditEntry]) -> None:
        if self.fail_record:
            raise StoreUnavailable("record: connection refused")
        self.inner.record_many(entries)

    def event_committed(self, event_id: UUID) -> bool:
        return self.inner.event_committed(event_id)


def expire(env: Env, handle: LeaseHandle) -> None:
    """Move the store clock to exactly the lease's expiry (expired: ``expires_at <= now``)."""
    gap = handle.expires_at - env.clock.now()
    env.clock.advance(max(gap, timedelta(0)))


def claim(gateway: ConnectorLeaseCoordinator, identity: LeaseIdentity, connector_id: str,
          row: LeaseRow | None, *, scopes: Sequence[str], ttl: float) -> LeaseResult:
    """A racer's move on ``identity`` given the row it just read: acquire where there is
    none, else take over at that row's epoch."""
    if row is None:
        return gateway.acquire(identity, connector_id, scopes=scopes, ttl=ttl)
    return gateway.takeover(identity, connector_id, scopes=scopes, ttl=ttl,
                            expected_epoch=row.epoch)
