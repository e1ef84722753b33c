"""The in-memory store: leases of one process, and the reference every other store matches.

It applies writes with the pure core's own guard (``mos_lease.machine.write_outcome``) under
one lock, so a write and its audit row happen together or not at all.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import ClassVar, TypeVar
from uuid import UUID

from mos_lease.checks import check_entries
from mos_lease.clock import Clock, SystemClock
from mos_lease.identity import LeaseIdentity, check_count, check_id, check_identity
from mos_lease.machine import Renew, Write, write_outcome
from mos_lease.ports import MAX_AUDIT_PAGE
from mos_lease.records import AuditEntry, AuditRecord, LeaseRow, Snapshot, WriteOutcome

T = TypeVar("T")


class InMemoryLeaseStore:
    """Thread-safe lease rows and audit log in this process's memory.

    ``clock`` is the store's time authority (a :class:`ManualClock` in tests).
    """

    # Telemetry names the store by this (``mos_lease.events.store_system``).
    db_system: ClassVar[str] = "memory"
    clock_can_step: ClassVar[bool] = False
    """Its time is this process's clock, which no failover can swap for another host's:
    keepers, ``hold()`` and the supervisor add no clock-step margin over it
    (:func:`mos_lease.keeper.default_clock_step`)."""

    def __init__(self, clock: Clock | None = None) -> None:
        self.clock: Clock = clock if clock is not None else SystemClock()
        # Reentrant: a fenced effect (``holding``) runs under it and may read the store.
        self._lock = threading.RLock()
        self._rows: dict[LeaseIdentity, LeaseRow] = {}
        self._audit: list[AuditRecord] = []
        self._event_ids: set[UUID] = set()

    def load(self, identity: LeaseIdentity) -> Snapshot:
        """:meth:`mos_lease.ports.LeaseStore.load` under the store's lock, at its clock's time."""
        with self._lock:
            return Snapshot(self._rows.get(identity), self.clock.now())

    def apply(self, write: Write, entry: AuditEntry) -> WriteOutcome:
        """:meth:`mos_lease.ports.LeaseStore.apply`: the reference semantics (``write_outcome``)
        under the store's lock, the row and its audit record together."""
        with self._lock:
            now = self.clock.now()
            current = self._rows.get(write.identity)
            row = write_outcome(write, current, now)
            if row is None:  # refused: the row it found names the refusal
                return WriteOutcome(None, now, found=Snapshot(current, now))
            self._append(entry, now)  # refuses a repeated event id before any change
            self._rows[write.identity] = row
            return WriteOutcome(row, now)

    def holding(self, identity: LeaseIdentity, action: Callable[[Snapshot], T]) -> T:
        """Call ``action`` with ``identity``'s row and the store's time, read under the
        store's lock and holding it until ``action`` returns: no lease write (heartbeat,
        release, takeover) can come between what ``action`` saw and what it did. The
        in-memory counterpart of a transaction holding the row ``FOR SHARE``; the fenced
        effects of :mod:`mos_lease_memory.effects` are built on it. Keep ``action`` short:
        every store call of the process waits for it."""
        check_identity("identity", identity)
        with self._lock:
            return action(Snapshot(self._rows.get(identity), self.clock.now()))

    def renew_many(self, items: Sequence[tuple[Renew, AuditEntry]]) -> list[WriteOutcome]:
        """:meth:`mos_lease.ports.LeaseStore.renew_many`: each renewal as :meth:`apply`, in
        order."""
        return [self.apply(write, entry) for write, entry in items]

    def record(self, entry: AuditEntry) -> None:
        """:meth:`mos_lease.ports.LeaseStore.record`; an event id recorded twice raises
        ``ValueError``."""
        with self._lock:
            self._append(entry, self.clock.now())

    def record_many(self, entries: Sequence[AuditEntry]) -> None:
        """:meth:`mos_lease.ports.LeaseStore.record_many`: all of them under the store's
        lock at one time, or none (an event id already recorded raises ``ValueError``
        before any is appended)."""
        checked = check_entries(entries)
        with self._lock:
            now = self.clock.now()
            for entry in checked:
                if entry.event_id in self._event_ids:
                    raise ValueError(f"audit event {entry.event_id} recorded twice")
            for entry in checked:
                self._append(entry, now)

    def event_committed(self, event_id: UUID) -> bool:
        """:meth:`mos_lease.ports.LeaseStore.event_committed`."""
        with self._lock:
            return event_id in self._event_ids

    def _append(self, entry: AuditEntry, now: datetime) -> None:
        if entry.event_id in self._event_ids:
            raise ValueError(f"audit event {entry.event_id} recorded twice")
        self._event_ids.add(entry.event_id)
        self._audit.append(AuditRecord(len(self._audit) + 1, entry, now))

    # -- inspection ---------------------------------------------------------------------

    def leases(self, tenant_id: str | None = None) -> Sequence[LeaseRow]:
        """Every lease row (of ``tenant_id`` only, if given), in identity order."""
        if tenant_id is not None:
            check_id("tenant_id", tenant_id)
        with self._lock:
            rows = [r for r in self._rows.values()
                    if tenant_id is None or r.identity.tenant_id == tenant_id]
        return sorted(rows, key=lambda r: (r.identity.tenant_id, r.identity.logical_agent_id,
                                           r.identity.binding_id))

    def audit(self, identity: LeaseIdentity | None = None, *, after_seq: int = 0,
              limit: int = 1000) -> Sequence[AuditRecord]:
        """Audit records in sequence order (after ``after_seq``, of ``identity`` if given,
        at most ``limit``)."""
        if identity is not None:
            check_identity("identity", identity)
        check_count("after_seq", after_seq, 0, 2**63 - 1)
        check_count("limit", limit, 1, MAX_AUDIT_PAGE)
        with self._lock:
            records = self._audit[max(after_seq, 0):]
        if identity is not None:
            records = [r for r in records if r.entry.identity == identity]
        return records[:limit]


class AsyncInMemoryLeaseStore:
    """The same store behind the asyncio store protocol (operations never block long)."""

    db_system: ClassVar[str] = "memory"
    clock_can_step: ClassVar[bool] = False
    """As :attr:`InMemoryLeaseStore.clock_can_step`."""

    def __init__(self, store: InMemoryLeaseStore | None = None) -> None:
        self.sync = store if store is not None else InMemoryLeaseStore()

    async def load(self, identity: LeaseIdentity) -> Snapshot:
        """As :meth:`InMemoryLeaseStore.load`."""
        return self.sync.load(identity)

    async def apply(self, write: Write, entry: AuditEntry) -> WriteOutcome:
        """As :meth:`InMemoryLeaseStore.apply`."""
        return self.sync.apply(write, entry)

    async def renew_many(self, items: Sequence[tuple[Renew, AuditEntry]]
                         ) -> list[WriteOutcome]:
        """As :meth:`InMemoryLeaseStore.renew_many`."""
        return self.sync.renew_many(items)

    async def record(self, entry: AuditEntry) -> None:
        """As :meth:`InMemoryLeaseStore.record`."""
        self.sync.record(entry)

    async def record_many(self, entries: Sequence[AuditEntry]) -> None:
        """As :meth:`InMemoryLeaseStore.record_many`."""
        self.sync.record_many(entries)

    async def event_committed(self, event_id: UUID) -> bool:
        """As :meth:`InMemoryLeaseStore.event_committed`."""
        return self.sync.event_committed(event_id)
