"""What the synchronous and the asyncio PostgreSQL store share, apart from their call path
(which stays in :mod:`mos_lease_pg.store`, where the two differ only in ``await``):
:class:`_StoreCore` holds the settings and the store's clock, builds the calls of the batch
and of the audit views, and writes the flows of ``record`` and ``event_committed`` (settling
a write in doubt) once, as generators of :data:`Step` that each store only performs;
:func:`_source_of` picks a store's connection source.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Generator, Sequence
from datetime import timedelta
from typing import Any, ClassVar, TypeVar
from uuid import UUID

import attrs

from mos_lease.clock import MonotonicClock
from mos_lease.errors import (
    CommitOutcomeUnknown,
    ConfigurationError,
    InternalInconsistency,
    MosLeaseError,
    StoreUnavailable,
)
from mos_lease.identity import check_count, check_id, check_identity
from mos_lease.machine import Renew, Write
from mos_lease.operation import time_left
from mos_lease.ports import MAX_AUDIT_PAGE
from mos_lease.records import AuditEntry, AuditRecord, Snapshot, WriteOutcome
from mos_lease.sleep import Sleep
from mos_lease.stats import StoreCounts, StoreStats
from mos_lease_pg import batch_statements, reconcile, replication, statements
from mos_lease_pg.attempts import Covers, Missed, Resend, resending
from mos_lease_pg.coalesce import Ticket, overdue
from mos_lease_pg.connection import ConnectionSettings
from mos_lease_pg.reconcile import IN_DOUBT, UNAUDITED, Lost
from mos_lease_pg.statements import Call
from mos_lease_pg.wire import AnyWire

T = TypeVar("T")
D = TypeVar("D")
P = TypeVar("P")
# What a store flow (record, event_committed, a failed call's resend) yields: a statement
# to send within the operation's deadline, one more attempt of a failed call, or the pause
# before looking again (the library's one pause step). Each store's ``_drive`` only performs
# them.
Step = Call[Any] | Resend | Sleep
Flow = Generator[Step, Any, T]


def _check_optional_id(field: str, value: object) -> str | None:
    return None if value is None else check_id(field, value)


class _StoreCore:
    """What both stores share: the time offset, the calls, the rules of their flows, and
    in-doubt bookkeeping. Each store (:mod:`mos_lease_pg.store`) only performs what these
    decide: one attempt of a statement (:mod:`mos_lease_pg.attempts` rules on a failed
    one), a flow's steps."""

    db_system: ClassVar[str] = "postgresql"  # for telemetry (mos_lease.events)
    # Every call's bound counts from mos_lease.operation.SHARED_START when it is set.
    shares_bound: ClassVar[bool] = True
    # A failover hands the tables to a standby with its own clock: keepers, hold() and the
    # supervisor keep a clock-step margin (mos_lease.keeper.default_clock_step).
    clock_can_step: ClassVar[bool] = True

    settings: ConnectionSettings  # set by each store; its ``schema`` is in every call
    _clock: MonotonicClock  # the only clock the store reads (deadlines, polls)
    _bound: float  # settings.call_bound(), computed once: the settings are frozen

    _counts: StoreCounts  # statements sent, writes in doubt, reconciles (mos_lease.stats)
    _reads: Any  # the coalesced loads and appends (coalesce.ThreadReads or TaskReads)
    _records: Any

    def _setup(self, settings: ConnectionSettings, clock: MonotonicClock) -> None:
        self.settings = settings
        self._clock = clock
        self._bound = settings.call_bound()
        self._counts = StoreCounts()

    def stats(self) -> StoreStats:
        """What this store sent since it was created (:class:`mos_lease.stats.StoreStats`)."""
        counts, loads, records = self._counts, self._reads._reads, self._records._reads
        return StoreStats(
            # Counted under the statement's file name; shown without the ``.sql``.
            {name.removesuffix(".sql"): n for name, n in list(counts.sent.items())},
            load_batches=loads.batches, loads_batched=loads.items,
            record_batches=records.batches, records_batched=records.items,
            commit_outcome_unknown=counts.in_doubt, reconciles=counts.reconciles)

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
        try:
            return (yield from resending(call, covers, deadline, self._bound, self._clock,
                                         missed))
        except CommitOutcomeUnknown:
            self._counts.in_doubt += 1  # off the hot path: only a lost statement gets here
            raise

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

    def _write_many_calls(self, items: Sequence[tuple[Write, AuditEntry]]
                          ) -> tuple[Call[list[WriteOutcome]], Callable[[], list[Call[Any]]]]:
        """The one statement of a batch of acquires, takeovers or releases, and (for a
        failure) the writes it stands for, each of them in doubt on its own if it fails."""
        batch = batch_statements.write_many(items, self._offset, schema=self._schema)
        return batch, lambda: [statements.apply(write, entry, self._offset, schema=self._schema)
                               for write, entry in items]

    def _load_call(self, identity: Any) -> Call[Snapshot]:
        return statements.load(identity, self._offset, schema=self._schema)

    def _load_many_call(self, batch: Sequence[Ticket]) -> Call[list[Snapshot]]:
        return statements.load_many([t.key for t in batch], self._offset, schema=self._schema)

    def _loaded(self, batch: Sequence[Ticket], snapshots: list[Snapshot],
                sent: float) -> list[Snapshot]:
        """A batch's snapshots, each saying how long its load waited before ``sent`` (the
        store's clock when the batch went out)."""
        return [attrs.evolve(s, queued=max(0.0, sent - t.since))
                for t, s in zip(batch, snapshots, strict=True)]

    def _record_many_calls(self, entries: Sequence[AuditEntry]
                           ) -> tuple[Call[list[int]], Covers]:
        """The one statement of a batch of audit appends, and (for a failure) the appends it
        stands for: if it is lost, each of them is in doubt on its own."""
        call = statements.record_many(entries, self._offset, schema=self._schema)
        return call, lambda: [self._record_calls(e)[0] for e in entries]

    def _recorded(self, entries: Sequence[AuditEntry], counts: Sequence[int]
                  ) -> Flow[list[MosLeaseError | None]]:
        """After a batch of appends: each entry that found its event id taken is checked as
        ``record`` checks it; the result is each entry's own error, or ``None``."""
        out: list[MosLeaseError | None] = []
        for entry, inserted in zip(entries, counts, strict=True):
            error = None
            if not inserted:
                try:
                    yield from self._matching(entry)
                except MosLeaseError as failed:
                    error = failed
            out.append(error)
        return out

    def _recording(self, entry: AuditEntry) -> Flow[None]:
        """``record``: append the audit record; if its event id is taken (its own first
        attempt, whose reply was lost, or another attempt), make sure the row is this one."""
        insert, _ = self._record_calls(entry)
        if (yield insert):
            return
        yield from self._matching(entry)

    def _matching(self, entry: AuditEntry) -> Flow[None]:
        """An append found ``entry``'s event id taken: raise unless the row is this record."""
        _, matches = self._record_calls(entry)
        try:
            same = yield matches
        except StoreUnavailable as down:
            raise reconcile.unmatched_record(entry, down) from down
        if not same:
            raise reconcile.conflicting_record(entry)

    def _settling(self, event_id: UUID, lost: Lost | None, deadline: float) -> Flow[bool]:
        """``event_committed``: end the session that may still commit the write (``lost``,
        if this process knows it: see :meth:`_lost_here`), then look the event up."""
        self._counts.reconciles += 1
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
                yield Sleep(reconcile.POLL)
            return
        since, running = yield reconcile.running_before(None, schema=self._schema)
        while running:
            self._poll(f"{running} transaction(s) of this role", deadline)
            yield Sleep(reconcile.POLL)
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


