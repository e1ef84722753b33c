"""A store and a resource guard of your own, checked by the conformance kit.

The code ``docs/writing-a-store.md`` walks through. Run as a program
(``python examples/store_kit.py``), it puts both through the conformance kit
(``mos_lease.testing``, the ``testing`` extra) and says what passed; the documentation's
tests run it so. ``DictLeaseStore`` is an asyncio store that keeps rows and the audit
log in memory: every write is compare-and-set under one lock, judged at the store's own
time read after the lock, with its audit row in the same step. ``SqliteResourceGuard`` is a
durable resource guard on SQLite, built from the public helpers of ``mos_lease.fencing``.
"""

from __future__ import annotations

import asyncio
import sqlite3
import sys
import tempfile
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from uuid import UUID

from mos_lease import LeaseIdentity
from mos_lease.clock import ManualClock
from mos_lease.fencing import (
    NO_GRACE,
    GuardDecision,
    ResourceEpoch,
    admit,
    check_resource_id,
    check_token,
    judged_grace,
)
from mos_lease.machine import Renew, Write, write_outcome
from mos_lease.reconciliation import took_effect
from mos_lease.records import AuditEntry, AuditRecord, LeaseRow, Snapshot, WriteOutcome
from mos_lease.token import FencingToken

# --- a lease store ------------------------------------------------------------------------


class DictLeaseStore:
    """An :class:`~mos_lease.AsyncLeaseStore` (and inspector) in this process's memory."""

    def __init__(self, clock: Callable[[], datetime]) -> None:
        self._clock = clock  # the store's time authority: the only clock that judges expiry
        self._lock = asyncio.Lock()
        self._rows: dict[LeaseIdentity, LeaseRow] = {}
        self._audit: list[AuditRecord] = []
        self._events: dict[UUID, AuditEntry] = {}

    def decide(self, write: Write, row: LeaseRow | None, now: datetime) -> LeaseRow | None:
        """The write guard: the library's reference semantics, never a copy of them."""
        return write_outcome(write, row, now)

    async def load(self, identity: LeaseIdentity) -> Snapshot:
        async with self._lock:
            return Snapshot(self._rows.get(identity), self._clock())

    async def apply(self, write: Write, entry: AuditEntry) -> WriteOutcome:
        async with self._lock:
            now = self._clock()  # read once the lock is held, never before
            row = self.decide(write, self._rows.get(write.identity), now)
            if row is not None:  # the row and its audit entry together, or neither
                self._append(entry, now)
                self._rows[write.identity] = row
            return WriteOutcome(row, now)

    async def renew_many(self, renewals: Sequence[tuple[Renew, AuditEntry]]
                         ) -> list[WriteOutcome]:
        return [await self.apply(write, entry) for write, entry in renewals]

    async def record(self, entry: AuditEntry) -> None:
        async with self._lock:
            if self._events.get(entry.event_id) == entry:
                return  # the same entry sent again after its reply was lost: kept once
            self._append(entry, self._clock())

    async def event_committed(self, event_id: UUID) -> bool:
        # Whether the attempt took effect: a refusal's entry carries the event id of the
        # write it refused, so its outcome answers, not its presence.
        async with self._lock:
            entry = self._events.get(event_id)
            return entry is not None and took_effect(entry)

    async def leases(self, tenant_id: str | None = None) -> Sequence[LeaseRow]:
        async with self._lock:
            return [row for row in self._rows.values()
                    if tenant_id is None or row.identity.tenant_id == tenant_id]

    async def audit(self, identity: LeaseIdentity | None = None, *, after_seq: int = 0,
                    limit: int = 1000) -> Sequence[AuditRecord]:
        async with self._lock:
            return [record for record in self._audit[after_seq:]
                    if identity is None or record.entry.identity == identity][:limit]

    def _append(self, entry: AuditEntry, now: datetime) -> None:
        # An event id is written at most once: it is how a lost commit is reconciled.
        if entry.event_id in self._events:
            raise ValueError(f"audit event {entry.event_id} recorded twice")
        self._events[entry.event_id] = entry
        self._audit.append(AuditRecord(len(self._audit) + 1, entry, now))


