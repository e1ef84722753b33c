"""The PostgreSQL lease stores: thin senders of the calls built in :mod:`statements`.

:class:`PostgresLeaseStore` implements :class:`mos_lease.ports.LeaseStore` and
:class:`AsyncPostgresLeaseStore` implements :class:`mos_lease.ports.AsyncLeaseStore`; both
also offer the :class:`mos_lease.ports.LeaseInspector` views. Everything they share (which
statement, which parameters, how rows map back, what a failure means) lives in
:class:`_StoreCore`, :mod:`mos_lease_pg.statements` and :mod:`mos_lease_pg.translate`; the
classes below differ only in ``await``. Every statement goes out through the connection's
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
from collections.abc import Callable, Generator, Sequence
from datetime import datetime, timedelta
from types import TracebackType
from typing import Any, ClassVar, Self, TypeVar
from uuid import UUID

import psycopg
import psycopg_pool

from mos_lease.clock import MonotonicClock, default_clock
from mos_lease.errors import (
    ConfigurationError,
    StoreUnavailable,
)
from mos_lease.flowdrive import Drive, outcome_of, outcome_of_async
from mos_lease.identity import LeaseIdentity, check_count, check_id, check_identity
from mos_lease.machine import Renew, Write
from mos_lease.operation import time_left
from mos_lease.ports import MAX_AUDIT_PAGE
from mos_lease.records import AuditEntry, AuditRecord, LeaseRow, Snapshot, WriteOutcome
from mos_lease_pg import reconcile, replication, statements
from mos_lease_pg.attempts import Covers, Missed, Resend, Sent, needs_discard, resending
from mos_lease_pg.coalesce import TaskReads, ThreadReads
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
from mos_lease_pg.reconcile import IN_DOUBT, UNAUDITED, Lost
from mos_lease_pg.statements import Call
from mos_lease_pg.wire import AnyWire

T = TypeVar("T")
D = TypeVar("D")
P = TypeVar("P")
# What a store flow (record, event_committed, a failed call's resend) yields: a statement
# to send within the operation's deadline, one more attempt of a failed call, or seconds to
# wait before looking again. Each store's ``_drive`` only performs them.
Step = Call[Any] | Resend | float
Flow = Generator[Step, Any, T]

def _check_optional_id(field: str, value: object) -> str | None:
    return None if value is None else check_id(field, value)


class _StoreCore:
    """What both stores share: the time offset, the calls, the rules of their flows, and
    in-doubt bookkeeping. Each store below only performs what these decide: one attempt of
    a statement (:mod:`mos_lease_pg.attempts` rules on a failed one), a flow's steps."""

    db_system: ClassVar[str] = "postgresql"  # for telemetry (mos_lease.events)
    # Every call's bound counts from mos_lease.operation.SHARED_START when it is set.
    shares_bound: ClassVar[bool] = True

    settings: ConnectionSettings  # set by each store; its ``schema`` is in every call
    _clock: MonotonicClock  # the only clock the store reads (deadlines, polls)
    _bound: float  # settings.call_bound(), computed once: the settings are frozen

    def _setup(self, settings: ConnectionSettings, clock: MonotonicClock) -> None:
        self.settings = settings
        self._clock = clock
        self._bound = settings.call_bound()

    @property
    def _schema(self) -> str:
        return self.settings.schema

    # Added to the database clock in every statement. Always zero here: only a test double
    # (tests/pg_clock.py) moves it, to reach expiry without waiting.
    _offset: timedelta = timedelta(0)

    @property
    def _audit_heartbeats(self) -> bool:
        return self.settings.audit_heartbeats

    def _deadline(self, deadline: float | None) -> float:
        # From the call, or from the start of the validation it serves (operation.py, which
        # says how much of the bound is left: read on its clock, added to the store's).
        return self._clock() + time_left(self._bound) if deadline is None else deadline

    def _resending(self, call: Call[T], covers: Covers | None, deadline: float,
                   missed: Missed) -> Flow[T]:
        """What follows a failed first attempt (:func:`attempts.resending`)."""
        return resending(call, covers, deadline, self._bound, self._clock, missed)

    def _lost_here(self, event_id: UUID, wire: AnyWire) -> Lost | None:
        """The backend to end before ``event_id`` is looked for, if this process knows it
        and it ran on the server ``wire`` talks to."""
        lost = IN_DOUBT.get(event_id)
        return lost if lost is not None and lost.server == wire.server else None

    def _batch_calls(self, renewals: Sequence[tuple[Renew, AuditEntry]]
                     ) -> tuple[Call[list[WriteOutcome]], Callable[[], list[Call[Any]]]]:
        """The one statement of a batch of heartbeats, and (for a failure) the writes it
        stands for: if it fails, each of them is in doubt on its own."""
        batch = statements.renew_many(renewals, self._offset, schema=self._schema,
                                      audit_heartbeats=self._audit_heartbeats)
        return batch, lambda: [statements.apply(write, entry, self._offset, schema=self._schema,
                                                audit_heartbeats=self._audit_heartbeats)
                               for write, entry in renewals]

    def _recording(self, entry: AuditEntry) -> Flow[None]:
        """``record``: append the audit record; if its event id is taken (its own first
        attempt, whose reply was lost, or another attempt), make sure the row is this one."""
        insert, matches = self._record_calls(entry)
        if (yield insert):
            return
        try:
            same = yield matches
        except StoreUnavailable as down:
            raise reconcile.unmatched_record(entry, down) from down
        if not same:
            raise reconcile.conflicting_record(entry)

    def _settling(self, event_id: UUID, lost: Lost | None, deadline: float) -> Flow[bool]:
        """``event_committed``: end the session that may still commit the write (``lost``,
        if this process knows it: see :meth:`_lost_here`), then look the event up."""
        yield from self._ending(lost, deadline)
        if event_id in UNAUDITED:
            # A lost heartbeat that wrote no audit row (its backend is ended by now): the
            # log cannot tell whether it committed.
            IN_DOUBT.forget(event_id)
            raise reconcile.unaudited_outcome(event_id)
        committed: bool = yield statements.event_committed(event_id, schema=self._schema)
        if committed and self.settings.require_synchronous_replication:
            # Found is not yet durable: only a write on the synchronous standby survives a
            # failover (replication.py); the barrier raises if that cannot be confirmed.
            yield replication.durability_barrier()
        IN_DOUBT.forget(event_id)  # settled for good: its backend is gone
        return committed

    def _ending(self, lost: Lost | None, deadline: float) -> Flow[None]:
        """Make sure the write in doubt can no longer commit (reconcile.py): end its backend
        and wait until it is gone, or, where none is known, wait until every transaction of
        this role that was running when the wait began has finished."""
        if lost is not None:
            yield reconcile.terminate(lost.pid, schema=self._schema)
            while (yield reconcile.backend_alive(lost.pid, schema=self._schema)):
                self._poll(f"backend {lost.pid}", deadline)
                yield reconcile.POLL
            return
        since, running = yield reconcile.running_before(None, schema=self._schema)
        while running:
            self._poll(f"{running} transaction(s) of this role", deadline)
            yield reconcile.POLL
            since, running = yield reconcile.running_before(since, schema=self._schema)

    def _poll(self, what: str, deadline: float) -> None:
        """Raise if one more look would come too late for ``deadline``."""
        if self._clock() + reconcile.POLL >= deadline:
            raise reconcile.still_running(what, self._bound)

    def _record_calls(self, entry: AuditEntry) -> tuple[Call[int], Call[bool]]:
        call = reconcile.record(entry, self._offset, schema=self._schema)
        return call, reconcile.record_matches(call, schema=self._schema)

    def _audit_call(self, identity: object, after_seq: object,
                    limit: object) -> Call[list[AuditRecord]]:
        checked = None if identity is None else check_identity("identity", identity)
        return statements.audit(
            tenant_id=None if checked is None else checked.tenant_id,
            logical_agent_id=None if checked is None else checked.logical_agent_id,
            binding_id=None if checked is None else checked.binding_id,
            after_seq=check_count("after_seq", after_seq, 0, 2**63 - 1),
            limit=check_count("limit", limit, 1, MAX_AUDIT_PAGE), schema=self._schema)

    def _search_call(self, tenant_id: object, logical_agent_id: object, binding_id: object,
                     after_seq: object, limit: object) -> Call[list[AuditRecord]]:
        return statements.audit(
            tenant_id=_check_optional_id("tenant_id", tenant_id),
            logical_agent_id=_check_optional_id("logical_agent_id", logical_agent_id),
            binding_id=_check_optional_id("binding_id", binding_id),
            after_seq=check_count("after_seq", after_seq, 0, 2**63 - 1),
            limit=check_count("limit", limit, 1, MAX_AUDIT_PAGE), schema=self._schema)


