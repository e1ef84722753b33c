"""The in-memory store: leases of one process, and the reference every other store matches.

It applies writes with the pure core's own guard (``mos_lease.machine.write_outcome``) under
one lock, so a write and its audit row happen together or not at all.

Holder metadata is judged as the PostgreSQL store judges what it reads back
(:func:`mos_lease.metadata.stored_metadata`). A row here has no writer but :meth:`apply`,
so it is judged once, as the insert or takeover that sets its metadata creates it, and
kept as every read returns it: a write built by hand around the coordinator's checks
cannot hand on metadata the library refuses.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from datetime import datetime
from typing import ClassVar, TypeVar
from uuid import UUID

import attrs

from mos_lease.checks import check_entries
from mos_lease.clock import Clock, SystemClock
from mos_lease.identity import LeaseIdentity, check_count, check_id, check_identity
from mos_lease.machine import Close, Insert, Renew, Rotate, Write, write_outcome
from mos_lease.metadata import EMPTY_METADATA, stored_metadata
from mos_lease.ports import MAX_AUDIT_PAGE
from mos_lease.reconciliation import took_effect
from mos_lease.records import AuditEntry, AuditRecord, LeaseRow, Snapshot, WriteOutcome
from mos_lease.stats import StoreCounts, StoreStats

T = TypeVar("T")

# A single write is counted under its statement's name in the PostgreSQL store.
_WRITE_NAMES: dict[type[Write], str] = {Insert: "insert", Renew: "renew", Close: "close",
                                         Rotate: "rotate"}


def _judged(row: LeaseRow) -> LeaseRow:
    """``row`` as every read returns it: metadata the library refuses is withheld."""
    shown = stored_metadata(row.metadata, row.identity, row.epoch)
    if shown is None:
        return attrs.evolve(row, metadata=EMPTY_METADATA, metadata_invalid=True)
    return row if shown is row.metadata else attrs.evolve(row, metadata=shown)


class InMemoryLeaseStore:
    """Thread-safe lease rows and audit log in this process's memory.

    ``clock`` is the store's time authority (a :class:`~mos_lease.clock.ManualClock` in tests).
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
        self._entries: dict[UUID, AuditEntry] = {}  # every audit entry, by event id
        # Calls by operation, each counted as one round trip, under the lock the call takes.
        self._counts = StoreCounts()

    def stats(self) -> StoreStats:
        """The calls made to this store since it was created, each counted as one round trip
        under the PostgreSQL store's statement names (:class:`mos_lease.stats.StoreStats`;
        nothing here is coalesced or lost in doubt)."""
        with self._lock:
            return StoreStats(self._counts.sent, reconciles=self._counts.reconciles)

    def _count_call(self, name: str) -> None:
        # Called with the lock held.
        sent = self._counts.sent
        sent[name] = sent.get(name, 0) + 1

    def load(self, identity: LeaseIdentity) -> Snapshot:
        """:meth:`mos_lease.ports.LeaseStore.load` under the store's lock, at its clock's time."""
        with self._lock:
            self._count_call("load")
            return Snapshot(self._rows.get(identity), self.clock.now())

    def apply(self, write: Write, entry: AuditEntry) -> WriteOutcome:
        """:meth:`mos_lease.ports.LeaseStore.apply`: the reference semantics (``write_outcome``)
        under the store's lock, the row and its audit record together."""
        with self._lock:
            self._count_call(_WRITE_NAMES[type(write)])
            return self._write(write, entry)

    def _write(self, write: Write, entry: AuditEntry) -> WriteOutcome:
        with self._lock:
            now = self.clock.now()
            current = self._rows.get(write.identity)
            row = write_outcome(write, current, now)
            if row is None:  # refused: the row it found names the refusal
                return WriteOutcome(None, now, found=Snapshot(current, now))
            self._append(entry, now)  # refuses a repeated event id before any change
            if isinstance(write, Insert | Rotate):  # the writes that set metadata
                row = _judged(row)
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
        order. Every renewal is reached (``WriteOutcome.reached``): this store has no row
        locks; :meth:`holding` holds the whole store, and a batch waits for it like any
        call."""
        with self._lock:
            self._count_call("renew_many")
        return [self._write(write, entry) for write, entry in items]

    def acquire_many(self, items: Sequence[tuple[Insert, AuditEntry]]) -> list[WriteOutcome]:
        """:meth:`mos_lease.ports.BatchLeaseStore.acquire_many`: each as :meth:`apply`, in order,
        under one hold of the lock (one atomic step)."""
        return self._apply_all("acquire_many", items)

    def takeover_many(self, items: Sequence[tuple[Rotate, AuditEntry]]) -> list[WriteOutcome]:
        """:meth:`mos_lease.ports.BatchLeaseStore.takeover_many`, as :meth:`acquire_many`. Nothing
        here holds a row apart from the store's lock, so every takeover is reached."""
        return self._apply_all("takeover_many", items)

    def release_many(self, items: Sequence[tuple[Close, AuditEntry]]) -> list[WriteOutcome]:
        """:meth:`mos_lease.ports.BatchLeaseStore.release_many`, as :meth:`takeover_many`."""
        return self._apply_all("release_many", items)

    def _apply_all(self, name: str, items: Sequence[tuple[Write, AuditEntry]]
                   ) -> list[WriteOutcome]:
        with self._lock:
            self._count_call(name)
            return [self._write(write, entry) for write, entry in items]

    def load_many(self, identities: Sequence[LeaseIdentity]) -> list[Snapshot]:
        """:meth:`mos_lease.ports.BatchLeaseStore.load_many`: every row at one clock reading."""
        with self._lock:
            self._count_call("load_many")
            now = self.clock.now()
            return [Snapshot(self._rows.get(identity), now) for identity in identities]

    def record(self, entry: AuditEntry) -> None:
        """:meth:`mos_lease.ports.LeaseStore.record`: the same entry sent again (after its
        reply was lost) is recorded once; another entry under a recorded event id raises
        ``ValueError``."""
        with self._lock:
            self._count_call("record")
            if self._entries.get(entry.event_id) == entry:
                return
            self._append(entry, self.clock.now())

    def record_many(self, entries: Sequence[AuditEntry]) -> None:
        """``record_many`` (optional, :mod:`mos_lease.ports`): all of them under the store's
        lock at one time, or none. As :meth:`record`: an entry already recorded (sent again
        after a lost reply) is kept once; another entry under a recorded event id raises
        ``ValueError`` before any is appended."""
        checked = check_entries(entries)
        with self._lock:
            self._count_call("record_many")
            now = self.clock.now()
            fresh = [entry for entry in checked if self._entries.get(entry.event_id) != entry]
            for entry in fresh:
                if entry.event_id in self._entries:
                    raise ValueError(f"audit event {entry.event_id} recorded twice")
            for entry in fresh:
                self._append(entry, now)

    def event_committed(self, event_id: UUID) -> bool:
        """:meth:`mos_lease.ports.LeaseStore.event_committed`: from the entry's outcome, since
        a refusal's entry carries the event id of the write it refused."""
        with self._lock:
            self._count_call("event_committed")
            self._counts.reconciles += 1
            entry = self._entries.get(event_id)
            return entry is not None and took_effect(entry)

    def _append(self, entry: AuditEntry, now: datetime) -> None:
        if entry.event_id in self._entries:
            raise ValueError(f"audit event {entry.event_id} recorded twice")
        self._entries[entry.event_id] = entry
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

    def stats(self) -> StoreStats:
        """As :meth:`InMemoryLeaseStore.stats` (shared with :attr:`sync`)."""
        return self.sync.stats()

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

    async def acquire_many(self, items: Sequence[tuple[Insert, AuditEntry]]
                           ) -> list[WriteOutcome]:
        """As :meth:`InMemoryLeaseStore.acquire_many`."""
        return self.sync.acquire_many(items)

    async def takeover_many(self, items: Sequence[tuple[Rotate, AuditEntry]]
                            ) -> list[WriteOutcome]:
        """As :meth:`InMemoryLeaseStore.takeover_many`."""
        return self.sync.takeover_many(items)

    async def release_many(self, items: Sequence[tuple[Close, AuditEntry]]
                           ) -> list[WriteOutcome]:
        """As :meth:`InMemoryLeaseStore.release_many`."""
        return self.sync.release_many(items)

    async def load_many(self, identities: Sequence[LeaseIdentity]) -> list[Snapshot]:
        """As :meth:`InMemoryLeaseStore.load_many`."""
        return self.sync.load_many(identities)

    async def record(self, entry: AuditEntry) -> None:
        """As :meth:`InMemoryLeaseStore.record`."""
        self.sync.record(entry)

    async def record_many(self, entries: Sequence[AuditEntry]) -> None:
        """As :meth:`InMemoryLeaseStore.record_many`."""
        self.sync.record_many(entries)

    async def event_committed(self, event_id: UUID) -> bool:
        """As :meth:`InMemoryLeaseStore.event_committed`."""
        return self.sync.event_committed(event_id)