class DictHarness:
    """What the kit needs: the store, and a way to move its clock forward."""

    def __init__(self, store: type[DictLeaseStore] = DictLeaseStore) -> None:
        self.clock = ManualClock()
        self._store = store(self.clock.now)

    @property
    def store(self) -> DictLeaseStore:
        return self._store

    async def advance(self, by: timedelta) -> None:
        self.clock.advance(by)


# --- a durable resource guard -------------------------------------------------------------


def _utc_now() -> datetime:
    return datetime.now(UTC)


class SqliteResourceGuard:
    """A :class:`~mos_lease.fencing.ResourceGuard` keeping the highest epoch in SQLite."""

    def __init__(self, path: str, *, expiry_grace: timedelta = NO_GRACE,
                 ignore_expiry: bool = False, clock: Callable[[], datetime] = _utc_now) -> None:
        self.expiry_grace = judged_grace(expiry_grace, ignore_expiry)  # None: expiry off
        self._clock = clock
        self._db = sqlite3.connect(path, isolation_level=None)  # transactions by hand
        self._db.execute("CREATE TABLE IF NOT EXISTS resource_epochs (resource_id TEXT "
                         "PRIMARY KEY, tenant_id TEXT, logical_agent_id TEXT, "
                         "binding_id TEXT, highest_epoch INTEGER)")

    def admit(self, resource_id: str, token: FencingToken) -> GuardDecision:
        resource_id, token = check_resource_id(resource_id), check_token(token)
        # Decide and record in one write transaction: BEGIN IMMEDIATE takes the write lock
        # first, so no other admission can record a higher epoch in between.
        self._db.execute("BEGIN IMMEDIATE")
        try:
            row = self._db.execute(
                "SELECT tenant_id, logical_agent_id, binding_id, highest_epoch "
                "FROM resource_epochs WHERE resource_id = ?", (resource_id,)).fetchone()
            current = None if row is None else ResourceEpoch(LeaseIdentity(*row[:3]), row[3])
            now = self._clock() if self.expiry_grace is not None else None  # after the lock
            after, decision = admit(current, token, resource_id, now=now,
                                    expiry_grace=self.expiry_grace)
            if after is not None and after != current:
                self._db.execute(
                    "INSERT OR REPLACE INTO resource_epochs VALUES (?, ?, ?, ?, ?)",
                    (resource_id, after.identity.tenant_id, after.identity.logical_agent_id,
                     after.identity.binding_id, after.highest_epoch))
            self._db.execute("COMMIT")
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        return decision

    def close(self) -> None:
        self._db.close()


# --- checked by the conformance kit -------------------------------------------------------


def check_store(*, steps: int = 200, examples: int = 10) -> None:
    """The store contract and the stateful specification, on an event loop of their own."""
    # The kit needs the testing extra (hypothesis); importing this module does not.
    from hypothesis import settings

    from mos_lease.testing import EventLoopThread, make_lease_machine, run_store_contract

    with EventLoopThread() as loop:
        run_store_contract(loop.harness_factory(DictHarness), steps=steps)
        machine = make_lease_machine(loop.harness_factory(DictHarness))
        machine.TestCase.settings = settings(max_examples=examples, stateful_step_count=20,
                                             deadline=None)
        machine.TestCase().runTest()


def check_guard() -> None:
    """The guard contract, on a database file that two guard objects share."""
    from mos_lease.testing import run_guard_contract

    with tempfile.TemporaryDirectory() as directory:
        guards: list[SqliteResourceGuard] = []

        def make_guard(*, ignore_expiry: bool) -> SqliteResourceGuard:
            guards.append(SqliteResourceGuard(str(Path(directory) / "epochs.db"),
                                              ignore_expiry=ignore_expiry))
            return guards[-1]

        try:
            run_guard_contract(make_guard)
        finally:
            for guard in guards:
                guard.close()


def main() -> int:
    check_store()
    print("DictLeaseStore: the store contract and the lease machine pass", flush=True)
    check_guard()
    print("SqliteResourceGuard: the guard contract passes")
    print("the store and the guard pass the conformance kit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