def _source_of(conninfo: str | None, pool: object, settings: ConnectionSettings | None,
               clock: MonotonicClock,
               dedicated: Callable[[str, ConnectionSettings, MonotonicClock], D],
               pooled: Callable[[Any, ConnectionSettings, MonotonicClock], P]
               ) -> tuple[ConnectionSettings, D | P]:
    """A store's settings and connection source: a dedicated connection for ``conninfo``,
    else the caller's ``pool``."""
    if (conninfo is None) == (pool is None):
        raise ConfigurationError("pass exactly one of conninfo or pool")
    if conninfo is not None and not isinstance(conninfo, str):
        raise ConfigurationError("conninfo must be a libpq connection string or URL")
    settings = settings if settings is not None else ConnectionSettings()
    return settings, (dedicated(conninfo, settings, clock) if conninfo is not None
                      else pooled(pool, settings, clock))


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
        self._reads = ThreadReads(self)  # loads that overlap share a round trip

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
        if isinstance(step, float):
            time.sleep(step)
            return None
        if isinstance(step, Resend):
            return self._attempt(step.call, None, deadline)
        return self._run(step, deadline=deadline)

    # -- LeaseStore ---------------------------------------------------------------------

    def load(self, identity: LeaseIdentity) -> Snapshot:
        """:meth:`mos_lease.LeaseStore.load`: one prepared read of the row with the database
        clock, shared with the loads of other threads that overlap it
        (:mod:`mos_lease_pg.coalesce`)."""
        return self._reads.load(identity)

    def apply(self, write: Write, entry: AuditEntry) -> WriteOutcome:
        """:meth:`mos_lease.LeaseStore.apply`: one statement that locks the row, then reads
        the database clock, writes and appends the audit row."""
        return self._run(statements.apply(write, entry, self._offset, schema=self._schema,
                                          audit_heartbeats=self._audit_heartbeats))

    def renew_many(self, renewals: Sequence[tuple[Renew, AuditEntry]]) -> list[WriteOutcome]:
        """:meth:`mos_lease.LeaseStore.renew_many`: the whole batch in one statement, rows
        locked in identity order."""
        if not renewals:
            return []
        batch, each = self._batch_calls(renewals)
        return self._run(batch, covers=each)

    def record(self, entry: AuditEntry) -> None:
        """:meth:`mos_lease.LeaseStore.record`: append one audit entry, at most once per
        event id."""
        self._drive(self._recording(entry), self._deadline(None))

    def event_committed(self, event_id: UUID) -> bool:
        """:meth:`mos_lease.LeaseStore.event_committed`, answered only once the session that
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
        self._reads = TaskReads(self)  # loads that overlap share a round trip

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
        if isinstance(step, float):
            await asyncio.sleep(step)
            return None
        if isinstance(step, Resend):
            return await self._attempt(step.call, None, deadline)
        return await self._run(step, deadline=deadline)

    async def load(self, identity: LeaseIdentity) -> Snapshot:
        """As :meth:`PostgresLeaseStore.load`, shared with the loads of other tasks."""
        return await self._reads.load(identity)

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

    async def record(self, entry: AuditEntry) -> None:
        """As :meth:`PostgresLeaseStore.record`."""
        await self._drive(self._recording(entry), self._deadline(None))

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