refused_whole: tuple[type[MosLeaseError], ...] = (ConfigurationError, InternalInconsistency)
"""What a batch of appends raises when the database refused its statement as a whole
(one entry it will not take, such as an event id no partition accepts): nothing of it was
written."""


def outcome_error(record: Callable[[AuditEntry, float], None], entry: AuditEntry,
                  deadline: float) -> MosLeaseError | None:
    """``record(entry, deadline)``'s own error, or ``None``."""
    try:
        record(entry, deadline)
    except MosLeaseError as error:
        return error
    return None


async def outcome_error_async(record: Callable[[AuditEntry, float], Awaitable[None]],
                              entry: AuditEntry, deadline: float) -> MosLeaseError | None:
    """As :func:`outcome_error`, awaited."""
    try:
        await record(entry, deadline)
    except MosLeaseError as error:
        return error
    return None


def first_error(results: Sequence[MosLeaseError | None]) -> None:
    """Raise the first entry's error of a batch of appends, if any (the others stand)."""
    for error in results:
        if error is not None:
            raise error


def records_in_doubt(entries: Sequence[AuditEntry],
                     lost: CommitOutcomeUnknown) -> list[MosLeaseError | None]:
    """The batch carrying ``entries`` was lost with its outcome unknown: so is each
    append's, under its own event id (the one a caller reconciles)."""
    return [CommitOutcomeUnknown(e.event_id, f"appended in a batch of {len(entries)} audit "
                                 f"records whose outcome is unknown ({lost})")
            for e in entries]


def late_record(entry: Any, bound: float, sent: bool) -> BaseException:
    """An append whose caller's bound passed while it waited: nothing was written if it was
    still queued; if it went out, it may have committed."""
    if not sent:
        return overdue("audit record", bound)
    return CommitOutcomeUnknown(entry.event_id, f"no reply within the {bound:g} s call bound "
                                "to the batch of audit records that carried it")


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
