"""The PostgreSQL lease stores: thin senders of the calls built in :mod:`statements`.

:class:`PostgresLeaseStore` implements :class:`mos_lease.ports.LeaseStore` and
:class:`AsyncPostgresLeaseStore` implements :class:`mos_lease.ports.AsyncLeaseStore`; both
also offer the :class:`mos_lease.ports.LeaseInspector` views. Everything they share (which
statement, which parameters, how rows map back, what a failure means, the flows that settle
a write in doubt) lives in :mod:`mos_lease_pg.store_core`, :mod:`mos_lease_pg.statements`
and :mod:`mos_lease_pg.translate`; the classes below, the call path, differ only in
``await``. Every statement goes out through the connection's
long-lived cursor (:mod:`mos_lease_pg.wire`), prepared by psycopg itself.

Each operation is one statement, so one round trip and one transaction (``renew_many`` too:
one statement renews the whole batch; reconciling a write whose connection was lost first
ends the session that sent it, see :mod:`mos_lease_pg.reconcile`). Every call returns
or raises within ``settings.call_bound()`` on the client, whatever the network does (see
:mod:`mos_lease_pg.deadline`); a connection whose reply did not come in time is discarded.
The database clock is the time authority: every statement reads
``clock_timestamp()`` (a test double adds an offset) in the same round trip as
the row it judges.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from datetime import datetime
from types import TracebackType
from typing import Any, Self, TypeVar
from uuid import UUID

import psycopg
import psycopg_pool

from mos_lease.checks import check_entries
from mos_lease.clock import MonotonicClock, default_clock
from mos_lease.errors import CommitOutcomeUnknown, MosLeaseError
from mos_lease.flowdrive import Drive, outcome_of, outcome_of_async
from mos_lease.identity import LeaseIdentity, check_id
from mos_lease.machine import Close, Insert, Renew, Rotate, Write
from mos_lease.records import AuditEntry, AuditRecord, LeaseRow, Snapshot, WriteOutcome
from mos_lease.sleep import Sleep
from mos_lease_pg import replication, statements, store_core
from mos_lease_pg.attempts import Covers, Missed, Resend, Sent, needs_discard
from mos_lease_pg.coalesce import TaskReads, ThreadReads, Ticket, keys
from mos_lease_pg.connection import (
    AsyncDedicatedConnection,
    AsyncPooledConnection,
    ConnectionSettings,
    DedicatedConnection,
    PooledConnection,
    discard_if_busy,
    discard_if_busy_sync,
)
from mos_lease_pg.deadline import AsyncWatch
from mos_lease_pg.statements import Call
from mos_lease_pg.store_core import Flow, Step, _check_optional_id, _source_of, _StoreCore

T = TypeVar("T")


class PostgresLeaseStore(_StoreCore):
    """The synchronous PostgreSQL store.

    Give it either ``conninfo`` (a libpq connection string or URL: the store keeps one
    dedicated connection, the fastest choice, safe to share between threads, which then
    take turns) or ``pool`` (a caller-owned ``psycopg_pool.ConnectionPool`` built with
    :func:`mos_lease_pg.make_pool`; one checkout per call). ``settings`` sets timeouts and
    statement preparation.
    """

    def __init__(self, conninfo: str | None = None, *,
                 pool: psycopg_pool.ConnectionPool[Any] | None = None,
                 settings: ConnectionSettings | None = None,
                 clock: MonotonicClock = default_clock) -> None:
        settings, self._source = _source_of(conninfo, pool, settings, clock,
                                            DedicatedConnection, PooledConnection)
        self._setup(settings, clock)
        # Loads that overlap share a round trip, and so do audit appends (one commit).
        self._reads = ThreadReads(self, self._load_one, self._load_batch)
        self._records = ThreadReads(self, self._record_one,
                                    lambda batch, d: self._record_batch(keys(batch), d),
                                    late=store_core.late_record, name="mos-lease-records")

    def _load_one(self, identity: LeaseIdentity, deadline: float) -> Snapshot:
        return self._run(self._load_call(identity), deadline=deadline)

    def _load_batch(self, batch: list[Ticket], deadline: float) -> list[Snapshot]:
        if len(batch) == 1:  # a batch of one goes out as the ordinary load
            return [self._load_one(batch[0].key, deadline)]
        sent = self._clock()
        return self._loaded(batch, self._run(self._load_many_call(batch), deadline=deadline),
                            sent)

    def _record_one(self, entry: AuditEntry, deadline: float) -> None:
        self._drive(self._recording(entry), deadline)

    def _record_batch(self, entries: list[AuditEntry], deadline: float
                      ) -> list[MosLeaseError | None]:
        if len(entries) == 1:  # a batch of one goes out as the ordinary record
            self._record_one(entries[0], deadline)
            return [None]
        call, each = self._record_many_calls(entries)
        try:
            counts = self._run(call, covers=each, deadline=deadline)
        except CommitOutcomeUnknown as lost:
            return store_core.records_in_doubt(entries, lost)
        except store_core.refused_whole:
            # The database refused the statement, so nothing of it was written: each entry
            # goes again on its own, and only the one it refuses fails.
            return [store_core.outcome_error(self._record_one, e, deadline) for e in entries]
        return self._drive(self._recorded(entries, counts), deadline)

    def _run(self, call: Call[T], *, covers: Covers | None = None,
             deadline: float | None = None) -> T:
        """Send one statement, within ``deadline`` (on the store's clock; default: the call
        bound from now). ``covers`` names the writes a combined statement stands for."""
        deadline = self._deadline(deadline)
        sent = self._attempt(call, covers, deadline)
        if sent.__class__ is Missed:
            return self._drive(self._resending(call, covers, deadline, sent), deadline)
        return call.parse(sent)  # type: ignore[arg-type]

    def _attempt(self, call: Call[Any], covers: Covers | None, deadline: float) -> Sent:
        """Send ``call`` once: its rows, or the :class:`Missed` that says why not."""
        source = self._source
        wire = source.enter(deadline)
        # Counted during the connection's turn (a dedicated connection's threads take turns).
        sent, name = self._counts.sent, call.statement.name
        sent[name] = sent.get(name, 0) + 1
        try:
            try:
                with wire.watch.arm(deadline, self._bound) as watch:
                    rows = wire.execute(call.statement.text, call.params)
            except psycopg.Error as exc:
                wire.notices.warnings.clear()
                if needs_discard(exc, wire):
                    wire.conn.close()
                return Missed(exc, wire, watch.fired)
            if wire.notices.warnings:
                replication.confirm(wire.conn, [call] if covers is None else covers())
            return rows
        except BaseException:
            discard_if_busy_sync(wire.conn)
            raise
        finally:
            source.leave(wire)

    def _drive(self, flow: Flow[T], deadline: float) -> T:
        drive = Drive(flow)
        for step in drive:
            drive.send(outcome_of(self._perform, step, deadline))
        return drive.result

    def _perform(self, step: Step, deadline: float) -> object:
        if isinstance(step, Sleep):
            time.sleep(step.seconds)
            return None
        if isinstance(step, Resend):
            return self._attempt(step.call, None, deadline)
        return self._run(step, deadline=deadline)

    # -- LeaseStore ---------------------------------------------------------------------

    def load(self, identity: LeaseIdentity) -> Snapshot:
        """:meth:`mos_lease.ports.LeaseStore.load`: one prepared read of the row with the database
        clock, shared with the loads of other threads that overlap it
        (:mod:`mos_lease_pg.coalesce`)."""
        return self._reads.call(identity)  # type: ignore[no-any-return]

    def apply(self, write: Write, entry: AuditEntry) -> WriteOutcome:
        """:meth:`mos_lease.ports.LeaseStore.apply`: one statement that locks the row, then reads
        the database clock, writes and appends the audit row."""
        return self._run(statements.apply(write, entry, self._offset, schema=self._schema,
                                          audit_heartbeats=self._audit_heartbeats))

    def renew_many(self, renewals: Sequence[tuple[Renew, AuditEntry]]) -> list[WriteOutcome]:
        """:meth:`mos_lease.ports.LeaseStore.renew_many`: the whole batch in one statement, rows
        locked in identity order."""
        if not renewals:
            return []
        batch, each = self._batch_calls(renewals)
        return self._run(batch, covers=each)

    def acquire_many(self, inserts: Sequence[tuple[Insert, AuditEntry]]
                     ) -> list[WriteOutcome]:
        """:meth:`~mos_lease.ports.BatchLeaseStore.acquire_many`: the whole batch in one
        statement."""
        return self._write_many(inserts)

    def takeover_many(self, rotations: Sequence[tuple[Rotate, AuditEntry]]
                      ) -> list[WriteOutcome]:
        """:meth:`~mos_lease.ports.BatchLeaseStore.takeover_many`: the whole batch in one
        statement, rows locked in identity order, a row locked elsewhere skipped."""
        return self._write_many(rotations)

    def release_many(self, closes: Sequence[tuple[Close, AuditEntry]]) -> list[WriteOutcome]:
        """:meth:`~mos_lease.ports.BatchLeaseStore.release_many`, as :meth:`takeover_many`."""
        return self._write_many(closes)

    def _write_many(self, items: Sequence[tuple[Write, AuditEntry]]) -> list[WriteOutcome]:
        if not items:
            return []
        batch, each = self._write_many_calls(items)
        return self._run(batch, covers=each)

    def load_many(self, identities: Sequence[LeaseIdentity]) -> list[Snapshot]:
        """:meth:`~mos_lease.ports.BatchLeaseStore.load_many`: one read of every row
        (``load_many.sql``, the statement coalesced loads share), at one database time."""
        if not identities:
            return []
        return self._run(statements.load_many(identities, self._offset, schema=self._schema))

    def record(self, entry: AuditEntry) -> None:
        """:meth:`~mos_lease.ports.LeaseStore.record`: append one audit entry, at most once per
        event id; appends of other threads that overlap it share its statement and commit
        (:mod:`mos_lease_pg.coalesce`)."""
        self._records.call(entry)

    def record_many(self, entries: Sequence[AuditEntry]) -> None:
        """``record_many`` (optional, :mod:`mos_lease.ports`): every entry in one statement and one
        commit, each appended and checked as :meth:`record` would (``record_many.sql``)."""
        checked = check_entries(entries)
        if checked:
            store_core.first_error(self._record_batch(checked, self._deadline(None)))

    def event_committed(self, event_id: UUID) -> bool:
        """:meth:`mos_lease.ports.LeaseStore.event_committed`, answered only once the session that
        sent a lost write can no longer commit it."""
        deadline = self._deadline(None)
        with self._source.checkout(deadline) as wire:
            lost = self._lost_here(event_id, wire)
        return self._drive(self._settling(event_id, lost, deadline), deadline)

    # -- LeaseInspector and operator views ----------------------------------------------

    def leases(self, tenant_id: str | None = None) -> Sequence[LeaseRow]:
        """Every lease row (of ``tenant_id`` only, if given), as ``mos-lease status`` shows
        them."""
        return self._run(statements.leases(_check_optional_id("tenant_id", tenant_id),
                                           schema=self._schema))

    def fleet_leases(self, fleet: str, tenant_id: str | None = None
                     ) -> tuple[datetime, Sequence[LeaseRow]]:
        """The database time and, read with it in one statement, fleet ``fleet``'s member
        leases and every lease (of ``tenant_id`` only, if given) whose last holder is one of
        their connectors: what :func:`mos_lease.fleet.census.census` judges
        (``mos-lease status --fleet``)."""
        return self._run(statements.fleet_leases(
            check_id("fleet", fleet), _check_optional_id("tenant_id", tenant_id),
            self._offset, schema=self._schema))

    def audit(self, identity: LeaseIdentity | None = None, *, after_seq: int = 0,
              limit: int = 1000) -> Sequence[AuditRecord]:
        """Audit records in sequence order, oldest first (after ``after_seq``, of
        ``identity`` if given, at most ``limit``)."""
        return self._run(self._audit_call(identity, after_seq, limit))

    def search_audit(self, *, tenant_id: str | None = None, logical_agent_id: str | None = None,
                     binding_id: str | None = None, after_seq: int = 0,
                     limit: int = 1000) -> Sequence[AuditRecord]:
        """Audit records narrowed by any of tenant, agent and binding (``mos-lease audit``)."""
        return self._run(self._search_call(tenant_id, logical_agent_id, binding_id,
                                           after_seq, limit))

    def now(self) -> datetime:
        """The store's time: the database clock."""
        return self._run(statements.now(self._offset, schema=self._schema))

    def close(self) -> None:
        """Close the dedicated connection (a pool stays open: it is the caller's)."""
        self._source.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


class AsyncPostgresLeaseStore(_StoreCore):
    """The asyncio PostgreSQL store; options as :class:`PostgresLeaseStore`, with an
    ``AsyncConnectionPool`` (see :func:`mos_lease_pg.open_async_pool`) for ``pool``."""

    def __init__(self, conninfo: str | None = None, *,
                 pool: psycopg_pool.AsyncConnectionPool[Any] | None = None,
                 settings: ConnectionSettings | None = None,
                 clock: MonotonicClock = default_clock) -> None:
        settings, self._source = _source_of(conninfo, pool, settings, clock,
                                            AsyncDedicatedConnection, AsyncPooledConnection)
        self._setup(settings, clock)
        # As PostgresLeaseStore: loads and audit appends that overlap are coalesced.
        # A call arriving while the store is busy with another queues (TaskReads).
        crowded, free = self._crowded, self._source.free
        self._reads = TaskReads(self, self._load_one, self._load_batch, crowded=crowded,
                                free=free)
        self._records = TaskReads(self, self._record_one,
                                  lambda batch, d: self._record_batch(keys(batch), d),
                                  late=store_core.late_record, crowded=crowded, free=free)

    def _crowded(self) -> bool:
        return self._reads.busy or self._records.busy or self._source.taken()

    async def _load_one(self, identity: LeaseIdentity, deadline: float) -> Snapshot:
        return await self._run(self._load_call(identity), deadline=deadline)

    async def _load_batch(self, batch: list[Ticket], deadline: float) -> list[Snapshot]:
        if len(batch) == 1:
            return [await self._load_one(batch[0].key, deadline)]
        sent = self._clock()
        return self._loaded(batch, await self._run(self._load_many_call(batch),
                                                   deadline=deadline), sent)

    async def _record_one(self, entry: AuditEntry, deadline: float) -> None:
        await self._drive(self._recording(entry), deadline)

    async def _record_batch(self, entries: list[AuditEntry], deadline: float
                            ) -> list[MosLeaseError | None]:
        if len(entries) == 1:
            await self._record_one(entries[0], deadline)
            return [None]
        call, each = self._record_many_calls(entries)
        try:
            counts = await self._run(call, covers=each, deadline=deadline)
        except CommitOutcomeUnknown as lost:
            return store_core.records_in_doubt(entries, lost)
        except store_core.refused_whole:  # as PostgresLeaseStore._record_batch
            return [await store_core.outcome_error_async(self._record_one, e, deadline)
                    for e in entries]
        return await self._drive(self._recorded(entries, counts), deadline)

    async def _run(self, call: Call[T], *, covers: Covers | None = None,
                   deadline: float | None = None) -> T:
        """Send one statement, as :meth:`PostgresLeaseStore._run`."""
        deadline = self._deadline(deadline)
        sent = await self._attempt(call, covers, deadline)
        if sent.__class__ is Missed:
            return await self._drive(self._resending(call, covers, deadline, sent), deadline)
        return call.parse(sent)  # type: ignore[arg-type]

    async def _attempt(self, call: Call[Any], covers: Covers | None, deadline: float) -> Sent:
        """As :meth:`PostgresLeaseStore._attempt`."""
        source = self._source
        wire = await source.enter(deadline)
        sent, name = self._counts.sent, call.statement.name  # as PostgresLeaseStore._attempt
        sent[name] = sent.get(name, 0) + 1
        try:
            conn = wire.conn
            try:
                async with AsyncWatch(conn, deadline, self._bound, self._clock) as watch:
                    rows = await wire.execute(call.statement.text, call.params)
            except psycopg.Error as exc:
                wire.notices.warnings.clear()
                if needs_discard(exc, wire):
                    await conn.close()
                return Missed(exc, wire, watch.fired)
            if wire.notices.warnings:
                replication.confirm(conn, [call] if covers is None else covers())
            return rows
        except BaseException:
            await discard_if_busy(wire.conn)
            raise
        finally:
            await source.leave(wire)

    async def _drive(self, flow: Flow[T], deadline: float) -> T:
        drive = Drive(flow)
        for step in drive:
            drive.send(await outcome_of_async(self._perform, step, deadline))
        return drive.result

    async def _perform(self, step: Step, deadline: float) -> object:
        if isinstance(step, Sleep):
            await asyncio.sleep(step.seconds)
            return None
        if isinstance(step, Resend):
            return await self._attempt(step.call, None, deadline)
        return await self._run(step, deadline=deadline)

    async def load(self, identity: LeaseIdentity) -> Snapshot:
        """As :meth:`PostgresLeaseStore.load`, shared with the loads of other tasks."""
        return await self._reads.call(identity)  # type: ignore[no-any-return]

    async def apply(self, write: Write, entry: AuditEntry) -> WriteOutcome:
        """As :meth:`PostgresLeaseStore.apply`."""
        return await self._run(statements.apply(write, entry, self._offset, schema=self._schema,
                                          audit_heartbeats=self._audit_heartbeats))

    async def renew_many(self, renewals: Sequence[tuple[Renew, AuditEntry]]
                         ) -> list[WriteOutcome]:
        """As :meth:`PostgresLeaseStore.renew_many`."""
        if not renewals:
            return []
        batch, each = self._batch_calls(renewals)
        return await self._run(batch, covers=each)

    async def acquire_many(self, inserts: Sequence[tuple[Insert, AuditEntry]]
                           ) -> list[WriteOutcome]:
        """As :meth:`PostgresLeaseStore.acquire_many`."""
        return await self._write_many(inserts)

    async def takeover_many(self, rotations: Sequence[tuple[Rotate, AuditEntry]]
                            ) -> list[WriteOutcome]:
        """As :meth:`PostgresLeaseStore.takeover_many`."""
        return await self._write_many(rotations)

    async def release_many(self, closes: Sequence[tuple[Close, AuditEntry]]
                           ) -> list[WriteOutcome]:
        """As :meth:`PostgresLeaseStore.release_many`."""
        return await self._write_many(closes)

    async def _write_many(self, items: Sequence[tuple[Write, AuditEntry]]
                          ) -> list[WriteOutcome]:
        if not items:
            return []
        batch, each = self._write_many_calls(items)
        return await self._run(batch, covers=each)

    async def load_many(self, identities: Sequence[LeaseIdentity]) -> list[Snapshot]:
        """As :meth:`PostgresLeaseStore.load_many`."""
        if not identities:
            return []
        return await self._run(statements.load_many(identities, self._offset,
                                                    schema=self._schema))

    async def record(self, entry: AuditEntry) -> None:
        """As :meth:`PostgresLeaseStore.record`, shared with the appends of other tasks."""
        await self._records.call(entry)

    async def record_many(self, entries: Sequence[AuditEntry]) -> None:
        """As :meth:`PostgresLeaseStore.record_many`."""
        checked = check_entries(entries)
        if checked:
            store_core.first_error(await self._record_batch(checked, self._deadline(None)))

    async def event_committed(self, event_id: UUID) -> bool:
        """As :meth:`PostgresLeaseStore.event_committed`."""
        deadline = self._deadline(None)
        async with self._source.checkout(deadline) as wire:
            lost = self._lost_here(event_id, wire)
        return await self._drive(self._settling(event_id, lost, deadline), deadline)

    async def leases(self, tenant_id: str | None = None) -> Sequence[LeaseRow]:
        """As :meth:`PostgresLeaseStore.leases`."""
        return await self._run(statements.leases(
            _check_optional_id("tenant_id", tenant_id), schema=self._schema))

    async def fleet_leases(self, fleet: str, tenant_id: str | None = None
                           ) -> tuple[datetime, Sequence[LeaseRow]]:
        """As :meth:`PostgresLeaseStore.fleet_leases`."""
        return await self._run(statements.fleet_leases(
            check_id("fleet", fleet), _check_optional_id("tenant_id", tenant_id),
            self._offset, schema=self._schema))

    async def audit(self, identity: LeaseIdentity | None = None, *, after_seq: int = 0,
                    limit: int = 1000) -> Sequence[AuditRecord]:
        """As :meth:`PostgresLeaseStore.audit`."""
        return await self._run(self._audit_call(identity, after_seq, limit))

    async def search_audit(self, *, tenant_id: str | None = None,
                           logical_agent_id: str | None = None, binding_id: str | None = None,
                           after_seq: int = 0, limit: int = 1000) -> Sequence[AuditRecord]:
        """As :meth:`PostgresLeaseStore.search_audit`."""
        return await self._run(self._search_call(tenant_id, logical_agent_id, binding_id,
                                                 after_seq, limit))

    async def now(self) -> datetime:
        """As :meth:`PostgresLeaseStore.now`."""
        return await self._run(statements.now(self._offset, schema=self._schema))

    async def aclose(self) -> None:
        """Close the store's connection (a pool it was given stays open)."""
        await self._source.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.aclose()
